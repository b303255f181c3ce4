"""Tensor parallel takes the plan a Hugging Face model declares (base_model_tp_plan)."""

from __future__ import annotations

import pytest
from torch import nn

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_hugging_face_models_own_plan_is_the_default() -> None:
    from scaletrain.strategies.tensor import TensorParallel

    model = _llama()
    declared = model.config.base_model_tp_plan
    plan = TensorParallel().resolved_plan(model)
    # The base model's keys under the task model's base_model_prefix ("model").
    assert plan == {f"model.{k}": v for k, v in declared.items()}
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"


def test_a_declared_plan_with_styles_scaletrain_does_not_apply_is_refused() -> None:
    from scaletrain.errors import ConfigError
    from scaletrain.strategies.tensor_plan import declared_tp_plan

    model = _llama()
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(ConfigError, match="styles local_colwise, which scaletrain does not"):
        declared_tp_plan(model)
