"""load_checkpoint: check everything, read everything, and only then change anything.

A load has two halves. The first reads the manifest, verifies every file's sha256
(spread over the ranks), compares model fingerprints, classes, and the names,
shapes and dtypes of every tensor read against the objects given, and reads the
sharded tensors into scratch copies: any failure there raises CheckpointError on
every rank and leaves model, optimizer, loader and RNG exactly as they were. The
second half copies what was read into the live objects.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint import full as _full
from scaletrain.checkpoint.asynchronous import AsyncSaver, default_saver
from scaletrain.checkpoint.disks import Disks
from scaletrain.checkpoint.layout import (
    OPTIM_VALUES,
    VALUES,
    buffers_file,
    classname,
    dcp,
    failure,
    loaders_file,
    optim_options,
    optim_values_file,
    rng_file,
    split_optimizer,
    user_class,
    views,
)
from scaletrain.checkpoint.manifest import (
    Manifest,
    RejectedCheckpointError,
    load_earlier,
    read_manifest,
    verify_files,
)
from scaletrain.checkpoint.save import global_tables, model_infos
from scaletrain.checkpoint.scope import CheckpointScope, ScopeSource, as_scope
from scaletrain.checkpoint.state import (
    State,
    Table,
    classify,
    diff_tables,
    fingerprint,
    is_dtensor,
    loader_resume_state,
    model_table,
    restore_rng,
)
from scaletrain.dist.agreement import agree, attempt, describe
from scaletrain.errors import CheckpointError, article

__all__ = ["holdings", "load_checkpoint", "load_weights", "load_with"]


def holdings(manifest: Manifest) -> str:
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
                f"{holdings(manifest)}. Pass the state under the names it was saved with."
            )
    for name, (opt, owner) in parts.optimizers.items():
        saved = manifest.objects[name]
        if saved["class"] != classname(opt):
            raise CheckpointError(
                f"checkpoint {path} holds {article(saved['class'])} state for {name!r}, but "
                f"{article(classname(opt))} was given. Build the same optimizer class as the "
                "run that saved it."
            )
        if saved.get("model") != owner:
            raise CheckpointError(
                f"checkpoint {path}: optimizer {name!r} was saved for the model "
                f"{saved.get('model')!r}, but here it updates {owner!r}. Pass the models "
                "under the names they were saved with."
            )
    for name, obj in parts.statefuls.items():
        saved = manifest.objects[name]
        if saved["class"] != classname(obj):
            raise CheckpointError(
                f"checkpoint {path} holds {article(saved['class'])} state for {name!r}, but "
                f"{article(classname(obj))} was given. Build the same class as the run that "
                "saved it."
            )


def _model_mismatch(path: Path, name: str, saved: Table, here: Table, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} holds another model than the {what} given as {name!r}: "
        + "; ".join(diff_tables(saved, here))
        + ". Build the model with the configuration it was saved with."
    )


def _check_models(
    path: Path, manifest: Manifest, tables: dict[str, Table], parts: State, scope: CheckpointScope
) -> None:
    for name, table in tables.items():
        saved = manifest.objects[name]
        if saved.get("fingerprint") == fingerprint(table):
            continue
        saved_as = article(saved.get("class"))
        what = f"{user_class(scope.unwrap(parts.models[name]))} (it saved {saved_as})"
        raise _model_mismatch(path, name, saved.get("table", {}), table, what)


def _check_optimizer(name: str, template: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """What keeps `saved` from replacing `template`: names, shapes and dtypes of tensors."""
    problems = []
    for key, value in template.items():
        if key not in saved:
            problems.append(f"{name}: {key} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            other = saved[key]
            if not isinstance(other, torch.Tensor):
                problems.append(f"{name}: {key} is not a tensor in the checkpoint")
            elif tuple(other.shape) != tuple(value.shape) or other.dtype != value.dtype:
                problems.append(
                    f"{name}: {key} is {tuple(other.shape)} {other.dtype} in the checkpoint, "
                    f"{tuple(value.shape)} {value.dtype} here"
                )
    # Extra hyperparameters are harmless (a scheduler adds initial_lr); extra tensors
    # mean the state belongs to other parameters.
    extra = sorted(k for k, v in saved.items() if k not in template and isinstance(v, torch.Tensor))
    if extra:
        problems.append(f"{name}: {', '.join(extra[:3])} are only in the checkpoint")
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
        name = optim_values_file(r)
        if name in manifest.files:
            for opt_name, values in _full.load_file(path / name).items():
                union.setdefault(opt_name, {}).update(values)
    return union


def _fill_from_full(template: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """`template` (this rank's DTensor shards) with the values of the whole tensors `whole`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(template)
    for key, value in template.items():
        source = whole[key]
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


def _scratch(state: dict[str, Any]) -> dict[str, Any]:
    """Empty tensors shaped like `state`'s (DTensors stay DTensors): what DCP reads into.

    DCP fills the tensors it is given in place; given the live parameters, a read that
    fails halfway (a truncated .distcp) would leave the model half loaded.
    """
    return {
        k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }


def _read(
    path: Path,
    manifest: Manifest,
    parts: State,
    scope: CheckpointScope,
    model_sds: dict[str, dict[str, Any]],
    tables: dict[str, Table],
    same_world: bool,
) -> dict[str, Any]:
    """Everything the load will apply, read into memory and checked; nothing changed yet."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    topo = scope.topology
    got: dict[str, Any] = {}
    got["values"] = json.loads((path / VALUES).read_text()) if VALUES in manifest.files else {}
    for name in parts.statefuls:
        got[name] = _full.load_file(path / f"{name}.pt")
    if same_world:
        got["rng"] = _full.load_file(path / rng_file(topo.rank))
        if buffers_file(topo.rank) in manifest.files:
            got["buffers"] = _full.load_file(path / buffers_file(topo.rank))
    if parts.loaders:
        saved = [
            json.loads((path / loaders_file(r)).read_text()) for r in range(manifest.world_size)
        ]
        for name, obj in parts.loaders.items():
            chosen, problem = loader_resume_state(
                name, obj, [s[name] for s in saved], topo.rank, topo.world_size
            )
            if problem is not None:
                raise CheckpointError(f"checkpoint {path}: {problem}")
            got[f"loader:{name}"] = chosen
    optim_templates = {
        name: get_optimizer_state_dict(parts.models[owner], opt, options=optim_options())
        for name, (opt, owner) in parts.optimizers.items()
    }
    problems: list[str] = []
    if manifest.kind == "full":
        for name in parts.models:
            got[name] = _full.load_file(path / f"{name}.pt")
            # The files match their manifest, but a manifest can be rewritten to match
            # swapped files: what is read must be what the model holds, key for key.
            read_table = model_table(got[name])
            if read_table != tables[name]:
                raise _model_mismatch(path, name, read_table, tables[name], "model")
        for name, template in optim_templates.items():
            got[name] = _full.load_file(path / f"{name}.pt")
            problems += _check_optimizer(name, template, got[name])
        got["optim_templates"] = optim_templates
    else:
        metadata = dcp().read_metadata(path)
        splits = {name: split_optimizer(t) for name, t in optim_templates.items()}
        dcp_state = {
            **{n: _scratch(sd) for n, sd in model_sds.items()},
            **{n: _scratch(tensors) for n, (tensors, _) in splits.items()},
        }
        problems += dcp().check_against(metadata, dcp_state)
        saved_values = _read_optim_values(path, manifest)
        for name, (_, wanted) in splits.items():
            have = saved_values.get(name, {})
            problems += [f"{name}: {k} is not in the checkpoint" for k in wanted if k not in have]
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


def _apply(path: Path, manifest: Manifest, parts: State, scope: CheckpointScope, got: dict[str, Any],
           model_sds: dict[str, dict[str, Any]], any_dtensor: bool, same_world: bool) -> None:  # fmt: skip
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if manifest.kind == "sharded":
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
        set_optimizer_state_dict(parts.models[owner], opt, loaded[name], options=optim_options())
    for name, obj in parts.statefuls.items():
        obj.load_state_dict(got[name])
    for name, obj in parts.loaders.items():
        obj.load_state_dict(got[f"loader:{name}"])
    if same_world:
        restore_rng(got["rng"], scope.topology.device)
    elif scope.topology.rank == 0:
        warnings.warn(
            f"checkpoint {path} was saved by {manifest.world_size} ranks and this job has "
            f"{scope.topology.world_size}: the per-rank RNG states (python, numpy, torch) "
            "cannot be matched to ranks and were NOT restored, so random numbers (dropout, "
            "augmentation) will differ from an uninterrupted run. Weights, optimizer and "
            "the rest are restored.",
            stacklevel=3,
        )


def load_with(
    scope: CheckpointScope,
    path: Path,
    state: dict[str, Any],
    *,
    saver: AsyncSaver,
    disks: Disks | None = None,
) -> dict[str, Any]:
    """load_checkpoint, waiting first for the saves in flight of `saver`; `disks` says
    which ranks share a filesystem (None: all of them)."""
    with scope.timed():
        return _load_with(scope, path, state, saver=saver, disks=disks)


def _load_with(
    scope: CheckpointScope,
    path: Path,
    state: dict[str, Any],
    *,
    saver: AsyncSaver,
    disks: Disks | None,
) -> dict[str, Any]:
    parts = classify(views(scope, state), loading=True)
    world = scope.topology.world_size
    what = f"loading checkpoint {path}"

    # 1. Pending saves (an async save of this very checkpoint may still be finishing
    #    on rank 0: the gather below waits for it), then the model layout here.
    def prepare() -> tuple[dict[str, dict[str, Any]], dict[str, Table], bool]:
        previous = saver.settle()
        if previous is not None:
            raise CheckpointError(previous)
        sds, tables = model_infos(parts)
        dtensors = any(is_dtensor(t) for sd in sds.values() for t in sd.values())
        return sds, tables, dtensors

    prepared, error = attempt(prepare)
    model_sds, local_tables, local_dt = prepared if prepared else ({}, {}, False)
    tables, any_dtensor, _, _ = global_tables(scope, local_tables, local_dt, what, error)

    # 2. The manifest: the same one on every rank.
    manifest, error = attempt(lambda: read_manifest(path))
    created = agree(
        what, error, manifest.created_ns if manifest else None, world_size=world, wrap=failure
    )
    assert manifest is not None
    if len(set(created)) > 1:
        raise CheckpointError(
            f"the ranks see different checkpoints at {path} (manifests written at different "
            "times): it was written by another job, or copied onto some nodes only. Every "
            "rank must read the same checkpoint: one directory on a shared filesystem, or "
            "the parts one save wrote on each node's own disk."
        )
    _check_request(path, manifest, parts)
    _check_models(path, manifest, tables, parts, scope)
    same_world = manifest.world_size == world

    # 3. Every file's sha256, the files spread over the ranks (of each disk: without a
    #    shared filesystem each disk holds its own part, under its own manifest).
    group = disks.mine if disks is not None else tuple(range(world))
    mine = sorted(manifest.files)[group.index(scope.topology.rank) :: len(group)]
    problems, error = attempt(lambda: verify_files(path, manifest, mine))
    damage = [p for ps in agree(what, error, problems, world_size=world, wrap=failure) for p in ps]
    if damage:
        raise RejectedCheckpointError(
            f"checkpoint {path} is damaged: " + "; ".join(damage) + ". Nothing was loaded; "
            f"{load_earlier()}.",
            reason="; ".join(damage),
        )

    # 4. Read everything into memory and check it fits, still changing nothing. The
    #    optimizer templates give never-stepped optimizers a zero state (torch's
    #    _init_optim_state runs a step with lr=0): a failed load takes it back.
    fresh = [opt for opt, _ in parts.optimizers.values() if not opt.state]
    try:
        got, error = attempt(
            lambda: _read(path, manifest, parts, scope, model_sds, tables, same_world)
        )
        agree(what, error, world_size=world, wrap=failure)
        assert got is not None
        if manifest.kind == "sharded":
            # Into scratch tensors: a file that fails halfway changes nothing.
            _, error = attempt(lambda: dcp().load(path, got["dcp"]))
            agree(what, error, world_size=world, wrap=_damaged(path))
    except BaseException:
        for opt in fresh:
            opt.state.clear()
        raise

    # 5. Apply. Every name, shape and dtype was checked above.
    _, error = attempt(
        lambda: _apply(path, manifest, parts, scope, got, model_sds, any_dtensor, same_world)
    )
    if error is not None:
        raise CheckpointError(
            f"checkpoint {path} passed every check but could not be applied "
            f"({describe(error)}); the objects given may be partly loaded. Please report "
            "this with the checkpoint's manifest.json."
        ) from error
    return dict(got["values"])


def _damaged(path: Path) -> Any:
    def wrap(message: str) -> CheckpointError:
        return RejectedCheckpointError(
            f"{message}. The checkpoint {path} is damaged; nothing was loaded."
        )

    return wrap


def load_checkpoint(
    source: CheckpointScope | ScopeSource, path: str | os.PathLike[str], **state: Any
) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint `path`; return its plain values.

    Call on every rank, with the objects under the names they were saved with
    (`model=model, optimizer=opt, loader=loader`); the result is the saved plain
    values (`{"step": 120, "epoch": 3}`). Each rank's RNG is restored when the world
    size is the one that saved; at another world size RNG states do not map to ranks
    and are left as they are (a warning says so). A loader saved mid-epoch resumes at
    any world size: the samples no rank had reached are shared among the new ranks.

    Before anything is changed the manifest is read, every file's sha256 checked
    (spread over the ranks), model fingerprints and classes compared and every
    tensor's name, shape and dtype checked; sharded tensors are read into scratch
    copies. A truncated, corrupted, foreign or mismatched checkpoint raises
    CheckpointError and leaves every object untouched (RejectedCheckpointError when
    the checkpoint itself is at fault: an older one may load). Files are read with
    weights_only=True and DCP metadata with a restricted unpickler: nothing in a
    checkpoint can run code. `source` is as for save_checkpoint.
    """
    return load_with(as_scope(source), Path(path), state, saver=default_saver())


def load_weights(
    source: CheckpointScope | ScopeSource, path: str | os.PathLike[str], model: torch.nn.Module
) -> None:
    """Load a plain state dict file (a run's model.pt, what `consolidate` writes) into
    `model`, whatever strategy wrapped it: each rank takes its shards or stages of the
    whole tensors. Every rank reads the file. Raises CheckpointError, changing nothing,
    when the file does not hold exactly this model's keys and shapes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    scope = as_scope(source)
    file = Path(path)
    view = scope.checkpoint_module(model)
    with scope.timed():
        try:
            whole = _full.load_file(file)
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot read the weights in {file}: {exc}") from None
        template = get_model_state_dict(view)
        missing = sorted(template.keys() - whole.keys())
        wrong = sorted(
            k
            for k in template.keys() & whole.keys()
            if isinstance(whole[k], torch.Tensor) and tuple(whole[k].shape) != _shape(template[k])
        )
        if missing or wrong:
            shown = ", ".join(
                [*(f"{k} (missing)" for k in missing), *(f"{k} (shape)" for k in wrong)]
            )
            raise CheckpointError(
                f"{file} does not hold this {type(scope.unwrap(model)).__name__}'s weights: "
                f"{shown[:300]}. Load it into the model that was trained to write it."
            )
        set_model_state_dict(view, _fill_from_full(template, whole))


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()
