"""What a resume needs besides the weights: sorting the user's state, RNG, loaders, values.

`save_checkpoint(rt, path, model=..., optimizer=..., step=...)` takes its state as
keyword arguments; `classify` sorts them by kind, because each kind is stored
differently: models and optimizers through torch.distributed.checkpoint's
state_dict API (portable: keyed by parameter name), other stateful objects
(LR schedulers, GradScalers) as rank 0's state dict, loaders and RNG per rank,
plain values as JSON.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.data.sampler import resume_state
from scaletrain.errors import ConfigError

__all__ = [
    "State",
    "classify",
    "collect_rng",
    "diff_tables",
    "fingerprint",
    "is_dtensor",
    "loader_resume_state",
    "model_table",
    "restore_rng",
]

Loader = ShardedLoader | ShardedSampler
Table = dict[str, list[Any]]
"""State-dict key -> [global shape, dtype name]: what a model's checkpoint must match."""


@dataclass(slots=True)
class State:
    """The keyword arguments of save/load, sorted by how each kind is stored."""

    models: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[torch.optim.Optimizer, str]] = field(default_factory=dict)
    """name -> (optimizer, name of the model whose parameters it updates)."""
    statefuls: dict[str, Any] = field(default_factory=dict)
    """LR schedulers, GradScalers, anything with state_dict/load_state_dict: replicated."""
    loaders: dict[str, Loader] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _check_plain(name: str, value: Any, path: str = "") -> None:
    where = f"{name}{path}"
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            # JSON has no inf/nan; Python's json writes them anyway, other readers choke.
            raise ConfigError(
                f"checkpoint value {where}={value!r} is not finite; JSON cannot hold it. Save "
                "a finite number or a string, e.g. str(value)."
            )
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(name, item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"checkpoint value {where} has the key {key!r} of type "
                    f"{type(key).__name__}; plain values are stored as JSON, whose keys are "
                    "strings. Use str keys."
                )
            _check_plain(name, item, f"{path}[{key!r}]")
        return
    hint = " Convert it with .item() or .tolist()." if hasattr(value, "item") else ""
    raise ConfigError(
        f"checkpoint got {where} of type {type(value).__name__}; expected a model, an "
        "optimizer, an object with state_dict()/load_state_dict() (LR scheduler, "
        "GradScaler, loader) or a plain value (int, float, str, bool, None, and lists/dicts "
        f"of them).{hint}"
    )


