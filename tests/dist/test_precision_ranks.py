"""bf16 on 2 real Gloo ranks: autocast under DDP, FSDP's MixedPrecisionPolicy under FSDP, and
every strategy's bf16-mixed run against its float32 twin."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)
    ]


def _train(strategy: str) -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy=strategy, precision="bf16-mixed")
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    losses = []
    for x, y in _batches(rt.rank):
        opt.zero_grad()
        losses.append(float(rt.forward_backward(model, x, y, nn.functional.cross_entropy)))
        opt.step()
    out = rt.predict(model, torch.randn(2, 8))
    result = {
        "losses": losses,
        "out_dtype": out.dtype,
        "param_dtype": next(model.parameters()).dtype,
        "autocast": rt.precision.autocast,
        "policy": type(getattr(rt.strategy, "mixed_precision", None)).__name__,
    }
    rt.shutdown()
    return result


def _fp32_losses(rank: int) -> list[float]:
    """Rank `rank`'s own losses in float32, one process on both ranks' batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for (x0, y0), (x1, y1) in zip(_batches(0), _batches(1), strict=True):
        opt.zero_grad()
        mine = nn.functional.cross_entropy(model((x0, x1)[rank]), (y0, y1)[rank])
        losses.append(mine.item())
        nn.functional.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        opt.step()
    return losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_mixed_trains_close_to_float32_with_fp32_weights(strategy: str) -> None:
    results = run_ranks(_train, 2, strategy, timeout=150)
    for rank, got in enumerate(results):
        assert got["out_dtype"] == torch.bfloat16 and got["param_dtype"] == torch.float32
        if strategy == "fsdp":
            # FSDP casts the gathered parameters itself: no autocast on top.
            assert got["policy"] == "MixedPrecisionPolicy" and got["autocast"] is False
        else:
            assert got["autocast"] is True
        # bf16 keeps 8 bits of mantissa: close to float32, not equal.
        assert got["losses"] == pytest.approx(_fp32_losses(rank), rel=3e-2)


def _tensor_only(mesh: dict[str, int]) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.train.models import GPT, GPTConfig

    rt = st.init(strategy="fsdp", mesh=mesh, precision="bf16-mixed")
    torch.manual_seed(0)
    bare = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    model, _ = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    logits = rt.predict(model, torch.randint(0, 64, (2, 16), generator=torch.Generator()))
    result = {"out_dtype": logits.dtype, "autocast": rt.precision.autocast}
    rt.shutdown()
    return result


def test_bf16_mixed_computes_in_bf16_on_a_mesh_without_data_parallel_ranks() -> None:
    """A mesh of dp=1 x tp=2 applies tensor parallel and no FSDP: autocast, not FSDP's
    policy, casts there. It was turned off as if FSDP would cast, and the run computed
    in float32 under bf16-mixed."""
    for got in run_ranks(_tensor_only, 2, {"dp": 1, "tp": 2}, timeout=150):
        assert got == {"out_dtype": torch.bfloat16, "autocast": True}


