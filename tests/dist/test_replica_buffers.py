"""The model at a step is data-parallel replica 0's, whatever the strategy and whoever asks.

BatchNorm's running statistics are each rank's own (each updates them from its own
batches; DDP copies rank 0's before each forward, FSDP and a pipeline's replicas do
not). On 2 real Gloo ranks that trained on different data: evaluation, the whole
state dict, a checkpoint and its consolidated file all see rank 0's buffers, and none
of them changes any rank's own (training goes on as if they had not run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = [pytest.mark.timeout(300)]


def _conv() -> nn.Module:
    from scaletrain.train.models import ConvNet

    torch.manual_seed(0)
    return ConvNet()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers()}


def _job(strategy: str, out: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.train import evaluate

    rt = st.init(strategy=strategy, ledger=False)
    model = rt.setup(_conv())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rt.rank)  # every rank its own data
    for _ in range(3):
        x = torch.randn(8, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        rt.forward_backward(model, x, y, nn.functional.cross_entropy)
        rt.step(opt)
        opt.zero_grad()
    net = rt.unwrap(model)
    own = _buffers(net)
    test = torch.utils.data.TensorDataset(
        torch.randn(12, 1, 28, 28, generator=g), torch.randint(0, 10, (12,), generator=g)
    )
    loader = rt.loader(test, batch_size=4, shuffle=False, pad=False)
    evaluate(rt, model, loader)
    after_eval = _buffers(net)
    full = rt.full_state_dict(model)
    path = rt.save(Path(out) / "ckpt", model=model, optimizer=opt)
    after_save = _buffers(net)
    rt.shutdown()
    return {
        "own": own,
        "after_eval": after_eval,
        "after_save": after_save,
        "full": {n: full[n] for n in own if n in full},
        "path": str(path),
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_model_at_a_step_is_replica_zeros_and_reading_it_changes_nothing(
    strategy: str, tmp_path: Path
) -> None:
    from scaletrain.checkpoint import consolidate

    r0, r1 = run_ranks(_job, 2, strategy, str(tmp_path), timeout=240)
    stats = [n for n in r0["own"] if "running" in n]
    assert stats, "the ConvNet holds BatchNorm statistics"
    # The ranks trained on different data: their own statistics differ.
    assert any(not torch.equal(r0["own"][n], r1["own"][n]) for n in stats)
    for r in (r0, r1):
        for n, own in r["own"].items():
            assert torch.equal(r["after_eval"][n], own), f"evaluate changed {n}"
            assert torch.equal(r["after_save"][n], own), f"saving changed {n}"
            assert torch.equal(r["full"][n], r0["own"][n]), f"full_state_dict's {n}"
    consolidated = consolidate(r0["path"], tmp_path / "model.pt")
    weights = torch.load(consolidated, weights_only=True)
    for n in r0["own"]:
        assert torch.equal(weights[n], r0["own"][n]), f"consolidated {n} is not rank 0's"
