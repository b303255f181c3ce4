"""float8 training in one process: which layers, the names, the math, the refusals.

A CPU has no float8 matmuls, so these tests turn on the test hook
(`strategies.float8._float8_on_any_device`): torchao emulates the matmul of the float8 values
in high precision, and everything around it (the conversion, the float8 casts and
scales) runs as on a GPU. The device refusal itself is tested with the hook off.
(2-process FSDP float8 all-gather and tensor parallel's float8 styles:
tests/dist/test_float8.py; real float8 on a GPU: tests/gpu/test_float8_gpu.py.)
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip(
    "torchao", reason="float8 is an optional extra: pip install 'scaletrain[float8]'"
)

import scaletrain as st
from scaletrain import cli
from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.strategies import float8 as float8_lever
from scaletrain.strategies import resolve_strategy
from scaletrain.strategies.float8 import convert_float8, float8_layers, float8_note
from scaletrain.strategies.mesh import FSDPxTP
from scaletrain.train.config import TrainConfig
from scaletrain.train.models import GPT, GPTConfig, SplitNet

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)

FLOAT8_LOSS_TOLERANCE = 0.01
"""|float8 - fp32| of the loss (about 4.2 here) over 10 AdamW steps: e4m3 keeps 3
mantissa bits (a relative rounding of up to 1/16 per element), which the dot
products average down to about 1e-3 in the loss; 10x that is the bound."""

BLOCK_LINEARS = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc", "mlp.proj"]


@pytest.fixture
def anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """float8 on the CPU, through the test hook."""
    monkeypatch.setattr(float8_lever, "_float8_on_any_device", True)


def _topology(world: int = 1) -> Any:
    from scaletrain.dist.topology import Topology

    return Topology(
        world_size=world,
        local_world_size=world,
        device=torch.device("cpu"),
        backend="gloo",
        mesh_shape={"dp": world},
        mesh_given=False,
    )


def _losses(strategy: st.Strategy | None, steps: int = 10) -> tuple[list[float], GPT]:
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if strategy is not None:
        strategy.validate(_topology())
        model = strategy.setup_module(model, _topology())  # type: ignore[assignment]
        opt = strategy.setup_optimizer(opt, model, _topology())
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        t = torch.randint(0, SMALL.vocab_size, (4, SMALL.block_size + 1), generator=g)
        logits = model(t[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, SMALL.vocab_size), t[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out, model


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fit = nn.Linear(32, 32)
        self.odd = nn.Linear(32, 24)  # 24 is not a multiple of 16: stays in high precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.fit(x))


class _OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Odd(), _Odd()])
        self.head = nn.Linear(24, 32)


def test_the_blocks_linear_layers_become_float8_and_the_rest_stays(anywhere: None) -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = GPT(SMALL)
    keys = list(model.state_dict())
    params = {n: id(p) for n, p in model.named_parameters()}
    converted = convert_float8(model)
    expected = sorted(f"blocks.{i}.{n}" for i in range(SMALL.n_layer) for n in BLOCK_LINEARS)
    assert converted == expected
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is Float8Linear for n in expected)
    # The embeddings and the output head stay in high precision, as in torchtitan.
    assert type(model.head) is nn.Linear and type(model.tok_emb) is nn.Embedding
    # In place, the same Parameter objects: names, checkpoint keys, the optimizer's.
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == params
    # Widths not divisible by 16 are left out.
    odd = _OddNet()
    assert convert_float8(odd) == ["blocks.0.fit", "blocks.1.fit"]
    assert type(odd.blocks[0].odd) is nn.Linear


def test_a_float8_checkpoint_loads_into_a_model_without_float8(anywhere: None) -> None:
    _, model = _losses(st.SingleDevice(float8=True), steps=2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # how scaletrain reads checkpoints
    plain = GPT(SMALL)
    plain.load_state_dict(state)  # strict: the same keys
    for name, value in model.state_dict().items():
        assert type(state[name]) is torch.Tensor
        assert torch.equal(plain.state_dict()[name], value)


def test_float8_trains_within_tolerance_of_fp32(anywhere: None) -> None:
    fp32, _ = _losses(None)
    float8, model = _losses(st.SingleDevice(float8=True))
    assert type(model.blocks[0].mlp.fc).__name__ == "Float8Linear"
    # float8 did change the math (the test would see a conversion that did nothing)...
    assert float8 != fp32
    # ... within the tolerance float8's rounding allows.
    assert max(abs(a - b) for a, b in zip(float8, fp32, strict=True)) < FLOAT8_LOSS_TOLERANCE
    # Under FSDP in one process (nothing to gather) it is the same conversion.
    fsdp, _ = _losses(st.FSDP(float8=True))
    assert fsdp == float8


def test_float8_comes_before_checkpointing_and_compile(anywhere: None) -> None:
    _, model = _losses(st.SingleDevice(float8=True, ac="full"), steps=1)
    assert type(model.blocks[0].mlp.fc).__name__ == "Float8Linear"
    assert getattr(model, "_scaletrain_levers", None) == ("full", None, False)


def test_tensor_parallel_gives_the_float8_layers_float8_styles(anywhere: None) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from scaletrain.strategies.tensor import _float8_styles, _sharing_colwise, default_tp_plan

    model = GPT(SMALL)
    assert (
        _float8_styles(model, default_tp_plan(model), False, True, {}) is None
    )  # no float8 layers
    convert_float8(model)
    plan = {**default_tp_plan(model), "head": "colwise"}
    # Sequence parallel all-gathers in float8 on NCCL; Gloo has no float8 collectives.
    assert _float8_styles(model, plan, True, False, {}) is None
    sequence = _float8_styles(model, plan, True, True, {})
    assert sequence is not None and type(sequence["blocks.0.mlp.fc"]) is Float8ColwiseParallel
    styles = _float8_styles(model, plan, False, False, {})
    assert styles is not None
    assert type(styles["blocks.0.attn.q_proj"]) is Float8ColwiseParallel
    assert type(styles["blocks.3.mlp.proj"]) is Float8RowwiseParallel
    # A layer float8 left alone keeps the plain style (a ColwiseParallel that shares its
    # input with the layers beside it that take the same tensor).
    assert type(styles["head"]) is _sharing_colwise()
    assert isinstance(styles["head"], ColwiseParallel)


def test_refused_on_a_device_without_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError,
        match=r"FSDP\(\.\.\.\): float8=True needs GPUs that multiply float8 matrices \(NVIDIA "
        r"compute capability 8\.9 or newer: L4, .*H100.*\), and this run's device is the CPU",
    ):
        st.FSDP(float8=True).validate(_topology())
    # A GPU before Ada: named with its capability.
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    with pytest.raises(
        ConfigError,
        match=r"this run's device is cuda:0 \(NVIDIA A100-SXM4-80GB\) of compute capability 8\.0",
    ):
        float8_lever.check_float8(torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    float8_lever.check_float8(torch.device("cuda:0"))  # an H100 is taken


def test_refused_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"Fix: pip install 'scaletrain\[float8\]'\."):
        st.DDP(float8=True).validate(_topology())


def test_without_compile_a_note_once_not_an_error(
    anywhere: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert float8_note(True) is None
    rt = st.init(strategy=st.SingleDevice(float8=True), env="local", ledger=False)
    rt.shutdown()
    err = capsys.readouterr().err
    assert err.count("scaletrain: note:") == 1
    assert "float8=True without compile=True: float8 is fast only compiled" in err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: st.Pipeline(float8=True), r"float8=True with a pipeline: its stages are traced"),
        (
            lambda: resolve_strategy(st.DDP(float8=True), mesh={"dp": 1, "pp": 2}),
            r"float8=True with a pipeline",
        ),
        (lambda: st.DataParallel(float8=True), r"strategy='dp' takes no float8"),
        (lambda: st.FSDP(float8=1), r"FSDP\(float8=1\) must be True or False"),
        (
            lambda: FSDPxTP(fsdp=st.FSDP(float8=True), tensor=st.TensorParallel(ac="full")),
            "set on more than one of its parts",
        ),
    ],
)
def test_library_mistakes_are_refused_at_construction(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_model_float8_cannot_convert_is_refused_before_any_process_starts() -> None:
    with torch.device("meta"):
        net = SplitNet()
    with pytest.raises(ConfigError, match=r"float8=True converts the Linear layers of a model's"):
        st.FSDP(float8=True).check_model(net, _topology(2))

    class Narrow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in "ab"])

    with pytest.raises(ConfigError, match=r"no Linear layer .* divisible by 16"):
        float8_layers(Narrow())


def test_a_mesh_keeps_float8_on_the_composite() -> None:
    fsdp_tp = resolve_strategy(st.FSDP(float8=True, compile=True), mesh={"dp": 2, "tp": 2})
    assert isinstance(fsdp_tp, FSDPxTP)
    assert (fsdp_tp.float8, fsdp_tp.compile) == (True, True)
    assert (fsdp_tp.fsdp.float8, fsdp_tp.tensor.float8) == (False, False)


def test_the_cli_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    strategy = TrainConfig(strategy="fsdp", float8=True, compile=True).strategy_object()
    assert (type(strategy), strategy.float8, strategy.compile) == (st.FSDP, True, True)
    use_cli_names(True)
    try:
        with pytest.raises(
            ConfigError, match=r"--float8 needs GPUs .* Fix: train without --float8"
        ):
            strategy.validate(_topology())
    finally:
        use_cli_names(False)
    # Refused in the launcher, before any process starts, in the flags' words (on a
    # machine without GPUs: a capable GPU would take it).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code = cli.main(["train", "--recipe", "gpt", "--strategy", "fsdp", "--float8"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("scaletrain: error: --float8 needs GPUs that multiply float8 matrices")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    group = help_text[help_text.index("memory and speed") : help_text.index("length and optimizer")]
    assert "--float8" in group
