"""Job files round trip: what a writer asks for is what the matching env reader reads back.

Each file is turned into the variables the platform gives every process
(tests/cluster/platforms.py, from the platforms' sources), read with scaletrain's
reader, and planned with scaletrain's launcher: the job must come out as the
size and shape it was written for, running the same training settings.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from scaletrain.cli import build_parser, main, train_config
from scaletrain.env import detect
from scaletrain.launch import LaunchConfig
from scaletrain.launch.jobs import (
    PyTorchJobOptions,
    SageMakerOptions,
    SbatchOptions,
    job_spec,
    pytorchjob_manifest,
    training_job,
    write_sbatch,
)
from scaletrain.launch.jobs.sagemaker import ENTRY_SOURCE
from scaletrain.launch.plan import make_plan
from scaletrain.launch.training import default_out, place
from scaletrain.train import TrainConfig
from tests.cluster.platforms import kubeflow_pods, sagemaker_hosts, slurm_tasks

SETTINGS = TrainConfig(recipe="split-net", max_steps=100, lr=0.05, async_save=True, save_every=20)


def parsed_train(words: Sequence[str]) -> TrainConfig:
    """The TrainConfig `scaletrain train WORDS` builds."""
    ns = build_parser().parse_args(["train", *words])
    return train_config(ns)


def train_words(command: Sequence[str]) -> list[str]:
    return list(command[command.index("train") + 1 :])


def flag(argv: Sequence[str], name: str) -> str:
    return argv[list(argv).index(name) + 1]


# --- sbatch ---------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", ["2", "1-3"])
def test_sbatch_tasks_read_back_as_one_job_of_the_right_size(nodes: str) -> None:
    spec = job_spec(SETTINGS, nnodes=nodes.replace("-", ":"), name=None, gpus_per_node=4)
    script = write_sbatch(spec, SbatchOptions(time="1:00:00"))
    assert f"#SBATCH --nodes={nodes}" in script and "#SBATCH --gpus-per-node=4" in script
    assert "#SBATCH --signal=USR1@90" in script and "#SBATCH --requeue" in script
    assert 'if [ "$code" -eq 75 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    tasks = slurm_tasks(script)
    envs = [detect(t.env) for t in tasks]
    count = int(nodes.split("-")[-1])
    assert sorted(e.rank for e in envs) == list(range(count * 4))
    assert {(e.world_size, e.num_nodes, e.local_world_size) for e in envs} == {
        (count * 4, count, 4)
    }
    assert {e.master_addr for e in envs} == {"node1"} and {e.job_id for e in envs} == {"4242"}
    # Each task is a rank (no launcher in between), trains the same settings, and names
    # the run after the job, as a requeued job (same SLURM_JOB_ID) does again.
    config = parsed_train(train_words(tasks[0].command))
    assert config == dataclasses.replace(SETTINGS)
    placement = place(config, tasks[5].env)
    assert placement.mode == "rank"
    assert default_out(config, placement, tasks[5].env) == "runs/split-net-4242"


def test_sbatch_with_restarts_runs_one_launcher_per_node() -> None:
    settings = dataclasses.replace(SETTINGS, max_restarts=2)
    spec = job_spec(settings, nnodes="2", name="restarts", gpus_per_node=0)
    script = write_sbatch(spec, SbatchOptions(cpus_per_task=4))
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --cpus-per-task=4" in script
    tasks = slurm_tasks(script)
    assert len(tasks) == 2
    config = parsed_train(train_words(tasks[1].command))
    assert config.nproc == 1 and config.max_restarts == 2
    placement = place(config, tasks[1].env)
    assert placement.mode == "launcher" and placement.nodes == 2
    plan = make_plan(LaunchConfig(nproc_per_node=1, max_restarts=2, local_addr="127.0.0.1"),
                     "t.py", [], env=placement.env, environ=tasks[1].env)  # fmt: skip
    assert plan.mode == "static" and flag(plan.argv, "--node-rank") == "1"
    assert flag(plan.argv, "--master-addr") == "node1" and flag(plan.argv, "--rdzv-id") == "4242"


def test_sbatch_refuses_a_bad_time_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["job", "sbatch", "--time", "4h", "-o", str(tmp_path / "x.sbatch")])
    assert code == 2
    assert "--time '4h' is not a Slurm time limit" in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()


# --- Kubeflow PyTorchJob ----------------------------------------------------------------


def _options() -> PyTorchJobOptions:
    return PyTorchJobOptions(image="registry.example.com/train:1")


def test_pytorchjob_master_worker_pods_read_back() -> None:
    spec = job_spec(SETTINGS, nnodes="3", name="mnist", gpus_per_node=4)
    manifest = pytorchjob_manifest(spec, _options())
    assert manifest["spec"]["nprocPerNode"] == "4"  # never "auto"
    assert set(manifest["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    pods = kubeflow_pods(yaml.safe_load(yaml.safe_dump(manifest)))
    assert [p.name for p in pods] == ["mnist-master-0", "mnist-worker-0", "mnist-worker-1"]
    for index, pod in enumerate(pods):
        env = detect(pod.env)
        assert (env.kind, env.node_rank, env.num_nodes, env.procs_per_node_hint) == (
            "kubeflow", index, 3, 4,
        )  # fmt: skip
        assert env.job_id == "mnist"
        plan = make_plan(LaunchConfig(local_addr="127.0.0.1"), "t.py", [], env=env, environ=pod.env)
        assert plan.mode == "static" and plan.nproc_per_node == 4
        assert flag(plan.argv, "--master-addr") == "mnist-master-0"
        assert flag(plan.argv, "--master-port") == "23456"
    assert parsed_train(train_words(pods[0].command)) == SETTINGS


def test_pytorchjob_elastic_pods_join_a_rendezvous() -> None:
    spec = job_spec(SETTINGS, nnodes="1:2", name="mnist", gpus_per_node=0)
    manifest = pytorchjob_manifest(spec, dataclasses.replace(_options(), max_restarts=5))
    assert manifest["spec"]["elasticPolicy"]["minReplicas"] == 1
    assert list(manifest["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    pods = kubeflow_pods(manifest)
    assert [p.name for p in pods] == ["mnist-worker-0", "mnist-worker-1"]
    env = detect(pods[1].env)
    assert env.kind == "kubeflow" and env.per_node and env.rendezvous is not None
    plan = make_plan(LaunchConfig(local_addr="127.0.0.1"), "t.py", [], env=env, environ=pods[1].env)
    assert plan.mode == "c10d" and flag(plan.argv, "--nnodes") == "1:2"
    assert flag(plan.argv, "--rdzv-endpoint") == "mnist-worker-0:23456"
    assert flag(plan.argv, "--rdzv-id") == "mnist" and flag(plan.argv, "--max-restarts") == "5"
    assert plan.nproc_per_node == 1  # a CPU pod: what was written, not one per core
    placement = place(parsed_train(train_words(pods[1].command)), pods[1].env)
    assert placement.mode == "launcher" and placement.nodes == 2


def test_pytorchjob_with_a_volume_keeps_the_run_on_it() -> None:
    spec = job_spec(SETTINGS, nnodes="2", name="mnist", gpus_per_node=1)
    manifest = pytorchjob_manifest(spec, dataclasses.replace(_options(), pvc="runs-claim"))
    pod = kubeflow_pods(manifest)[1]
    assert flag(pod.command, "--out") == "/runs/mnist"
    container = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs-claim"}} in container[
        "volumes"
    ]


# --- SageMaker --------------------------------------------------------------------------


def _sm_options(**changes: Any) -> SageMakerOptions:
    base = SageMakerOptions(
        role="arn:aws:iam::123456789012:role/SageMakerRole",
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.3",
        code="s3://bucket/code/sourcedir.tar.gz",
        output="s3://bucket/out",
        instance_type="ml.g5.12xlarge",
    )
    return dataclasses.replace(base, **changes)


def run_entry(args: Sequence[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What scaletrain_entry.py passes to `scaletrain` for SageMaker's arguments."""
    import scaletrain.cli

    seen: list[list[str]] = []
    monkeypatch.setattr(scaletrain.cli, "main", lambda argv: seen.append(list(argv)) or 0)
    monkeypatch.setattr(sys, "argv", ["scaletrain_entry.py", *args])
    with pytest.raises(SystemExit) as done:
        exec(compile(ENTRY_SOURCE, "scaletrain_entry.py", "exec"), {"__name__": "__main__"})
    assert done.value.code == 0
    return seen[0]


