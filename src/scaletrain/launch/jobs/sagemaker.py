"""A SageMaker training-job definition: the inverse of scaletrain.env.sagemaker.

The definition is a CreateTrainingJob request (`aws sagemaker create-training-job
--cli-input-json file://training-job.json`) for SageMaker's PyTorch containers with
the `torch_distributed` distribution, which the Python SDK writes as the
hyperparameter `sagemaker_torch_distributed_enabled: true`. What the platform then
does on each of the InstanceCount hosts ("algo-1", "algo-2", ...), in the
sagemaker-training-toolkit (environment.py, runner.py, torch_distributed.py):

- it sets SM_HOSTS, SM_CURRENT_HOST, SM_NUM_GPUS, SM_NUM_CPUS, SM_MODEL_DIR
  (/opt/ml/model, uploaded to S3OutputPath when the job ends), ...;
- it runs `torchrun --nnodes HOSTS --nproc_per_node P --master_addr algo-1
  --master_port 7777 --node_rank I ENTRY ARGS`, with P = the host's GPUs (1 on a CPU
  instance) and ARGS the hyperparameters as `--key value`, keys sorted.

ENTRY is `scaletrain_entry.py` (written beside the definition, to upload as the
source directory): it turns the hyperparameters back into `scaletrain train` flags
(`--async-save True` into `--async-save`) and runs it. Every worker is then a
torchrun rank, and the run directory defaults to SM_MODEL_DIR.

SM_MODEL_DIR is uploaded only when the job ends, so with `--checkpoint-s3` the run
lives where SageMaker syncs checkpoints instead (CheckpointConfig.LocalPath,
/opt/ml/checkpoints): SageMaker copies that folder to S3 while the job runs and back
onto every host before a restarted or spot-interrupted job starts again, which then
resumes. Each host keeps its run in LocalPath/<host> (the hosts' folders meet in one
S3 prefix; files of the same name would overwrite each other there), and the entry
copies the finished run, checkpoints aside, into SM_MODEL_DIR for the job's output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.launch.jobs.spec import JobSpec

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_VARIABLE",
    "ENTRY_POINT",
    "ENTRY_SOURCE",
    "SageMakerOptions",
    "sagemaker_warnings",
    "training_job",
    "write_sagemaker",
]

CHECKPOINT_DIR = "/opt/ml/checkpoints"
"""CheckpointConfig.LocalPath: the folder SageMaker syncs with the checkpoint S3 URI."""
CHECKPOINT_VARIABLE = "SCALETRAIN_SAGEMAKER_CHECKPOINTS"
"""The job's environment variable that tells the entry point that folder."""

ENTRY_POINT = "scaletrain_entry.py"
ENTRY_SOURCE = """\
# The entry point of a SageMaker training job written by `scaletrain job sagemaker`:
# SageMaker's torchrun starts it on every host with the hyperparameters as arguments,
# `--key value` each, booleans as True/False; `scaletrain train` takes `--key` and
# `--no-key` for those.
#
# With checkpoints synced to S3 the job sets SCALETRAIN_SAGEMAKER_CHECKPOINTS to the
# folder SageMaker syncs: each host's run directory is FOLDER/<host>, so a restarted or
# spot-interrupted job finds its checkpoints there again and resumes. When the run
# finishes, rank 0 copies it (checkpoints aside) into SM_MODEL_DIR, the job's output.
import os
import shutil
import sys

from scaletrain.cli import main

args, words = [], sys.argv[1:]
while words:
    word = words.pop(0)
    if word.startswith("--") and words and words[0] in ("True", "False"):
        args.append(word if words.pop(0) == "True" else "--no-" + word[2:])
    else:
        args.append(word)
synced, run = os.environ.get("SCALETRAIN_SAGEMAKER_CHECKPOINTS"), None
if synced and "--out" not in args:
    run = os.path.join(synced, os.environ.get("SM_CURRENT_HOST", "algo-1"))
    args += ["--out", run]
code = main(["train", *args])
model_dir = os.environ.get("SM_MODEL_DIR")
if code == 0 and run and model_dir and os.environ.get("RANK", "0") == "0":
    skip = shutil.ignore_patterns("checkpoints", "pids")
    shutil.copytree(run, model_dir, ignore=skip, dirs_exist_ok=True)
sys.exit(code)
"""

