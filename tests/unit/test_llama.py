"""The Llama-shaped model of the llama recipes: its math against Meta's reference
formulation, its published sizes, and what the strategies read from it (FSDP's units,
the tensor-parallel plan)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from scaletrain.train.llama import (
    LLAMA_SHAPES,
    LLAMA_TP_PLAN,
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaShape,
    apply_rope,
    rope_tables,
)

TINY = LlamaShape(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)


def _meta_rope(x: torch.Tensor, shape: LlamaShape, t: int) -> torch.Tensor:
    """Meta's reference: pairs of features as complex numbers times e^(i m theta_j)."""
    half = shape.head_dim // 2
    freqs = 1.0 / (
        shape.rope_theta ** (torch.arange(0, 2 * half, 2)[:half].float() / shape.head_dim)
    )
    cis = torch.polar(torch.ones(t, half), torch.outer(torch.arange(t).float(), freqs))
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3).type_as(x)


def _reference_attention(attn: LlamaAttention, shape: LlamaShape, x: torch.Tensor) -> torch.Tensor:
    """Attention written out: softmax(q k^T / sqrt(d) + causal mask) v, query head h
    reading key/value head h // (heads / kv_heads), rotary as Meta's reference."""
    b, t, _ = x.shape
    d = shape.head_dim
    q = _meta_rope(attn.wq(x).view(b, t, shape.n_heads, d), shape, t)
    k = _meta_rope(attn.wk(x).view(b, t, shape.kv_heads, d), shape, t)
    v = attn.wv(x).view(b, t, shape.kv_heads, d)
    group = shape.n_heads // shape.kv_heads
    heads = []
    mask = torch.full((t, t), float("-inf")).triu(1)
    for h in range(shape.n_heads):
        kh, vh = k[:, :, h // group], v[:, :, h // group]
        scores = q[:, :, h] @ kh.transpose(1, 2) / math.sqrt(d) + mask
        heads.append(scores.softmax(-1) @ vh)
    return attn.wo(torch.cat(heads, dim=-1))


def test_logits_have_the_vocabulary_and_too_long_a_sequence_is_refused() -> None:
    torch.manual_seed(0)
    model = Llama(TINY)
    assert model(torch.randint(0, 64, (3, 16))).shape == (3, 16, 64)
    with pytest.raises(ValueError, match="at most max_seq_len=16"):
        model(torch.randint(0, 64, (1, 17)))


def test_attention_equals_the_written_out_formula_with_grouped_heads() -> None:
    torch.manual_seed(0)
    attn = LlamaAttention(TINY)
    x = torch.randn(2, 11, TINY.dim)
    cos, sin = rope_tables(TINY, 11)
    torch.testing.assert_close(attn(x, cos, sin), _reference_attention(attn, TINY, x))


def test_grouped_query_attention_equals_full_heads_with_the_shared_heads_copied() -> None:
    """A key/value head serving two query heads is the same as two full heads holding
    its weights: GQA with n_kv_heads=2 equals MHA (n_kv_heads == n_heads) whose k/v
    heads are copied, in Meta's order (query head h reads kv head h // 2)."""
    torch.manual_seed(0)
    full_shape = LlamaShape(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=8)
    gqa, full = LlamaAttention(TINY), LlamaAttention(full_shape)
    d = TINY.head_dim
    with torch.no_grad():
        for name in ("wq", "wo"):
            getattr(full, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("wk", "wv"):
            heads = getattr(gqa, name).weight.view(TINY.kv_heads, d, TINY.dim)
            getattr(full, name).weight.copy_(
                heads.repeat_interleave(2, dim=0).reshape(-1, TINY.dim)
            )
    x = torch.randn(2, 9, TINY.dim)
    cos, sin = rope_tables(TINY, 9)
    torch.testing.assert_close(gqa(x, cos, sin), full(x, cos, sin), rtol=0, atol=1e-6)


def test_rope_is_meta_s_complex_rotation() -> None:
    x = torch.randn(2, 13, 3, TINY.head_dim)
    cos, sin = rope_tables(TINY, 13)
    torch.testing.assert_close(apply_rope(x, cos, sin), _meta_rope(x, TINY, 13))


def test_rope_scores_depend_only_on_the_distance_between_positions() -> None:
    shape = LLAMA_SHAPES["debug"]
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, 1, shape.head_dim, generator=g),
        torch.randn(1, 1, 1, shape.head_dim, generator=g),
    )
    cos, sin = rope_tables(shape, 200)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return float((qm * kn).sum())

    for m, n in ((5, 2), (40, 9), (3, 3)):
        for shift in (1, 17, 150):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(9, 2), abs=1e-3)


