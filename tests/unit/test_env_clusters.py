"""The readers' multi-node facts (job ids, elastic Kubeflow pods, SageMaker's worker count,
Open MPI's port) and the network checks, from recorded variables and this machine."""

from __future__ import annotations

import socket
import time

import pytest

from scaletrain.env import ClusterEnv, detect, job_id
from scaletrain.env._common import port_from_job_id
from scaletrain.env.network import (
    choose_interface,
    interface_of,
    node_range,
    route_source,
    split_endpoint,
    wait_connectable,
)
from scaletrain.errors import EnvironmentDetectionError

# What training-operator v1.9 gives a pod of an elastic PyTorchJob named "mnist"
# (Worker replicas 2, elasticPolicy minReplicas 1, maxReplicas 2, maxRestarts 3,
# nprocPerNode "2"): no MASTER_*, RANK or WORLD_SIZE at all.
KUBEFLOW_ELASTIC = {
    "PYTHONUNBUFFERED": "1",
    "HOSTNAME": "mnist-worker-1",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "PET_NPROC_PER_NODE": "2",
    "PET_RDZV_ENDPOINT": "mnist-worker-0:23456",
    "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:2",
    "PET_MAX_RESTARTS": "3",
}

# What Open MPI 4.1's mpirun gave rank 1 of `mpirun -np 2` (recorded on Debian 12).
OPENMPI_41 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "921567233",
    "OMPI_MCA_orte_num_nodes": "1",
    "PMIX_NAMESPACE": "921567233",
    "PMIX_RANK": "1",
}


def test_elastic_kubeflow_pod_is_a_rendezvous_not_a_lone_process() -> None:
    # Issue 10 (3): this was read as "local", and every pod trained alone.
    found = detect(KUBEFLOW_ELASTIC)
    assert found.kind == "kubeflow" and found.per_node
    assert found.rendezvous is not None
    assert (found.rendezvous.endpoint, found.rendezvous.nnodes) == ("mnist-worker-0:23456", "1:2")
    assert (found.rendezvous.backend, found.rendezvous.max_restarts) == ("c10d", 3)
    assert found.rendezvous.run_id == "mnist" and found.job_id == "mnist"
    assert found.procs_per_node_hint == 2
    assert any("node ranks come from the rendezvous" in r for r in found.reasons)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PET_RDZV_ENDPOINT", "mnist-worker-0", "HOST:PORT"),
        ("PET_NNODES", "2:1", "MIN:MAX"),
        ("PET_NNODES", "two", "MIN:MAX"),
        ("PET_MAX_RESTARTS", "-1", "whole number"),
    ],
)
def test_elastic_kubeflow_malformed(variable: str, value: str, expected: str) -> None:
    with pytest.raises(EnvironmentDetectionError) as info:
        detect({**KUBEFLOW_ELASTIC, variable: value})
    assert f"{variable}={value!r}" in str(info.value) and expected in str(info.value)


