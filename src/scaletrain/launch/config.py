"""What `scaletrain launch` needs to know: how many processes, on how many nodes, met where.

Validation happens here, before torch is imported, so a typo in a flag is reported in
one sentence instead of as an AssertionError from deep inside `torch.distributed.run`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from scaletrain.env.network import node_range, split_endpoint
from scaletrain.errors import ConfigError

__all__ = [
    "DEFAULT_RDZV_ID",
    "DEFAULT_RDZV_TIMEOUT_S",
    "LaunchConfig",
    "parse_endpoint",
    "parse_nnodes",
]

DEFAULT_RDZV_ID = "scaletrain"
DEFAULT_RDZV_TIMEOUT_S = 600
"""torch's own default join timeout for the c10d and static rendezvous."""

# torchrun's --redirects/--tee syntax: one digit for all local ranks (0 none, 1 stdout,
# 2 stderr, 3 both) or a per-local-rank map like "0:3,1:0".
_STD_RE = re.compile(r"^(?:[0-3]|\d+:[0-3](?:,\d+:[0-3])*)$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """Parse "N" or "MIN:MAX" into (min_nodes, max_nodes), raising ConfigError if invalid."""
    try:
        return node_range(nnodes)
    except ValueError as exc:
        raise ConfigError(
            f"--nnodes {nnodes!r} is not a node count: {exc}. Expected a positive integer "
            f'such as "2", or an elastic range "MIN:MAX" such as "1:4" with the smaller number '
            f"first. Fix: pass e.g. --nnodes 2, or --nnodes 1:4."
        ) from None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split "HOST:PORT" (or "[IPv6]:PORT") into (host, port), raising ConfigError if invalid."""
    try:
        return split_endpoint(endpoint)
    except ValueError as exc:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT ({exc}). Expected the address of "
            f"node 0 and a TCP port in 1..65535 that every node can reach, e.g. "
            f'"10.0.0.1:29500", "node0.cluster:29500" or "[fd00::1]:29500". '
            f"Fix: pass the same --rdzv-endpoint HOST:PORT on every node."
        ) from None


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Options of `scaletrain launch`: each field is one flag (launch/cli.py makes them
    from these declarations, the docstrings their help) and one torchrun option."""

    nproc_per_node: int | None = None
    """Worker processes on this node (default: the scheduler's hint, else one per GPU, 2 on CPU)"""
    nnodes: str | None = None
    """Number of nodes, or an elastic range MIN:MAX such as 1:4 (default: 1, or the per-node scheduler's count)"""
    node_rank: int | None = None
    """This node's index; node 0 hosts the rendezvous store at --rdzv-endpoint (default: torch's rendezvous numbers the nodes)"""
    rdzv_endpoint: str | None = None
    """HOST:PORT where the nodes meet, node 0's address and a free port, the same on every node (default on one node: a free local port)"""
    rdzv_id: str | None = None
    """Job id, the same on every node (default: $SCALETRAIN_RDZV_ID, the scheduler's job id, else 'scaletrain')"""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (default: the address of the interface that routes to them, never what the host name resolves to)"""
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    """Seconds to wait for the rendezvous store to be reachable and for every node to join"""
    max_restarts: int | None = None
    """Restart the worker group up to this many times after a worker fails (default: the platform's, e.g. a Kubeflow elasticPolicy's, else 0)"""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers' health"""
    log_dir: str | None = None
    """Directory for the workers' log and error files (default: a temporary directory)"""
    redirects: str = "0"
    """Write worker output to files in --log-dir: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank as 0:3,1:0"""
    run_as_module: bool = False
    """Run SCRIPT as a module, like python -m"""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables set for every worker process, on top of the launcher's own."""
    cluster: str | None = None
    """Which cluster environment to read, by name ("local", "slurm", ...); None or
    "auto": detect it. "local" runs here as one node, even inside a Slurm batch script."""

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and (
            isinstance(self.nproc_per_node, bool)
            or not isinstance(self.nproc_per_node, int)
            or self.nproc_per_node < 1
        ):
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node!r} is not a process count. Expected an "
                f"integer >= 1 (usually the number of GPUs per node). Fix: pass e.g. "
                f"--nproc-per-node 2, or leave it out to use one process per GPU (2 on CPU)."
            )
        max_nodes = 1
        if self.nnodes is not None:
            _, max_nodes = parse_nnodes(self.nnodes)
        if self.node_rank is not None and not 0 <= self.node_rank < max_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is outside the job: with --nnodes "
                f"{self.nnodes or '1'} it must be in 0..{max_nodes - 1}. Fix: give node 0 "
                f"(the one that hosts the rendezvous store) --node-rank 0 and the others "
                f"1, 2, ..., or raise --nnodes."
            )
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.rdzv_id is not None and (
            not self.rdzv_id or any(c.isspace() for c in self.rdzv_id)
        ):
            raise ConfigError(
                f"--rdzv-id {self.rdzv_id!r} is not usable. Expected a non-empty string without "
                f"spaces, the same on every node (e.g. the scheduler's job id). Fix: pass e.g. "
                f"--rdzv-id job42."
            )
        if self.max_restarts is not None and (
            isinstance(self.max_restarts, bool) or self.max_restarts < 0
        ):
            raise ConfigError(
                f"--max-restarts {self.max_restarts!r} is negative. Expected an integer >= 0 "
                f"(0 means a failed worker ends the job). Fix: pass e.g. --max-restarts 3."
            )
        if isinstance(self.rdzv_timeout, bool) or self.rdzv_timeout < 1:
            raise ConfigError(
                f"--rdzv-timeout {self.rdzv_timeout!r} is too small. Expected whole seconds "
                f">= 1 to wait for the other nodes. Fix: pass e.g. --rdzv-timeout 600."
            )
        if not 0 < self.monitor_interval < math.inf:
            raise ConfigError(
                f"--monitor-interval {self.monitor_interval!r} must be a positive, finite number of "
                f"seconds. Fix: leave it out (0.1) or pass e.g. --monitor-interval 1."
            )
        if not _STD_RE.match(self.redirects):
            raise ConfigError(
                f"--redirects {self.redirects!r} is not understood. Expected 0 (none), "
                f'1 (stdout), 2 (stderr), 3 (both), or a per-local-rank map like "0:3,1:0". '
                f"Fix: pass e.g. --redirects 3 --log-dir logs."
            )
        if self.local_addr is not None and (
            not self.local_addr.strip() or any(c.isspace() for c in self.local_addr)
        ):
            raise ConfigError(
                f"--local-addr {self.local_addr!r} is not an address. Expected this node's IP "
                f"or host name as the other nodes reach it. Fix: pass e.g. --local-addr "
                f"10.0.0.2, or leave it out to use the interface that routes to node 0."
            )
        if self.cluster is not None:
            from scaletrain.env import ENVIRONMENTS

            known = ("auto", *ENVIRONMENTS)
            if self.cluster not in known:
                raise ConfigError(
                    f"--env {self.cluster!r} is neither NAME=VALUE (a variable for the "
                    f"workers) nor a cluster environment. Expected one of {', '.join(known)}. "
                    f"Fix: pass e.g. --env local to run here as one node, or --env "
                    f"NCCL_DEBUG=INFO to set a variable."
                )
        for key, value in self.extra_env.items():
            if not isinstance(key, str) or not _ENV_KEY_RE.match(key) or not isinstance(value, str):
                raise ConfigError(
                    f"extra_env entry {key!r}={value!r} is not an environment variable. "
                    f"Expected a NAME made of letters, digits and '_' mapped to a string. "
                    f"Fix: pass e.g. --env NCCL_DEBUG=INFO."
                )
