"""FSDP and TensorParallel without a process group: configs, wrap units, the default TP plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.dist.topology import Topology
from scaletrain.errors import ConfigError
from scaletrain.strategies.base import (
    STRATEGIES,
    parameter_names,
    rebind_optimizer,
    resolve_strategy,
)
from scaletrain.strategies.fsdp import FSDP, auto_wrap_targets, wrap_targets
from scaletrain.strategies.mesh import FSDPxTP
from scaletrain.strategies.tensor import (
    TensorParallel,
    check_tp_plan,
    default_tp_plan,
    sequence_parallel_blocks,
)
from scaletrain.train.models import GPT, MLP, Block, ConvNet, GPTConfig, SplitNet

SMALL = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _topo(world_size: int = 1, mesh_shape: dict[str, int] | None = None, rank: int = 0) -> Topology:
    """The topology the hooks read, without a process group: the mesh given to st.init,
    else tensor parallel's implicit one (every rank along "tp")."""
    return Topology(
        rank=rank,
        world_size=world_size,
        mesh_shape=mesh_shape or {"tp": world_size},
        mesh_given=mesh_shape is not None,
    )


# -- registry -----------------------------------------------------------------------


def test_registered_under_their_names() -> None:
    assert STRATEGIES["fsdp"] is FSDP and STRATEGIES["tensor"] is TensorParallel
    assert isinstance(resolve_strategy("FSDP"), FSDP)
    assert isinstance(resolve_strategy("tensor"), TensorParallel)


# -- FSDP config --------------------------------------------------------------------


def test_fsdp_defaults() -> None:
    s = FSDP()
    assert (s.wrap, s.reshard_after_forward, s.cpu_offload, s.mixed_precision) == (
        "auto",
        True,
        False,
        None,
    )


@pytest.mark.parametrize(
    ("wrap", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("Block", ("Block",)),
        (Block, (Block,)),
        (["Block", MLP], ("Block", MLP)),
        ((Block,), (Block,)),
    ],
)
def test_fsdp_wrap_is_normalised(wrap: Any, expected: Any) -> None:
    assert FSDP(wrap=wrap).wrap == expected


@pytest.mark.parametrize("wrap", [3, (), ("",), (int,), {"Block": 1}, (Block, 2)])
def test_fsdp_rejects_a_bad_wrap(wrap: Any) -> None:
    with pytest.raises(ConfigError, match=r"FSDP\(wrap=.*is not a wrap policy.*wrap=\(Block,\)"):
        FSDP(wrap=wrap)


def test_fsdp_rejects_bad_flags_and_policies() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ConfigError, match="reshard_after_forward='yes'"):
        FSDP(reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cpu_offload=1"):
        FSDP(cpu_offload=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mixed_precision='bf16'.*MixedPrecisionPolicy"):
        FSDP(mixed_precision="bf16")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert FSDP(mixed_precision=policy).mixed_precision is policy


def test_auto_wrap_finds_blocks_and_stages() -> None:
    assert auto_wrap_targets(GPT(SMALL)) == ["blocks.0", "blocks.1"]
    # ConvNet's stages are Sequentials of bare layers: each stage is one unit.
    assert auto_wrap_targets(ConvNet()) == ["layer1", "layer2"]
    # A Sequential of blocks: each block, even when the Sequential is the root.
    stack = nn.Sequential(Block(SMALL), Block(SMALL), nn.LayerNorm(32))
    assert auto_wrap_targets(stack) == ["0", "1", "2"]
    # Bare layers only / no container at all: no units, the root is the one unit.
    assert auto_wrap_targets(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))) == []
    assert auto_wrap_targets(SplitNet()) == []


def test_wrap_by_class_or_name() -> None:
    gpt = GPT(SMALL)
    assert wrap_targets(gpt, (Block,)) == ["blocks.0", "blocks.1"]
    assert wrap_targets(gpt, "Block") == ["blocks.0", "blocks.1"]
    # Nested units, outermost first (setup shards them innermost first).
    assert wrap_targets(gpt, ("Block", MLP)) == [
        "blocks.0",
        "blocks.0.mlp",
        "blocks.1",
        "blocks.1.mlp",
    ]


