"""Data for distributed training: a resumable sharded sampler, its loader, dataset readers."""

from scaletrain.data.cifar import read_cifar_batch
from scaletrain.data.datasets import (
    CLASSES,
    DATASETS,
    NORMALIZATION,
    SPLITS,
    ImageClassificationDataset,
    find_dataset_dir,
    load_dataset,
)
from scaletrain.data.idx import read_idx
from scaletrain.data.loader import ShardedLoader
from scaletrain.data.sampler import ShardedSampler

__all__ = [
    "CLASSES",
    "DATASETS",
    "NORMALIZATION",
    "SPLITS",
    "ImageClassificationDataset",
    "ShardedLoader",
    "ShardedSampler",
    "find_dataset_dir",
    "load_dataset",
    "read_cifar_batch",
    "read_idx",
]
