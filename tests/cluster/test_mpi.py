"""scaletrain under real MPI launchers on one host: Open MPI 4.1's mpirun, MPICH 4.0's mpiexec."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import Procs
from tests.docblocks import commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# What a root test process needs that a user does not: Open MPI refuses root, and more
# ranks than cores, unless told; two jobs binding ranks to the same cores would crawl.
AS_ROOT = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_hwloc_base_binding_policy": "none",
}


def _need(tool: str, version_says: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (make setup installs openmpi-bin and mpich)")
    got = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30)
    if version_says not in got.stdout + got.stderr:
        pytest.skip(f"{tool} here is not {version_says}")


def world_size(run: Path) -> int:
    return int(json.loads((run / "config.json").read_text())["run"]["world_size"])


def test_two_mpirun_jobs_on_one_host(procs: Procs, tmp_path: Path) -> None:
    # The docs' mpirun example, twice at once. Issue 10 (6): both jobs took torch's
    # port 29500; each now takes one derived from its mpirun's job id. Issue 26 (21):
    # mpirun gives each rank a pseudo-terminal, and the live bar's escape codes filled
    # the output that mpirun wrote to a pipe.
    openmpi, _ = commands("mpi")
    _need(openmpi[0], "Open MPI")
    jobs = [procs.start(None, [*openmpi, "--out", f"run{i}"], AS_ROOT) for i in (1, 2)]
    for job in jobs:
        code, out = procs.wait(job, timeout=180)
        assert code == 0, out
        assert "\x1b[" not in out and "step 50/50" in out, out
    assert world_size(tmp_path / "run1") == world_size(tmp_path / "run2") == 2


def test_mpich_ranks_train_as_one_job(procs: Procs, tmp_path: Path) -> None:
    # The docs' MPICH example.
    _, mpich = commands("mpi")
    _need(mpich[0], "HYDRA")
    code, out = procs.wait(procs.start(None, mpich), timeout=180)
    assert code == 0, out
    runs = sorted((tmp_path / "runs").glob("split-net-*"))  # no job id: rank 0's stamp
    assert len(runs) == 1 and world_size(runs[0]) == 2
