"""The documentation's Python runs as written: every strategy's script the way its first
line says (`scaletrain launch --nproc-per-node N script.py` or `python script.py`), and
each fragment of a loop in one process, with the names it leaves to the reader (a model,
an optimizer, a dataset) filled in around it. The blocks are read from the pages."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.docblocks import example
from tests.launcher.conftest import Proc

# Each script ends with rt.print(f"last loss ...") on rank 0.
SCRIPTS = [
    "train-ddp",
    "train-fsdp",
    "train-tensor",
    "train-pipeline",
    "train-dp",
    "train-model-parallel",
    "train-ddp-mp",
    "train-fsdp-tp",
    "train-ddp-pp",
    "train-syncbn",
]
RUN_LINE = re.compile(r"# (?P<file>\w+\.py) -- run: (?P<command>.*?)(?:\s{2,}\(.*\))?")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_strategy_script_runs_as_its_first_line_says(
    name: str, tmp_path: Path, start: Callable[..., Proc]
) -> None:
    script = example(name)
    match = RUN_LINE.fullmatch(script.splitlines()[0])
    assert match is not None, f"{name}'s first line is not '# FILE.py -- run: COMMAND'"
    assert match["file"] == name.replace("-", "_") + ".py"
    (tmp_path / match["file"]).write_text(script)
    words = shlex.split(match["command"])
    assert words[0] in ("scaletrain", "python") and words[-1] == match["file"], words
    args = ["-m", "scaletrain", *words[1:]] if words[0] == "scaletrain" else words[1:]
    done = start(*args).wait(timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^last loss \d+\.\d+", done.stdout, re.M), done.stdout + done.stderr


# What each fragment leaves to the reader, and what it must have done after.
_DATA = """
import torch
from torch.utils.data import TensorDataset

import scaletrain as st

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_set = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loss_fn = torch.nn.functional.cross_entropy
"""
_SET_UP = (
    _DATA
    + """
rt = st.init(strategy="ddp")
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(train_set, batch_size=32, seed=0)
"""
)
FRAGMENTS = {
    "index-lines": (
        _DATA + "dataset = train_set\n",
        "assert len(loader) == 3 and rt.world_size == 1\nrt.shutdown()\n",
    ),
    "five-lines": (
        _DATA + "epochs = 2\n",
        "assert last.dim() == 0 and torch.isfinite(last) and last.item() < 1.0, last\n",
    ),
    "precision": (
        _DATA,
        "assert micro.sync and rt.precision.name == 'bf16-mixed'\n"
        "assert all(p.dtype == torch.float32 for p in model.parameters())\nrt.shutdown()\n",
    ),
    "save-load": (
        _SET_UP,
        "assert values['step'] == 100, values\nrt.shutdown()\n",
    ),
    "checkpoint-manager": (
        _SET_UP + "rt.save('runs/x/checkpoints/step-000005', model=model, optimizer=optimizer, "
        "loader=loader, step=5)\n",
        "assert step == 5\nrt.shutdown()\n",
    ),
    "tracker": (
        "import torch\nimport scaletrain as st\nlr, steps = 0.1, 40\n"
        "def train_step():\n    return torch.tensor(1.0)\n",
        "import json, pathlib\n"
        "assert json.loads(pathlib.Path('runs/mine/mlflow.json').read_text())\n",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_a_fragment_runs_with_its_names_filled_in(
    name: str, tmp_path: Path, start: Callable[..., Proc]
) -> None:
    before, after = FRAGMENTS[name]
    program = before + "\n# -- the docs' block --\n" + example(name) + "\n# -- checks --\n" + after
    done = start("-c", program).wait(timeout=240)
    assert done.returncode == 0, program + "\n" + done.stdout + done.stderr


def test_the_readme_shows_the_docs_five_lines() -> None:
    assert example("readme-five-lines") == example("five-lines")
