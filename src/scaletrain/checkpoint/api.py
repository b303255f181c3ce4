"""save_checkpoint / load_checkpoint: everything a bit-for-bit resume needs, on any strategy.

A checkpoint is a directory (by convention RUN/checkpoints/step-000120/):

  full (no parameter is a DTensor and every rank holds the same keys):
    model.pt, optimizer.pt, scheduler.pt, ...   rank 0, torch.save of state dicts
  sharded (FSDP, tensor parallel, pipeline):
    __0_0.distcp, __1_0.distcp, .metadata       torch.distributed.checkpoint: model and
                                                optimizer tensors, every rank its shards
    optim-values.pt                             the optimizers' hyperparameters (or
                                                optim-values-rank{r}.pt when ranks hold
                                                different parameters: pipeline)
    scheduler.pt, ...                           as above
  both:
    rng-rank{r}.pt        each rank's RNG (python, numpy, torch CPU, its CUDA device)
    loaders-rank{r}.json  each rank's sampler epoch/position (when loaders are saved)
    values.json           plain values (step, epoch, ...)
    manifest.json         sha256 of every file, world size, model fingerprints; LAST

Models and optimizers go through torch.distributed.checkpoint.state_dict
(get/set_model_state_dict, get/set_optimizer_state_dict): keys without DDP's
`module.` prefix, optimizer state keyed by parameter NAME (flattened, as
torchtitan does), DTensors for FSDP/TP, so a checkpoint loads into any wrapper
and, when sharded, at any world size.

Every step that can fail locally is followed by one all-gather of the ranks'
errors, so a failure on one rank raises on all of them instead of leaving
the others waiting in the next collective until the timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist

from scaletrain.checkpoint import full as _full
from scaletrain.checkpoint.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    atomic_write_bytes,
    fsync_dir,
    prune,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)
from scaletrain.checkpoint.scope import CheckpointScope, ScopeSource, as_scope
from scaletrain.checkpoint.state import (
    State,
    Table,
    classify,
    collect_rng,
    diff_tables,
    fingerprint,
    is_dtensor,
    loader_resume_problem,
    model_table,
    restore_rng,
)
from scaletrain.errors import CheckpointError, ConfigError, say

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "PendingCheckpoint",
    "consolidate",
    "load_checkpoint",
    "save_checkpoint",
    "wait_pending",
]

VALUES = "values.json"
OPTIM_VALUES = "optim-values.pt"


def _optim_values_file(rank: int) -> str:
    return f"optim-values-rank{rank}.pt"


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _buffers_file(rank: int) -> str:
    return f"buffers-rank{rank}.pt"


def _local_buffers(scope: CheckpointScope, state: State) -> dict[str, dict[str, torch.Tensor]]:
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


def _views(scope: CheckpointScope, state: dict[str, Any]) -> dict[str, Any]:
    """Models as the strategy wants them saved (a pipeline rank: only its stages)."""
    return {
        name: scope.checkpoint_module(obj) if isinstance(obj, torch.nn.Module) else obj
        for name, obj in state.items()
    }


def _loaders_file(rank: int) -> str:
    return f"loaders-rank{rank}.json"


def _optim_options() -> StateDictOptions:
    # Optimizer state keyed "state.<param name>.<key>" / "param_groups.<param name>.<key>":
    # independent of parameter order and of how parameters are grouped per rank,
    # which is what lets DCP reshard it (pipeline stages hold disjoint groups).
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _dcp() -> Any:
    """torch.distributed.checkpoint and our wrappers, imported on first use.

    They add ~0.6 s to an import; `import scaletrain.checkpoint` stays cheap so
    it can be imported at the top of any module.
    """
    from scaletrain.checkpoint import sharded

    return sharded


# -- coordination -------------------------------------------------------------------


def _distributed(scope: CheckpointScope) -> bool:
    return scope.topology.world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_gather(scope: CheckpointScope, obj: Any) -> list[Any]:
    if not _distributed(scope):
        return [obj]
    out: list[Any] = [None] * scope.topology.world_size
    dist.all_gather_object(out, obj)
    return out


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (CheckpointError, ConfigError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _sync(
    scope: CheckpointScope, what: str, error: BaseException | None, payload: Any = None
) -> list[Any]:
    """All-gather (error, payload) from every rank; if any rank failed, raise on all.

    A rank's own exception is re-raised as is when every failing rank reports the
    same thing (the usual case: a bad checkpoint looks bad to everyone).
    """
    gathered = _all_gather(scope, (None if error is None else _describe(error), payload))
    failed = [(r, msg) for r, (msg, _) in enumerate(gathered) if msg is not None]
    if failed:
        messages = {msg for _, msg in failed}
        if error is not None and len(messages) == 1:
            if isinstance(error, (CheckpointError, ConfigError)):
                raise error
            raise CheckpointError(f"{what} failed: {_describe(error)}") from error
        story = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {story}") from error
    return [p for _, p in gathered]


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


# -- async saves ----------------------------------------------------------------------


class PendingCheckpoint:
    """An async save in flight. `wait()` / `result()` finish it and return its path.

    On rank 0 the checkpoint is complete (manifest written, old ones pruned) once
    `wait()` returns; on other ranks `wait()` returns when this rank's part is
    written. The next save_checkpoint or load_checkpoint waits for it on its own.
    """

    def __init__(self, path: Path, future: Future[Path]) -> None:
        self.path = path
        self._future = future
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        except CheckpointError:
            self._reported = True
            raise
        except Exception as exc:
            self._reported = True
            raise CheckpointError(
                f"the async save to {self.path} failed: {_describe(exc)}. The checkpoints "
                "saved before it are untouched."
            ) from exc

    def wait(self, timeout: float | None = None) -> Path:
        return self.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"PendingCheckpoint({str(self.path)!r}, {state})"


_PENDING: list[PendingCheckpoint] = []
_PENDING_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_ASYNC_GROUP: tuple[Any, Any] | None = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        # One worker: saves finish in the order they were started.
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scaletrain-ckpt")
    return _EXECUTOR


def _async_group(scope: CheckpointScope) -> Any:
    """A Gloo group for DCP's background-thread collectives (made once per process group).

    Collectives from two threads on one group can interleave differently on
    different ranks and deadlock; torchtitan gives async checkpointing its own
    group for the same reason. Gloo also because dcp.async_save needs a CPU backend.
    """
    global _ASYNC_GROUP
    if not _distributed(scope):
        return None
    world = dist.group.WORLD
    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not world:
        _ASYNC_GROUP = (world, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[1]


def wait_pending() -> None:
    """Finish every async save of this process (raise CheckpointError if one failed).

    Call before the process group is destroyed (rt.shutdown()): a sharded async
    save still needs it.
    """
    error = _settle_pending()
    if error is not None:
        raise CheckpointError(error)


def _settle_pending() -> str | None:
    """Wait for pending saves; the first failure not yet reported to the user, if any."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    first: str | None = None
    for handle in pending:
        reported = handle._reported
        try:
            handle.result()
        except CheckpointError as exc:
            if not reported and first is None:
                first = str(exc)
    return first