def test_impossible_wrap_lists_the_classes_the_model_has() -> None:
    with pytest.raises(ConfigError) as e:
        wrap_targets(ConvNet(), ("TransformerBlock", Block))
    msg = str(e.value)
    assert "names TransformerBlock, Block, but no sub-module of the ConvNet" in msg
    assert "BatchNorm2d, Conv2d, Linear, MaxPool2d, ReLU, Sequential" in msg
    assert "wrap='auto'" in msg


def test_fsdp_in_one_process_is_the_plain_module() -> None:
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters())
    s = FSDP()
    assert s.setup_module(model, _topo()) is model
    assert s.setup_optimizer(opt, model, _topo()) is opt
    assert s.unwrap(model) is model
    with s.no_sync(model):  # no FSDP state: nothing to switch off
        pass
    with pytest.raises(ConfigError, match="names Blok"):
        FSDP(wrap="Blok").setup_module(model, _topo())


def test_rebind_optimizer_points_at_the_new_parameters_in_place() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    # AdamW: its `defaults` carry decoupled_weight_decay, which AdamW() rejects, so
    # rebuilding with type(opt)(groups, **defaults) would fail in torch 2.13.
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[1].parameters()}]
    )
    names = parameter_names(model)
    old = list(model.parameters())
    for layer in model:
        assert isinstance(layer, nn.Linear)
        layer.weight = nn.Parameter(layer.weight.detach().clone())
    assert rebind_optimizer(opt, names, model) is opt
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.param_groups[0]["params"][0] is model[0].weight is not old[0]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()

    with pytest.raises(ConfigError, match="already has state"):
        rebind_optimizer(opt, names, model)
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(7))], lr=0.1)
    with pytest.raises(ConfigError, match=r"shape \(7,\) that is not in the model"):
        rebind_optimizer(foreign, names, model)


# -- TensorParallel config ------------------------------------------------------------


