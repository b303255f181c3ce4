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


def _collectives_job(backend: str) -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    import scaletrain as st

    device = "cuda:0" if backend == "gloo" else None  # Gloo: every rank on the one GPU
    rt = st.init(strategy="ddp", backend=backend, device=device, precision="bf16-mixed")
    r = rt.rank
    loader = rt.loader(TensorDataset(torch.arange(7)), batch_size=2, seed=1)
    seen = [rt.gather_for_metrics(idx.to(rt.device)) for (idx,) in loader]
    with rt.autocast():
        dtype = (torch.ones(2, 2, device=rt.device) @ torch.ones(2, 2, device=rt.device)).dtype
    res = {
        "gather": rt.gather(torch.arange(r + 1, device=rt.device) + 10 * r),
        "metrics": torch.cat(seen),
        "bcast": rt.broadcast_object({"from": r}, src=rt.world_size - 1),
        "autocast": dtype,
    }
    rt.shutdown()
    return res


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gather_broadcast_and_autocast_on_the_gpu(backend: str) -> None:
    # NCCL needs a GPU per rank; Gloo ranks may share one (the rows travel on the CPU).
    n = min(torch.cuda.device_count(), 2) if backend == "nccl" else 2
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    for res in run_ranks(_collectives_job, n, backend, timeout=200):
        assert res["gather"].is_cuda and res["metrics"].is_cuda
        assert res["gather"].tolist() == [v + 10 * q for q in range(n) for v in range(q + 1)]
        assert sorted(res["metrics"].tolist()) == list(range(7))
        assert res["bcast"] == {"from": n - 1}
        assert res["autocast"] == torch.bfloat16
