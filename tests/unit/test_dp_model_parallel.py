"""DataParallel, ModelParallel and DDP's device map without a process group.

The placement logic is pure over module names and device strings, so most of it
is tested with fake device names ("gpu0"); the hooks are tested with real
tensors on "cpu" and "meta" (meta tensors carry shapes and devices, no data, so a
forward runs on them and shows where every activation went).
"""

from __future__ import annotations

import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.env.base import ClusterEnv
from scaletrain.runtime import Runtime
from scaletrain.strategies import base as strategies_base
from scaletrain.strategies import devices as devices_module
from scaletrain.strategies import dp as dp_module
from scaletrain.strategies import placement as placement_module
from scaletrain.strategies.base import Strategy, resolve_strategy
from scaletrain.strategies.ddp import DDP
from scaletrain.strategies.dp import DataParallel
from scaletrain.strategies.model_parallel import (
    ModelParallel,
    auto_device_map,
    check_device_map,
    local_devices_needed,
    move_to_device,
    place_module,
    plan_device_map,
    process_devices,
    resolve_device_map,
)
from scaletrain.train.models import GPT, GPTConfig, SplitNet
from tests.trunk import IN_FEATURES, TrunkNet

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU behaviour")


def _env(world_size: int = 1, local_rank: int = 0, local_world_size: int = 1) -> ClusterEnv:
    return ClusterEnv(
        kind="local", rank=local_rank, local_rank=local_rank, world_size=world_size,
        local_world_size=local_world_size, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=29500,
    )  # fmt: skip


