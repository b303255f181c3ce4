"""save_checkpoint: everything a bit-for-bit resume needs, on any strategy.

Models and optimizers go through torch.distributed.checkpoint.state_dict
(get_model_state_dict, get_optimizer_state_dict): keys without DDP's `module.`
prefix, optimizer state keyed by parameter NAME (flattened, as torchtitan does),
DTensors for FSDP/TP, so a checkpoint loads into any wrapper and, when sharded, at
any world size. The files are described in scaletrain.checkpoint.layout.

Every step that can fail locally is followed by one all-gather of the ranks'
errors (scaletrain.dist.agreement), so a failure on one rank raises on all of them
instead of leaving the others waiting in the next collective until the timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, overload

from scaletrain.checkpoint import full as _full
from scaletrain.checkpoint.asynchronous import AsyncSaver, PendingCheckpoint, default_saver
from scaletrain.checkpoint.catalog import Retention
from scaletrain.checkpoint.disks import Disks, sharded_refusal
from scaletrain.checkpoint.layout import (
    OPTIM_VALUES,
    VALUES,
    buffers_file,
    classname,
    dcp,
    digest,
    failure,
    loaders_file,
    local_buffers,
    optim_options,
    optim_values_file,
    prepare_dir,
    rng_file,
    split_optimizer,
    user_class,
    views,
    with_first_replica_buffers,
    write_json,
)
from scaletrain.checkpoint.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    fsync_dir,
    sha256_file,
    write_manifest,
)
from scaletrain.checkpoint.scope import CheckpointScope, ScopeSource, as_scope
from scaletrain.checkpoint.state import (
    State,
    Table,
    classify,
    collect_rng,
    fingerprint,
    is_dtensor,
    model_table,
)
from scaletrain.dist.agreement import agree, all_gather_objects, attempt
from scaletrain.errors import CheckpointError, ConfigError

__all__ = ["model_infos", "save_checkpoint", "save_with"]


def model_infos(state: State) -> tuple[dict[str, dict[str, Any]], dict[str, Table]]:
    """Per model: its state dict (references, no copies) and its table of shapes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sds: dict[str, dict[str, Any]] = {}
    tables: dict[str, Table] = {}
    for name, model in state.models.items():
        sds[name] = get_model_state_dict(model)
        tables[name] = model_table(sds[name])
    return sds, tables


