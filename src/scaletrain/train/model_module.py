"""A model module as a Recipe: `load_recipe("MODULE:NAME")` (or a .py path, or a
Hugging Face config.json) imports it, finds its factory, data, loss and settings, and
`check_recipe` refuses one that breaks the protocol before any process starts. The
protocol itself is in scaletrain.train.recipes' docstring.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from scaletrain._lazy import on_meta, quiet_imports
from scaletrain.errors import ConfigError, ScaletrainError, article, spell
from scaletrain.train.recipes import Recipe
from scaletrain.train.user_code import user_code_error

__all__ = ["check_recipe", "load_recipe"]

_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "batch_size": 32,
    "epochs": 1,
    "warmup": 0,
    "task": "classification",
}
"""A model module's settings where it gives none (see the module's docstring)."""

_VALUES = {"lr": float, "batch_size": int, "eval_batch_size": int, "epochs": int, "warmup": int}


def load_recipe(spec: str, *, data: str | None = None, field: str = "model") -> Recipe:
    """The Recipe of a model module, `spec` being MODULE:NAME (or MODULE, whose
    module-level build() is the factory); `data` a MODULE:NAME of datasets(split).

    `spec` may also be a Hugging Face config.json, or the directory holding it
    (`scaletrain.train.hf_config`): its causal language model, on the byte corpus unless
    `data` gives other data.

    Raises ConfigError, in the words of the setting `field`, when the module cannot be
    imported or does not follow the protocol (the module's docstring). Nothing is built
    here: a CLI calls this before any process starts.
    """
    from scaletrain.train.hf_config import config_file, config_recipe

    if (path := config_file(spec, field=field)) is not None:
        recipe = config_recipe(spec, path, field=field)
        if data is None:
            return recipe
        own = _resolve_data(data)
        return replace(
            recipe,
            dataset=data,
            data=partial(_user_data, own, spec, field),
            locate_data=_given_dir,
            example=partial(_user_example, None, own, spec, field),
        )
    module, name, target = _resolve(spec, field=field)
    if target is None:
        shown = ", ".join(_callables(module)) or "none"
        raise ConfigError(
            f"{spell(field, spec)}: {_module_part(spec)} has no {name!r}. Its functions and "
            f"classes: {shown}. Fix: {spell(field, _module_part(spec) + ':FACTORY')} naming "
            "the function (or class) that builds the nn.Module.",
            field=field,
        )
    # A factory (a function, an nn.Module class), or an object that holds the protocol
    # (a module, a class or instance with build()).
    factory = callable(target) and not isinstance(target, ModuleType)
    if isinstance(target, type) and not issubclass(target, nn.Module):
        factory = not callable(getattr(target, "build", None))
    holder = None if factory else target
    build: Any = target if factory else getattr(target, "build", None)
    if holder is not None and not callable(build):
        raise ConfigError(
            f"{spell(field, spec)}: {name} is not a factory and has no build(). Expected a "
            "function or class that returns the nn.Module, or an object whose build() does. "
            f"Fix: {spell(field, _module_part(spec) + ':build')}.",
            field=field,
        )

    def find(attr: str) -> Any:
        for where in (holder, module):
            value = getattr(where, attr, None) if where is not None else None
            if value is not None:
                return value
        return None

    values = {k: find(k) for k in (*_DEFAULTS, "eval_batch_size")}
    for key, kind in _VALUES.items():
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(
                f"{spell(field, spec)}: its {key} is {value!r}; expected a number. Fix: "
                f"{key} = {kind(_DEFAULTS.get(key, 32))} in {_module_part(spec)}, or leave it out.",
                field=field,
            )
    loss = _callable_or_none(find("loss"))
    settings: dict[str, Any] = {
        k: (v if v is not None else _DEFAULTS.get(k)) for k, v in values.items()
    }
    datasets = _resolve_data(data) if data is not None else find("datasets")
    label = data if data is not None else f"{_module_part(spec)}:datasets"
    if datasets is not None and not callable(datasets):
        datasets = None
    where = _module_part(spec)
    run_name = (
        name
        if name != "build"
        else Path(where.replace(".", "/") if not where.endswith(".py") else where).stem
    )
    return Recipe(
        name=_safe_name(run_name),
        spec=spec,
        dataset=label,
        build=build,
        data=partial(_user_data, datasets, spec, field)
        if datasets is not None
        else partial(_no_data, spec, field),
        locate_data=_given_dir,
        example=partial(_user_example, find("example"), datasets, spec, field),
        lr=float(settings["lr"]),
        optimizer_name="adamw",
        weight_decay=0.01,
        reference_batch=None,
        epochs=int(settings["epochs"]),
        warmup=int(settings["warmup"]),
        batch_size=int(settings["batch_size"]),
        eval_batch_size=int(settings["eval_batch_size"] or settings["batch_size"]),
        task=str(settings["task"]),
        loss_fn=loss,
        optimizer_fn=_callable_or_none(find("optimizer")),
        metrics_fn=_callable_or_none(find("metrics")),
        token_loss=(
            "num_items" in inspect.signature(loss).parameters
            if loss is not None
            else settings["task"] == "language-model"
        ),
    )


def check_recipe(recipe: Recipe, *, field: str = "model", training: bool = True) -> None:
    """What can be checked of a model module before any process starts: that it can
    train (a datasets function; for a plan, datasets or example) and that its factory
    builds an nn.Module (on the meta device: no memory); raises ConfigError in the words
    of the setting `field`."""
    if recipe.spec is None:
        return
    no_data = isinstance(recipe.data, partial) and recipe.data.func is _no_data
    no_example = (
        isinstance(recipe.example, partial)
        and recipe.example.func is _user_example
        and recipe.example.args[0] is None
    )
    if no_data and (training or no_example):
        if training:
            recipe.data(None, "train")  # raises the error that says what is missing
        raise ConfigError(
            f"{spell(field, recipe.spec)}: a plan runs the model on an example batch, and "
            "its module defines neither example(batch_size) -> (inputs, targets) nor "
            "datasets(split). Fix: define one of them there.",
            field=field,
        )
    if isinstance(recipe.data, partial) and recipe.data.func is _user_data:
        _check_datasets_signature(recipe.data.args[0], recipe.dataset)
    required = [
        p
        for p in inspect.signature(recipe.build).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        raise ConfigError(
            f"{spell(field, recipe.spec)}: its factory takes arguments "
            f"({', '.join(p.name for p in required)}); scaletrain calls it with none. Fix: "
            "name a function that builds the model from nothing (wrap yours: def build(): "
            "return MyModel(...)).",
            field=field,
        )
    try:
        with on_meta():
            model = recipe.build()
    except ScaletrainError:
        raise
    except Exception as exc:
        raise user_code_error(
            exc,
            f"{spell(field, recipe.spec)}: its factory, called on the meta device (scaletrain "
            "checks the model there first, with no memory),",
            field,
            "A factory runs on the meta device, where tensors have no values: build the "
            "modules there, and read weights or values (torch.load, .item()) outside it",
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{spell(field, recipe.spec)}: the factory returned {article(type(model).__name__)}; "
            "expected a torch.nn.Module. Fix: return the model itself from it.",
            field=field,
        )
    if next(model.parameters(), None) is None:
        raise ConfigError(
            f"{spell(field, recipe.spec)}: the factory's {type(model).__name__} has no "
            "parameters, so there is nothing to train. Fix: return the model with its "
            "layers (a module whose parameters() are not empty).",
            field=field,
        )


def _datasets_call(datasets: Callable[..., Any]) -> str | None:
    """How datasets is called: "keyword" (datasets(split, data_dir=...): it has a
    parameter of that name), "positional" (datasets(split, data_dir): a second required
    positional parameter), "split" (datasets(split)); None where it cannot take
    a split alone (no positional parameter, or more than two required ones). A callable
    whose signature cannot be read is called with the split alone."""
    try:
        params = list(inspect.signature(datasets).parameters.values())
    except (TypeError, ValueError):
        return "split"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > 2 or not (positional or varargs):
        return None
    if any(p.name == "data_dir" and p.kind is not p.POSITIONAL_ONLY for p in params):
        return "keyword"
    return "positional" if len(required) == 2 else "split"


def _check_datasets_signature(datasets: Callable[..., Any], label: str) -> None:
    """datasets must take the split, and at most the data directory besides."""
    if _datasets_call(datasets) is not None:
        return
    names = ", ".join(inspect.signature(datasets).parameters)
    raise ConfigError(
        f"the datasets function {label} takes ({names}); scaletrain calls it as "
        "datasets(split) or datasets(split, data_dir), split being 'train' or 'test'. "
        f"Fix: give it those parameters, or name one that has them "
        f"({spell('data', _module_part(label) + ':datasets')}).",
        field="data",
    )


def _callable_or_none(value: Any) -> Any:
    return value if callable(value) else None


def _module_part(spec: str) -> str:
    return spec.rpartition(":")[0] if ":" in spec else spec


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "model"


def _callables(module: ModuleType) -> list[str]:
    own = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and callable(v)
        and getattr(v, "__module__", None) == module.__name__
    ]
    return sorted(own)[:12]


def _import(where: str, *, spec: str, field: str) -> ModuleType:
    """A module by dotted name (importable from the working directory, as `python -m`
    makes it) or by the path of a .py file."""
    if where.endswith(".py") or os.sep in where or "/" in where or Path(where).is_file():
        path = Path(where)
        if not path.is_file():
            raise ConfigError(
                f"{spell(field, spec)}: {where} is not a file. Fix: the path of the .py file "
                "that defines the model, or a dotted module name (mypkg.models:build).",
                field=field,
            )
        name = "scaletrain_user_" + "".join(
            c if c.isalnum() else "_" for c in str(path.resolve().with_suffix(""))
        )
        if name in sys.modules:
            return sys.modules[name]
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None:
            raise ConfigError(
                f"{spell(field, spec)}: {where} is neither Python (a .py file) nor a Hugging "
                "Face config.json. Fix: the .py file that builds the model "
                f"({spell(field, 'path/to/model.py:build')}), a module name "
                f"({spell(field, 'mymodels:build')}) or a config.json.",
                field=field,
            )
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        try:
            with quiet_imports():  # a module importing transformers (and so torchao)
                loader.loader.exec_module(module)
        except ScaletrainError:
            del sys.modules[name]
            raise
        except Exception as exc:
            del sys.modules[name]
            raise user_code_error(exc, f"{spell(field, spec)}: importing {where}", field) from None
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        # The `scaletrain` command's own directory is first on its path, not the user's:
        # their modules import from where they run it, as under `python -m`.
        sys.path.insert(0, os.getcwd())
    try:
        with quiet_imports():
            return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and where.startswith(exc.name):
            raise ConfigError(
                f"{spell(field, spec)}: no module {where!r} on the Python path (looked in "
                f"{os.getcwd()} too). Fix: run from the directory that holds it, add its "
                f"directory to PYTHONPATH, or give the .py file's path "
                f"({spell(field, 'path/to/model.py:' + ('datasets' if field == 'data' else 'build'))}).",
                field=field,
            ) from None
        raise user_code_error(exc, f"{spell(field, spec)}: importing {where}", field) from None
    except ScaletrainError:
        raise
    except Exception as exc:
        raise user_code_error(exc, f"{spell(field, spec)}: importing {where}", field) from None


def _resolve(spec: str, *, field: str) -> tuple[ModuleType, str, Any]:
    where, colon, name = spec.rpartition(":") if ":" in spec else (spec, "", "build")
    if not where or (colon and not name) or ":" in re.sub(r"^[A-Za-z]:[\\/]", "", where):
        raise ConfigError(
            f"{spell(field, spec)}: expected MODULE:NAME, e.g. {spell(field, 'mymodels:build')} "
            f"or {spell(field, 'train/model.py:build')}.",
            field=field,
        )
    module = _import(where, spec=spec, field=field)
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            break
    return module, name, target


def _resolve_data(spec: str) -> Callable[..., Any]:
    _, name, target = _resolve(spec, field="data")
    if not callable(target):
        raise ConfigError(
            f"{spell('data', spec)}: {_module_part(spec)} has no function {name!r}. Fix: "
            f"{spell('data', _module_part(spec) + ':datasets')} naming a function "
            "(split, data_dir=None) -> Dataset of (inputs, targets).",
            field="data",
        )
    return target


def _user_data(
    datasets: Callable[..., Any], spec: str, field: str, data_dir: str | None, split: str
) -> Any:
    how = _datasets_call(datasets)
    name = getattr(datasets, "__name__", "datasets")
    try:
        if how == "keyword":
            dataset = datasets(split, data_dir=data_dir)
        elif how == "positional":
            dataset = datasets(split, data_dir)
        else:
            dataset = datasets(split)
    except ScaletrainError:
        raise  # scaletrain's own (a corpus reader's), which says its own fix
    except Exception as exc:
        raise user_code_error(exc, f"{spell(field, spec)}: {name}({split!r})", field) from None
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"{spell(field, spec)}: {name}({split!r}) returned {type(dataset).__name__}; "
            "expected a map-style Dataset (len() and [i]) of (inputs, targets) pairs.",
            field=field,
        )
    first = _first_sample(dataset, spec, field, name, split)
    if first is not None and not (isinstance(first, (tuple, list)) and len(first) == 2):
        got = article(type(first).__name__) + (
            f" of {len(first)}" if isinstance(first, (tuple, list)) else ""
        )
        raise ConfigError(
            f"{spell(field, spec)}: {name}({split!r})[0] is {got}; each sample must be an "
            "(inputs, targets) pair: what the model takes and what its loss compares with. "
            "Fix: return inputs, targets from the Dataset's __getitem__.",
            field=field,
        )
    return dataset


def _first_sample(dataset: Any, spec: str, field: str, name: str, split: str) -> Any:
    """dataset[0], to check its form, with every random generator as it was (a random
    augmentation must not shift the model's initial weights); None where the Dataset
    has no samples or reads only in batches (__getitems__, which the DataLoader prefers)."""
    import random

    import numpy as np

    if not len(dataset) or callable(getattr(type(dataset), "__getitems__", None)):
        return None
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return dataset[0]
    except ScaletrainError:
        raise
    except Exception as exc:
        raise user_code_error(exc, f"{spell(field, spec)}: {name}({split!r})[0]", field) from None
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def _no_data(spec: str, field: str, data_dir: str | None, split: str) -> Any:
    raise ConfigError(
        f"{spell(field, spec)} names a model, and nothing says what to train it on: its "
        "module defines no datasets(split). Fix: define datasets(split, data_dir=None) -> "
        f"Dataset of (inputs, targets) in it, or pass {spell('data', 'MODULE:NAME')}.",
        field=field,
    )


def _given_dir(data_dir: str | None) -> str | None:
    """A model module reads its own data: the directory given is passed to it as is."""
    return data_dir


def _user_example(
    example: Callable[[int], Any] | None,
    datasets: Callable[..., Any] | None,
    spec: str,
    field: str,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if example is not None:
        pair = example(batch)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            got = article(type(pair).__name__) + (
                f" of {len(pair)}" if isinstance(pair, (tuple, list)) else ""
            )
            raise ConfigError(
                f"{spell(field, spec)}: example({batch}) returned {got}; it must return "
                "(inputs, targets), a batch the model takes and what its loss compares "
                "with. Fix: return inputs, targets (for next-token prediction, "
                "tokens[:, :-1], tokens[:, 1:]).",
                field=field,
            )
        return pair[0], pair[1]
    if datasets is None:
        _no_data(spec, field, None, "train")
    data = _user_data(datasets, spec, field, None, "train")  # type: ignore[arg-type]
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    inputs, targets = next(iter(loader))
    return inputs, targets
