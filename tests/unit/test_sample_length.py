"""A batch longer than the model's learned position table is refused before the first
step, in one line (the first forward would raise an IndexError deep inside
torch.embedding on every rank, or on a GPU a device-side assert); models whose positions
take any length, whose table is not surely one (several, a name that only holds "pos",
a config that says otherwise), and data that is not token ids are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.train.positions import check_batch_length, longest_sequence, position_table

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


def _tokens(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 50, (n, length))
    return x, x


def test_a_batch_longer_than_the_position_table_is_refused_with_the_fix() -> None:
    model = _Learned(8)
    table = position_table(model)
    assert table == ("wpe", 8)
    use_cli_names()
    try:
        with pytest.raises(ConfigError) as info:
            check_batch_length(table, _tokens(4, 16), "--model m.py:build")
    finally:
        use_cli_names(False)
    said = str(info.value)
    assert said.startswith(
        "--model m.py:build: its position table wpe has 8 rows (one per position), and the "
        "data's samples are 16 tokens long"
    ), said
    assert "Fix: samples of at most 8 tokens (--data" in said and info.value.field == "data"
    # What the refusal prevents: the first forward fails inside torch.embedding.
    with pytest.raises(IndexError):
        model(_tokens(1, 16)[0])
    check_batch_length(table, _tokens(4, 8), "m")  # within the table
    # Inputs as a mapping: input_ids are checked; with position_ids of their own
    # (packed sequences), the model decides.
    with pytest.raises(ConfigError, match="samples are 12 tokens"):
        check_batch_length(table, ({"input_ids": torch.zeros(2, 12, dtype=torch.long)},), "m")
    given = {"input_ids": torch.zeros(2, 12, dtype=torch.long), "position_ids": None}
    check_batch_length(table, (given,), "m")
    check_batch_length(table, (torch.randn(4, 99), torch.zeros(4)), "m")  # features


def test_only_a_table_that_is_surely_the_positions_counts() -> None:
    assert position_table(_Rotary()) is None
    assert longest_sequence(_Rotary()) == ("config.max_position_embeddings", 8)
    assert longest_sequence(_Learned(8)) == ("wpe", 8)

    class TwoTowers(nn.Module):  # CLIP: text and vision tables of their own lengths
        def __init__(self) -> None:
            super().__init__()
            self.text = nn.Module()
            self.text.position_embedding = nn.Embedding(77, 4)
            self.vision = nn.Module()
            self.vision.position_embedding = nn.Embedding(50, 4)

    class Tags(nn.Module):  # a part-of-speech table is no position table
        def __init__(self) -> None:
            super().__init__()
            self.pos_tag_emb = nn.Embedding(18, 4)
            self.rel_pos_bias = nn.Embedding(32, 4)

    disagreeing = _Learned(8)
    disagreeing.config = type("C", (), {"n_positions": 1024})()  # type: ignore[assignment]
    agreeing = _Learned(8)
    agreeing.config = type("C", (), {"n_positions": 8})()  # type: ignore[assignment]
    assert position_table(TwoTowers()) is None and position_table(Tags()) is None
    assert position_table(disagreeing) is None and position_table(agreeing) == ("wpe", 8)


def test_the_gpt_recipes_own_table_is_found() -> None:
    from scaletrain.train.models import GPT, GPTConfig

    assert position_table(GPT(GPTConfig(block_size=24))) == ("pos_emb", 24)