def global_tables(
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
    world = scope.topology.world_size
    local = {name: fingerprint(t) for name, t in tables.items()}
    gathered = agree(what, error, (local, dtensors, extra), world_size=world, wrap=failure)
    any_dtensor = any(d for _, d, _ in gathered)
    extras = [e for _, _, e in gathered]
    differ = any(g != local for g, _, _ in gathered)
    if not differ:
        return tables, any_dtensor, False, extras
    union: dict[str, Table] = {name: {} for name in tables}
    for rank_tables in all_gather_objects(tables, world):
        for name, table in rank_tables.items():
            union.setdefault(name, {}).update(table)
    return union, any_dtensor, True, extras


def _write_per_rank(
    scope: CheckpointScope, path: Path, state: State, *, sharded: bool
) -> dict[str, FileEntry]:
    rank = scope.topology.rank
    files = {
        rng_file(rank): _full.save_file(path / rng_file(rank), collect_rng(scope.topology.device))
    }
    if sharded and state.models:
        files[buffers_file(rank)] = _full.save_file(
            path / buffers_file(rank), local_buffers(scope, state)
        )
    if state.loaders:
        loaders = {name: obj.state_dict() for name, obj in state.loaders.items()}
        files[loaders_file(rank)] = write_json(path / loaders_file(rank), loaders)
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
    files[VALUES] = write_json(path / VALUES, values)
    return files


def _finalize(
    path: Path,
    manifest: Manifest,
    files: dict[str, FileEntry],
    retention: Retention,
    created_ns: int | None = None,
) -> Path:
    """Rank 0 (each disk's first rank, without a shared filesystem), once every rank's
    files are on disk: hash DCP's files, write the manifest, prune."""
    if manifest.kind == "sharded":
        for f in sorted(path.iterdir()):
            if f.name not in files and f.name != MANIFEST and ".tmp-" not in f.name and f.is_file():
                files[f.name] = sha256_file(f)
        fsync_dir(path)
    manifest.files = files
    manifest.created_ns = created_ns if created_ns is not None else time.time_ns()
    write_manifest(path, manifest)
    retention.prune(path)
    return path


def _stateful_sds(state: State) -> dict[str, Any]:
    """The user's objects' state dicts (rank 0's are the checkpoint's)."""
    return {name: obj.state_dict() for name, obj in state.statefuls.items()}


def _manifest(
    scope: CheckpointScope, parts: State, kind: str, tables: dict[str, Table]
) -> Manifest:
    step = parts.values.get("step")
    manifest = Manifest(
        kind=kind,
        world_size=scope.topology.world_size,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        values=list(parts.values),
    )
    for name, model in parts.models.items():
        manifest.objects[name] = {
            "kind": "model",
            "class": user_class(scope.unwrap(model)),
            "fingerprint": fingerprint(tables[name]),
            "table": tables[name],
        }
    for name, (opt, owner) in parts.optimizers.items():
        manifest.objects[name] = {"kind": "optimizer", "class": classname(opt), "model": owner}
    for name, obj in parts.statefuls.items():
        manifest.objects[name] = {"kind": "stateful", "class": classname(obj)}
    for name, obj in parts.loaders.items():
        manifest.objects[name] = {"kind": "loader", "class": classname(obj)}
    return manifest


def save_with(
    scope: CheckpointScope,
    path: Path,
    state: dict[str, Any],
    *,
    saver: AsyncSaver,
    retention: Retention,
    async_save: bool,
    sharded: bool | None,
    disks: Disks | None = None,
) -> Path | PendingCheckpoint:
    """save_checkpoint with the saver (thread, group) and keep-K memory given, onto
    `disks` (None: one filesystem every rank shares; see scaletrain.checkpoint.disks)."""
    with scope.timed():
        return _save_with(
            scope,
            path,
            state,
            saver=saver,
            retention=retention,
            async_save=async_save,
            sharded=sharded,
            disks=disks,
        )


def _save_with(
    scope: CheckpointScope,
    path: Path,
    state: dict[str, Any],
    *,
    saver: AsyncSaver,
    retention: Retention,
    async_save: bool,
    sharded: bool | None,
    disks: Disks | None,
) -> Path | PendingCheckpoint:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    parts = classify(views(scope, state))
    world, rank = scope.topology.world_size, scope.topology.rank
    what = f"saving checkpoint {path}"
    local = disks is not None and not disks.shared
    # The rank that writes the shared files: rank 0, or each disk's first rank.
    leader = disks.leader if disks is not None else rank == 0

    # 1. Finish a pending async save, learn the model layout.
    def prepare() -> tuple[
        dict[str, dict[str, Any]], dict[str, Table], bool, dict[str, dict[str, Any]]
    ]:
        previous = saver.settle()
        if previous is not None:
            raise CheckpointError(previous)
        sds, tables = model_infos(parts)
        dtensors = any(is_dtensor(t) for sd in sds.values() for t in sd.values())
        optim_sds = {
            name: get_optimizer_state_dict(parts.models[owner], opt, options=optim_options())
            for name, (opt, owner) in parts.optimizers.items()
        }
        return sds, tables, dtensors, optim_sds

    prepared, error = attempt(prepare)
    model_sds, local_tables, local_dt, optim_sds = prepared if prepared else ({}, {}, False, {})
    optim_split = {name: split_optimizer(sd) for name, sd in optim_sds.items()}
    optim_values = {name: values for name, (_, values) in optim_split.items()}
    tables, any_dtensor, ranks_differ, digests = global_tables(
        scope, local_tables, local_dt, what, error, digest(optim_values)
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
    if local and kind == "sharded":
        assert disks is not None
        raise CheckpointError(sharded_refusal(path.parent, disks))
    manifest = _manifest(scope, parts, kind, tables)
    # The directory, once it is known what goes into it; before anyone writes there.
    _, error = attempt(lambda: prepare_dir(path) if leader else None)
    agree(what, error, world_size=world, wrap=failure)
    # Without a shared filesystem each disk's first rank writes the other disks' ranks'
    # sampler positions (a resume at another world size reads them all) and rank 0's
    # values and objects (what rank 0 alone writes on one shared disk: every disk then
    # resumes the same run), and the manifests of all disks carry rank 0's time:
    # together they are one checkpoint. One gather, only without a shared filesystem.
    everyone: list[dict[str, Any]] = []
    created: int | None = None
    statefuls0: dict[str, Any] = {}
    if local:
        gathered = all_gather_objects(
            (
                {n: o.state_dict() for n, o in parts.loaders.items()},
                (time.time_ns(), parts.values, _stateful_sds(parts)) if rank == 0 else None,
            ),
            world,
        )
        everyone = [loaders for loaders, _ in gathered]
        created, values0, statefuls0 = gathered[0][1]
        parts = replace(parts, values=values0)

    if kind == "sharded":
        # Outside `write`: a collective, which every rank must reach.
        model_sds = {
            name: with_first_replica_buffers(scope, parts.models[name], sd)
            for name, sd in model_sds.items()
        }

    # 2. Write. Per-rank files on every rank; rank 0 the replicated ones (full: also
    #    models and optimizers, later in the background when async); DCP on all.
    def write() -> tuple[dict[str, FileEntry], dict[str, Any] | None, dict[str, Any] | None]:
        files = _write_per_rank(scope, path, parts, sharded=kind == "sharded")
        dcp_state: dict[str, Any] | None = None
        payloads: dict[str, Any] | None = None
        if kind == "sharded":
            dcp_state = {**model_sds, **{n: tensors for n, (tensors, _) in optim_split.items()}}
            if optim_values and not values_shared:
                name = optim_values_file(rank)
                files[name] = _full.save_file(path / name, optim_values)
            elif optim_values and rank == 0:
                files[OPTIM_VALUES] = _full.save_file(path / OPTIM_VALUES, optim_values)
            if rank == 0:
                replicated = _replicated_payloads(parts, None, None, clone=False)
                files.update(_write_replicated(path, replicated, parts.values))
        elif leader:
            payloads = _replicated_payloads(parts, model_sds, optim_sds, clone=async_save)
            if local:
                payloads.update({f"{n}.pt": sd for n, sd in statefuls0.items()})
            if not async_save:
                files.update(_write_replicated(path, payloads, parts.values))
                payloads = None
        if local and leader and parts.loaders:
            assert disks is not None
            for other, loaders in enumerate(everyone):
                if other not in disks.mine:  # those write their own
                    files[loaders_file(other)] = write_json(path / loaders_file(other), loaders)
        return files, dcp_state, payloads

    written, error = attempt(write)
    files, dcp_state, payloads = written if written else ({}, None, None)
    if kind == "sharded" and not async_save:
        # DCP's own collectives report a failure on any rank to all of them.
        agree(what, error, world_size=world, wrap=failure)
        _, error = attempt(lambda: dcp().save(path, dcp_state or {}))
    # What is on this rank's disk: the files its ranks wrote (every rank's, on one
    # shared filesystem).
    merged: dict[str, FileEntry] = {}
    for other, rank_files in enumerate(agree(what, error, files, world_size=world, wrap=failure)):
        if disks is None or other in disks.mine:
            merged.update(rank_files)

    if not async_save:
        _, error = attempt(
            lambda: _finalize(path, manifest, merged, retention, created) if leader else path
        )
        agree(what, error, world_size=world, wrap=failure)
        return path

    # 3. Async: the rest runs on the saver's thread.
    upload: Callable[[], None] | None = None
    if kind == "sharded":
        # Staging (the copy to CPU memory) happens here, on this thread.
        upload, error = attempt(lambda: dcp().async_save(path, dcp_state or {}, saver.group(world)))
        agree(what, error, world_size=world, wrap=failure)
    values = dict(parts.values)

    def finish() -> Path:
        if upload is not None:
            upload()
        if leader:
            if payloads is not None:
                merged.update(_write_replicated(path, payloads, values))
            _finalize(path, manifest, merged, retention, created)
        return path

    return saver.submit(path, finish)


def check_keep(keep: int | None, where: str) -> None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(
            f"{where}(keep={keep!r}): expected an int >= 1 (how many checkpoints "
            "to keep) or None to keep all."
        )


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
        use, e.g. `model=model, optimizer=opt, loader=loader, step=120, epoch=3`.
        Every rank's RNG states are always saved.
    keep: once this checkpoint is complete, delete the checkpoints named like it in
        its parent directory (for step-000120: the step-NNNNNN ones, never a `best/`
        beside them) that are older than `keep` valid ones; a damaged checkpoint does
        not count as one, so older valid ones stay until enough newer ones exist.
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
    check_keep(keep, "save_checkpoint")
    if not state:
        raise ConfigError(
            "save_checkpoint got nothing to save; pass the state by name, e.g. "
            "save_checkpoint(scope, path, model=model, optimizer=optimizer, step=step)."
        )
    saver = default_saver()
    return save_with(
        as_scope(source),
        Path(path),
        state,
        saver=saver,
        retention=saver.retention(keep),
        async_save=async_save,
        sharded=sharded,
    )
