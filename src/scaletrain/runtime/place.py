"""Where this process is in the job: its rank, device and data-parallel replica, and its
coordinates on the device mesh, read off its Topology. The base class of the Runtime,
whose API reference lists these with its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scaletrain.dist.mesh import device_mesh, full_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from scaletrain.dist.topology import Topology
    from scaletrain.env.base import ClusterEnv

__all__ = ["Place"]


class Place:
    """This process's place in the job, read off the Runtime's `topology` and `env`."""

    env: ClusterEnv
    topology: Topology

    # -- device meshes -------------------------------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int] | None:
        """The mesh given to st.init(mesh=...), ordered pp, dp, tp; None without one."""
        return dict(self.topology.mesh_shape) if self.topology.mesh_given else None

    @property
    def mesh(self) -> DeviceMesh | None:
        """The N-D DeviceMesh asked for with st.init(mesh=...), else None."""
        return full_mesh(self.topology)

    def device_mesh(self, dim: str) -> DeviceMesh:
        """The 1-D mesh a strategy works on: dimension `dim` of st.init(mesh=...), or
        every rank when no mesh was given (plain FSDP / tensor / pipeline parallel)."""
        return device_mesh(self.topology, dim)

    def mesh_coordinate(self, dim: str) -> int:
        """This rank's index along `dim` of the mesh (0 if the mesh has no such dimension).

        init_device_mesh lays ranks out row-major over the shape, outermost first.
        """
        return self.topology.coordinate(dim) if self.topology.mesh_given else 0

    def mesh_size(self, dim: str) -> int:
        """Ranks along `dim` of the mesh (1 if the mesh has no such dimension)."""
        return self.topology.size(dim) if self.topology.mesh_given else 1

    # -- where am I ------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job, 0 to world_size - 1."""
        return self.topology.rank

    @property
    def local_rank(self) -> int:
        """This process's rank among the processes of its node."""
        return self.topology.local_rank

    @property
    def world_size(self) -> int:
        """The processes in the job."""
        return self.topology.world_size

    @property
    def node_rank(self) -> int:
        """This process's node, 0 to the number of nodes - 1."""
        return self.topology.node_rank

    @property
    def backend(self) -> str:
        """The process group's backend: "nccl" on GPUs, "gloo" on CPUs."""
        return self.topology.backend

    @property
    def device(self) -> torch.device:
        """The device this process computes on: inputs go there."""
        return self.topology.device

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which shard of data it reads)."""
        return self.topology.dp_rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas: the global batch is batch_size x dp_size."""
        return self.topology.dp_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one that prints, logs and writes files."""
        return self.env.rank == 0