# -- models -----------------------------------------------------------------------------


def _model_infos(state: State) -> tuple[dict[str, dict[str, Any]], dict[str, Table]]:
    """Per model: its state dict (references, no copies) and its table of shapes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sds: dict[str, dict[str, Any]] = {}
    tables: dict[str, Table] = {}
    for name, model in state.models.items():
        sds[name] = get_model_state_dict(model)
        tables[name] = model_table(sds[name])
    return sds, tables


def _global_tables(
    scope: CheckpointScope,
    tables: dict[str, Table],
    dtensors: bool,
    what: str,
    error: BaseException | None,
    extra: Any = None,
) -> tuple[dict[str, Table], bool, bool, list[Any]]:
    """(union of every rank's tables, any rank holds DTensors, ranks hold different
    keys, every rank's `extra`).

    One small gather of fingerprints; the tables themselves travel only when the
    ranks differ (pipeline stages), to be merged into the whole model's table.
    """
    local = {name: fingerprint(t) for name, t in tables.items()}
    gathered = _sync(scope, what, error, (local, dtensors, extra))
    any_dtensor = any(d for _, d, _ in gathered)
    extras = [e for _, _, e in gathered]
    differ = any(g != local for g, _, _ in gathered)
    if not differ:
        return tables, any_dtensor, False, extras
    all_tables = _all_gather(scope, tables)
    union: dict[str, Table] = {name: {} for name in tables}
    for rank_tables in all_tables:
        for name, table in rank_tables.items():
            union.setdefault(name, {}).update(table)
    return union, any_dtensor, True, extras


def _split(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flattened optimizer state dict as (tensors, everything else).

    The flattened form repeats every hyperparameter per parameter name
    ("param_groups.<name>.lr", ~13 per parameter for AdamW). As DCP items each
    is a separate torch.save/torch.load; kept out of DCP in one small file they
    cost nothing (measured: ~1,000 such items were two thirds of a sharded
    save/load of the small GPT).
    """
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in optim_sd.items() if k not in tensors}


