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
import ipaddress
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from scaletrain.errors import ConfigError, LaunchError
from scaletrain.launch.config import DEFAULT_RDZV_ID, LaunchConfig, parse_endpoint, parse_nnodes

if TYPE_CHECKING:
    from scaletrain.env.base import ClusterEnv

__all__ = ["build_torchrun_args", "format_torchrun_command", "launch"]

_PROG = "scaletrain launch"
_POLL_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class _Plan:
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
) -> _Plan:
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
        return _Plan(
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
        return _Plan(
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
    return _Plan(
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


def format_torchrun_command(argv: Sequence[str]) -> str:
    """The equivalent shell command, for logs and `--dry-run`."""
    return shlex.join(["torchrun", *argv])


# --- checks before anything is spawned ------------------------------------------------


def _check_target(script: str, run_as_module: bool) -> None:
    if run_as_module:
        # Workers run `python -m SCRIPT` from this directory, which puts the current
        # directory first on sys.path; look the module up the same way.
        saved = list(sys.path)
        sys.path.insert(0, os.getcwd())
        try:
            spec = importlib.util.find_spec(script)
            reason = "" if spec is not None else "it is not on the Python path"
        except (ImportError, ValueError) as exc:
            spec, reason = None, str(exc)
        finally:
            sys.path[:] = saved
        if spec is None:
            raise LaunchError(
                f"Cannot launch module {script!r} (-m): {reason}. Expected an importable "
                f"module name such as 'mypkg.train', found from {os.getcwd()} or PYTHONPATH. "
                f"Fix: check the spelling, run from the directory that holds the package or "
                f"install it (pip install -e .), or drop -m to run a script file."
            )
        return
    path = os.path.abspath(script)
    runnable = os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py"))
    if not runnable:
        what = "is a directory without __main__.py" if os.path.isdir(path) else "does not exist"
        raise LaunchError(
            f"Cannot launch {script!r}: {path} {what}. Expected the path of a Python training "
            f"script (relative to {os.getcwd()}) followed by its arguments. Fix: check the path; "
            f"to run an installed module instead, pass -m and its dotted name."
        )


def _resolve(host: str, port: int, source: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"The rendezvous host {host!r} (from {source}) does not resolve to an address: "
            f"{exc}. Expected node 0's hostname or IP address as this machine sees it. "
            f"Fix: check the spelling, use node 0's IP address, or fix DNS or /etc/hosts on "
            f"this node."
        ) from None
    return [str(info[4][0]) for info in infos]


def _is_local(addresses: Sequence[str]) -> bool:
    for address in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                return True
        # Binding succeeds only to an address of one of this machine's interfaces.
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def _port_in_use(port: int) -> bool:
    # The TCPStore server listens on every interface, so probe the wildcard address.
    # SO_REUSEADDR as the store does: a port in TIME_WAIT from the last run is free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def _wait_reachable(plan: _Plan, timeout_s: float) -> None:
    assert plan.host is not None and plan.port is not None
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(
                (plan.host, plan.port), timeout=max(0.1, min(2.0, remaining))
            ):
                return
        except OSError as exc:
            last_error = exc.strerror or type(exc).__name__
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if not announced:
            print(
                f"{_PROG}: waiting up to {timeout_s:g}s for the rendezvous store at "
                f"{plan.host}:{plan.port} (node 0) to come up...",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        time.sleep(min(_POLL_INTERVAL_S, remaining))
    who = f"node rank {plan.node_rank}" if plan.node_rank is not None else "this node"
    raise LaunchError(
        f"Cannot reach the rendezvous store at {plan.host}:{plan.port} (from "
        f"{plan.endpoint_source}) after {timeout_s:g}s: {last_error}. This is {who}; it "
        f"connects to the store that node 0 opens there. Check that node 0 has been started "
        f"with the same endpoint and --node-rank 0, that {plan.host} is node 0's address as "
        f"seen from this machine, and that no firewall blocks TCP port {plan.port}; if node 0 "
        f"starts later, raise --rdzv-timeout."
    )


def _check_network(plan: _Plan, cfg: LaunchConfig) -> None:
    if plan.host is None or plan.port is None:
        return  # standalone: torch picks a free local port itself
    addresses = _resolve(plan.host, plan.port, plan.endpoint_source)
    hosts_store = plan.hosts_store
    if hosts_store is None and _is_local(addresses):
        # Node rank unknown and the endpoint is this machine: torch's own heuristic
        # hosts the store if the port is free and joins it otherwise. A taken port may
        # be another agent of this job on the same host, so it is not an error here.
        return
    if hosts_store:
        # Checked only where this node is certain to host the store (node rank 0 or
        # the only node): torch would otherwise fail with "address already in use"
        # deep in a traceback, after the other nodes have started waiting.
        if _port_in_use(plan.port):
            raise LaunchError(
                f"Port {plan.port} on this machine is already in use, but this node "
                f"(node rank {plan.node_rank if plan.node_rank is not None else 0}) must host "
                f"the rendezvous store on {plan.host}:{plan.port} (from "
                f"{plan.endpoint_source}). Another job, or an earlier launch still running, "
                f"holds it. Fix: stop that process (find it with `ss -ltnp 'sport = "
                f":{plan.port}'`), or pick a free port and pass it in --rdzv-endpoint on "
                f"every node."
            )
        return
    _wait_reachable(plan, cfg.rdzv_timeout)


# --- running torchrun ------------------------------------------------------------------


@contextlib.contextmanager
def _launch_environ(cfg: LaunchConfig, plan: _Plan) -> Iterator[None]:
    """Set the variables the agent and workers need; restore os.environ afterwards."""
    saved = dict(os.environ)
    try:
        if "OMP_NUM_THREADS" not in os.environ:
            import torch

            # torchrun sets OMP_NUM_THREADS=1 itself for several workers per node, with
            # a banner warning every time. Set it quietly, and also for one worker per
            # node on CPU, where nodes sharing a host would oversubscribe its cores.
            if plan.nproc_per_node > 1 or not torch.cuda.is_available():
                os.environ["OMP_NUM_THREADS"] = "1"
        if cfg.max_restarts > 0:
            # Restarts through the agent's shared TCPStore hung or failed in about half
            # of our runs (shared/NOTES.md); a separate store per round is reliable.
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        os.environ.update(cfg.extra_env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _failure_message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip()


def _summarize_failure(exc: Any, cfg: LaunchConfig) -> tuple[str, int]:
    """A few lines naming the failed rank, its exit code and error file; and the exit code."""
    rank, failure = exc.get_first_failure()
    exitcode = int(failure.exitcode)
    if exitcode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
        code = 128 - exitcode
    else:
        how = f"exited with code {exitcode}"
        code = exitcode if 0 < exitcode < 256 else 1
    lines = [
        f"{_PROG}: worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}."
    ]
    others = sorted(r for r in exc.failures if r != rank)
    if others:
        lines.append(f"  Other failed ranks: {', '.join(map(str, others))}.")
    if os.path.isfile(failure.error_file):
        lines.append(f"  Error file: {failure.error_file}")
        message = _failure_message(failure)
        if message:
            lines.append(f"  Error: {message.splitlines()[-1]}")
    else:
        lines.append(
            "  No error file: the script did not write one. Decorate its entry point with "
            "@torch.distributed.elastic.multiprocessing.errors.record to get one."
        )
    if cfg.redirects != "0":
        lines.append(
            f"  The workers' output is in the log directory ({cfg.log_dir or 'temporary'})."
        )
    else:
        lines.append("  The worker's own output and traceback are above.")
    return "\n".join(lines), code


def _parse_torchrun_args(torchrun: Any, plan: _Plan) -> Any:
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


def _run_torchrun(plan: _Plan, cfg: LaunchConfig) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        torchrun.run(_parse_torchrun_args(torchrun, plan))
    except ChildFailedError as exc:
        summary, code = _summarize_failure(exc, cfg)
        print(summary, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        # The agent was told to stop (Ctrl-C, scheduler preemption); it has already
        # forwarded the signal to the workers. Exit as a shell reports a signal.
        return 128 + int(exc.sigval)
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
    return 0


def launch(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    env: ClusterEnv | None = None,
) -> int:
    """Run `script` (or module, with cfg.run_as_module) on this node's workers; return the exit code.

    Blocks until the workers of every node finish. Returns 0 on success, or the failed
    worker's exit code (128+N for signal N) after printing a short summary. Raises
    LaunchError when the job cannot start (missing script, port taken, unreachable or
    unresolvable endpoint) and ConfigError for a config that cannot work.
    """
    plan = _plan(cfg, script, script_args, env=env)
    _check_target(script, cfg.run_as_module)
    _check_network(plan, cfg)
    with _launch_environ(cfg, plan):
        return _run_torchrun(plan, cfg)
