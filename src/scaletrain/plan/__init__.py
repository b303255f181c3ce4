"""Planning how a model is cut over devices and ranks: pure functions of the model.

A leaf package: it imports nothing of the training stack, so every strategy can use
it and it can be tested without devices or processes. `partition` cuts a model into
stages; `profile`, `layertime`, `hardware`, `comm`, `overhead`, `layouts`, `schedule`,
`estimate` and `api` make `scaletrain plan`: memory per device and step time of every
strategy at N devices.

`st.plan(...)` is this package, called: importing `scaletrain.plan` binds the name
`plan` on `scaletrain` to this module (Python sets a subpackage as an attribute of its
parent), so the module itself is made callable. The call goes to
scaletrain.train.planning.plan (recipes live in scaletrain.train), imported by name
when called, so this package never imports the training stack.
"""

import importlib
import sys
import types
from typing import Any

from scaletrain.strategies.partition import (
    Layer,
    balance_stages,
    list_layers,
    list_units,
    split_layers,
)

__all__ = ["Layer", "balance_stages", "list_layers", "list_units", "split_layers"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """st.plan(recipe=None, *, model=None, devices=1, ...): see scaletrain.train.planning."""
        return importlib.import_module("scaletrain.train.planning").plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
plan = sys.modules[__name__]
"""`scaletrain.plan.plan` is the package itself, so `st.plan` resolves to it lazily too."""
