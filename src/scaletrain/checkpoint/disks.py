"""Which ranks see the same run directory: one shared filesystem, or a disk per node.

A multi-node job without a shared filesystem is ordinary: SageMaker gives every host
its own /opt/ml/model, a Kubernetes pod its own volume, a Slurm node its own /tmp.
The same path then names a different directory on each node, and a checkpoint
written by rank 0 alone exists on node 0 only.

`find_disks` asks the filesystem: every rank drops a file named after a token rank
0 chose into the run directory, and lists which ranks' files it sees. Ranks that
see each other share a disk. With more than one disk, a full checkpoint (DDP and
the other strategies whose ranks hold whole tensors) is written once per disk:
each disk's first rank writes the replicated files and every rank's sampler
position, each rank its own RNG, and each disk gets a manifest of what is on it.
A checkpoint is complete only when every disk's part is: the manifests carry the
same time, and a resume uses the newest checkpoint that every disk holds whole.
A sharded checkpoint (torch.distributed.checkpoint writes each tensor once, from
one rank) cannot be split that way and needs a shared filesystem; that is said at
the first save, before anything is written.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from pathlib import Path

from scaletrain.dist.agreement import all_gather_objects
from scaletrain.errors import CheckpointError

__all__ = ["PROBES", "Disks", "find_disks"]

PROBES = ".scaletrain-disks"
"""The directory, inside the run directory, that holds the probe files for a moment."""


@dataclass(frozen=True, slots=True)
class Disks:
    """The ranks of each disk, in rank order, and this rank's place among them."""

    groups: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def shared(self) -> bool:
        """One filesystem for every rank: checkpoints as written by rank 0 alone."""
        return len(self.groups) == 1

    @property
    def mine(self) -> tuple[int, ...]:
        """The ranks on this rank's disk."""
        return next(g for g in self.groups if self.rank in g)

    @property
    def leader(self) -> bool:
        """Whether this rank writes its disk's shared files (the disk's first rank)."""
        return self.rank == self.mine[0]

    def describe(self) -> str:
        return "; ".join(
            f"ranks {g[0]}-{g[-1]}" if len(g) > 1 else f"rank {g[0]}" for g in self.groups
        )


def find_disks(folder: Path, rank: int, world_size: int) -> Disks:
    """Which ranks share `folder`'s filesystem. Call on every rank; a few small collectives."""
    if world_size == 1:
        return Disks(((0,),), 0)
    token = all_gather_objects(secrets.token_hex(8) if rank == 0 else None, world_size)[0]
    probes = Path(folder) / PROBES
    mine = probes / f"{token}-rank{rank}"
    error: str | None = None
    try:
        probes.mkdir(parents=True, exist_ok=True)
        mine.write_text("")
    except OSError as exc:
        error = f"rank {rank} cannot write into {folder}: {exc.strerror or exc}"
    errors = [e for e in all_gather_objects(error, world_size) if e]
    if errors:
        raise CheckpointError(f"{errors[0]}. Fix: give the run a directory every node can write.")
    seen = tuple(r for r in range(world_size) if (probes / f"{token}-rank{r}").exists())
    views = all_gather_objects(seen, world_size)
    with contextlib.suppress(OSError):
        mine.unlink()
    all_gather_objects(None, world_size)  # everyone has looked before the directory goes
    with contextlib.suppress(OSError):
        probes.rmdir()
    groups = tuple(sorted(set(views)))
    if any(r not in view for r, view in enumerate(views)) or sorted(
        r for g in groups for r in g
    ) != list(range(world_size)):
        raise CheckpointError(
            f"the ranks see {folder} inconsistently ({', '.join(map(str, views))}: which ranks "
            "each one sees): neither one shared filesystem nor one disk per node. Fix: put the "
            "run directory on a filesystem every node shares, or on each node's own disk."
        )
    return Disks(groups, rank)
