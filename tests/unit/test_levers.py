"""Activation checkpointing and torch.compile in one process: the math, the names, the refusals.

(2-process equivalence under every strategy: tests/dist/test_levers.py.)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.strategies import resolve_strategy
from scaletrain.strategies.levers import apply_levers, check_compiler, lever_blocks
from scaletrain.strategies.mesh import FSDPxTP, PipelinexDDP
from scaletrain.train.config import TrainConfig
from scaletrain.train.models import GPT, GPTConfig, SplitNet

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)


def _train(
    ac: str = "none", every: int | None = None, compile: bool | str = False, steps: int = 3
) -> tuple[list[tuple[torch.Tensor, list[torch.Tensor]]], GPT]:
    torch.manual_seed(0)
    model = GPT(SMALL)
    apply_levers(model, ac=ac, ac_every=every, compile=compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        t = torch.randint(0, SMALL.vocab_size, (4, SMALL.block_size + 1), generator=g)
        logits = model(t[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, SMALL.vocab_size), t[:, 1:].reshape(-1)
        )
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out, model


@pytest.mark.parametrize(("ac", "every"), [("full", None), ("selective", None), ("selective", 2)])
def test_checkpointing_is_bitwise_no_checkpointing(ac: str, every: int | None) -> None:
    base, plain = _train()
    got, model = _train(ac, every)
    for (loss, grads), (loss0, grads0) in zip(got, base, strict=True):
        assert torch.equal(loss, loss0)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    # In place: the checkpoint keys are the model's own.
    assert list(model.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize(("ac", "every"), [("full", None), ("selective", None), ("selective", 1)])
def test_checkpointing_updates_batchnorms_running_statistics_once(
    ac: str, every: int | None
) -> None:
    """The recomputation runs a block's forward again in training mode: its BatchNorms
    updated their running statistics twice a step (num_batches_tracked counted 2), so
    evaluation read other statistics than the run without checkpointing."""
    from scaletrain.train.models import ConvNet

    torch.manual_seed(0)
    plain = ConvNet()
    checkpointed = copy.deepcopy(plain)
    apply_levers(checkpointed, ac=ac, ac_every=every, owner="test")
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for _ in range(2):
        for model in (plain, checkpointed):
            nn.functional.cross_entropy(model(x), y).backward()
    for name, buffer in plain.named_buffers():
        assert torch.equal(dict(checkpointed.named_buffers())[name], buffer), name
    assert checkpointed.layer1[1].num_batches_tracked.item() == 2
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_compiled_checkpointing_updates_batchnorms_running_statistics_once() -> None:
    """Compiled, a checkpoint takes none of the levers' contexts (the recomputation's
    restore of BatchNorm's statistics among them): the compiler recomputes in its own
    backward graph, and must update the statistics once a step too."""
    from scaletrain.train.models import ConvNet

    torch.manual_seed(0)
    plain = ConvNet()
    compiled = copy.deepcopy(plain)
    apply_levers(compiled, ac="full", compile=True, owner="test")
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for _ in range(2):
        for model in (plain, compiled):
            nn.functional.cross_entropy(model(x), y).backward()
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(compiled.named_buffers())[name], buffer, msg=name)
    assert compiled.layer1[1].num_batches_tracked.item() == 2


def test_checkpointing_saves_less_for_backward() -> None:
    """What autograd keeps for backward, counted by the saved-tensor hooks: full keeps
    each block's input only, selective more than full and less than none."""

    def saved_bytes(ac: str, every: int | None = None) -> int:
        torch.manual_seed(0)
        model = GPT(SMALL)
        apply_levers(model, ac=ac, ac_every=every)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        x = torch.randint(0, SMALL.vocab_size, (8, SMALL.block_size))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        return total

    assert saved_bytes("full") < saved_bytes("selective", 2) < saved_bytes("none")


