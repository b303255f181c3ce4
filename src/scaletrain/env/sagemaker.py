"""Amazon SageMaker training jobs: one process per host, started by the platform.

SageMaker runs the entry point once on every host ("algo-1", "algo-2", ...)
and says only which hosts exist and which one this is. The launcher then
starts one worker per device (`per_node=True`). Where SageMaker itself runs
torchrun or mpirun (its `distribution` option), those readers win first.

Workers per host follow the SageMaker training toolkit's own rule
(sagemaker_training/runner.py): one per GPU, else one per Neuron core, else ONE
on a CPU instance. SM_NUM_CPUS counts cores, not workers: 96 worker processes on
an ml.c5.24xlarge would each get one core and a share of the batch too small to
be worth the communication.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    Value,
    build_env,
    default_port,
    malformed,
    missing,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment

__all__ = ["SageMakerEnvironment", "model_dir"]

_WHY = "SageMaker sets it in every training container"
_FIX = (
    "these variables come from the SageMaker training toolkit; run the job through "
    "SageMaker (an Estimator) rather than setting SM_* by hand, or unset them to run locally"
)


def model_dir(environ: Mapping[str, str]) -> str | None:
    """SM_MODEL_DIR: what SageMaker uploads to S3 when the job ends (/opt/ml/model on
    each host), whichever launcher runs inside the container; None outside SageMaker."""
    value = environ.get("SM_MODEL_DIR", "").strip()
    return value or None


def _read_hosts(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("SM_HOSTS")
    if raw is None:
        raise missing("SM_HOSTS", _WHY, _FIX)
    expected = 'a JSON list of distinct host names, e.g. ["algo-1", "algo-2"]'
    try:
        hosts = json.loads(raw)
    except json.JSONDecodeError:
        raise malformed("SM_HOSTS", raw, expected, _FIX) from None
    if (
        not isinstance(hosts, list)
        or not hosts
        or not all(isinstance(h, str) and h for h in hosts)
        or len(set(hosts)) != len(hosts)
    ):
        raise malformed("SM_HOSTS", raw, expected, _FIX)
    return hosts


class SageMakerEnvironment(ClusterEnvironment):
    """SageMaker: rank = index of this host in SM_HOSTS, one process per host."""

    name: ClassVar[str] = "sagemaker"
    priority: ClassVar[int] = 30

    def _detect(self, environ: Mapping[str, str]) -> bool:
        return "SM_HOSTS" in environ or "SM_CURRENT_HOST" in environ

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        hosts = _read_hosts(environ)
        current = environ.get("SM_CURRENT_HOST")
        if current is None:
            raise missing("SM_CURRENT_HOST", _WHY, _FIX)
        if current not in hosts:
            raise malformed(
                "SM_CURRENT_HOST",
                current,
                f"one of the hosts in SM_HOSTS={environ['SM_HOSTS']!r}",
                _FIX,
            )
        index = hosts.index(current)
        reasons = [
            f"SM_HOSTS={environ['SM_HOSTS']!r}, SM_CURRENT_HOST={current!r}: "
            f"host {index} of {len(hosts)} of a SageMaker job",
        ]

        gpus = read_optional_int(environ, "SM_NUM_GPUS", fix=_FIX)
        neurons = read_optional_int(environ, "SM_NUM_NEURONS", fix=_FIX)
        cpus = read_optional_int(environ, "SM_NUM_CPUS", fix=_FIX)
        if gpus is not None and gpus.value > 0:
            hint = gpus.value
            reasons.append(f"{gpus.source}: one worker per GPU")
        elif neurons is not None and neurons.value > 0:
            hint = neurons.value
            reasons.append(f"{neurons.source}: one worker per Neuron core")
        else:
            hint = 1
            cores = f" ({cpus.source} are its threads)" if cpus is not None else ""
            reasons.append(f"no GPU: one worker per host, as SageMaker's toolkit runs{cores}")

        node = Value(index, f"SM_CURRENT_HOST={current!r} (index {index})")
        nodes = Value(len(hosts), f"{len(hosts)} hosts in SM_HOSTS")
        # SageMaker starts one process per host; workers come from our launcher.
        zero = Value(0, "local rank 0 (one process per host)")
        one = Value(1, "local world size 1 (one process per host)")
        port = read_master_port(environ, default_port(), fix=_FIX)
        reasons.append(f"master {hosts[0]} (first host in SM_HOSTS), {port.source}")

        return build_env(
            kind=self.name,
            rank=node,
            local_rank=zero,
            world_size=nodes,
            local_world_size=one,
            node_rank=node,
            num_nodes=nodes,
            master_addr=hosts[0],
            master_port=port,
            reasons=reasons,
            fix=_FIX,
            per_node=True,
            procs_per_node_hint=hint,
            job_id=environ.get("TRAINING_JOB_NAME", "").strip() or None,
            hosts=hosts,
        )
