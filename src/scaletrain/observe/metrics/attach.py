"""How a Runtime gets its ledger and puts it on a model, an optimizer and a loader.

The runtime passes plain values (rank, device, a gather function): observe imports
nothing of the training stack.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.observe.metrics.ledger import Gather, LedgerConfig, StepLedger

__all__ = ["LEDGER_ENV", "RUN_DIR_ENV", "attach_model", "create_ledger"]

LEDGER_ENV = "SCALETRAIN_LEDGER"
"""0 turns the ledger off for every st.init in the process (benchmarks compare on/off)."""
RUN_DIR_ENV = "SCALETRAIN_RUN_DIR"
"""Where a ledger without `out` writes its records."""


def _config(value: LedgerConfig | bool | None) -> LedgerConfig | None:
    if os.environ.get(LEDGER_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if value is None or value is True:
        value = LedgerConfig()
    if value is False:
        return None
    if not isinstance(value, LedgerConfig):
        raise ConfigError(
            f"ledger={value!r} is not a ledger setting; expected True, False or "
            "st.LedgerConfig(out=..., every=50). Fix: pass ledger=False to turn it off."
        )
    if value.summary not in (True, False, "line", "table"):
        raise ConfigError(
            f"LedgerConfig(summary={value.summary!r}): expected 'line' (one line at the end), "
            "'table' (the phase table) or False (nothing). Fix: pass e.g. "
            "LedgerConfig(summary='table')."
        )
    if value.every < 1:
        raise ConfigError(
            f"LedgerConfig(every={value.every!r}): expected steps per window >= 1. "
            "Fix: pass e.g. LedgerConfig(every=50)."
        )
    return value


def create_ledger(
    value: LedgerConfig | bool | None,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    device: Any,
    backend: str,
    peer_group: int,
    precision: str,
    gather: Gather | None,
) -> StepLedger | None:
    """The ledger st.init gives a Runtime (None when turned off)."""
    config = _config(value)
    if config is None:
        return None
    if config.out is None and os.environ.get(RUN_DIR_ENV):
        config = LedgerConfig(
            out=os.environ[RUN_DIR_ENV],
            every=config.every,
            flops=config.flops,
            summary=config.summary,
            stragglers=config.stragglers,
        )
    from scaletrain.observe.metrics.memory import MemorySampler

    if getattr(device, "type", str(device)) == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(device)
    else:
        import platform

        device_name = f"cpu ({platform.processor() or platform.machine()})"
    ledger = StepLedger(
        config,
        rank=rank,
        world_size=world_size,
        device=device,
        backend=backend,
        peer_group=peer_group,
        precision=precision,
        local_world_size=local_world_size,
        gather=gather,
        device_name=device_name,
    )
    ledger.memory = MemorySampler(device)
    return ledger


def attach_model(ledger: StepLedger, model: Any, optimizer: Any | None) -> None:
    """Hooks on the wrapped model (and DDP's buckets) and the optimizer; FLOP counting
    and the peak measurement for MFU when the config asks for them."""
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.observe.metrics.hooks import (
        watch_compile,
        watch_ddp,
        watch_module,
        watch_optimizer,
        watch_stages,
    )
    from scaletrain.observe.metrics.memory import current_rss_bytes, reset_rss_peak

    if not watch_stages(ledger, model):
        watch_module(ledger, model)
    if isinstance(model, DistributedDataParallel):
        watch_ddp(ledger, model)
    if optimizer is not None:
        watch_optimizer(ledger, optimizer)
    watch_compile(ledger)  # now if a compiled model loaded dynamo, else at a forward
    if ledger.config.flops and ledger.flops is None:
        from scaletrain.observe.metrics.flops import (
            FlopCounter,
            datasheet_peak,
            measure_peak,
            peak_dtype,
        )

        ledger.peak_dtype = peak_dtype(ledger.precision, ledger.device_type)
        ledger.peak_datasheet = (
            datasheet_peak(ledger.device_name, ledger.peak_dtype)
            if ledger.device_type == "cuda"
            else None
        )
        ledger.peak_measured = measure_peak(
            ledger.device,
            ledger.peak_dtype,
            device_name=ledger.device_name,
            processes=ledger.local_world_size,
        )
        ledger.flops = FlopCounter()
    # Where training's memory starts (data and model built and wrapped, the FLOP/s peak
    # measured): the peaks count from here, so rss_peak - rss_setup is what training
    # itself adds (what `scaletrain plan --check` compares with its prediction on a
    # CPU), and CUDA's allocated_peak is the model's and training's, not the peak
    # measurement's matrices (3 x 64 MiB at 4096 x 4096 fp32: a 1-process split-net
    # run on an H200 reported 257 MiB, its plan 0.02).
    ledger.rss_setup = current_rss_bytes() if reset_rss_peak() else None
    if ledger.device_type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(ledger.device)
