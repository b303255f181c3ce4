"""`scaletrain train` before any process starts: its config, its flags, its errors.

Everything here runs in this process (cli.main) and must fail or answer before a
worker would be launched: a check that only a worker could make is in
tests/dist/test_train_command.py.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain import cli
from scaletrain.errors import ConfigError, spell, use_cli_names
from scaletrain.settings import field_docs, field_specs, read_config_file, typed_flags
from scaletrain.train.config import SINGLE_PROCESS_STRATEGIES, TrainConfig

CONFIGS = Path(__file__).parent / "data" / "configs"


def _train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.err


# -- 1. single-process strategies ------------------------------------------------------


@pytest.mark.parametrize("strategy", SINGLE_PROCESS_STRATEGIES)
def test_single_process_strategies_default_to_one_process(strategy: str) -> None:
    assert TrainConfig(strategy=strategy).default_nproc(gpus=0) == 1  # type: ignore[arg-type]
    assert TrainConfig(strategy=strategy).default_nproc(gpus=8) == 1  # type: ignore[arg-type]
    assert TrainConfig(strategy="ddp").default_nproc(gpus=0) == 2
    assert TrainConfig(strategy="ddp").default_nproc(gpus=8) == 8


@pytest.mark.parametrize("strategy", ["dp", "model-parallel"])
def test_single_process_strategy_with_more_processes_is_refused_before_launch(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = _train(capsys, "--strategy", strategy, "--nproc", "2")
    assert code == 2
    assert f"--strategy {strategy}" in err and "--nproc 2" in err and "--nproc 1" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_single_process_strategies_refuse_a_world_in_the_library() -> None:
    # The API keeps its own guard (st.init under torchrun with 2 processes).
    from scaletrain.strategies import STRATEGIES

    for name in ("dp", "model-parallel"):
        assert name in SINGLE_PROCESS_STRATEGIES and name in STRATEGIES


# -- 2. everything that can be checked in the parent -----------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--precision", "fp16-mixed"], ["--precision fp16-mixed needs a CUDA GPU", "bf16-mixed"]),
        (["--backend", "nccl"], ["--backend nccl needs CUDA GPUs", "--backend gloo"]),
        (["--mesh", "dp=2,tp=2", "--strategy", "ddp", "--nproc", "4"], ["ddp", "--strategy fsdp"]),
        (["--mesh", "dp=2,tp=2", "--nproc", "2"], ["4 ranks", "world size 2", "--nproc 4"]),
        (["--strategy", "tensor", "--recipe", "convnet"], ["no Linear pairs", "ConvNet",
                                                          "--strategy ddp", "--recipe gpt"]),
        (["--strategy", "pipeline", "--recipe", "split-net", "--nproc", "4"],
         ["more stages than layers", "SplitNet"]),
        (["--nproc", "0"], ["--nproc 0", "--nproc 2"]),
        (["--max-steps", "0"], ["--max-steps 0", "--max-steps 1"]),
        (["--data-dir", "/nonexistent/fmnist"], ["--data-dir /nonexistent/fmnist", "does not exist",
                                                  "train-images-idx3-ubyte"]),
        (["--data-dir", ""], ["--data-dir", "a directory holding the dataset"]),
        (["--recipe", "split-net", "--data-dir", "/tmp"], ["split-net", "generates its data"]),
        (["--monitor-interval", "0"], ["--monitor-interval 0.0", "positive, finite",
                                       "--monitor-interval 1"]),
        (["--monitor-interval", "inf"], ["--monitor-interval inf", "positive, finite"]),
    ],
    ids=["fp16-on-cpu", "nccl-without-gpus", "mesh-with-ddp", "mesh-size", "tensor-convnet",
         "pipeline-too-deep", "nproc-0",
         "max-steps-0", "data-dir-missing", "data-dir-empty", "data-dir-not-used",
         "monitor-interval-0", "monitor-interval-inf"],
)  # fmt: skip
def test_bad_settings_fail_in_the_parent_in_the_clis_words(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    words: list[str],
) -> None:
    if "--precision" in args or "--backend" in args:
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("CPU-only behaviour")
    monkeypatch.chdir(tmp_path)
    code, err = _train(capsys, *args)
    assert code == 2, err
    for word in words:
        assert word in err, err
    # One paragraph from the parent: no traceback, no API spelling, no worker started.
    assert "Traceback" not in err and err.count("scaletrain: error") == 1
    for api_name in ("precision=", "backend=", "nproc=", "mesh=", "strategy=", "plan="):
        assert api_name not in err, err
    assert not (tmp_path / "runs").exists()


def test_monitor_interval_reaches_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--monitor-interval is the elastic agent's polling interval for the workers of
    `scaletrain train`; left out, it is `scaletrain launch`'s default."""
    import scaletrain.launch as launch_mod
    from scaletrain.launch import LaunchConfig
    from scaletrain.testing.datasets import write_fake_mnist

    data = write_fake_mnist(tmp_path / "data")
    seen: list[LaunchConfig] = []

    def fake_launch(cfg: LaunchConfig, *args: object, **kwargs: object) -> int:
        seen.append(cfg)
        return 0

    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    monkeypatch.chdir(tmp_path)
    common = ["train", "--nproc", "2", "--data-dir", str(data), "--max-steps", "1"]
    assert cli.main([*common, "--out", "a", "--monitor-interval", "2.5"]) == 0
    assert cli.main([*common, "--out", "b"]) == 0
    assert [c.monitor_interval for c in seen] == [2.5, LaunchConfig().monitor_interval]
    assert TrainConfig().monitor_interval == LaunchConfig().monitor_interval


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--out", "afile"], ["--out afile names a file", "Fix: pass a directory"]),
        (["--out", "afile/run"], ["--out afile/run is inside afile, which is a file"]),
        (["--out", "old", "--fork", "afile"], ["--fork afile names a file"]),
    ],
)
def test_a_run_directory_that_is_a_file_is_refused_before_start(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    words: list[str],
) -> None:
    """issue 26: `--out FILE` failed on rank 0 with a 15-line traceback (exit 1)."""
    import scaletrain.launch as launch_mod

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    code, err = _train(capsys, *args, "--recipe", "split-net")
    assert code == 2, err
    for word in words:
        assert word in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_run_directory_this_user_cannot_write_is_refused_before_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import scaletrain.launch as launch_mod

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "locked").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p).name != "locked" and real(p, m))
    code, err = _train(capsys, "--out", "locked/run", "--recipe", "split-net")
    assert code == 2 and "locked, where it would be made, is not writable" in err, err
    assert not (tmp_path / "locked" / "run").exists()


