"""A sample longer than the model's learned position table is refused before the first
step, in one line (the first forward would raise an IndexError deep inside
torch.embedding on every rank, or on a GPU a device-side assert); models whose positions
take any length, and data that is not token ids, are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.train.positions import check_sample_length, longest_sequence, position_table

pytestmark = pytest.mark.timeout(60)


class _Learned(nn.Module):
    """GPT-2's shape: a token table and a position table `wpe` (of `positions` rows)."""

    def __init__(self, positions: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 4)
        self.wpe = nn.Embedding(positions, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wte(x) + self.wpe(torch.arange(x.shape[1]))


class _Rotary(nn.Module):
    """A rotary model: no position table; its config's maximum is no limit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 4)
        self.config = type("C", (), {"max_position_embeddings": 8})()


def _tokens(n: int, length: int) -> TensorDataset:
    x = torch.randint(0, 50, (n, length))
    return TensorDataset(x, x)


def test_a_sample_longer_than_the_position_table_is_refused_with_the_fix() -> None:
    model = _Learned(8)
    use_cli_names()
    try:
        with pytest.raises(ConfigError) as info:
            check_sample_length(model, {"training": _tokens(4, 16)}, "--model m.py:build")
    finally:
        use_cli_names(False)
    said = str(info.value)
    assert said.startswith(
        "--model m.py:build: its position table wpe has 8 rows (one per position), and the "
        "training data's samples are 16 tokens long"
    ), said
    assert "Fix: samples of at most 8 tokens (--data" in said and info.value.field == "data"
    # What the refusal prevents: the first forward fails inside torch.embedding.
    with pytest.raises(IndexError):
        model(_tokens(1, 16)[0][0][None])


def test_each_split_is_checked_and_samples_within_the_table_pass() -> None:
    model = _Learned(8)
    check_sample_length(model, {"training": _tokens(4, 8), "test": _tokens(2, 3)}, "m")
    with pytest.raises(ConfigError, match="the test data's samples are 9 tokens"):
        check_sample_length(model, {"training": _tokens(4, 8), "test": _tokens(2, 9)}, "m")

    # A sample's inputs as a mapping of input_ids, as a tokenizer returns them.
    class Dicts(torch.utils.data.Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            return {"input_ids": torch.zeros(12, dtype=torch.long)}, torch.zeros(12)

    with pytest.raises(ConfigError, match="samples are 12 tokens"):
        check_sample_length(model, {"training": Dicts()}, "m")


def test_what_cannot_be_read_ahead_or_has_no_table_is_left_to_the_step() -> None:
    class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield torch.zeros(99, dtype=torch.long), torch.zeros(99, dtype=torch.long)

    floats = TensorDataset(torch.randn(4, 99), torch.randn(4))
    empty = _tokens(0, 99)
    check_sample_length(_Learned(8), {"a": Stream(), "b": floats, "c": empty}, "m")
    check_sample_length(_Rotary(), {"training": _tokens(4, 99)}, "m")
    assert position_table(_Rotary()) is None
    assert longest_sequence(_Rotary()) == ("config.max_position_embeddings", 8)
    assert longest_sequence(_Learned(8)) == ("wpe", 8)


def test_the_gpt_recipes_own_table_is_found() -> None:
    from scaletrain.train.models import GPT, GPTConfig

    assert position_table(GPT(GPTConfig(block_size=24))) == ("pos_emb", 24)
