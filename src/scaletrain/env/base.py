"""What every cluster environment reports, and the base class each kind implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["ClusterEnv", "ClusterEnvironment", "Rendezvous"]

DEFAULT_MASTER_PORT = 29500


@dataclass(kw_only=True, frozen=True, slots=True)
class Rendezvous:
    """An elastic rendezvous the platform asks for (a Kubeflow elasticPolicy): the node
    ranks are not known in advance but decided by torch's rendezvous when nodes join."""

    endpoint: str
    """HOST:PORT of the rendezvous store, the same for every node."""
    nnodes: str
    """Node count "N" or range "MIN:MAX", as torchrun's --nnodes."""
    backend: str = "c10d"
    """torch's rendezvous backend name."""
    run_id: str | None = None
    """The rendezvous id shared by the nodes; None: the launcher's default."""
    conf: str | None = None
    """Extra rendezvous settings "key=value,key=value", as torchrun's --rdzv-conf."""
    max_restarts: int | None = None
    """Worker-group restarts the platform asks for; None: the launcher's default."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ClusterEnv:
    """Where this process runs: its place in the job and how to reach rank 0."""

    kind: str
    """Name of the environment that was detected ("torchelastic", "slurm", ...)."""
    rank: int
    """Global rank of this process, 0 <= rank < world_size."""
    local_rank: int
    """Rank among the processes on this node; picks the GPU."""
    world_size: int
    """Number of processes in the whole job."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node, 0 <= node_rank < num_nodes."""
    num_nodes: int
    """Number of nodes in the job."""
    master_addr: str
    """Host of rank 0, where the rendezvous store lives."""
    master_port: int
    """Port of the rendezvous store on master_addr."""
    per_node: bool = False
    """True where the scheduler starts one process per node (SageMaker, Kubeflow):
    the launcher then starts the per-device processes itself."""
    procs_per_node_hint: int | None = None
    """Processes per node the scheduler suggests (SageMaker's SM_NUM_GPUS), if any."""
    job_id: str | None = None
    """The scheduler's id for the whole job, the same in every process and kept across
    requeues (SLURM_JOB_ID, Open MPI's job id, SageMaker's job name); None if none."""
    hosts: tuple[str, ...] = ()
    """The job's hosts in node order where the scheduler lists them (Slurm's node
    list, SM_HOSTS); empty where it does not."""
    rendezvous: Rendezvous | None = None
    """Set where the platform asks for an elastic rendezvous; rank, node_rank and
    num_nodes then describe this process alone until the rendezvous places it."""
    reasons: tuple[str, ...] = field(default_factory=tuple)
    """Human-readable evidence: which variables were read and what they said."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


class ClusterEnvironment(ABC):
    """One kind of cluster. Subclasses implement `_detect` and `_read`.

    `detect` answers from the variables alone whether this kind applies;
    `read` parses them into a ClusterEnv or raises EnvironmentDetectionError
    naming the variable that is wrong and what it should be.
    """

    name: ClassVar[str]
    """User-facing name of the kind, e.g. "slurm"."""
    priority: ClassVar[int]
    """Lower is tried first: a launcher inside a scheduler must win (torchrun under srun)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self._detect(environ)

    def read(self, environ: Mapping[str, str]) -> ClusterEnv:
        return self._read(environ)

    @abstractmethod
    def _detect(self, environ: Mapping[str, str]) -> bool: ...

    @abstractmethod
    def _read(self, environ: Mapping[str, str]) -> ClusterEnv: ...
