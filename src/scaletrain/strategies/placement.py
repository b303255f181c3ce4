"""Placing a module over devices by a device map, and moving activations between them.

Placement rule, for every module of the tree in registration order:
1. a module named in the map goes to its device (keys are qualified names as in
   `model.named_modules()`: "sub_net1", "blocks.0", "blocks.0.mlp");
2. a module not named goes with its nearest named ancestor (a subtree follows its
   root, unless a deeper key overrides part of it);
3. a module with no named ancestor follows the module registered just before it
   (its parent, or the previous sibling's last descendant): parts that come after
   `sub_net1` and before `sub_net2` stay with `sub_net1`. The root's own
   parameters and anything registered before the first named module go to the
   first device.

Activations cross devices at the boundaries: a forward pre-hook on the root, on
every named module and on every module whose device differs from its parent's or
its predecessor's moves the module's tensor inputs (args and kwargs, nested in
tuples, lists and dicts) to its device. Outputs stay on the device of the part that
made them (the last one, for a sequential model); `forward_backward` moves the
targets there. Split where the output of one part is the only input of the next:
a residual add whose operands were made on two devices fails, as it would in the
seeds' hand-written version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from scaletrain.errors import ConfigError
from scaletrain.strategies.devices import (
    DeviceMap,
    auto_device_map,
    check_device_map,
    resolve_device_map,
    visible_devices,
)

__all__ = ["DevicePlan", "Placement", "move_to_device", "place_module", "plan_device_map"]

# Attribute on the placed module holding its Placement, so placing it again first
# removes the previous hooks instead of stacking a second set.
_PLACEMENT_ATTR = "_scaletrain_placement"


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """Where every module goes and which modules move their inputs."""

    devices: dict[str, str]
    """Qualified module name ("" is the root) -> device string, for every module."""
    hooks: tuple[str, ...]
    """Modules that get a forward pre-hook moving their tensor inputs to their device."""


def plan_device_map(
    names: Sequence[str],
    device_map: DeviceMap,
    *,
    owner: str = "ModelParallel",
    type_name: str = "model",
) -> DevicePlan:
    """Apply the placement rule (module docstring) to module names in registration order.

    `names` is `[name for name, _ in model.named_modules()]`: the root "" first, then
    pre-order. Device strings are opaque here, so this is testable with fake names.
    """
    order = list(names)
    if not order or order[0] != "":
        raise ValueError("names must start with the root module's name ''")
    if not device_map:
        raise ConfigError(
            f"{owner}(device_map={{}}) is empty; expected submodule names mapped to devices, e.g. "
            "{'sub_net1': 'cuda:0', 'sub_net2': 'cuda:1'}, or 'auto'."
        )
    known = set(order)
    unknown = [k for k in device_map if k == "" or k not in known]
    if unknown:
        top = [n for n in order[1:] if "." not in n]
        nested = [n for n in order[1:] if "." in n]
        shown = ", ".join(nested[:24]) + (
            f", ... ({len(nested) - 24} more)" if len(nested) > 24 else ""
        )
        raise ConfigError(
            f"{owner}(device_map=...) names {', '.join(map(repr, unknown))}, which is not a "
            f"submodule of the {type_name}. Top-level submodules: {', '.join(top) or '(none)'}"
            + (f"; deeper ones: {shown}" if nested else "")
            + ". Keys are names as printed by model.named_modules(), e.g. 'blocks.0'."
        )
    first = next(device_map[n] for n in order if n in device_map)
    devices: dict[str, str] = {}
    hooks: list[str] = []
    named: list[tuple[str, str]] = []  # stack of (named ancestor, its device)
    previous = first
    for name in order:
        while named and not _is_within(name, named[-1][0]):
            named.pop()
        if name in device_map:
            device = device_map[name]
            named.append((name, device))
        elif named:
            device = named[-1][1]
        else:
            device = previous
        devices[name] = device
        parent = devices.get(name.rpartition(".")[0], device) if name else device
        if name == "" or name in device_map or device != parent or device != previous:
            hooks.append(name)
        previous = device
    return DevicePlan(devices=devices, hooks=tuple(hooks))


def _is_within(name: str, ancestor: str) -> bool:
    return name == ancestor or name.startswith(ancestor + ".")


def move_to_device(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor in it (nested tuples, lists, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple):
        items = [move_to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [move_to_device(v, device) for v in obj]
    if isinstance(obj, dict):
        moved = {k: move_to_device(v, device) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except TypeError:  # a dict subclass with another constructor
            return moved
    return obj


class _MoveInputs:
    """Forward pre-hook: the module's tensor inputs go to its device (picklable)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return move_to_device(args, self.device), move_to_device(kwargs, self.device)


