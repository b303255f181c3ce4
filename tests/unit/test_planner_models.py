"""The models people plan: recipes, model modules and Hugging Face config.json files
resolve to what the planner needs, and what cannot be planned is refused with the fix."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.planner.models import PlannedModel, resolve_model

pytestmark = pytest.mark.timeout(120)

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 48,
    "torch_dtype": "bfloat16",
}  # fmt: skip

SEQ_MODULE = """
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 50)
        self.config = {config}

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

def build():
    return Tiny()

def example(batch_size{seq_param}):
    x = torch.randint(0, 50, (batch_size, {seq}))
    return x, x
"""


def _module(tmp_path: Path, *, seq_param: str = ", seq_len=12", seq: str = "seq_len") -> str:
    config = "type('C', (), {'max_seq_len': 32})()"
    path = tmp_path / "seqmodel.py"
    path.write_text(SEQ_MODULE.format(config=config, seq_param=seq_param, seq=seq))
    return f"{path}:build"


def _config(tmp_path: Path, settings: dict[str, Any], name: str = "config.json") -> Path:
    folder = tmp_path / str(settings.get("model_type", "hf"))
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(settings))
    return folder


def _on_meta(planned: PlannedModel) -> nn.Module:
    with torch.device("meta"):
        net = planned.build()
    assert all(p.device.type == "meta" for p in net.parameters())
    return net


def _refused(match: str, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as info:
        resolve_model(**kwargs)
    return info.value


def test_no_model_named_plans_the_convnet_recipe_which_has_no_sequence() -> None:
    planned = resolve_model(batch_size=7)
    assert (planned.name, planned.batch_size, planned.seq_len) == ("convnet", 7, None)
    assert planned.blocks == ("layer1", "layer2") and planned.tp_plan is None
    inputs, targets = planned.example(3)
    assert inputs.shape == (3, 1, 28, 28) and targets.shape == (3,)
    net = _on_meta(planned)
    assert isinstance(planned.optimizer(net.parameters()), torch.optim.SGD)
    assert resolve_model("convnet").batch_size == 100


def test_llama_8b_builds_on_meta_at_its_size_with_its_own_plan_and_sequence() -> None:
    from scaletrain.train.models import LLAMA_TP_PLAN

    planned = resolve_model("llama-8b")
    net = _on_meta(planned)
    assert sum(p.numel() for p in net.parameters()) == 8_030_261_248
    assert (planned.seq_len, planned.batch_size) == (8192, 1)
    assert planned.tp_plan == LLAMA_TP_PLAN
    assert planned.blocks == tuple(f"layers.{i}" for i in range(32))
    assert planned.example(1)[0].shape == (1, 8192)
    shorter = resolve_model("llama-8b", seq_len=2048, batch_size=2)
    inputs, targets = shorter.example(shorter.batch_size)
    assert (shorter.seq_len, inputs.shape, targets.shape) == (2048, (2, 2048), (2, 2048))
    assert inputs.dtype == torch.int64


def test_a_recipes_sequence_is_refused_beyond_its_models_maximum() -> None:
    err = _refused(r"seq_len=200000 is more than llama-8b takes: its config.max_seq_len is "
                   r"131072\. Fix: seq_len=131072 or less", recipe="llama-8b", seq_len=200_000)  # fmt: skip
    assert err.field == "seq_len"
    _refused(r"more than gpt takes: its config.block_size is 64", recipe="gpt", seq_len=65)
    assert resolve_model("gpt", seq_len=64).example(1)[0].shape == (1, 64)


def test_a_model_module_with_a_sequence_takes_seq_len_through_its_example(
    tmp_path: Path,
) -> None:
    spec = _module(tmp_path)
    planned = resolve_model(model=spec)
    assert (planned.name, planned.seq_len, planned.batch_size) == (spec, 12, 32)
    assert planned.blocks == ("blocks.0", "blocks.1")
    assert planned.tp_plan == {
        f"blocks.{i}.{j}": style for i in (0, 1) for j, style in ((0, "colwise"), (2, "rowwise"))
    }
    net = _on_meta(planned)
    out = net.to_empty(device="cpu")(planned.example(2)[0])
    assert out.shape == (2, 12, 50) and planned.loss(out, planned.example(2)[1]).dim() == 0
    longer = resolve_model(model=spec, seq_len=20)
    assert longer.seq_len == 20 and longer.example(3)[0].shape == (3, 20)
    _refused(r"more than .*seqmodel.py:build takes: its config.max_seq_len is 32",
             model=spec, seq_len=33)  # fmt: skip


def test_a_model_modules_example_without_seq_len_is_refused_with_the_fix(tmp_path: Path) -> None:
    spec = _module(tmp_path, seq_param="", seq="9")
    assert resolve_model(model=spec).seq_len == 9
    err = _refused(r"seq_len=16: .*example\(batch_size\) takes no sequence length.*Fix: give it "
                   r"one \(def example\(batch_size, seq_len=\.\.\.\)", model=spec, seq_len=16)  # fmt: skip
    assert err.field == "seq_len"


def test_a_model_modules_sequence_is_refused_beyond_its_position_table(tmp_path: Path) -> None:
    """A model module with no config stating its longest sequence: its learned position
    table's rows are the limit (beyond them its first step indexes past the table)."""
    path = tmp_path / "posmodel.py"
    path.write_text(
        SEQ_MODULE.format(config="None", seq_param=", seq_len=12", seq="seq_len").replace(
            "self.head = nn.Linear(8, 50)",
            "self.head = nn.Linear(8, 50)\n        self.pos_emb = nn.Embedding(24, 8)",
        )
    )
    spec = f"{path}:build"
    assert resolve_model(model=spec, seq_len=24).seq_len == 24
    err = _refused(r"seq_len=25 is more than .*posmodel.py:build takes: its position table "
                   r"pos_emb holds 24 positions\. Fix: seq_len=24 or less", model=spec,
                   seq_len=25)  # fmt: skip
    assert err.field == "seq_len"


