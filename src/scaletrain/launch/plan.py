"""What one `scaletrain launch` on this node amounts to: torchrun's arguments, or srun's.

The node's part in the job comes from, in this order:

1. the user's flags (`--nnodes`, `--node-rank`, `--rdzv-endpoint`): a c10d rendezvous;
2. a Slurm batch script (not a task): the same command again under `srun`, one
   task per node of the allocation (scaletrain.launch.batch);
3. a scheduler that starts one process per node and says where node 0 is
   (SageMaker, Kubeflow, or srun / mpirun with one task per node): a static
   rendezvous with the node rank, master and port it gives, or an elastic c10d one
   where the platform asks for it (a Kubeflow elasticPolicy);
4. otherwise one node: torchrun --standalone on a free local port.

Across nodes, the address this node announces (`--local-addr`, which torch's c10d
rendezvous gives the workers as MASTER_ADDR when this node hosts the store) and
Gloo's interface are the ones that route to the other nodes, never what the host
name resolves to: Debian resolves it to 127.0.1.1, and two pods can share a name.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from scaletrain.errors import ConfigError
from scaletrain.launch.batch import in_batch_script, job_nodes, srun_command
from scaletrain.launch.config import DEFAULT_RDZV_ID, LaunchConfig, parse_endpoint, parse_nnodes

if TYPE_CHECKING:
    from scaletrain.env.base import ClusterEnv

__all__ = ["Plan", "make_plan", "node_environment", "torchrun_argv"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What this node's launcher runs: torch's agent with a rendezvous (the fields below),
    or srun. `argv` is the same as a command line: torchrun's arguments (what --dry-run
    shows), or srun's."""

    argv: list[str]
    mode: Literal["standalone", "c10d", "static", "srun"]
    nproc_per_node: int
    nnodes: str
    host: str | None = None
    port: int | None = None
    endpoint_source: str = "--rdzv-endpoint"
    """Where host:port came from, for messages: a flag or the detected cluster."""
    hosts_store: bool | None = None
    """True: this node must open the store's port; False: it connects to it;
    None: torch decides at run time (it hosts if the host name is this machine's)."""
    node_rank: int | None = None
    max_restarts: int = 0
    local_addr: str | None = None
    """This node's address for the other nodes (torchrun's --local-addr)."""
    gloo_ifname: str | None = None
    """The interface for Gloo where the user set none (GLOO_SOCKET_IFNAME)."""
    gloo_why: str = ""
    rdzv_backend: str = ""
    """torch's rendezvous backend where a platform names one other than c10d (a
    Kubeflow elasticPolicy's PET_RDZV_BACKEND); "": the mode's."""
    rdzv_endpoint: str = ""
    """HOST:PORT of the c10d rendezvous (torchrun's --rdzv-endpoint), as given."""
    rdzv_id: str = ""
    """The job id every node gives (torchrun's --rdzv-id); standalone: none, a fresh one
    per launch."""
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    """torch's rendezvous options (torchrun's --rdzv-conf)."""
    script: str = ""
    script_args: tuple[str, ...] = ()
    module: bool = False
    """Run `script` as a module (python -m)."""


def _rendezvous_argv(plan: Plan) -> list[str]:
    """torchrun's flags for the rendezvous of `plan` (not srun)."""
    conf = ",".join(f"{k}={v}" for k, v in plan.rdzv_conf.items())
    if plan.mode == "standalone":
        return ["--standalone", "--nnodes", "1", "--rdzv-conf", conf]
    head = ["--nnodes", plan.nnodes, "--rdzv-backend", plan.rdzv_backend or plan.mode]
    if plan.mode == "static":
        head += ["--node-rank", str(plan.node_rank), "--master-addr", str(plan.host)]
        head += ["--master-port", str(plan.port)]
    else:
        head += ["--rdzv-endpoint", plan.rdzv_endpoint]
    head += ["--rdzv-id", plan.rdzv_id, "--rdzv-conf", conf]
    if plan.local_addr is not None:
        head += ["--local-addr", plan.local_addr]
    return head


def torchrun_argv(plan: Plan, cfg: LaunchConfig) -> list[str]:
    """The torchrun arguments (without the program name) that say what `plan` runs."""
    tail = ["--nproc-per-node", str(plan.nproc_per_node), "--max-restarts", str(plan.max_restarts)]
    tail += ["--monitor-interval", str(cfg.monitor_interval)]
    if cfg.log_dir is not None:
        tail += ["--log-dir", cfg.log_dir]
    if cfg.redirects != "0":
        tail += ["--redirects", cfg.redirects]
    if plan.module:
        tail.append("--module")
    return [*_rendezvous_argv(plan), *tail, plan.script, *plan.script_args]


def _default_nproc_per_node() -> int:
    # One process per GPU is what everyone wants on GPUs. On CPU, 2 shows the
    # distributed code path working without oversubscribing a laptop.
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count if count > 0 else 2


