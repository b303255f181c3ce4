"""Job files for clusters, each the inverse of a reader in scaletrain.env.

- `sbatch`: a Slurm batch script (scaletrain.env.slurm reads what srun then sets);
- `pytorchjob`: a Kubeflow PyTorchJob manifest (scaletrain.env.kubeflow);
- `sagemaker`: a SageMaker training-job definition (scaletrain.env.sagemaker).

`scaletrain job KIND [options] [train flags]` writes one (scaletrain.launch.jobs.cli).
"""

from scaletrain.launch.jobs.pytorchjob import (
    PyTorchJobOptions,
    pytorchjob_manifest,
    write_pytorchjob,
)
from scaletrain.launch.jobs.sagemaker import SageMakerOptions, training_job, write_sagemaker
from scaletrain.launch.jobs.sbatch import SbatchOptions, write_sbatch
from scaletrain.launch.jobs.spec import JobSpec, job_spec, train_arguments

__all__ = [
    "JobSpec",
    "PyTorchJobOptions",
    "SageMakerOptions",
    "SbatchOptions",
    "job_spec",
    "pytorchjob_manifest",
    "train_arguments",
    "training_job",
    "write_pytorchjob",
    "write_sagemaker",
    "write_sbatch",
]
