"""Job files written by `scaletrain job`, run as the platforms run them.

Kubeflow's pods and SageMaker's hosts are namespace hosts named like them, given the
variables and the command the training operator and the SageMaker toolkit would
(tests/cluster/platforms.py, from their sources). They must form ONE job of the
size the file asks for.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.cluster.conftest import SCALETRAIN, Procs, job_env
from tests.cluster.netns import Host
from tests.cluster.platforms import kubeflow_pods, sagemaker_hosts
from tests.docblocks import commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN_FLAGS = ["--recipe", "split-net", "--max-steps", "5", "--eval-batches", "1"]


def _job(tmp_path: Path, *args: str) -> None:
    got = subprocess.run([SCALETRAIN, "job", *args, *TRAIN_FLAGS], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert got.returncode == 0, got.stderr


def test_elastic_pytorchjob_pods_form_one_job(
    hosts_named: Callable[..., list[Host]], procs: Procs, tmp_path: Path
) -> None:
    # Issue 10 (3): an elastic PyTorchJob's pods (PET_RDZV_ENDPOINT, PET_NNODES=1:2, ...)
    # were read as "local": each pod trained alone.
    _job(tmp_path, "pytorchjob", "--nnodes", "1:2", "--nproc", "2", "--image", "unused",
         "--name", "mnist", "-o", "job.yaml")  # fmt: skip
    manifest = yaml.safe_load((tmp_path / "job.yaml").read_text())
    pods = kubeflow_pods(manifest)
    assert [p.name for p in pods] == ["mnist-worker-0", "mnist-worker-1"]
    hosts = hosts_named(*(p.name for p in pods))
    # The container's `python` is this test's: the job environment puts it first on PATH.
    started = [procs.start(h, p.command, p.env) for h, p in zip(hosts, pods, strict=True)]
    for proc in started:
        code, out = procs.wait(proc, timeout=180)
        assert code == 0, out
    run = tmp_path / "runs" / "split-net-mnist"  # named after the job, the same in every pod
    config = json.loads((run / "config.json").read_text())
    assert config["run"]["world_size"] == 4 and config["run"]["nodes"] == 2


def test_master_worker_pytorchjob_pods_form_one_job(
    hosts_named: Callable[..., list[Host]], procs: Procs, tmp_path: Path
) -> None:
    # The docs' Kubeflow example (kubectl apply replaced by what the operator does).
    write, _ = commands("kubeflow")
    got = subprocess.run(write, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=job_env())  # fmt: skip
    assert got.returncode == 0, got.stderr
    manifest = yaml.safe_load((tmp_path / write[write.index("-o") + 1]).read_text())
    pods = kubeflow_pods(manifest)
    assert [p.name for p in pods] == ["mnist-master-0", "mnist-worker-0"]
    hosts = hosts_named(*(p.name for p in pods))
    started = [procs.start(h, p.command, p.env) for h, p in zip(hosts, pods, strict=True)]
    for proc in started:
        code, out = procs.wait(proc, timeout=180)
        assert code == 0, out
    config = json.loads((tmp_path / "runs" / "split-net-mnist" / "config.json").read_text())
    assert config["run"]["world_size"] == 4 and config["run"]["nodes"] == 2


def test_sagemaker_hosts_form_one_job_and_write_the_model_dir(
    hosts_named: Callable[..., list[Host]], procs: Procs, tmp_path: Path
) -> None:
    # The docs' SageMaker example (the upload and create-training-job replaced by what
    # SageMaker and its toolkit do). Issue 10 (4): SM_MODEL_DIR, what SageMaker
    # uploads, was ignored.
    write = commands("sagemaker")[0]
    got = subprocess.run(write, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=job_env())  # fmt: skip
    assert got.returncode == 0, got.stderr
    folder = tmp_path / write[write.index("-o") + 1]
    definition = json.loads((folder / "training-job.json").read_text())
    model_dir = tmp_path / "opt-ml-model"  # the same path on every host, a disk of its own
    model_dir.mkdir()
    nodes = sagemaker_hosts(definition, model_dir=str(model_dir))
    hosts = hosts_named(*(n.name for n in nodes))
    disks = {}
    started = []
    for host, node in zip(hosts, nodes, strict=True):
        disks[node.name] = tmp_path / f"disk-{node.name}"
        disks[node.name].mkdir()
        started.append(procs.start(
            host, node.command, node.env, binds=[(disks[node.name], model_dir)],
            cwd=folder / "code",
        ))  # fmt: skip
    for proc in started:
        code, out = procs.wait(proc, timeout=180)
        assert code == 0, out
    first = disks["algo-1"]  # rank 0's host
    assert (first / "model.pt").is_file() and (first / "metrics.jsonl").is_file()
    config = json.loads((first / "config.json").read_text())
    assert config["run"]["world_size"] == 2 and config["out"] == str(model_dir)
