"""Device maps as the user writes them: their shape, "local:i", the devices a process owns.

Device strings: "cuda:1", "cpu", or "local:i", the i-th device of this process
(with one process that is GPU i; under `st.DDP(device_map=...)` the process with
local rank r owning k devices has GPUs r*k .. r*k+k-1). Where no GPU is visible
every "local:i" is the CPU, so one script runs on a laptop and on a GPU node.
"auto" balances the model's layers over the devices (scaletrain.strategies.partition).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from scaletrain.errors import ConfigError, article
from scaletrain.strategies.partition import list_layers, list_units, split_layers

__all__ = [
    "DeviceMap",
    "auto_device_map",
    "check_device_map",
    "local_devices_needed",
    "process_devices",
    "resolve_device_map",
    "visible_devices",
]

DeviceMap = Mapping[str, str]

_LOCAL = re.compile(r"^local:(\d+)$")


def auto_device_map(model: nn.Module, devices: Sequence[str]) -> dict[str, str]:
    """A contiguous split of the model's layers over `devices`, balanced by parameter count.

    Layers and the balance are scaletrain.strategies.partition's, the same as pipeline
    stages': the top-level children (ModuleList, ModuleDict and nn.Sequential entries
    counted one by one at any depth, a single wrapping child opened) in registration
    order, under their qualified names ("trunk.3"), cut so that the device holding the most
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
            f"{owner}(device_map=...) got {article(type(device_map).__name__)}; expected 'auto' or "
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