def test_kubeflow_pet_node_rank_and_pet_master() -> None:
    pod = {
        "PET_MASTER_ADDR": "mnist-master-0", "PET_MASTER_PORT": "23456", "RANK": "1",
        "PET_NODE_RANK": "1", "WORLD_SIZE": "4", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "HOSTNAME": "mnist-worker-0",
    }  # fmt: skip
    found = detect(pod)
    assert (found.node_rank, found.num_nodes, found.procs_per_node_hint) == (1, 2, 2)
    # A pod spec that drops the plain names still has the operator's PET_MASTER_* copies.
    only_pet = {k: v for k, v in pod.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    found = detect(only_pet, kind="kubeflow")
    assert (found.master_addr, found.master_port) == ("mnist-master-0", 23456)
    with pytest.raises(EnvironmentDetectionError, match="PET_NODE_RANK='0'"):
        detect({**pod, "PET_NODE_RANK": "0"})


def test_openmpi_port_comes_from_the_job_id() -> None:
    # Issue 10 (6): two mpirun jobs on one host both took torch's 29500.
    found = detect(OPENMPI_41)
    assert found.master_port == port_from_job_id("921567233") != 29500
    assert found.job_id == "921567233"
    other = detect({**OPENMPI_41, "OMPI_MCA_ess_base_jobid": "921632769"})
    assert other.master_port != found.master_port
    assert detect({**OPENMPI_41, "MASTER_PORT": "29999"}).master_port == 29999
    assert any("derived from OMPI_MCA_ess_base_jobid" in r for r in found.reasons)


def test_hydra_without_a_job_id_keeps_torchs_port() -> None:
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect(hydra).master_port == 29500


def test_job_id_prefers_an_explicit_one_then_the_schedulers() -> None:
    assert job_id({"SCALETRAIN_JOB_ID": "mine", "SLURM_JOB_ID": "7"}) == "mine"
    assert job_id({"TRAINING_JOB_NAME": "sm-job"}) == "sm-job"
    assert job_id({}) is None
    torchrun_in_slurm = {
        "TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1", "SLURM_JOB_ID": "77",
    }  # fmt: skip
    assert detect(torchrun_in_slurm).job_id == "77"


# --- the network --------------------------------------------------------------------------


def test_split_endpoint_and_node_range() -> None:
    assert split_endpoint("node0:29500") == ("node0", 29500)
    assert split_endpoint("[fd00::1]:29500") == ("fd00::1", 29500)
    for bad in ("node0", "node0:0", "fd00::1:29500", ":1"):
        with pytest.raises(ValueError):
            split_endpoint(bad)
    assert node_range("2") == (2, 2) and node_range("1:4") == (1, 4)
    for bad in ("0", "4:1", "x", "1:2:3", ""):
        with pytest.raises(ValueError):
            node_range(bad)


def test_routes_and_interfaces_of_this_machine() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    # Our own name is never what decides: it may resolve to 127.0.1.1.
    choice = choose_interface(socket.gethostname())
    assert choice is None or choice.name != "lo"


def test_wait_connectable_gives_up_on_a_closed_port_quickly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        start = time.monotonic()
        ok, problem = wait_connectable("127.0.0.1", port, timeout_s=1.0)
    assert not ok and "connection refused" in problem
    assert time.monotonic() - start < 5


def _rank(rank: int, addr: str, port: int, kind: str = "slurm") -> ClusterEnv:
    return ClusterEnv(
        kind=kind, rank=rank, local_rank=rank, world_size=2, local_world_size=1,
        node_rank=rank, num_nodes=2, master_addr=addr, master_port=port,
        reasons=("SLURM_STEP_NODELIST='gpu[01-02]': rank 0 runs on gpu01, the first host",),
    )  # fmt: skip


def test_check_master_names_an_unresolvable_host_at_once() -> None:
    from scaletrain.dist.reach import check_master

    start = time.monotonic()
    with pytest.raises(EnvironmentDetectionError) as info:
        check_master(_rank(1, "no-such-node.invalid", 29500))
    message = str(info.value)
    assert "'no-such-node.invalid'" in message and "does not resolve on this node" in message
    assert "MASTER_ADDR=<address of no-such-node.invalid>" in message
    assert time.monotonic() - start < 10


def test_check_master_rank_zero_needs_its_port() -> None:
    from scaletrain.dist.reach import check_master

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EnvironmentDetectionError, match=f"Port {port} on this node"):
            check_master(_rank(0, "127.0.0.1", port))
        check_master(_rank(0, "127.0.0.1", port, kind="torchelastic"))  # the agent's store


def test_check_master_other_ranks_wait_then_explain() -> None:
    from scaletrain.dist.reach import check_master

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(EnvironmentDetectionError) as info:
            check_master(_rank(1, "127.0.0.1", port), wait_s=1.0)
    assert f"cannot reach rank 0's store at 127.0.0.1:{port}" in str(info.value)


class _Tty:
    """A stdout that says it is a terminal, as a rank's is under Open MPI's mpirun."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("variables", "live"),
    [({}, True), (OPENMPI_41, False), ({**OPENMPI_41, "FORCE_COLOR": "1"}, True)],
)
def test_under_open_mpi_a_terminal_is_mpiruns_not_the_users(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], live: bool
) -> None:
    # Issue 26 (21): mpirun gives every rank a pseudo-terminal, so `mpirun ... > log`
    # filled the log with the live bar's escape codes.
    from scaletrain.train.progress import StepProgress

    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "TERM", *OPENMPI_41):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    tty = _Tty()
    monkeypatch.setattr("sys.stdout", tty)
    progress = StepProgress(enabled=True)
    progress.start_epoch("epoch 1/1", total=2)
    progress.update(1, 2, 0.5, 100.0)
    progress.print("[bold]done[/]")
    progress.end_epoch()
    assert progress.live is live
    assert ("\x1b[" in tty.text) is live, repr(tty.text)
