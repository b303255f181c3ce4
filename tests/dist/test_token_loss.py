"""Token-level losses: with ragged padding, data parallel and gradient accumulation, a
step normalised by the step's whole count of targets equals one process on the whole
batch; the mean per micro-batch and per rank does not (the bug it fixes: a token of a
mostly padded micro-batch weighed more than one of a full one).

2 real Gloo ranks x accumulation 3 x 2 sequences, against one process on the 12
sequences at once; one SGD step, weights compared within 1e-6.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

VOCAB, T, PER_MICRO, MICRO = 16, 8, 2, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 12), nn.Linear(12, VOCAB))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """12 sequences whose real lengths range from 1 to 8 tokens (the rest -100)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (12, T), generator=g)
    y = torch.randint(0, VOCAB, (12, T), generator=g)
    lengths = [1, 8, 2, 7, 1, 1, 8, 8, 3, 6, 2, 8]
    for i, n in enumerate(lengths):
        y[i, n:] = -100
    return x, y


def _loss(outputs: torch.Tensor, targets: torch.Tensor, num_items: int | None = None) -> Any:
    flat, t = outputs.reshape(-1, VOCAB), targets.reshape(-1)
    if num_items is None:
        return nn.functional.cross_entropy(flat, t)
    return nn.functional.cross_entropy(flat, t, reduction="sum") / num_items


def _job(strategy: str, token_loss: bool) -> dict[str, torch.Tensor]:
    import scaletrain as st
    from scaletrain.train.loop import train_step

    rt = st.init(strategy=strategy, ledger=False)
    model = rt.setup(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = _batch()
    mine = slice(rt.rank * 6, rt.rank * 6 + 6)  # each rank its 3 micro-batches of 2
    micro = [
        (x[mine][i : i + PER_MICRO], y[mine][i : i + PER_MICRO]) for i in range(0, 6, PER_MICRO)
    ]
    train_step(rt, model, opt, iter(micro), _loss, accumulate=MICRO, token_loss=token_loss)
    weights = rt.full_state_dict(model)
    rt.shutdown()
    return weights


def _one_process() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = _batch()
    n = int((y != -100).sum())
    _loss(model(x), y, num_items=n).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_token_loss_over_ranks_and_micro_batches_is_the_whole_batchs(strategy: str) -> None:
    reference = _one_process()
    for token_loss in (True, False):
        got = run_ranks(_job, 2, strategy, token_loss, timeout=240)[0]
        worst = max((got[k] - reference[k]).abs().max().item() for k in reference)
        if token_loss:
            assert worst < 1e-6, worst
        else:
            # The mean per micro-batch and rank: another gradient (why token_loss exists).
            assert worst > 1e-3, worst