@pytest.mark.parametrize("kwargs", [{"recipe": "convnet"}, {"recipe": "wrn"}])
def test_seq_len_is_refused_for_a_model_without_a_sequence(kwargs: dict[str, Any]) -> None:
    err = _refused(r"seq_len=128 only applies to sequence models .*inputs are float32 of shape "
                   r"\(1, 1, 28, 28\)\. Fix: leave out seq_len\.", seq_len=128, **kwargs)  # fmt: skip
    assert err.field == "seq_len"
    use_cli_names()
    _refused(r"^--seq-len 128 only applies to sequence models.*Fix: leave out --seq-len\.$",
             seq_len=128, **kwargs)  # fmt: skip


def test_a_llama_config_json_builds_on_meta_in_fp32_with_its_declared_plan(
    tmp_path: Path,
) -> None:
    folder = _config(tmp_path, LLAMA)
    planned = resolve_model(model=str(folder / "config.json"))
    assert planned.name == f"LlamaForCausalLM ({folder / 'config.json'})"
    net = _on_meta(planned)
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert not net.config.use_cache
    assert (planned.seq_len, planned.batch_size) == (48, 1)  # max_position_embeddings
    assert planned.blocks == ("model.layers.0", "model.layers.1")
    declared = net.config.base_model_tp_plan
    assert planned.tp_plan == {f"model.{k}": v for k, v in declared.items()}
    inputs, targets = planned.example(2)
    assert inputs.shape == targets.shape == (2, 48) and inputs.dtype == torch.int64
    assert int(inputs.max()) < 64 and torch.equal(inputs[:, 1:], targets[:, :-1])
    real = planned.build()
    loss = planned.loss(real(inputs), targets)  # a ModelOutput: its logits
    assert loss.dim() == 0 and 3.0 < loss.item() < 5.5  # about log(64) at random weights
    assert resolve_model(model=str(folder), seq_len=10).example(1)[0].shape == (1, 10)