def _rt(strategy: Strategy, device: str = "cpu", **env: int) -> Runtime:
    return Runtime(env=_env(**env), strategy=strategy, backend="gloo", device=torch.device(device))


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules()]


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees `count` GPUs, as far as the device checks can tell."""
    monkeypatch.setattr(
        devices_module, "visible_devices", lambda: [f"cuda:{i}" for i in range(count)]
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dp_module, "_gpu_count", lambda: count)


# -- the placement rule (pure) -----------------------------------------------------------
def test_seeds_split_net_places_each_part_and_hooks_the_boundaries() -> None:
    plan = plan_device_map(_names(SplitNet()), {"sub_net1": "gpu0", "sub_net2": "gpu1"})
    # relu is not named: it follows sub_net1, the module registered before it.
    assert plan.devices == {"": "gpu0", "sub_net1": "gpu0", "relu": "gpu0", "sub_net2": "gpu1"}
    assert plan.hooks == ("", "sub_net1", "sub_net2")


def test_unnamed_modules_follow_their_named_ancestor_or_the_previous_module() -> None:
    model = GPT(GPTConfig(n_layer=4, n_embd=16, n_head=2, vocab_size=11, block_size=8))
    plan = plan_device_map(_names(model), {"blocks.1": "gpu0", "blocks.2": "gpu1"})
    d = plan.devices
    # Before the first named module (and the root): the first device.
    assert d[""] == d["tok_emb"] == d["pos_emb"] == d["blocks"] == d["blocks.0"] == "gpu0"
    # A named module's subtree follows it.
    assert d["blocks.2.attn.q_proj"] == d["blocks.2.mlp.fc"] == "gpu1"
    assert d["blocks.1.mlp.proj"] == "gpu0"
    # After it, unnamed modules with no named ancestor follow the previous module.
    assert d["blocks.3"] == d["blocks.3.ln1"] == d["ln_f"] == d["head"] == "gpu1"
    # Hooks: the root, the named modules, and modules placed elsewhere than their
    # parent (blocks.3, ln_f, head sit on gpu1 under parents on gpu0); not blocks.2's
    # insides, nor blocks.0, which share the device of what runs before them.
    assert plan.hooks == ("", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head")


def test_a_deeper_key_overrides_part_of_a_named_subtree() -> None:
    model = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, vocab_size=11, block_size=8))
    plan = plan_device_map(_names(model), {"blocks": "gpu0", "blocks.1": "gpu1"})
    d = plan.devices
    assert d["blocks.0.mlp.fc"] == "gpu0" and d["blocks.1.mlp.fc"] == "gpu1"
    # blocks.2 follows its named ancestor "blocks", back on gpu0: its input comes from
    # gpu1, so it is hooked although nobody named it.
    assert d["blocks.2"] == d["blocks.2.mlp.fc"] == "gpu0"
    assert "blocks.2" in plan.hooks
    assert d["ln_f"] == d["head"] == "gpu0"


def test_unknown_key_lists_the_valid_names() -> None:
    with pytest.raises(st.ConfigError) as info:
        plan_device_map(_names(SplitNet()), {"sub_net1": "gpu0", "subnet2": "gpu1"})
    message = str(info.value)
    assert "'subnet2'" in message
    assert "sub_net1, relu, sub_net2" in message and "named_modules()" in message
    with pytest.raises(st.ConfigError, match=r"deeper ones: blocks\.0, blocks\.0\.ln1"):
        model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=11, block_size=8))
        plan_device_map(_names(model), {"block.0": "gpu0"})


@pytest.mark.parametrize(
    ("device_map", "words"),
    [
        ("balanced", "device_map='balanced'"),
        (["sub_net1"], "got a list"),
        ({}, "empty"),
        ({"sub_net1": 0}, "maps 'sub_net1' to 0"),
        ({"sub_net1": "gpu:0"}, "'gpu:0', which is not a device string"),
        ({"": "cpu"}, "key ''"),
    ],
)
def test_device_map_shape_is_checked_at_construction(device_map: Any, words: str) -> None:
    with pytest.raises(st.ConfigError, match=words):
        ModelParallel(device_map=device_map)
    with pytest.raises(st.ConfigError, match=words):
        DDP(device_map=device_map)
    with pytest.raises(st.ConfigError, match=words):
        check_device_map(device_map, "X")


# -- "auto" (pure) -----------------------------------------------------------------------
def _params(model: nn.Module, names: list[str]) -> int:
    modules = dict(model.named_modules())
    return sum(p.numel() for n in names for p in modules[n].parameters())


def test_auto_splits_the_seeds_net_in_two() -> None:
    assert auto_device_map(SplitNet(), ["a", "b"]) == {
        "sub_net1": "a",
        "relu": "a",
        "sub_net2": "b",
    }
    assert auto_device_map(SplitNet(), ["only"]) == dict.fromkeys(
        ("sub_net1", "relu", "sub_net2"), "only"
    )


@pytest.mark.parametrize("k", [2, 3, 4])
def test_auto_opens_module_lists_and_balances_contiguously(k: int) -> None:
    model = GPT(GPTConfig(n_layer=8, n_embd=32, n_head=2, vocab_size=16, block_size=8))
    devices = [f"dev{i}" for i in range(k)]
    mapping = auto_device_map(model, devices)
    assert list(mapping) == [
        "tok_emb", "pos_emb", "drop", *(f"blocks.{i}" for i in range(8)), "ln_f", "head",
    ]  # fmt: skip
    order = [devices.index(d) for d in mapping.values()]
    assert order == sorted(order), "parts must stay in order (contiguous stages)"
    assert set(order) == set(range(k)), "every device gets a share"
    per_device = [_params(model, [n for n, d in mapping.items() if d == dev]) for dev in devices]
    total = sum(p.numel() for p in model.parameters())
    biggest = max(_params(model, [n]) for n in mapping)
    # Each device is within one part of its equal share.
    assert all(abs(n - total / k) <= biggest for n in per_device), per_device


def test_auto_descends_into_a_single_wrapper_and_handles_no_parameters() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    assert auto_device_map(Wrapper(), ["a", "b"]) == {
        "inner.0": "a", "inner.1": "a", "inner.2": "b",
    }  # fmt: skip
    assert auto_device_map(nn.Sequential(nn.ReLU(), nn.Tanh()), ["a", "b"]) == {
        "0": "a", "1": "a",
    }  # fmt: skip
    assert auto_device_map(nn.Linear(2, 2), ["a", "b"]) == {}
    with pytest.raises(st.ConfigError, match="at least one device"):
        auto_device_map(SplitNet(), [])


def test_auto_shares_out_the_blocks_of_a_nested_sequential() -> None:
    # The blocks sit in model.trunk, an nn.Sequential beside embed and head: they are
    # split between the devices (not all of them with the head on one).
    model = TrunkNet()
    assert auto_device_map(model, ["a", "b"]) == {
        "embed": "a", "trunk.0": "a", "trunk.1": "a", "trunk.2": "b", "trunk.3": "b", "head": "b",
    }  # fmt: skip
    # Placed for real over two devices ("meta" stands in for a second one without GPUs):
    # each block's tensors go to its device and the activation crosses at trunk.2.
    placement = place_module(model, "auto", devices=["cpu", "meta"])
    assert model.trunk[1].fc.weight.device.type == "cpu"
    assert model.trunk[2].fc.weight.device.type == model.head.weight.device.type == "meta"
    assert "trunk.2" in placement.hooked
    assert model(torch.ones(3, IN_FEATURES)).device.type == "meta"


def test_auto_counts_a_tied_weight_once() -> None:
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), nn.Linear(8, 100, bias=False))
    model[2].weight = model[0].weight
    # Counted twice the head would look as heavy as the embedding and get its own device.
    assert auto_device_map(model, ["a", "b"]) == {"0": "a", "1": "b", "2": "b"}


# -- devices of a process (pure) --------------------------------------------------------
def test_process_devices_is_the_seeds_gpu_table() -> None:
    # gpus = {0: [0, 1], 1: [2, 3]}[rank]
    assert process_devices(0, 2, gpu_count=4) == ["cuda:0", "cuda:1"]
    assert process_devices(1, 2, gpu_count=4) == ["cuda:2", "cuda:3"]
    assert process_devices(1, 2, gpu_count=0) == ["cpu", "cpu"]
    with pytest.raises(st.ConfigError) as info:
        process_devices(1, 2, gpu_count=3)
    message = str(info.value)
    assert "local rank 1" in message and "cuda:2, cuda:3" in message
    assert "3 visible GPU(s)" in message and "--nproc-per-node 1" in message
    assert local_devices_needed({"a": "local:0", "b": "local:3", "c": "cpu"}) == 4
    assert local_devices_needed({"a": "cuda:0"}) == 0


def test_ddp_device_map_gives_each_process_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 4)
    seeds = DDP(device_map={"sub_net1": "local:0", "sub_net2": "local:1"})
    for rank, owned in [(0, ["cuda:0", "cuda:1"]), (1, ["cuda:2", "cuda:3"])]:
        rt = _rt(seeds, f"cuda:{rank}", world_size=2, local_rank=rank, local_world_size=2)
        assert seeds.process_devices(rt.topology) == owned
        assert resolve_device_map(seeds.device_map, owned, "DDP") == {  # type: ignore[arg-type]
            "sub_net1": owned[0], "sub_net2": owned[1],
        }  # fmt: skip
        seeds.validate(rt.topology)
    auto = DDP(device_map="auto")
    rt = _rt(auto, "cuda:1", world_size=2, local_rank=1, local_world_size=2)
    assert auto.process_devices(rt.topology) == ["cuda:2", "cuda:3"]
    explicit = DDP(device_map="auto", devices_per_process=1)
    assert explicit.process_devices(rt.topology) == ["cuda:1"]
    # Three processes with two GPUs each do not fit on four GPUs.
    rt = _rt(seeds, "cuda:2", world_size=3, local_rank=2, local_world_size=3)
    with pytest.raises(st.ConfigError, match="local rank 2 owns 2 devices"):
        seeds.validate(rt.topology)


def test_ddp_device_map_config_is_checked() -> None:
    with pytest.raises(st.ConfigError, match="only applies with a device_map"):
        DDP(devices_per_process=2)
    with pytest.raises(st.ConfigError, match="devices_per_process=0"):
        DDP(device_map="auto", devices_per_process=0)
    assert DDP(device_map="auto").device_map == "auto"


def test_local_devices_on_a_machine_without_gpus_are_the_cpu() -> None:
    seeds = DDP(device_map={"sub_net1": "local:0", "sub_net2": "local:1"})
    rt = _rt(seeds, "cpu", world_size=2, local_rank=1, local_world_size=2)
    assert seeds.process_devices(rt.topology) == ["cpu", "cpu"]
    assert resolve_device_map({"a": "local:5"}, ["cpu"], "DDP") == {"a": "cpu"}


def test_a_device_that_does_not_exist_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpus(monkeypatch, 2)
    strategy = ModelParallel(device_map={"sub_net1": "cuda:0", "sub_net2": "cuda:3"})
    with pytest.raises(st.ConfigError) as info:
        strategy.validate(_rt(strategy).topology)
    message = str(info.value)
    assert "'cuda:3'" in message and "available: cuda:0, cuda:1" in message
    assert "CUDA_VISIBLE_DEVICES" in message
    with pytest.raises(st.ConfigError, match="owns 2: cuda:0, cuda:1"):
        resolve_device_map({"sub_net1": "local:2"}, ["cuda:0", "cuda:1"], "ModelParallel")
    assert resolve_device_map({"a": "local:1", "b": "cuda:0"}, ["cuda:0", "cuda:1"], "M") == {
        "a": "cuda:1", "b": "cuda:0",
    }  # fmt: skip


@CPU_ONLY
def test_cuda_on_a_cpu_machine_fails_at_init_and_says_use_cpu() -> None:
    strategy = ModelParallel(device_map={"sub_net1": "cuda:0", "sub_net2": "cuda:1"})
    with pytest.raises(st.ConfigError) as info:
        st.init(strategy=strategy, env=_env())
    message = str(info.value)
    assert "'cuda:0'" in message and "available: cpu" in message and "'cpu'" in message
    with pytest.raises(st.ConfigError, match="'cuda:0'"):
        place_module(SplitNet(), {"sub_net1": "cuda:0"})


# -- hooks move activations ----------------------------------------------------------------
def test_move_to_device_walks_nested_containers() -> None:
    pair = namedtuple("pair", "a b")
    meta = torch.device("meta")
    tree = {
        "x": torch.ones(2),
        "seq": [torch.ones(1), (torch.ones(3), 7)],
        "p": pair(torch.ones(1), "s"),
    }
    moved = move_to_device(tree, meta)
    assert moved["x"].device == meta and moved["seq"][0].device == meta
    assert moved["seq"][1][0].device == meta and moved["seq"][1][1] == 7
    assert isinstance(moved["p"], pair) and moved["p"].a.device == meta and moved["p"].b == "s"
    same = torch.ones(2)
    assert move_to_device(same, torch.device("cpu")) is same  # no copy when already there


class _Recorder(nn.Module):
    """Records the devices of its tensor inputs (args and kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor, *, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen = [str(x.device), str(extra["t"][0].device)]
        return x * self.scale


class _TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = _Recorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.second(h, extra={"t": [x]})


def test_hooks_move_args_and_kwargs_at_the_boundary() -> None:
    model = _TwoStage()
    weight = model.first.weight
    # Private entry: place_module refuses "meta" (no data to train), the hooks do not care.
    placement = placement_module._apply_plan(
        model, plan_device_map(_names(model), {"first": "cpu", "second": "meta"})
    )
    assert model.first.weight is weight, "placement keeps the Parameter objects"
    assert model.first.weight.device.type == "cpu" and model.second.scale.device.type == "meta"
    out = model(torch.ones(2, 4))
    # The cpu activation crossed to meta, kwargs (nested in a dict of a list) too.
    assert model.second.seen == ["meta", "meta"] and out.device.type == "meta"
    assert placement.hooked == ("", "first", "second")
    # Placing again replaces the hooks rather than stacking a second set.
    placement_module._apply_plan(
        model, plan_device_map(_names(model), {"first": "meta", "second": "meta"})
    )
    assert [len(m._forward_pre_hooks) for m in (model, model.first, model.second)] == [1, 1, 1]


def test_a_tied_weight_on_two_devices_is_refused() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    plan = plan_device_map(_names(model), {"0": "gpu0", "1": "gpu1"})
    with pytest.raises(st.ConfigError, match=r"0\.weight and 1\.weight are the same tensor"):
        placement_module._check_shared(model, plan.devices)
    placement_module._check_shared(
        model, plan_device_map(_names(model), {"0": "gpu0", "1": "gpu0"}).devices
    )


# -- ModelParallel on CPU ------------------------------------------------------------------
def test_model_parallel_on_cpu_places_hooks_and_unwraps_to_the_module() -> None:
    strategy = ModelParallel(device_map={"sub_net1": "cpu", "sub_net2": "cpu"})
    rt = st.init(strategy=strategy, env=_env())
    try:
        bare = SplitNet()
        opt = torch.optim.SGD(bare.parameters(), lr=0.1)
        model, opt2 = rt.setup(bare, opt)
        assert model is bare and rt.unwrap(model) is bare and opt2 is opt
        assert not any(k.startswith("module.") for k in rt.unwrap(model).state_dict())
        assert len(bare.sub_net2._forward_pre_hooks) == 1
        loss = rt.forward_backward(model, torch.randn(4, 10), torch.tensor([0, 1, 2, 3]),
                                   nn.functional.cross_entropy)  # fmt: skip
        assert loss.requires_grad is False and bare.sub_net1.weight.grad is not None
    finally:
        rt.shutdown()


def test_model_parallel_refuses_several_processes() -> None:
    strategy = ModelParallel(device_map={"sub_net1": "cpu", "sub_net2": "cpu"})
    with pytest.raises(st.ConfigError) as info:
        strategy.validate(_rt(strategy, world_size=2).topology)
    message = str(info.value)
    assert "2 processes" in message and "st.DDP(device_map=" in message


def test_names_resolve_to_the_new_strategies() -> None:
    assert isinstance(resolve_strategy("model-parallel"), ModelParallel)
    assert resolve_strategy("model-parallel").device_map == "auto"  # type: ignore[attr-defined]
    assert isinstance(resolve_strategy("dp"), DataParallel)
    assert {"dp", "model-parallel"} <= set(strategies_base.STRATEGIES)


@CPU_ONLY
def test_model_parallel_auto_on_cpu_puts_everything_on_the_cpu() -> None:
    model = SplitNet()
    placement = place_module(model, "auto")
    assert set(placement.devices.values()) == {torch.device("cpu")}
    assert model(torch.randn(2, 10)).shape == (2, 5)


# -- DataParallel ----------------------------------------------------------------------------
@CPU_ONLY
def test_dp_on_cpu_warns_once_and_trains_the_module_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_module, "_warned_no_gpu", False)
    rt = st.init(strategy="dp", env=_env())
    try:
        torch.manual_seed(0)
        bare = SplitNet()
        torch.manual_seed(0)
        ref = SplitNet()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
            rt.setup(SplitNet())  # a second setup in the same process: no second warning
        mine = [w for w in caught if "found no CUDA GPU" in str(w.message)]
        assert len(mine) == 1 and "strategy='ddp'" in str(mine[0].message)
        assert model is bare
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 5, (8,), generator=g)
            opt.zero_grad()
            loss = rt.forward_backward(model, x, y, nn.functional.cross_entropy)
            opt.step()
            ref_opt.zero_grad()
            ref_loss = nn.functional.cross_entropy(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            assert torch.equal(loss, ref_loss.detach())
        for key, value in ref.state_dict().items():
            assert torch.equal(bare.state_dict()[key], value), key
    finally:
        rt.shutdown()


def test_dp_unwrap_drops_the_module_prefix() -> None:
    # On a machine without GPUs nn.DataParallel still wraps (and prefixes the keys).
    wrapped = nn.DataParallel(SplitNet(), device_ids=[] if not torch.cuda.is_available() else None)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    strategy = DataParallel()
    unwrapped = strategy.unwrap(wrapped)
    assert unwrapped is wrapped.module
    assert not any("module." in k for k in unwrapped.state_dict())
    plain = SplitNet()
    assert strategy.unwrap(plain) is plain


def test_dp_with_several_processes_says_use_ddp() -> None:
    strategy = DataParallel()
    rt = Runtime(env=_env(world_size=2), strategy=strategy, backend="nccl",
                 device=torch.device("cpu"))  # fmt: skip
    with pytest.raises(st.ConfigError) as info:
        strategy.validate(rt.topology)
    message = str(info.value)
    assert "single process" in message and "2 processes" in message and "'nccl'" in message
    assert "strategy='ddp'" in message and "faster" in message


@pytest.mark.parametrize(
    ("ids", "words"), [([], "non-empty"), ([-1], "non-empty"), ([0, 0], "repeats")]
)
def test_dp_device_ids_are_checked(ids: list[int], words: str) -> None:
    with pytest.raises(st.ConfigError, match=words):
        DataParallel(device_ids=ids)


def test_dp_device_ids_beyond_the_gpus_fail_at_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    strategy = DataParallel(device_ids=[0, 3])
    with pytest.raises(st.ConfigError, match=r"GPU 3.*2 visible GPU\(s\)"):
        strategy.validate(_rt(strategy).topology)
    DataParallel(device_ids=[1, 0]).validate(_rt(strategy).topology)
