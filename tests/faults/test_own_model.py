"""Your own model through `scaletrain train --model MODULE:NAME`: everything a recipe gets.

A module the test writes (a small MLP with BatchNorm, its data, an lr) trains at 2
processes under DDP and FSDP: under FSDP, SIGTERM saves and exits 75 and the next start
resumes to the same losses and weights as a straight run; under DDP, the run extends,
forks, and `scaletrain report` and `plan --check` read it. Real `scaletrain train` commands, as a user runs
them: the one the test signals in a process of its own, the others (their ranks
processes all the same) in this one (tests/inprocess.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.testing import launcher_free_env
from tests.cpu_hardware import cpu_hardware_file
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

EXIT_PREEMPTED = 75

MODULE = '''
"""A user's model and data: nothing of scaletrain in it."""
import os
import time

import torch
from torch import nn

lr = 0.05
batch_size = 16

# Set by the test for the run it signals, so the run is still going when it arrives.
_STEP_S = float(os.environ.get("USERMOD_STEP_S", "0"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        if _STEP_S and self.training:
            time.sleep(_STEP_S)
        return self.head(self.body(x))


def build() -> nn.Module:
    return Net()


def datasets(split, data_dir=None):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randn(1280 if split == "train" else 64, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].argmax(dim=1))
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's project directory, holding their module; commands run from here."""
    root = tmp_path_factory.mktemp("project")
    (root / "usermod.py").write_text(MODULE)
    return root


_ARGS = [
    "train", "--model", "usermod:build", "--nproc", "2", "--epochs", "1", "--log-every", "1",
    "--save-every", "10", "--hang-timeout", "60",
]  # fmt: skip
"""The command's flags but --out and the test's own."""


def _train(
    project: Path, out: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The command in a process of its own: for the run the test signals."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *_ARGS, "--out", out, *extra],
        cwd=project,
        env={**launcher_free_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _done(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _here(project: Path, out: str, *extra: str) -> tuple[int, str]:
    """The command with its launcher in this process (tests/inprocess.py): its ranks are
    processes all the same, but not the launcher's import of torch."""
    args = [*_ARGS, "--out", out, *extra]
    done = run_cli(*args, cwd=project)
    return done.returncode, done.stdout + done.stderr


def _run(project: Path, out: str, *extra: str) -> str:
    code, log = _here(project, out, *extra)
    assert code == 0, log
    return log


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def _same_model(a: Path, b: Path) -> None:
    wa = torch.load(a / "model.pt", weights_only=True)
    wb = torch.load(b / "model.pt", weights_only=True)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_your_model_stops_on_sigterm_and_resumes_bitwise(project: Path) -> None:
    # Under FSDP: each rank saves its own shard and BatchNorm statistics. A DDP run of
    # the same model resumes in test_your_model_extends_forks_and_is_reported_and_checked,
    # and SIGTERM's save and exit 75 under DDP are test_resume_and_faults.py's.
    strategy = "fsdp"
    straight, run = f"straight-{strategy}", f"run-{strategy}"
    log = _run(project, straight, "--strategy", strategy)
    assert "model usermod:build on usermod:datasets (1,280 train / 64 test" in log, log
    assert "lr 0.05" in log and "batch 16/replica x 2" in log
    proc = _train(project, run, "--strategy", strategy, env={"USERMOD_STEP_S": "0.05"})
    manifest = project / run / "checkpoints" / "step-000010" / "manifest.json"
    deadline = time.monotonic() + 180
    while not manifest.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manifest.is_file(), _done(proc)[1]
    for rank in (0, 1):
        os.kill(int((project / run / "pids" / f"rank{rank}.pid").read_text()), signal.SIGTERM)
    code, log = _done(proc)
    assert code == EXIT_PREEMPTED, log
    assert "signal SIGTERM" in log
    log = _run(project, run, "--strategy", strategy)
    assert "resumed from" in log
    assert _losses(project / run) == _losses(project / straight)
    _same_model(project / run, project / straight)


def test_your_model_extends_forks_and_is_reported_and_checked(project: Path) -> None:
    run = project / "life"
    _run(project, "life", "--max-steps", "20")
    log = _run(project, "life", "--max-steps", "30")
    assert "resumed at step 20, extending to 30" in log
    # Settings that change what the run means are refused for a model as for a recipe,
    # the model itself among them.
    code, log = _here(project, "life", "--max-steps", "40", "--batch-size", "8")
    assert code == 2 and "would change what the run means" in log, log
    log = _run(project, "life", "--fork", "forked", "--max-steps", "5", "--lr", "0.01")
    assert "forked from" in log
    forked = json.loads((project / "forked" / "config.json").read_text())
    assert forked["model"] == "usermod:build" and forked["run"]["forked_from"]["step"] == 30
    # The commands that read the run, in this process (tests/inprocess.py).
    report = run_cli("report", str(run), cwd=project)
    assert report.returncode == 0, report.stdout + report.stderr
    assert (run / "report.html").is_file()
    hardware = str(cpu_hardware_file(project / "cpu.toml"))
    check = run_cli("plan", "--check", str(run), "--hardware", hardware, cwd=project)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "check: ddp" in check.stdout and "step time" in check.stdout
    # From another directory: the model is the one the run named, found where the run
    # was started ("usermod:build" was refused there: "no module 'usermod'").
    elsewhere = run_cli("plan", "--check", str(run), "--hardware", hardware, cwd=project.parent)
    assert elsewhere.returncode == 0, elsewhere.stdout + elsewhere.stderr
    # Export writes Hugging Face directories; a plain nn.Module is pointed to consolidate.
    export = run_cli("checkpoint", "export", str(run), "hf", cwd=project)
    assert export.returncode == 2, export.stdout + export.stderr
    assert "not a transformers PreTrainedModel" in export.stderr and "consolidate" in export.stderr
    assert not (project / "hf").exists()


def test_a_model_module_that_breaks_the_protocol_is_refused_before_any_process(
    project: Path, tmp_path: Path
) -> None:
    (project / "badmod.py").write_text(
        "import torch\n"
        "def build(width):\n    return torch.nn.Linear(width, 2)\n"
        "def not_a_model():\n    return 3\n"
        "def datasets(split):\n    return None\n"
    )
    (project / "badimport.py").write_text("import torch\nimport no_such_pkg_xyz\n")
    cases = {
        "badmod:nope": "badmod has no 'nope'. Its functions and classes: build, datasets",
        "badmod:build": "its factory takes arguments (width)",
        "badmod:not_a_model": "the factory returned an int; expected a torch.nn.Module",
        "nosuchmod:build": "no module 'nosuchmod' on the Python path",
        "badimport:build": "importing badimport raised ModuleNotFoundError: No module named "
        "'no_such_pkg_xyz'",
    }
    # That a file path works as well as a module name, the docs' own commands show
    # (test_the_docs_own_model_runs_as_written: mymodel.py:build at 2 processes).
    for spec, said in cases.items():
        proc = run_cli(
            "train", "--model", spec, "--nproc", "2", "--max-steps", "2",
            "--out", str(tmp_path / spec.replace(":", "-")), "--hang-timeout", "0",
            cwd=project,
        )  # fmt: skip
        assert proc.returncode == 2, (spec, proc.stdout + proc.stderr)
        assert said in proc.stderr and "rank" not in proc.stderr, (spec, proc.stderr)
        assert not (tmp_path / spec.replace(":", "-")).exists()


def test_the_docs_own_model_runs_as_written(tmp_path: Path) -> None:
    from tests.docblocks import commands, example

    (tmp_path / "mymodel.py").write_text(example("own-model-module"))
    logs = []
    for words in commands("own-model-commands"):
        assert words[:2] == ["scaletrain", "train"], words
        done = run_cli(*words[1:], cwd=tmp_path)
        assert done.returncode == 0, (words, done.stdout + done.stderr)
        logs.append(done.stdout)
    assert "model mymodel:build on mymodel:datasets" in logs[0]
    assert "lr 0.01" in logs[0] and "batch 64/replica" in logs[0]
    assert "extending to" in logs[1]
    # A file path names the module as well as a dotted name, in the launcher and in
    # each of the processes it starts.
    assert "model mymodel.py:build" in logs[2] and "2 processes" in logs[2], logs[2]
    assert "strategy fsdp" in logs[2]


def test_samples_longer_than_the_models_position_table_are_refused_before_the_first_step(
    project: Path, tmp_path: Path
) -> None:
    """A GPT-2-shaped model (a learned position table of 8 rows) on data of 16-token
    samples: one line in the words of --model, not an IndexError traceback from each rank
    (on a GPU, a device-side assert)."""
    (project / "posmod.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.wte, self.wpe = nn.Embedding(20, 8), nn.Embedding(8, 8)\n"
        "        self.head = nn.Linear(8, 20)\n\n"
        "    def forward(self, x):\n"
        "        return self.head(self.wte(x) + self.wpe(torch.arange(x.shape[1])))\n\n"
        "def build():\n    return Net()\n\n"
        "def datasets(split):\n"
        "    x = torch.randint(0, 20, (32, 16))\n"
        "    return torch.utils.data.TensorDataset(x, x)\n\n"
        "def loss(out, y):\n"
        "    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())\n"
    )
    out = tmp_path / "run"
    proc = run_cli(
        "train", "--model", "posmod:build", "--nproc", "1", "--max-steps", "2",
        "--batch-size", "4", "--out", str(out), "--hang-timeout", "0", cwd=project,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert said.count("its position table wpe has 8 rows") == 1, said
    assert "--model posmod:build" in said and "Traceback" not in said, said
    assert "IndexError" in said  # what the first step would have raised, named