def test_tensor_defaults_and_plan_validation() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    s = TensorParallel()
    assert (s.plan, s.sequence_parallel) == (None, False)
    assert TensorParallel(plan={"mlp.fc": ColwiseParallel(), "mlp.proj": "rowwise"}).plan
    with pytest.raises(ConfigError, match="must be a non-empty dict"):
        TensorParallel(plan={})
    with pytest.raises(ConfigError, match="maps 'mlp.fc' to 'cols'; expected"):
        TensorParallel(plan={"mlp.fc": "cols"})
    with pytest.raises(ConfigError, match="has key 3"):
        TensorParallel(plan={3: "colwise"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="sequence_parallel=True\\) applies to the default"):
        TensorParallel(plan={"mlp.fc": "colwise"}, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel='yes'"):
        TensorParallel(sequence_parallel="yes")  # type: ignore[arg-type]


def test_default_plan_on_gpt() -> None:
    plan = default_tp_plan(GPT(SMALL))
    expected: dict[str, str] = {}
    for b in ("blocks.0", "blocks.1"):
        expected.update(
            {
                f"{b}.attn.q_proj": "colwise",
                f"{b}.attn.k_proj": "colwise",
                f"{b}.attn.v_proj": "colwise",
                f"{b}.attn.out_proj": "rowwise",
                f"{b}.mlp.fc": "colwise",
                f"{b}.mlp.proj": "rowwise",
            }
        )
    assert plan == expected  # embeddings, norms, the LM head: replicated

    sp = default_tp_plan(GPT(SMALL), sequence_parallel=True)
    norms = {f"blocks.{i}.{ln}": "sequence" for i in (0, 1) for ln in ("ln1", "ln2")}
    assert sp == {**expected, **norms}  # ln_f is outside the blocks: stays whole
    assert sequence_parallel_blocks(GPT(SMALL), plan) == ["blocks.0", "blocks.1"]


class _FusedAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn (d -> 3d), then c_proj."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)


class _NanoMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)


class _LlamaAttention(nn.Module):
    """Grouped-query attention: k/v narrower than q, o_proj out."""

    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d // heads * kv_heads, bias=False)
        self.v_proj = nn.Linear(d, d // heads * kv_heads, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class _GatedMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, 3 * d)
        self.up_proj = nn.Linear(d, 3 * d)
        self.down_proj = nn.Linear(3 * d, d)


class _ReversedMLP(nn.Module):
    """Registered down-projection first: the names decide the order."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(4 * d, d)
        self.fc = nn.Linear(d, 4 * d)


def test_default_plan_on_other_families() -> None:
    nano = nn.ModuleDict({"attn": _FusedAttention(8), "mlp": _NanoMLP(8)})
    # Fused q/k/v cannot be split by columns: only the MLP is planned.
    assert default_tp_plan(nano) == {"mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}

    llama = nn.ModuleDict({"attn": _LlamaAttention(16, 4, 2), "mlp": _GatedMLP(16)})
    assert default_tp_plan(llama) == {
        "attn.q_proj": "colwise",
        "attn.k_proj": "colwise",
        "attn.v_proj": "colwise",
        "attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    assert default_tp_plan(_ReversedMLP(4)) == {"fc": "colwise", "proj": "rowwise"}
    # Unknown names: registration order, only for the d -> h -> d residual-MLP shape.
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    assert default_tp_plan(mlp) == {"0": "colwise", "2": "rowwise"}


@pytest.mark.parametrize(
    "model",
    [
        ConvNet(),
        SplitNet(),  # 10 -> 10 -> 5: chained, but no MLP names and not back to 10
        nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4)),
        nn.Sequential(_FusedAttention(8)),  # d -> 3d, d -> d: not chained
    ],
    ids=["convnet", "splitnet", "classifier", "fused_attention"],
)
def test_models_without_pairs_are_refused(model: nn.Module) -> None:
    with pytest.raises(ConfigError) as e:
        default_tp_plan(model)
    msg = str(e.value)
    assert msg.startswith(
        f"tensor parallel found no Linear pairs to shard in {type(model).__name__}; expected"
    )
    assert "fix: pass plan=" in msg and "use ddp/fsdp" in msg


def test_sequence_parallel_needs_blocks_in_a_container() -> None:
    with pytest.raises(ConfigError, match="needs the attention / MLP modules inside blocks"):
        default_tp_plan(_NanoMLP(8), sequence_parallel=True)


def test_divisibility_checks_name_layer_size_and_degree() -> None:
    gpt = GPT(SMALL)
    plan = default_tp_plan(gpt)
    check_tp_plan(gpt, plan, 2)
    check_tp_plan(gpt, plan, 4)
    # 4 heads over 8 ranks: widths divide (32 / 8), heads do not.
    with pytest.raises(ConfigError, match=r"blocks.0.attn.q_proj holds 4 heads .* degree 8"):
        check_tp_plan(gpt, plan, 8)
    with pytest.raises(ConfigError, match=r"q_proj \(Linear 32 -> 32\) colwise over 3 ranks"):
        check_tp_plan(gpt, plan, 3)
    # Grouped-query attention without head_dim: num_heads / num_key_value_heads attributes.
    llama = nn.ModuleDict({"attn": _LlamaAttention(16, 4, 2), "mlp": _GatedMLP(16)})
    with pytest.raises(ConfigError, match=r"attn.k_proj holds 2 heads .* degree 4"):
        check_tp_plan(llama, default_tp_plan(llama), 4)
    # A user plan with wildcards is checked the same way; rowwise splits in_features.
    with pytest.raises(ConfigError, match=r"blocks.0.mlp.proj .* in_features=128 .* degree 3"):
        check_tp_plan(gpt, {"blocks.*.mlp.proj": "rowwise"}, 3)


def test_user_plan_keys_must_match_a_module() -> None:
    s = TensorParallel(plan={"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.fc2": "rowwise"})
    with pytest.raises(ConfigError) as e:
        s.resolved_plan(GPT(SMALL))
    msg = str(e.value)
    assert "key 'blocks.*.mlp.fc2' matches no module of the GPT" in msg
    assert "blocks.0.attn.q_proj, blocks.0.attn.k_proj" in msg
    assert TensorParallel(plan={"blocks.*.mlp.fc": "colwise"}).resolved_plan(GPT(SMALL)) == {
        "blocks.*.mlp.fc": "colwise"
    }


def test_tensor_in_one_process_is_a_no_op_but_still_checks() -> None:
    model = GPT(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = TensorParallel()
    assert s.setup_module(model, _topo()) is model
    assert s.setup_optimizer(opt, model, _topo()) is opt
    assert all(type(p) is nn.Parameter for p in model.parameters())
    with pytest.raises(ConfigError, match="no Linear pairs to shard in ConvNet"):
        s.setup_module(ConvNet(), _topo())


def test_tensor_peers_share_the_data() -> None:
    s = TensorParallel()
    assert s.data_parallel(_topo(world_size=2)) == (0, 1)
    assert s.data_parallel(_topo(world_size=2, mesh_shape={"tp": 2})) == (0, 1)
    # Rank 2 of a dp=2 x tp=2 mesh sits at dp coordinate 1.
    topo = _topo(world_size=4, mesh_shape={"dp": 2, "tp": 2}, rank=2)
    assert s.data_parallel(topo) == (1, 2)


def test_tensor_needs_a_tp_mesh_dimension() -> None:
    with pytest.raises(ConfigError, match=r"needs a 'tp' dimension, but the mesh is \{'dp': 2\}"):
        TensorParallel().validate(_topo(world_size=2, mesh_shape={"dp": 2}))
    TensorParallel().validate(_topo(world_size=2))


def test_cpu_offload_in_one_process_on_a_gpu_says_it_offloads_nothing() -> None:
    """One process trains unwrapped: FSDP(cpu_offload=True) there leaves every state on
    the GPU, which the user asked to move off it; it says so before training. On a CPU
    the states are in host memory already, and at 2 data-parallel ranks it shards: no
    warning."""
    import warnings

    def topo(world: int, device: str, mesh: dict[str, int] | None = None) -> Topology:
        return Topology(world_size=world, local_world_size=world, device=torch.device(device),
                        backend="nccl" if device == "cuda" else "gloo",
                        mesh_shape=mesh or {}, mesh_given=mesh is not None)  # fmt: skip

    with pytest.warns(UserWarning, match=r"cpu_offload=True\) with one data-parallel rank on cuda"):
        FSDP(cpu_offload=True).validate(topo(1, "cuda"))
    # A mesh of dp=1 x tp=2 never applies FSDP either: two processes, nothing offloaded.
    with pytest.warns(UserWarning, match=r"one data-parallel rank on cuda"):
        FSDP(cpu_offload=True).validate(topo(2, "cuda", {"dp": 1, "tp": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDP(cpu_offload=True).validate(topo(1, "cpu"))
        FSDP(cpu_offload=True).validate(topo(2, "cuda"))
        FSDP().validate(topo(1, "cuda"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mesh_of_one_data_parallel_rank_keeps_autocast(precision: str) -> None:
    """FSDP casts the weights itself (MixedPrecisionPolicy) only where it shards: a
    mesh of dp=1 x tp=2 never applies FSDP, and turning autocast off there left the
    mixed precision to nobody: the run trained in float32 as if asked for bf16."""
    from scaletrain.precision import Precision

    cuda = precision == "fp16-mixed"  # fp16 needs CUDA; its checks read only the device type
    device = torch.device("cuda" if cuda else "cpu")
    for shape, casts in (({"dp": 1, "tp": 2}, False), ({"dp": 2, "tp": 2}, True)):
        world = shape["dp"] * shape["tp"]
        topo = Topology(world_size=world, local_world_size=world, mesh_shape=shape,
                        mesh_given=True, device=device)  # fmt: skip
        mine = Precision(name=precision, device=device, scaler=object() if cuda else None)
        FSDPxTP().adopt_precision(mine, topo)
        assert mine.autocast is not casts, shape