def test_llama_3_1_frequency_scaling() -> None:
    """Llama 3.1's reference apply_scaling, loop by loop, against the tables."""
    shape = LLAMA_SHAPES["8b"]
    base = LlamaShape(**{**{f: getattr(shape, f) for f in shape.__slots__}, "rope_scaling": None})
    half = shape.head_dim // 2
    freqs = 1.0 / (
        shape.rope_theta ** (torch.arange(0, shape.head_dim, 2)[:half].float() / shape.head_dim)
    )
    expected = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            expected.append(f)
        elif wavelen > 8192 / 1:
            expected.append(f / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected.append((1 - smooth) * f / 8 + smooth * f)
    # Position 1's angles are the frequencies themselves.
    cos, sin = rope_tables(shape, 2)
    torch.testing.assert_close(torch.atan2(sin[1], cos[1]), torch.tensor(expected))
    cos0, sin0 = rope_tables(base, 2)
    torch.testing.assert_close(torch.atan2(sin0[1], cos0[1]), freqs)


@pytest.mark.parametrize(
    ("size", "ffn", "params", "published"),
    [("1b", 8192, 1_235_814_400, 1.24e9), ("8b", 14336, 8_030_261_248, 8.03e9)],
)
def test_the_big_sizes_have_the_published_shapes(
    size: str, ffn: int, params: int, published: float
) -> None:
    shape = LLAMA_SHAPES[size]
    assert shape.ffn_hidden == ffn  # Meta's rounding: 2/3 * 4 dim * multiplier, up to multiple_of
    with torch.device("meta"):
        model = Llama(shape)
    count = sum(p.numel() for p in model.parameters())  # a tied matrix once
    assert count == params
    assert abs(count - published) / published < 0.01


def test_a_tied_head_is_the_embedding() -> None:
    with torch.device("meta"):
        model = Llama(LLAMA_SHAPES["1b"])
    assert model.output.weight is model.tok_embeddings.weight
    assert {"output.weight", "tok_embeddings.weight"} <= set(model.state_dict())


def test_a_seed_gives_the_same_weights_and_the_residual_outputs_shrink_with_depth() -> None:
    shape = LlamaShape(dim=256, n_layers=4, n_heads=4, vocab_size=512)
    torch.manual_seed(3)
    a = Llama(shape)
    torch.manual_seed(3)
    b = Llama(shape)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    for i, layer in enumerate(a.layers):
        assert isinstance(layer, LlamaBlock)
        std = float(layer.attention.wo.weight.detach().std())
        assert std == pytest.approx(0.02 / math.sqrt(2 * (i + 1)), rel=0.05)
    assert float(a.output.weight.detach().std()) == pytest.approx(256**-0.5, rel=0.05)
    assert float(a.tok_embeddings.weight.detach().std()) == pytest.approx(1.0, rel=0.05)


def test_fsdp_units_are_the_blocks() -> None:
    from scaletrain.strategies.fsdp import auto_wrap_targets

    assert auto_wrap_targets(Llama(TINY)) == ["layers.0", "layers.1"]


def test_tensor_parallel_takes_the_declared_plan_and_the_planner_finds_the_same() -> None:
    from scaletrain.strategies.tensor import TensorParallel
    from scaletrain.strategies.tensor_plan import default_tp_plan, matching_modules

    model = Llama(TINY)
    assert TensorParallel().resolved_plan(model) == LLAMA_TP_PLAN
    # The planner reads the default plan (by names and shapes): the same layers, styles.
    expanded = {
        name: style for key, style in LLAMA_TP_PLAN.items() for name in matching_modules(model, key)
    }
    assert default_tp_plan(model) == expanded


def test_a_tensor_parallel_degree_that_splits_a_key_value_head_is_refused() -> None:
    from scaletrain.errors import ConfigError
    from scaletrain.strategies.tensor_plan import check_tp_plan

    model = Llama(TINY)  # 4 query heads, 2 key/value heads
    check_tp_plan(model, LLAMA_TP_PLAN, 2)
    with pytest.raises(ConfigError, match=r"layers\.0\.attention\.wk holds 2 heads"):
        check_tp_plan(model, LLAMA_TP_PLAN, 4)


@pytest.mark.parametrize("degree", [1, 2])
def test_each_rank_s_share_of_the_heads_sums_to_the_whole_attention(degree: int) -> None:
    """Tensor parallel's arithmetic without processes: rank r holds rows r of wq/wk/wv
    (its query heads and the key/value heads serving them) and columns r of wo; the
    ranks' outputs summed (the all-reduce) are the unsplit attention's."""
    torch.manual_seed(0)
    attn = LlamaAttention(TINY)
    x = torch.randn(2, 7, TINY.dim)
    cos, sin = rope_tables(TINY, 7)
    total = torch.zeros(2, 7, TINY.dim)
    for r in range(degree):
        part = LlamaAttention(TINY)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                rows = getattr(attn, name).weight.chunk(degree, dim=0)[r]
                setattr(part, name, nn.Linear(TINY.dim, rows.shape[0], bias=False))
                getattr(part, name).weight.copy_(rows)
            cols = attn.wo.weight.chunk(degree, dim=1)[r]
            part.wo = nn.Linear(cols.shape[1], TINY.dim, bias=False)
            part.wo.weight.copy_(cols)
        total += part(x, cos, sin)
    torch.testing.assert_close(total, attn(x, cos, sin))


def test_the_recipes_train_on_the_byte_corpus_at_their_sizes() -> None:
    from scaletrain.train.recipes import get_recipe

    debug = get_recipe("llama")
    with torch.device("meta"):
        model = debug.build()
    assert isinstance(model, Llama) and model.config == LLAMA_SHAPES["debug"]
    x, y = debug.data(None, "test")[0]
    assert x.shape == y.shape == (64,) and int(x.max()) < 256
    assert torch.equal(x[1:], y[:-1])
    for name, seq, vocab in (("llama-1b", 2048, 128256), ("llama-8b", 8192, 128256)):
        inputs, targets = get_recipe(name).example(2)
        assert inputs.shape == targets.shape == (2, seq)
        assert int(inputs.max()) < vocab


def test_every_recipe_is_a_choice_of_the_recipe_flag() -> None:
    from scaletrain.settings import field_specs
    from scaletrain.train.config import TrainConfig
    from scaletrain.train.recipes import RECIPES

    (spec,) = (s for s in field_specs(TrainConfig) if s.name == "recipe")
    assert spec.choices is not None and set(spec.choices) == set(RECIPES)
    assert {"llama", "llama-1b", "llama-8b"} <= set(RECIPES)


def test_the_8b_builds_under_the_planner_s_fake_tensors() -> None:
    """`scaletrain plan --recipe llama-8b --hardware ...` builds the model under a
    FakeTensorMode (no memory): its initialisation may not depend on the values it
    draws (torch's own trunc_normal_ does, and raised there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = Llama(LLAMA_SHAPES["8b"])
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_the_head_s_truncation_holds_and_its_spread_is_the_normal_s() -> None:
    from scaletrain.train.llama import _truncated_normal_

    w = torch.empty(200_000)
    torch.manual_seed(0)
    _truncated_normal_(w, std=0.05, cutoff=3.0)
    assert float(w.abs().max()) <= 0.15 + 1e-6
    # A normal truncated at 3 sigma keeps 98.7% of its standard deviation.
    assert float(w.std()) == pytest.approx(0.05 * 0.9866, rel=0.01)
    assert abs(float(w.mean())) < 1e-3


def test_a_paper_plan_of_the_llama_recipe_splits_only_whole_key_value_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from scaletrain import cli

    code = cli.main(["plan", "--recipe", "llama", "--devices", "4", "--hardware", "h100-sxm"])
    out = capsys.readouterr().out
    assert code == 0
    for row in ("fsdp dp=4", "fsdp x tp dp=2,tp=2", "ddp x pp dp=2,pp=2", "pipeline pp=4"):
        assert row in out, out
    assert "tensor tp=4" not in out, out  # 2 key/value heads do not split 4 ways


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"dim": 30, "n_heads": 4}, "dim=30 must be divisible by n_heads=4"),
        ({"dim": 12, "n_heads": 4}, "head width dim / n_heads = 3 must be even"),
        ({"dim": 32, "n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3 must divide n_heads=4"),
        ({"dim": 32, "n_heads": 4, "n_kv_heads": 0}, "n_kv_heads=0 must divide n_heads=4"),
    ],
)
def test_a_shape_that_cannot_be_built_says_why(fields: dict[str, int], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LlamaShape(**fields)


def test_the_default_loss_is_taken_in_fp32() -> None:
    """Under sharded FSDP no autocast runs: the default loss took bf16 logits as they
    came, where one process (autocast) computes the same cross-entropy in fp32."""
    from scaletrain.train.recipes import get_recipe

    logits = torch.randn(2, 8, 64).to(torch.bfloat16)
    targets = torch.randint(0, 64, (2, 8))
    loss = get_recipe("llama").loss(logits, targets)
    assert loss.dtype == torch.float32
    want = nn.functional.cross_entropy(logits.float().reshape(-1, 64), targets.reshape(-1))
    assert torch.equal(loss, want)
    wide = torch.randn(2, 8, 64, dtype=torch.float64)  # wider than fp32 stays as it is
    assert get_recipe("llama").loss(wide, targets).dtype == torch.float64


def test_evaluation_sums_the_loss_in_fp32() -> None:
    """Evaluation's sums took bf16 logits as they came under sharded FSDP (no autocast),
    summing in bf16; one process's autocast sums in fp32. The sum, not only each term,
    is fp32: the same as one process's to the bit."""
    from scaletrain.train.loop import cross_entropy_sums

    logits = torch.randn(4, 256, 64).to(torch.bfloat16)
    targets = torch.randint(0, 64, (4, 256))
    total, correct, counted = cross_entropy_sums(logits, targets)
    assert total.dtype == torch.float32
    flat = logits.float().reshape(-1, 64)
    assert torch.equal(
        total, nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="sum")
    )
    assert int(counted) == 1024 and int(correct) == int(
        (flat.argmax(1) == targets.reshape(-1)).sum()
    )
