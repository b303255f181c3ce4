"""Environment detection from recorded environments: no process group, no subprocess.

Each fixture is the environment a real launcher gives a process, noise
included, so detection is tested against what schedulers actually set and not
only against the variables the readers look for. Fixtures are read-only
mappings: a reader must never write to the environment it inspects.
"""

from __future__ import annotations

import ast
import importlib
import os
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

import scaletrain.env as env_pkg
from scaletrain.env import ENVIRONMENTS, ClusterEnv, detect, expand_nodelist
from scaletrain.env.report import describe
from scaletrain.env.slurm import expand_tasks_per_node, is_batch_script, port_from_job_id
from scaletrain.errors import ConfigError, EnvironmentDetectionError

Env = Mapping[str, str]

_BASE = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/ada",
    "USER": "ada",
    "LANG": "C.UTF-8",
    "SHELL": "/bin/bash",
}


def _env(*parts: Mapping[str, str], **changes: str | None) -> Env:
    """Merge recorded parts; a change to None removes the variable."""
    merged: dict[str, str] = {**_BASE}
    for part in parts:
        merged.update(part)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return types.MappingProxyType(merged)


def _error(environ: Env, kind: str | None = None) -> str:
    with pytest.raises(EnvironmentDetectionError) as info:
        detect(environ, kind=kind)
    return str(info.value)


# --- recorded environments -------------------------------------------------

# `torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d ...`, worker 1 of node 1.
TORCHRUN = {
    "RANK": "5",
    "GROUP_RANK": "1",
    "ROLE_RANK": "5",
    "ROLE_NAME": "default",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "WORLD_SIZE": "8",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "job42",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x1/job42/attempt_0/1/error.json",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}

# Task 5 of `srun` in an sbatch job with 2 nodes x 4 tasks (Slurm 23.02).
SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_USER": "ada",
    "SLURM_JOB_UID": "1000",
    "SLURM_JOB_ACCOUNT": "ml",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_QOS": "normal",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NODELIST": "gpu[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "64(x2)",
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURM_SUBMIT_DIR": "/home/ada/run",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NNODES": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[01-02]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_LAUNCHER_PORT": "41234",
    "SLURM_SRUN_COMM_HOST": "10.0.0.11",
    "SLURM_SRUN_COMM_PORT": "41235",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.11",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_GTIDS": "4,5,6,7",
    "SLURM_TASK_PID": "31337",
    "SLURM_CPUS_ON_NODE": "64",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_DISTRIBUTION": "block",
    "SLURM_TOPOLOGY_ADDR": "gpu02",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_UMASK": "0022",
    "SLURMD_NODENAME": "gpu02",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}

# The sbatch script itself: job variables, and even SLURM_PROCID=0, but no step.
SBATCH_SCRIPT = {
    key: value
    for key, value in SRUN_TASK.items()
    if not key.startswith(("SLURM_STEP", "SLURM_SRUN", "SLURM_LAUNCH"))
} | {
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0",
    "ENVIRONMENT": "BATCH",
}

# An salloc shell on the login node: a job, no step, no task variables.
SALLOC_SHELL = {
    "SLURM_JOB_ID": "5000",
    "SLURM_JOBID": "5000",
    "SLURM_JOB_NODELIST": "gpu[03-04]",
    "SLURM_NODELIST": "gpu[03-04]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_CLUSTER_NAME": "hpc",
}

# `mpirun -np 8 --map-by slot python train.py` with Open MPI 4, rank 6 on node 1.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    # Not a node index: this process's rank on its node across all jobs.
    "OMPI_COMM_WORLD_NODE_RANK": "2",
    "OMPI_UNIVERSE_SIZE": "8",
    "OMPI_APP_CTX_NUM_PROCS": "8",
    "OMPI_FIRST_RANKS": "0",
    "OMPI_NUM_APP_CTX": "1",
    "OMPI_COMMAND": "python",
    "OMPI_ARGV": "train.py",
    "OMPI_FILE_LOCATION": "/tmp/ompi.gpu02.1000/pid.4711/1/6",
    "OMPI_MCA_orte_hnp_uri": "1234567890.0;tcp://10.0.0.11:45123",
    "OMPI_MCA_ess": "^singleton",
    "OMPI_MCA_orte_launch": "1",
    "PMIX_RANK": "6",
    "PMIX_NAMESPACE": "1234567890",
    "PMIX_SERVER_URI3": "pmix-server.4711;tcp4://127.0.0.1:37411",
    "MASTER_ADDR": "gpu01",
}

