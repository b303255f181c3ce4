"""Tensor parallel on 2 real Gloo ranks equals one process training the same model.

Both ranks are one model replica: they get the SAME batch and must produce the
losses and weights one process gets on that batch. ONE spawned job trains every
configuration (default plan, sequence parallel, a user plan) and provokes the
configuration errors; the tests assert on its results.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks
from scaletrain.train.models import GPT, ConvNet, GPTConfig

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 3
BATCH = 4
GPT_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)

# name -> (TensorParallel kwargs, optimizer)
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "default_sgd": ({}, "sgd"),
    "default_adamw": ({}, "adamw"),
    "sequence_sgd": ({"sequence_parallel": True}, "sgd"),
    "sequence_adamw": ({"sequence_parallel": True}, "adamw"),
    "user_plan_sgd": ({"plan": "mlp_only"}, "sgd"),
}


def _model(config: GPTConfig = GPT_CONFIG) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps=1e-6: see the tolerance note below.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    shape = (BATCH, GPT_CONFIG.block_size)
    return (
        torch.randint(0, GPT_CONFIG.vocab_size, shape, generator=g),
        torch.randint(0, GPT_CONFIG.vocab_size, shape, generator=g),
    )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class _FixedHeadAttention(nn.Module):
    """A user's attention whose forward hard-codes its head count (n_head)."""

    def __init__(self, d: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class _UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _FixedHeadAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _placements(model: nn.Module) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    return {
        n: repr(p.placements[0]) if isinstance(p, DTensor) else "plain"
        for n, p in model.named_parameters()
    }


def _train(rt: Any, name: str) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from scaletrain.strategies.tensor import TensorParallel

    kwargs, opt_kind = CONFIGS[name]
    if kwargs.get("plan") == "mlp_only":
        plan = {"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()}
        kwargs = {**kwargs, "plan": plan}
    rt.strategy = TensorParallel(**kwargs)
    bare = _model()
    model, opt = rt.setup(bare, _optimizer(opt_kind, bare.parameters()))
    # Rank-local weights after sharding: q_proj holds half the rows on each rank.
    q = model.blocks[0].attn.q_proj.weight
    local_q = (q.to_local() if hasattr(q, "to_local") else q).detach().clone()
    from torch.distributed.tensor.debug import CommDebugMode

    losses = []
    for step in range(STEPS):
        x, y = _batch(step)  # the same batch on every tensor-parallel rank
        opt.zero_grad()
        loss = rt.forward_backward(model, x, y, _loss)
        with CommDebugMode() as in_step:
            opt.step()
        losses.append(float(loss))
    return {
        "step_collectives": in_step.get_total_counts(),
        "losses": losses,
        "weights": _full(model),
        "placements": _placements(model),
        "local_q": local_q,
        "predict": rt.predict(model, _batch(99)[0]).clone(),
        "opt_params_are_model_params": {id(p) for g in opt.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
    }


def _error(rt: Any, model: nn.Module, inputs: torch.Tensor | None = None, **kwargs: Any) -> str:
    import scaletrain as st
    from scaletrain.strategies.tensor import TensorParallel

    try:
        rt.strategy = TensorParallel(**kwargs)
        wrapped = rt.setup(model)
        if inputs is not None:
            rt.predict(wrapped, inputs)
    except st.ConfigError as e:
        return str(e)
    return "no error"


CHECKPOINTING = [
    ("none", None, 0.0), ("selective", None, 0.0), ("full", None, 0.0), ("selective", 2, 0.0),
    ("full", None, 0.1), ("selective", None, 0.1),
]  # fmt: skip
"""(ac, ac_every, dropout) of the steps whose collectives are counted (`_collectives`):
dropout after a block's last projection saves a mask, so the recomputation runs
through that projection and its collective."""


def _collectives(rt: Any) -> dict[str, dict[str, int]]:
    """The collectives of one step (its forward and backward, the second: the first
    has setup's own) under each checkpointing, plain and sequence parallel, counted
    as they are dispatched: what the planner's `tp_collectives` prices."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from scaletrain.strategies.tensor import TensorParallel

    kinds = {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: Counter[str] = Counter()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if (name := func.overloadpacket.__name__) in kinds:
                self.seen[name] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for sp in (False, True):
        for ac, every, dropout in CHECKPOINTING:
            rt.strategy = TensorParallel(sequence_parallel=sp, ac=ac, ac_every=every)
            model = rt.setup(_model(replace(GPT_CONFIG, dropout=dropout)))
            x, y = _batch(0)
            for _ in range(2):
                with Count() as count:
                    _loss(model(x), y).backward()
            out[f"{sp} {ac} {every} {dropout}"] = dict(count.seen)
    return out


class _TwoReads(nn.Module):
    """q and k read one tensor; `mode`: q's read under no_grad, or in a reentrant
    checkpoint (its forward runs under no_grad), or as k's."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "nograd":
            with torch.no_grad():
                q = self.q(x)
        elif self.mode == "reentrant":
            q = torch.utils.checkpoint.checkpoint(self.q, x, use_reentrant=True)
        else:
            q = self.q(x)
        return q + self.k(x)


class _Heads(nn.Module):
    """Colwise layers in a ModuleList, which is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[0](x) + self.heads[1](x)


def _shared_inputs(rt: Any) -> dict[str, Any]:
    """Each case's input gradient with the layers split (their outputs' local columns
    summed on each rank: together, the whole output's sum) and whole, and what the
    shared-input cache holds after the step."""
    from torch.distributed.tensor.parallel import parallelize_module

    from scaletrain.dist.mesh import device_mesh
    from scaletrain.strategies.tensor import _forget_shared_input, _style

    mesh = device_mesh(rt.topology, "tp")
    out = {}
    for name, make, plan in [
        *((mode, partial(_TwoReads, mode), {"q": "colwise", "k": "colwise"})
          for mode in ("plain", "nograd", "reentrant")),
        ("heads", _Heads, {"heads.0": "colwise", "heads.1": "colwise"}),
    ]:  # fmt: skip
        grads = []
        for split in (False, True):
            torch.manual_seed(0)
            model, shared = make(), {}
            if split:
                parallelize_module(
                    model, mesh, {k: _style(v, False, shared) for k, v in plan.items()}
                )
                _forget_shared_input(model, plan, shared)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
            model(x).sum().backward()
            grads.append(x.grad)
        out[name] = {"grads": grads, "cache": sorted(shared)}
    return out


def _job() -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.strategies.tensor import TensorParallel

    rt = st.init(strategy=TensorParallel())
    res: dict[str, Any] = {
        "data_parallel": rt.strategy.data_parallel(rt.topology),
        "loader_sees_everything": len(rt.loader(list(range(10)), batch_size=10, shuffle=False)),
    }
    res.update({name: _train(rt, name) for name in CONFIGS})
    res["collectives"] = _collectives(rt)
    res["shared_inputs"] = _shared_inputs(rt)
    # Each error is raised on both ranks before any collective, so no rank is stranded.
    res["convnet"] = _error(rt, ConvNet())
    res["bad_key"] = _error(rt, _model(), plan={"blocks.*.attn.qproj": "colwise"})
    res["heads"] = _error(rt, _model(GPTConfig(n_layer=1, n_embd=30, n_head=3)))
    res["width"] = _error(rt, _model(GPTConfig(n_layer=1, n_embd=33, n_head=3)))
    res["seq_len"] = _error(
        rt, _model(), torch.zeros(1, 15, dtype=torch.long), sequence_parallel=True
    )
    # Raised in the attention's forward on every rank alike, before the out_proj's
    # all-reduce, so no rank is stranded in a collective.
    res["fixed_heads"] = _error(rt, _UserModel(), torch.zeros(2, 8, 32))
    rt.shutdown()
    return res


def _reference(opt_kind: str) -> dict[str, Any]:
    model = _model()
    opt = _optimizer(opt_kind, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(_batch(99)[0])
    return {"losses": losses, "weights": model.state_dict(), "predict": logits}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD, timeout=280)


# float32. A row-parallel layer sums two half-width matrix products (all-reduce, or
# reduce-scatter under sequence parallel) where one process does one full-width
# product: the same math in another summation order, so results agree to rounding,
# not bitwise. Observed after 3 steps: losses equal, SGD weights <= 1.3e-8 absolute,
# AdamW weights <= 2.6e-7. AdamW's step is lr * m / (sqrt(v) + eps): for a gradient
# entry near 0 a rounding difference dg moves the step by up to lr * dg / eps, hence
# its looser absolute tolerance (0.2% of one step, lr=1e-3); a sharding bug moves
# whole steps and fails.
LOSS_TOL = {"rel": 1e-6, "abs": 1e-7}
WEIGHT_TOL = {
    "sgd": {"rtol": 1e-6, "atol": 1e-7},
    "adamw": {"rtol": 1e-5, "atol": 2e-6},
}


def test_every_rank_gets_the_same_data(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["data_parallel"] == (0, 1)
        assert r["loader_sees_everything"] == 1  # one batch of all 10 samples


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_parallel_matches_one_process(results: list[dict[str, Any]], name: str) -> None:
    opt_kind = CONFIGS[name][1]
    ref = _reference(opt_kind)
    tol = WEIGHT_TOL[opt_kind]
    for r in results:
        got = r[name]
        assert got["losses"] == pytest.approx(ref["losses"], **LOSS_TOL)
        assert set(got["weights"]) == set(ref["weights"])
        for key, value in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, **tol, msg=key)
        # Outputs come back whole (B, T, vocab) on every rank, not a slice.
        torch.testing.assert_close(got["predict"], ref["predict"], rtol=1e-5, atol=1e-6)
        assert got["opt_params_are_model_params"]
    assert results[0][name]["losses"] == results[1][name]["losses"]


@pytest.mark.parametrize("name", ["sequence_sgd", "sequence_adamw"])
def test_sequence_parallels_partial_gradients_are_summed_once_before_the_step(
    results: list[dict[str, Any]], name: str
) -> None:
    """The norms' gradients are each rank's sum over its slice of the sequence
    (Partial): every optimizer op all-reduced them again (AdamW: three times a step, 24
    all-reduces here). Summed once as the step begins: one all-reduce each (the weight
    and bias of 2 blocks' 2 LayerNorms), and the weights are still one process's
    (test_tensor_parallel_matches_one_process)."""
    for r in results:
        assert r[name]["step_collectives"] == 2 * 2 * 2


def test_layers_are_split_as_planned(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for name in ("default_sgd", "sequence_sgd"):
            placements = r[name]["placements"]
            for block in ("blocks.0", "blocks.1"):
                for proj in ("q_proj", "k_proj", "v_proj"):
                    assert placements[f"{block}.attn.{proj}.weight"] == "Shard(dim=0)"
                assert placements[f"{block}.attn.out_proj.weight"] == "Shard(dim=1)"
                assert placements[f"{block}.mlp.fc.weight"] == "Shard(dim=0)"
                assert placements[f"{block}.mlp.proj.weight"] == "Shard(dim=1)"
            assert placements["tok_emb.weight"] == placements["head.weight"] == "plain"
        assert r["default_sgd"]["placements"]["blocks.0.ln1.weight"] == "plain"
        assert r["sequence_sgd"]["placements"]["blocks.0.ln1.weight"] == "Replicate()"
        assert r["sequence_sgd"]["placements"]["ln_f.weight"] == "plain"
        user = r["user_plan_sgd"]["placements"]
        assert user["blocks.0.mlp.fc.weight"] == "Shard(dim=0)"
        assert user["blocks.0.attn.q_proj.weight"] == "plain"
        # This rank's rows of q_proj: rank 0 the first 16 output features, rank 1 the rest.
        full_q = _model().blocks[0].attn.q_proj.weight.detach()
        torch.testing.assert_close(
            r["default_sgd"]["local_q"], full_q[rank * 16 : (rank + 1) * 16], rtol=0, atol=0
        )


def test_configuration_errors_name_the_problem(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["convnet"].startswith(
            "tensor parallel found no Linear pairs to shard in ConvNet; expected "
        )
        assert "fix: pass plan=" in r["convnet"] and "use ddp/fsdp" in r["convnet"]
        assert "'blocks.*.attn.qproj' matches no module of the GPT" in r["bad_key"]
        assert "blocks.0.attn.q_proj" in r["bad_key"]
        assert "blocks.0.attn.q_proj holds 3 heads" in r["heads"]
        assert "tensor-parallel degree 2" in r["heads"]
        assert "blocks.0.attn.q_proj (Linear 33 -> 33)" in r["width"]
        assert "out_features=33 is not divisible by the tensor-parallel degree 2" in r["width"]
        assert "input of shape (1, 15, 32)" in r["seq_len"]
        assert "divisible by 2" in r["seq_len"]
        # A forward with a hard-coded head count: which module, why, and what to change.
        fixed = r["fixed_heads"]
        assert fixed.startswith("tensor parallel: attn (_FixedHeadAttention) reshapes")
        assert "2 of its 4 heads" in fixed and "is invalid for input of size" in fixed
        assert "q.view(b, t, -1, head_dim)" in fixed


def test_an_input_its_colwise_layers_share_is_redistributed_once(
    results: list[dict[str, Any]],
) -> None:
    """q, k and v read one tensor: its gradient is all-reduced once per attention (and
    once per MLP), Megatron's count, not once per layer as torch's ColwiseParallel on
    each of them does; under sequence parallel it is gathered once, its gradient
    reduce-scattered once. Per block of the GPT here (separate q/k/v, an fc/proj MLP):
    2 rowwise outputs and 2 shared inputs."""
    blocks = GPT_CONFIG.n_layer
    for r in results:
        plain, sp = r["collectives"]["False none None 0.0"], r["collectives"]["True none None 0.0"]
        assert plain == {"all_reduce": 4 * blocks}, plain  # was 6 a block: 3 for q/k/v
        # The sequence's gathers as it leaves the blocks and its gradient enters them: 2.
        assert sp == {"reduce_scatter_tensor": 4 * blocks, "all_gather_into_tensor": 4 * blocks + 2}


def test_a_shared_input_keeps_every_gradient_and_nothing_past_the_step(
    results: list[dict[str, Any]],
) -> None:
    """A DTensor made from an input under no_grad (or in a reentrant checkpoint's
    forward) carries no gradient: handed to the next layer taking that input, it lost
    that layer's gradient (x.grad None). Colwise layers in a ModuleList, never called
    itself, kept their shared input (and its DTensor) past the step."""
    for r in results:
        for name, case in r["shared_inputs"].items():
            whole, split = case["grads"]
            assert split is not None, name
            torch.testing.assert_close(split, whole, msg=name)
            # A reentrant checkpoint recomputes q in the backward, after every module
            # returned: its input stays until the next forward begins.
            assert case["cache"] == (
                [] if name != "reentrant" else ["dtensor", "grad", "input", "mesh"]
            ), name


@pytest.mark.parametrize(("ac", "every", "dropout"), CHECKPOINTING)
@pytest.mark.parametrize("sp", [False, True])
def test_the_planner_counts_the_collectives_tensor_parallel_runs(
    results: list[dict[str, Any]], sp: bool, ac: str, every: int | None, dropout: float
) -> None:
    """`scaletrain plan` prices tensor parallel's collectives by count: the plain
    all-reduces (a rowwise output's, each colwise input gradient's), sequence
    parallel's reduce-scatters and all-gathers, and what a checkpointed block's
    recomputation runs again. The counts are those TensorParallel runs."""
    from functools import partial

    from scaletrain.planner.cost import tp_collectives
    from scaletrain.planner.layout import Layout
    from scaletrain.planner.profile import profile_model
    from scaletrain.planner.structure import Model
    from scaletrain.strategies.blocks import auto_wrap_targets
    from scaletrain.strategies.partition import list_layers
    from scaletrain.strategies.tensor_plan import default_tp_plan

    config = replace(GPT_CONFIG, dropout=dropout)
    with torch.device("meta"):
        net = _model(config)
    profile = profile_model(
        partial(_model, config), _batch(0), _loss, partial(torch.optim.SGD, lr=0.1), ac=ac,
        ac_every=every,
    )  # fmt: skip
    m = Model(profile, list_layers(net), auto_wrap_targets(net), default_tp_plan(net))
    planned = tp_collectives(Layout("tensor", tp=WORLD, sp=sp), m)
    names = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
             "all_gather": "all_gather_into_tensor", "edges": "all_gather_into_tensor"}  # fmt: skip
    want: dict[str, int] = {}
    for kind, n in planned.items():
        want[names[kind]] = want.get(names[kind], 0) + n
    for r in results:
        assert r["collectives"][f"{sp} {ac} {every} {dropout}"] == want
