"""Tasks launched by Slurm's `srun`.

Only a task of a job step has a rank. The batch script (and an salloc shell)
carries SLURM_JOB_ID too, but it is one process that srun has not placed
anywhere; treating it as rank 0 of 1 would silently train on one GPU of a
multi-node allocation, so `read` refuses it and says to use srun.

Node lists are expanded here in pure Python: `scontrol show hostnames` is not
on every compute image, and calling it from thousands of tasks at once loads
slurmctld for nothing.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    PORT_BASE,
    PORT_SPAN,
    Value,
    build_env,
    first_set,
    malformed,
    missing,
    port_from_job_id,
    read_int,
    read_master_addr,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment
from scaletrain.errors import ConfigError, EnvironmentDetectionError

__all__ = [
    "SlurmEnvironment",
    "expand_nodelist",
    "expand_tasks_per_node",
    "is_batch_script",
    "port_from_job_id",
]

_JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
_STEP_ID_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
# srun rewrites SLURM_NTASKS/SLURM_NNODES/SLURM_TASKS_PER_NODE for the step,
# except under `srun --export`/`-E` (preserve env), where they keep the job's
# values; the SLURM_STEP_* names always describe the step, so they come first.
_WORLD_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

# Step ids above SLURM_MAX_NORMAL_STEP_ID (0xfffffff0 in slurm.h) are special
# steps: batch, extern, interactive, pending. Their values moved between Slurm
# releases (batch was 0xfffffffe before 20.11, 0xfffffffb since), so the range
# is checked rather than a list.
_MAX_NORMAL_STEP_ID = 0xFFFFFFF0

# Processes started by mpirun inside an allocation inherit SLURM_* from the
# batch script (or from the orted/hydra proxy that mpirun placed with srun,
# whose SLURM_PROCID is the proxy's, not the rank's): mpirun's own variables
# describe the process, so the MPI reader must take it.
_MPIRUN_MARKERS = ("OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")

_MAX_HOSTS = 1 << 20
_HOST_CHARS = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_TASKS_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")

_WHY = "srun sets it for every task it launches"
_FIX = (
    "start the program with srun so that Slurm places each task, e.g. "
    "`srun python train.py` or `srun scaletrain train ...`; do not override SLURM_* by hand"
)


def _bad_nodelist(nodelist: str, problem: str) -> ConfigError:
    return ConfigError(
        f"Slurm node list {nodelist!r} is malformed: {problem}. Expected host names, "
        "comma-separated, with optional bracket ranges such as 'gpu[01-04,07],cpu5'. "
        "Fix: pass the value exactly as Slurm printed it (SLURM_JOB_NODELIST)."
    )


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        match = _RANGE.fullmatch(piece.strip())
        if match is None:
            raise _bad_nodelist(nodelist, f"[{body}] holds {piece!r}, not a number or a range a-b")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise _bad_nodelist(nodelist, f"range {piece!r} runs backwards")
        if len(values) + hi - lo + 1 > _MAX_HOSTS:
            raise _bad_nodelist(nodelist, f"it expands to more than {_MAX_HOSTS} hosts")
        # Slurm pads every value to the width of the low bound: [08-10] gives
        # 08 09 10, [8-10] gives 8 9 10. zfill does both.
        width = len(lo_text)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def _expand_host(item: str, nodelist: str) -> list[str]:
    parts: list[list[str]] = []
    pos = 0
    for match in _BRACKET.finditer(item):
        parts.append([item[pos : match.start()]])
        parts.append(_expand_ranges(match.group(1), nodelist))
        pos = match.end()
    parts.append([item[pos:]])
    for literal in parts[::2]:
        if not _HOST_CHARS.fullmatch(literal[0]):
            raise _bad_nodelist(nodelist, f"{item!r} holds a character not allowed in a host name")
    if math.prod(len(p) for p in parts) > _MAX_HOSTS:
        raise _bad_nodelist(nodelist, f"it expands to more than {_MAX_HOSTS} hosts")
    # Several groups multiply, leftmost slowest: r[1-2]-n[1-2] gives
    # r1-n1 r1-n2 r2-n1 r2-n2, the order Slurm itself prints.
    return ["".join(combo) for combo in itertools.product(*parts)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``gpu[01-03,07],cpu5``) into host names, in order.

    Zero padding is kept, several bracket groups in one name multiply, and
    commas inside brackets separate values, not hosts. Raises ConfigError
    naming the string when it is malformed.
    """
    text = nodelist.strip()
    if not text:
        raise _bad_nodelist(nodelist, "it is empty")
    # Split on commas outside brackets only.
    items: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise _bad_nodelist(nodelist, f"nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise _bad_nodelist(nodelist, f"']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad_nodelist(nodelist, "a '[' is never closed")
    items.append(text[start:])

    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            raise _bad_nodelist(nodelist, "it holds an empty host name (two commas in a row?)")
        hosts.extend(_expand_host(item, nodelist))
        if len(hosts) > _MAX_HOSTS:
            raise _bad_nodelist(nodelist, f"it expands to more than {_MAX_HOSTS} hosts")
    return hosts


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's task counts per node (``2(x3),1`` -> ``[2, 2, 2, 1]``).

    Raises ConfigError naming the string when it is malformed.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None:
            raise ConfigError(
                f"Slurm task counts {value!r} are malformed at {item!r}: expected "
                "comma-separated counts, each optionally repeated, like '4(x2),1'. "
                "Fix: pass the value exactly as Slurm printed it (SLURM_TASKS_PER_NODE)."
            )
        repeat = 1 if match.group(2) is None else int(match.group(2))
        if len(counts) + repeat > _MAX_HOSTS:
            raise ConfigError(f"Slurm task counts {value!r} cover more than {_MAX_HOSTS} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return counts


def _step_id(environ: Mapping[str, str]) -> Value | None:
    name = first_set(environ, _STEP_ID_VARS)
    if name is None:
        return None
    return read_int(environ, name, why=_WHY, fix=_FIX)


def is_batch_script(environ: Mapping[str, str]) -> bool:
    """True inside a Slurm job but outside any srun task: the batch script or an salloc shell."""
    if first_set(environ, _JOB_ID_VARS) is None:
        return False
    name = first_set(environ, _STEP_ID_VARS)
    if name is None:
        return True
    raw = environ[name].strip()
    # A malformed step id is not judged here; `read` reports it by name.
    return raw.isdigit() and int(raw) > _MAX_NORMAL_STEP_ID


def _batch_error(environ: Mapping[str, str], job: Value) -> EnvironmentDetectionError:
    step_name = first_set(environ, _STEP_ID_VARS)
    if step_name is None:
        seen = f"{job.source} is set but SLURM_STEP_ID is not"
    else:
        seen = (
            f"{job.source} with {step_name}={environ[step_name].strip()}, "
            "a batch/extern/interactive step rather than a task step"
        )
    return EnvironmentDetectionError(
        f"{seen}: this process is the job's batch script (or an salloc shell), not a "
        "task launched by srun, so Slurm has given it no rank. Expected: a task started "
        "by srun (SLURM_STEP_ID=0, 1, ...). Fix: start training through srun from the "
        "script, e.g. `srun python train.py` or `srun scaletrain train ...` with one task "
        "per GPU (#SBATCH --ntasks-per-node=<GPUs per node>), or "
        "`srun --ntasks-per-node=1 scaletrain launch ...` to start one launcher per node. "
        "To run one process here on purpose, force the local environment (kind 'local')."
    )


def _wrap(name: str, raw: str, error: ConfigError) -> EnvironmentDetectionError:
    return EnvironmentDetectionError(f"{name}={raw!r} cannot be used: {error}")


class SlurmEnvironment(ClusterEnvironment):
    """A task of an srun job step: one process per task, placed by Slurm."""

    name: ClassVar[str] = "slurm"
    priority: ClassVar[int] = 10

    def _detect(self, environ: Mapping[str, str]) -> bool:
        if first_set(environ, _JOB_ID_VARS) is None:
            return False
        if any(marker in environ for marker in _MPIRUN_MARKERS):
            return False
        # PMI_RANK in a real srun task is srun's own PMI plugin (--mpi=pmi2),
        # which agrees with SLURM_PROCID; outside a task it comes from mpiexec.
        return not ("PMI_RANK" in environ and is_batch_script(environ))

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        job_name = first_set(environ, _JOB_ID_VARS)
        if job_name is None:
            raise missing(
                "SLURM_JOB_ID",
                "the Slurm environment was selected",
                f"run inside a Slurm job; {_FIX}",
            )
        job = read_int(environ, job_name, why=_WHY, fix=_FIX)
        step = _step_id(environ)
        if step is None or step.value > _MAX_NORMAL_STEP_ID:
            raise _batch_error(environ, job)

        rank = read_int(environ, "SLURM_PROCID", why=_WHY, fix=_FIX)
        local_rank = read_int(environ, "SLURM_LOCALID", why=_WHY, fix=_FIX)
        node_rank = read_int(environ, "SLURM_NODEID", why=_WHY, fix=_FIX)
        reasons = [
            f"{rank.source}, {step.source}: a task launched by srun in job {job.value}",
            f"{local_rank.source}, {node_rank.source}",
        ]

        world_size = self._first_int(environ, _WORLD_VARS)
        num_nodes = self._first_int(environ, _NODES_VARS)
        local_world = self._local_world_size(environ, node_rank, num_nodes, world_size)
        reasons.append(f"{world_size.source}, {num_nodes.source}, {local_world.source}")

        port = read_master_port(
            environ,
            Value(
                port_from_job_id(job.value),
                f"port {port_from_job_id(job.value)} derived from {job.source} "
                f"({PORT_BASE} + job id % {PORT_SPAN}, the same in every task)",
            ),
            fix=_FIX,
        )
        hosts = self._hosts(environ)
        addr = read_master_addr(environ)
        if addr is not None:
            reasons.append(f"MASTER_ADDR={addr} overrides the node list")
        elif hosts:
            # Task 0 is on the step's first node under every distribution except
            # `--distribution=arbitrary`; MASTER_ADDR overrides for that case.
            addr = hosts[0]
            name = first_set(environ, _NODELIST_VARS) or "SLURM_STEP_NODELIST"
            reasons.append(f"{name}={environ.get(name)!r}: rank 0 runs on {addr}, the first host")
        else:
            raise missing(
                "SLURM_STEP_NODELIST",
                "neither it, SLURM_JOB_NODELIST nor MASTER_ADDR says where rank 0 runs",
                f"{_FIX}, or export MASTER_ADDR=<host of rank 0>",
            )
        reasons.append(port.source)

        hint = None
        if local_world.value == 1:
            # One task per node is how `srun scaletrain launch` runs: the
            # launcher then wants to know how many devices Slurm gave the node.
            gpus = read_optional_int(environ, "SLURM_GPUS_ON_NODE", fix=_FIX)
            if gpus is not None and gpus.value > 0:
                hint = gpus.value
                reasons.append(f"{gpus.source}: one task per node, {hint} GPUs to fill")

        return build_env(
            kind=self.name,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            reasons=reasons,
            fix=_FIX,
            procs_per_node_hint=hint,
            job_id=str(job.value),
            hosts=hosts,
        )

    @staticmethod
    def _first_int(environ: Mapping[str, str], names: tuple[str, ...]) -> Value:
        name = first_set(environ, names)
        if name is None:
            raise missing(" / ".join(names), _WHY, _FIX)
        return read_int(environ, name, why=_WHY, fix=_FIX, minimum=1)

    @staticmethod
    def _local_world_size(
        environ: Mapping[str, str], node_rank: Value, num_nodes: Value, world_size: Value
    ) -> Value:
        name = first_set(environ, _TASKS_PER_NODE_VARS)
        if name is None:
            # Only set when --ntasks-per-node was given, and then it is the
            # job's request, which a step may not follow; hence the last resort.
            per_node = read_optional_int(environ, "SLURM_NTASKS_PER_NODE", fix=_FIX, minimum=1)
            if per_node is None:
                raise missing(
                    " / ".join((*_TASKS_PER_NODE_VARS, "SLURM_NTASKS_PER_NODE")), _WHY, _FIX
                )
            return per_node
        raw = environ[name]
        try:
            counts = expand_tasks_per_node(raw)
        except ConfigError as error:
            raise _wrap(name, raw, error) from None
        if len(counts) != num_nodes.value or sum(counts) != world_size.value:
            raise malformed(
                name,
                raw,
                f"{num_nodes.source} counts adding up to {world_size.source} "
                f"(got {len(counts)} counts adding up to {sum(counts)})",
                _FIX,
            )
        if node_rank.value >= len(counts):
            raise malformed(
                "SLURM_NODEID",
                environ["SLURM_NODEID"],
                f"an index below {num_nodes.source}",
                _FIX,
            )
        local = counts[node_rank.value]
        return Value(local, f"{name}={raw!r}: {local} tasks on node {node_rank.value}")

    @staticmethod
    def _hosts(environ: Mapping[str, str]) -> list[str]:
        """The step's hosts in node order ([] where no node list is set)."""
        name = first_set(environ, _NODELIST_VARS)
        if name is None:
            return []
        raw = environ[name]
        try:
            return expand_nodelist(raw)
        except ConfigError as error:
            raise _wrap(name, raw, error) from None
