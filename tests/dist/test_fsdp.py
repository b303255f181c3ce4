"""FSDP2 on 2 real Gloo ranks equals one process training on the concatenated global batch.

ONE spawned job trains every configuration (GPT and ConvNet; SGD with momentum and
AdamW; reshard_after_forward=False; cpu_offload; no_sync gradient accumulation;
MixedPrecisionPolicy) and the tests assert on its results.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks
from scaletrain.train.models import GPT, ConvNet, GPTConfig

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 3
PER_RANK = 2  # GPT sequences (ConvNet images: 2x) per rank per step
GPT_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)

# name -> (model, optimizer, FSDP kwargs, micro-batches per step)
CONFIGS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "gpt_sgd": ("gpt", "sgd", {}, 1),
    "gpt_adamw": ("gpt", "adamw", {}, 1),
    "conv_sgd": ("conv", "sgd", {}, 1),
    "conv_adamw": ("conv", "adamw", {}, 1),
    "gpt_no_reshard_by_class": ("gpt", "sgd", {"reshard_after_forward": False, "wrap": ("Block",)}, 1),
    "gpt_cpu_offload": ("gpt", "adamw", {"cpu_offload": True}, 1),
    "gpt_no_sync": ("gpt", "sgd", {}, 2),
    "gpt_bf16": ("gpt", "sgd", {"mixed_precision": "bf16"}, 1),
}  # fmt: skip


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_CONFIG)
    model = ConvNet()
    # Without SyncBatchNorm (train mode needs a GPU input) each rank normalises with its
    # own batch's statistics, which one process on the global batch cannot reproduce:
    # BatchNorm runs on its running statistics (eval mode) so the math is the same.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # Adam divides by sqrt(v) + eps, so a gradient that is pure rounding noise (the
    # key projection's bias: softmax ignores a shift shared by all keys, so its true
    # gradient is 0) gets a step of lr * noise / (|noise| + eps), whatever its size.
    # eps=1e-6 (not 1e-8) bounds that to lr * ~1e-4: the step is still AdamW's, and the
    # comparison tests the sharded optimizer state, not the amplification of rounding.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def _batch(kind: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: rank r's share is a contiguous block of rows."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        x = torch.randint(0, GPT_CONFIG.vocab_size, (rows, GPT_CONFIG.block_size), generator=g)
        y = torch.randint(0, GPT_CONFIG.vocab_size, (rows, GPT_CONFIG.block_size), generator=g)
        return x, y
    return torch.randn(rows, 1, 28, 28, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _rows(kind: str) -> int:
    return PER_RANK * (2 if kind == "conv" else 1)


def _train(rt: Any, name: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from scaletrain.strategies.fsdp import FSDP

    kind, opt_kind, kwargs, micro = CONFIGS[name]
    if kwargs.get("mixed_precision") == "bf16":
        kwargs = {**kwargs, "mixed_precision": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    rt.strategy = FSDP(**kwargs)
    bare = _model(kind)
    model, opt = rt.setup(bare, _optimizer(opt_kind, bare.parameters()))
    rows = _rows(kind)
    losses = []
    skipped: list[bool] = []
    for step in range(STEPS):
        x, y = _batch(kind, step, rows * WORLD * micro)
        mine = slice(rt.rank * rows * micro, (rt.rank + 1) * rows * micro)
        xs, ys = x[mine].chunk(micro), y[mine].chunk(micro)
        opt.zero_grad()
        total = torch.zeros(())
        for i in range(micro):
            # Accumulation: every micro-step but the last skips the reduce-scatter.
            last = i == micro - 1
            with contextlib.nullcontext() if last else rt.no_sync(model):
                loss = rt.forward_backward(model, xs[i], ys[i], lambda o, t: _loss(o, t) / micro)
            total += loss
            if not last:
                # Nothing reduce-scattered yet: FSDP holds the local unsharded sum.
                skipped.append(all(p.grad is None for p in model.parameters()))
        opt.step()
        losses.append(float(rt.reduce({"loss": total}, op="mean")["loss"]))
    first = next(
        p
        for n, p in model.named_parameters()
        if n.endswith("attn.q_proj.weight") or n == "layer1.0.weight"
    )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out: dict[str, Any] = {
        "losses": losses,
        "no_sync_skipped": skipped,
        "weights": {k: v.detach().clone() for k, v in full.items()},
        "units": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        "same_object": model is bare and rt.unwrap(model) is bare,
        "sharded": (
            isinstance(first, DTensor),
            tuple(first.to_local().shape) if isinstance(first, DTensor) else None,
            tuple(first.shape),
        ),
        "opt_params_are_model_params": {id(p) for g in opt.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
    }
    if name == "gpt_sgd":
        # Evaluation forward on this rank's rows with the trained weights.
        xe, _ = _batch(kind, 99, rows * WORLD)
        out["predict"] = rt.predict(model, xe[rt.rank * rows : (rt.rank + 1) * rows]).clone()
    return out


def _job() -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.strategies.fsdp import FSDP

    rt = st.init(strategy=FSDP())
    res: dict[str, Any] = {name: _train(rt, name) for name in CONFIGS}
    # An impossible wrap fails at setup, before any collective, naming what exists.
    rt.strategy = FSDP(wrap=("Blok", nn.Conv3d))
    try:
        rt.setup(_model("gpt"))
    except st.ConfigError as e:
        res["bad_wrap"] = str(e)
    rt.shutdown()
    return res


def _reference(name: str) -> dict[str, Any]:
    """One process: each step's global batch (all ranks' rows) in one forward/backward."""
    kind, opt_kind, _, micro = CONFIGS[name]
    model = _model(kind)
    opt = _optimizer(opt_kind, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, step, _rows(kind) * WORLD * micro)
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out: dict[str, Any] = {"losses": losses, "weights": model.state_dict()}
    if name == "gpt_sgd":
        with torch.no_grad():
            out["predict"] = model(_batch(kind, 99, _rows(kind) * WORLD)[0])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD, timeout=280)


# float32. FSDP averages the ranks' gradients with a reduce-scatter (sum of two
# half-batch gradients, then /2) where one process sums over the whole batch in one
# backward: the same math in another summation order, so results agree to rounding,
# not bitwise. Observed: losses <= 1.2e-7 relative; SGD weights <= 7.4e-8 absolute
# after 3 steps. AdamW's step is lr * m / (sqrt(v) + eps): for a gradient entry near 0
# a rounding difference dg in it moves the step by up to lr * dg / eps, so AdamW
# weights get an absolute tolerance of 1% of one step (lr=1e-3; observed 4.7e-6 on
# ConvNet's conv2, whose gradients sum ~1,600 positions each). A sharding bug moves
# whole steps (~lr) and still fails.
LOSS_TOL = {"rel": 1e-6, "abs": 1e-7}
WEIGHT_TOL = {
    "sgd": {"rtol": 1e-6, "atol": 2e-7},
    "adamw": {"rtol": 1e-5, "atol": 1e-5},
}


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "gpt_bf16"])
def test_fsdp_matches_one_process_on_the_global_batch(
    results: list[dict[str, Any]], name: str
) -> None:
    ref = _reference(name)
    tol = WEIGHT_TOL[CONFIGS[name][1]]
    for r in results:
        got = r[name]
        assert got["losses"] == pytest.approx(ref["losses"], **LOSS_TOL)
        assert set(got["weights"]) == set(ref["weights"])
        for key, value in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, **tol, msg=key)
    # The gathered full weights are the same on every rank.
    for key, value in results[0][name]["weights"].items():
        assert torch.equal(results[1][name]["weights"][key], value), key


def test_units_and_sharding(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["gpt_sgd"]["units"] == ["", "blocks.0", "blocks.1"]
        assert r["conv_sgd"]["units"] == ["", "layer1", "layer2"]
        assert r["gpt_no_reshard_by_class"]["units"] == ["", "blocks.0", "blocks.1"]
        for name in CONFIGS:
            got = r[name]
            assert got["same_object"], "fully_shard works in place: unwrap is the model"
            assert got["opt_params_are_model_params"], "optimizer rebuilt on the DTensors"
            is_dtensor, local, full = got["sharded"]
            assert is_dtensor
            assert local[0] * WORLD == full[0] and local[1:] == full[1:], (name, local, full)


def test_no_sync_defers_the_reduce_scatter(results: list[dict[str, Any]]) -> None:
    # The equivalence above holds with or without the skip; this shows the skip.
    for r in results:
        assert r["gpt_no_sync"]["no_sync_skipped"] == [True] * STEPS


def test_predict_gives_full_outputs(results: list[dict[str, Any]]) -> None:
    ref = _reference("gpt_sgd")["predict"]
    rows = _rows("gpt")
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            r["gpt_sgd"]["predict"], ref[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-6
        )


def test_mixed_precision_policy_is_applied(results: list[dict[str, Any]]) -> None:
    ref = _reference("gpt_bf16")
    for r in results:
        got = r["gpt_bf16"]
        # bf16 compute (8 bits of mantissa): close to the float32 run, not equal,
        # and not equal either, which shows the policy took effect.
        assert got["losses"] == pytest.approx(ref["losses"], rel=2e-2)
        assert got["losses"] != pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        # Parameters stay float32 (the policy casts for compute only).
        assert all(v.dtype == torch.float32 for v in got["weights"].values())


def test_impossible_wrap_names_the_classes(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["bad_wrap"]
        assert "Blok, Conv3d" in msg and "GPT" in msg
        assert "Block, CausalSelfAttention" in msg and "wrap='auto'" in msg