@pytest.mark.parametrize(("nproc", "warned"), [(64, True), (4, False)])
def test_far_more_cpu_processes_than_cores_is_warned_once(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nproc: int,
    warned: bool,
) -> None:
    """issue 26: --nproc 64 on 2 cores ran silently for minutes with the learning rate
    scaled to 3.2 (the ConvNet's 0.1 at a global batch of 200, here 64 x 100)."""
    import os

    import scaletrain.launch as launch_mod
    from scaletrain.testing.datasets import write_fake_mnist

    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    data = write_fake_mnist(tmp_path / "data")
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = _train(capsys, "--nproc", str(nproc), "--data-dir", str(data), "--out", "r")
    assert code == 0, err
    if not warned:
        assert err == ""
        return
    assert err.count("\n") == 1 and err.startswith("scaletrain: warning: --nproc 64 starts 64")
    assert "on 2 CPU cores" in err and "learning rate scales" in err and "to 3.2" in err
    assert "Fix: --nproc 2, or set --lr." in err
    code, err = _train(capsys, "--nproc", "64", "--data-dir", str(data), "--out", "r", "--lr", "1")
    assert "learning rate" not in err and err.endswith("Fix: --nproc 2.\n")


def test_argparse_refuses_unknown_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--precision", "fp64"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "fp64" in err and "bf16-mixed" in err


