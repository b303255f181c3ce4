"""`scaletrain job sbatch|pytorchjob|sagemaker [options] [train flags]`: write a job file.

Each kind takes the job's own options (nodes, GPUs, time, image...) and every
`scaletrain train` flag except the node flags, which the job file says in the
scheduler's terms. The settings are checked as `scaletrain train` checks them, before
anything is written, and an existing file is never replaced without --force.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError

__all__ = ["KINDS", "add_job_parsers", "run_job"]

KINDS = ("sbatch", "pytorchjob", "sagemaker")


_JOB_ELSEWHERE = {
    "--nproc-per-node": "--gpus-per-node G for a GPU job (one process per GPU), or --nproc N "
    "for the processes of each node of a CPU job",
}
"""torchrun's flags a job user brings along, and what to pass (see Parser.elsewhere)."""


def _common(p: argparse.ArgumentParser, default_out: str) -> None:
    from scaletrain.launch.jobs.spec import NODE_FIELDS
    from scaletrain.settings import Parser, add_flags
    from scaletrain.train.config import FLAG_GROUPS, METAVARS, SWITCHES, TrainConfig

    j = p.add_argument_group("the job")
    j.add_argument(
        "-o",
        "--output",
        dest="job_output",
        default=None,
        metavar="PATH",
        help=f"where to write it (default: {default_out}; - for standard output)",
    )
    j.add_argument("--force", action="store_true", help="replace an existing file")
    j.add_argument(
        "--name", default=None, metavar="NAME", help="job name (default: scaletrain-<recipe>)"
    )
    j.add_argument(
        "--nnodes",
        dest="job_nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="nodes (MIN:MAX: an elastic job where the scheduler has them)",
    )
    j.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        metavar="G",
        help="GPUs per node (default: 0, a CPU job); one training process per GPU",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file of train settings (the flags of `scaletrain train`, in the "
        "sections below); flags given too win",
    )
    add_flags(
        p, TrainConfig, metavars=METAVARS, exclude=NODE_FIELDS, groups=FLAG_GROUPS,
        switches=SWITCHES,
    )  # fmt: skip
    if isinstance(p, Parser):
        p.elsewhere = {**p.elsewhere, **_JOB_ELSEWHERE}


def add_job_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kinds = sub.add_parser(
        "job",
        help="write a job file for a cluster: sbatch script, Kubeflow PyTorchJob, SageMaker job",
        description=(
            "Write a file that runs `scaletrain train` with the given flags on a cluster. "
            "Each kind is the inverse of how scaletrain reads that cluster: what the file "
            "asks for is what every process reads back."
        ),
    )
    actions = kinds.add_subparsers(dest="kind", metavar="KIND", required=True)
    s = actions.add_parser("sbatch", help="a Slurm batch script (sbatch FILE)")
    _common(s, "<name>.sbatch")
    g = s.add_argument_group("slurm")
    g.add_argument("--time", default=None, metavar="D-HH:MM:SS", help="time limit")
    g.add_argument("--partition", default=None)
    g.add_argument("--account", default=None)
    g.add_argument(
        "--cpus-per-task", type=int, default=None, metavar="C", help="CPUs per training process"
    )
    g.add_argument(
        "--signal-seconds",
        type=int,
        default=90,
        metavar="S",
        help="save and requeue this many seconds before the time limit (default 90)",
    )
    g.add_argument(
        "--python",
        default=sys.executable,
        metavar="PATH",
        help="python on the compute nodes (default: this one, for a shared filesystem)",
    )
    g.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line to run before srun (module load ..., repeatable)",
    )
    k = actions.add_parser("pytorchjob", help="a Kubeflow PyTorchJob (kubectl apply -f FILE)")
    _common(k, "<name>.yaml")
    g = k.add_argument_group("kubeflow")
    g.add_argument("--image", required=True, help="container image with scaletrain installed")
    g.add_argument("--namespace", default=None)
    g.add_argument("--port", type=int, default=23456, help="rendezvous port (default 23456)")
    g.add_argument(
        "--pvc",
        default=None,
        metavar="CLAIM",
        help="PersistentVolumeClaim mounted at /runs for the run directory",
    )
    g.add_argument(
        "--cpu",
        default=None,
        metavar="C",
        help="CPUs requested per pod, e.g. 8 or 500m (default: one per process and loader worker)",
    )
    g.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help="memory requested per pod, e.g. 16Gi (default: 2Gi per process)",
    )
    g.add_argument(
        "--elastic-restarts",
        type=int,
        default=3,
        metavar="K",
        help="elastic jobs: worker-group restarts before failing (default 3)",
    )
    m = actions.add_parser("sagemaker", help="a SageMaker training job (create-training-job)")
    _common(m, "<name>-sagemaker/")
    g = m.add_argument_group("sagemaker")
    g.add_argument("--role", required=True, metavar="ARN", help="IAM role the job runs as")
    g.add_argument("--image", required=True, metavar="URI", help="PyTorch training image (ECR)")
    g.add_argument(
        "--code",
        required=True,
        metavar="S3_URI",
        help="where you upload the source directory tarball (sourcedir.tar.gz)",
    )
    g.add_argument(
        "--output-s3", required=True, metavar="S3_URI", help="where SageMaker uploads SM_MODEL_DIR"
    )
    g.add_argument("--instance-type", default="ml.g5.xlarge")
    g.add_argument("--region", default=None)
    g.add_argument("--max-run", type=int, default=24 * 3600, metavar="S", help="seconds")
    g.add_argument(
        "--checkpoint-s3",
        default=None,
        metavar="S3_URI",
        help="S3 URI synced with /opt/ml/checkpoints, where the run then lives: a restarted "
        "or spot job resumes (the finished run is copied to SM_MODEL_DIR)",
    )
    g.add_argument(
        "--spot",
        action="store_true",
        help="managed spot training (EnableManagedSpotTraining); with --checkpoint-s3 an "
        "interrupted job resumes",
    )
    g.add_argument(
        "--max-wait",
        type=int,
        default=None,
        metavar="S",
        help="spot: seconds for the whole job, waits for capacity included (default: twice "
        "--max-run)",
    )