def test_other_architectures_resolve_from_a_directory_or_architectures_alone(
    tmp_path: Path,
) -> None:
    qwen = {**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    qwen["max_position_embeddings"] = 32768
    planned = resolve_model(model=str(_config(tmp_path, qwen)))
    assert planned.name.startswith("Qwen2ForCausalLM (") and planned.seq_len == 4096
    assert planned.tp_plan is not None and planned.tp_plan["model.layers.*.mlp.down_proj"] == (
        "rowwise"
    )
    _on_meta(planned)
    # No model_type: the architecture names it. GPT-2's Conv1D layers give no plan.
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 32,
            "n_layer": 3, "n_head": 4, "n_positions": 40, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    planned = resolve_model(model=str(_config(tmp_path, gpt2)), seq_len=16)
    assert planned.name.startswith("GPT2LMHeadModel") and planned.tp_plan is None
    assert planned.blocks == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert type(_on_meta(planned)).__name__ == "GPT2LMHeadModel"
    assert planned.example(4)[0].shape == (4, 16)
    _refused(r"seq_len=41 is more than GPT2LMHeadModel .* its config.max_position_embeddings "
             r"is 40", model=str(tmp_path / "hf"), seq_len=41)  # fmt: skip


def test_both_a_recipe_and_a_model_are_refused_in_the_callers_words(tmp_path: Path) -> None:
    err = _refused(r"^recipe='gpt' and model='x.py:build' both name the model\. Fix: give one",
                   recipe="gpt", model="x.py:build")  # fmt: skip
    assert err.field == "model"
    # st.plan("mine.py:build", ...) took it as a recipe's name: "not known".
    _refused(r"^recipe='mine.py:build' names a model module or config.json, not one of "
             r"scaletrain's recipes\. Fix: model='mine.py:build'\.$", recipe="mine.py:build")  # fmt: skip
    for spec in ("mine.py", "path/to/hf-model"):  # a file or a folder, as model= takes them
        _refused(rf"^recipe='{spec}' names a model module .* Fix: model='{spec}'\.$", recipe=spec)
    use_cli_names()
    _refused(r"^--recipe gpt and --model x.py:build both", recipe="gpt", model="x.py:build")


def test_an_unknown_recipe_is_refused_with_the_near_name() -> None:
    err = _refused(r"recipe='lama-8b' is not known; .*Fix: recipe='llama-8b'", recipe="lama-8b")
    assert err.field == "recipe"


@pytest.mark.parametrize("field", ["seq_len", "batch_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_that_are_not_positive_are_refused(field: str, value: int) -> None:
    err = _refused(rf"^{field}={value}: expected a positive whole number\. Fix: {field}=1",
                   recipe="llama", **{field: value})  # fmt: skip
    assert err.field == field


def test_a_missing_config_json_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    err = _refused(rf"model='{missing}': no file {missing}\. Fix: the path of a Hugging Face "
                   "config.json", model=str(missing))  # fmt: skip
    assert err.field == "model"
    (tmp_path / "empty").mkdir()
    _refused(rf"no file {tmp_path / 'empty' / 'config.json'}", model=str(tmp_path / "empty"))


def test_a_config_json_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{model_type: llama")
    _refused(rf"model='{path}': {path} is not JSON \(.*\)\. Fix: the config.json", model=str(path))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {"model_type": "lama", **TINY},
            r"its model_type is 'lama' .* does not know \(did it mean llama\b.*\)\.",
        ),
        (TINY, r"it names no model_type and its architectures are none, .* does not know\."),
        (
            {**TINY, "architectures": ["NoSuchForCausalLM"]},
            r"architectures are \['NoSuchForCausalLM'\], .* does not know\.",
        ),
    ],
)
def test_a_config_json_transformers_does_not_know_is_refused(
    tmp_path: Path, settings: dict[str, Any], match: str
) -> None:
    folder = _config(tmp_path, settings)
    err = _refused(match + r" Fix: a config.json whose model_type", model=str(folder))
    assert err.field == "model"


def test_a_config_json_of_no_causal_language_model_is_refused(tmp_path: Path) -> None:
    folder = _config(tmp_path, {"model_type": "vit", "hidden_size": 32})
    _refused(r"builds no causal language model for model_type 'vit'.*Fix: plan it as a model "
             r"module \(MODULE:NAME\)", model=str(folder))  # fmt: skip


def test_a_config_json_whose_settings_transformers_refuses_says_which(tmp_path: Path) -> None:
    folder = _config(tmp_path, {**LLAMA, "hidden_size": 30})
    _refused(r"transformers refused .*config.json: .*hidden size \(30\) is not a multiple of "
             r"the number of attention heads \(4\)\. Fix: that setting in the file\.$",
             model=str(folder))  # fmt: skip


def test_a_config_json_without_transformers_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _config(tmp_path, LLAMA)
    monkeypatch.setitem(sys.modules, "transformers", None)
    use_cli_names()
    err = _refused(rf"^--model {folder} is a Hugging Face config, .* not installed\. Fix: pip "
                   r"install transformers\.$", model=str(folder))  # fmt: skip
    assert err.field == "model"


def test_a_config_json_models_blocks_fall_back_to_its_no_split_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scaletrain.planner.models as models

    monkeypatch.setattr(models, "auto_wrap_targets", lambda net: [])
    planned = resolve_model(model=str(_config(tmp_path, LLAMA)))
    assert planned.blocks == ("model.layers.0", "model.layers.1")  # LlamaDecoderLayer


def test_a_declared_plans_patterns_divide_the_tensor_parallel_rows(tmp_path: Path) -> None:
    """A Hugging Face plan names its modules by pattern ("layers.*.self_attn.q_proj");
    the formulas priced modules by exact name, so tensor parallel divided nothing and a
    70B's 2-D row held every weight on each rank."""
    import scaletrain as st
    from scaletrain.planner.layout import Layout

    path = _config(tmp_path, {"model_type": "llama", **TINY, "num_attention_heads": 4,
                              "num_key_value_heads": 2})  # fmt: skip
    p = st.plan(model=str(path), devices=2, hardware="h100-sxm", seq_len=16,
                layouts=[Layout("ddp", dp=2), Layout("tensor", tp=2)])  # fmt: skip
    ddp, tp = p.rows
    assert tp.memory.params < 0.8 * ddp.memory.params
    assert tp.time.comm > 0


def test_a_config_json_is_profiled_in_the_dtype_its_step_reads(tmp_path: Path) -> None:
    """A config.json model was built in fp32 whatever the profile asked: a sharded FSDP
    row at bf16-mixed (and every bf16-true row) held fp32 activations, twice theirs."""
    from scaletrain.planner.profile import profile_model

    planned = resolve_model(model=str(_config(tmp_path, LLAMA)), seq_len=16)
    args = (planned.build, planned.example(2), planned.loss, planned.optimizer)
    fp32 = profile_model(*args, precision="32")
    bf16 = profile_model(*args, precision="bf16-true")
    gathered = profile_model(*args, precision="bf16-mixed", gathered=True)
    assert bf16.param_bytes == fp32.param_bytes // 2
    block = planned.blocks[0]
    for p in (bf16, gathered):
        assert p.modules[block].output_bytes == fp32.modules[block].output_bytes // 2


MIXTRAL = {
    **LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip


def test_a_mixture_of_experts_is_profiled_with_its_experts_matmuls(tmp_path: Path) -> None:
    """transformers runs a mixture of experts' layers as torch._grouped_mm, whose fake
    kernel took bfloat16 alone (its CPU and CUDA kernels take float32 too): a Mixtral
    config.json failed to plan at 32 (and bf16-mixed: autocast does not cast the op);
    at bf16-true its experts, which torch's counter has no formula for, counted 0
    FLOPs. Each token runs its top 2 of 4 experts, each Llama's MLP, and a router: a
    Llama of the same sizes plus one MLP more and the router, per token and block."""
    from scaletrain.planner.profile import profile_model

    def profile(settings: dict[str, Any], precision: str) -> Any:
        planned = resolve_model(model=str(_config(tmp_path, settings)), seq_len=16)
        args = (planned.build, planned.example(1), planned.loss, planned.optimizer)
        return profile_model(*args, precision=precision)

    moe, dense, bf16 = profile(MIXTRAL, "32"), profile(LLAMA, "32"), profile(MIXTRAL, "bf16-true")
    h, i, blocks, tokens, experts = 32, 64, 2, 16, 4
    more = blocks * tokens * (3 * 2 * h * i + 2 * h * experts)
    assert moe.forward.flops == dense.forward.flops + more == bf16.forward.flops
    assert moe.backward.flops == 2 * moe.forward.flops == bf16.backward.flops
    assert moe.activation_bytes > dense.activation_bytes
    # The float32 experts hold what the bfloat16 ones (torch's own fake kernel) hold,
    # at twice the bytes: all but the routing's integer indices.
    layer = "model.layers.0.mlp.experts"
    held, half = moe.modules[layer], bf16.modules[layer]
    assert held.output_bytes == 2 * half.output_bytes
    assert 1.95 * half.activation_bytes < held.activation_bytes <= 2 * half.activation_bytes


def test_a_mixture_of_experts_under_autocast_is_priced_in_float32(tmp_path: Path) -> None:
    """Autocast does not cast torch._grouped_mm, and transformers casts its input to
    the float32 weights: at bf16-mixed the experts run in float32 (a sharded FSDP row's
    weights are gathered in bf16, and so are theirs). A plan priced them at the bf16
    rate, and said nothing."""
    import scaletrain as st
    from scaletrain.hardware import load
    from scaletrain.planner import Layout

    h, i, blocks, tokens = 32, 64, 2, 16
    experts = blocks * tokens * 2 * 3 * 2 * h * i  # top 2, three matmuls each
    path = str(_config(tmp_path, MIXTRAL))
    ddp, fsdp = Layout("ddp", dp=2), Layout("fsdp", dp=2)
    plan = st.plan(model=path, devices=2, hardware="h100-sxm", seq_len=tokens,
                   precision="bf16-mixed", layouts=[ddp, fsdp])  # fmt: skip
    prof = plan.profile  # the ddp row's: autocast
    # The rest in float32: the rotary embedding's (it turns autocast off).
    assert prof.forward.fp32 == pytest.approx(experts, rel=1e-3)
    assert prof.backward.fp32 == pytest.approx(2 * experts, rel=1e-3)
    hw = load("h100-sxm")
    fp32_s = (prof.forward.fp32 + prof.backward.fp32) / hw.matmul_flops("fp32")
    assert plan.row("ddp").time.compute > fp32_s
    f32 = [n for n in plan.row("ddp").notes if "run in float32" in n]
    assert f32 and f32[0].startswith(f"{3 * experts / prof.flops:.0%} of the matmul FLOPs")
    assert not [n for n in plan.row("fsdp").notes if "float32" in n]


VALUED = """
import torch
from torch import nn

class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            {route}
        return self.head(x)

def build():
    return Routed()

def example(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
"""


@pytest.mark.parametrize(
    ("route", "op"),
    [
        ("keep = (x.sum(-1) > 0).nonzero().squeeze(-1); x = x.index_add(0, keep, b(x[keep]))",
         "aten.nonzero"),
        ("x = b(x) if x.sum().item() > 0 else x", r"\.item\(\) or the like \(a tensor read as a "
                                                  r"Python number or bool"),
    ],
    ids=["nonzero", "item"],
)  # fmt: skip
def test_a_step_that_needs_tensor_values_is_refused_in_words(
    tmp_path: Path, route: str, op: str
) -> None:
    """A forward that routes by .nonzero() (an eager loop over a mixture's experts) or
    branches on .item() ended the plan in a fake tensor's traceback."""
    import scaletrain as st

    path = tmp_path / "routed.py"
    path.write_text(VALUED.format(route=route))
    with pytest.raises(ConfigError, match=rf"plan\(\.\.\.\): {path}:build's step cannot be "
                       rf"profiled: it runs {op}.*, whose result depends .* Fix: compute .* "
                       r"or measure it: train a few steps"):  # fmt: skip
        st.plan(model=f"{path}:build", devices=2, hardware="h100-sxm")


def test_a_config_json_is_built_without_the_libraries_import_notes(tmp_path: Path) -> None:
    """transformers imports torchao where it is installed, which logged a line for each
    CUDA extension this machine cannot load, and torch's pytree a deprecation: three
    lines on stderr before every plan of a config.json, and every rank's training."""
    import subprocess

    pytest.importorskip("torchao")
    folder = _config(tmp_path, LLAMA)
    build = (
        "import sys; from scaletrain.planner.models import resolve_model as r; r(model=sys.argv[1])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", build, str(folder)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "_pytree" not in proc.stderr, proc.stderr


def test_a_model_module_that_imports_transformers_is_loaded_without_its_import_notes(
    tmp_path: Path,
) -> None:
    """The same three lines came from a user's model module that imports transformers
    itself (examples/hf_llama.py does), in `plan --model` and on every rank's start."""
    import subprocess

    pytest.importorskip("torchao")
    (tmp_path / "hfmod.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def build():\n"
        "    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1))\n"
    )
    load = "from scaletrain.train.model_module import load_recipe; load_recipe('hfmod:build')"
    proc = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "_pytree" not in proc.stderr, proc.stderr


def test_a_library_transformers_imports_that_fails_says_so_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchao (or other module transformers' models import) that fails to import was
    reported as "transformers ... is not installed. Fix: pip install transformers"."""
    import transformers.models.auto.modeling_auto  # noqa: F401  (imported before the break)

    folder = _config(tmp_path, LLAMA)
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", None)
    with pytest.raises(ImportError, match="transformers.modeling_utils"):
        resolve_model(model=str(folder))


def test_a_forward_that_fails_names_the_users_line_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A model whose forward fails (a shape mismatch) ended the plan in a traceback of
    some 180 lines, torch's log of the failing meta kernel first; a failing factory was
    already one message naming its line."""
    import scaletrain as st

    path = tmp_path / "mismatched.py"
    path.write_text(VALUED.format(route="x = b(x[:, :8])"))
    with pytest.raises(ConfigError) as got:
        st.plan(model=f"{path}:build", devices=2, hardware="h100-sxm")
    said = str(got.value)
    assert said.startswith(
        f"plan(...): {path}:build's step on its example batch (inputs float32 (32, 16), "
        "targets int64 (32,)) raised RuntimeError: "
    ), said
    assert said.endswith(f"Fix: correct your code at {path}, line 13."), said
    assert f'File "{path}", line 13, in forward' in said and "linear.py" in said, said
    assert (
        "_meta_registrations" not in said
        and "failed while attempting" not in capfd.readouterr().err
    )


def test_an_error_of_scaletrains_own_beneath_a_forward_is_not_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error raised in scaletrain's own dispatch modes, beneath a user's forward, was
    told as theirs: "Fix: correct your code at <their line>"."""
    import scaletrain as st
    from scaletrain.planner import kernels

    path = tmp_path / "plain.py"
    path.write_text(VALUED.format(route="x = b(x)"))

    real = kernels.Kernels.__torch_dispatch__

    def broken(self: kernels.Kernels, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is torch.ops.aten.addmm.default:  # a Linear's matmul
            raise IndexError("scaletrain's own bug")
        return real(self, func, *args, **kwargs)

    # As a function of kernels.py's own (its frame is scaletrain's).
    ours = types.FunctionType(broken.__code__, vars(kernels), None, None, broken.__closure__)
    monkeypatch.setattr(kernels.Kernels, "__torch_dispatch__", ours)
    with pytest.raises(IndexError, match="scaletrain's own bug"):
        st.plan(model=f"{path}:build", devices=2, hardware="h100-sxm")


def test_a_declared_plan_tensor_parallel_refuses_says_why_it_is_not_planned(
    tmp_path: Path,
) -> None:
    """A Mixtral declares a tensor-parallel plan of expert styles TensorParallel does
    not apply (training refuses it): its plan had no tensor-parallel rows, and no word
    of why."""
    import scaletrain as st
    from scaletrain.planner import Layout

    path = str(_config(tmp_path, MIXTRAL))
    why = r"MixtralForCausalLM declares a tensor-parallel plan .* moe_tp_experts"
    with pytest.raises(
        ConfigError, match=rf"plan\(\.\.\., layouts=.*tensor tp=2.*{why}.*Fix: a layout with tp=1"
    ):
        st.plan(model=path, devices=2, hardware="h100-sxm", layouts=[Layout("tensor", tp=2)])
    p = st.plan(model=path, devices=2, hardware="h100-sxm", seq_len=16)
    assert p.rows and not [r for r in p.rows if r.layout.tp > 1]
    assert p.skipped[0].startswith("tensor parallel: MixtralForCausalLM declares"), p.skipped


def test_a_model_modules_example_that_returns_no_pair_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    """example(batch_size) returns (inputs, targets); one that returns the inputs alone
    was unpacked by the planner and raised a bare ValueError."""
    path = tmp_path / "seqmodel.py"
    text = SEQ_MODULE.format(config="None", seq_param="", seq="9").replace(
        "return x, x", "return x"
    )
    path.write_text(text)
    err = _refused(r"model='.*seqmodel.py:build': example\(1\) returned a Tensor; it must return "
                   r"\(inputs, targets\).*Fix: return inputs, targets", model=f"{path}:build")  # fmt: skip
    assert err.field == "model"


def test_a_pipeline_that_cannot_split_the_blocks_says_so(tmp_path: Path) -> None:
    """A Hugging Face model's top-level layers are `model` and `lm_head`: a pipeline row
    put every block in one stage (params 3.9 GiB of DDP's 4.1, no bubble, half the
    throughput) and said nothing."""
    import scaletrain as st
    from scaletrain.planner.layout import Layout

    folder = _config(tmp_path, LLAMA)
    p = st.plan(model=str(folder / "config.json"), devices=2, hardware="h100-sxm", batch_size=2,
                layouts=[Layout("pipeline", pp=2, schedule="1f1b", microbatches=2)])  # fmt: skip
    notes = p.rows[0].notes
    assert any("of the parameters: stages are whole top-level layers (model, lm_head)" in n
               for n in notes), notes  # fmt: skip
    # Every block in one stage although it holds less than 75% (a large vocabulary
    # makes lm_head most of the other stage): the note said nothing below 75%.
    (tmp_path / "wide").mkdir()
    wide = _config(tmp_path / "wide", {**LLAMA, "vocab_size": 1024})
    row = st.plan(model=str(wide / "config.json"), devices=2, hardware="h100-sxm", batch_size=2,
                  layouts=[Layout("pipeline", pp=2, schedule="1f1b", microbatches=2)]).rows[0]  # fmt: skip
    share = next(int(n.split("%")[0].split()[-1]) for n in row.notes if "of the parameters" in n)
    assert share < 75, row.notes
    mine = st.plan("gpt", devices=2, hardware="h100-sxm",
                   layouts=[Layout("pipeline", pp=2, schedule="1f1b", microbatches=2)])  # fmt: skip
    assert not any("top-level layers" in n for n in mine.rows[0].notes)  # its blocks split


def test_a_sweep_profiles_a_model_once_and_a_changed_model_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile depends on the model, its batch and the levers, not on the devices or
    the hardware: a sweep of them profiled the model again for each plan (37 s each for
    the 8B recipe). Kept for a recipe and a config.json (their code is fixed in a
    process), by what shapes them; a model module, whose code its user may edit and
    reload, is profiled at each plan."""
    from collections import OrderedDict

    import scaletrain as st
    import scaletrain.planner.api as api
    from scaletrain.train import llama

    profiled: list[str] = []
    real = api.profile_model
    monkeypatch.setattr(
        api, "profile_model", lambda *a, **k: profiled.append(k["name"]) or real(*a, **k)
    )
    monkeypatch.setattr(api, "_PROFILES", OrderedDict())

    def rows(*args: Any, **kwargs: Any) -> list[tuple[str, float, float]]:
        p = st.plan(*args, hardware=kwargs.pop("hardware", "h100-sxm"), **kwargs)
        return [(r.layout.label, r.memory.total, r.time.total) for r in p.rows]

    first = rows("llama", devices=2, batch_size=2)
    assert profiled == ["llama"]
    assert rows("llama", devices=2, batch_size=2) == first  # the same plan, not profiled
    rows("llama", devices=8, batch_size=2, hardware="a100-sxm")
    assert profiled == ["llama"]
    for changed in ({"batch_size": 4}, {"ac": "full"}, {"precision": "bf16-mixed"},
                    {"seq_len": 64}):  # fmt: skip
        rows("llama", devices=2, **{"batch_size": 2, **changed})
    assert len(profiled) == 5
    # The recipe's model changed (its shape's heads and MLP): profiled again.
    debug = llama.LLAMA_SHAPES["debug"]
    for shape in (replace(debug, n_heads=8, n_kv_heads=None), replace(debug, multiple_of=64)):
        monkeypatch.setitem(llama.LLAMA_SHAPES, "debug", shape)
        rows("llama", devices=2, batch_size=2)
    assert len(profiled) == 7
    # A config.json's text, as it is when planned.
    folder = _config(tmp_path, LLAMA)
    rows(model=str(folder), devices=2)
    rows(model=str(folder), devices=4)
    _config(tmp_path, {**LLAMA, "intermediate_size": 96})
    rows(model=str(folder), devices=2)
    assert len(profiled) == 9
    module = _module(tmp_path)
    rows(model=module, devices=2)
    rows(model=module, devices=2)
    assert len(profiled) == 11
