"""This process's place in the job, resolved once by `st.init` and handed to strategies.

The mesh is always resolved: the one given with `st.init(mesh=...)`, else the
strategy's implicit one, every rank along its own dimension ({"dp": N} for data
parallel strategies, {"tp": N} for tensor parallel alone, {"pp": N} for pipeline
parallel alone). So a strategy reads its coordinates from one place whether or
not the user gave a mesh, and `mesh_given` tells the two apart where the user's
intent matters (a mesh that lacks the strategy's dimension is a mistake).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from scaletrain.env.base import ClusterEnv
from scaletrain.errors import ConfigError, say, spell

__all__ = ["MESH_DIMS", "Topology", "parse_mesh"]

MESH_DIMS = ("pp", "dp", "tp")
"""Mesh dimensions, outermost first: tensor-parallel peers are neighbours (same node,
fastest links), pipeline stages furthest apart (they exchange the least)."""


def parse_mesh(mesh: Mapping[str, int] | str | None, world_size: int) -> dict[str, int] | None:
    """{"dp": 2, "tp": 2} or "dp=2,tp=2" -> an ordered, checked mesh shape (or None)."""
    if mesh is None:
        return None
    items: dict[str, int] = {}
    if isinstance(mesh, str):
        for part in filter(None, (p.strip() for p in mesh.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value.strip().isdigit():
                raise ConfigError(
                    f"{spell('mesh', mesh)}: {part!r} is not NAME=SIZE. Expected e.g. "
                    f"{spell('mesh', 'dp=2,tp=2')}.",
                    field="mesh",
                )
            items[key.strip()] = int(value)
    else:
        items = {str(k): int(v) for k, v in mesh.items()}
    unknown = [k for k in items if k not in MESH_DIMS]
    if unknown:
        raise ConfigError(
            f"{spell('mesh', mesh)} names dimension(s) {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(MESH_DIMS)} (data, tensor and pipeline parallel).",
            field="mesh",
        )
    bad = {k: v for k, v in items.items() if v < 1}
    if bad:
        raise ConfigError(f"{spell('mesh', mesh)}: sizes must be >= 1, got {bad}.", field="mesh")
    product = math.prod(items.values())
    if product != world_size:
        start = say(api=f"start {product} processes", cli=f"pass {spell('nproc', product)}")
        raise ConfigError(
            f"{spell('mesh', mesh)} holds {product} ranks ("
            + " x ".join(f"{k}={v}" for k, v in items.items())
            + f"), but the job has world size {world_size}. The product of the mesh sizes "
            f"must equal the number of processes. Fix: change the mesh or {start}.",
            field="mesh",
        )
    return {k: items[k] for k in MESH_DIMS if k in items}


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where this process sits: ranks, device, backend and its mesh coordinates.

    Build it with `Topology.resolve` (what `st.init` does); the fields can also be
    given directly (tests, tools), the data-parallel coordinate is derived.
    """

    rank: int = 0
    """Global rank, 0 <= rank < world_size."""
    local_rank: int = 0
    """Rank among the processes on this node."""
    world_size: int = 1
    """Processes in the job."""
    local_world_size: int = 1
    """Processes on this node."""
    node_rank: int = 0
    """Index of this node."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The device this process computes on (the strategy's home device)."""
    backend: str = "gloo"
    """The process group's backend ("gloo", "nccl")."""
    mesh_shape: dict[str, int] = field(default_factory=dict)
    """Dimension -> size, outermost first; the sizes multiply to world_size. Empty:
    every rank along "dp". Read it, never change it."""
    mesh_given: bool = False
    """True when the mesh came from st.init(mesh=...), False when it is the implicit one."""
    dp_rank: int = field(init=False)
    """Index among the data-parallel replicas: which shard of the data this rank reads."""
    dp_size: int = field(init=False)
    """Data-parallel replicas: the global batch is batch_size x dp_size."""

    def __post_init__(self) -> None:
        if not self.mesh_shape:
            object.__setattr__(self, "mesh_shape", {"dp": self.world_size})
        if math.prod(self.mesh_shape.values()) != self.world_size:
            raise ConfigError(
                f"Topology: mesh {self.mesh_shape} does not hold world_size={self.world_size} "
                "ranks; the sizes must multiply to the world size."
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"Topology: rank={self.rank} is outside world_size={self.world_size}."
            )
        object.__setattr__(self, "dp_rank", self.coordinate("dp"))
        object.__setattr__(self, "dp_size", self.size("dp"))

    @classmethod
    def resolve(
        cls,
        env: ClusterEnv,
        *,
        device: torch.device,
        backend: str,
        mesh: Mapping[str, int] | None,
        implicit_dim: str,
    ) -> Topology:
        """The topology of `env`'s process: `mesh` (from parse_mesh) when given, else
        every rank along `implicit_dim` (the strategy's own dimension)."""
        given = bool(mesh)
        shape = dict(mesh) if mesh else {implicit_dim: env.world_size}
        return cls(
            rank=env.rank,
            local_rank=env.local_rank,
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            node_rank=env.node_rank,
            device=device,
            backend=backend,
            mesh_shape=shape,
            mesh_given=given,
        )

    def size(self, dim: str) -> int:
        """Ranks along `dim` (1 where the mesh has no such dimension)."""
        return self.mesh_shape.get(dim, 1)

    def coordinate(self, dim: str) -> int:
        """This rank's index along `dim` (0 where the mesh has no such dimension).

        Row-major over the shape, outermost first, as init_device_mesh lays ranks out.
        """
        if dim not in self.mesh_shape:
            return 0
        dims = list(self.mesh_shape)
        inner = math.prod(self.mesh_shape[d] for d in dims[dims.index(dim) + 1 :])
        return (self.rank // inner) % self.mesh_shape[dim]
