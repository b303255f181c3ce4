"""Precision choices, their errors, and their effect in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.precision import Precision


def test_unknown_precision_lists_the_choices() -> None:
    with pytest.raises(st.ConfigError, match=r"precision='fp8'.*32, bf16-mixed, fp16-mixed"):
        Precision(name="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_fp16_on_cpu_says_it_needs_cuda_and_offers_bf16() -> None:
    with pytest.raises(st.ConfigError) as info:
        st.init(precision="fp16-mixed", env="local")
    assert "CUDA" in str(info.value) and "bf16-mixed" in str(info.value)


def test_bf16_mixed_autocasts_forward_keeps_fp32_weights() -> None:
    rt = st.init(precision="bf16-mixed", env="local", device="cpu")
    bare = nn.Linear(4, 3)
    model, _ = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    out = rt.predict(model, torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    loss = rt.forward_backward(
        model, torch.randn(2, 4), torch.tensor([0, 1]), nn.functional.cross_entropy
    )
    assert torch.isfinite(loss)
    assert bare.weight.dtype == torch.float32 and bare.weight.grad is not None
    assert bare.weight.grad.dtype == torch.float32
    rt.shutdown()


def test_bf16_true_casts_weights_and_inputs() -> None:
    rt = st.init(precision="bf16-true", env="local", device="cpu")
    model = rt.setup(nn.Linear(4, 3))
    assert next(model.parameters()).dtype == torch.bfloat16
    out = rt.predict(model, torch.randn(2, 4))  # float32 input cast for the user
    assert out.dtype == torch.bfloat16
    rt.shutdown()


def test_accumulate_rejects_bad_steps() -> None:
    rt = st.init(env="local", device="cpu")
    model = rt.setup(nn.Linear(2, 2))
    with pytest.raises(st.ConfigError, match=r"steps=0"), rt.accumulate(model, steps=0):
        pass
    rt.shutdown()
