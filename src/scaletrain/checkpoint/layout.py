"""The files inside one checkpoint directory, and the helpers both save and load use.

full (no parameter is a DTensor and every rank holds the same keys):
  model.pt, optimizer.pt, scaler.pt, ...    rank 0, torch.save of state dicts
sharded (FSDP, tensor parallel, pipeline):
  __0_0.distcp, __1_0.distcp, .metadata     torch.distributed.checkpoint: model and
                                            optimizer tensors, every rank its shards
  optim-values.pt                           the optimizers' hyperparameters (or
                                            optim-values-rank{r}.pt when ranks hold
                                            different parameters: pipeline)
  buffers-rank{r}.pt                        each rank's own plain buffers
both:
  rng-rank{r}.pt        each rank's RNG (python, numpy, torch CPU, its CUDA device)
  loaders-rank{r}.json  each rank's sampler epoch/position (when loaders are saved)
  values.json           plain values (step, epoch, the run's config...)
  manifest.json         sha256 of every file, world size, model fingerprints; LAST
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.checkpoint.manifest import MANIFEST, FileEntry, atomic_write_bytes, fsync_dir
from scaletrain.checkpoint.scope import CheckpointScope
from scaletrain.checkpoint.state import State, is_dtensor
from scaletrain.dist.replicas import first_replica_values
from scaletrain.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "OPTIM_VALUES",
    "VALUES",
    "buffers_file",
    "classname",
    "dcp",
    "digest",
    "failure",
    "loaders_file",
    "local_buffers",
    "optim_options",
    "optim_values_file",
    "prepare_dir",
    "rng_file",
    "split_optimizer",
    "views",
    "with_first_replica_buffers",
    "write_json",
]

VALUES = "values.json"
OPTIM_VALUES = "optim-values.pt"
_OUR_FILES = (".pt", ".json", ".distcp")
_DCP_METADATA = ".metadata"  # sharded.METADATA, without importing DCP


def optim_values_file(rank: int) -> str:
    return f"optim-values-rank{rank}.pt"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def buffers_file(rank: int) -> str:
    return f"buffers-rank{rank}.pt"


def loaders_file(rank: int) -> str:
    return f"loaders-rank{rank}.json"


def failure(message: str) -> CheckpointError:
    """The error the cross-rank agreement raises for a checkpoint step that failed."""
    return CheckpointError(message)


def classname(obj: Any) -> str:
    return type(obj).__name__


def user_class(module: Any) -> str:
    """The class the user wrote: FSDP's fully_shard makes each module it shards an
    instance of a class of its own ("FSDPMLP", of FSDPModule and MLP), which a message
    would otherwise name."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next((c for c in cls.__mro__ if not issubclass(c, FSDPModule)), cls)
    return cls.__name__


def local_buffers(scope: CheckpointScope, state: State) -> dict[str, dict[str, torch.Tensor]]:
    """Each model's plain (non-DTensor) buffers as THIS rank holds them.

    Under FSDP, tensor or pipeline parallel nothing keeps buffers (BatchNorm running
    statistics) equal across ranks, and DCP saves a plain tensor once, from one rank.
    Resuming bitwise needs every rank's own copy back.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, model in state.models.items():
        out[name] = {
            key: buf.detach().cpu().clone()
            for key, buf in scope.unwrap(model).named_buffers()
            if type(buf).__name__ != "DTensor"
        }
    return out


def with_first_replica_buffers(
    scope: CheckpointScope, model: torch.nn.Module, sd: dict[str, Any]
) -> dict[str, Any]:
    """`sd` (the model's state dict, references) with its plain buffers replaced by
    data-parallel replica 0's: a checkpoint's model is the one DDP would hold
    (scaletrain.dist.replicas), whichever rank DCP takes a replicated tensor from.
    Each rank's own buffers go into its buffers file (local_buffers) for resuming.
    A collective of the data-parallel group."""
    if scope.topology.dp_size == 1:
        return sd
    live = {
        _storage(b) for _, b in model.named_buffers(remove_duplicate=False) if not is_dtensor(b)
    }
    names = sorted(
        k
        for k, v in sd.items()
        if isinstance(v, torch.Tensor) and not is_dtensor(v) and _storage(v) in live
    )
    first = first_replica_values([sd[k] for k in names], scope.topology)
    return {**sd, **dict(zip(names, first, strict=True))}


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def views(scope: CheckpointScope, state: dict[str, Any]) -> dict[str, Any]:
    """Models as the strategy wants them saved (a pipeline rank: only its stages)."""
    return {
        name: scope.checkpoint_module(obj) if isinstance(obj, torch.nn.Module) else obj
        for name, obj in state.items()
    }


def optim_options() -> StateDictOptions:
    # Optimizer state keyed "state.<param name>.<key>" / "param_groups.<param name>.<key>":
    # independent of parameter order and of how parameters are grouped per rank,
    # which is what lets DCP reshard it (pipeline stages hold disjoint groups).
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def dcp() -> Any:
    """scaletrain.checkpoint.sharded (torch.distributed.checkpoint), imported on first use.

    It adds ~0.6 s to an import; `import scaletrain.checkpoint` stays cheap so it can
    be imported at the top of any module.
    """
    from scaletrain.checkpoint import sharded

    return sharded


def split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flattened optimizer state dict as (tensors, everything else).

    The flattened form repeats every hyperparameter per parameter name
    ("param_groups.<name>.lr", ~13 per parameter for AdamW). As DCP items each
    is a separate torch.save/torch.load; kept out of DCP in one small file they
    cost nothing (measured: ~1,000 such items were two thirds of a sharded
    save/load of the small GPT).
    """
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in optim_sd.items() if k not in tensors}


def digest(values: dict[str, dict[str, Any]]) -> str:
    text = repr(sorted((name, sorted(v.items())) for name, v in values.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_json(path: Path, data: Any) -> FileEntry:
    return atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def prepare_dir(path: Path) -> None:
    """Make `path` an empty checkpoint directory (rank 0, before anyone writes into it).

    An existing checkpoint there (saving the same step again) is first made
    incomplete by removing its manifest, so a crash while it is rewritten
    cannot leave old and new files under one valid manifest. A directory with
    other files is refused rather than emptied: it is likely not a checkpoint.
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint path {path} is a file; a checkpoint is a directory.")
    if path.is_dir():
        entries = list(path.iterdir())
        foreign = [
            e.name
            for e in entries
            if not (
                e.is_file()
                and (e.name.endswith(_OUR_FILES) or e.name == _DCP_METADATA or ".tmp-" in e.name)
            )
        ]
        if foreign:
            raise ConfigError(
                f"checkpoint path {path} already holds other things ({', '.join(sorted(foreign)[:5])}"
                "); a checkpoint needs a directory of its own. Use e.g. "
                "scaletrain.checkpoint.checkpoint_path(run_dir, step)."
            )
        (path / MANIFEST).unlink(missing_ok=True)
        fsync_dir(path)
        for e in entries:
            if e.name != MANIFEST:
                e.unlink(missing_ok=True)
    else:
        path.mkdir(parents=True)
        fsync_dir(path.parent)
