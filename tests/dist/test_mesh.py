"""2-D meshes on 4 real Gloo ranks: FSDP x tensor and DDP x pipeline equal one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks
from scaletrain.train.models import GPT, GPTConfig

pytestmark = pytest.mark.timeout(300)

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS = 3
PER_REPLICA = 4
DP = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(SMALL)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(
        0, SMALL.vocab_size, (STEPS, DP, PER_REPLICA, SMALL.block_size + 1), generator=g
    )
    return tokens[..., :-1], tokens[..., 1:]


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _train(strategy: str, mesh: dict[str, int] | None, strategy_obj: Any = None) -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy=strategy_obj or strategy, mesh=mesh)
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9))
    x, y = _data()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = rt.forward_backward(model, x[step, rt.dp_rank], y[step, rt.dp_rank], _loss)
        norm = rt.clip_grad_norm(model, opt, max_norm=1e9)  # measures, does not clip
        opt.step()
        losses.append((float(loss), float(norm)))
    out = {
        "kind": type(rt.strategy).__name__,
        "dp": (rt.dp_rank, rt.dp_size),
        "losses": losses,
        "weights": rt.full_state_dict(model),
        "predict": rt.predict(model, x[0, 0]).float().cpu(),
    }
    rt.shutdown()
    return out


def _job_fsdp_tp() -> dict[str, Any]:
    return _train("fsdp", {"dp": DP, "tp": 2})


def _job_ddp_pp() -> dict[str, Any]:
    import scaletrain as st

    return _train("ddp", {"dp": DP, "pp": 2}, st.Pipeline(schedule="1f1b", microbatches=2))


def _job_fsdp_alone() -> dict[str, Any]:
    return _train("fsdp", None)


def _job_tensor_alone() -> dict[str, Any]:
    return _train("tensor", None)


def _reference(replicas: int = DP) -> dict[str, Any]:
    """One process on the global batch: the first `replicas` replicas' batches."""
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        # Every replica's loss is the mean over its batch; data parallel averages the
        # replicas: the mean over the concatenated global batch.
        loss = _loss(
            model(x[step, :replicas].reshape(-1, SMALL.block_size)),
            y[step, :replicas].reshape(-1, SMALL.block_size),
        )
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        losses.append((loss.item(), norm.item()))
    with torch.no_grad():
        predict = model(x[0, 0])
    return {"losses": losses, "weights": model.state_dict(), "predict": predict}


def _check(results: list[dict[str, Any]], kind: str) -> None:
    ref = _reference()
    assert [r["kind"] for r in results] == [kind] * 4
    assert sorted(r["dp"] for r in results) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for step in range(STEPS):
        # Each rank logs its replica's loss; the reference logs the global mean, so
        # compare the average of the two replicas' losses.
        by_replica = {r["dp"][0]: r["losses"][step][0] for r in results}
        mean = sum(by_replica.values()) / DP
        assert mean == pytest.approx(ref["losses"][step][0], rel=1e-5)
        for r in results:
            # The whole-model gradient norm, whatever holds which shard or stage.
            assert r["losses"][step][1] == pytest.approx(ref["losses"][step][1], rel=1e-5)
    for r in results:
        for name, value in ref["weights"].items():
            # float32: shards and stages sum in another order than one process does.
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["predict"], ref["predict"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp_x_tensor_parallel_equals_one_process() -> None:
    _check(run_ranks(_job_fsdp_tp, 4, timeout=280), "FSDPxTP")


@pytest.mark.slow
def test_ddp_x_pipeline_equals_one_process() -> None:
    _check(run_ranks(_job_ddp_pp, 4, timeout=280), "PipelinexDDP")


@pytest.mark.parametrize(
    ("job", "replicas"),
    [(_job_fsdp_alone, 2), (_job_tensor_alone, 1)],
    ids=["fsdp", "tensor"],
)
def test_whole_model_grad_norm_and_weights_on_two_ranks(job: Any, replicas: int) -> None:
    """FSDP alone (every gradient a 1-D shard) and tensor parallel alone (sharded and
    plain replicated gradients mixed): the clipping norm is the whole model's."""
    results = run_ranks(job, 2, timeout=200)
    ref = _reference(replicas)
    for step in range(STEPS):
        mean = sum(r["losses"][step][0] for r in results) / 2
        assert mean == pytest.approx(ref["losses"][step][0], rel=1e-5)
        for r in results:
            assert r["losses"][step][1] == pytest.approx(ref["losses"][step][1], rel=1e-5)
    for r in results:
        for name, value in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6)
