"""float8 at 2 real Gloo ranks: FSDP's float8 all-gather and tensor parallel's float8 styles.

A CPU has no float8 matmuls: the ranks turn on the test hook
(`strategies.float8._float8_on_any_device`), with which torchao emulates the matmul of the
float8 values in high precision; everything else, the float8 all-gather of FSDP's
weight shards, the scales computed after each optimizer step and the float8
casts before tensor parallel's collectives, runs as on GPUs (real float8 on a GPU:
tests/gpu/test_float8_gpu.py).

Each is compared with float8 in one process on the same global batch. They are not
bitwise equal: the activations' scales are each rank's own (FSDP: over its half
of the batch) and the float8 roundings follow them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks
from scaletrain.train.models import GPT, GPTConfig

pytest.importorskip(
    "torchao", reason="float8 is an optional extra: pip install 'scaletrain[float8]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS = 5
PER_REPLICA = 4

TOLERANCE = {"rtol": 0, "atol": 2e-3}
"""|2 ranks - 1 process| of the float8 losses (about 4.2) over 5 AdamW steps: the
activations' scales differ (per rank, per half batch), and each float8 rounding with
them, by up to 1/16 of an element; the dot products average that down to ~1e-4."""


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _batches(dp_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.randint(
            0, SMALL.vocab_size, (dp_size, PER_REPLICA, SMALL.block_size + 1), generator=g
        )
        for _ in range(STEPS)
    ]


def _one_process(dp_size: int) -> list[float]:
    """float8 in one process, the whole global batch of `dp_size` replicas at once."""
    from scaletrain.strategies import float8

    float8._float8_on_any_device = True
    try:
        torch.manual_seed(0)
        model = GPT(SMALL)
        float8.convert_float8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for tokens in _batches(dp_size):
            whole = tokens.reshape(-1, SMALL.block_size + 1)
            loss = _loss(model(whole[:, :-1]), whole[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses
    finally:
        float8._float8_on_any_device = False


def _train(strategy: str, ckpt: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.strategies import float8

    float8._float8_on_any_device = True
    rt = st.init(strategy=strategy, ledger=False)
    out: dict[str, Any] = {}
    variants = [False, True] if strategy == "tensor" else [False]
    for sequence_parallel in variants:
        strat = rt.strategy
        strat.float8 = True
        if strategy == "tensor":
            strat.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        torch.manual_seed(0)
        bare = GPT(SMALL)
        model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
        fc = model.blocks[0].mlp.fc
        out_types = {"fc": type(fc).__name__, "weight": type(fc.weight._local_tensor).__name__}
        losses = []
        for tokens in _batches(rt.dp_size):
            opt.zero_grad()
            loss = rt.forward_backward(
                model, tokens[rt.dp_rank, :, :-1], tokens[rt.dp_rank, :, 1:], _loss
            )
            opt.step()
            losses.append(float(loss))
        full = rt.full_state_dict(model)
        out[f"sp={sequence_parallel}"] = {
            "types": out_types,
            "losses": losses,
            "state_types": sorted({type(v).__name__ for v in full.values()}),
            "keys": sorted(full),
            # FSDP's scales, computed by the optimizer's post-step hook.
            "scale": getattr(fc.weight._local_tensor, "_precomputed_scale", None) is not None,
        }
        if strategy == "fsdp":
            # A sharded checkpoint of the float8 model, loaded into one without float8.
            rt.save(ckpt, model=model)
            strat.float8 = False
            torch.manual_seed(1)
            plain_bare = GPT(SMALL)
            plain, _ = rt.setup(plain_bare, torch.optim.AdamW(plain_bare.parameters()))
            rt.load(ckpt, model=plain)
            again = rt.full_state_dict(plain)
            out["loaded"] = all(torch.equal(again[k], v) for k, v in full.items())
    rt.shutdown()
    return out


@pytest.mark.parametrize("strategy", ["fsdp", "tensor"])
def test_float8_at_two_ranks_matches_one_process(strategy: str, tmp_path: Path) -> None:
    results = run_ranks(_train, 2, strategy, str(tmp_path / "ckpt"), timeout=280)
    # FSDP: 2 replicas on their halves of the batch; tensor parallel: one replica.
    reference = torch.tensor(_one_process(2 if strategy == "fsdp" else 1))
    plain_keys = sorted(GPT(SMALL).state_dict())
    variants = [k for k in results[0] if k.startswith("sp=")]
    for variant in variants:
        # Each rank's loss is its own replica's: their mean is the global batch's.
        mean = torch.tensor([r[variant]["losses"] for r in results]).mean(0)
        torch.testing.assert_close(mean, reference, **TOLERANCE)
    for per_rank in results:
        for variant, run in ((k, v) for k, v in per_rank.items() if k.startswith("sp=")):
            assert run["keys"] == plain_keys, variant
            # What a checkpoint holds is plain tensors, whatever float8 wrapped them in.
            assert run["state_types"] == ["Tensor"], variant
            assert run["types"]["fc"] == "Float8Linear", variant
    first = results[0]["sp=False"]
    if strategy == "fsdp":
        # The weight shards are gathered in float8, with scales computed after each step.
        assert first["types"]["weight"] == "WeightWithDynamicFloat8CastTensor"
        assert first["scale"]
        assert all(r["loaded"] for r in results)
    else:
        assert first["types"]["weight"] == "Tensor"  # tensor parallel's plain shards
