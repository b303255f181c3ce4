"""Shared parsing for the environment readers.

Every reader reports a bad variable the same way: the variable, the value
received, what was expected and the fix. Values keep their source ("RANK=3")
so that a consistency error can cite both variables that disagree.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from scaletrain.env.base import DEFAULT_MASTER_PORT, ClusterEnv, Rendezvous
from scaletrain.errors import EnvironmentDetectionError

__all__ = [
    "LOOPBACK",
    "Value",
    "build_env",
    "default_port",
    "first_set",
    "malformed",
    "missing",
    "port_from_job_id",
    "read_int",
    "read_master_addr",
    "read_master_port",
    "read_optional_int",
]

LOOPBACK = "127.0.0.1"
"""Master address when every process runs on this machine."""

_MAX_PORT = 65535
# Plain decimal only: int() would also accept "+3", " 3 " or "3_000", which no
# launcher writes; taking them would hide a variable the user set by mistake.
_INT = re.compile(r"-?[0-9]+")


PORT_BASE = 15000
# Base + span stays below 32768, where Linux's ephemeral range starts
# (net.ipv4.ip_local_port_range 32768-60999): a port there may already be held
# by some outgoing connection on the master node.
PORT_SPAN = 15000


def port_from_job_id(job_id: int | str) -> int:
    """A port every process of the job computes alike, spread so concurrent jobs differ.

    Numeric ids (Slurm's, Open MPI's) map directly; others (a PMIx namespace) through
    CRC-32, which is the same in every process, unlike Python's salted hash().
    """
    if isinstance(job_id, int):
        number = job_id
    elif job_id.isdigit():
        number = int(job_id)
    else:
        number = zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


class Value(NamedTuple):
    """An integer and where it came from, e.g. ``Value(3, "RANK=3")``."""

    value: int
    source: str


def malformed(name: str, raw: str, expected: str, fix: str) -> EnvironmentDetectionError:
    """The error for a variable that is set to something unusable."""
    return EnvironmentDetectionError(
        f"{name}={raw!r} cannot be used: expected {expected}. Fix: {fix}"
    )


def missing(name: str, why: str, fix: str) -> EnvironmentDetectionError:
    """The error for a variable that this kind of environment must provide."""
    return EnvironmentDetectionError(f"{name} is not set, but {why}. Fix: {fix}")


def first_set(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The first of `names` that is set to a non-empty value (schedulers keep old aliases)."""
    for name in names:
        if environ.get(name, "").strip():
            return name
    return None


def _parse_int(environ: Mapping[str, str], name: str, minimum: int, fix: str) -> Value:
    raw = environ[name]
    text = raw.strip()
    if not _INT.fullmatch(text):
        raise malformed(name, raw, f"a whole number >= {minimum}", fix)
    value = int(text)
    if value < minimum:
        raise malformed(name, raw, f"a whole number >= {minimum}", fix)
    return Value(value, f"{name}={value}")


def read_int(
    environ: Mapping[str, str], name: str, *, why: str, fix: str, minimum: int = 0
) -> Value:
    """A required integer variable; `why` says who should have set it."""
    if name not in environ:
        raise missing(name, why, fix)
    return _parse_int(environ, name, minimum, fix)


def read_optional_int(
    environ: Mapping[str, str], name: str, *, fix: str, minimum: int = 0
) -> Value | None:
    """An optional integer variable; unset or empty reads as None (shells export empty values)."""
    if not environ.get(name, "").strip():
        return None
    return _parse_int(environ, name, minimum, fix)


def read_master_port(environ: Mapping[str, str], default: Value, *, fix: str) -> Value:
    """MASTER_PORT if set (a user or launcher override), else `default`."""
    port = read_optional_int(environ, "MASTER_PORT", fix=fix, minimum=1)
    if port is None:
        return default
    if port.value > _MAX_PORT:
        raise malformed("MASTER_PORT", environ["MASTER_PORT"], f"a TCP port 1..{_MAX_PORT}", fix)
    return port


def read_master_addr(environ: Mapping[str, str]) -> str | None:
    """MASTER_ADDR stripped, or None where unset or empty."""
    addr = environ.get("MASTER_ADDR", "").strip()
    return addr or None


def default_port() -> Value:
    """torch's own default, so scaletrain and plain torchrun agree where nothing is set."""
    return Value(DEFAULT_MASTER_PORT, f"default port {DEFAULT_MASTER_PORT}")


def _inconsistent(kind: str, detail: str, expected: str, fix: str) -> EnvironmentDetectionError:
    return EnvironmentDetectionError(
        f"{kind}: {detail}, which cannot be: expected {expected}. Fix: {fix}"
    )


def build_env(
    *,
    kind: str,
    rank: Value,
    local_rank: Value,
    world_size: Value,
    local_world_size: Value,
    node_rank: Value,
    num_nodes: Value,
    master_addr: str,
    master_port: Value,
    reasons: Sequence[str],
    fix: str,
    per_node: bool = False,
    procs_per_node_hint: int | None = None,
    job_id: str | None = None,
    hosts: Sequence[str] = (),
    rendezvous: Rendezvous | None = None,
) -> ClusterEnv:
    """Check that the values fit together, then build the ClusterEnv.

    Each reader parses its own variables; the cross-checks live here once so
    that every kind refuses the same impossible layouts with the same words.
    """
    for size in (world_size, local_world_size, num_nodes):
        if size.value < 1:
            raise _inconsistent(kind, f"{size.source}", "a size of at least 1", fix)
    pairs = (
        (rank, world_size, "0 <= rank < world size"),
        (local_rank, local_world_size, "0 <= local rank < local world size"),
        (node_rank, num_nodes, "0 <= node rank < number of nodes"),
    )
    for index, size, expected in pairs:
        if not 0 <= index.value < size.value:
            raise _inconsistent(kind, f"{index.source} with {size.source}", expected, fix)
    if local_world_size.value > world_size.value:
        raise _inconsistent(
            kind,
            f"{local_world_size.source} exceeds {world_size.source}",
            "no more processes on one node than in the whole job",
            fix,
        )
    if num_nodes.value > world_size.value:
        raise _inconsistent(
            kind,
            f"{num_nodes.source} exceeds {world_size.source}",
            "at least one process per node",
            fix,
        )
    if not 1 <= master_port.value <= _MAX_PORT:
        raise _inconsistent(kind, master_port.source, f"a TCP port 1..{_MAX_PORT}", fix)
    if not master_addr:
        raise _inconsistent(kind, "the master address is empty", "a host name or IP", fix)
    return ClusterEnv(
        kind=kind,
        rank=rank.value,
        local_rank=local_rank.value,
        world_size=world_size.value,
        local_world_size=local_world_size.value,
        node_rank=node_rank.value,
        num_nodes=num_nodes.value,
        master_addr=master_addr,
        master_port=master_port.value,
        per_node=per_node,
        procs_per_node_hint=procs_per_node_hint,
        job_id=job_id,
        hosts=tuple(hosts),
        rendezvous=rendezvous,
        reasons=tuple(reasons),
    )
