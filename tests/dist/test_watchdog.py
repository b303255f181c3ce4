"""Hang watchdog on real ranks under torchrun: a rank that sleeps inside a step ends the
job within the hang timeout plus a few seconds, named, with every rank's stack and the
collective trace on disk; a healthy run is left alone and its watchdog stops.

Each job runs ONCE (module-scoped fixtures) and the tests assert on what it left.
torchrun rather than run_ranks: the workers end with os._exit, and it is torchrun's
reaction to that (end the job, report exit code 86) that users see.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from scaletrain.observe import EXIT_HANG

pytestmark = pytest.mark.timeout(120)

HANG_TIMEOUT_S = 3.0
SLEEP_STEP = 5

_SCRIPT = textwrap.dedent(
    '''
    """Every step: beat, then an all_reduce. Rank 1 sleeps in step SLEEP_STEP (hang mode)."""
    import json, os, sys, threading, time

    import torch
    import torch.distributed as dist

    import scaletrain as st
    from scaletrain.observe import Watchdog, configure_flight_recorder

    mode, run_dir, backend, timeout_s, sleep_step = (
        sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
    )
    configure_flight_recorder(run_dir)  # before the process group exists


    def _user_step_that_hangs(rank):
        with open(os.path.join(run_dir, "sleep_started"), "w") as f:
            f.write(repr(time.time()))
        time.sleep(60)


    def main():
        rt = st.init(strategy="ddp", backend=backend)
        x = torch.ones(1, device=rt.device)
        with Watchdog(rt.topology, timeout_s=timeout_s, run_dir=run_dir) as wd:
            steps = 1000 if mode == "hang" else 40
            for step in range(1, steps + 1):
                wd.beat(step, "forward")
                if mode == "hang" and rt.rank == 1 and step == sleep_step:
                    _user_step_that_hangs(rt.rank)
                dist.all_reduce(x)
                x.fill_(1.0).sum().item()  # NCCL is asynchronous: wait like loss.item()
                time.sleep(0.1 if mode == "healthy" else 0.01)
        # Healthy run only from here: 40 x 0.1 s outlasts the timeout.
        rt.barrier()
        store = dist.PrefixStore(
            "scaletrain/watchdog/attempt0",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False),
        )
        result = {
            "running": wd.running,
            "report": wd.report is not None,
            "threads": sorted(t.name for t in threading.enumerate()),
            "final": [json.loads(store.get(f"hb/{r}")) for r in range(rt.world_size)],
        }
        with open(os.path.join(run_dir, f"result{rt.rank}.json"), "w") as f:
            json.dump(result, f)
        rt.shutdown()


    main()
    '''
)


@dataclass
class Job:
    run_dir: Path
    returncode: int
    output: str
    ended: float
    wall_s: float


def _torchrun(work: Path, mode: str, backend: str = "gloo") -> Job:
    work.mkdir(parents=True, exist_ok=True)
    script = work / "job.py"
    script.write_text(_SCRIPT)
    run_dir = work / "run"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC", "PET_", "TORCH_FR_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(work))
    started = time.time()
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(script),
            mode, str(run_dir), backend, str(HANG_TIMEOUT_S), str(SLEEP_STEP),
        ],
        cwd=work, env=env, capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    ended = time.time()
    return Job(run_dir, done.returncode, done.stdout + done.stderr, ended, ended - started)


@pytest.fixture(scope="module")
def hang_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _torchrun(tmp_path_factory.mktemp("hang"), "hang")


@pytest.fixture(scope="module")
def healthy_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _torchrun(tmp_path_factory.mktemp("healthy"), "healthy")


def test_hang_ends_the_job_soon_with_the_hang_exit_code(hang_job: Job) -> None:
    out = hang_job.output
    assert hang_job.returncode != 0, out
    # torchrun's failure summary carries each worker's exit code.
    assert re.search(rf"exitcode\s*:\s*{EXIT_HANG}\b", out), out
    slept_at = float((hang_job.run_dir / "sleep_started").read_text())
    # Measured ~6.5 s on 2 loaded cores: 3 s timeout + 0.3 s poll + ~3 s for both
    # ranks' first flight-recorder dump (symbolizing the recorded frames).
    after = hang_job.ended - slept_at
    assert after < HANG_TIMEOUT_S + 12, f"job ended {after:.1f} s after the hang\n{out}"
    print(f"job ended {after:.1f} s after rank 1 fell asleep; total {hang_job.wall_s:.1f} s")


def test_one_paragraph_names_rank_1_and_where_each_rank_was(hang_job: Job) -> None:
    out = hang_job.output
    lines = [line for line in out.splitlines() if "hang detected" in line]
    assert len(lines) == 1, out
    (msg,) = lines
    assert msg.startswith(f"scaletrain: hang detected after {HANG_TIMEOUT_S:g} s")
    assert f"rank(s) [1] did not arrive at step {SLEEP_STEP}" in msg, msg
    assert f"rank(s) [0] waited in step {SLEEP_STEP}" in msg, msg
    assert "in _user_step_that_hangs" in msg and "inside all_reduce" in msg, msg
    # Both beat at the start of the step: the collective counts tell them apart.
    assert "fewer collectives issued" in msg, msg
    run = hang_job.run_dir
    assert str(run / "hang" / "rank*.txt") in msg
    assert str(run / "flight_recorder") in msg
    assert (run / "hang" / "report.txt").read_text().strip() == msg


def test_every_rank_wrote_its_python_stack(hang_job: Job) -> None:
    hang = hang_job.run_dir / "hang"
    rank0 = (hang / "rank0.txt").read_text()
    rank1 = (hang / "rank1.txt").read_text()
    assert rank0.startswith("scaletrain hang watchdog: rank 0 of 2")
    # Rank 0 waits in the all_reduce; rank 1 sleeps in the user's function.
    assert "dist.all_reduce(x)" in rank0 and "_user_step_that_hangs" not in rank0
    assert "in _user_step_that_hangs" in rank1 and "time.sleep(60)" in rank1
    beats = json.loads((hang / "heartbeats.json").read_text())
    assert beats["0"]["step"] == beats["1"]["step"] == SLEEP_STEP
    # Rank 0 entered one more collective (the all_reduce of step 5) than rank 1.
    assert beats["0"]["seq"] - beats["1"]["seq"] == 1
    assert (beats["0"]["collective"], beats["1"]["collective"]) == ("all_reduce", "")


def test_flight_recorder_trace_shows_the_collective_rank_1_never_issued(hang_job: Job) -> None:
    traces = {}
    for r in range(2):
        with open(hang_job.run_dir / "flight_recorder" / f"rank_{r}", "rb") as f:
            traces[r] = pickle.load(f)  # written by torch's own recorder
    names = {e["profiling_name"] for t in traces.values() for e in t["entries"]}
    assert names == {"gloo:all_reduce"}
    last = {r: max(e["collective_seq_id"] for e in t["entries"]) for r, t in traces.items()}
    assert last[0] - last[1] == 1 and last[0] >= SLEEP_STEP


def test_healthy_run_finishes_and_the_watchdog_stops(healthy_job: Job) -> None:
    assert healthy_job.returncode == 0, healthy_job.output
    assert "hang detected" not in healthy_job.output
    assert not (healthy_job.run_dir / "hang").exists()
    for r in range(2):
        result = json.loads((healthy_job.run_dir / f"result{r}.json").read_text())
        assert result["running"] is False and result["report"] is False
        assert "scaletrain-watchdog" not in result["threads"]
        # Both ranks told the store they finished (what a later hang on a peer reports).
        assert [(b["rank"], b["step"], b["stopped"]) for b in result["final"]] == [
            (0, 40, True),
            (1, 40, True),
        ]
    print(f"healthy job: {healthy_job.wall_s:.1f} s")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for 2 NCCL ranks")
def test_hang_on_nccl_dumps_the_nccl_flight_recorder(tmp_path: Path) -> None:
    job = _torchrun(tmp_path, "hang", backend="nccl")
    assert re.search(rf"exitcode\s*:\s*{EXIT_HANG}\b", job.output), job.output
    assert f"rank(s) [1] did not arrive at step {SLEEP_STEP}" in job.output, job.output
    for r in range(2):
        assert (job.run_dir / "hang" / f"rank{r}.txt").exists()
        assert (job.run_dir / "flight_recorder" / f"rank_{r}").exists()
    assert "fr_trace" in job.output  # NCCL traces: the analyzer is suggested


def _hang_without_torchrun(run_dir: str) -> None:
    """A rank of run_ranks: rank 0's process hosts the store (as under srun or mpirun)."""
    import torch.distributed as dist

    import scaletrain as st
    from scaletrain.observe import Watchdog

    rt = st.init(strategy="ddp")
    x = torch.ones(1)
    with Watchdog(rt.topology, timeout_s=HANG_TIMEOUT_S, run_dir=run_dir) as wd:
        for step in range(1, 1000):
            wd.beat(step, "forward")
            if rt.rank == 1 and step == SLEEP_STEP:
                time.sleep(60)
            dist.all_reduce(x)
            time.sleep(0.01)


def test_hang_without_torchrun_ends_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from scaletrain.testing import RankFailure, run_ranks

    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_hang_without_torchrun, 2, str(tmp_path), timeout=60)
    elapsed = time.monotonic() - started
    story = str(failure.value)
    assert story.count(f"process died with exit code {EXIT_HANG}") == 2, story
    err = capfd.readouterr().err
    # One paragraph, although the reporter's exit takes the store down with it.
    assert err.count("hang detected") == 1, err
    assert f"rank(s) [1] did not arrive at step {SLEEP_STEP}" in err, err
    assert (tmp_path / "hang" / "rank1.txt").exists()
    assert elapsed < 40, f"{elapsed:.1f} s"
