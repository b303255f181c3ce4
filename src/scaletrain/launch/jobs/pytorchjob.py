"""A Kubeflow PyTorchJob manifest: the inverse of scaletrain.env.kubeflow.

Two shapes, as the training operator (v1.9) runs them:

- fixed size (`--nnodes N`): a Master replica and N-1 Workers. The operator gives
  every pod MASTER_ADDR/PORT (the master's service), RANK = PET_NODE_RANK (its
  index), PET_NNODES = N and PET_NPROC_PER_NODE;
- elastic (`--nnodes MIN:MAX`): Workers only, with an elasticPolicy; the operator
  gives PET_RDZV_ENDPOINT ("<job>-worker-0:<port>"), PET_NNODES = "MIN:MAX",
  PET_NPROC_PER_NODE and PET_MAX_RESTARTS, and torch's c10d rendezvous places the
  pods.

Either way each pod runs `python -m scaletrain train ...` once, which reads those
variables and starts `nprocPerNode` workers. nprocPerNode is always written as a
number: the operator's default "auto" means one worker per CPU core on a CPU pod.
The container mounts a memory-backed /dev/shm (Kubernetes gives 64 MiB, too little
for DataLoader workers) and, with --pvc, a PersistentVolumeClaim that holds the run
directory, so a restarted pod resumes from its checkpoints (without one the run is in
the pod's own filesystem, gone with the pod: a restarted pod starts over). It requests
CPUs and memory for its processes, so the scheduler places a pod where they are free and
does not evict it first (a pod without requests is "BestEffort").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from scaletrain import __version__
from scaletrain.errors import ConfigError
from scaletrain.launch.jobs.spec import JobSpec

__all__ = [
    "DEFAULT_PORT",
    "MEMORY_PER_PROCESS_GIB",
    "PyTorchJobOptions",
    "pytorchjob_manifest",
    "pytorchjob_warnings",
    "write_pytorchjob",
]

DEFAULT_PORT = 23456
"""The training operator's default for the port named "pytorchjob-port"."""
RUN_MOUNT = "/runs"
MEMORY_PER_PROCESS_GIB = 2
"""Memory requested per training process when --memory is not given: a floor to
schedule by (a CPU ConvNet process peaks near 0.5 GiB; data and CUDA add to it)."""
_CPU = re.compile(r"\d+(\.\d+)?m?")
_MEMORY = re.compile(r"\d+(\.\d+)?([KMGTPE]i?)?")
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class PyTorchJobOptions:
    """What only a PyTorchJob says."""

    image: str
    """Container image with scaletrain (and the data) installed."""
    namespace: str | None = None
    port: int = DEFAULT_PORT
    max_restarts: int = 3
    """Elastic jobs: worker-group restarts before the job fails (the elasticPolicy's)."""
    pvc: str | None = None
    """A PersistentVolumeClaim mounted at /runs to hold the run directory."""
    python: str = "python"
    cpu: str | None = None
    """CPUs requested per pod (a Kubernetes quantity: 8, 7.5, 500m); None: one per
    training process and DataLoader worker."""
    memory: str | None = None
    """Memory requested per pod (16Gi, 64G); None: MEMORY_PER_PROCESS_GIB per process."""

    def __post_init__(self) -> None:
        if not self.image.strip():
            raise ConfigError(
                "--image is empty. Expected a container image that has scaletrain installed, "
                "e.g. --image registry.example.com/team/train:1.0."
            )
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: expected a TCP port 1..65535.")
        if self.cpu is not None and not (_CPU.fullmatch(self.cpu) and _positive(self.cpu)):
            raise ConfigError(
                f"--cpu {self.cpu!r}: expected CPUs per pod as Kubernetes writes them, e.g. 8, "
                "7.5 or 500m (thousandths). Fix: pass e.g. --cpu 8."
            )
        if self.memory is not None and not (
            _MEMORY.fullmatch(self.memory) and _positive(self.memory)
        ):
            raise ConfigError(
                f"--memory {self.memory!r}: expected memory per pod as Kubernetes writes it, "
                "e.g. 16Gi (GiB) or 64G. Fix: pass e.g. --memory 16Gi."
            )


def _positive(quantity: str) -> bool:
    return float(re.match(r"[\d.]+", quantity).group()) > 0  # type: ignore[union-attr]


def _requests(spec: JobSpec, opts: PyTorchJobOptions) -> dict[str, str]:
    cpu = opts.cpu or str(spec.nproc * (1 + spec.config.num_workers))
    memory = opts.memory or f"{spec.nproc * MEMORY_PER_PROCESS_GIB}Gi"
    return {"cpu": cpu, "memory": memory}


