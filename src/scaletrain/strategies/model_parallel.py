"""Single-process model parallel: submodules on several devices from a device map.

The seeds' `Net("cuda:0", "cuda:1")` hard-codes `.to(gpu)` calls into the model.
Here the model stays plain and a map says where each part lives:

    st.ModelParallel(device_map={"sub_net1": "cuda:0", "sub_net2": "cuda:1"})
    st.ModelParallel(device_map="auto")          # balance parameters over local GPUs

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

Device strings: "cuda:1", "cpu", or "local:i", the i-th device of this process
(with one process that is GPU i; under `st.DDP(device_map=...)` the process with
local rank r owning k devices has GPUs r*k .. r*k+k-1). Where no GPU is visible
every "local:i" is the CPU, so one script runs on a laptop and on a GPU node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from scaletrain.errors import ConfigError
from scaletrain.plan import list_layers, list_units, split_layers
from scaletrain.strategies.base import Strategy, register

if TYPE_CHECKING:
    from scaletrain.runtime import Runtime

__all__ = [
    "DevicePlan",
    "ModelParallel",
    "Placement",
    "auto_device_map",
    "check_device_map",
    "local_devices_needed",
    "move_to_device",
    "place_module",
    "plan_device_map",
    "process_devices",
    "resolve_device_map",
    "visible_devices",
]

DeviceMap = Mapping[str, str]

_LOCAL = re.compile(r"^local:(\d+)$")
# Attribute on the placed module holding its Placement, so placing it again first
# removes the previous hooks instead of stacking a second set.
_PLACEMENT_ATTR = "_scaletrain_placement"


# -- pure logic: no devices touched --------------------------------------------------
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


def auto_device_map(model: nn.Module, devices: Sequence[str]) -> dict[str, str]:
    """A contiguous split of the model's layers over `devices`, balanced by parameter count.

    Layers and the balance are scaletrain.plan's, the same as pipeline stages': the
    top-level children (a ModuleList's entries counted one by one, a single wrapping
    child opened) in registration order, cut so that the device holding the most
    parameters holds as few as possible, ties going to the most even split. A layer
    never straddles two devices; with more devices than layers the first ones are
    used. Modules without parameters stay with the layer before them (the first
    device when no module holds any). A parameter shared by two layers is counted
    once, in the first.
    """
    devs = list(devices)
    if not devs:
        raise ConfigError("auto_device_map() needs at least one device, got none.")
    layers = list_layers(model)
    if not layers:
        return {name: devs[0] for name, _ in list_units(model)}
    parts = split_layers(layers, len(devs))
    return {
        member: device
        for device, part in zip(devs, parts, strict=False)
        for layer in part
        for member in layer.members
    }


def check_device_map(device_map: object, owner: str) -> None:
    """Check the shape of a device map at construction: names to device strings or 'auto'."""
    example = "{'sub_net1': 'cuda:0', 'sub_net2': 'cuda:1'}"
    if isinstance(device_map, str):
        if device_map != "auto":
            raise ConfigError(
                f"{owner}(device_map={device_map!r}) is not a device map; expected 'auto' "
                f"or a dict of submodule names to devices, e.g. {example}."
            )
        return
    if not isinstance(device_map, Mapping):
        raise ConfigError(
            f"{owner}(device_map=...) got a {type(device_map).__name__}; expected 'auto' or "
            f"a dict of submodule names to devices, e.g. {example}."
        )
    if not device_map:
        raise ConfigError(
            f"{owner}(device_map={{}}) is empty; name the submodules and their devices, "
            f"e.g. {example}, or pass 'auto'."
        )
    for key, value in device_map.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"{owner}(device_map=...) has the key {key!r}; keys are submodule names "
                "as printed by model.named_modules(), e.g. 'sub_net1' or 'blocks.0'."
            )
        if not isinstance(value, str):
            raise ConfigError(
                f"{owner}(device_map=...) maps {key!r} to {value!r}; devices are strings "
                "such as 'cuda:0', 'cpu' or 'local:0' (this process's first device)."
            )
        if _LOCAL.match(value):
            continue
        try:
            torch.device(value)
        except (RuntimeError, ValueError) as err:
            raise ConfigError(
                f"{owner}(device_map=...) maps {key!r} to {value!r}, which is not a device "
                "string; expected e.g. 'cuda:0', 'cpu' or 'local:0' (this process's "
                "first device)."
            ) from err


def local_devices_needed(device_map: DeviceMap) -> int:
    """1 + the highest "local:i" index in the map (0 if it names no local device)."""
    indices = [int(m.group(1)) for v in device_map.values() if (m := _LOCAL.match(v))]
    return max(indices) + 1 if indices else 0


def process_devices(local_rank: int, devices_per_process: int, *, gpu_count: int) -> list[str]:
    """The devices a process owns: local rank r with k per process owns GPUs r*k .. r*k+k-1.

    The seeds' `gpus = {0: [0, 1], 1: [2, 3]}[rank]` is `process_devices(rank, 2, ...)`.
    Without GPUs every one of them is the CPU.
    """
    if devices_per_process < 1:
        raise ConfigError(f"devices_per_process={devices_per_process!r} must be >= 1.")
    if gpu_count == 0:
        return ["cpu"] * devices_per_process
    first = local_rank * devices_per_process
    owned = [f"cuda:{first + i}" for i in range(devices_per_process)]
    if first + devices_per_process > gpu_count:
        fit = max(gpu_count // devices_per_process, 1)
        raise ConfigError(
            f"the process with local rank {local_rank} owns {devices_per_process} devices "
            f"({', '.join(owned)}), but this node has {gpu_count} visible GPU(s) "
            f"(cuda:0 .. cuda:{gpu_count - 1}). With {devices_per_process} GPUs per process "
            f"start at most {fit} process(es) per node (--nproc-per-node {fit}), or lower "
            "devices_per_process / the 'local:i' indices in the device map."
        )
    return owned


def visible_devices() -> list[str]:
    """This machine's devices for a device map: every visible GPU, or ["cpu"]."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def resolve_device_map(device_map: DeviceMap, devices: Sequence[str], owner: str) -> dict[str, str]:
    """Turn "local:i" into this process's i-th device and check every device exists.

    `devices` are the devices this process owns (`process_devices`); absolute names
    ("cuda:3") are checked against every visible device.
    """
    owned = list(devices)
    available = visible_devices()
    cpu_only = available == ["cpu"]
    resolved: dict[str, str] = {}
    for key, value in device_map.items():
        match = _LOCAL.match(value)
        if match:
            index = int(match.group(1))
            if all(d == "cpu" for d in owned) or cpu_only:
                resolved[key] = "cpu"
                continue
            if index >= len(owned):
                raise ConfigError(
                    f"{owner}: device_map[{key!r}] = {value!r} names this process's device "
                    f"#{index}, but it owns {len(owned)}: {', '.join(owned)}. Use local:0 .. "
                    f"local:{len(owned) - 1}, or give more devices to each process "
                    "(devices_per_process)."
                )
            resolved[key] = owned[index]
            continue
        device = torch.device(value)
        if device.type == "cuda" and device.index is None and not cpu_only:
            device = torch.device("cuda", torch.cuda.current_device())
        name = str(device)
        if name not in available and device.type != "cpu":
            hint = (
                "this machine has no GPU: name 'cpu' for every part (or 'local:i', which "
                "means the CPU where no GPU is visible)"
                if cpu_only
                else "name one of those, or check CUDA_VISIBLE_DEVICES"
            )
            raise ConfigError(
                f"{owner}: device_map[{key!r}] = {value!r} names a device this machine does "
                f"not have; available: {', '.join(available)}. Fix: {hint}."
            )
        resolved[key] = name
    return resolved


