"""GPU variants: NCCL backend and one device per local rank. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def _job() -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy="ddp")
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8, device=rt.device)
    model(x).sum().backward()
    opt.step()
    total = rt.reduce({"one": torch.ones((), device=rt.device)}, op="sum")["one"]
    res = {
        "backend": rt.backend,
        "device": str(rt.device),
        "param_device": str(next(model.parameters()).device),
        "current": torch.cuda.current_device(),
        "sum": float(total),
        "sum_device": str(total.device),
    }
    rt.shutdown()
    return res


def test_nccl_one_gpu_per_local_rank() -> None:
    n = min(torch.cuda.device_count(), 2)
    if n < 1:
        pytest.skip("needs a CUDA GPU")
    results = run_ranks(_job, n, timeout=200)
    for rank, r in enumerate(results):
        assert r["backend"] == "nccl"
        assert r["device"] == f"cuda:{rank}" == r["param_device"] == r["sum_device"]
        assert r["current"] == rank
        assert r["sum"] == n


def test_single_process_on_gpu_picks_cuda0(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    import scaletrain as st

    rt = st.init()
    try:
        assert rt.backend == "nccl" and rt.device == torch.device("cuda", 0)
        bare = nn.Linear(2, 2)
        model = rt.setup(bare)
        assert next(model.parameters()).is_cuda
    finally:
        rt.shutdown()