def _container(spec: JobSpec, opts: PyTorchJobOptions) -> dict[str, Any]:
    args = ["-m", "scaletrain", "train", *spec.train_args]
    if opts.pvc and spec.config.out is None:
        args += ["--out", f"{RUN_MOUNT}/{spec.name}"]
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the port on the container of this name
        "image": opts.image,
        "command": [opts.python],
        "args": args,
        "ports": [{"name": "pytorchjob-port", "containerPort": opts.port}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    container["resources"] = {"requests": _requests(spec, opts)}
    if spec.gpus_per_node:
        container["resources"]["limits"] = {"nvidia.com/gpu": spec.gpus_per_node}
    if opts.pvc:
        container["volumeMounts"].append({"name": "runs", "mountPath": RUN_MOUNT})
    return container


def _replica(spec: JobSpec, opts: PyTorchJobOptions, replicas: int) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if opts.pvc:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": opts.pvc}})
    return {
        "replicas": replicas,
        # A pod that fails (or saves and exits 75 when evicted) is started again and resumes.
        "restartPolicy": "OnFailure",
        "template": {"spec": {"containers": [_container(spec, opts)], "volumes": volumes}},
    }


def _check_name(spec: JobSpec) -> None:
    """The operator names each pod and its service <job>-master-0, <job>-worker-<i>; a
    service name is a DNS-1035 label (a lowercase letter first, at most 63 characters)."""
    workers = spec.max_nodes if spec.elastic else spec.max_nodes - 1
    suffix = max(len("-master-0"), len(f"-worker-{max(workers - 1, 0)}"))
    longest = 63 - suffix
    if not _DNS_LABEL.fullmatch(spec.name) or len(spec.name) > longest:
        fixed = re.sub(r"[^a-z0-9-]", "-", spec.name.lower()).strip("-")[:longest].strip("-")
        if not fixed[:1].isalpha():
            fixed = ("job-" + fixed)[:longest].strip("-")
        raise ConfigError(
            f"--name {spec.name!r} cannot name this PyTorchJob: its pods and services are "
            f"named <name>-worker-<i>, which Kubernetes takes as lowercase letters, digits "
            f"and '-', a letter first, at most 63 characters: at most {longest} for the name. "
            f"Fix: --name {fixed}."
        )


def pytorchjob_warnings(spec: JobSpec, opts: PyTorchJobOptions) -> list[str]:
    """What the job will do that its author may not expect, one line each."""
    if opts.pvc is None:
        return [
            "without --pvc the run directory is in each pod's own filesystem, lost with the "
            "pod: a pod restarted after a failure or an eviction starts over from step 0. Add "
            "--pvc CLAIM (a PersistentVolumeClaim) to resume from its checkpoints."
        ]
    return []


def pytorchjob_manifest(spec: JobSpec, opts: PyTorchJobOptions) -> dict[str, Any]:
    """The manifest as a mapping (what `kubectl apply` reads)."""
    _check_name(spec)
    metadata: dict[str, Any] = {"name": spec.name}
    if opts.namespace:
        metadata["namespace"] = opts.namespace
    body: dict[str, Any] = {"nprocPerNode": str(spec.nproc)}
    if spec.elastic:
        body["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": spec.min_nodes,
            "maxReplicas": spec.max_nodes,
            "maxRestarts": opts.max_restarts,
        }
        body["pytorchReplicaSpecs"] = {"Worker": _replica(spec, opts, spec.max_nodes)}
    else:
        replicas = {"Master": _replica(spec, opts, 1)}
        if spec.max_nodes > 1:
            replicas["Worker"] = _replica(spec, opts, spec.max_nodes - 1)
        body["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": body,
    }


def write_pytorchjob(spec: JobSpec, opts: PyTorchJobOptions) -> str:
    """The manifest as YAML, with a header that says how to submit it."""
    shape = f"{spec.min_nodes}:{spec.max_nodes}" if spec.elastic else str(spec.max_nodes)
    header = (
        f"# Written by `scaletrain job pytorchjob` (scaletrain {__version__}): {shape} pod(s) x "
        f"{spec.nproc} process(es).\n# Submit with `kubectl apply -f THIS_FILE` (the Kubeflow "
        "training operator must be installed).\n"
    )
    return header + yaml.safe_dump(pytorchjob_manifest(spec, opts), sort_keys=False)