# -- 5. names: the CLI's for commands, the API's for the library ---------------------------


def test_messages_name_flags_on_the_cli_and_fields_in_the_api() -> None:
    with pytest.raises(ConfigError, match=r"^nproc=0: expected"):
        TrainConfig(nproc=0)
    use_cli_names()
    with pytest.raises(ConfigError, match=r"^--nproc 0: expected"):
        TrainConfig(nproc=0)
    assert spell("async_save", False) == "--no-async-save"
    use_cli_names(False)
    assert spell("async_save", False) == "async_save=False"


# -- 6. one config: flags, files, config.json --------------------------------------------


def test_every_setting_has_a_docstring_and_a_flag() -> None:
    docs = field_docs(TrainConfig)
    specs = field_specs(TrainConfig)
    assert [s.name for s in specs] == list(docs)
    parser = cli.build_parser()
    train = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[
        "train"
    ]  # type: ignore[attr-defined]
    flags = {o for a in train._actions for o in a.option_strings}
    for spec in specs:
        assert spec.flag in flags


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("recipe: gpt\nmax_steps: 100\nprecision: bf16-mixed\nsync-bn: true\n")
    ns = cli.build_parser().parse_args(["train", "--config", str(path), "--max-steps", "7"])
    config = cli.train_config(ns)
    assert config.recipe == "gpt" and config.max_steps == 7
    assert config.precision == "bf16-mixed" and config.sync_bn is True
    assert config.lr is None  # neither file nor flag: the default


