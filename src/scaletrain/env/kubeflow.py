"""Kubeflow PyTorchJob pods: one process per pod, started by the training operator.

What the training operator v1.9 writes into each pod's container
(pkg/controller.v1/pytorch/envvar.go, master.go, elastic.go):

- a job with a Master replica: MASTER_ADDR (the service "<job>-master-0"),
  MASTER_PORT (the container port named "pytorchjob-port", default 23456), the
  same two as PET_MASTER_ADDR / PET_MASTER_PORT, RANK and PET_NODE_RANK (the pod's
  index: master 0, worker i -> i + 1), WORLD_SIZE = pods x nprocPerNode (a
  non-numeric nprocPerNode counts as 1), PET_NNODES = pods, and
  PET_NPROC_PER_NODE = nprocPerNode ("auto" by default);
- an elastic job (elasticPolicy, usually workers only) gets none of MASTER_*,
  RANK or WORLD_SIZE, only PET_RDZV_ENDPOINT ("<job>-worker-0:<port>" unless
  rdzvHost/rdzvPort are set), PET_RDZV_BACKEND (default c10d), PET_NNODES
  ("MIN:MAX": the defaults fill both ends), PET_NPROC_PER_NODE and, where set,
  PET_MAX_RESTARTS, PET_RDZV_ID and PET_RDZV_CONF. The node ranks are decided by
  torch's rendezvous, so this reader returns a `Rendezvous` for the launcher.

MASTER_ADDR/RANK/WORLD_SIZE are also torchrun's names for *processes*; here they
count pods, and the launcher starts the per-device workers (`per_node=True`). A
pod that runs torchrun itself is read by the torchelastic reader first: its
workers carry TORCHELASTIC_RUN_ID / LOCAL_RANK / GROUP_RANK, which this reader
refuses.

Kubernetes names a pod's host after the pod ("<job>-worker-1"), so the job's name,
the same in every pod and across pod restarts, is read from HOSTNAME.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    Value,
    build_env,
    default_port,
    malformed,
    missing,
    read_int,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment, Rendezvous
from scaletrain.env.torchelastic import TORCHELASTIC_MARKERS

__all__ = ["KubeflowEnvironment", "job_name_from_pod"]

_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_ELASTIC = "PET_RDZV_ENDPOINT"
_WHY = "the Kubeflow training operator sets it in every PyTorchJob pod"
_FIX = (
    "these variables come from the Kubeflow training operator; run the job as a "
    "PyTorchJob (or, for a manual launch, set MASTER_ADDR, MASTER_PORT, RANK and "
    "WORLD_SIZE consistently: RANK in 0..WORLD_SIZE-1, one value per node)"
)
_ELASTIC_FIX = (
    "these variables come from the Kubeflow training operator's elasticPolicy; set "
    "minReplicas/maxReplicas and the rdzv settings in the PyTorchJob, not by hand"
)
_DIGITS = re.compile(r"[0-9]+")
_NNODES = re.compile(r"([0-9]+)(?::([0-9]+))?")
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\s]+):([0-9]+)")
_POD = re.compile(r"(.+)-(?:master|worker)-[0-9]+")


def job_name_from_pod(hostname: str) -> str | None:
    """The PyTorchJob's name from a pod's ("mnist-worker-3" -> "mnist"), else None."""
    match = _POD.fullmatch(hostname.strip())
    return match.group(1) if match else None


def _nproc(environ: Mapping[str, str]) -> int | None:
    # "auto", "gpu" and "cpu" are torchrun's own choices (auto and cpu start one
    # worker per CPU core on a CPU pod); only a number is taken as a count.
    raw = environ.get("PET_NPROC_PER_NODE", "").strip()
    return int(raw) if _DIGITS.fullmatch(raw) and int(raw) > 0 else None


class KubeflowEnvironment(ClusterEnvironment):
    """Kubeflow PyTorchJob: rank = pod index, world size = number of pods."""

    name: ClassVar[str] = "kubeflow"
    priority: ClassVar[int] = 40

    def _detect(self, environ: Mapping[str, str]) -> bool:
        # torchrun exports the same names per worker; its own markers tell its
        # workers apart from a pod's single process.
        if any(marker in environ for marker in TORCHELASTIC_MARKERS):
            return False
        return all(name in environ for name in _REQUIRED) or _ELASTIC in environ

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        if _ELASTIC in environ and "RANK" not in environ:
            return self._read_elastic(environ)
        reasons = ["MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set without torchrun's markers"]
        evidence = sorted(k for k in environ if k.startswith("PET_"))
        if evidence:
            reasons.append(f"{', '.join(evidence)} set: a Kubeflow PyTorchJob pod")
        kubernetes = "KUBERNETES_SERVICE_HOST" in environ
        if kubernetes:
            reasons.append("KUBERNETES_SERVICE_HOST set: running in a Kubernetes pod")
        if not evidence and not kubernetes:
            reasons.append("no Kubernetes variables: read as a manual one-process-per-node launch")

        rank = read_int(environ, "RANK", why=_WHY, fix=_FIX)
        node_rank = read_optional_int(environ, "PET_NODE_RANK", fix=_FIX)
        if node_rank is not None and node_rank.value != rank.value:
            raise malformed(
                "PET_NODE_RANK",
                environ["PET_NODE_RANK"],
                f"the pod's index, equal to {rank.source} as the training operator sets both",
                _FIX,
            )
        world = read_int(environ, "WORLD_SIZE", why=_WHY, fix=_FIX, minimum=1)

        # Only a numeric nprocPerNode multiplied WORLD_SIZE (the operator counts the
        # others as 1).
        nproc = _nproc(environ)
        nnodes_raw = environ.get("PET_NNODES", "").strip()
        if _DIGITS.fullmatch(nnodes_raw):
            num_nodes = Value(int(nnodes_raw), f"PET_NNODES={nnodes_raw}")
        elif nproc is not None and nproc > 1 and world.value % nproc == 0:
            n = world.value // nproc
            num_nodes = Value(n, f"{n} pods (derived: WORLD_SIZE // PET_NPROC_PER_NODE)")
        else:
            num_nodes = Value(world.value, f"{world.source} pods")
        if num_nodes.value != world.value:
            reasons.append(
                f"{world.source} counts processes (PET_NPROC_PER_NODE="
                f"{environ.get('PET_NPROC_PER_NODE', '')!r} per pod); the job has "
                f"{num_nodes.value} pods"
            )
        reasons.append(f"{rank.source}: pod {rank.value} of {num_nodes.value}")

        addr, port = self._master(environ)
        reasons.append(f"master {addr}, {port.source}")
        pod = environ.get("HOSTNAME", "")
        job = job_name_from_pod(pod) if kubernetes or evidence else None
        # The pod is one process: the launcher starts the workers.
        zero = Value(0, "local rank 0 (one process per pod)")
        one = Value(1, "local world size 1 (one process per pod)")
        return build_env(
            kind=self.name,
            rank=rank,
            local_rank=zero,
            world_size=num_nodes,
            local_world_size=one,
            node_rank=rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            reasons=reasons,
            fix=_FIX,
            per_node=True,
            procs_per_node_hint=nproc,
            job_id=job,
        )

    @staticmethod
    def _master(environ: Mapping[str, str]) -> tuple[str, Value]:
        """MASTER_ADDR/PORT, or the PET_MASTER_* copies where only those are set."""
        for addr_name, port_name in (
            ("MASTER_ADDR", "MASTER_PORT"),
            ("PET_MASTER_ADDR", "PET_MASTER_PORT"),
        ):
            addr = environ.get(addr_name, "").strip()
            if not addr:
                continue
            raw = environ.get(port_name, "").strip()
            if not raw:
                raise missing(port_name, f"{addr_name} is set and {_WHY}", _FIX)
            if addr_name == "MASTER_ADDR":
                # The default is never used: MASTER_PORT was just checked to be set.
                return addr, read_master_port(environ, default_port(), fix=_FIX)
            if not _DIGITS.fullmatch(raw) or not 0 < int(raw) < 65536:
                raise malformed(port_name, environ[port_name], "a TCP port 1..65535", _FIX)
            return addr, Value(int(raw), f"{port_name}={raw}")
        raise missing("MASTER_ADDR", _WHY, _FIX)

    def _read_elastic(self, environ: Mapping[str, str]) -> ClusterEnv:
        endpoint = environ[_ELASTIC].strip()
        match = _ENDPOINT.fullmatch(endpoint)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise malformed(
                _ELASTIC, environ[_ELASTIC], "HOST:PORT of the rendezvous", _ELASTIC_FIX
            )
        host, port = match.group(1).strip("[]"), int(match.group(2))
        nnodes = environ.get("PET_NNODES", "").strip()
        counts = _NNODES.fullmatch(nnodes)
        if not nnodes:
            raise missing("PET_NNODES", f"{_ELASTIC} is set and {_WHY}", _ELASTIC_FIX)
        lo = int(counts.group(1)) if counts else 0
        hi = int(counts.group(2) or lo) if counts else 0
        if counts is None or not 0 < lo <= hi:
            raise malformed(
                "PET_NNODES",
                environ["PET_NNODES"],
                'a node count "N" or range "MIN:MAX"',
                _ELASTIC_FIX,
            )
        restarts = read_optional_int(environ, "PET_MAX_RESTARTS", fix=_ELASTIC_FIX)
        backend = environ.get("PET_RDZV_BACKEND", "").strip() or "c10d"
        run_id = environ.get("PET_RDZV_ID", "").strip() or None
        job = job_name_from_pod(environ.get("HOSTNAME", ""))
        rendezvous = Rendezvous(
            endpoint=endpoint,
            nnodes=nnodes,
            backend=backend,
            run_id=run_id or job,
            conf=environ.get("PET_RDZV_CONF", "").strip() or None,
            max_restarts=None if restarts is None else restarts.value,
        )
        reasons = [
            f"{_ELASTIC}={endpoint!r}, PET_NNODES={nnodes!r}, PET_RDZV_BACKEND={backend!r}: "
            "an elastic Kubeflow PyTorchJob pod; node ranks come from the rendezvous",
        ]
        if restarts is not None:
            reasons.append(f"{restarts.source}: restarts asked for by the elasticPolicy")
        zero = Value(0, "this pod's place is decided by the rendezvous")
        one = Value(1, "one process per pod")
        return build_env(
            kind=self.name,
            rank=zero,
            local_rank=zero,
            world_size=one,
            local_world_size=one,
            node_rank=zero,
            num_nodes=one,
            master_addr=host,
            master_port=Value(port, f"{_ELASTIC} port {port}"),
            reasons=reasons,
            fix=_ELASTIC_FIX,
            per_node=True,
            procs_per_node_hint=_nproc(environ),
            job_id=job,
            rendezvous=rendezvous,
        )
