"""Process groups, backend and device choice, and collectives for metrics."""

from scaletrain.dist.backend import BACKENDS, choose_backend, choose_device
from scaletrain.dist.collectives import REDUCE_OPS, barrier, rank_first, reduce_values
from scaletrain.dist.grad_norm import global_grad_norm
from scaletrain.dist.process_group import (
    DEFAULT_TIMEOUT_S,
    claim_first,
    destroy,
    init_process_group,
    is_initialized,
)
from scaletrain.dist.sync_batchnorm import SyncBatchNorm

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "REDUCE_OPS",
    "SyncBatchNorm",
    "barrier",
    "choose_backend",
    "choose_device",
    "claim_first",
    "destroy",
    "global_grad_norm",
    "init_process_group",
    "is_initialized",
    "rank_first",
    "reduce_values",
]