# `mpiexec -n 4 -ppn 2` with Intel MPI (Hydra), rank 3 on node 1.
HYDRA = {
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "PMI_FD": "6",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2",
    "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.10.0",
    "I_MPI_HYDRA_TOPOLIB": "hwloc",
    "I_MPI_FABRICS": "shm:ofi",
    "MASTER_ADDR": "cn001",
    "MASTER_PORT": "23456",
}

# A SageMaker training container, second host of two (training toolkit env).
SAGEMAKER = {
    "SM_HOSTS": '["algo-1","algo-2"]',
    "SM_CURRENT_HOST": "algo-2",
    "SM_NUM_GPUS": "8",
    "SM_NUM_CPUS": "96",
    "SM_NETWORK_INTERFACE_NAME": "eth0",
    "SM_MODEL_DIR": "/opt/ml/model",
    "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
    "SM_INPUT_DIR": "/opt/ml/input",
    "SM_CHANNELS": '["train"]',
    "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
    "SM_HPS": '{"epochs": 3}',
    "SM_USER_ENTRY_POINT": "train.py",
    "SM_LOG_LEVEL": "20",
    "SM_RESOURCE_CONFIG": (
        '{"current_host":"algo-2","hosts":["algo-1","algo-2"],"network_interface_name":"eth0"}'
    ),
    "TRAINING_JOB_NAME": "pytorch-training-2024-05-01-12-00-00-000",
}

# A Kubeflow PyTorchJob worker pod (training-operator < 1.7): 1 master + 2 workers.
KUBEFLOW = {
    "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456",
    "RANK": "2",
    "WORLD_SIZE": "3",
    "PYTHONUNBUFFERED": "0",
    "HOSTNAME": "mnist-worker-1",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "KUBERNETES_SERVICE_PORT_HTTPS": "443",
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
}

# training-operator >= 1.7 with nprocPerNode: "4": WORLD_SIZE counts processes.
KUBEFLOW_NPROC = {
    "MASTER_ADDR": "llm-master-0",
    "MASTER_PORT": "23456",
    "PET_MASTER_ADDR": "llm-master-0",
    "PET_MASTER_PORT": "23456",
    "RANK": "1",
    "WORLD_SIZE": "8",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_NNODES": "2",
    "PYTHONUNBUFFERED": "0",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
}

WORKSTATION = {
    "CUDA_VISIBLE_DEVICES": "0",
    "DISPLAY": ":0",
    "VIRTUAL_ENV": "/home/ada/.venv",
}


# --- registry and detect() -------------------------------------------------


def test_registry_is_ordered_by_priority() -> None:
    assert list(ENVIRONMENTS) == ["torchelastic", "slurm", "mpi", "sagemaker", "kubeflow", "local"]
    priorities = [cls.priority for cls in ENVIRONMENTS.values()]
    assert priorities == sorted(priorities)
    assert all(cls.name == name for name, cls in ENVIRONMENTS.items())


@pytest.mark.parametrize(
    ("environ", "kind"),
    [
        (TORCHRUN, "torchelastic"),
        (SRUN_TASK, "slurm"),
        (OPENMPI, "mpi"),
        (HYDRA, "mpi"),
        (SAGEMAKER, "sagemaker"),
        (KUBEFLOW, "kubeflow"),
        (KUBEFLOW_NPROC, "kubeflow"),
        (WORKSTATION, "local"),
        ({}, "local"),
    ],
)
def test_each_recording_is_detected_and_explained(environ: Env, kind: str) -> None:
    found = detect(_env(environ))
    assert found.kind == kind
    assert found.reasons, "every ClusterEnv must say why"
    assert all(isinstance(r, str) and r for r in found.reasons)
    assert 0 <= found.rank < found.world_size
    assert 0 <= found.local_rank < found.local_world_size
    assert 0 <= found.node_rank < found.num_nodes


def test_unknown_kind_lists_the_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        detect(_env(), kind="lsf")
    message = str(info.value)
    assert "'lsf'" in message
    for name in ENVIRONMENTS:
        assert name in message


def test_forced_kind_skips_detection_and_says_so() -> None:
    found = detect(_env(SBATCH_SCRIPT), kind="Local")
    assert found.kind == "local"
    assert found.reasons[0] == "kind 'local' forced"


def test_auto_kind_detects() -> None:
    assert detect(_env(SRUN_TASK), kind="auto").kind == "slurm"