_ROLE = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/.+")
_S3 = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?")
_INSTANCE = re.compile(r"ml\.[a-z0-9]+\.[a-z0-9]+")
_JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
"""CreateTrainingJob's pattern for TrainingJobName (with its length limit, 63: letters,
digits and '-', a letter or digit at each end)."""


@dataclass(frozen=True, slots=True)
class SageMakerOptions:
    """What only a SageMaker training job says."""

    role: str
    """The IAM role SageMaker runs the job as (arn:aws:iam::ACCOUNT:role/NAME)."""
    image: str
    """A SageMaker PyTorch training image with scaletrain installed (ECR URI)."""
    code: str
    """S3 URI of the source directory tarball holding scaletrain_entry.py."""
    output: str
    """S3 URI where SageMaker uploads SM_MODEL_DIR when the job ends."""
    instance_type: str = "ml.g5.xlarge"
    region: str | None = None
    max_run_s: int = 24 * 3600
    checkpoint: str | None = None
    """S3 URI that /opt/ml/checkpoints is synced with, where the run then lives (see the
    module's docstring); None: the run is in SM_MODEL_DIR and a restart starts over."""
    spot: bool = False
    """Managed spot training (EnableManagedSpotTraining): cheaper, may be interrupted."""
    max_wait_s: int | None = None
    """Spot: seconds the job may take in all, waiting for capacity included
    (MaxWaitTimeInSeconds, at least max_run_s); None: twice max_run_s."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, str, Any, str]] = [
            ("--role", self.role, _ROLE, "arn:aws:iam::123456789012:role/SageMakerRole"),
            ("--code", self.code, _S3, "s3://my-bucket/code/sourcedir.tar.gz"),
            ("--output", self.output, _S3, "s3://my-bucket/output"),
            ("--instance-type", self.instance_type, _INSTANCE, "ml.g5.12xlarge"),
        ]
        if self.checkpoint is not None:
            checks.append(("--checkpoint", self.checkpoint, _S3, "s3://my-bucket/ckpt"))
        for flag, value, pattern, example in checks:
            if not pattern.fullmatch(value):
                raise ConfigError(
                    f"{flag} {value!r} is not what SageMaker expects. Expected e.g. {example}. "
                    f"Fix: pass {flag} with that shape."
                )
        if not self.image.strip():
            raise ConfigError("--image is empty. Expected the ECR URI of a PyTorch training image.")
        if self.max_run_s < 60:
            raise ConfigError(f"--max-run {self.max_run_s}: expected seconds >= 60.")
        if self.max_wait_s is not None:
            if not self.spot:
                raise ConfigError(
                    f"--max-wait {self.max_wait_s} bounds a spot job's waiting, but no --spot "
                    "was given. Fix: add --spot, or drop --max-wait."
                )
            if self.max_wait_s < self.max_run_s:
                raise ConfigError(
                    f"--max-wait {self.max_wait_s} is shorter than --max-run {self.max_run_s}; "
                    "SageMaker needs MaxWaitTimeInSeconds >= MaxRuntimeInSeconds (the wait "
                    f"includes the run). Fix: --max-wait {2 * self.max_run_s}, or leave it out."
                )

    @property
    def max_wait(self) -> int:
        """MaxWaitTimeInSeconds of a spot job."""
        return self.max_wait_s if self.max_wait_s is not None else 2 * self.max_run_s


def _hyperparameters(spec: JobSpec, opts: SageMakerOptions) -> dict[str, str]:
    # The SDK stores every value JSON-encoded; the toolkit decodes them.
    hps: dict[str, Any] = {
        "sagemaker_program": ENTRY_POINT,
        "sagemaker_submit_directory": opts.code,
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_container_log_level": 20,
    }
    if opts.region:
        hps["sagemaker_region"] = opts.region
    args = list(spec.train_args)
    while args:
        flag = args.pop(0)
        if flag.startswith("--no-"):
            hps[flag[5:]] = False
        elif args and not args[0].startswith("--"):
            hps[flag[2:]] = args.pop(0)
        else:
            hps[flag[2:]] = True
    return {key: json.dumps(value) for key, value in hps.items()}


def training_job(spec: JobSpec, opts: SageMakerOptions) -> dict[str, Any]:
    """The CreateTrainingJob request as a mapping."""
    if spec.elastic:
        raise ConfigError(
            f"--nnodes {spec.min_nodes}:{spec.max_nodes} is elastic, but a SageMaker training "
            "job runs on a fixed InstanceCount. Fix: pass --nnodes N."
        )
    if not _JOB_NAME.fullmatch(spec.name) or len(spec.name) > 63:
        fixed = re.sub(r"[^a-zA-Z0-9-]", "-", spec.name).strip("-")[:63].strip("-")
        raise ConfigError(
            f"--name {spec.name!r} is not a SageMaker training job name: expected at most 63 "
            "letters, digits and '-', starting and ending with a letter or digit. Fix: "
            f"--name {fixed or 'mnist-ddp'}."
        )
    if opts.checkpoint and spec.config.out is not None:
        raise ConfigError(
            f"--out {spec.config.out} with --checkpoint-s3: the run must live in "
            f"{CHECKPOINT_DIR}, the folder SageMaker syncs with {opts.checkpoint}, or a "
            "restarted job finds nothing to resume. Fix: leave --out out (each host's run is "
            f"{CHECKPOINT_DIR}/<host>; the finished run is copied to SM_MODEL_DIR)."
        )
    job: dict[str, Any] = {
        "TrainingJobName": spec.name,
        "RoleArn": opts.role,
        "AlgorithmSpecification": {"TrainingImage": opts.image, "TrainingInputMode": "File"},
        "HyperParameters": _hyperparameters(spec, opts),
        "ResourceConfig": {
            "InstanceType": opts.instance_type,
            "InstanceCount": spec.max_nodes,
            "VolumeSizeInGB": 50,
        },
        "OutputDataConfig": {"S3OutputPath": opts.output},
        "StoppingCondition": {"MaxRuntimeInSeconds": opts.max_run_s},
    }
    if opts.checkpoint:
        job["CheckpointConfig"] = {"S3Uri": opts.checkpoint, "LocalPath": CHECKPOINT_DIR}
        job["Environment"] = {CHECKPOINT_VARIABLE: CHECKPOINT_DIR}
    if opts.spot:
        job["EnableManagedSpotTraining"] = True
        job["StoppingCondition"]["MaxWaitTimeInSeconds"] = opts.max_wait
    return job


def sagemaker_warnings(spec: JobSpec, opts: SageMakerOptions) -> list[str]:
    """What the job will do that its author may not expect, one line each."""
    if opts.checkpoint is None:
        if not opts.spot:
            return []
        return [
            "--spot without --checkpoint-s3: the run lives in SM_MODEL_DIR, uploaded only "
            "when the job ends, so a job restarted after a spot interruption starts over from "
            "step 0. Add --checkpoint-s3 S3_URI (and --save-every N) to resume."
        ]
    if spec.config.save_every is None:
        return [
            "--checkpoint-s3 without --save-every: checkpoints are written only when the job "
            "is stopped (SIGTERM), so a crash starts over from step 0. Add --save-every N."
        ]
    return []


def write_sagemaker(spec: JobSpec, opts: SageMakerOptions) -> str:
    """The definition as JSON (CreateTrainingJob's --cli-input-json)."""
    return json.dumps(training_job(spec, opts), indent=2) + "\n"
