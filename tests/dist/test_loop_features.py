"""Accumulation, clipping and precision on 2 real Gloo ranks, against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

K = 3  # micro-steps per optimizer step
MICRO = 4  # samples per rank per micro-step
STEPS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[step][micro][rank] batches of MICRO samples, as one tensor."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, K, world, MICRO, 6, generator=g) * 3
    y = torch.randint(0, 3, (STEPS, K, world, MICRO), generator=g)
    return x, y


def _job() -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy=st.DDP(bucket_cap_mb=1000))
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9))
    calls: list[int] = []

    # No annotations: DDP checks the hook's signature and insists on dist.GradBucket.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(None, counting_hook)
    x, y = _batches(rt.world_size)
    per_micro_calls: list[int] = []
    syncs: list[bool] = []
    losses: list[float] = []
    norms: list[float] = []
    for step in range(STEPS):
        for micro in range(K):
            before = len(calls)
            with rt.accumulate(model, steps=K) as acc:
                loss = rt.forward_backward(
                    model,
                    x[step, micro, rt.rank],
                    y[step, micro, rt.rank],
                    nn.functional.cross_entropy,
                )
            per_micro_calls.append(len(calls) - before)
            syncs.append(acc.sync)
            losses.append(float(loss))
            if acc.sync:
                norms.append(float(rt.clip_grad_norm(model, opt, max_norm=0.5)))
                rt.step(opt)
                opt.zero_grad()
    weights = {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()}
    rt.shutdown()
    return {
        "calls": per_micro_calls,
        "syncs": syncs,
        "losses": losses,
        "norms": norms,
        "weights": weights,
    }


def _reference(world: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batches(world)
    norms = []
    for step in range(STEPS):
        loss = nn.functional.cross_entropy(model(x[step].reshape(-1, 6)), y[step].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    return {"norms": norms, "weights": model.state_dict()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, 2, timeout=150)


def test_accumulation_skips_the_all_reduce_until_the_last_micro_step(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert r["syncs"] == [False, False, True] * STEPS
        # DDP's comm hook runs once per bucket per synchronised backward, never in no_sync.
        assert r["calls"] == [0, 0, 1] * STEPS


def test_accumulation_equals_one_step_on_the_k_times_larger_batch(
    results: list[dict[str, Any]],
) -> None:
    ref = _reference(2)
    for r in results:
        for name, value in ref["weights"].items():
            # float32; the gradient is summed in another order (micro-steps, ranks).
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_is_the_whole_model_norm(results: list[dict[str, Any]]) -> None:
    ref = _reference(2)
    for r in results:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert ref["norms"][0] > 0.5, "the test must actually clip"


def test_forward_backward_returns_the_true_loss_not_the_scaled_one(
    results: list[dict[str, Any]],
) -> None:
    x, y = _batches(2)
    first = nn.functional.cross_entropy(_model()(x[0, 0, 0]), y[0, 0, 0]).item()
    assert results[0]["losses"][0] == pytest.approx(first, rel=1e-6)
