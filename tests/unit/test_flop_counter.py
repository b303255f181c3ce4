"""The step ledger's FLOP count never stops training (found on an H200, torch 2.11: a
Hugging Face Llama's grouped-query attention made torch's formula for fused attention
raise inside the forward, and the run died at its first step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _failing(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")


def test_grouped_query_attention_is_counted_where_torchs_formula_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.utils.flop_counter as fc

    from scaletrain.observe.metrics.flops import FlopCounter, attention_flops

    # torch before 2.13: the fused ops' formulas refuse fewer key/value heads.
    ops = [torch.ops.aten._scaled_dot_product_flash_attention,
           torch.ops.aten._scaled_dot_product_flash_attention_backward]  # fmt: skip
    real = dict(fc.flop_registry)
    monkeypatch.setattr(fc, "flop_registry", {**real, **dict.fromkeys(ops, _failing)})
    q = torch.randn(2, 8, 16, 4)
    k, v = torch.randn(2, 2, 16, 4), torch.randn(2, 2, 16, 4)
    counter = FlopCounter()
    counter.start()
    # Called as the op a CUDA kernel would run: the guard sees the raw tensors.
    counted = counter._mode.flop_registry[ops[0]](q, k, v)
    backward = counter._mode.flop_registry[ops[1]](torch.randn(2, 8, 16, 4), q, k, v)
    counter.stop()
    assert counted == attention_flops(q, k, v) == 2 * 2 * 8 * 16 * 16 * 4 * 2
    assert backward == 2 * counted and counter.problems == []


def test_an_op_whose_formula_fails_counts_nothing_and_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.utils.flop_counter as fc

    from scaletrain.observe.metrics.flops import FlopCounter

    monkeypatch.setattr(fc, "flop_registry", {**fc.flop_registry, torch.ops.aten.mm: _failing})
    a = torch.randn(8, 8, requires_grad=True)
    counter = FlopCounter()
    counter.start()
    (a @ a).sum().backward()  # training goes on
    total = counter.stop()
    assert total >= 0 and a.grad is not None
    assert counter.problems and counter.problems[0].startswith("aten.mm: AssertionError")


def test_attention_on_a_cpu_is_counted() -> None:
    """torch's counter has no formula for the CPU's fused attention: a model's
    attention counted 0 there, and so did a plan profiled on a CPU."""
    import torch.nn.functional as F

    from scaletrain.observe.metrics.flops import FlopCounter, attention_flops

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, requires_grad=True)
    counter = FlopCounter()
    counter.start()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    forward = counter.count()
    out.sum().backward()
    total = counter.stop()
    assert forward == attention_flops(q, k, v) > 0
    assert total == 3 * forward
    assert counter.problems == []


def _offsets(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


GROUPED = {  # mat_a, mat_b, offsets, the same product one matmul per group
    "tokens by experts": (
        torch.randn(12, 16), torch.randn(3, 16, 8), _offsets(4, 8, 12),
        lambda a, b: [a[s:e] @ b[g] for g, (s, e) in enumerate([(0, 4), (4, 8), (8, 12)])],
    ),
    "batched": (torch.randn(3, 4, 16), torch.randn(3, 16, 8), None, lambda a, b: [*a @ b]),
    "a weight gradient": (
        torch.randn(12, 16), torch.randn(16, 8), _offsets(4, 8, 16),
        lambda a, b: [a[:, s:e] @ b[s:e] for s, e in [(0, 4), (4, 8), (8, 16)]],
    ),
    "columns by groups": (
        torch.randn(3, 12, 16), torch.randn(16, 24), _offsets(8, 16, 24),
        lambda a, b: [a[g] @ b[:, s:e] for g, (s, e) in enumerate([(0, 8), (8, 16), (16, 24)])],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", GROUPED)
def test_a_mixture_of_experts_grouped_matmul_counts_as_its_matmuls(case: str) -> None:
    """torch's counter has no formula for torch._grouped_mm, the matmul transformers
    runs a mixture of experts' layers with: their experts counted 0 FLOPs in a run's
    MFU and in a plan. It counts what the same product, one matmul per group, counts."""
    from scaletrain.observe.metrics.flops import FlopCounter

    a, b, offs, per_group = GROUPED[case]
    counter = FlopCounter()
    counter.start()
    out = torch._grouped_mm(a, b, offs=offs)
    grouped = counter.stop()
    counter.start()
    parts = per_group(a, b)
    expected = counter.stop()
    assert grouped == expected > 0 and counter.problems == []
    # The groups as the offsets cut them (the loop is the op's product).
    whole = torch.stack(parts) if out.dim() == 3 else torch.cat(parts, dim=1 if a.dim() == 3 else 0)
    torch.testing.assert_close(out, whole)


def test_a_grouped_matmuls_backward_counts_twice_its_forward() -> None:
    import torch.nn.functional as F

    from scaletrain.observe.metrics.flops import FlopCounter

    a = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    counter = FlopCounter()
    counter.start()
    out = F.grouped_mm(a, w, offs=_offsets(4, 8, 12))
    forward = counter.count()
    out.backward(torch.randn_like(out))
    assert forward == 2 * 12 * 16 * 8 and counter.stop() == 3 * forward


@pytest.mark.parametrize("groups", [1, 64])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_convolutions_backward_counts_its_forward_once_per_gradient(
    groups: int, transposed: bool
) -> None:
    """torch's formula counts a convolution's weight gradient as if it had one group:
    a depthwise convolution's (a Mamba block's) backward counted 64 times too much
    here, and a Qwen3-Next's step 63 times its forward. Each gradient (the weight's;
    the input's where it needs one) multiplies what the forward did; with one group,
    torch's own count."""
    from torch.utils.flop_counter import FlopCounterMode

    from scaletrain.observe.metrics.flops import FlopCounter

    kind = torch.nn.ConvTranspose1d if transposed else torch.nn.Conv1d
    conv = kind(64, 64, 4, groups=groups, padding=1)
    for needs_grad in (False, True):  # the first layer's input needs none
        x = torch.randn(2, 64, 32, requires_grad=needs_grad)
        counter = FlopCounter()
        counter.start()
        y = conv(x)
        forward = counter.count()
        y.sum().backward()
        assert counter.stop() == (3 if needs_grad else 2) * forward and counter.problems == []
        if groups == 1:
            with FlopCounterMode(display=False) as torchs:
                conv(x).sum().backward()
            assert torchs.get_total_flops() == counter.total


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_counted_step_peaks_where_every_other_step_does(ac: str) -> None:
    """The counted step (a run's first, for MFU; a plan's profile) holds what an
    uncounted one holds. torch's counter ran silu_backward as its decomposition (more
    temporaries in a SwiGLU's backward), and hung backward hooks on the outputs of each
    checkpointed block's recomputation, keeping them, and with them the recomputed
    blocks' saved tensors, until the count ended: under full checkpointing the step
    took about the memory of none, so a run that fits only with checkpointing would
    run out of memory at its first step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from scaletrain.observe.metrics.flops import FlopCounter
    from scaletrain.planner.models import resolve_model
    from scaletrain.strategies.levers import apply_levers

    planned = resolve_model("llama", None, seq_len=256, batch_size=16)
    x, y = planned.example(16)

    def step(counted: bool, ac: str) -> tuple[float, int, int]:
        model = planned.build()
        if ac != "none":
            apply_levers(model, ac=ac, owner="test")
        counter, tracker = FlopCounter(), MemTracker()
        tracker.track_external(model)
        with tracker:
            if counted:
                counter.start()
            planned.loss(model(x), y).backward()
            flops = counter.stop() if counted else 0
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return peak, flops, counter.recomputed

    uncounted, _, _ = step(counted=False, ac=ac)
    counted, flops, recomputed = step(counted=True, ac=ac)
    assert counted == uncounted
    plain = step(counted=True, ac="none")[1]
    if ac == "full":  # the recomputation still counts: the blocks' forward twice
        assert 1.2 * plain < flops < 1.34 * plain
    # ... as time, not as the model's FLOPs (MFU's): those are the same either way. They
    # were not told apart, so --ac full raised the MFU it slowed (a hardware utilisation).
    assert flops - recomputed == plain


def test_inference_and_reentrant_checkpointing_are_counted_by_their_modules() -> None:
    """What the counted step's fixes must keep (found by a review of a first version,
    which lost both): an op that is only a composition (linear under inference_mode)
    still decomposes into the matmul that counts, and a reentrant checkpoint's
    recomputation and the backward run on it are named by the module they run in
    (before these fixes its backward was named by no module)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from scaletrain.observe.metrics.flops import FlopCounter

    layer, x = nn.Linear(64, 32), torch.randn(8, 64)
    counter = FlopCounter()
    counter.start()
    with torch.inference_mode():
        layer(x)
    assert counter.stop() == 2 * 8 * 64 * 32

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)

    counter.start()
    Net()(x.requires_grad_()).sum().backward()
    counter.stop()
    # forward, its recomputation, and the backward's two matmuls: 4 of 2 x 8 x 64 x 64
    assert sum(counter.by_module()["Net.inner"].values()) == 4 * 2 * 8 * 64 * 64
