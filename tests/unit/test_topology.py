"""The Topology st.init resolves: the implicit mesh of each strategy, the data-parallel
coordinate, and the Runtime views that keep their meaning without a given mesh."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import scaletrain as st
from scaletrain.dist.topology import Topology
from scaletrain.env.base import ClusterEnv
from scaletrain.runtime import Runtime
from scaletrain.strategies import FSDPxTP, PipelinexDDP, resolve_strategy


def _env(rank: int, world_size: int) -> ClusterEnv:
    return ClusterEnv(
        kind="local", rank=rank, local_rank=rank, world_size=world_size,
        local_world_size=world_size, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=29500,
    )  # fmt: skip


def _resolve(
    name: str, rank: int = 1, world_size: int = 4, mesh: dict[str, int] | None = None
) -> Topology:
    strategy = resolve_strategy(name)
    return Topology.resolve(
        _env(rank, world_size),
        device=torch.device("cpu"),
        backend="gloo",
        mesh=mesh,
        implicit_dim=strategy.mesh_dim,
    )


@pytest.mark.parametrize(
    ("name", "shape", "dp"),
    [
        ("ddp", {"dp": 4}, (1, 4)),
        ("fsdp", {"dp": 4}, (1, 4)),
        ("single", {"dp": 4}, (1, 4)),
        ("tensor", {"tp": 4}, (0, 1)),
        ("pipeline", {"pp": 4}, (0, 1)),
    ],
)
def test_without_a_mesh_each_strategy_spans_its_own_dimension(
    name: str, shape: dict[str, int], dp: tuple[int, int]
) -> None:
    topo = _resolve(name)
    assert topo.mesh_shape == shape and not topo.mesh_given
    assert (topo.dp_rank, topo.dp_size) == dp
    assert (FSDPxTP.mesh_dim, PipelinexDDP.mesh_dim) == ("tp", "pp")


def test_a_given_mesh_is_laid_out_row_major() -> None:
    shape = {"pp": 2, "dp": 2, "tp": 2}
    topos = [_resolve("ddp", rank=r, world_size=8, mesh=shape) for r in range(8)]
    assert all(t.mesh_given and t.mesh_shape == shape for t in topos)
    assert [t.coordinate("pp") for t in topos] == [r // 4 for r in range(8)]
    assert [t.dp_rank for t in topos] == [(r // 2) % 2 for r in range(8)]
    assert [t.coordinate("tp") for t in topos] == [r % 2 for r in range(8)]
    assert topos[5].size("tp") == 2 and topos[5].size("ep") == 1 and topos[5].coordinate("ep") == 0


def test_the_home_device_replaces_the_device_only() -> None:
    topo = _resolve("ddp", mesh={"dp": 4})
    moved = dataclasses.replace(topo, device=torch.device("meta"))
    assert moved.device == torch.device("meta")
    assert (moved.rank, moved.mesh_shape, moved.mesh_given, moved.dp_rank) == (
        1,
        {"dp": 4},
        True,
        1,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.rank = 2  # type: ignore[misc]


def test_inconsistent_topologies_are_refused() -> None:
    with pytest.raises(st.ConfigError, match="multiply to the world size"):
        Topology(world_size=4, mesh_shape={"dp": 2})
    with pytest.raises(st.ConfigError, match="outside world_size"):
        Topology(rank=4, world_size=4)


def test_runtime_mesh_views_keep_their_meaning_without_a_given_mesh() -> None:
    rt = Runtime(
        env=_env(1, 4), strategy=st.TensorParallel(), backend="gloo", device=torch.device("cpu")
    )
    assert rt.topology.mesh_shape == {"tp": 4}
    assert rt.mesh_shape is None and rt.mesh is None
    assert (rt.mesh_coordinate("tp"), rt.mesh_size("tp")) == (0, 1)
    assert (rt.dp_rank, rt.dp_size) == (0, 1)
    given = Runtime(
        env=_env(3, 4),
        strategy=st.DDP(),
        backend="gloo",
        device=torch.device("cpu"),
        mesh_shape={"dp": 4},
    )
    assert given.mesh_shape == {"dp": 4}
    assert (given.mesh_coordinate("dp"), given.mesh_size("dp"), given.dp_rank) == (3, 4, 3)
