"""scaletrain.plan: the one layer listing and balanced partition behind pipeline stages
and device_map="auto"."""

from __future__ import annotations

import pytest
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.strategies.partition import Layer, list_layers, list_units, split_layers
from scaletrain.train.models import SplitNet


def test_parameter_free_modules_join_a_neighbouring_layer() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Linear(2, 3), nn.Dropout(), nn.Linear(3, 2))
    assert list_layers(model) == [
        Layer(name="1", members=("0", "1", "2"), size=9),
        Layer(name="3", members=("3",), size=8),
    ]
    assert [layer.name for layer in list_layers(SplitNet())] == ["sub_net1", "sub_net2"]


def test_a_single_wrapping_child_is_opened() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8)))
    assert [n for n, _ in list_units(model)] == ["0.0", "0.1", "0.2"]
    assert [(layer.name, layer.size) for layer in list_layers(model)] == [("0.0", 20), ("0.2", 40)]
    assert list_units(nn.Linear(2, 2)) == []
    assert list_layers(nn.Sequential(nn.ReLU(), nn.Tanh())) == []


def test_split_uses_at_most_one_part_per_layer() -> None:
    layers = list_layers(SplitNet())
    parts = split_layers(layers, 5)
    assert [[layer.name for layer in part] for part in parts] == [["sub_net1"], ["sub_net2"]]
    assert split_layers(layers, 1) == [layers]
    assert split_layers([], 3) == []
    with pytest.raises(ConfigError, match="at least 1"):
        split_layers(layers, 0)
