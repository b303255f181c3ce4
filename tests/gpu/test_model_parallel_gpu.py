"""GPU variants of DataParallel, ModelParallel and DDP with model parallel.

Skipped without CUDA (conftest) and, per test, without enough GPUs. References
are computed on the CPU: GPU kernels sum in another order, so results agree to
float32 rounding (TF32 is off for float32 matmuls by default), not bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import launcher_variables, run_ranks
from scaletrain.train.models import GPT, GPTConfig, SplitNet

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

STEPS = 4
BATCH = 8


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(n: int) -> None:
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, found {_gpus()}")


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in launcher_variables():
        monkeypatch.delenv(var)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, 10, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _model() -> SplitNet:
    torch.manual_seed(1)
    return SplitNet()


def _cpu_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(rt: Any) -> tuple[nn.Module, list[float]]:
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for x, y in _batches():  # CPU batches: the hooks / DataParallel move them
        opt.zero_grad()
        losses.append(float(rt.forward_backward(model, x, y, nn.functional.cross_entropy)))
        opt.step()
    return model, losses


def _assert_matches_cpu(losses: list[float], weights: dict[str, torch.Tensor]) -> None:
    ref_losses, ref_weights = _cpu_reference()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key].cpu(), value, rtol=1e-5, atol=1e-6)


def test_split_net_across_two_gpus(single_process: None) -> None:
    _needs(2)
    import scaletrain as st
    from scaletrain.strategies.model_parallel import ModelParallel

    strategy = ModelParallel(device_map={"sub_net1": "cuda:0", "sub_net2": "cuda:1"})
    rt = st.init(strategy=strategy)
    try:
        model, losses = _train(rt)
        inner = rt.unwrap(model)
        assert inner.sub_net1.weight.device == torch.device("cuda", 0)
        assert inner.sub_net2.weight.device == torch.device("cuda", 1)
        out = rt.predict(model, torch.randn(3, 10))
        assert out.device == torch.device("cuda", 1)
        _assert_matches_cpu(losses, inner.state_dict())
    finally:
        rt.shutdown()


def test_auto_spreads_a_gpt_over_every_gpu(single_process: None) -> None:
    _needs(2)
    from scaletrain.strategies.model_parallel import place_module

    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    place_module(model, "auto")
    used = {p.device for p in model.parameters()}
    assert len(used) >= 2 and all(d.type == "cuda" for d in used)
    idx = torch.randint(0, 64, (2, 16))
    logits = model(idx)
    assert logits.device == model.head.weight.device
    logits.float().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_dp_over_all_gpus(single_process: None) -> None:
    _needs(2)
    import scaletrain as st

    rt = st.init(strategy="dp")
    try:
        model, losses = _train(rt)
        assert isinstance(model, nn.DataParallel)
        assert model.device_ids == list(range(_gpus()))
        weights = rt.unwrap(model).state_dict()
        assert not any(k.startswith("module.") for k in weights)
        # DataParallel sums the replicas' gradients of their slices of the batch.
        _assert_matches_cpu(losses, weights)
    finally:
        rt.shutdown()


def _ddp_mp_job() -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.strategies.ddp import DDP

    # The seeds' gpus = {0: [0, 1], 1: [2, 3]}[rank], in one line.
    strategy = DDP(device_map={"sub_net1": "local:0", "sub_net2": "local:1"})
    rt = st.init(strategy=strategy)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH, 10, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9))
    half = BATCH // 2
    for x, y in batches:  # rank r takes its half of each global batch
        xs, ys = x[rt.rank * half : (rt.rank + 1) * half], y[rt.rank * half : (rt.rank + 1) * half]
        opt.zero_grad()
        rt.forward_backward(model, xs, ys, nn.functional.cross_entropy)
        opt.step()
    res = {
        "devices": [str(bare.sub_net1.weight.device), str(bare.sub_net2.weight.device)],
        "wrapped": type(model).__name__,
        "weights": {k: v.detach().cpu() for k, v in bare.state_dict().items()},
    }
    del model, opt
    rt.shutdown()
    return res


def test_ddp_with_model_parallel_two_gpus_per_process() -> None:
    _needs(4)
    results = run_ranks(_ddp_mp_job, 2, timeout=200)
    assert results[0]["devices"] == ["cuda:0", "cuda:1"]
    assert results[1]["devices"] == ["cuda:2", "cuda:3"]
    _, ref_weights = _cpu_reference()
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel"
        for key, value in ref_weights.items():
            torch.testing.assert_close(r["weights"][key], value, rtol=1e-5, atol=1e-6)