class _NormsAsUnits(nn.Module):
    """A container of bare layers beside a compound block: FSDP's auto wrap makes every
    member a unit, BatchNorms among them."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), block, nn.BatchNorm2d(4)
        )
        self.head = nn.Linear(4 * 28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _batchnorm_under_fsdp(kind: str, precision: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.train.models import ConvNet

    rt = st.init(strategy="fsdp", precision=precision)
    torch.manual_seed(0)
    bare = _NormsAsUnits() if kind == "norms-as-units" else ConvNet()
    if kind == "sync-bn":
        bare = st.sync_batchnorm(bare)
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(rt.rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        losses.append(float(rt.forward_backward(model, x, y, nn.functional.cross_entropy)))
        opt.step()
    bare.eval()
    out = rt.predict(model, torch.randn(4, 1, 28, 28, generator=g))
    rt.shutdown()
    return {"losses": losses, "eval_dtype": out.dtype, "eval": out.float()}


@pytest.mark.parametrize("kind", ["batchnorm", "sync-bn", "norms-as-units"])
def test_fsdp_bf16_mixed_trains_and_evaluates_a_model_with_batchnorm(kind: str) -> None:
    """FSDP2's MixedPrecisionPolicy gathered BatchNorm's weights in bf16 beside its
    float32 running statistics, and batch_norm refused the mix ("expected scalar type
    BFloat16 but found Float"): the default recipe, convnet, failed at its first step
    under --strategy fsdp --precision bf16-mixed. BatchNorm keeps float32 weights, as
    FSDP1's MixedPrecision kept them, and takes the bf16 activations as autocast gives
    them: the run follows float32's, as bf16 does. A BatchNorm that is a unit already
    (norms-as-units) is sharded once, with the float32 policy."""
    mixed = run_ranks(_batchnorm_under_fsdp, 2, kind, "bf16-mixed", timeout=150)
    full = run_ranks(_batchnorm_under_fsdp, 2, kind, "32", timeout=150)
    for got, want in zip(mixed, full, strict=True):
        assert got["eval_dtype"] == torch.bfloat16
        assert got["losses"] == pytest.approx(want["losses"], rel=3e-2)
        torch.testing.assert_close(got["eval"], want["eval"], rtol=5e-2, atol=5e-2)


def _pipeline_first_loss(prepared: bool) -> float:
    import scaletrain as st
    from scaletrain.strategies.pipeline import Pipeline
    from scaletrain.train.models import ConvNet

    rt = st.init(strategy=Pipeline(microbatches=4), precision="bf16-mixed")
    torch.manual_seed(0)
    bare = ConvNet()
    model, _ = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    if prepared:  # as `scaletrain train` does, to build the stages before a resume loads
        rt.prepare(model, x)
    loss = float(rt.forward_backward(model, x, y, nn.functional.cross_entropy))
    rt.shutdown()
    return loss


def test_pipeline_stages_built_by_prepare_compute_under_the_runs_precision() -> None:
    """rt.prepare traced the stages outside autocast, so they expected float32 between
    them; under bf16-mixed the first stage sent bf16 and the next read the bytes as
    float32: every `scaletrain train --strategy pipeline --precision bf16-mixed` step
    computed from garbage (losses of 1e33). Built by prepare or by the first step, the
    stages now give one process's loss, microbatch by microbatch under autocast."""
    from scaletrain.train.models import ConvNet

    torch.manual_seed(0)
    one = ConvNet()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = (
            sum(
                float(nn.functional.cross_entropy(one(a), b))
                for a, b in zip(x.chunk(4), y.chunk(4), strict=True)
            )
            / 4
        )
    for prepared in (False, True):
        for got in run_ranks(_pipeline_first_loss, 2, prepared, timeout=150):
            assert got == pytest.approx(want, rel=1e-6), prepared


MATRIX = [
    ("ddp", None, "gpt"),
    ("fsdp", None, "gpt"),
    ("tensor", None, "gpt"),
    ("pipeline", None, "gpt"),
    ("fsdp", {"dp": 1, "tp": 2}, "gpt"),
    ("ddp", {"dp": 1, "pp": 2}, "gpt"),
    ("fsdp", None, "convnet"),
    ("pipeline", None, "convnet"),
]
"""Every strategy (and mesh) 2 ranks run, on a transformer and on a BatchNorm ConvNet."""


def _steps(strategy: str, mesh: dict[str, int] | None, kind: str, precision: str) -> Any:
    import scaletrain as st
    from scaletrain.train.models import GPT, ConvNet, GPTConfig

    rt = st.init(strategy=strategy, mesh=mesh, precision=precision)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    bare = GPT(config) if kind == "gpt" else ConvNet()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(rt.dp_rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "gpt":
            tokens = torch.randint(0, 64, (8, 17), generator=g)
            return tokens[:, :-1], tokens[:, 1:]
        return torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = outputs.reshape(-1, outputs.shape[-1]).float()
        return nn.functional.cross_entropy(flat, targets.reshape(-1))

    first = batch()
    rt.prepare(model, first[0])  # as `scaletrain train` builds pipeline stages
    losses = []
    for x, y in [first, batch(), batch()]:
        opt.zero_grad()
        losses.append(float(rt.forward_backward(model, x, y, loss_fn)))
        opt.step()
    bare.eval()
    out = rt.predict(model, batch()[0])
    rt.shutdown()
    return losses, out.float(), out.dtype


@pytest.mark.parametrize(("strategy", "mesh", "kind"), MATRIX,
                         ids=[f"{s}-{k}" + ("-" + ",".join(f"{d}={n}" for d, n in m.items()) if m else "")
                              for s, m, k in MATRIX])  # fmt: skip
def test_bf16_mixed_follows_float32_under_every_strategy(
    strategy: str, mesh: dict[str, int] | None, kind: str
) -> None:
    """Three steps and an evaluation under bf16-mixed against the same in float32: the
    evaluation computes in bf16, and as bf16 rounds, the losses agree to about 1%. It
    finds a pipeline computing from misread bytes, BatchNorm refused under FSDP, and a
    mesh of dp=1 computing in float32."""
    mixed = run_ranks(_steps, 2, strategy, mesh, kind, "bf16-mixed", timeout=150)
    full = run_ranks(_steps, 2, strategy, mesh, kind, "32", timeout=150)
    for (losses, out, dtype), (want, want_out, _) in zip(mixed, full, strict=True):
        assert dtype == torch.bfloat16
        assert losses == pytest.approx(want, rel=2e-2)
        torch.testing.assert_close(out, want_out, rtol=5e-2, atol=5e-2)
