"""scaletrain.strategies.partition: the one layer listing and balanced partition
behind pipeline stages and device_map="auto"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.strategies.partition import Layer, list_layers, list_units, split_layers
from scaletrain.train.models import SplitNet, WideResNet
from tests.trunk import ResidualBlock, TrunkNet


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


def test_blocks_in_a_nested_sequential_are_layers_of_their_own() -> None:
    # The blocks in an nn.Sequential beside the input layer and the head: each one is a
    # layer, so a balanced cut falls between blocks (not embed | all blocks + head).
    blocks = nn.Sequential(*(ResidualBlock(16) for _ in range(4)))
    model = nn.Sequential(nn.Embedding(50, 16), blocks, nn.Linear(16, 50))
    block = 16 * 16 + 16 + 2 * 16
    assert [(layer.name, layer.size) for layer in list_layers(model)] == [
        ("0", 800), *((f"1.{i}", block) for i in range(4)), ("2", 850),
    ]  # fmt: skip
    parts = split_layers(list_layers(model), 2)
    assert [[layer.name for layer in part] for part in parts] == [
        ["0", "1.0", "1.1"], ["1.2", "1.3", "2"],
    ]  # fmt: skip
    # The same under an attribute of the user's own module.
    assert [layer.name for layer in list_layers(TrunkNet())] == [
        "embed", "trunk.0", "trunk.1", "trunk.2", "trunk.3", "head",
    ]  # fmt: skip
    parts = split_layers(list_layers(TrunkNet()), 2)
    assert [part[-1].name for part in parts] == ["trunk.1", "head"]
    # At any depth: WideResNet's groups are a Sequential of Sequentials of blocks.
    assert [layer.name for layer in list_layers(WideResNet())] == [
        "conv", "groups.0.0", "groups.1.0", "groups.2.0", "bn", "fc",
    ]  # fmt: skip


def test_a_container_whose_forward_is_its_own_is_not_opened() -> None:
    class Reversed(nn.Sequential):
        """Runs its entries last to first: a cut between two of them is no boundary."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in reversed(self):
                x = block(x)
            return x

    class Trunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x)) + x

    model = nn.Sequential(nn.Linear(4, 8), Reversed(nn.Linear(8, 8), nn.Linear(8, 8)), Trunk())
    assert [n for n, _ in list_units(model)] == ["0", "1", "2"]

    # A plain Sequential subclass (forward untouched) still runs its entries in order.
    class Plain(nn.Sequential):
        pass

    plain = nn.Sequential(nn.Linear(2, 2), Plain(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert [n for n, _ in list_units(plain)] == ["0", "1.0", "1.1"]
