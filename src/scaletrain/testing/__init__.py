"""Helpers for testing distributed training code. Public: users test with them.

run_ranks runs a function on N real ranks, as torchrun would start them; the
dataset writers make small files in the published MNIST / CIFAR formats.
"""

from scaletrain.testing.datasets import write_cifar, write_fake_mnist, write_idx
from scaletrain.testing.ranks import (
    RankFailure,
    free_port,
    launcher_free_env,
    launcher_variables,
    run_ranks,
)

__all__ = [
    "RankFailure",
    "free_port",
    "launcher_free_env",
    "launcher_variables",
    "run_ranks",
    "write_cifar",
    "write_fake_mnist",
    "write_idx",
]
