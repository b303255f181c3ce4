"""Rows for `scaletrain env`: what was detected and why.

Plain (field, value) string pairs, so the CLI decides how to render them and
this module stays importable without torch or rich.
"""

from __future__ import annotations

from scaletrain.env.base import ClusterEnv

__all__ = ["describe"]


def describe(env: ClusterEnv) -> list[tuple[str, str]]:
    """The detected environment as (field, value) rows, evidence last."""
    per_node = (
        "yes: the scheduler starts one process per node; the launcher starts the workers"
        if env.per_node
        else "no: the scheduler started this process as one worker"
    )
    rows = [
        ("kind", env.kind),
        ("rank", f"{env.rank} of {env.world_size}"),
        ("local rank", f"{env.local_rank} of {env.local_world_size}"),
        ("world size", str(env.world_size)),
        ("node", f"{env.node_rank} of {env.num_nodes}"),
        ("master", f"{env.master_addr}:{env.master_port}"),
        ("per node", per_node),
    ]
    if env.procs_per_node_hint is not None:
        rows.append(("processes per node (hint)", str(env.procs_per_node_hint)))
    if env.job_id is not None:
        rows.append(("job id", env.job_id))
    if env.hosts:
        shown = ", ".join(env.hosts[:8]) + (
            f", ... ({len(env.hosts)} hosts)" if len(env.hosts) > 8 else ""
        )
        rows.append(("hosts", shown))
    if env.rendezvous is not None:
        r = env.rendezvous
        rows.append(("rendezvous", f"{r.backend} at {r.endpoint}, nodes {r.nnodes}"))
    rows.extend(("reason", reason) for reason in env.reasons)
    return rows
