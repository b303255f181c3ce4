"""Pipeline logic with no process group: config checks, layout rules, splitting, tracing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.env.base import ClusterEnv
from scaletrain.errors import ConfigError
from scaletrain.runtime import Runtime
from scaletrain.strategies.base import STRATEGIES, resolve_strategy
from scaletrain.strategies.pipeline import (
    Pipeline,
    PipelineModule,
    balance_stages,
    pipeline_layers,
)
from scaletrain.train.models import GPT, ConvNet, GPTConfig, SplitNet
from tests.trunk import TrunkNet

SMALL_GPT = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _rt(
    rank: int = 0, world_size: int = 1, mesh: dict[str, int] | None = None, strategy: Any = None
) -> Runtime:
    env = ClusterEnv(
        kind="local", rank=rank, local_rank=rank, world_size=world_size,
        local_world_size=world_size, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=29500,
    )  # fmt: skip
    return Runtime(
        env=env,
        strategy=strategy or Pipeline(),
        backend="gloo",
        device=torch.device("cpu"),
        mesh_shape=mesh,
    )


def _module(model: nn.Module, split: tuple[str, ...], pp_size: int = 2) -> PipelineModule:
    # No process group is touched until a schedule runs: tracing is local.
    return PipelineModule(
        model,
        split_points=split,
        schedule="gpipe",
        microbatches=2,
        group=None,  # type: ignore[arg-type]
        pp_rank=0,
        pp_size=pp_size,
        device=torch.device("cpu"),
    )


# -- config -------------------------------------------------------------------------
def test_registered_under_its_name() -> None:
    assert STRATEGIES["pipeline"] is Pipeline
    assert isinstance(resolve_strategy("pipeline"), Pipeline)
    p = Pipeline()
    assert (p.stages, p.schedule, p.microbatches) == (None, "1f1b", 4)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved-1f1b"),
     ("interleaved_1f1b", "interleaved-1f1b")],
)  # fmt: skip
def test_schedule_names_are_normalised(given: str, canonical: str) -> None:
    assert Pipeline(schedule=given).schedule == canonical


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"schedule": "zero-bubble"},
            r"schedule='zero-bubble'.*'gpipe', '1f1b', 'interleaved-1f1b'",
        ),
        ({"microbatches": 0}, r"microbatches=0\) must be >= 1"),
        ({"microbatches": True}, r"microbatches=True\) must be an int"),
        ({"microbatches": 2.0}, r"microbatches=2.0\) must be an int"),
        ({"stages": 0}, r"stages=0\) must be >= 1"),
        ({"stages": True}, r"stages=True\) must be an int"),
        ({"stages": []}, r"names no split point.*'blocks.2'"),
        ({"stages": ["a", "b", "a"]}, r"repeats \['a'\]"),
        ({"stages": [3]}, r"a list of module names"),
    ],
)
def test_bad_config_names_value_and_fix(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Pipeline(**kwargs)


def test_stages_forms() -> None:
    assert Pipeline(stages=["layer2"]).stages == ("layer2",)
    assert Pipeline(stages="blocks.1, blocks.3").stages == ("blocks.1", "blocks.3")
    assert Pipeline(stages=3).stages == 3
    assert Pipeline().num_stages(2) == 2
    assert Pipeline(schedule="interleaved-1f1b").num_stages(2) == 4
    assert Pipeline(stages=["a", "b"]).num_stages(2) == 3


# -- layout: torch's schedule rules, checked before any process is contacted ---------------
@pytest.mark.parametrize(
    ("kwargs", "pp", "words"),
    [
        ({"stages": 3}, 2, r"makes 3 stage\(s\).*exactly one stage per rank.*2 ranks.*stages=2"),
        ({"stages": ["a", "b"], "schedule": "gpipe"}, 2, r"stages=\['a', 'b'\].*3 stage"),
        ({"microbatches": 1}, 2, r"microbatches=1\).*at least as many microbatches as stages \(2\).*microbatches=2"),
        ({"schedule": "interleaved-1f1b", "stages": 2}, 2, r"2 stage\(s\) over 2 ranks.*>= 4.*stages=4"),
        ({"schedule": "interleaved-1f1b", "stages": 5}, 2, r"5 stage\(s\) over 2 ranks"),
        ({"schedule": "interleaved-1f1b", "microbatches": 5}, 2, r"microbatches=5\).*rounds \(2\).*microbatches=2, 3, 4, 6"),
    ],
)  # fmt: skip
def test_layout_errors(kwargs: dict[str, Any], pp: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Pipeline(**kwargs).check_layout(pp)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schedule": "gpipe", "microbatches": 1},
        {"microbatches": 2},
        {"schedule": "interleaved-1f1b", "microbatches": 3},
        {"schedule": "interleaved-1f1b", "stages": 6, "microbatches": 4},
    ],
)
def test_layouts_torch_accepts(kwargs: dict[str, Any]) -> None:
    Pipeline(**kwargs).check_layout(2)


def test_validate_runs_before_the_process_group() -> None:
    with pytest.raises(ConfigError, match=r"one stage per rank"):
        Pipeline(stages=3).validate(_rt(world_size=2).topology)
    with pytest.raises(ConfigError, match=r"needs a 'pp' dimension.*\{'dp': 2\}"):
        Pipeline().validate(_rt(world_size=2, mesh={"dp": 2}).topology)
    Pipeline(stages=3).validate(_rt(world_size=1).topology)  # one process: nothing to pipeline


# -- splitting ------------------------------------------------------------------------
def test_layers_are_top_level_children_with_container_entries() -> None:
    block = 4 * (32 * 32 + 32) + 2 * 64 + (32 * 128 + 128) + (128 * 32 + 32)
    assert pipeline_layers(GPT(SMALL_GPT)) == [
        ("tok_emb", 64 * 32),
        ("pos_emb", 16 * 32),  # the parameter-free dropout joins it
        *[(f"blocks.{i}", block) for i in range(4)],
        ("ln_f", 64),
        ("head", 64 * 32),
    ]
    # layer1 and layer2 are nn.Sequential: their entries are layers (BatchNorm's affine
    # weights make it one; ReLU and pooling join it).
    assert pipeline_layers(ConvNet()) == [
        ("layer1.0", 416), ("layer1.1", 32), ("layer2.0", 12832), ("layer2.1", 64), ("fc", 15690),
    ]  # fmt: skip
    assert [n for n, _ in pipeline_layers(SplitNet())] == ["sub_net1", "sub_net2"]


def test_balance_minimises_the_largest_stage() -> None:
    assert balance_stages([1, 1, 1, 1], 2) == [2]
    assert balance_stages([10, 1, 1, 1, 10], 3) == [1, 4]
    assert balance_stages([5, 5], 1) == []
    assert balance_stages([3, 1, 1, 1], 2) == [1]
    with pytest.raises(ValueError, match="cannot cut 2 layer"):
        balance_stages([1, 1], 3)


@pytest.mark.parametrize(
    ("model", "stages", "pp", "split"),
    [
        (lambda: GPT(SMALL_GPT), 2, 2, ("blocks.2",)),
        (lambda: GPT(SMALL_GPT), 4, 2, ("blocks.1", "blocks.2", "blocks.3")),
        (lambda: GPT(SMALL_GPT), None, 4, ("blocks.1", "blocks.2", "blocks.3")),
        (ConvNet, 2, 2, ("fc",)),
        (ConvNet, 3, 3, ("layer2.0", "fc")),
        (SplitNet, None, 2, ("sub_net2",)),
        (TrunkNet, None, 2, ("trunk.2",)),  # blocks in a nested nn.Sequential, shared out
        (ConvNet, ["layer1.3", "fc"], 3, ("layer1.3", "fc")),  # by name, inside a layer
    ],
)
def test_split_points(model: Any, stages: Any, pp: int, split: tuple[str, ...]) -> None:
    assert Pipeline(stages=stages).split_points(model(), pp) == split


def test_more_stages_than_layers() -> None:
    with pytest.raises(ConfigError) as info:
        Pipeline(stages=6, schedule="interleaved-1f1b").split_points(ConvNet(), 3)
    msg = str(info.value)
    assert msg.startswith("a pipeline with more stages than layers: 6 stages")
    assert "ConvNet has only 5 layer(s) to share out (layer1.0, layer1.1, layer2.0, " in msg
    assert "Fix: fewer stages" in msg and "stages=['layer1.2', 'layer2']" in msg


def test_unknown_split_names_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        Pipeline(stages=["blocks.9"]).split_points(GPT(SMALL_GPT), 2)
    msg = str(info.value)
    assert "'blocks.9': not submodule(s) of GPT" in msg
    assert "'tok_emb', 'pos_emb', 'blocks.0'" in msg and "'head'" in msg
    with pytest.raises(ConfigError, match=r"'blocks': container\(s\).*never called"):
        Pipeline(stages=["blocks"]).split_points(GPT(SMALL_GPT), 2)


# -- data and the one-process fallback ---------------------------------------------------
@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        (None, [(0, 1)] * 4),
        ({"pp": 2, "dp": 2}, [(0, 2), (1, 2), (0, 2), (1, 2)]),
        ({"pp": 2, "tp": 2}, [(0, 1)] * 4),
        ({"dp": 2, "pp": 2}, [(0, 2), (1, 2), (0, 2), (1, 2)]),  # runtime orders it pp, dp
    ],
)
def test_all_stages_of_a_replica_share_the_data(mesh: Any, expected: list[Any]) -> None:
    from scaletrain.runtime import parse_mesh

    shape = parse_mesh(mesh, 4)
    got = [
        Pipeline().data_parallel(_rt(rank=r, world_size=4, mesh=shape).topology) for r in range(4)
    ]
    assert got == expected


def test_pp_dp_tp_mesh_coordinates_follow_device_mesh_layout() -> None:
    shape = {"pp": 2, "dp": 2, "tp": 2}
    got = [
        Pipeline().data_parallel(_rt(rank=r, world_size=8, mesh=shape).topology)[0]
        for r in range(8)
    ]
    assert got == [(r // 2) % 2 for r in range(8)]


def test_one_process_trains_the_model_unchanged() -> None:
    rt = _rt(world_size=1)
    model = SplitNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, same = rt.setup(model, opt)
    assert wrapped is model and same is opt
    x, y = torch.randn(4, 10), torch.randint(0, 5, (4,))
    loss = rt.forward_backward(wrapped, x, y, nn.functional.cross_entropy)
    assert not loss.requires_grad and model.sub_net1.weight.grad is not None
    torch.testing.assert_close(rt.predict(wrapped, x), model(x).detach(), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="not submodule"):
        Pipeline(stages=["nope"]).setup_module(SplitNet(), rt.topology)


# -- tracing (local: no process group needed) --------------------------------------------
def test_tracer_keeps_the_models_parameters_and_unpatches_it() -> None:
    model = GPT(SMALL_GPT)
    ids = {id(p) for p in model.parameters()}
    pipe = _module(model, ("blocks.2",))._trace(torch.randint(0, 64, (2, 16)))
    assert pipe.num_stages == 2
    stage_params = [p for i in range(2) for p in pipe.get_stage_module(i).parameters()]
    assert {id(p) for p in stage_params} == ids  # same objects: the optimizer stays valid
    assert "forward" not in model.blocks[2].__dict__  # the user's model runs as before
    model(torch.randint(0, 64, (3, 16)))


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def test_a_split_point_that_never_runs_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"before \['spare'\] gave 1 stage\(s\), not 2"):
        _module(_Unused(), ("spare",))._trace(torch.randn(2, 4))


def test_tied_weights_across_stages_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"used by more than one stage \(tied weights\)"):
        _module(_Tied(), ("mid",))._trace(torch.randint(0, 8, (2, 3)))


def test_wrapper_is_not_called_like_a_model() -> None:
    module = _module(SplitNet(), ("sub_net2",))
    with pytest.raises(ConfigError, match=r"not called directly.*rt.forward_backward"):
        module(torch.randn(2, 10))
    with pytest.raises(ConfigError, match="built at the first rt.forward_backward"):
        module.stage_state_dict()
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"shape \(2, 2\) that is not in the model"):
        module.attach_optimizer(foreign)
