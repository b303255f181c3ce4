"""Measuring a device: the FLOP/s of its matmuls (the ledger's measured peak, and a
calibration's achieved FLOP/s), here beside the facts it measures."""

from __future__ import annotations

import functools
import time
from typing import Any

__all__ = ["matmul_flops"]


def matmul_flops(
    device: Any, dtype: str, *, size: int | None = None, seconds: float = 0.3
) -> float:
    """FLOP/s of a square matmul in `dtype` on `device`, run for about `seconds`.

    `size`: the matrices' side (default 4096 on a GPU, 512 on a CPU). "fp8" is
    torch._scaled_mm's e4m3 matmul with a bf16 output (what float8 training's linears
    run), on a GPU that has one."""
    import torch

    cuda = torch.device(device).type == "cuda"
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    n = size or (4096 if cuda else 512)
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    mm: Any = torch.mm
    if dtype == "fp8":
        # _scaled_mm takes its second operand column-major, and a scale for each.
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device, dtype=torch.float32)
        mm = functools.partial(torch._scaled_mm, scale_a=one, scale_b=one,
                               out_dtype=torch.bfloat16)  # fmt: skip

    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        for _ in range(2):
            mm(a, b)
        if cuda:
            torch.cuda.synchronize(device)
        iters, start = 0, time.perf_counter()
        while True:
            for _ in range(4):
                mm(a, b)
            iters += 4
            if cuda:
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    peak = 2.0 * n**3 * iters / elapsed
    return peak