def _digest(values: dict[str, dict[str, Any]]) -> str:
    text = repr(sorted((name, sorted(v.items())) for name, v in values.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _classname(obj: Any) -> str:
    return type(obj).__name__


# -- save ---------------------------------------------------------------------------------

_OUR_FILES = (".pt", ".json", ".distcp")
_DCP_METADATA = ".metadata"  # sharded.METADATA, without importing DCP


def _prepare_dir(path: Path) -> None:
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


def _write_json(path: Path, data: Any) -> FileEntry:
    return atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def _write_per_rank(
    scope: CheckpointScope, path: Path, state: State, *, sharded: bool
) -> dict[str, FileEntry]:
    files = {
        _rng_file(scope.topology.rank): _full.save_file(
            path / _rng_file(scope.topology.rank), collect_rng(scope.topology.device)
        )
    }
    if sharded and state.models:
        name = _buffers_file(scope.topology.rank)
        files[name] = _full.save_file(path / name, _local_buffers(scope, state))
    if state.loaders:
        loaders = {name: obj.state_dict() for name, obj in state.loaders.items()}
        files[_loaders_file(scope.topology.rank)] = _write_json(
            path / _loaders_file(scope.topology.rank), loaders
        )
    return files


def _replicated_payloads(
    state: State,
    model_sds: dict[str, dict[str, Any]] | None,
    optim_sds: dict[str, dict[str, Any]] | None,
    *,
    clone: bool,
) -> dict[str, Any]:
    """File name -> what rank 0 writes (model/optimizer files only for full checkpoints)."""
    payloads: dict[str, Any] = {}
    for name, sd in (model_sds or {}).items():
        payloads[f"{name}.pt"] = _full.snapshot(sd, clone=clone)
    for name, sd in (optim_sds or {}).items():
        payloads[f"{name}.pt"] = _full.snapshot(sd, clone=clone)
    for name, obj in state.statefuls.items():
        payloads[f"{name}.pt"] = _full.snapshot(obj.state_dict(), clone=clone)
    return payloads


def _write_replicated(
    path: Path, payloads: dict[str, Any], values: dict[str, Any]
) -> dict[str, FileEntry]:
    files = {name: _full.save_file(path / name, obj) for name, obj in payloads.items()}
    files[VALUES] = _write_json(path / VALUES, values)
    return files


def _finalize(
    path: Path, manifest: Manifest, files: dict[str, FileEntry], keep: int | None
) -> Path:
    """Rank 0, once every rank's files are on disk: hash DCP's files, write the manifest, prune."""
    if manifest.kind == "sharded":
        for f in sorted(path.iterdir()):
            if f.name not in files and f.name != MANIFEST and ".tmp-" not in f.name and f.is_file():
                files[f.name] = sha256_file(f)
        fsync_dir(path)
    manifest.files = files
    manifest.created_ns = time.time_ns()
    write_manifest(path, manifest)
    if keep is not None:
        prune(path.parent, keep, protect=path)
    return path


@overload
def save_checkpoint(
    source: CheckpointScope | ScopeSource,
    path: str | os.PathLike[str],
    *,
    keep: int | None = ...,
    async_save: Literal[False] = ...,
    sharded: bool | None = ...,
    **state: Any,
) -> Path: ...


@overload
def save_checkpoint(
    source: CheckpointScope | ScopeSource,
    path: str | os.PathLike[str],
    *,
    keep: int | None = ...,
    async_save: Literal[True],
    sharded: bool | None = ...,
    **state: Any,
) -> PendingCheckpoint: ...


@overload
def save_checkpoint(
    source: CheckpointScope | ScopeSource,
    path: str | os.PathLike[str],
    *,
    keep: int | None = ...,
    async_save: bool,
    sharded: bool | None = ...,
    **state: Any,
) -> Path | PendingCheckpoint: ...


def save_checkpoint(
    source: CheckpointScope | ScopeSource,
    path: str | os.PathLike[str],
    *,
    keep: int | None = None,
    async_save: bool = False,
    sharded: bool | None = None,
    **state: Any,
) -> Path | PendingCheckpoint:
    """Save `state` into the checkpoint directory `path`. Call on every rank.

    state: models, optimizers (with their model), LR schedulers, GradScalers,
        loaders (ShardedLoader/ShardedSampler) and plain values (ints, floats,
        str, bool, None, lists/dicts of them), by the names load_checkpoint will
        use, e.g. `model=model, optimizer=opt, scheduler=sched, loader=loader,
        step=120, epoch=3`. Every rank's RNG states are always saved.
    keep: once this checkpoint is complete, delete all but the newest `keep`
        complete checkpoints named like it in its parent directory (for
        step-000120: the step-NNNNNN ones, never a `best/` beside them);
        None keeps all.
    async_save: copy the state now and write it in the background; returns a
        PendingCheckpoint (`.wait()`), else the path once the checkpoint is complete.
    sharded: None chooses: sharded (torch.distributed.checkpoint, every rank
        writes its shards) when any parameter is a DTensor or ranks hold
        different parameters, else full (rank 0 writes plain files). True forces
        sharded (parallel writes for a big replicated model).
    source: this rank's CheckpointScope, or what describes it (the object st.init
        returns).
    """
    scope = as_scope(source)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(
            f"save_checkpoint(keep={keep!r}): expected an int >= 1 (how many checkpoints "
            "to keep) or None to keep all."
        )
    if not state:
        raise ConfigError(
            "save_checkpoint got nothing to save; pass the state by name, e.g. "
            "save_checkpoint(scope, path, model=model, optimizer=optimizer, step=step)."
        )
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    parts = classify(_views(scope, state))
    path = Path(path)
    what = f"saving checkpoint {path}"

    # 1. Finish a pending async save, prepare the directory, learn the model layout.
    def prepare() -> tuple[
        dict[str, dict[str, Any]], dict[str, Table], bool, dict[str, dict[str, Any]]
    ]:
        previous = _settle_pending()
        if previous is not None:
            raise CheckpointError(previous)
        if scope.topology.rank == 0:
            _prepare_dir(path)
        sds, tables = _model_infos(parts)
        dtensors = any(is_dtensor(t) for sd in sds.values() for t in sd.values())
        optim_sds = {
            name: get_optimizer_state_dict(parts.models[owner], opt, options=_optim_options())
            for name, (opt, owner) in parts.optimizers.items()
        }
        return sds, tables, dtensors, optim_sds

    prepared, error = _attempt(prepare)
    model_sds, local_tables, local_dt, optim_sds = prepared if prepared else ({}, {}, False, {})
    optim_split = {name: _split(sd) for name, sd in optim_sds.items()}
    optim_values = {name: values for name, (_, values) in optim_split.items()}
    tables, any_dtensor, ranks_differ, digests = _global_tables(
        scope, local_tables, local_dt, what, error, _digest(optim_values)
    )
    # FSDP/TP ranks hold the same hyperparameters (rank 0 writes them once);
    # pipeline stages hold their own parameters' (every rank writes its own).
    values_shared = len(set(digests)) == 1
    needs_sharded = any_dtensor or ranks_differ
    if sharded is False and needs_sharded:
        raise ConfigError(
            "save_checkpoint(sharded=False): this model is split across ranks ("
            + ("DTensor parameters" if any_dtensor else "ranks hold different parameters")
            + "), so no rank can write it whole. Leave sharded=None; consolidate() turns "
            "the sharded checkpoint into one plain state dict afterwards."
        )
    kind = "sharded" if (sharded or needs_sharded) else "full"
    manifest = Manifest(
        kind=kind,
        world_size=scope.topology.world_size,
        step=parts.values.get("step") if isinstance(parts.values.get("step"), int) else None,
        values=list(parts.values),
    )
    for name, model in parts.models.items():
        manifest.objects[name] = {
            "kind": "model",
            "class": _classname(scope.unwrap(model)),
            "fingerprint": fingerprint(tables[name]),
            "table": tables[name],
        }
    for name, (opt, owner) in parts.optimizers.items():
        manifest.objects[name] = {"kind": "optimizer", "class": _classname(opt), "model": owner}
    for name, obj in parts.statefuls.items():
        manifest.objects[name] = {"kind": "stateful", "class": _classname(obj)}
    for name, obj in parts.loaders.items():
        manifest.objects[name] = {"kind": "loader", "class": _classname(obj)}

    # 2. Write. Per-rank files on every rank; rank 0 the replicated ones (full: also
    #    models and optimizers, later in the background when async); DCP on all.
    def write() -> tuple[dict[str, FileEntry], dict[str, Any] | None, dict[str, Any] | None]:
        files = _write_per_rank(scope, path, parts, sharded=kind == "sharded")
        dcp_state: dict[str, Any] | None = None
        payloads: dict[str, Any] | None = None
        if kind == "sharded":
            dcp_state = {**model_sds, **{n: tensors for n, (tensors, _) in optim_split.items()}}
            if optim_values and not values_shared:
                name = _optim_values_file(scope.topology.rank)
                files[name] = _full.save_file(path / name, optim_values)
            elif optim_values and scope.topology.rank == 0:
                files[OPTIM_VALUES] = _full.save_file(path / OPTIM_VALUES, optim_values)
            if scope.topology.rank == 0:
                files.update(
                    _write_replicated(
                        path, _replicated_payloads(parts, None, None, clone=False), parts.values
                    )
                )
        elif scope.topology.rank == 0:
            payloads = _replicated_payloads(parts, model_sds, optim_sds, clone=async_save)
            if not async_save:
                files.update(_write_replicated(path, payloads, parts.values))
                payloads = None
        return files, dcp_state, payloads

    written, error = _attempt(write)
    files, dcp_state, payloads = written if written else ({}, None, None)
    if kind == "sharded" and not async_save:
        # DCP's own collectives report a failure on any rank to all of them.
        _sync(scope, what, error)
        _, error = _attempt(lambda: _dcp().save(path, dcp_state or {}))
    all_files = _sync(scope, what, error, files)
    merged: dict[str, FileEntry] = {}
    for rank_files in all_files:
        merged.update(rank_files)

    if not async_save:
        _, error = _attempt(
            lambda: _finalize(path, manifest, merged, keep) if scope.topology.rank == 0 else path
        )
        _sync(scope, what, error)
        return path

    # 3. Async: the rest runs on this process's checkpoint thread.
    upload: Callable[[], None] | None = None
    if kind == "sharded":
        # Staging (the copy to CPU memory) happens here, on this thread.
        upload, error = _attempt(
            lambda: _dcp().async_save(path, dcp_state or {}, _async_group(scope))
        )
        _sync(scope, what, error)
    is_main = scope.topology.rank == 0
    values = dict(parts.values)

    def finish() -> Path:
        if upload is not None:
            upload()
        if is_main:
            if payloads is not None:
                merged.update(_write_replicated(path, payloads, values))
            _finalize(path, manifest, merged, keep)
        return path

    handle = PendingCheckpoint(path, _executor().submit(finish))
    with _PENDING_LOCK:
        _PENDING.append(handle)
    return handle


# -- load ---------------------------------------------------------------------------------


def _holdings(manifest: Manifest) -> str:
    names = [f"{n} ({o['kind']})" for n, o in manifest.objects.items()]
    return ", ".join(names + [f"{v} (value)" for v in manifest.values]) or "nothing"


def _check_request(path: Path, manifest: Manifest, parts: State) -> None:
    kinds = {
        **{n: "model" for n in parts.models},
        **{n: "optimizer" for n in parts.optimizers},
        **{n: "stateful" for n in parts.statefuls},
        **{n: "loader" for n in parts.loaders},
    }
    for name, kind in kinds.items():
        saved = manifest.objects.get(name)
        if saved is None or saved.get("kind") != kind:
            raise CheckpointError(
                f"checkpoint {path} has no {kind} named {name!r}; it holds: "
                f"{_holdings(manifest)}. Pass the state under the names it was saved with."
            )
    for name, (opt, owner) in parts.optimizers.items():
        saved = manifest.objects[name]
        if saved["class"] != _classname(opt):
            raise CheckpointError(
                f"checkpoint {path} holds a {saved['class']} state for {name!r}, but a "
                f"{_classname(opt)} was given. Build the same optimizer class as the run "
                "that saved it."
            )
        if saved.get("model") != owner:
            raise CheckpointError(
                f"checkpoint {path}: optimizer {name!r} was saved for the model "
                f"{saved.get('model')!r}, but here it updates {owner!r}. Pass the models "
                "under the names they were saved with."
            )
    for name, obj in parts.statefuls.items():
        saved = manifest.objects[name]
        if saved["class"] != _classname(obj):
            raise CheckpointError(
                f"checkpoint {path} holds a {saved['class']} state for {name!r}, but a "
                f"{_classname(obj)} was given. Build the same class as the run that saved it."
            )


def _check_models(
    path: Path, manifest: Manifest, tables: dict[str, Table], parts: State, scope: CheckpointScope
) -> None:
    for name, table in tables.items():
        saved = manifest.objects[name]
        if saved.get("fingerprint") == fingerprint(table):
            continue
        diff = diff_tables(saved.get("table", {}), table)
        raise CheckpointError(
            f"checkpoint {path} holds another model than the "
            f"{_classname(scope.unwrap(parts.models[name]))} given as {name!r} (it saved a "
            f"{saved.get('class')}): " + "; ".join(diff) + ". Build the model with the "
            "configuration it was saved with."
        )


def _check_optimizer_keys(name: str, template: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    problems = []
    for key, value in template.items():
        if key not in saved:
            problems.append(f"{name}: {key} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            other = saved[key]
            if not isinstance(other, torch.Tensor) or tuple(other.shape) != tuple(value.shape):
                problems.append(f"{name}: {key} has another shape in the checkpoint")
    return problems


def _read_optim_values(path: Path, manifest: Manifest) -> dict[str, dict[str, Any]]:
    """The optimizers' non-tensor entries of a sharded checkpoint, merged over the ranks.

    Keys carry parameter names, so a union over the saving ranks gives every
    parameter's entries, whatever stage or shard of a new layout asks for them.
    """
    if OPTIM_VALUES in manifest.files:
        return dict(_full.load_file(path / OPTIM_VALUES))
    union: dict[str, dict[str, Any]] = {}
    for r in range(manifest.world_size):
        name = _optim_values_file(r)
        if name in manifest.files:
            for opt_name, values in _full.load_file(path / name).items():
                union.setdefault(opt_name, {}).update(values)
    return union


def _fill_from_full(template: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """`template` (this rank's DTensor shards) with the values of the whole tensors `full`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(template)
    for key, value in template.items():
        source = full[key]
        if isinstance(value, DTensor):
            # src_data_rank=None: every rank has the whole tensor, so each slices
            # its own part locally; no scatter.
            out[key] = distribute_tensor(
                source.to(value.device), value.device_mesh, value.placements, src_data_rank=None
            )
        elif isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor):
            out[key] = source.to(device=value.device, dtype=value.dtype)
        else:
            out[key] = source
    return out


def load_checkpoint(
    source: CheckpointScope | ScopeSource, path: str | os.PathLike[str], **state: Any
) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint `path`; return its plain values.

    Call on every rank, with the objects under the names they were saved with
    (`model=model, optimizer=opt, scheduler=sched, loader=loader`); the result is
    the saved plain values (`{"step": 120, "epoch": 3}`). Each rank's RNG is
    restored when the world size is the one that saved; at another world size RNG
    states do not map to ranks and are left as they are (a warning says so).

    Before anything is changed the manifest is read, every file's sha256 checked
    (spread over the ranks), model fingerprints and classes compared and every
    tensor's shape checked: a truncated, corrupted, foreign or mismatched
    checkpoint raises CheckpointError and leaves the state untouched. Files are
    read with weights_only=True and DCP metadata with a restricted unpickler:
    nothing in a checkpoint can run code. `source` is as for save_checkpoint.
    """
    scope = as_scope(source)
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    parts = classify(_views(scope, state), loading=True)
    path = Path(path)
    what = f"loading checkpoint {path}"

    # 1. Pending saves (an async save of this very checkpoint may still be finishing
    #    on rank 0: the gather below waits for it), then the model layout here.
    def prepare() -> tuple[dict[str, dict[str, Any]], dict[str, Table], bool]:
        previous = _settle_pending()
        if previous is not None:
            raise CheckpointError(previous)
        sds, tables = _model_infos(parts)
        dtensors = any(is_dtensor(t) for sd in sds.values() for t in sd.values())
        return sds, tables, dtensors

    prepared, error = _attempt(prepare)
    model_sds, local_tables, local_dt = prepared if prepared else ({}, {}, False)
    tables, any_dtensor, _, _ = _global_tables(scope, local_tables, local_dt, what, error)

    # 2. The manifest: the same one on every rank.
    manifest, error = _attempt(lambda: read_manifest(path))
    created = _sync(scope, what, error, manifest.created_ns if manifest else None)
    assert manifest is not None
    if len(set(created)) > 1:
        raise CheckpointError(
            f"the ranks see different checkpoints at {path} (manifests written at different "
            "times): every rank must read the same directory, on a shared filesystem."
        )
    _check_request(path, manifest, parts)
    _check_models(path, manifest, tables, parts, scope)
    same_world = manifest.world_size == scope.topology.world_size

    # 3. Every file's sha256, the files spread over the ranks.
    names = sorted(manifest.files)
    mine = names[scope.topology.rank :: scope.topology.world_size]
    problems, error = _attempt(lambda: verify_files(path, manifest, mine))
    all_problems = [p for ps in _sync(scope, what, error, problems) for p in ps]
    if all_problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged: " + "; ".join(all_problems) + ". Nothing was "
            "loaded. Load an earlier checkpoint ("
            + say(
                api="latest_checkpoint(run_dir) returns the newest undamaged one",
                cli="`scaletrain checkpoint latest RUN` prints the newest undamaged one",
            )
            + ")."
        )

    # 4. Read everything into memory and check it fits, still changing nothing.
    def read() -> dict[str, Any]:
        got: dict[str, Any] = {}
        got["values"] = json.loads((path / VALUES).read_text()) if VALUES in manifest.files else {}
        for name in parts.statefuls:
            got[name] = _full.load_file(path / f"{name}.pt")
        if same_world:
            got["rng"] = _full.load_file(path / _rng_file(scope.topology.rank))
            if _buffers_file(scope.topology.rank) in manifest.files:
                got["buffers"] = _full.load_file(path / _buffers_file(scope.topology.rank))
        if parts.loaders:
            saved = [
                json.loads((path / _loaders_file(r)).read_text())
                for r in range(manifest.world_size)
            ]
            for name, obj in parts.loaders.items():
                chosen, problem = loader_resume_problem(
                    name,
                    obj,
                    [s[name] for s in saved],
                    scope.topology.rank,
                    scope.topology.world_size,
                )
                if problem is not None:
                    raise CheckpointError(f"checkpoint {path}: {problem}")
                got[f"loader:{name}"] = chosen
        optim_templates = {
            name: get_optimizer_state_dict(parts.models[owner], opt, options=_optim_options())
            for name, (opt, owner) in parts.optimizers.items()
        }
        problems: list[str] = []
        if manifest.kind == "full":
            for name in list(parts.models) + list(parts.optimizers):
                got[name] = _full.load_file(path / f"{name}.pt")
            for name, template in optim_templates.items():
                problems += _check_optimizer_keys(name, template, got[name])
            got["optim_templates"] = optim_templates
        else:
            metadata = _dcp().read_metadata(path)
            splits = {name: _split(t) for name, t in optim_templates.items()}
            dcp_state = {**model_sds, **{n: tensors for n, (tensors, _) in splits.items()}}
            problems += _dcp().check_against(metadata, dcp_state)
            saved_values = _read_optim_values(path, manifest)
            for name, (_, wanted) in splits.items():
                have = saved_values.get(name, {})
                missing = [k for k in wanted if k not in have]
                problems += [f"{name}: {k} is not in the checkpoint" for k in missing]
                got[f"values:{name}"] = {k: have[k] for k in wanted if k in have}
            got["dcp"] = dcp_state
        if problems:
            raise CheckpointError(
                f"checkpoint {path} does not fit the objects given: "
                + "; ".join(problems[:8])
                + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
                + ". Build the model and optimizer as in the run that saved it."
            )
        return got

    fresh = [opt for opt, _ in parts.optimizers.values() if not opt.state]
    got, error = _attempt(read)
    try:
        _sync(scope, what, error)
    except BaseException:
        # The optimizer templates gave never-stepped optimizers zero state (torch's
        # _init_optim_state runs a step with lr=0): undo that, the load failed.
        for opt in fresh:
            opt.state.clear()
        raise
    assert got is not None

    # 5. Apply. From here on, state changes.
    if manifest.kind == "sharded":
        _dcp().load(path, got["dcp"])
        loaded = dict(got["dcp"])
        for name in parts.optimizers:
            loaded[name] = {**loaded[name], **got[f"values:{name}"]}
    elif any_dtensor:
        # Whole tensors into a model split across ranks: each rank keeps its slice.
        # (set_optimizer_state_dict(full_state_dict=True) with a flattened state
        # fails in torch 2.13 with KeyError 'param_groups.0.params.0'.)
        loaded = {name: _fill_from_full(model_sds[name], got[name]) for name in parts.models}
        for name, template in got["optim_templates"].items():
            loaded[name] = _fill_from_full(template, got[name])
    else:
        loaded = got
    for name, model in parts.models.items():
        set_model_state_dict(model, loaded[name])
        own = got.get("buffers", {}).get(name)
        if own:
            with torch.no_grad():
                for key, buf in scope.unwrap(model).named_buffers():
                    if key in own:
                        buf.copy_(own[key])
    for name, (opt, owner) in parts.optimizers.items():
        set_optimizer_state_dict(parts.models[owner], opt, loaded[name], options=_optim_options())
    for name, obj in parts.statefuls.items():
        obj.load_state_dict(got[name])
    for name, obj in parts.loaders.items():
        obj.load_state_dict(got[f"loader:{name}"])
    if same_world:
        restore_rng(got["rng"], scope.topology.device)
    elif scope.topology.rank == 0:
        warnings.warn(
            f"checkpoint {path} was saved by {manifest.world_size} ranks and this job has "
            f"{scope.topology.world_size}: the per-rank RNG states (python, numpy, torch) cannot be "
            "matched to ranks and were NOT restored, so random numbers (dropout, "
            "augmentation) will differ from an uninterrupted run. Weights, optimizer and "
            "the rest are restored.",
            stacklevel=2,
        )
    return dict(got["values"])


# -- consolidate ---------------------------------------------------------------------------


def consolidate(
    checkpoint_dir: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> Path:
    """Write one plain state dict of a checkpoint's model, for `torch.load(weights_only=True)`.

    Works for full and sharded checkpoints, in one process, without a process
    group: sharded tensors are assembled whole. Keys carry no wrapper prefix
    (`module.`) and values are plain CPU tensors, so `bare_model.load_state_dict(
    torch.load(out_file, weights_only=True))` works. `model` names the model when
    the checkpoint holds several. Files are verified against the manifest first.
    """
    ckpt = Path(checkpoint_dir)
    manifest = read_manifest(ckpt)
    problems = verify_files(ckpt, manifest, manifest.files)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems) + ".")
    models = [n for n, o in manifest.objects.items() if o.get("kind") == "model"]
    if model is None:
        if len(models) != 1:
            raise CheckpointError(
                f"checkpoint {ckpt} holds {len(models)} models ({', '.join(models) or 'none'}); "
                "name the one to consolidate with model=NAME."
            )
        model = models[0]
    if model not in models:
        raise CheckpointError(
            f"checkpoint {ckpt} has no model named {model!r}; it holds: {_holdings(manifest)}."
        )
    if manifest.kind == "full":
        sd = _full.load_file(ckpt / f"{model}.pt")
    else:
        sd = _dcp().read_entries(ckpt, model)
    sd = {
        k: (v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v)
        for k, v in sd.items()
    }
    table = manifest.objects[model].get("table", {})
    if set(sd) != set(table):
        raise CheckpointError(
            f"checkpoint {ckpt}: the entries of {model!r} do not match its manifest ("
            + "; ".join(diff_tables(table, model_table(sd)))
            + "). The checkpoint is damaged."
        )
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    _full.save_file(out, sd)
    return out
