"""Start the worker processes of one node by calling PyTorch's own elastic launcher.

`build_torchrun_args` turns a LaunchConfig into torchrun's command line, and `launch`
runs `torch.distributed.run` in this process with it. What is added on top is what
torchrun leaves to the user: defaults taken from the cluster (SageMaker/Kubeflow start
one process per node and expect it to start the rest), checks that turn the usual
setup mistakes into one clear paragraph before anything is spawned, and a short summary
of a failed worker instead of torchrun's page-long traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from scaletrain.errors import ConfigError, LaunchError
from scaletrain.exitcodes import EXIT_ABORTED
from scaletrain.launch.checks import check_network, check_target
from scaletrain.launch.config import DEFAULT_RDZV_ID, LaunchConfig, parse_endpoint, parse_nnodes
from scaletrain.launch.failures import summarize_failure

if TYPE_CHECKING:
    from scaletrain.env.base import ClusterEnv

__all__ = [
    "Plan",
    "build_torchrun_args",
    "dry_run_command",
    "format_torchrun_command",
    "launch",
    "launch_environment",
]

_PROG = "scaletrain launch"
_POLL_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class Plan:
    """torchrun's argv plus what the precondition checks need to know about it."""

    argv: list[str]
    mode: Literal["standalone", "c10d", "static"]
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
    num_script_args: int = 0
    """How many words at the end of argv belong to the script, not to torchrun."""


def _default_nproc_per_node() -> int:
    # One process per GPU is what everyone wants on GPUs. On CPU, 2 shows the
    # distributed code path working without oversubscribing a laptop.
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count if count > 0 else 2


def _detect_cluster(environ: Mapping[str, str] | None) -> ClusterEnv | None:
    # scaletrain.env.detect is written alongside this module; until it exists (or in a
    # stripped-down install) the launcher works as plain torchrun.
    module = importlib.import_module("scaletrain.env")
    detect = getattr(module, "detect", None)
    if detect is None:
        return None
    cluster: ClusterEnv = detect(environ)
    return cluster


def _plan(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str],
    *,
    env: ClusterEnv | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    environ = os.environ if environ is None else environ
    user_topology = (
        cfg.nnodes is not None or cfg.node_rank is not None or cfg.rdzv_endpoint is not None
    )
    cluster = env
    if cluster is None and (not user_topology or cfg.nproc_per_node is None):
        cluster = _detect_cluster(environ)
    per_node = cluster if cluster is not None and cluster.per_node else None

    nproc = cfg.nproc_per_node
    if nproc is None and per_node is not None and per_node.procs_per_node_hint:
        nproc = per_node.procs_per_node_hint
    if nproc is None:
        nproc = _default_nproc_per_node()

    rdzv_id = (
        cfg.rdzv_id
        or environ.get("SCALETRAIN_RDZV_ID")
        or environ.get("SLURM_JOB_ID")
        or DEFAULT_RDZV_ID
    )
    tail = [
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(cfg.max_restarts),
        "--monitor-interval",
        str(cfg.monitor_interval),
    ]
    if cfg.log_dir is not None:
        tail += ["--log-dir", cfg.log_dir]
    if cfg.redirects != "0":
        tail += ["--redirects", cfg.redirects]
    if cfg.run_as_module:
        tail.append("--module")
    tail += [script, *script_args]

    # SageMaker and Kubeflow start this launcher once per node and tell each one its
    # rank and where node 0 is: a static rendezvous is exactly that, and needs no
    # flags from the user. Anything the user did pass wins over the scheduler.
    if not user_topology and per_node is not None and per_node.num_nodes > 1:
        head = [
            "--nnodes",
            str(per_node.num_nodes),
            "--rdzv-backend",
            "static",
            "--node-rank",
            str(per_node.node_rank),
            "--master-addr",
            per_node.master_addr,
            "--master-port",
            str(per_node.master_port),
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            f"timeout={cfg.rdzv_timeout}",
        ]
        return Plan(
            argv=head + tail,
            num_script_args=len(script_args),
            mode="static",
            nproc_per_node=nproc,
            nnodes=str(per_node.num_nodes),
            host=per_node.master_addr,
            port=per_node.master_port,
            endpoint_source=f"the {per_node.kind} environment's master address",
            hosts_store=per_node.node_rank == 0,
            node_rank=per_node.node_rank,
        )

    nnodes = cfg.nnodes or "1"
    _, max_nodes = parse_nnodes(nnodes)
    if max_nodes == 1 and cfg.rdzv_endpoint is None:
        # --standalone: a c10d store on a free local port, so two single-node jobs
        # on one machine never collide on 29500.
        head = ["--standalone", "--nnodes", "1", "--rdzv-conf", f"join_timeout={cfg.rdzv_timeout}"]
        return Plan(
            argv=head + tail,
            num_script_args=len(script_args),
            mode="standalone",
            nproc_per_node=nproc,
            nnodes="1",
            node_rank=0,
        )

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
    conf = f"join_timeout={cfg.rdzv_timeout}"
    if hosts_store is not None:
        conf += f",is_host={str(hosts_store).lower()}"
    head = [
        "--nnodes",
        nnodes,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        cfg.rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        conf,
    ]
    return Plan(
        argv=head + tail,
        num_script_args=len(script_args),
        mode="c10d",
        nproc_per_node=nproc,
        nnodes=nnodes,
        host=host,
        port=port,
        hosts_store=hosts_store,
        node_rank=cfg.node_rank,
    )