def test_forcing_a_kind_whose_variables_are_missing_names_them() -> None:
    assert "SLURM_JOB_ID" in _error(_env(WORKSTATION), kind="slurm")
    assert "SM_HOSTS" in _error(_env(WORKSTATION), kind="sagemaker")
    assert "OMPI_COMM_WORLD_RANK" not in _error(_env(WORKSTATION), kind="mpi")
    assert "PMI_RANK" in _error(_env(WORKSTATION), kind="mpi")


def test_detect_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    prefixes = ("SLURM", "OMPI_", "PMI", "MPI_", "SM_", "PET_", "TORCHELASTIC", "KUBERNETES")
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    names |= {"MASTER_ADDR", "MASTER_PORT"}
    for key in list(os.environ):
        if key.startswith(prefixes) or key in names:
            monkeypatch.delenv(key)
    for key, value in SRUN_TASK.items():
        monkeypatch.setenv(key, value)
    found = detect()
    assert (found.kind, found.rank, found.world_size) == ("slurm", 5, 8)


def test_every_module_declares_all() -> None:
    for module in ("base", "torchelastic", "slurm", "mpi", "sagemaker", "kubeflow", "local"):
        mod = importlib.import_module(f"scaletrain.env.{module}")
        assert mod.__all__, module
    assert "detect" in env_pkg.__all__
    assert "ENVIRONMENTS" in env_pkg.__all__


# --- priority between kinds ------------------------------------------------