@dataclass(slots=True)
class Placement:
    """A placed module's device per submodule and the hooks that move activations."""

    devices: dict[str, torch.device]
    """Qualified module name ("" is the root) -> the device of its own tensors."""
    hooked: tuple[str, ...]
    """Modules whose tensor inputs are moved to their device before their forward."""
    handles: list[RemovableHandle] = field(default_factory=list, repr=False)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _check_shared(module: nn.Module, devices: Mapping[str, str]) -> None:
    """Refuse a tensor (tied weights) owned by modules placed on two devices.

    Moving it for the second owner would take it away from the first one, whose
    forward would then fail mid-training with a device mismatch.
    """
    owners: dict[int, tuple[str, str]] = {}
    for mod_name, mod in module.named_modules():
        for kind in (mod._parameters, mod._buffers):
            for key, tensor in kind.items():
                if tensor is None:
                    continue
                qualified = f"{mod_name}.{key}" if mod_name else key
                device = devices[mod_name]
                first = owners.setdefault(id(tensor), (qualified, device))
                if first[1] != device:
                    raise ConfigError(
                        f"{first[0]} and {qualified} are the same tensor (tied weights), but "
                        f"the device map puts the first on {first[1]} and the second on "
                        f"{device}. A tensor lives on one device: map both modules to the "
                        "same device, or untie the weights."
                    )


def _apply_plan(module: nn.Module, plan: DevicePlan) -> Placement:
    """Move each module's own tensors to its device and register the input hooks.

    Each tensor is moved once, straight to its device (`_apply(recurse=False)` keeps
    the Parameter objects, so an optimizer built before setup still holds them), so
    a model too large for one device never has to fit on the first one.
    """
    previous = getattr(module, _PLACEMENT_ATTR, None)
    if isinstance(previous, Placement):
        previous.remove_hooks()
    devices = {name: torch.device(d) for name, d in plan.devices.items()}
    modules = dict(module.named_modules())
    for name, mod in modules.items():
        target = devices[name]
        mod._apply(lambda t, d=target: t.to(d), recurse=False)
    placement = Placement(devices=devices, hooked=plan.hooks)
    for name in plan.hooks:
        placement.handles.append(
            modules[name].register_forward_pre_hook(_MoveInputs(devices[name]), with_kwargs=True)
        )
    object.__setattr__(module, _PLACEMENT_ATTR, placement)
    return placement


def place_module(
    module: nn.Module,
    device_map: DeviceMap | str,
    *,
    devices: Sequence[str] | None = None,
    owner: str = "ModelParallel",
) -> Placement:
    """Place `module` by `device_map` ("auto" or names -> devices) and hook its boundaries.

    `devices` are the devices this process owns (default: every visible GPU, or the
    CPU): "auto" balances over them and "local:i" picks from them.
    """
    owned = list(devices) if devices is not None else visible_devices()
    if isinstance(device_map, str):
        check_device_map(device_map, owner)
        mapping = auto_device_map(module, owned)
    else:
        mapping = resolve_device_map(device_map, owned, owner)
    names = [name for name, _ in module.named_modules()]
    if mapping:
        plan = plan_device_map(names, mapping, owner=owner, type_name=type(module).__name__)
    else:  # "auto" on a module with no children: nothing to split
        plan = DevicePlan(devices=dict.fromkeys(names, owned[0]), hooks=("",))
    _check_shared(module, plan.devices)
    return _apply_plan(module, plan)