# -- placing a real module ---------------------------------------------------------------
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


# -- the strategy -------------------------------------------------------------------------
@register
@dataclass(kw_only=True, slots=True)
class ModelParallel(Strategy):
    """One process, the model's submodules on several devices (the seeds' `Net(gpus)`).

    Only one device computes at a time: this fits a model too large for one GPU,
    it does not make it faster. For speed across processes add data parallel
    (`st.DDP(device_map=...)`) or use pipeline parallel.
    """

    name: ClassVar[str] = "model-parallel"

    device_map: dict[str, str] | str = "auto"
    """Submodule name -> device ("cuda:0", "cpu", "local:i"), or "auto" to balance parameters."""

    def __post_init__(self) -> None:
        check_device_map(self.device_map, "ModelParallel")

    def _validate(self, rt: Runtime) -> None:
        if rt.world_size > 1:
            raise ConfigError(
                f"strategy 'model-parallel' places one model over the devices of ONE process, "
                f"but this job has {rt.world_size} processes, which would each train alone. "
                "For several processes each owning several devices use "
                "st.DDP(device_map={'sub_net1': 'local:0', 'sub_net2': 'local:1'}) "
                "(DDP with model parallel), or start a single process."
            )
        if isinstance(self.device_map, Mapping):
            resolve_device_map(self.device_map, visible_devices(), "ModelParallel")

    def _setup_module(self, module: nn.Module, rt: Runtime) -> nn.Module:
        place_module(module, self.device_map, owner="ModelParallel")
        return module

    def _setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, rt: Runtime
    ) -> torch.optim.Optimizer:
        _follow_parameters(optimizer)
        return optimizer


def _follow_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Move optimizer state (momentum, Adam moments) to the device of its parameter.

    Placement keeps the Parameter objects, so the optimizer still holds them; state
    from steps taken before setup would stay behind on the old device.
    """
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        for key, value in state.items():
            # Scalar step counters live on the CPU on purpose (torch.optim); leave them.
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[key] = value.to(param.device)
