"""Real Gloo ranks: a pipeline trains and predicts exactly like one process on the whole batch.

ONE spawned job at world size 2 runs every case (GPT and ConvNet under GPipe, 1F1B
and Interleaved 1F1B, a model with its blocks in a nested nn.Sequential, plus SplitNet
for accumulation and errors); the tests below
assert on its results. Each case takes 3 SGD (momentum) steps on global batches of
8, 8 and 4 samples (the smaller last batch makes the stages rebuild for the new
microbatch shape), then predicts batches of 7 and 3 samples in eval mode (padding,
and reuse of the traced microbatch size).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks
from scaletrain.train.models import GPT, ConvNet, GPTConfig, SplitNet
from tests.trunk import IN_FEATURES, OUT_FEATURES, TrunkNet

pytestmark = pytest.mark.timeout(240)

MICROBATCHES = 4
BATCHES = (8, 8, 4)  # the last one is smaller: a new microbatch shape mid-training
EVAL_BATCHES = (7, 3)  # not multiples of MICROBATCHES: predict pads and slices
LR = 0.1
MOMENTUM = 0.9
GPT_CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)

# (model, schedule, stages, expected split points)
CASES: list[tuple[str, str, Any, tuple[str, ...]]] = [
    ("gpt", "gpipe", None, ("blocks.2",)),
    ("gpt", "1f1b", 2, ("blocks.2",)),  # balanced by parameter count
    ("gpt", "interleaved-1f1b", None, ("blocks.1", "blocks.2", "blocks.3")),  # 4 over 2 ranks
    ("convnet", "gpipe", ["layer2"], ("layer2",)),  # split by name
    ("convnet", "1f1b", 2, ("fc",)),  # balanced: layer1+layer2 13,344 | fc 15,690 params
    # Blocks in a nested nn.Sequential (model.trunk): embed+2 blocks 784 | 2 blocks+head 693.
    ("trunk", "1f1b", None, ("trunk.2",)),
]


def _case_id(case: tuple[str, str, Any, tuple[str, ...]]) -> str:
    return f"{case[0]}-{case[1]}"


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_CONFIG)
    if kind == "convnet":
        return ConvNet()
    if kind == "trunk":
        return TrunkNet()
    return SplitNet()


def _inputs(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        v, t = GPT_CONFIG.vocab_size, GPT_CONFIG.block_size
        return torch.randint(0, v, (n, t), generator=g), torch.randint(0, v, (n, t), generator=g)
    if kind == "convnet":
        return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    if kind == "trunk":
        x = torch.randn(n, IN_FEATURES, generator=g)
        return x, torch.randint(0, OUT_FEATURES, (n,), generator=g)
    return torch.randn(n, 10, generator=g), torch.randint(0, 5, (n,), generator=g)


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _job() -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.errors import ConfigError
    from scaletrain.strategies.pipeline import Pipeline, PipelineModule

    rt = st.init(strategy=Pipeline())
    res: dict[str, Any] = {
        "rank": rt.rank,
        "cases": {},
        "dp": rt.strategy.data_parallel(rt.topology),
    }
    for kind, schedule, stages, _ in CASES:
        # One process group for every case: swap the strategy the runtime uses.
        rt.strategy = Pipeline(stages=stages, schedule=schedule, microbatches=MICROBATCHES)
        bare = _model(kind)
        optimizer = _optimizer(bare)
        model, opt = rt.setup(bare, optimizer)
        assert isinstance(model, PipelineModule) and opt is optimizer
        assert rt.unwrap(model) is bare
        losses = []
        for step, n in enumerate(BATCHES):
            x, y = _inputs(kind, n, seed=step)
            opt.zero_grad()
            losses.append(rt.forward_backward(model, x, y, _loss))
            opt.step()
        bare.eval()
        outputs = [rt.predict(model, _inputs(kind, n, seed=100 + n)[0]) for n in EVAL_BATCHES]
        bare.train()
        res["cases"][_case_id((kind, schedule, stages, ()))] = {
            "losses": [float(loss) for loss in losses],
            "loss_dtype": losses[0].dtype,
            "state": {k: v.detach().clone() for k, v in model.stage_state_dict().items()},
            "params": model.stage_parameter_names(),
            "optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
            "outputs": outputs,
            "split": model.split_points,
            "built": len(model._built),  # train 8, train 4, predict (7 and 3 share one)
            "forward_restored": all(
                "forward" not in bare.get_submodule(name).__dict__ for name in model.split_points
            ),
        }

    # SplitNet, default 1F1B, one stage per rank: accumulation and the user-facing errors.
    rt.strategy = Pipeline(microbatches=MICROBATCHES)
    bare = _model("splitnet")
    model, opt = rt.setup(bare, _optimizer(bare))
    errors: dict[str, str] = {}
    for what, call in {
        "before_build": lambda: model.stage_state_dict(),
        "called": lambda: model(torch.zeros(4, 10)),
        "indivisible": lambda: rt.forward_backward(model, *_inputs("splitnet", 6, 0), _loss),
    }.items():
        try:
            call()
        except ConfigError as e:
            errors[what] = str(e)
    # Two micro-steps accumulate without zero_grad: the gradients must add up.
    with rt.no_sync(model):
        rt.forward_backward(model, *_inputs("splitnet", 8, 0), _loss)
    rt.forward_backward(model, *_inputs("splitnet", 8, 1), _loss)
    res["accumulated"] = {
        n: p.grad.clone() for n, p in bare.named_parameters() if n in model.stage_parameter_names()
    }
    res["errors"] = errors
    # The library's evaluation loop drives predict (batches of 4, 4 and 2: padded).
    from scaletrain.train import evaluate

    data = torch.utils.data.TensorDataset(*_inputs("splitnet", 10, seed=7))
    result = evaluate(rt, model, rt.loader(data, batch_size=4, shuffle=False, pad=False))
    res["eval"] = (result.loss, result.accuracy)
    rt.shutdown()
    return res


def _reference(kind: str) -> dict[str, Any]:
    """One process, the whole model, each global batch in one step.

    GPT: one forward over the whole batch. ConvNet holds BatchNorm, which normalises
    over whatever batch it sees, so a pipeline (like gradient accumulation) normalises
    per microbatch: its reference accumulates gradients over the same microbatches,
    one backward of loss / MICROBATCHES each (same running-stat updates too).
    """
    threads = torch.get_num_threads()
    # The ranks run one thread each; kernels split over more threads round differently.
    torch.set_num_threads(1)
    try:
        return _reference_steps(kind)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(kind: str) -> dict[str, Any]:
    model = _model(kind)
    opt = _optimizer(model)
    losses = []
    for step, n in enumerate(BATCHES):
        x, y = _inputs(kind, n, seed=step)
        opt.zero_grad()
        if kind == "convnet":
            parts = []
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                part = _loss(model(xm), ym)
                (part / MICROBATCHES).backward()
                parts.append(part.detach())
            # The pipeline averages the microbatch losses in float64 too.
            loss = torch.stack(parts).double().mean().float()
        else:
            loss = _loss(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        outputs = [model(_inputs(kind, n, seed=100 + n)[0]) for n in EVAL_BATCHES]
    return {"losses": losses, "state": model.state_dict(), "outputs": outputs}


_CACHE: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def job() -> list[dict[str, Any]]:
    if not _CACHE:
        _CACHE.extend(run_ranks(_job, 2, timeout=220))
    return _CACHE


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pipeline_matches_one_process_on_the_global_batch(job: Any, case: Any) -> None:
    kind, _, _, split = case
    ref = _reference(kind)
    got = [r["cases"][_case_id(case)] for r in job]
    for r in got:
        assert r["split"] == split
        assert r["loss_dtype"] == torch.float32
        assert r["built"] == 3  # train 8, train 4, predict (7 and 3 share one trace)
        assert r["forward_restored"]
    # Gathered by name, the stages' shares are exactly the whole model, once each.
    shares = [set(r["state"]) for r in got]
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(ref["state"])
    full = {**got[0]["state"], **got[1]["state"]}
    if kind == "convnet":
        # Gradient accumulation over the same microbatches runs the same kernels in the
        # same order: bitwise equal losses, weights and BatchNorm running statistics.
        for r in got:
            assert r["losses"] == ref["losses"]
        for name, value in ref["state"].items():
            assert torch.equal(full[name], value), name
    else:
        # float32, GPT and TrunkNet against ONE forward over the whole batch: the
        # pipeline's loss is the mean of the microbatch means (equal sizes, so the same
        # number) and its gradients are summed over microbatches, both in another order.
        # Measured on GPT after 3 momentum steps: losses to 1.2e-7 relative, weights to
        # 7.5e-9 absolute.
        for r in got:
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        for name, value in ref["state"].items():
            torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7, msg=name)
    # Each rank's optimizer was trimmed in place to its own stages' parameters.
    n_params = len(list(_model(kind).parameters()))
    assert [r["optimizer_params"] for r in got] == [len(r["params"]) for r in got]
    assert sum(r["optimizer_params"] for r in got) == n_params


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_predict_gives_the_full_models_outputs_on_every_rank(job: Any, case: Any) -> None:
    ref = _reference(case[0])
    for r in job:
        outs = r["cases"][_case_id(case)]["outputs"]
        for out, expected in zip(outs, ref["outputs"], strict=True):
            assert out.shape == expected.shape
            if case[0] == "convnet":
                assert torch.equal(out, expected)  # same weights bitwise, same kernels
            else:
                # Weights equal to ~1e-8 (above): logits agree to 1.5e-7 (measured).
                torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(job[0]["cases"][_case_id(case)]["outputs"], job[1]["cases"][_case_id(case)]["outputs"], strict=True):  # fmt: skip
        assert torch.equal(a, b), "every rank gets the last stage's exact outputs"


def test_each_stage_trains_blocks_of_a_nested_sequential(job: Any) -> None:
    # The blocks sit in model.trunk, an nn.Sequential beside embed and head: each stage
    # gets two of them, where one stage used to get all four.
    held = [r["cases"]["trunk-1f1b"]["params"] for r in job]
    blocks = [sorted({n.split(".")[1] for n in names if n.startswith("trunk.")}) for names in held]
    assert blocks == [["0", "1"], ["2", "3"]]


def test_all_stages_of_a_replica_read_the_same_data(job: Any) -> None:
    assert [r["dp"] for r in job] == [(0, 1), (0, 1)]


def test_accumulated_gradients_add_up(job: Any) -> None:
    model = _model("splitnet")
    for seed in (0, 1):
        _loss(model(_inputs("splitnet", 8, seed)[0]), _inputs("splitnet", 8, seed)[1]).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    got = {**job[0]["accumulated"], **job[1]["accumulated"]}
    assert set(got) == set(expected)
    for name, grad in expected.items():
        # Each microbatch's loss is scaled by 1/M (exact: M is a power of two) instead
        # of torch's scale_grads, which would also shrink the first call's gradients.
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_evaluate_runs_on_the_pipeline(job: Any) -> None:
    model = _model("splitnet")  # no optimizer step was taken: the initial weights
    x, y = _inputs("splitnet", 10, seed=7)
    with torch.no_grad():
        logits = model(x)
    loss = nn.functional.cross_entropy(logits, y).item()
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    for r in job:
        assert r["eval"][0] == pytest.approx(loss, rel=1e-6)
        assert r["eval"][1] == pytest.approx(accuracy, abs=1e-12)


def test_errors_say_what_and_how_to_fix(job: Any) -> None:
    for r in job:
        errors = r["errors"]
        assert "built at the first rt.forward_backward" in errors["before_build"]
        assert "rt.forward_backward(model" in errors["called"]
        assert "rt.unwrap(model) is the full model" in errors["called"]
        msg = errors["indivisible"]
        assert "microbatches=4" in msg and "6 sample(s)" in msg and "drop_last=True" in msg


def _hf_job() -> dict[str, Any]:
    """A Hugging Face causal LM as transformers builds it (use_cache on, its default)
    under the library's Pipeline: its tracer cannot return the key-value cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import scaletrain as st
    from scaletrain.train.loop import logits_of

    rt = st.init(strategy=st.Pipeline(microbatches=2), ledger=False)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
    )  # fmt: skip
    model = rt.setup(LlamaForCausalLM(config))
    x = torch.randint(0, 64, (4, 8))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        # What the model returns under every strategy: its ModelOutput's logits (the
        # traced last stage returned the bare tensor).
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    loss = rt.forward_backward(model, x, x, loss_fn)
    predicted = rt.predict(model, x)
    return {
        "loss": float(loss),
        "use_cache": rt.unwrap(model).config.use_cache,
        "predicted": type(predicted).__name__,
        "logits": tuple(logits_of(predicted).shape),
    }


def test_a_hugging_face_model_is_traced_without_its_kv_cache_and_returns_its_output() -> None:
    for res in run_ranks(_hf_job, 2, timeout=200):
        assert 3.0 < res["loss"] < 5.5, res  # about log(64) at random weights
        assert res["use_cache"] is True  # the user's setting, put back after the trace
        assert res["predicted"] == "CausalLMOutputWithPast" and res["logits"] == (4, 8, 64)
