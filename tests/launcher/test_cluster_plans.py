"""What the launcher and `scaletrain train` make of each cluster, with no process started:
torchrun's arguments (or srun's), and the errors a user can cause, in their words."""

from __future__ import annotations

import os

import pytest

from scaletrain.cli import build_parser, main
from scaletrain.env import detect
from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.launch import LaunchConfig
from scaletrain.launch.cli import config_from_args
from scaletrain.launch.plan import make_plan
from scaletrain.launch.training import default_out, place
from scaletrain.train import TrainConfig

# `srun -N 2 --ntasks-per-node 1 scaletrain launch ...`, the task on the second node.
SLURM_NODE_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "gpu[01-02]",
}  # fmt: skip
# The batch script of `sbatch -N 2`: a job, no step.
BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # fmt: skip
LOCAL = LaunchConfig(nproc_per_node=2, local_addr="127.0.0.1")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_slurm_task_per_node_forms_one_job() -> None:
    # Issue 10 (1): each node's launcher started a standalone job of its own.
    plan = make_plan(LOCAL, "x.py", [], environ=SLURM_NODE_TASK)
    assert plan.mode == "static" and "--standalone" not in plan.argv
    assert (flag(plan.argv, "--nnodes"), flag(plan.argv, "--node-rank")) == ("2", "1")
    assert flag(plan.argv, "--master-addr") == "gpu01"  # the step's first node
    assert flag(plan.argv, "--master-port") == str(15000 + 4242)  # from the job id
    assert flag(plan.argv, "--rdzv-id") == "4242" and flag(plan.argv, "--local-addr") == "127.0.0.1"
    assert plan.gloo_ifname == "lo"


def test_several_slurm_tasks_per_node_are_refused() -> None:
    crowded = {**SLURM_NODE_TASK, "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
               "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        make_plan(LOCAL, "x.py", [], environ=crowded)
    assert "srun started 2 tasks on this node" in str(info.value)
    assert "srun --ntasks-per-node=1 scaletrain launch" in str(info.value)


@pytest.mark.parametrize(("uid", "mpirun"), [(1000, "mpirun"), (0, "mpirun --allow-run-as-root")])
def test_several_mpirun_tasks_per_node_are_refused_with_the_command_to_use(
    monkeypatch: pytest.MonkeyPatch, uid: int, mpirun: str
) -> None:
    # Issue 26 (21): as root Open MPI's mpirun refuses to start without
    # --allow-run-as-root; the command the fix gives carries it there.
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    crowded = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "MASTER_ADDR": "10.0.0.1"}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        make_plan(LOCAL, "x.py", [], environ=crowded)
    assert "mpirun started 2 tasks on this node" in str(info.value)
    assert f"`{mpirun} --map-by ppr:1:node scaletrain launch ...`" in str(info.value)


def test_mpirun_one_rank_per_node_forms_one_job() -> None:
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
           "OMPI_MCA_ess_base_jobid": "7", "MASTER_ADDR": "10.0.0.1"}  # fmt: skip
    plan = make_plan(LOCAL, "x.py", [], environ=mpi)
    assert plan.mode == "static" and flag(plan.argv, "--node-rank") == "1"
    assert flag(plan.argv, "--master-addr") == "10.0.0.1"


def test_kubeflow_elastic_pod_joins_the_platforms_rendezvous() -> None:
    pod = {"PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NNODES": "1:4", "PET_MAX_RESTARTS": "2",
           "PET_NPROC_PER_NODE": "3", "HOSTNAME": "job-worker-2"}  # fmt: skip
    plan = make_plan(LaunchConfig(local_addr="127.0.0.1"), "x.py", [], environ=pod)
    assert plan.mode == "c10d" and plan.nproc_per_node == 3
    assert flag(plan.argv, "--nnodes") == "1:4" and flag(plan.argv, "--max-restarts") == "2"
    assert flag(plan.argv, "--rdzv-endpoint") == "job-worker-0:23456"
    # What the user types wins over the platform.
    mine = make_plan(LaunchConfig(max_restarts=0, nproc_per_node=1, local_addr="127.0.0.1"),
                     "x.py", [], environ=pod)  # fmt: skip
    assert flag(mine.argv, "--max-restarts") == "0" and mine.nproc_per_node == 1


def test_sagemaker_cpu_host_starts_one_worker() -> None:
    # Issue 10 (3): SM_NUM_CPUS=96 started 96 workers.
    host = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "0",
            "SM_NUM_CPUS": "96"}  # fmt: skip
    plan = make_plan(LaunchConfig(local_addr="127.0.0.1"), "x.py", [], environ=host)
    assert plan.nproc_per_node == 1 and flag(plan.argv, "--nproc-per-node") == "1"