def test_sagemaker_hosts_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = job_spec(SETTINGS, nnodes="2", name="mnist", gpus_per_node=0)
    job = training_job(spec, _sm_options())
    hps = job["HyperParameters"]
    assert json.loads(hps["sagemaker_torch_distributed_enabled"]) is True
    assert job["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 2,
                                     "VolumeSizeInGB": 50}  # fmt: skip
    hosts = sagemaker_hosts(job, model_dir="/opt/ml/model")
    # The platform's per-host process as scaletrain would read it (no distribution) ...
    env = detect(hosts[1].env)
    assert (env.kind, env.node_rank, env.num_nodes, env.master_addr) == (
        "sagemaker",
        1,
        2,
        "algo-1",
    )
    assert env.procs_per_node_hint == 4 and env.job_id == "mnist"
    # ... and torch_distributed's torchrun: two nodes of one process per GPU.
    command = hosts[1].command
    assert command[:5] == ["torchrun", "--nnodes", "2", "--nproc_per_node", "4"]
    assert flag(command, "--node_rank") == "1" and flag(command, "--master_addr") == "algo-1"
    entry_args = command[command.index("scaletrain_entry.py") + 1 :]
    words = run_entry(entry_args, monkeypatch)
    assert words[0] == "train" and parsed_train(words[1:]) == dataclasses.replace(SETTINGS)
    config = parsed_train(words[1:])
    placement = place(config, {**hosts[1].env, "TORCHELASTIC_RUN_ID": "x", "RANK": "5",
                               "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                               "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                               "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777"})  # fmt: skip
    assert placement.mode == "rank"
    assert default_out(config, placement, hosts[1].env) == "/opt/ml/model"


