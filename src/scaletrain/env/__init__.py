"""Where am I running? One reader per cluster kind, and `detect` to pick one.

Readers are tried in priority order and the first whose variables are present
wins. The order puts the innermost launcher first: torchrun under srun, or
mpirun inside a Slurm allocation, describe the process better than the
scheduler around them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from scaletrain.env.base import ClusterEnv, ClusterEnvironment
from scaletrain.env.kubeflow import KubeflowEnvironment
from scaletrain.env.local import LocalEnvironment
from scaletrain.env.mpi import MPIEnvironment
from scaletrain.env.sagemaker import SageMakerEnvironment
from scaletrain.env.slurm import SlurmEnvironment, expand_nodelist
from scaletrain.env.torchelastic import TorchElasticEnvironment
from scaletrain.errors import ConfigError

__all__ = [
    "ENVIRONMENTS",
    "ClusterEnv",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SageMakerEnvironment",
    "SlurmEnvironment",
    "TorchElasticEnvironment",
    "detect",
    "expand_nodelist",
    "job_id",
]

_KINDS: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SlurmEnvironment,
    MPIEnvironment,
    SageMakerEnvironment,
    KubeflowEnvironment,
    LocalEnvironment,
)

ENVIRONMENTS: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls for cls in sorted(_KINDS, key=lambda cls: cls.priority)
}
"""User-facing name -> reader class, in the order `detect` tries them."""

_AUTO = ("auto", "")

# An explicit id first; then the schedulers' own, for a process whose reader has none
# (a torchrun worker inside a Slurm job or a SageMaker host).
_JOB_ID_VARS = ("SCALETRAIN_JOB_ID", "SLURM_JOB_ID", "TRAINING_JOB_NAME")


def job_id(environ: Mapping[str, str], found: ClusterEnv | None = None) -> str | None:
    """The job's id, the same in every process of the job and across its requeues:
    $SCALETRAIN_JOB_ID, else what the reader found, else Slurm's or SageMaker's id."""
    explicit = environ.get("SCALETRAIN_JOB_ID", "").strip()
    if explicit:
        return explicit
    if found is not None and found.job_id:
        return found.job_id
    for name in _JOB_ID_VARS[1:]:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def _with_job_id(found: ClusterEnv, environ: Mapping[str, str]) -> ClusterEnv:
    job = job_id(environ, found)
    return found if job == found.job_id else dataclasses.replace(found, job_id=job)


def detect(environ: Mapping[str, str] | None = None, kind: str | None = None) -> ClusterEnv:
    """Read this process's place in the job from its environment variables.

    environ: the variables to read; default `os.environ`.
    kind: force one reader by name (see ENVIRONMENTS); None or "auto" detects.
    Raises ConfigError for an unknown kind and EnvironmentDetectionError where
    the chosen kind's variables are missing, malformed or inconsistent.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if kind is not None and kind.strip().lower() not in _AUTO:
        name = kind.strip().lower()
        if name not in ENVIRONMENTS:
            known = ", ".join(ENVIRONMENTS)
            raise ConfigError(
                f"unknown cluster environment {kind!r}: expected one of {known} (or 'auto'). "
                "Fix: pass one of those names, or leave it unset to detect."
            )
        found = ENVIRONMENTS[name]().read(env)
        found = dataclasses.replace(found, reasons=(f"kind {name!r} forced", *found.reasons))
        return _with_job_id(found, env)

    readers = [cls() for cls in ENVIRONMENTS.values()]
    matching = [reader for reader in readers if reader.detect(env)]
    # LocalEnvironment always matches, so `matching` is never empty.
    chosen = matching[0]
    found = _with_job_id(chosen.read(env), env)
    others = [r.name for r in matching[1:] if not isinstance(r, LocalEnvironment)]
    if not others:
        return found
    # Say what else matched, so `scaletrain env` explains a surprising choice.
    note = f"also matches {', '.join(others)}; {chosen.name} has priority as the inner launcher"
    return dataclasses.replace(found, reasons=(*found.reasons, note))