def test_batch_script_runs_the_command_again_under_srun() -> None:
    # Issue 10 (2): launch refused to run in a batch script.
    plan = make_plan(LOCAL, "x.py", [], environ=BATCH, relaunch=["scaletrain", "launch", "x.py"])
    assert plan.mode == "srun"
    assert plan.argv == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--whole",
                         "scaletrain", "launch", "x.py"]  # fmt: skip
    with pytest.raises(ConfigError, match='env="local"'):
        make_plan(LOCAL, "x.py", [], environ=BATCH)
    here = make_plan(LaunchConfig(nproc_per_node=2, cluster="local"), "x.py", [], environ=BATCH)
    assert here.mode == "standalone"


def test_env_flag_takes_a_kind_or_a_variable() -> None:
    parser = build_parser()
    ns = parser.parse_args(["launch", "--env", "local", "--env", "A=1", "x.py"])
    cfg = config_from_args(ns)
    assert cfg.cluster == "local" and dict(cfg.extra_env) == {"A": "1"}


def test_env_flag_with_an_unknown_kind_says_both_meanings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["launch", "--env", "locale", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--env 'locale' is neither NAME=VALUE" in err and "kubeflow, local" in err


def test_dry_run_in_a_batch_script_prints_the_srun_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in BATCH.items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--dry-run", "--nproc-per-node", "2", "x.py", "--lr", "1"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --whole ")
    assert out.endswith("-m scaletrain launch --nproc-per-node 2 x.py --lr 1")


# --- scaletrain train ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cli", "api", "flags"),
    [
        ("--nnodes 2 spans several machines", "nnodes='2' spans several machines",
         {"nnodes": "2"}),
        ("--node-rank 2: expected an index in 0..1", "node_rank=2: expected an index in 0..1",
         {"nnodes": "2", "node_rank": 2, "rdzv_endpoint": "h:1"}),
        ("--rdzv-endpoint node0: expected HOST:PORT", "rdzv_endpoint='node0': expected HOST:PORT",
         {"rdzv_endpoint": "node0"}),
        ("--nnodes 4:1: expected a node count", "nnodes='4:1': expected a node count",
         {"nnodes": "4:1"}),
    ],
)  # fmt: skip
def test_train_node_flags_are_checked_in_the_interfaces_words(
    cli: str, api: str, flags: dict[str, object]
) -> None:
    with pytest.raises(ConfigError, match=api.replace("(", r"\(").replace(".", r"\.")):
        TrainConfig(**flags)  # type: ignore[arg-type]
    use_cli_names()
    with pytest.raises(ConfigError, match=cli.replace(".", r"\.")):
        TrainConfig(**flags)  # type: ignore[arg-type]


def test_train_placement() -> None:
    ranks = {**SLURM_NODE_TASK, "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert place(TrainConfig(), ranks).mode == "rank"
    # Alone on its node: a rank, unless there is more than one process to start there.
    assert place(TrainConfig(), SLURM_NODE_TASK).mode == "rank"
    node = place(TrainConfig(nproc=2), SLURM_NODE_TASK)
    assert (node.mode, node.nodes) == ("launcher", 2)
    assert place(TrainConfig(max_restarts=1), SLURM_NODE_TASK).mode == "launcher"
    assert place(TrainConfig(), {**SLURM_NODE_TASK, "SLURM_GPUS_ON_NODE": "4"}).mode == "launcher"
    batch = place(TrainConfig(), BATCH)
    assert (batch.mode, batch.nodes) == ("srun", 2)
    assert place(TrainConfig(env="local"), BATCH).mode == "launcher"
    by_hand = place(TrainConfig(nnodes="1:3", rdzv_endpoint="h:1"), {})
    assert (by_hand.mode, by_hand.nodes) == ("launcher", 3)


def test_the_run_directory_is_the_same_on_every_node() -> None:
    # Issue 10 (4): each node stamped runs/<recipe>-<its own clock>.
    cfg = TrainConfig(recipe="split-net")
    rank = place(cfg, SLURM_NODE_TASK)
    assert default_out(cfg, rank, SLURM_NODE_TASK) == "runs/split-net-4242"
    sm = {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_MODEL_DIR": "/opt/ml/model"}
    assert default_out(cfg, place(cfg, sm), sm) == "/opt/ml/model"
    by_hand = TrainConfig(recipe="split-net", nnodes="2", rdzv_endpoint="h:1")
    assert default_out(by_hand, place(by_hand, {}), {}) is None  # rank 0 chooses it
    one = default_out(cfg, place(cfg, {}), {})
    assert one is not None and one.startswith("runs/split-net-2")  # a time stamp, one node
    assert default_out(TrainConfig(out="mine"), rank, SLURM_NODE_TASK) == "mine"


def test_detect_of_a_node_task_reports_its_job() -> None:
    found = detect(SLURM_NODE_TASK)
    assert found.hosts == ("gpu01", "gpu02") and found.job_id == "4242"
