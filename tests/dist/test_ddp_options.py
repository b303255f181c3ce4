"""DDP's options on 2 real Gloo ranks: hooks, static graph, buckets, no_sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "static_bucket": {"static_graph": True, "bucket_cap_mb": 0.001, "gradient_as_bucket_view": False},
    "fp16": {"comm_hook": "fp16"},
    "powersgd": {"comm_hook": "powersgd", "powersgd_start_iter": 2},
}  # fmt: skip
STEPS = 4


def _train(rt: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    import scaletrain as st

    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(bare.parameters(), lr=0.05)
    rt.strategy = st.DDP(**config)
    model, opt = rt.setup(bare, opt)
    g = torch.Generator().manual_seed(100 + rt.rank)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()}


def _job() -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy="ddp")
    out = {name: _train(rt, cfg) for name, cfg in CONFIGS.items()}
    # no_sync: gradients stay local inside the block, then sync on the next backward.
    torch.manual_seed(0)
    bare = nn.Linear(4, 1, bias=False)
    model = rt.setup(bare)
    with rt.no_sync(model):
        model(torch.full((1, 4), float(rt.rank + 1))).sum().backward()
    out["local_grad"] = bare.weight.grad.clone()
    rt.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, 2, timeout=150)


def test_replicas_agree_for_every_config(results: list[dict[str, Any]]) -> None:
    for name in CONFIGS:
        for key, value in results[0][name].items():
            assert torch.equal(results[1][name][key], value), (name, key)


def test_options_that_keep_the_math_match_the_default(results: list[dict[str, Any]]) -> None:
    ref = results[0]["default"]
    for key, value in results[0]["static_bucket"].items():
        torch.testing.assert_close(value, ref[key], rtol=1e-6, atol=1e-7)
    # fp16 compression rounds the gradients: close, not equal.
    for key, value in results[0]["fp16"].items():
        torch.testing.assert_close(value, ref[key], rtol=1e-3, atol=1e-4)
    # PowerSGD is a low-rank approximation after its start iteration: it trains,
    # differently; it must stay finite and move away from the init.
    for value in results[0]["powersgd"].values():
        assert torch.isfinite(value).all()


def test_no_sync_keeps_gradients_local(results: list[dict[str, Any]]) -> None:
    assert results[0]["local_grad"].tolist() == [[1.0] * 4]
    assert results[1]["local_grad"].tolist() == [[2.0] * 4]
