"""A job file's run survives what its platform does to it: a SageMaker job restarted
after a spot interruption resumes from the checkpoints SageMaker synced to S3.

The host is emulated as tests/cluster/platforms.py does (the variables and command of
SageMaker's toolkit); the folder SageMaker syncs with S3 is a temporary one kept across
the restart, and SM_MODEL_DIR is a fresh empty folder each time, as on a new instance.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.errors import use_cli_names
from scaletrain.testing import free_port, launcher_free_env, write_fake_mnist
from tests.cluster.platforms import sagemaker_hosts

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def test_a_restarted_sagemaker_spot_job_resumes(tmp_path: Path) -> None:
    """Issue 26 item 19: with --checkpoint-s3 the run lived in SM_MODEL_DIR, which is
    uploaded only when the job ends; the synced folder stayed empty, and a restarted
    job started over from step 0."""
    data = write_fake_mnist(tmp_path / "data", n_train=600, n_test=100, seed=1, gz=False)
    try:
        code = main([
            "job", "sagemaker", "--instance-type", "ml.c5.xlarge", "--name", "mnist",
            "--role", "arn:aws:iam::123456789012:role/R", "--image", "i",
            "--code", "s3://bucket/c.tar.gz", "--output-s3", "s3://bucket/o",
            "--checkpoint-s3", "s3://bucket/ckpt", "--spot", "--strategy", "single",
            "--data-dir", str(data), "--max-steps", "6", "--save-every", "2",
            "--stop-after", "4", "--eval-batches", "0", "-o", str(tmp_path / "job"),
        ])  # fmt: skip
    finally:
        use_cli_names(False)
    assert code == 0
    job = json.loads((tmp_path / "job" / "training-job.json").read_text())
    model_dir, synced = tmp_path / "opt-ml-model", tmp_path / "opt-ml-checkpoints"
    (host,) = sagemaker_hosts(job, model_dir=str(model_dir))
    env = {**launcher_free_env(), **host.env, "MASTER_PORT": str(free_port())}
    # The one path that differs from SageMaker's: the synced folder, LocalPath there.
    assert env["SCALETRAIN_SAGEMAKER_CHECKPOINTS"] == job["CheckpointConfig"]["LocalPath"]
    env["SCALETRAIN_SAGEMAKER_CHECKPOINTS"] = str(synced)
    args = host.command[host.command.index("scaletrain_entry.py") + 1 :]
    outputs = []
    for _ in range(2):  # the first start, stopped at step 4; then the restarted job
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir()
        done = subprocess.run(
            [sys.executable, "scaletrain_entry.py", *args], cwd=tmp_path / "job" / "code",
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(done.stdout)
    assert "stopped at step 4/6" in outputs[0]
    run = synced / "algo-1"
    resumed = [line for line in outputs[1].splitlines() if "resumed" in line]
    assert resumed and str(run / "checkpoints" / "step-000004") in resumed[0], outputs[1]
    assert (run / "model.pt").is_file()
    # The finished run reaches the job's output, its checkpoints only the synced folder.
    assert (model_dir / "model.pt").is_file() and (model_dir / "metrics.jsonl").is_file()
    assert not (model_dir / "checkpoints").exists()
