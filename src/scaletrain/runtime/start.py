"""`scaletrain.init()`: detect the job, check the strategy, join the process group."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from scaletrain import dist as _dist
from scaletrain.dist.topology import Topology, parse_mesh
from scaletrain.env import detect
from scaletrain.env.base import ClusterEnv
from scaletrain.observe.metrics.ledger import LedgerConfig
from scaletrain.precision import Precision
from scaletrain.runtime.core import Runtime, current, set_current
from scaletrain.strategies import Strategy, resolve_strategy
from scaletrain.strategies.float8 import float8_note

__all__ = ["init", "sync_batchnorm"]


def init(
    strategy: str | Strategy | None = "ddp",
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout: float = _dist.DEFAULT_TIMEOUT_S,
    env: ClusterEnv | str | None = None,
    mesh: Mapping[str, int] | str | None = None,
    precision: str = "32",
    ledger: LedgerConfig | bool = True,
) -> Runtime:
    """Detect the environment, join the process group, pin the device.

    strategy: a name ("ddp", "single") or a strategy object (st.DDP(...)).
    backend: "nccl" / "gloo" / None for NCCL on GPUs and Gloo on CPUs.
    device: override the device ("cpu", "cuda:1"); default one GPU per local rank.
    timeout: seconds a collective may wait for a peer before failing.
    env: a ClusterEnv, or the name of a kind to force ("slurm"); default: detect.
    mesh: {"dp": 2, "tp": 2} (or "dp=2,tp=2") lays the ranks on a DeviceMesh to
        compose data parallel (the strategy: DDP or FSDP) with tensor ("tp") and
        pipeline ("pp") parallel. The sizes must multiply to the world size.
    precision: "32", "bf16-mixed", "fp16-mixed" (CUDA) or "bf16-true".
    ledger: the step ledger (where each rank's time goes; on by default):
        st.LedgerConfig(out="runs/x", every=50), or False to turn it off.
    """
    cluster = env if isinstance(env, ClusterEnv) else detect(kind=env)
    chosen = _dist.choose_backend(backend)
    dev = _dist.choose_device(cluster.local_rank, backend=chosen, device=device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shape = parse_mesh(mesh, cluster.world_size)
    strat = resolve_strategy(strategy, mesh=shape)
    topo = Topology.resolve(
        cluster, device=dev, backend=chosen, mesh=shape, implicit_dim=strat.mesh_dim
    )
    prec = Precision(name=precision, device=dev)
    strat.adopt_precision(prec, topo)
    # Check the strategy before any peer is contacted: a bad config fails fast, alone.
    strat.validate(topo)
    note = float8_note(strat.compile) if strat.float8 else None
    if note is not None and topo.rank == 0:
        print(f"scaletrain: note: {note}", file=sys.stderr)
    home = strat.home_device(topo)
    if home != dev:
        topo = dataclasses.replace(topo, device=home)
        prec.device = home
        if home.type == "cuda":
            torch.cuda.set_device(home)
    rt = Runtime(env=cluster, strategy=strat, precision=prec, topology=topo)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _dist.init_process_group(cluster, backend=chosen, device=rt.device, timeout_s=timeout)
    if prec.scaler is not None:
        prec.share_overflow(strat.model_parallel_group(topo))
    from scaletrain.observe.metrics.attach import create_ledger

    rt.ledger = create_ledger(
        ledger,
        rank=rt.rank,
        world_size=rt.world_size,
        local_world_size=cluster.local_world_size,
        device=rt.device,
        backend=chosen,
        peer_group=topo.coordinate("pp"),  # peers do the same work: one pipeline stage
        precision=prec.name,
        gather=functools.partial(_dist.all_gather_floats, world_size=rt.world_size),
    )
    set_current(rt)
    return rt


def sync_batchnorm(model: nn.Module, process_group: Any = None) -> nn.Module:
    """Make BatchNorm layers use the statistics of the whole global batch.

    Call it on the bare model, before rt.setup(). On CUDA it converts to PyTorch's
    nn.SyncBatchNorm; on CPU (where PyTorch's raises and DDP refuses it) to
    scaletrain's own, which is autograd-correct: forward, running statistics and
    gradients equal BatchNorm on the concatenated batch. The statistics are reduced
    over the data-parallel ranks (the "dp" mesh dimension, else all ranks). With
    one data-parallel replica there is nothing to synchronise and the model is
    returned as is. Without st.init() the device of each layer decides.
    """
    from scaletrain.dist.sync_batchnorm import sync_batchnorm as convert

    rt = current()
    if rt is None:
        return convert(model, process_group)
    if rt.dp_size == 1:
        return model
    group = process_group
    if group is None and rt.mesh_shape is not None and "dp" in rt.mesh_shape:
        group = rt.device_mesh("dp").get_group()
    if rt.device.type == "cuda":
        return convert(model, group, implementation="torch")
    return convert(model, group, implementation="scaletrain")