def test_selective_recomputes_the_cheap_ops_and_keeps_the_matmuls() -> None:
    """The ops backward runs, counted: full recomputes the matmuls, selective only the
    cheap ops (its kept outputs are not autograd's saved tensors, so they are seen
    here rather than by the saved-tensor hooks)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def backward_ops(ac: str) -> Counter[str]:
        torch.manual_seed(0)
        model = GPT(SMALL)
        apply_levers(model, ac=ac)
        loss = model(torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))).sum()
        with Count() as count:
            loss.backward()
        return count.ops

    none, full, selective = backward_ops("none"), backward_ops("full"), backward_ops("selective")
    matmuls = ("mm", "addmm", "bmm")
    assert sum(full[m] for m in matmuls) > sum(none[m] for m in matmuls)
    assert sum(selective[m] for m in matmuls) == sum(none[m] for m in matmuls)
    assert selective["native_layer_norm"] > none["native_layer_norm"]


def test_the_blocks_are_the_fsdp_units_and_a_model_without_says_so() -> None:
    assert lever_blocks(GPT(SMALL), "full") == [f"blocks.{i}" for i in range(4)]
    with pytest.raises(
        ConfigError,
        match=r"ac='full' checkpoints a model's repeated blocks, and this SplitNet has none",
    ):
        apply_levers(SplitNet(), ac="full")
    # Compile alone takes the whole model when it has no blocks.
    assert apply_levers(SplitNet(), compile="aot_eager") == []
    # Before any process starts: check_model on the meta device.
    with torch.device("meta"):
        net = SplitNet()
    with pytest.raises(ConfigError, match="has none"):
        st.FSDP(ac="full").check_model(net, _topology())


def test_a_model_without_blocks_is_refused_in_the_words_of_its_caller() -> None:
    """A plan's refusal ended "... or train with --ac none": a plan trains nothing."""
    with torch.device("meta"):
        net = SplitNet()
    with pytest.raises(ConfigError, match=r"^FSDP\(\.\.\.\): .* or train with ac='none'\.$"):
        st.FSDP(ac="full").check_model(net, _topology())
    with pytest.raises(ConfigError, match=r"^plan\(\.\.\.\): .* or plan with ac='none'\.$"):
        st.plan("split-net", devices=2, hardware="h100-sxm", ac="full")
    use_cli_names(True)
    with pytest.raises(ConfigError, match=r"^--ac full .* or plan with --ac none\.$"):
        st.plan("split-net", devices=2, hardware="h100-sxm", ac="full")


def test_levers_twice_are_refused() -> None:
    model = GPT(SMALL)
    apply_levers(model, ac="full")
    with pytest.raises(ConfigError, match="already had activation checkpointing"):
        apply_levers(model, ac="full")


def test_compiled_blocks_share_one_graph_and_keep_their_names() -> None:
    """Selective checkpointing inside the compiled blocks (the order the strategies
    apply them in), traced by dynamo and AOT autograd ("aot_eager": inductor's capture
    without its code generation; inductor itself runs in tests/dist/test_levers.py's
    docs test): close to eager over 20 steps, one graph for every block (compile
    time does not grow with depth), and the names unchanged."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base, _ = _train(steps=20)
    got, model = _train("selective", None, "aot_eager", steps=20)
    losses = torch.stack([loss for loss, _ in got])
    torch.testing.assert_close(
        losses, torch.stack([loss for loss, _ in base]), rtol=1e-4, atol=1e-5
    )
    assert counters["stats"]["unique_graphs"] == 1
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
    assert "blocks.0.attn.q_proj.weight" in model.state_dict()


def _topology(dim: str = "dp") -> Any:
    """Two CPU ranks along `dim`, as a launcher checks a model before they start."""
    from scaletrain.dist.topology import Topology

    return Topology(
        world_size=2,
        local_world_size=2,
        device=torch.device("cpu"),
        backend="gloo",
        mesh_shape={dim: 2},
        mesh_given=False,
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: st.FSDP(ac="ful"),
            r"FSDP\(\.\.\.\): ac='ful' is not a checkpointing mode; expected one of none, full, selective",
        ),
        (
            lambda: st.DDP(ac="full", ac_every=2),
            r"ac_every=2 picks every k-th block for ac='selective', not ac='full'",
        ),
        (lambda: st.DDP(ac="selective", ac_every=0), r"ac_every=0 must be a whole number >= 1"),
        (
            lambda: st.TensorParallel(compile="inductr"),
            r"compile='inductr' is not a torch.compile backend",
        ),
        (lambda: st.DataParallel(compile=True), r"strategy='dp' takes no ac or compile"),
        (
            lambda: st.Pipeline(ac="selective", ac_every=2),
            r"Pipeline\(\.\.\.\): ac_every=2 with a pipeline: it checkpoints whole stages",
        ),
        (
            lambda: FSDPxTP(fsdp=st.FSDP(ac="full"), tensor=st.TensorParallel(compile=True)),
            "set on more than one of its parts",
        ),
    ],
)
def test_library_mistakes_are_refused_at_construction(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_mesh_keeps_the_levers_of_the_strategy_named() -> None:
    fsdp_tp = resolve_strategy(st.FSDP(ac="selective", compile=True), mesh={"dp": 2, "tp": 2})
    assert isinstance(fsdp_tp, FSDPxTP)
    assert (fsdp_tp.ac, fsdp_tp.compile) == ("selective", True)
    # Moved up, so nothing is checkpointed twice.
    assert (fsdp_tp.fsdp.ac, fsdp_tp.fsdp.compile) == ("none", False)
    ddp_pp = resolve_strategy(st.DDP(ac="full"), mesh={"dp": 2, "pp": 2})
    assert isinstance(ddp_pp, PipelinexDDP)
    assert ddp_pp.pipeline.ac == "full"


def test_compile_on_a_cpu_without_a_compiler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"compile=True on the CPU needs a C\+\+ compiler"):
        check_compiler(torch.device("cpu"))
    check_compiler(torch.device("cpu"), "aot_eager")  # no code generated: no compiler needed


def test_cli_flags_are_checked_in_the_flags_words() -> None:
    use_cli_names(True)
    try:
        with pytest.raises(
            ConfigError,
            match=r"--ac-every 2 picks every K-th block for --ac selective, but the mode is --ac full",
        ):
            TrainConfig(ac="full", ac_every=2)
        with pytest.raises(ConfigError, match=r"--ac-every 0: expected a whole number >= 1"):
            TrainConfig(ac="selective", ac_every=0)
        strategy = TrainConfig(
            strategy="fsdp", ac="selective", ac_every=3, compile=True
        ).strategy_object()
        assert (type(strategy), strategy.ac, strategy.ac_every, strategy.compile) == (
            st.FSDP,
            "selective",
            3,
            True,
        )
        with pytest.raises(ConfigError, match=r"--strategy dp takes no --ac or --compile"):
            TrainConfig(strategy="dp", nproc=1, compile=True).strategy_object()
    finally:
        use_cli_names(False)


def test_eval_runs_without_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad a checkpointed block runs plainly (nothing to recompute)."""
    import torch.utils.checkpoint as cp

    calls = []
    real = cp.checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cp, "checkpoint", spy)
    model = GPT(SMALL)
    apply_levers(model, ac="full")
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    with torch.no_grad():
        model(x)
    assert calls == []
    model(x)
    assert len(calls) == SMALL.n_layer