def test_sagemaker_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["job", "sagemaker", "--role", "arn:aws:iam::123456789012:role/R", "--image", "i",
            "--code", "s3://bucket/c.tar.gz", "--output-s3", "s3://bucket/o", "-o", "-"]  # fmt: skip
    assert main([*args, "--nnodes", "1:2"]) == 2
    assert "runs on a fixed InstanceCount" in capsys.readouterr().err
    bad_role = [*args[:2], "--role", "my-role", *args[4:]]
    assert main(bad_role) == 2
    err = capsys.readouterr().err
    assert "--role 'my-role' is not what SageMaker expects" in err and "Fix:" in err


# --- the command ----------------------------------------------------------------------------


def test_job_never_replaces_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "train.sbatch"
    target.write_text("precious\n")
    assert main(["job", "sbatch", "-o", str(target), "--recipe", "split-net"]) == 2
    err = capsys.readouterr().err
    assert f"{target} already exists" in err and "--force" in err
    assert target.read_text() == "precious\n"
    assert main(["job", "sbatch", "-o", str(target), "--force", "--recipe", "split-net"]) == 0
    assert shlex.split(target.read_text().splitlines()[-7])[0] == "srun"


def test_job_checks_the_train_settings_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "job.yaml"
    code = main(["job", "pytorchjob", "--image", "img", "-o", str(target), "--max-steps", "0"])
    assert code == 2
    assert "--max-steps 0" in capsys.readouterr().err and not target.exists()
