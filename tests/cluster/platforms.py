"""What Slurm, Kubeflow and SageMaker do with a job file, written from their sources.

No Kubernetes or AWS here (the real Slurm is in tests/cluster/slurm.py): these
functions turn an sbatch script, a PyTorchJob manifest or a SageMaker training-job
definition into what each task, pod or host gets, its variables and its command,
following:

- Kubeflow training-operator v1.9: pkg/apis/kubeflow.org/v1/pytorch_defaults.go
  (defaults: replicas 1, port 23456 named "pytorchjob-port", nprocPerNode "auto",
  an elasticPolicy's min/max filled from each other or the worker replicas),
  pkg/controller.v1/pytorch/envvar.go, master.go, elastic.go (the variables), and
  Kubernetes itself (HOSTNAME is the pod's name, KUBERNETES_SERVICE_* are set);
- sagemaker-training-toolkit: environment.py and mapping.py (SM_* variables,
  hyperparameters JSON-decoded and passed as `--key value`, keys sorted),
  runner.py (processes per host: the GPUs, else 1) and torch_distributed.py (the
  torchrun command, master algo-1, port 7777).

The tests run what these return on namespace hosts named like the pods and hosts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INSTANCE_GPUS", "Node", "kubeflow_pods", "sagemaker_hosts", "slurm_tasks"]

INSTANCE_GPUS = {"ml.c5.xlarge": 0, "ml.m5.2xlarge": 0, "ml.g5.xlarge": 1, "ml.g5.12xlarge": 4,
                 "ml.p4d.24xlarge": 8}  # fmt: skip
"""GPUs of the instance types the tests use (AWS's instance type pages)."""
_INSTANCE_CPUS = {"ml.c5.xlarge": 4, "ml.m5.2xlarge": 8, "ml.g5.xlarge": 4, "ml.g5.12xlarge": 48,
                  "ml.p4d.24xlarge": 96}  # fmt: skip


@dataclass
class Node:
    """A pod or host: its name, its variables, and the command it runs."""

    name: str
    env: dict[str, str]
    command: list[str]
    cwd: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _port(replica: Mapping[str, Any]) -> int:
    for container in replica["template"]["spec"]["containers"]:
        if container["name"] == "pytorch":
            for port in container.get("ports", []):
                if port.get("name") == "pytorchjob-port":
                    return int(port["containerPort"])
    return 23456  # setPyTorchDefaultPort


def kubeflow_pods(manifest: Mapping[str, Any]) -> list[Node]:
    """Every pod of a PyTorchJob, as the training operator v1.9 would create it."""
    name = manifest["metadata"]["name"]
    spec = manifest["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    counts = {kind: int(r.get("replicas", 1)) for kind, r in replicas.items()}
    total = sum(counts.values())
    elastic = spec.get("elasticPolicy")
    nproc = spec.get("nprocPerNode")
    if nproc is None and (elastic is None or elastic.get("nProcPerNode") is None):
        nproc = "auto"  # setDefaultNprocPerNode
    nproc_int = int(nproc) if nproc is not None and str(nproc).isdigit() else 1
    pods = []
    for kind in ("Master", "Worker"):
        if kind not in replicas:
            continue
        for index in range(counts[kind]):
            pod = f"{name}-{kind.lower()}-{index}"
            env = {
                "PYTHONUNBUFFERED": "1",
                "HOSTNAME": pod,
                "KUBERNETES_SERVICE_HOST": "10.96.0.1",
                "KUBERNETES_SERVICE_PORT": "443",
            }
            if "Master" in replicas:
                port = str(_port(replicas["Master"]))
                master = f"{name}-master-0"
                env |= {"MASTER_PORT": port, "PET_MASTER_PORT": port}
                env |= {"MASTER_ADDR": master, "PET_MASTER_ADDR": master}
                rank = index + (1 if kind == "Worker" else 0)
                env |= {"WORLD_SIZE": str(total * nproc_int), "RANK": str(rank)}
                env["PET_NODE_RANK"] = str(rank)
            if nproc is not None:
                env["PET_NPROC_PER_NODE"] = str(nproc)
            if elastic is not None:
                lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
                lo, hi = lo if lo is not None else hi, hi if hi is not None else lo
                if lo is None:
                    lo = hi = counts["Worker"]
                host = elastic.get("rdzvHost", f"{name}-worker-0")
                port_e = elastic.get("rdzvPort", _port(replicas["Worker"]))
                env["PET_RDZV_ENDPOINT"] = f"{host}:{port_e}"
                env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
                env["PET_NNODES"] = f"{lo}:{hi}"
                if elastic.get("maxRestarts") is not None:
                    env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
                if elastic.get("nProcPerNode") is not None:
                    env["PET_NPROC_PER_NODE"] = str(elastic["nProcPerNode"])
                if elastic.get("rdzvId") is not None:
                    env["PET_RDZV_ID"] = elastic["rdzvId"]
            else:
                env["PET_NNODES"] = str(total)
            container = replicas[kind]["template"]["spec"]["containers"][0]
            for item in container.get("env", []):
                env[item["name"]] = str(item.get("value", ""))
            command = [*container.get("command", []), *container.get("args", [])]
            pods.append(Node(pod, env, command))
    return pods


def _user_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    args: list[str] = []
    for key in sorted(hyperparameters):
        value = hyperparameters[key]
        args += [f"--{key}" if len(key) > 1 else f"-{key}", str(value)]
    return args


def sagemaker_hosts(job: Mapping[str, Any], *, model_dir: str = "/opt/ml/model") -> list[Node]:
    """Every host of a training job, as SageMaker and its training toolkit start it."""
    resources = job["ResourceConfig"]
    count, instance = int(resources["InstanceCount"]), resources["InstanceType"]
    hosts = [f"algo-{i + 1}" for i in range(count)]
    decoded = {k: json.loads(v) for k, v in job.get("HyperParameters", {}).items()}
    framework = {k: v for k, v in decoded.items() if k.startswith("sagemaker_")}
    user = {k: v for k, v in decoded.items() if not k.startswith("sagemaker_")}
    gpus, cpus = INSTANCE_GPUS[instance], _INSTANCE_CPUS[instance]
    per_host = gpus if gpus > 0 else 1  # runner.py: "Default to single process for CPU"
    entry = framework["sagemaker_program"]
    nodes = []
    for index, host in enumerate(hosts):
        env = {
            "SM_HOSTS": json.dumps(hosts),
            "SM_CURRENT_HOST": host,
            "SM_CURRENT_INSTANCE_TYPE": instance,
            "SM_NUM_GPUS": str(gpus),
            "SM_NUM_CPUS": str(cpus),
            "SM_NUM_NEURONS": "0",
            "SM_MODEL_DIR": model_dir,
            "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
            "SM_NETWORK_INTERFACE_NAME": "eth0",
            "SM_HPS": json.dumps(user),
            "SM_USER_ARGS": json.dumps(_user_args(user)),
            "SM_USER_ENTRY_POINT": entry,
            "TRAINING_JOB_NAME": job["TrainingJobName"],
            # The request's Environment: SageMaker sets it in the container.
            **job.get("Environment", {}),
        }
        if framework.get("sagemaker_torch_distributed_enabled"):
            command = ["torchrun", "--nnodes", str(count), "--nproc_per_node", str(per_host)]
            if count > 1:
                command += ["--master_addr", hosts[0], "--master_port", "7777"]
                command += ["--node_rank", str(index)]
            command += [entry, *_user_args(user)]
        else:
            command = ["python", entry, *_user_args(user)]
        nodes.append(Node(host, env, command, extra={"processes_per_host": per_host}))
    return nodes


def _compress(hosts: list[str]) -> str:
    """node1,node2,node3 -> node[1-3] (what Slurm prints for a run of one prefix)."""
    prefix = hosts[0].rstrip("0123456789")
    numbers = [int(h[len(prefix) :]) for h in hosts]
    if numbers == list(range(numbers[0], numbers[0] + len(numbers))) and len(hosts) > 1:
        return f"{prefix}[{numbers[0]}-{numbers[-1]}]"
    return ",".join(hosts)


def slurm_tasks(script: str, *, nodes: int | None = None, job_id: int = 4242) -> list[Node]:
    """The tasks `srun` starts for an sbatch script's last srun line, with the variables
    Slurm 22.05 gives each (srun's man page, ENVIRONMENT VARIABLES / OUTPUT): the job
    gets `nodes` nodes (default: the most --nodes allows) named node1, node2, ..."""
    directives: dict[str, str] = {}
    srun: list[str] = []
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            directives[key] = value
        elif line.startswith("srun "):
            import shlex

            srun = shlex.split(line)
    low, _, high = directives["nodes"].partition("-")
    count = nodes if nodes is not None else int(high or low)
    per_node = int(directives.get("ntasks-per-node", "1"))
    hosts = [f"node{i + 1}" for i in range(count)]
    nodelist = _compress(hosts)
    command = [word for word in srun[1:] if not word.startswith("--")][:1]
    command = srun[srun.index(command[0]) :] if command else []
    tasks = []
    for node, host in enumerate(hosts):
        for local in range(per_node):
            rank = node * per_node + local
            env = {
                "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
                "SLURM_STEPID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node), "SLURM_NTASKS": str(count * per_node),
                "SLURM_NPROCS": str(count * per_node),
                "SLURM_STEP_NUM_TASKS": str(count * per_node), "SLURM_NNODES": str(count),
                "SLURM_JOB_NUM_NODES": str(count), "SLURM_STEP_NUM_NODES": str(count),
                "SLURM_TASKS_PER_NODE": f"{per_node}(x{count})",
                "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{count})",
                "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NODELIST": nodelist, "SLURMD_NODENAME": host,
                "SLURM_JOB_NAME": directives.get("job-name", ""),
            }  # fmt: skip
            if "gpus-per-node" in directives:
                env["SLURM_GPUS_ON_NODE"] = directives["gpus-per-node"]
            tasks.append(Node(host, env, command, extra={"directives": directives}))
    return tasks