def _owner(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> str | None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, model in models.items():
        if ids and ids <= {id(p) for p in model.parameters()}:
            return name
    return None


def classify(state: Mapping[str, Any], *, loading: bool = False) -> State:
    """Sort save/load keyword arguments by kind; raise ConfigError for what cannot be saved."""
    out = State()
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            out.models[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            pass  # paired with its model below, once all models are known
        elif isinstance(obj, (ShardedLoader, ShardedSampler)):
            out.loaders[name] = obj
        elif _is_stateful(obj):
            out.statefuls[name] = obj
        elif loading:
            raise ConfigError(
                f"load_checkpoint got {name}={obj!r}: plain values are not passed in, they "
                "come back in the returned dict, e.g. step = load_checkpoint(rt, path, "
                "model=model)['step']."
            )
        else:
            _check_plain(name, obj)
            out.values[name] = obj
    for name, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            owner = _owner(obj, out.models)
            if owner is None:
                raise ConfigError(
                    f"the optimizer {name}={type(obj).__name__} updates parameters of no model "
                    f"passed with it (models: {', '.join(out.models) or 'none'}). Its state "
                    "is keyed by parameter name, so pass the model too, e.g. "
                    "save_checkpoint(rt, path, model=model, optimizer=optimizer); after "
                    "rt.setup() pass the optimizer setup() returned."
                )
            out.optimizers[name] = (obj, owner)
    return out


# -- models: fingerprints ----------------------------------------------------------


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def model_table(model_state: Mapping[str, Any]) -> Table:
    """Key -> [global shape, dtype] of a model state dict (DTensors report global shapes)."""
    table: Table = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            table[key] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return table


def fingerprint(table: Table) -> str:
    text = json.dumps(sorted(table.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def diff_tables(saved: Table, current: Table, limit: int = 8) -> list[str]:
    """Human-readable differences: keys only in one of them, and shape/dtype changes."""
    lines = []
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    changed = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])

    def show(keys: list[str]) -> str:
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(keys[:limit]) + more

    if missing:
        lines.append(f"not in the checkpoint: {show(missing)}")
    if extra:
        lines.append(f"only in the checkpoint: {show(extra)}")
    for k in changed[:limit]:
        (s_shape, s_dtype), (c_shape, c_dtype) = saved[k], current[k]
        lines.append(
            f"{k}: checkpoint has shape {tuple(s_shape)} {s_dtype}, the model "
            f"{tuple(c_shape)} {c_dtype}"
        )
    if len(changed) > limit:
        lines.append(f"... and {len(changed) - limit} more parameters differ in shape/dtype")
    return lines


# -- RNG ---------------------------------------------------------------------------


def collect_rng(device: torch.device) -> dict[str, Any]:
    """This rank's generators: python `random`, numpy's global, torch CPU, this CUDA device.

    Stored as tensors and numbers only, so the file loads with weights_only=True.
    Only this rank's own CUDA device is read: get_rng_state_all() would create a
    context on every visible GPU from every rank.
    """
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": str(np_kind),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device) -> None:
    internal = tuple(int(x) for x in state["python_state"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    np.random.set_state(
        (
            state["numpy_kind"],
            state["numpy_keys"].numpy().astype(np.uint32),
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_gauss"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device)


# -- loaders -----------------------------------------------------------------------


def _sampler(obj: Loader) -> ShardedSampler:
    return obj.sampler if isinstance(obj, ShardedLoader) else obj


def _left(obj: Loader, state: Mapping[str, Any], rank: int) -> int:
    """What the saving rank `rank` had left of its epoch: batches for a loader (one
    whose last partial batch is dropped is done without it), else samples."""
    sampler = ShardedSampler(
        int(state["dataset_len"]),
        num_replicas=int(state["num_replicas"]),
        rank=rank,
        seed=int(state["seed"]),
        shuffle=bool(state["shuffle"]),
        drop_last=bool(state["drop_last"]),
        pad=bool(state["pad"]),
    )
    sampler.load_state_dict(state)
    left = sampler.remaining()
    if isinstance(obj, ShardedLoader):
        return left // obj.batch_size if obj.drop_last else -(-left // obj.batch_size)
    return left


def loader_resume_state(
    name: str, obj: Loader, saved: list[dict[str, Any]], rank: int, world_size: int
) -> tuple[dict[str, Any] | None, str | None]:
    """The state `obj` (on `rank`) should load from the per-rank `saved` states, or a problem.

    Same world size: this rank's own state. Another world size: at an epoch boundary
    (every saving rank at position 0, or every one done with the epoch, which resumes
    as the next epoch at 0) the new ranks start that epoch afresh; mid-epoch, the
    samples no saving rank had reached are dealt over the new ranks
    (scaletrain.data.sampler.resume_state). Either way the state is tried on a copy
    of the sampler first, so a mismatch (another dataset, seed...) fails before
    anything is changed.
    """
    try:
        if len(saved) == world_size:
            chosen = dict(saved[rank])
        else:
            epochs = {int(s["epoch"]) for s in saved}
            fresh = all(int(s["position"]) == 0 and not s.get("reshard") for s in saved)
            done = len(epochs) == 1 and all(_left(obj, s, r) == 0 for r, s in enumerate(saved))
            if len(epochs) == 1 and (fresh or done):
                chosen = dict(saved[0], position=0, reshard=[])
                if done and not fresh:
                    chosen["epoch"] = int(saved[0]["epoch"]) + 1
            else:
                chosen = resume_state(saved, world_size, rank)
        trial = copy.deepcopy(_sampler(obj))
        trial.load_state_dict(chosen)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        return None, f"the loader {name!r} cannot resume: {exc}"
    return chosen, None
