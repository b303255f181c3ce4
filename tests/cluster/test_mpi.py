"""scaletrain under real MPI launchers on one host: Open MPI 4.1's mpirun, MPICH 4.0's mpiexec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cluster.conftest import SCALETRAIN, Procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = [SCALETRAIN, "train", "--recipe", "split-net", "--max-steps", "5", "--eval-batches", "1"]
# Open MPI refuses root and more ranks than cores unless told.
OPENMPI = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (make setup installs openmpi-bin and mpich)")


def world_size(run: Path) -> int:
    return int(json.loads((run / "config.json").read_text())["run"]["world_size"])


def test_two_mpirun_jobs_on_one_host(procs: Procs, tmp_path: Path) -> None:
    # Issue 10 (6): both jobs took torch's port 29500; the port now comes from each
    # mpirun's job id, as Slurm's comes from SLURM_JOB_ID.
    _need("mpirun.openmpi")
    jobs = [procs.start(None, [*OPENMPI, "-np", "2", *TRAIN, "--out", f"run{i}"]) for i in (1, 2)]
    for job in jobs:
        code, out = procs.wait(job, timeout=180)
        assert code == 0, out
    assert world_size(tmp_path / "run1") == world_size(tmp_path / "run2") == 2


def test_mpich_ranks_train_as_one_job(procs: Procs, tmp_path: Path) -> None:
    _need("mpiexec.mpich")
    code, out = procs.wait(
        procs.start(None, ["mpiexec.mpich", "-n", "2", *TRAIN, "--out", "run"]), timeout=180
    )
    assert code == 0, out
    assert world_size(tmp_path / "run") == 2
