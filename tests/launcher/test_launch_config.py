"""LaunchConfig validation: each bad value is named with what was expected and the fix."""

from __future__ import annotations

import pytest

from scaletrain.errors import ConfigError
from scaletrain.launch import LaunchConfig
from scaletrain.launch.config import parse_endpoint, parse_nnodes


def test_defaults_are_valid() -> None:
    cfg = LaunchConfig()
    assert cfg.nproc_per_node is None and cfg.nnodes is None and cfg.node_rank is None
    # None: the platform's restarts (a Kubeflow elasticPolicy), else 0.
    assert cfg.max_restarts is None and not cfg.run_as_module and dict(cfg.extra_env) == {}


def test_is_kw_only_and_slotted() -> None:
    with pytest.raises(TypeError):
        LaunchConfig(2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        LaunchConfig().no_such_field = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), (" 3:3 ", (3, 3))]
)
def test_parse_nnodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("bad", ["0", "two", "4:1", "1:2:3", "", "-1", "1:"])
def test_bad_nnodes(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(nnodes=bad)
    msg = str(info.value)
    assert f"--nnodes {bad!r}" in msg
    assert "MIN:MAX" in msg and "Fix:" in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node0.cluster:1234", ("node0.cluster", 1234)),
        ("[::1]:29500", ("::1", 29500)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "bad", ["node0", "node0:", ":29500", "node0:http", "h:0", "h:70000", "::1:5"]
)
def test_bad_endpoint(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(nnodes="2", rdzv_endpoint=bad)
    msg = str(info.value)
    assert repr(bad) in msg and "HOST:PORT" in msg and "1..65535" in msg and "Fix:" in msg


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nproc_per_node": 0}, ["--nproc-per-node 0", ">= 1", "Fix:"]),
        ({"node_rank": 2, "nnodes": "2"}, ["--node-rank 2", "0..1", "Fix:"]),
        ({"node_rank": 1}, ["--node-rank 1", "0..0", "raise --nnodes"]),
        ({"node_rank": -1, "nnodes": "2"}, ["--node-rank -1", "0..1"]),
        ({"rdzv_id": "my job"}, ["'my job'", "without spaces", "Fix:"]),
        ({"max_restarts": -1}, ["--max-restarts -1", ">= 0", "Fix:"]),
        ({"rdzv_timeout": 0}, ["--rdzv-timeout 0", ">= 1", "Fix:"]),
        ({"monitor_interval": 0.0}, ["--monitor-interval 0.0", "positive", "Fix:"]),
        ({"monitor_interval": float("inf")}, ["--monitor-interval inf", "finite", "Fix:"]),
        ({"redirects": "4"}, ["--redirects '4'", "3 (both)", "Fix:"]),
        ({"extra_env": {"A B": "1"}}, ["'A B'", "NAME", "Fix:"]),
    ],
)
def test_bad_values_are_explained(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        LaunchConfig(nnodes="x")


def test_good_values() -> None:
    cfg = LaunchConfig(
        nproc_per_node=4,
        nnodes="1:4",
        node_rank=3,
        rdzv_endpoint="[fd00::1]:29500",
        rdzv_id="job42",
        max_restarts=3,
        rdzv_timeout=30,
        redirects="0:3,1:0",
        extra_env={"NCCL_DEBUG": "INFO"},
    )
    assert cfg.node_rank == 3
