"""DeviceMeshes for a Topology, made once per process group.

Creating a DeviceMesh creates process groups (a collective every rank joins), so
each mesh is made once and reused; the cache belongs to the default process group
and is dropped when that group is replaced (shutdown, then init again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from scaletrain.dist.topology import Topology
from scaletrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "full_mesh"]

# (the default process group the meshes belong to, (device type, sizes, names) -> mesh)
_CACHE: tuple[Any, dict[tuple[str, tuple[int, ...], tuple[str, ...]], DeviceMesh]] = (None, {})


def _mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    global _CACHE
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _CACHE[0] is not world:
        _CACHE = (world, {})
    key = (device_type, sizes, names)
    meshes = _CACHE[1]
    if key not in meshes:
        from torch.distributed.device_mesh import init_device_mesh

        meshes[key] = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return meshes[key]


def full_mesh(topology: Topology) -> DeviceMesh | None:
    """The N-D mesh asked for with st.init(mesh=...); None without one, or in one process."""
    if not topology.mesh_given or topology.world_size == 1:
        return None
    shape = topology.mesh_shape
    return _mesh(topology.device.type, tuple(shape.values()), tuple(shape))


def device_mesh(topology: Topology, dim: str) -> DeviceMesh:
    """The 1-D mesh a strategy works on: dimension `dim` of st.init(mesh=...), or
    every rank when no mesh was given (plain FSDP / tensor / pipeline parallel)."""
    mesh = full_mesh(topology)
    if mesh is not None:
        if dim not in topology.mesh_shape:
            raise ConfigError(
                f"the strategy needs a {dim!r} dimension, but the mesh is "
                f"{topology.mesh_shape}. Add it, e.g. mesh={{'dp': 2, '{dim}': 2}}."
            )
        return mesh[dim]
    return _mesh(topology.device.type, (topology.world_size,), (dim,))