def build_torchrun_args(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    env: ClusterEnv | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The `torchrun` arguments (without the program name) that launch `script` per `cfg`.

    `env` is the cluster environment to take defaults from; by default it is detected
    from `environ` (default `os.environ`) when the config leaves the topology open.
    """
    return _plan(cfg, script, script_args, env=env, environ=environ).argv


def format_torchrun_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The equivalent shell command, for logs and `--dry-run`: the variables the launcher
    sets, then torchrun and its arguments."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*prefix, shlex.join(["torchrun", *argv])])


def dry_run_command(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    env: ClusterEnv | None = None,
) -> str:
    """The shell command `launch` would amount to, with the environment it adds."""
    plan = _plan(cfg, script, script_args, env=env)
    return format_torchrun_command(plan.argv, launch_environment(cfg, plan))


# --- running torchrun ------------------------------------------------------------------


def launch_environment(
    cfg: LaunchConfig, plan: Plan, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables the launcher adds for the agent and its workers (what --dry-run shows)."""
    environ = os.environ if environ is None else environ
    added: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in environ:
        import torch

        # torchrun sets OMP_NUM_THREADS=1 itself for several workers per node, with
        # a banner warning every time. Set it quietly, and also for one worker per
        # node on CPU, where nodes sharing a host would oversubscribe its cores.
        if plan.nproc_per_node > 1 or not torch.cuda.is_available():
            added["OMP_NUM_THREADS"] = "1"
    if plan.mode == "standalone" and "GLOO_SOCKET_IFNAME" not in environ:
        # One node: every peer is local. Gloo otherwise binds the interface the host
        # name resolves to, which in containers and VPNs can be one peers cannot reach.
        added["GLOO_SOCKET_IFNAME"] = "lo"
    if cfg.max_restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        # Restarts through the agent's shared TCPStore hung or failed in 6 of 12 of our
        # runs on Gloo; with a separate store per round 10 of 10 passed.
        added["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    added.update(cfg.extra_env)
    return added


@contextlib.contextmanager
def _launch_environ(cfg: LaunchConfig, plan: Plan) -> Iterator[None]:
    """Set the variables the agent and workers need; restore os.environ afterwards."""
    saved = dict(os.environ)
    try:
        os.environ.update(launch_environment(cfg, plan))
        # Ctrl-C is ours to handle (see _Interrupts), not torch's agent's: with torch's
        # handler a second Ctrl-C waits out the agent's shutdown timeout again.
        os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _child_pids() -> list[int]:
    """This process's children (the agent's workers), from /proc; [] where there is none."""
    me = os.getpid()
    children = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="utf-8") as f:
                    stat = f.read()
            except OSError:
                continue
            # Fields after the ")" that closes the command name: state, ppid, ...
            if int(stat.rpartition(")")[2].split()[1]) == me:
                children.append(int(entry.name))
    return children


class _Interrupts:
    """Ctrl-C in the launcher: the first asks the workers to stop, the second kills them.

    The workers run in sessions of their own (torch starts them so), so a terminal's
    Ctrl-C reaches only this process. The first one becomes torch's own shutdown with
    SIGINT: the agent forwards it and waits for the workers (a scaletrain worker
    finishes its step, saves and exits). The second one kills every worker's process
    group at once: the user means now.
    """

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.count = 0
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            if not self.quiet:
                print(
                    f"\n{_PROG}: Ctrl-C: asking the workers to stop (Ctrl-C again to kill them "
                    "now).",
                    file=sys.stderr,
                    flush=True,
                )
            raise SignalException("Ctrl-C", sigval=signal.SIGINT)
        for pid in _child_pids():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        print(
            "\nscaletrain: second Ctrl-C: killed the workers; nothing more was saved.",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def _quiet_agent(quiet: bool) -> Iterator[None]:
    """Hide the elastic agent's own log lines (workers' closing signals, its failure
    table) where the launcher prints its own summary of what happened."""
    if not quiet:
        yield
        return
    import logging

    # torch gives each elastic module a logger with its own level, so the parent's
    # level is not enough: every one of them is raised, and restored afterwards.
    prefix = "torch.distributed.elastic"
    loggers = [logging.getLogger(prefix)] + [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith(prefix + ".") and isinstance(logger, logging.Logger)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _parse_torchrun_args(torchrun: Any, plan: Plan) -> Any:
    """torchrun's parsed arguments, without letting its parser see the script's flags.

    torchrun's argparse classifies every word before it hands the rest to the script,
    so a script flag that abbreviates two torchrun options (`--nproc` for
    `--nproc-per-node`/`--nproc_per_node`) aborts with "ambiguous option". The script
    and its arguments are therefore set after parsing only the launcher's part.
    """
    split = len(plan.argv) - plan.num_script_args
    args = torchrun.parse_args(plan.argv[:split])
    args.training_script_args = list(plan.argv[split:])
    return args


def _run_torchrun(plan: Plan, cfg: LaunchConfig, *, quiet: bool = False) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    interrupts = _Interrupts(quiet)
    try:
        # The agent's modules are imported by now, so _quiet_agent sees their loggers.
        with interrupts, _quiet_agent(quiet):
            torchrun.run(_parse_torchrun_args(torchrun, plan))
    except ChildFailedError as exc:
        if interrupts.count > 1:
            return EXIT_ABORTED
        summary, code = summarize_failure(
            exc, redirects=cfg.redirects, log_dir=cfg.log_dir, prog=_PROG
        )
        print(summary, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        # The agent was told to stop (Ctrl-C, scheduler preemption); it has already
        # forwarded the signal to the workers. Exit as a shell reports a signal.
        return EXIT_ABORTED if interrupts.count > 1 else 128 + int(exc.sigval)
    except RendezvousError as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        where = f"{plan.host}:{plan.port}" if plan.host else "the local store"
        raise LaunchError(
            f"The rendezvous at {where} did not complete ({detail}). Expected --nnodes "
            f"{plan.nnodes} node(s) to join within --rdzv-timeout {cfg.rdzv_timeout}s, all "
            f"with the same endpoint and --rdzv-id. Fix: start the launcher on every node "
            f"with the same --nnodes, --rdzv-endpoint and --rdzv-id (a node that exited "
            f"early ends the rendezvous), or raise --rdzv-timeout if nodes start far apart."
        ) from exc
    return EXIT_ABORTED if interrupts.count > 1 else 0


def launch(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    env: ClusterEnv | None = None,
    quiet: bool = False,
) -> int:
    """Run `script` (or module, with cfg.run_as_module) on this node's workers; return the exit code.

    Blocks until the workers of every node finish. Returns 0 on success, or the failed
    worker's exit code (128+N for signal N) after printing a short summary. Raises
    LaunchError when the job cannot start (missing script, port taken, unreachable or
    unresolvable endpoint) and ConfigError for a config that cannot work.

    Ctrl-C once asks the workers to stop (torch forwards SIGINT and waits for them);
    twice kills them at once and returns 130. `quiet` hides the agent's own log lines
    and the launcher's Ctrl-C notice: for `scaletrain train`, whose workers say it.
    """
    plan = _plan(cfg, script, script_args, env=env)
    check_target(script, cfg.run_as_module)
    check_network(plan, cfg)
    with _launch_environ(cfg, plan):
        return _run_torchrun(plan, cfg, quiet=quiet)
