"""PyTorch's collective flight recorder: turning it on, and reading its traces on a hang."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError

__all__ = ["FLIGHT_RECORDER_DIR", "configure_flight_recorder", "dump_traces"]

FLIGHT_RECORDER_DIR = "flight_recorder"
"""Sub-directory of the run directory for the collective traces, one file per rank
named rank_<r>: the layout `python -m torch.distributed.flight_recorder.fr_trace DIR`
reads."""


def configure_flight_recorder(
    run_dir: Path | str,
    *,
    buffer_size: int = 2000,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Turn on PyTorch's collective flight recorder; call BEFORE the process group exists.

    Sets the variables torch reads when it creates a process group, where the user has
    not set them already (under either name): TORCH_FR_BUFFER_SIZE (entries kept per
    rank), TORCH_FR_DUMP_TEMP_FILE (where NCCL's own dump on a collective timeout goes:
    run_dir/flight_recorder/rank_<r>) and TORCH_NCCL_DUMP_ON_TIMEOUT=1. Torch before the
    vendor-neutral recorder (pytorch/pytorch#152563, 2.8) reads the older names
    TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE, which newer torch
    warns about: only the names this torch reads are set. The watchdog dumps the same
    recorder on a hang, on Gloo too where torch records Gloo collectives (>= 2.8).
    Returns what it set.
    """
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ConfigError(
            f"buffer_size={buffer_size!r} must be a positive integer (collectives kept "
            "per rank), e.g. 2000."
        )
    env = os.environ if environ is None else environ
    fr_dir = Path(run_dir) / FLIGHT_RECORDER_DIR
    # NCCL writes its own dump with a plain ofstream: the directory must exist first.
    fr_dir.mkdir(parents=True, exist_ok=True)
    new_names = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
    settings: list[tuple[tuple[str, str], str]] = [
        (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(buffer_size)),
        (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), f"{fr_dir}/rank_"),
        (("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"), "1"),
    ]
    done: dict[str, str] = {}
    for (new, old), value in settings:
        if new in env or old in env:
            continue  # the user's own choice, under either name, wins
        name = new if new_names else old
        env[name] = value
        done[name] = value
    if done and environ is None and dist.is_available() and dist.is_initialized():
        warnings.warn(
            "configure_flight_recorder() was called after the process group was created: "
            "the recorder's size is read when the group is created, so it may stay off. "
            "Call it before scaletrain.init().",
            stacklevel=2,
        )
    return done


def _flight_recorder_traces() -> list[tuple[str, bytes]]:
    """This process's non-empty flight recorder traces: ("nccl"|"cpu", pickle bytes).

    NCCL keeps its own recorder (dumped by _dump_nccl_trace, CUDA builds only); Gloo
    and other CPU backends record into the generic one (_dump_fr_trace, torch >= 2.8).
    Both take their own lock, so dumping from this thread while the main thread waits
    in a collective is what they are built for (NCCL's own watchdog does the same).
    """
    c10d: Any = torch._C._distributed_c10d
    found: list[tuple[str, bytes]] = []
    for kind, name in (("nccl", "_dump_nccl_trace"), ("cpu", "_dump_fr_trace")):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = bytes(fn())
            if pickle.loads(data).get("entries"):
                found.append((kind, data))
        except Exception:
            continue
    return found


def dump_traces(run_dir: Path, rank: int) -> tuple[set[str], list[Path]]:
    """Write this rank's non-empty traces under run_dir: (their kinds, the files written)."""
    kinds: set[str] = set()
    written: list[Path] = []
    for i, (kind, data) in enumerate(_flight_recorder_traces()):
        kinds.add(kind)
        # The first (NCCL's where there is one) gets the analyzer's default layout.
        folder = run_dir / FLIGHT_RECORDER_DIR
        if i > 0:
            folder = folder / kind
        target = folder / f"rank_{rank}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append(target)
        except OSError as exc:
            print(f"scaletrain: cannot write {target}: {exc}", file=sys.stderr, flush=True)
    return kinds, written
