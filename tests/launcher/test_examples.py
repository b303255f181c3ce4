"""The examples run: each seed's raw-PyTorch script and its scaletrain twin."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.testing import launcher_free_env

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=launcher_free_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_model_parallel_pair_learns_the_same() -> None:
    raw = _run("examples/model_parallel_raw.py")
    twin = _run("examples/model_parallel_scaletrain.py")
    loss = re.compile(r"final loss ([0-9.]+)")
    # Same seed, same model, same data: the device map changes nothing on one device.
    assert loss.search(raw).group(1) == loss.search(twin).group(1)  # type: ignore[union-attr]


@pytest.mark.skipif(not FMNIST.exists(), reason="needs Debian's dataset-fashion-mnist")
@pytest.mark.parametrize("script", ["examples/ddp_raw.py", "examples/ddp_scaletrain.py"])
def test_ddp_pair_runs_under_the_launcher(script: str) -> None:
    out = _run("-m", "scaletrain", "launch", "--nproc-per-node", "2", script, "--max-steps", "5")
    assert "train samples/s" in out