def _detect_cluster(environ: Mapping[str, str], kind: str | None) -> ClusterEnv | None:
    # Looked up at call time, so a caller (or a test) may substitute scaletrain.env.detect.
    module = importlib.import_module("scaletrain.env")
    detect = getattr(module, "detect", None)
    if detect is None:
        return None
    cluster: ClusterEnv = detect(environ) if kind in (None, "auto") else detect(environ, kind=kind)
    return cluster


def node_environment(cluster: ClusterEnv | None) -> ClusterEnv | None:
    """The cluster environment if this process is its node's launcher, else None.

    SageMaker and Kubeflow start one process per node for that purpose. srun and
    mpirun start tasks; a task alone on its node (`srun --ntasks-per-node=1`) is that
    node's launcher too. Several tasks per node would each start their own workers,
    a job per task that no one asked for, so that is refused.
    """
    if cluster is None:
        return None
    if cluster.per_node:
        return cluster
    if cluster.kind not in ("slurm", "mpi"):
        return None
    if cluster.local_world_size == 1:
        return cluster
    from scaletrain.env.mpi import mpirun_command

    starter = "srun" if cluster.kind == "slurm" else "mpirun"
    one_per_node = (
        "srun --ntasks-per-node=1 scaletrain launch ..."
        if cluster.kind == "slurm"
        else f"{mpirun_command()} --map-by ppr:1:node scaletrain launch ..."
    )
    raise ConfigError(
        f"{starter} started {cluster.local_world_size} tasks on this node (rank "
        f"{cluster.rank} of {cluster.world_size}), and each `scaletrain launch` would start "
        f"its own workers: {cluster.local_world_size} jobs per node instead of one. Expected "
        f"one launcher per node. Fix: `{one_per_node}` (the launcher starts the per-device "
        f"workers), or start the training script itself with {starter}, one task per device."
    )


def _interface(
    cfg: LaunchConfig, host: str, peers: Sequence[str]
) -> tuple[str | None, str | None, str]:
    """(local address, Gloo interface, why) for a node of a multi-node job."""
    from scaletrain.env.network import choose_interface, interface_of, resolve

    if cfg.local_addr is not None:
        try:
            address = resolve(cfg.local_addr)[0]
        except (OSError, IndexError):
            return cfg.local_addr, None, ""  # checks.py reports it before anything starts
        name = interface_of(address)
        why = f"it holds --local-addr {cfg.local_addr}" if name else ""
        return cfg.local_addr, name, why
    choice = choose_interface(host, peers)
    if choice is None:
        return None, None, ""
    return choice.address, choice.name, f"{choice.address}: {choice.why}"


