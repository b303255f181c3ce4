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
import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.dist.agreement import all_gather_objects
from scaletrain.errors import CheckpointError, ConfigError, say

__all__ = ["PROBES", "Disks", "check_splittable", "find_disks", "sharded_refusal"]

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


def sharded_refusal(folder: Path, disks: Disks) -> str:
    """Why a sharded checkpoint cannot go onto a disk per node, and what to do, in the
    words of the interface in use."""
    fix = say(
        api="put the CheckpointManager's folder on a filesystem every node shares (NFS, "
        'Lustre, an S3/GCS mount), or use a strategy whose checkpoints are full ("ddp")',
        cli="give --out a directory on a filesystem every node shares (NFS, Lustre, an "
        "S3/GCS mount), or train with --strategy ddp",
    )
    return (
        f"checkpoints in {folder}: the ranks do not share this directory (one disk per "
        f"node: {disks.describe()}), and this model is split across ranks, so its "
        "checkpoints are sharded (torch.distributed.checkpoint writes each tensor once, "
        "from one rank): no node would hold what it needs to resume. Nothing was written. "
        f"Fix: {fix}."
    )


def check_splittable(disks: Disks, folder: Path, modules: Iterable[Any], world_size: int) -> None:
    """Before training (at resume): refuse, as bad input, a model split across ranks (DTensor parameters,
    or ranks holding different parameters: pipeline stages) when the ranks do not share
    `folder`. Call on every rank; one small gather, only without a shared filesystem."""
    if disks.shared:
        return
    from torch.distributed.tensor import DTensor

    names, split = hashlib.sha256(), False
    for module in modules:
        for name, param in module.named_parameters():
            names.update(name.encode() + b"\0")
            split = split or isinstance(param, DTensor)
    views = all_gather_objects((split, names.hexdigest()), world_size)
    if any(s for s, _ in views) or len({n for _, n in views}) > 1:
        raise ConfigError(sharded_refusal(folder, disks), field="out")
