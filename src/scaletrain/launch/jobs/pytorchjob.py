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
directory, so a restarted pod resumes from its checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from scaletrain import __version__
from scaletrain.errors import ConfigError
from scaletrain.launch.jobs.spec import JobSpec

__all__ = ["DEFAULT_PORT", "PyTorchJobOptions", "pytorchjob_manifest", "write_pytorchjob"]

DEFAULT_PORT = 23456
"""The training operator's default for the port named "pytorchjob-port"."""
RUN_MOUNT = "/runs"


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

    def __post_init__(self) -> None:
        if not self.image.strip():
            raise ConfigError(
                "--image is empty. Expected a container image that has scaletrain installed, "
                "e.g. --image registry.example.com/team/train:1.0."
            )
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: expected a TCP port 1..65535.")


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
    if spec.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.gpus_per_node}}
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


def pytorchjob_manifest(spec: JobSpec, opts: PyTorchJobOptions) -> dict[str, Any]:
    """The manifest as a mapping (what `kubectl apply` reads)."""
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