def test_torchrun_under_srun_is_torchelastic() -> None:
    # `srun --ntasks-per-node=1 torchrun ...`: srun placed the agent, torchrun the worker.
    srun_agent = SRUN_TASK | {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    found = detect(_env(srun_agent, TORCHRUN))
    assert found.kind == "torchelastic"
    assert (found.rank, found.world_size, found.local_rank) == (5, 8, 1)
    assert any("also matches slurm" in r for r in found.reasons)


def test_torchrun_variables_are_not_taken_as_kubeflow() -> None:
    # torchrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE per worker.
    found = detect(_env(TORCHRUN))
    assert found.kind == "torchelastic"
    assert not found.per_node
    assert not ENVIRONMENTS["kubeflow"]().detect(_env(TORCHRUN))


def test_torchrun_in_a_kubeflow_elastic_pod_is_torchelastic() -> None:
    pod = KUBEFLOW_NPROC | {"PET_NNODES": "1:4", "PET_RDZV_BACKEND": "c10d"}
    found = detect(_env(pod, TORCHRUN))
    assert found.kind == "torchelastic"
    assert found.world_size == 8
    assert found.node_rank == 1


def test_a_launcher_without_run_id_is_still_torchelastic_not_kubeflow() -> None:
    # torch.distributed.launch style: LOCAL_RANK but no TORCHELASTIC_RUN_ID.
    legacy = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    found = detect(_env(legacy))
    assert found.kind == "torchelastic"
    assert not ENVIRONMENTS["kubeflow"]().detect(_env(legacy))


def test_mpirun_inside_a_batch_script_is_mpi_not_a_refused_batch_script() -> None:
    found = detect(_env(SBATCH_SCRIPT, OPENMPI))
    assert found.kind == "mpi"
    assert found.rank == 6


def test_mpirun_ranks_under_srun_placed_daemons_are_mpi() -> None:
    # Open MPI launches its orted daemons with srun: ranks inherit the daemon's
    # step and SLURM_PROCID (the node index), which must not be read as rank.
    daemon_step = SRUN_TASK | {"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    found = detect(_env(daemon_step, OPENMPI))
    assert (found.kind, found.rank, found.world_size) == ("mpi", 6, 8)


def test_hydra_inside_a_batch_script_is_mpi() -> None:
    found = detect(_env(SBATCH_SCRIPT, HYDRA))
    assert (found.kind, found.rank) == ("mpi", 3)


def test_srun_pmi2_task_stays_slurm() -> None:
    # srun --mpi=pmi2 exports PMI_RANK (equal to SLURM_PROCID) in a real task.
    found = detect(_env(SRUN_TASK, {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "7"}))
    assert (found.kind, found.rank) == ("slurm", 5)


def test_sagemaker_with_torchrun_or_mpirun_defers_to_the_inner_launcher() -> None:
    assert detect(_env(SAGEMAKER, TORCHRUN)).kind == "torchelastic"
    assert detect(_env(SAGEMAKER, OPENMPI)).kind == "mpi"


def test_sbatch_script_that_exports_master_vars_is_still_refused() -> None:
    exported = SBATCH_SCRIPT | {"MASTER_ADDR": "gpu01", "MASTER_PORT": "29500"}
    assert "srun" in _error(_env(exported))


# --- torchelastic ----------------------------------------------------------


def test_torchrun_worker() -> None:
    found = detect(_env(TORCHRUN))
    assert found == ClusterEnv(
        kind="torchelastic",
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        num_nodes=2,
        master_addr="node0.cluster",
        master_port=29400,
        reasons=found.reasons,
    )
    assert any("TORCHELASTIC_RUN_ID='job42'" in r for r in found.reasons)
    assert any("GROUP_RANK=1" in r and "GROUP_WORLD_SIZE=2" in r for r in found.reasons)


def test_role_world_size_is_not_a_node_count() -> None:
    # ROLE_WORLD_SIZE counts workers; without GROUP_WORLD_SIZE derive from sizes.
    found = detect(_env(TORCHRUN, GROUP_WORLD_SIZE=None))
    assert found.num_nodes == 2


def test_torchrun_node_rank_derived_without_group_rank() -> None:
    found = detect(_env(TORCHRUN, GROUP_RANK=None, RANK="6"))
    assert found.node_rank == 1
    assert any("derived" in r for r in found.reasons)


def test_torchrun_local_world_size_derived_from_group_world_size() -> None:
    found = detect(_env(TORCHRUN, LOCAL_WORLD_SIZE=None))
    assert found.local_world_size == 4


def test_torchrun_local_world_size_missing() -> None:
    message = _error(_env(TORCHRUN, LOCAL_WORLD_SIZE=None, GROUP_WORLD_SIZE=None))
    assert "LOCAL_WORLD_SIZE" in message
    assert "torchrun" in message


def test_torchrun_restart_is_reported() -> None:
    found = detect(_env(TORCHRUN, TORCHELASTIC_RESTART_COUNT="2"))
    assert any("TORCHELASTIC_RESTART_COUNT=2" in r for r in found.reasons)


def test_torchrun_single_node_without_master_addr_uses_loopback() -> None:
    one_node = TORCHRUN | {"RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "4"}
    one_node |= {"GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "4"}
    found = detect(_env(one_node, MASTER_ADDR=None, MASTER_PORT=None))
    assert (found.master_addr, found.master_port) == ("127.0.0.1", 29500)


def test_torchrun_multi_node_without_master_addr() -> None:
    message = _error(_env(TORCHRUN, MASTER_ADDR=None))
    assert "MASTER_ADDR" in message
    assert "2 nodes" in message


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("RANK", "five", "whole number"),
        ("RANK", "-1", "whole number >= 0"),
        ("RANK", "8", "rank < world size"),
        ("RANK", "", "whole number"),
        ("RANK", "3.0", "whole number"),
        ("WORLD_SIZE", "0", "whole number >= 1"),
        ("WORLD_SIZE", "2", "rank < world size"),
        ("LOCAL_RANK", "4", "local rank < local world size"),
        ("LOCAL_RANK", "1_0", "whole number"),
        ("LOCAL_WORLD_SIZE", "x", "whole number"),
        ("GROUP_RANK", "2", "node rank < number of nodes"),
        ("GROUP_WORLD_SIZE", "9", "at least one process per node"),
        ("MASTER_PORT", "99999", "TCP port"),
        ("MASTER_PORT", "http", "whole number"),
        ("MASTER_PORT", "0", "whole number >= 1"),
    ],
)
def test_torchrun_malformed_variables(variable: str, value: str, expected: str) -> None:
    message = _error(_env(TORCHRUN, **{variable: value}))
    assert f"{variable}=" in message
    assert expected in message
    assert "Fix:" in message
    if value.strip():
        assert value in message


# --- slurm: node lists -----------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("gpu[007]", ["gpu007"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("a[1,3]b[2]c", ["a1b2c", "a3b2c"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("a1,b[1-2],c", ["a1", "b1", "b2", "c"]),
        ("n[1-2],m[3,5-6]", ["n1", "n2", "m3", "m5", "m6"]),
        (" gpu[1-2] , cpu1 ", ["gpu1", "gpu2", "cpu1"]),
        ("host.domain.org", ["host.domain.org"]),
        ("[1-2]", ["1", "2"]),
        ("login-01,login-02", ["login-01", "login-02"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("gpu[01-03", "never closed"),
        ("gpu01-03]", "without '['"),
        ("gpu[[1-2]]", "nested"),
        ("gpu[]", "not a number"),
        ("gpu[a-b]", "not a number"),
        ("gpu[3-1]", "backwards"),
        ("gpu[1-2-3]", "not a number"),
        ("gpu[1,]", "not a number"),
        ("gpu01,,gpu02", "empty host"),
        ("gpu01,", "empty host"),
        ("gpu 01", "character"),
        ("gpu[1-2](x2)", "character"),
        ("gpu[0-99999999]", "more than"),
    ],
)
def test_expand_nodelist_malformed(nodelist: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_nodelist(nodelist)
    message = str(info.value)
    assert repr(nodelist) in message
    assert problem in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("value", "counts"),
    [
        ("4", [4]),
        ("4(x2)", [4, 4]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,2,3", [1, 2, 3]),
        ("8(x1)", [8]),
    ],
)
def test_expand_tasks_per_node(value: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2(x)", "x2", "2(3)", "2(x3", "2,,1", "-1"])
def test_expand_tasks_per_node_malformed(value: str) -> None:
    with pytest.raises(ConfigError, match="malformed"):
        expand_tasks_per_node(value)


# --- slurm: tasks ----------------------------------------------------------


def test_srun_task() -> None:
    found = detect(_env(SRUN_TASK))
    assert found == ClusterEnv(
        kind="slurm",
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        num_nodes=2,
        master_addr="gpu01",
        master_port=port_from_job_id(4242),
        job_id="4242",
        hosts=("gpu01", "gpu02"),
        reasons=found.reasons,
    )
    assert found.reasons[0].startswith("SLURM_PROCID=5, SLURM_STEP_ID=0: a task launched by srun")
    assert any("SLURM_STEP_NODELIST='gpu[01-02]'" in r and "gpu01" in r for r in found.reasons)
    assert found.procs_per_node_hint is None


def test_srun_uneven_tasks_per_node() -> None:
    # srun -n 7 over 4 nodes: 2,2,2,1; the last node's task sees a local size of 1.
    uneven = SRUN_TASK | {
        "SLURM_STEP_NODELIST": "gpu[01-04]",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_NTASKS": "7",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
    }
    found = detect(_env(uneven, SLURM_NTASKS_PER_NODE=None))
    assert (found.local_world_size, found.num_nodes, found.node_rank) == (1, 4, 3)


def test_srun_step_variables_win_over_job_variables() -> None:
    # `srun -E -N1 -n2` inside a 2x4 job keeps the job's SLURM_NTASKS=8 etc.
    step = SRUN_TASK | {
        "SLURM_STEP_NODELIST": "gpu02",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
    }
    found = detect(_env(step))
    assert (found.world_size, found.local_world_size, found.num_nodes) == (2, 2, 1)
    assert found.master_addr == "gpu02"


def test_srun_falls_back_to_job_variables_and_ntasks_per_node() -> None:
    old = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP_")}
    old = {k: v for k, v in old.items() if k not in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_ID")}
    found = detect(_env(old))
    assert (found.rank, found.world_size, found.local_world_size) == (5, 8, 4)
    assert found.master_addr == "gpu01"
    assert found.master_port == port_from_job_id(4242)


def test_srun_one_task_per_node_reports_gpus_as_hint() -> None:
    per_node = SRUN_TASK | {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    found = detect(_env(per_node))
    assert found.local_world_size == 1
    assert found.procs_per_node_hint == 4


def test_srun_master_addr_and_port_overrides() -> None:
    found = detect(_env(SRUN_TASK, MASTER_ADDR="10.1.2.3", MASTER_PORT="12345"))
    assert (found.master_addr, found.master_port) == ("10.1.2.3", 12345)
    assert any("MASTER_ADDR=10.1.2.3 overrides" in r for r in found.reasons)


def test_port_from_job_id_is_deterministic_and_below_ephemeral_range() -> None:
    assert port_from_job_id(4242) == 19242
    assert port_from_job_id(15000) == 15000
    ports = {port_from_job_id(job) for job in range(0, 100_000, 7)}
    assert min(ports) >= 15000
    assert max(ports) < 32768
    # Every task of the job computes the same port, whatever its rank.
    tasks = [
        detect(
            _env(SRUN_TASK, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 4), SLURM_NODEID=str(r // 4))
        )
        for r in range(8)
    ]
    assert {t.master_port for t in tasks} == {19242}
    assert {t.master_addr for t in tasks} == {"gpu01"}
    assert any("derived from SLURM_JOB_ID=4242" in r for r in tasks[0].reasons)


def test_port_differs_between_jobs() -> None:
    other = detect(_env(SRUN_TASK, SLURM_JOB_ID="4243", SLURM_JOBID="4243"))
    assert other.master_port == 19243


@pytest.mark.parametrize(
    "environ",
    [
        SBATCH_SCRIPT,
        SALLOC_SHELL,
        SRUN_TASK | {"SLURM_STEP_ID": "4294967294", "SLURM_STEPID": "4294967294"},
        SRUN_TASK | {"SLURM_STEP_ID": "4294967295", "SLURM_STEPID": "4294967295"},
        SRUN_TASK | {"SLURM_STEP_ID": "4294967291", "SLURM_STEPID": "4294967291"},
        SRUN_TASK | {"SLURM_STEP_ID": "4294967290", "SLURM_STEPID": "4294967290"},
    ],
)
def test_batch_script_is_refused_with_srun_advice(environ: Env) -> None:
    assert is_batch_script(_env(environ))
    message = _error(_env(environ))
    assert "batch script" in message
    assert "not a task" in message
    assert "srun python train.py" in message
    assert "srun scaletrain" in message
    assert "SLURM_JOB_ID=" in message


def test_batch_script_message_names_the_special_step_id() -> None:
    message = _error(_env(SRUN_TASK, SLURM_STEP_ID="4294967291"))
    assert "SLURM_STEP_ID=4294967291" in message


def test_srun_task_is_not_a_batch_script() -> None:
    assert not is_batch_script(_env(SRUN_TASK))
    assert not is_batch_script(_env(WORKSTATION))


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("SLURM_PROCID", "five", "whole number"),
        ("SLURM_PROCID", "8", "rank < world size"),
        ("SLURM_LOCALID", "4", "local rank < local world size"),
        ("SLURM_NODEID", "2", "an index below"),
        ("SLURM_STEP_ID", "step0", "whole number"),
        ("SLURM_JOB_ID", "42a", "whole number"),
        ("SLURM_STEP_NUM_TASKS", "0", "whole number >= 1"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x)", "malformed"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x3)", "adding up to"),
        ("SLURM_STEP_TASKS_PER_NODE", "3(x2)", "adding up to"),
        ("SLURM_STEP_NODELIST", "gpu[01-02", "never closed"),
        ("MASTER_PORT", "70000", "TCP port"),
    ],
)
def test_slurm_malformed_variables(variable: str, value: str, expected: str) -> None:
    message = _error(_env(SRUN_TASK, **{variable: value}))
    assert f"{variable}=" in message
    assert value in message
    assert expected in message
    assert "Fix:" in message or "Fix " in message


def test_slurm_missing_procid() -> None:
    message = _error(_env(SRUN_TASK, SLURM_PROCID=None))
    assert "SLURM_PROCID is not set" in message
    assert "srun" in message


def test_slurm_missing_nodelist_without_master_addr() -> None:
    bare = {k: v for k, v in SRUN_TASK.items() if "NODELIST" not in k}
    message = _error(_env(bare))
    assert "SLURM_STEP_NODELIST" in message
    assert "MASTER_ADDR" in message
    assert detect(_env(bare, MASTER_ADDR="gpu01")).master_addr == "gpu01"


# --- mpi -------------------------------------------------------------------


def test_openmpi_rank() -> None:
    found = detect(_env(OPENMPI))
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (6, 8, 2, 4)
    # OMPI_COMM_WORLD_NODE_RANK=2 is the rank on the node, not the node index.
    assert (found.node_rank, found.num_nodes) == (1, 2)
    # The port comes from the mpirun's job id (PMIX_NAMESPACE), not torch's 29500.
    assert (found.master_addr, found.master_port) == ("gpu01", port_from_job_id("1234567890"))
    assert any("OMPI_COMM_WORLD_RANK=6" in r for r in found.reasons)


def test_openmpi_round_robin_mapping_node_rank() -> None:
    # --map-by node: rank 5 of 8 on 2 nodes is on node 1 as its local rank 2.
    found = detect(_env(OPENMPI, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_LOCAL_RANK="2"))
    assert found.node_rank == 1
    assert any("round-robin" in r for r in found.reasons)


def test_hydra_rank() -> None:
    found = detect(_env(HYDRA))
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (3, 4, 1, 2)
    assert (found.node_rank, found.num_nodes) == (1, 2)
    assert (found.master_addr, found.master_port) == ("cn001", 23456)


def test_mpi_single_node_uses_loopback() -> None:
    one_node = OPENMPI | {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}
    found = detect(_env(one_node, MASTER_ADDR=None))
    assert found.master_addr == "127.0.0.1"
    assert found.num_nodes == 1


@pytest.mark.parametrize(("uid", "mpirun"), [(1000, "mpirun"), (0, "mpirun --allow-run-as-root")])
def test_mpi_multi_node_without_master_addr(
    monkeypatch: pytest.MonkeyPatch, uid: int, mpirun: str
) -> None:
    # Issue 26 (21): as root (a container's user) Open MPI's mpirun refuses to start
    # without --allow-run-as-root, so the command the fix gives must carry it.
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    message = _error(_env(OPENMPI, MASTER_ADDR=None))
    assert "MASTER_ADDR is not set" in message
    assert "does not tell where rank 0 runs" in message
    assert f"`{mpirun} -x MASTER_ADDR=<host of rank 0>`" in message
    assert "OMPI_COMM_WORLD_SIZE=8" in message
    hydra = _error(_env(HYDRA, MASTER_ADDR=None))
    assert "mpiexec -genv MASTER_ADDR" in hydra and f"(Open MPI: {mpirun} -x" in hydra


@pytest.mark.parametrize(
    ("environ", "variable", "value", "expected"),
    [
        (OPENMPI, "OMPI_COMM_WORLD_RANK", "six", "whole number"),
        (OPENMPI, "OMPI_COMM_WORLD_RANK", "8", "rank < world size"),
        (OPENMPI, "OMPI_COMM_WORLD_SIZE", "0", "whole number >= 1"),
        (OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK", "4", "local rank < local world size"),
        (OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE", "16", "exceeds"),
        (HYDRA, "PMI_RANK", "-3", "whole number >= 0"),
        (HYDRA, "MPI_LOCALNRANKS", "two", "whole number"),
        (HYDRA, "MASTER_PORT", "port", "whole number"),
    ],
)
def test_mpi_malformed_variables(environ: Env, variable: str, value: str, expected: str) -> None:
    message = _error(_env(environ, **{variable: value}))
    assert f"{variable}=" in message
    assert value in message
    assert expected in message
    assert "Fix:" in message


def test_hydra_missing_local_rank() -> None:
    message = _error(_env(HYDRA, MPI_LOCALRANKID=None))
    assert "MPI_LOCALRANKID is not set" in message
    assert "mpiexec" in message


# --- sagemaker -------------------------------------------------------------


def test_sagemaker_host() -> None:
    found = detect(_env(SAGEMAKER))
    assert found == ClusterEnv(
        kind="sagemaker",
        rank=1,
        local_rank=0,
        world_size=2,
        local_world_size=1,
        node_rank=1,
        num_nodes=2,
        master_addr="algo-1",
        master_port=29500,
        per_node=True,
        procs_per_node_hint=8,
        job_id="pytorch-training-2024-05-01-12-00-00-000",
        hosts=("algo-1", "algo-2"),
        reasons=found.reasons,
    )
    assert any("SM_CURRENT_HOST='algo-2'" in r for r in found.reasons)


def test_sagemaker_cpu_host_runs_one_worker_as_the_toolkit_does() -> None:
    # Issue 10: SM_NUM_CPUS=96 used to start 96 workers; the toolkit starts one.
    found = detect(_env(SAGEMAKER, SM_NUM_GPUS="0", SM_NUM_CPUS="96"))
    assert found.procs_per_node_hint == 1
    assert any("SM_NUM_CPUS=96" in r for r in found.reasons)


def test_sagemaker_first_host_and_port() -> None:
    found = detect(_env(SAGEMAKER, SM_CURRENT_HOST="algo-1", MASTER_PORT="7777"))
    assert (found.rank, found.master_addr, found.master_port) == (0, "algo-1", 7777)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("SM_HOSTS", "algo-1,algo-2", "JSON list"),
        ("SM_HOSTS", '{"hosts": ["algo-1"]}', "JSON list"),
        ("SM_HOSTS", "[]", "JSON list"),
        ("SM_HOSTS", '["algo-1", "algo-1"]', "distinct"),
        ("SM_HOSTS", '["algo-1", 2]', "JSON list"),
        ("SM_CURRENT_HOST", "algo-9", "one of the hosts"),
        ("SM_NUM_GPUS", "eight", "whole number"),
    ],
)
def test_sagemaker_malformed_variables(variable: str, value: str, expected: str) -> None:
    message = _error(_env(SAGEMAKER, **{variable: value}))
    assert f"{variable}=" in message
    assert value in message
    assert expected in message


def test_sagemaker_current_host_error_names_the_host_list() -> None:
    message = _error(_env(SAGEMAKER, SM_CURRENT_HOST="algo-9"))
    assert "algo-1" in message and "algo-2" in message


def test_sagemaker_missing_hosts() -> None:
    assert "SM_HOSTS is not set" in _error(_env(SAGEMAKER, SM_HOSTS=None))


# --- kubeflow --------------------------------------------------------------


def test_kubeflow_worker_pod() -> None:
    found = detect(_env(KUBEFLOW))
    assert found == ClusterEnv(
        kind="kubeflow",
        rank=2,
        local_rank=0,
        world_size=3,
        local_world_size=1,
        node_rank=2,
        num_nodes=3,
        master_addr="mnist-master-0",
        master_port=23456,
        per_node=True,
        job_id="mnist",
        reasons=found.reasons,
    )
    assert any("KUBERNETES_SERVICE_HOST" in r for r in found.reasons)


def test_kubeflow_nproc_per_node_world_size_counts_processes() -> None:
    found = detect(_env(KUBEFLOW_NPROC))
    assert (found.rank, found.world_size, found.node_rank, found.num_nodes) == (1, 2, 1, 2)
    assert found.procs_per_node_hint == 4
    assert any("PET_NNODES" in r for r in found.reasons)
    assert any("WORLD_SIZE=8 counts processes" in r for r in found.reasons)


def test_kubeflow_nproc_without_nnodes_derives_pod_count() -> None:
    found = detect(_env(KUBEFLOW_NPROC, PET_NNODES=None))
    assert found.num_nodes == 2


def test_kubeflow_nproc_auto_is_no_hint() -> None:
    found = detect(_env(KUBEFLOW_NPROC, PET_NPROC_PER_NODE="auto", PET_NNODES=None, WORLD_SIZE="2"))
    assert (found.num_nodes, found.procs_per_node_hint) == (2, None)


def test_manual_one_process_per_node_launch_is_read_like_kubeflow() -> None:
    manual = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    found = detect(_env(manual))
    assert (found.kind, found.rank, found.world_size) == ("kubeflow", 1, 2)
    assert any("no Kubernetes variables" in r for r in found.reasons)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("RANK", "3", "rank < world size"),
        ("RANK", "-1", "whole number >= 0"),
        ("RANK", "two", "whole number"),
        ("WORLD_SIZE", "0", "whole number >= 1"),
        ("MASTER_PORT", "abc", "whole number"),
        ("MASTER_PORT", "65536", "TCP port"),
    ],
)
def test_kubeflow_malformed_variables(variable: str, value: str, expected: str) -> None:
    message = _error(_env(KUBEFLOW, **{variable: value}))
    assert f"{variable}=" in message
    assert value in message
    assert expected in message


def test_kubeflow_forced_without_master_addr() -> None:
    assert "MASTER_ADDR is not set" in _error(_env(KUBEFLOW, MASTER_ADDR=None), kind="kubeflow")


# --- local -----------------------------------------------------------------


def test_local_process() -> None:
    found = detect(_env(WORKSTATION))
    assert found == ClusterEnv(
        kind="local",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=29500,
        reasons=found.reasons,
    )
    assert not found.is_distributed


def test_local_port_override() -> None:
    assert detect(_env(WORKSTATION, MASTER_PORT="12345")).master_port == 12345


def test_local_accepts_world_size_one() -> None:
    assert detect(_env(WORKSTATION, WORLD_SIZE="1", RANK="0")).kind == "local"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("WORLD_SIZE", "4", "1 or unset"),
        ("RANK", "2", "0 or unset"),
        ("WORLD_SIZE", "four", "whole number"),
    ],
)
def test_local_refuses_a_lone_multi_process_variable(
    variable: str, value: str, expected: str
) -> None:
    message = _error(_env(WORKSTATION, **{variable: value}))
    assert f"{variable}={value!r}" in message
    assert expected in message
    assert "torchrun" in message


# --- report ----------------------------------------------------------------


def test_describe_rows() -> None:
    found = detect(_env(SAGEMAKER))
    rows = describe(found)
    fields = dict(rows[:8])
    assert fields["kind"] == "sagemaker"
    assert fields["rank"] == "1 of 2"
    assert fields["local rank"] == "0 of 1"
    assert fields["world size"] == "2"
    assert fields["node"] == "1 of 2"
    assert fields["master"] == "algo-1:29500"
    assert fields["per node"].startswith("yes")
    assert fields["processes per node (hint)"] == "8"
    assert [v for k, v in rows if k == "reason"] == list(found.reasons)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in rows)


def test_describe_local_has_no_hint_row() -> None:
    rows = dict(describe(detect(_env(WORKSTATION))))
    assert "processes per node (hint)" not in rows
    assert rows["per node"].startswith("no")


def test_env_modules_import_neither_torch_nor_rich() -> None:
    # `scaletrain env` must answer fast and before torch is importable.
    package = Path(env_pkg.__file__).parent
    for source in package.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert not {"torch", "rich"} & set(roots), f"{source.name} imports {roots}"
