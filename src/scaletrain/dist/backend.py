"""Choosing the communication backend and the device of this process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError, spell

__all__ = ["BACKENDS", "choose_backend", "choose_device"]

BACKENDS = ("nccl", "gloo", "mpi")


def choose_backend(requested: str | None, *, cuda: bool | None = None) -> str:
    """NCCL where there are GPUs, Gloo on CPUs; an explicit choice is checked, not trusted."""
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    if requested is None or requested == "auto":
        return "nccl" if has_cuda and dist.is_nccl_available() else "gloo"
    name = requested.lower()
    if name not in BACKENDS:
        raise ConfigError(
            f"{spell('backend', requested)} is not a torch.distributed backend scaletrain can "
            f"use; expected one of {', '.join(BACKENDS)} or 'auto'. Fix: leave it unset to get "
            "NCCL on GPUs and Gloo on CPUs.",
            field="backend",
        )
    if name == "nccl" and not (has_cuda and dist.is_nccl_available()):
        raise ConfigError(
            f"{spell('backend', 'nccl')} needs CUDA GPUs and a PyTorch build with NCCL, but "
            f"here torch sees {'a GPU' if has_cuda else 'no GPU'} and NCCL is "
            f"{'available' if dist.is_nccl_available() else 'not built in'}. Fix: "
            f"{spell('backend', 'gloo')} (or leave it unset) to train on CPUs.",
            field="backend",
        )
    if name == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            "backend='mpi' needs a PyTorch built from source against MPI; this build has no MPI "
            "backend. Use backend='gloo' or 'nccl'; scaletrain can still run *under* mpirun "
            "(it reads OMPI_COMM_WORLD_* / PMI_* and uses Gloo or NCCL)."
        )
    return name


def choose_device(local_rank: int, *, backend: str, device: str | None = None) -> torch.device:
    """One GPU per local rank where there are GPUs (the seeds' `cuda:<local_rank>`), else CPU."""
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"device={device!r}: expected a torch device name: 'cpu', 'cuda' (this "
                "process's GPU) or 'cuda:N'. Fix: e.g. device='cuda', or leave it out (a GPU "
                "per process where there are GPUs, else the CPU)."
            ) from None
        if dev.type == "cuda":
            count = torch.cuda.device_count()
            index = dev.index if dev.index is not None else local_rank
            if index >= count:
                fix = (
                    f"Start at most {count} processes per node or check CUDA_VISIBLE_DEVICES"
                    if count
                    else "Fix: device='cpu', or leave device out (the CPU where there is no "
                    "GPU), or run on a machine with GPUs (and a CUDA build of torch)"
                )
                raise ConfigError(
                    f"device={device!r} (local rank {local_rank}) names GPU {index}, but this "
                    f"node has {count} visible GPU(s). {fix}."
                )
            return torch.device("cuda", index)
        return dev
    if backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(
                f"local rank {local_rank} has no GPU of its own: this node has {count} visible "
                f"GPU(s). Start at most {count} processes per node (--nproc-per-node {count})."
            )
        return torch.device("cuda", local_rank)
    if backend == "gloo" and torch.cuda.is_available():
        # Gloo can move CUDA tensors; a user who asks for Gloo on a GPU box still trains on GPUs.
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
    return torch.device("cpu")