def make_plan(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str],
    *,
    env: ClusterEnv | None = None,
    environ: Mapping[str, str] | None = None,
    relaunch: Sequence[str] | None = None,
) -> Plan:
    """The plan for this node. `relaunch` is the command that started this launcher,
    which a Slurm batch script runs again under srun; without it, a batch script is
    refused with the srun command to use."""
    environ = os.environ if environ is None else environ
    user_topology = (
        cfg.nnodes is not None or cfg.node_rank is not None or cfg.rdzv_endpoint is not None
    )
    auto = cfg.cluster in (None, "auto")
    if env is None and auto and not user_topology and in_batch_script(environ):
        return _batch_plan(cfg, environ, relaunch)
    cluster = env
    if cluster is None and (not user_topology or cfg.nproc_per_node is None or not auto):
        cluster = _detect_cluster(environ, cfg.cluster)
    node = None if user_topology else node_environment(cluster)
    if node is None and cluster is not None and cluster.per_node:
        node = cluster  # only the process count is taken from it below
    rendezvous = node.rendezvous if node is not None else None

    nproc = cfg.nproc_per_node
    if nproc is None and node is not None and node.procs_per_node_hint:
        nproc = node.procs_per_node_hint
    if nproc is None:
        nproc = _default_nproc_per_node()
    restarts = cfg.max_restarts
    if restarts is None:
        restarts = rendezvous.max_restarts if rendezvous and rendezvous.max_restarts else 0
    rdzv_id = (
        cfg.rdzv_id
        or environ.get("SCALETRAIN_RDZV_ID")
        or (rendezvous.run_id if rendezvous else None)
        or (cluster.job_id if cluster is not None else None)
        or environ.get("SLURM_JOB_ID")
        or DEFAULT_RDZV_ID
    )

    def plan(**fields: Any) -> Plan:
        made = Plan(
            argv=[],
            nproc_per_node=nproc,
            max_restarts=restarts,
            script=script,
            script_args=tuple(script_args),
            module=cfg.run_as_module,
            **fields,
        )
        return replace(made, argv=torchrun_argv(made, cfg))

    if not user_topology and rendezvous is not None:
        # An elastic platform (Kubeflow elasticPolicy): torch's rendezvous places the
        # node; the store is hosted by the pod whose name is the endpoint's host.
        host, port = parse_endpoint(rendezvous.endpoint)
        local, ifname, why = _interface(cfg, host, ())
        conf = {"join_timeout": str(cfg.rdzv_timeout), **_conf(rendezvous.conf)}
        return plan(
            mode="c10d", nnodes=rendezvous.nnodes, host=host, port=port,
            rdzv_backend=rendezvous.backend, rdzv_endpoint=rendezvous.endpoint, rdzv_id=rdzv_id,
            rdzv_conf=conf,
            endpoint_source=f"the {node.kind if node else 'cluster'} environment's PET_RDZV_ENDPOINT",
            local_addr=local, gloo_ifname=ifname, gloo_why=why,
        )  # fmt: skip

    if not user_topology and node is not None and node.num_nodes > 1:
        # One launcher per node, told its rank and where node 0 is: a static rendezvous
        # is exactly that, and needs no flags from the user.
        local, ifname, why = _interface(cfg, node.master_addr, node.hosts)
        return plan(
            mode="static", nnodes=str(node.num_nodes), host=node.master_addr,
            port=node.master_port, endpoint_source=f"the {node.kind} environment's master address",
            hosts_store=node.node_rank == 0, node_rank=node.node_rank, rdzv_id=rdzv_id,
            rdzv_conf={"timeout": str(cfg.rdzv_timeout)},
            local_addr=local, gloo_ifname=ifname, gloo_why=why,
        )  # fmt: skip

    nnodes = cfg.nnodes or "1"
    _, max_nodes = parse_nnodes(nnodes)
    if max_nodes == 1 and cfg.rdzv_endpoint is None:
        # --standalone: a c10d store on a free local port, so two single-node jobs
        # on one machine never collide on 29500.
        conf = {"join_timeout": str(cfg.rdzv_timeout)}
        return plan(mode="standalone", nnodes="1", node_rank=0, rdzv_conf=conf)

    if cfg.rdzv_endpoint is None:
        raise ConfigError(
            f"--nnodes {nnodes} spans several machines, but no --rdzv-endpoint says where "
            f"they meet. Expected HOST:PORT of node 0, the same on every node. Fix: on every "
            f"node pass --rdzv-endpoint NODE0_ADDR:29500 --rdzv-id JOB_ID, and on the node "
            f"at NODE0_ADDR also --node-rank 0."
        )
    host, port = parse_endpoint(cfg.rdzv_endpoint)
    # Which agent opens the store's port is torch's guess unless told: every agent
    # whose hostname matches HOST tries to, and the loser silently becomes a client
    # (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py). With an
    # explicit node rank we say it outright, so node 0 fails loudly if the port is
    # taken instead of connecting to whatever holds it, and other nodes on the same
    # host (tests, network namespaces) never race node 0 for the port.
    hosts_store: bool | None
    if cfg.node_rank is not None:
        hosts_store = cfg.node_rank == 0
    elif max_nodes == 1:
        hosts_store = True  # the only node must host
    else:
        hosts_store = None
    conf = {"join_timeout": str(cfg.rdzv_timeout)}
    if hosts_store is not None:
        conf["is_host"] = str(hosts_store).lower()
    local, ifname, why = (None, None, "") if max_nodes == 1 else _interface(cfg, host, ())
    return plan(
        mode="c10d", nnodes=nnodes, host=host, port=port, rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_id=rdzv_id, rdzv_conf=conf, hosts_store=hosts_store, node_rank=cfg.node_rank,
        local_addr=local, gloo_ifname=ifname, gloo_why=why,
    )  # fmt: skip


def _conf(text: str | None) -> dict[str, str]:
    """torchrun's --rdzv-conf "k1=v1,k2=v2" as a mapping."""
    pairs = (item.split("=", 1) for item in (text or "").split(",") if item.strip())
    return {k.strip(): v.strip() for k, v in (p if len(p) == 2 else (p[0], "") for p in pairs)}


def _batch_plan(
    cfg: LaunchConfig, environ: Mapping[str, str], relaunch: Sequence[str] | None
) -> Plan:
    """In a Slurm batch script: `relaunch` again under srun, one launcher per node (see
    scaletrain.launch.batch)."""
    nodes = job_nodes(environ)
    if relaunch is None:
        raise ConfigError(
            f"This process is a Slurm batch script (job {environ.get('SLURM_JOB_ID')}, "
            f"{nodes} node(s)), not a task started by srun, and a launch from Python cannot "
            f"restart itself under srun. Expected one launcher per node. Fix: run your script "
            f"with `srun --ntasks-per-node=1 --whole python YOUR_SCRIPT.py`, or pass "
            f'env="local" to run on this node alone.'
        )
    return Plan(
        argv=srun_command(nodes, relaunch),
        mode="srun",
        nproc_per_node=cfg.nproc_per_node or 0,
        nnodes=str(nodes),
        endpoint_source="the Slurm allocation",
        max_restarts=cfg.max_restarts or 0,
    )