def test_the_planner_profiles_each_checkpointing_mode() -> None:
    """The plan profiles the model with its blocks checkpointed: activation memory
    falls (most under full), and full's recomputed forward costs compute time."""
    from scaletrain.planner.api import plan
    from scaletrain.planner.layout import Layout

    rows = {
        ac: plan("gpt", devices=2, hardware="h100-sxm", ac=ac, layouts=[Layout("fsdp", dp=2)]).rows[
            0
        ]
        for ac in ("none", "full", "selective")
    }
    acts = {ac: row.memory.activations for ac, row in rows.items()}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert rows["full"].time.compute > rows["none"].time.compute
    with pytest.raises(ConfigError, match="ac_every=2 picks every k-th block"):
        plan("gpt", devices=2, hardware="h100-sxm", ac="full", ac_every=2)


def test_selective_recomputes_every_call_that_drew_random_numbers() -> None:
    """Recomputation restores the block's starting RNG state and redraws its random ops
    in order; a call kept from forward that drew numbers (CUDA's flash attention with
    dropout) would draw nothing on recompute and shift every later mask. So a kept op
    is kept only when its call drew nothing (attention without dropout)."""
    from scaletrain.strategies.levers import selective_keeps

    aten = torch.ops.aten
    q = torch.zeros(1, 1, 2, 4)
    for attention in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        op = getattr(aten, attention).default
        assert selective_keeps(op, (q, q, q, 0.0))
        assert not selective_keeps(op, (q, q, q, 0.1))
        assert not selective_keeps(op, (q, q, q), {"dropout_p": 0.1})
    assert selective_keeps(aten.mm.default, (q, q))
    assert not selective_keeps(aten.native_dropout.default, (q, 0.1, True))
    assert not selective_keeps(aten.add.Tensor, (q, q))

    def grads(ac: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(SMALL, dropout=0.1))
        apply_levers(model, ac=ac)
        x = torch.randint(0, SMALL.vocab_size, (4, SMALL.block_size))
        torch.manual_seed(1)
        model(x).float().pow(2).mean().backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads("selective"), grads("none"), strict=True))


def test_a_pipeline_refuses_ac_every_in_the_words_of_the_interface() -> None:
    with pytest.raises(ConfigError, match=r"PipelinexDDP\(\.\.\.\): ac_every=2 with a pipeline"):
        resolve_strategy(st.DDP(ac="selective", ac_every=2), mesh={"dp": 2, "pp": 2})
    use_cli_names(True)
    try:
        with pytest.raises(ConfigError, match=r"^--ac-every 2 with a pipeline: .* Fix: --ac full"):
            st.Pipeline(ac="selective", ac_every=2)
    finally:
        use_cli_names(False)


def test_a_pipeline_checkpoints_a_model_without_blocks_whole() -> None:
    """Its stages are checkpointed whole, so it needs no blocks: not refused before
    launch, and in one process the model is checkpointed whole."""
    flat = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    topo = _topology("pp")
    st.Pipeline(ac="full").check_model(flat, topo)
    # Four bare layers are one stage to FSDP (no units): the root is checkpointed.
    assert st.Pipeline(ac="full")._blocks(flat) == [""]


def test_a_mesh_leaves_the_users_strategy_as_it_was() -> None:
    mine = st.FSDP(ac="full", compile=True)
    composite = resolve_strategy(mine, mesh={"dp": 2, "tp": 2})
    assert (composite.ac, composite.compile) == ("full", True)
    assert (mine.ac, mine.compile) == ("full", True)
