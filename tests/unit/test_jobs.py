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
from scaletrain.errors import ConfigError
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


def test_pytorchjob_pods_request_cpus_and_memory() -> None:
    """Issue 26 item 19: the pods requested nothing (BestEffort: placed anywhere, evicted
    first)."""
    settings = dataclasses.replace(SETTINGS, num_workers=2)
    spec = job_spec(settings, nnodes="2", name="mnist", gpus_per_node=4)
    manifest = pytorchjob_manifest(spec, _options())
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        resources = replica["template"]["spec"]["containers"][0]["resources"]
        # 4 processes x (1 + 2 loader workers) CPUs, 2 GiB per process.
        assert resources == {"requests": {"cpu": "12", "memory": "8Gi"},
                             "limits": {"nvidia.com/gpu": 4}}  # fmt: skip
    chosen = dataclasses.replace(_options(), cpu="7500m", memory="64Gi")
    container = pytorchjob_manifest(spec, chosen)["spec"]["pytorchReplicaSpecs"]["Master"]
    requests = container["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "7500m", "memory": "64Gi"}
    for bad in ({"cpu": "8 cores"}, {"cpu": "0"}, {"memory": "16 GB"}):
        with pytest.raises(ConfigError, match="Fix: pass e.g."):
            dataclasses.replace(_options(), **bad)


def test_pytorchjob_without_a_volume_warns_that_a_restarted_pod_starts_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["job", "pytorchjob", "--image", "img", "--recipe", "split-net", "-o", "-"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: without --pvc" in err and "starts over from step 0" in err, err
    assert main([*args, "--pvc", "runs-claim"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_pytorchjob_names_follow_kubernetes_rules(capsys: pytest.CaptureFixture[str]) -> None:
    """Its services are <name>-worker-<i>, DNS-1035 labels of at most 63 characters; the
    name's limit depends on the worker count (a flat 40 before, for every kind of job)."""
    longest = "a" * (63 - len("-worker-0"))
    spec = job_spec(SETTINGS, nnodes="2", name=longest, gpus_per_node=0)
    pods = kubeflow_pods(pytorchjob_manifest(spec, _options()))
    assert max(len(p.name) for p in pods) == 63
    for name, fix in ((longest + "a", longest), ("MNIST_ddp", "mnist-ddp"), ("1st", "job-1st")):
        spec = job_spec(SETTINGS, nnodes="2", name=name, gpus_per_node=0)
        with pytest.raises(ConfigError, match=f"Fix: --name {fix}[.]$"):
            pytorchjob_manifest(spec, _options())


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


def test_sagemaker_names_take_what_sagemaker_takes() -> None:
    """Issue 26 item 19: names were held to 40 lowercase characters; SageMaker's rule is
    ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$."""
    name = "Mnist-DDP--" + "x" * 52
    assert len(name) == 63
    spec = job_spec(SETTINGS, nnodes="1", name=name, gpus_per_node=0)
    assert training_job(spec, _sm_options())["TrainingJobName"] == name
    for bad, fix in ((name + "x", name), ("mnist_ddp.v2", "mnist-ddp-v2")):
        spec = job_spec(SETTINGS, nnodes="1", name=bad, gpus_per_node=0)
        with pytest.raises(ConfigError, match=f"at most 63 .* Fix: --name {fix}[.]$"):
            training_job(spec, _sm_options())


def test_sagemaker_spot_jobs_say_so_and_may_wait(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 item 19: there was no way to ask for spot (EnableManagedSpotTraining needs
    MaxWaitTimeInSeconds >= MaxRuntimeInSeconds)."""
    spec = job_spec(SETTINGS, nnodes="1", name="mnist", gpus_per_node=0)
    job = training_job(spec, _sm_options(spot=True, max_run_s=3600, checkpoint="s3://bucket/c"))
    assert job["EnableManagedSpotTraining"] is True
    assert job["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    job = training_job(spec, _sm_options(spot=True, max_run_s=3600, max_wait_s=3600))
    assert job["StoppingCondition"]["MaxWaitTimeInSeconds"] == 3600
    assert "EnableManagedSpotTraining" not in training_job(spec, _sm_options())
    with pytest.raises(ConfigError, match="MaxWaitTimeInSeconds >= MaxRuntimeInSeconds"):
        _sm_options(spot=True, max_run_s=3600, max_wait_s=600)
    with pytest.raises(ConfigError, match="no --spot was given"):
        _sm_options(max_wait_s=7200)
    args = ["job", "sagemaker", "--role", "arn:aws:iam::123456789012:role/R", "--image", "i",
            "--code", "s3://bucket/c.tar.gz", "--output-s3", "s3://bucket/o", "-o", "-",
            "--recipe", "split-net", "--spot"]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: --spot without --checkpoint-s3" in err and "starts over" in err, err
    assert main([*args, "--checkpoint-s3", "s3://bucket/ck", "--save-every", "50"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_sagemaker_checkpoints_live_where_sagemaker_syncs_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 26 item 19: with --checkpoint-s3 nothing was written to /opt/ml/checkpoints (the
    run was in SM_MODEL_DIR, uploaded only at the end): a restarted job had nothing to
    resume. Now each host's run is LocalPath/<host>, and rank 0 copies the finished run,
    checkpoints aside, into SM_MODEL_DIR."""
    import scaletrain.cli

    spec = job_spec(SETTINGS, nnodes="2", name="mnist", gpus_per_node=0)
    job = training_job(spec, _sm_options(checkpoint="s3://bucket/ckpt"))
    assert job["CheckpointConfig"] == {"S3Uri": "s3://bucket/ckpt",
                                       "LocalPath": "/opt/ml/checkpoints"}  # fmt: skip
    model_dir, synced = tmp_path / "model", tmp_path / "checkpoints"
    model_dir.mkdir()
    hosts = sagemaker_hosts(job, model_dir=str(model_dir))
    assert hosts[1].env["SCALETRAIN_SAGEMAKER_CHECKPOINTS"] == "/opt/ml/checkpoints"

    def train(argv: list[str]) -> int:
        run = Path(argv[argv.index("--out") + 1])
        (run / "checkpoints" / "step-000020").mkdir(parents=True)
        (run / "model.pt").write_bytes(b"weights")
        return 0

    monkeypatch.setattr(scaletrain.cli, "main", train)
    command = hosts[1].command
    for host, rank in ((hosts[1], "4"), (hosts[0], "0")):
        for key, value in {**host.env, "SCALETRAIN_SAGEMAKER_CHECKPOINTS": str(synced),
                           "RANK": rank}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "argv", ["scaletrain_entry.py", *command[command.index(
            "scaletrain_entry.py") + 1 :]])  # fmt: skip
        with pytest.raises(SystemExit) as done:
            exec(compile(ENTRY_SOURCE, "scaletrain_entry.py", "exec"), {"__name__": "__main__"})
        assert done.value.code == 0
        assert (synced / host.name / "checkpoints" / "step-000020").is_dir()
        # Only rank 0's copy reaches the output, and without the checkpoints.
        assert sorted(p.name for p in model_dir.iterdir()) == ([] if rank != "0" else ["model.pt"])
    with pytest.raises(ConfigError, match="Fix: leave --out out"):
        training_job(
            job_spec(dataclasses.replace(SETTINGS, out="runs/x"), nnodes="1", name="m",
                     gpus_per_node=0),
            _sm_options(checkpoint="s3://bucket/ckpt"),
        )  # fmt: skip


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