def _write(path: Path, text: str, force: bool) -> None:
    if path.exists() and not force:
        raise ConfigError(
            f"{path} already exists, and a job file is never replaced silently. Fix: pass "
            f"-o with another path, or --force to replace it."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_job(ns: argparse.Namespace, train_config: Callable[[argparse.Namespace], Any]) -> int:
    """Write the job file `ns` describes; `train_config` builds the TrainConfig from the
    train flags (and --config) as `scaletrain train` does."""
    from scaletrain.launch.jobs.spec import job_spec

    config = train_config(ns)
    spec = job_spec(config, nnodes=ns.job_nnodes, name=ns.name, gpus_per_node=ns.gpus_per_node)
    notes: list[str] = []
    if ns.kind == "sbatch":
        from scaletrain.launch.jobs.sbatch import SbatchOptions, write_sbatch

        text = write_sbatch(spec, SbatchOptions(
            time=ns.time, partition=ns.partition, account=ns.account,
            cpus_per_task=ns.cpus_per_task, signal_s=ns.signal_seconds, python=ns.python,
            setup=tuple(ns.setup),
        ))  # fmt: skip
        files = {Path(ns.job_output or f"{spec.name}.sbatch"): text}
        how = "sbatch {}"
    elif ns.kind == "pytorchjob":
        from scaletrain.launch.jobs.pytorchjob import (
            PyTorchJobOptions,
            pytorchjob_warnings,
            write_pytorchjob,
        )

        k8s = PyTorchJobOptions(
            image=ns.image, namespace=ns.namespace, port=ns.port, pvc=ns.pvc,
            max_restarts=ns.elastic_restarts, cpu=ns.cpu, memory=ns.memory,
        )  # fmt: skip
        text = write_pytorchjob(spec, k8s)
        notes = pytorchjob_warnings(spec, k8s)
        files = {Path(ns.job_output or f"{spec.name}.yaml"): text}
        how = "kubectl apply -f {}"
    else:
        from scaletrain.launch.jobs.sagemaker import (
            ENTRY_POINT,
            ENTRY_SOURCE,
            SageMakerOptions,
            sagemaker_warnings,
            write_sagemaker,
        )

        sm = SageMakerOptions(
            role=ns.role, image=ns.image, code=ns.code, output=ns.output_s3,
            instance_type=ns.instance_type, region=ns.region, max_run_s=ns.max_run,
            checkpoint=ns.checkpoint_s3, spot=ns.spot, max_wait_s=ns.max_wait,
        )  # fmt: skip
        text = write_sagemaker(spec, sm)
        notes = sagemaker_warnings(spec, sm)
        folder = Path(ns.job_output or f"{spec.name}-sagemaker")
        files = {folder / "training-job.json": text, folder / "code" / ENTRY_POINT: ENTRY_SOURCE}
        how = (
            f"tar -czf sourcedir.tar.gz -C {folder / 'code'} . && aws s3 cp sourcedir.tar.gz "
            f"{ns.code} && aws sagemaker create-training-job --cli-input-json file://{{}}"
        )
    for note in notes:
        print(f"scaletrain: warning: {note}", file=sys.stderr)
    if ns.job_output == "-":
        sys.stdout.write(text)
        return 0
    for path in files:
        if path.exists() and not ns.force:
            _write(path, "", force=False)  # raises with the message
    for path, content in files.items():
        _write(path, content, force=True)
    first = next(iter(files))
    print(f"wrote {', '.join(map(str, files))}; submit with: {how.format(first)}", file=sys.stderr)
    return 0