def test_a_bad_value_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("nproc: 0\n")
    use_cli_names()
    ns = cli.build_parser().parse_args(["train", "--config", str(path)])
    with pytest.raises(ConfigError, match=rf"--nproc 0.*comes from {path}"):
        cli.train_config(ns)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("max_step: 3\n", ["'max_step'", "did you mean 'max_steps'"]),
        ("max_steps: three\n", ["max_steps", "'three'", "integer"]),
        ("precision: fp64\n", ["precision", "'fp64'", "bf16-mixed"]),
        ("- a\n- b\n", ["holds a list", "mapping"]),
        ("recipe: [\n", ["not valid YAML"]),
    ],
)
def test_config_file_errors(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_config_file(path, TrainConfig)
    for word in words:
        assert word in str(info.value)


def test_every_config_file_problem_is_said_in_one_pass(tmp_path: Path) -> None:
    """Issue 26 item 18: a file with four mistakes took four tries (each run named only the
    first), and a value of the wrong type came without a fix."""
    path = tmp_path / "run.yaml"
    path.write_text('max_step: 3\nbatch_size: "64"\nstrategy: fsd\neval_batches: -1\nledger: 3\n')
    use_cli_names()
    ns = cli.build_parser().parse_args(["train", "--config", str(path), "--nproc", "0"])
    with pytest.raises(ConfigError) as info:
        cli.train_config(ns)
    message = str(info.value)
    assert message.startswith("6 problems with the settings:"), message
    for words in (
        "did you mean 'max_steps'",
        "batch_size: '64' is not an integer",
        "Fix: batch_size: 64 (a number, without quotes)",
        "Fix: strategy: fsdp",
        "Fix: ledger: true or ledger: false",
        f"--eval-batches -1: expected a whole number >= 0. Fix: pass e.g. --eval-batches 0. "
        f"(The value comes from {path}.)",
        "--nproc 0: expected a number of processes >= 1",
    ):
        assert words in message, words
    # The flag's own value is not attributed to the file.
    (nproc,) = [line for line in message.splitlines() if "--nproc 0" in line]
    assert "comes from" not in nproc


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [("lr: 1e-2\n", "lr", 0.01), ("clip_grad: 5E-1\n", "clip_grad", 0.5),
     ('{"lr": 2e-3}', "lr", 0.002), ("monitor_interval: +1e0\n", "monitor_interval", 1.0)],
)  # fmt: skip
def test_a_yaml_11_exponent_is_a_number(
    tmp_path: Path, text: str, field: str, value: float
) -> None:
    """Issue 26 item 18: PyYAML reads YAML 1.1, where `lr: 1e-2` (no dot) is the string
    '1e-2', and the file was refused as "not a number"."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    got = read_config_file(path, TrainConfig)[field]
    assert isinstance(got, float) and got == value


def test_a_type_error_in_a_config_file_comes_with_its_fix(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 1e3\nlr: fast\nsave_every: 12.5\n")
    with pytest.raises(ConfigError) as info:
        read_config_file(path, TrainConfig)
    message = str(info.value)
    assert "Fix: max_steps: 1000." in message
    assert "lr: 'fast' is not a number" in message and "Fix: e.g. lr: 0.1." in message
    assert "Fix: a whole number, e.g. save_every: 12." in message


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _train(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read the config file" in err and "nope.yaml" in err


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.iterdir()))
def test_saved_config_files_replay(name: str) -> None:
    """Config files written by earlier versions (a run's config.json, a hand-written
    YAML) still load: renaming or dropping a setting breaks them, on purpose only."""
    values = read_config_file(CONFIGS / name, TrainConfig)
    config = TrainConfig(**values)
    expected = (
        json.loads((CONFIGS / name).with_suffix(".expected").read_text())
        if (CONFIGS / name).with_suffix(".expected").exists()
        else None
    )
    if expected is not None:
        assert {k: getattr(config, k) for k in expected} == expected


def _train_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser("train")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = sub.choices["train"]
    assert isinstance(train, argparse.ArgumentParser)
    return train


def test_train_help_is_in_sections_and_every_setting_in_one() -> None:
    """issue 26: `train --help` listed 42 flags in one block."""
    from scaletrain.train.config import FLAG_GROUPS

    grouped = [name for _, names in FLAG_GROUPS for name in names]
    assert sorted(grouped) == sorted(s.name for s in field_specs(TrainConfig))
    train = _train_parser()
    sections = {g.title: g for g in train._action_groups}
    for title, names in FLAG_GROUPS:
        flags = [o for a in sections[title]._group_actions for o in a.option_strings]
        assert [f for f in flags if not f.startswith("--no-")] == [
            "--" + n.replace("_", "-") for n in names
        ]
    # Only -h and --config are left outside the sections.
    loose = [o for a in sections["options"]._group_actions for o in a.option_strings]
    assert loose == ["-h", "--help", "--config"]


def test_help_texts_say_defaults_and_their_own_placeholder() -> None:
    """issue 26: 18 help texts said "None: ..." (a config file's null, not a flag's
    default) and --max-restarts K said "up to N times"."""
    for parser in (_train_parser(), cli.build_parser("launch")):
        for action in parser._actions:
            text = action.help or ""
            assert "None" not in text, (action.option_strings, text)
            metavar = action.metavar if isinstance(action.metavar, str) else ""
            if re.fullmatch(r"[A-Z]", metavar):
                letters = set(re.findall(r"\b([A-Z])\b", text)) - {"A", "I"}
                assert letters <= {metavar}, (action.option_strings, text)
    help_text = _train_parser().format_help()
    assert "--max-restarts K" in help_text and "up to K times" in help_text


@pytest.mark.parametrize("field", ["overwrite", "fork_optimizer"])
def test_switches_that_are_off_unless_given_have_no_off_form(field: str) -> None:
    """issue 26: --no-overwrite and --no-fork-optimizer did nothing (both are off unless
    given, and a run's config.json records them off)."""
    flag = "--" + field.replace("_", "-")
    flags = {o for a in _train_parser()._actions for o in a.option_strings}
    assert flag in flags and "--no-" + flag[2:] not in flags
    ns = cli.build_parser("train").parse_args(["train", flag])
    assert typed_flags(ns, TrainConfig) == {field: True}
    assert typed_flags(cli.build_parser("train").parse_args(["train"]), TrainConfig) == {}


# -- 7. quick answers ---------------------------------------------------------------------


def test_a_worker_parses_train_flags_without_the_launch_and_job_parsers() -> None:
    # Every worker of a job parses its flags again: it builds only the train parser,
    # which reads them as the whole CLI does.
    code = (
        "import sys\n"
        "from scaletrain import cli\n"
        "words = ['train', '--max-steps', '7', '--nproc', '2']\n"
        "alone = cli.build_parser('train').parse_args(words)\n"
        "print(sorted(m for m in sys.modules if m.startswith('scaletrain.launch')))\n"
        "assert alone == cli.build_parser().parse_args(words)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_check_before_any_process_does_not_import_torchs_compiler(tmp_path: Path) -> None:
    # The launcher builds the model on the meta device to check it before any process
    # starts. nn.Embedding's (and most Hugging Face models') normal_ initialisation,
    # run there, made torch import its compiler: ~1.7 s of every launch, before the
    # first worker started.
    (tmp_path / "embedded.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    net = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8))\n"
        "    nn.init.normal_(net[1].weight, std=0.02)\n"
        "    nn.init.kaiming_normal_(net[1].weight, nonlinearity='relu')\n"
        "    net[1].weight.data.normal_()\n"
        "    return net\n"
        "def datasets(split, data_dir=None):\n"
        "    import torch\n"
        "    return torch.utils.data.TensorDataset(torch.zeros(8, dtype=torch.long))\n"
    )
    code = (
        "import sys\n"
        "from scaletrain import cli\n"
        "from scaletrain.train_command import _preflight, train_config\n"
        "for words in (['--recipe', 'gpt'], ['--model', 'embedded:build']):\n"
        "    ns = cli.build_parser('train').parse_args(['train', '--nproc', '2', *words])\n"
        "    assert _preflight(train_config(ns), 1, None) == (2, 2)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_model_built_to_be_checked_is_the_model_torch_builds_on_meta() -> None:
    """on_meta skips only what sets a meta tensor's values: the structure (names, shapes,
    dtypes, what trains) is what `torch.device("meta")` builds, and a tensor the build
    makes on a real device is initialised as written."""
    import torch
    from torch import nn

    from scaletrain._lazy import on_meta
    from scaletrain.train.models import GPT, GPTConfig

    def build() -> nn.Module:
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
        net.register_buffer("real", torch.empty(3, device="cpu").normal_())
        nn.init.uniform_(net.real, 1.0, 2.0)
        return net

    with torch.device("meta"):
        plain = build()
    with on_meta():
        skipped = build()

    def shapes(net: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype, str, bool]]:
        tensors = [*net.named_parameters(), *net.named_buffers()]
        return [(n, tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for n, t in tensors]

    assert shapes(skipped) == shapes(plain)
    assert all(p.is_meta for p in skipped.parameters())
    assert skipped.real.device.type == "cpu" and bool(
        ((skipped.real >= 1) & (skipped.real <= 2)).all()
    )
    assert torch.empty(1).device.type == "cpu"  # the device is the default again after
    # torch.nn.init's own checks still run there, and what a fill refuses is refused.
    with on_meta(), pytest.raises(ValueError, match="fewer than 2 dimensions"):
        nn.init.kaiming_normal_(torch.empty(3))
    with on_meta(), pytest.raises(RuntimeError, match="std >= 0.0"):
        nn.init.normal_(torch.empty(3), std=-1.0)
    with on_meta(), pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        nn.Parameter(torch.empty(3)).normal_()
    with on_meta(), pytest.raises(NotImplementedError, match="Long"):
        torch.empty(3, dtype=torch.long).normal_()


def test_an_unknown_command_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["tarin"])
    err = capsys.readouterr().err
    for name in ("train", "launch", "job", "checkpoint", "report", "plan", "env"):
        assert name in err


def test_help_and_version_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from scaletrain.cli import build_parser\n"
        "build_parser().format_help()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    version = subprocess.run(
        [sys.executable, "-m", "scaletrain", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("scaletrain ")
