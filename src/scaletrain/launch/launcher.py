"""Start the worker processes of one node by calling PyTorch's own elastic launcher.

`launch` gives torch's public launcher (`torch.distributed.launcher.api`: a
`LaunchConfig` and `elastic_launch`) what a LaunchConfig of scaletrain's amounts to,
in this process; `build_torchrun_args` says the same as a torchrun command line
(`--dry-run`). What is added on top is what torchrun leaves to the user: defaults
taken from the cluster (SageMaker/Kubeflow start one process per node and expect it
to start the rest), checks that turn the usual setup mistakes into one clear paragraph
before anything is spawned, and a short summary of a failed worker instead of
torchrun's page-long traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scaletrain.errors import LaunchError
from scaletrain.exitcodes import EXIT_ABORTED, EXIT_ERROR, EXIT_PREEMPTED
from scaletrain.launch.checks import check_network, check_target
from scaletrain.launch.compat import exit_codes, watch_workers
from scaletrain.launch.config import LaunchConfig
from scaletrain.launch.failures import preempted_note, summarize_failure
from scaletrain.launch.guard import guarded_command, sigint_held
from scaletrain.launch.interrupts import _Interrupts, _quiet_agent
from scaletrain.launch.plan import Plan, make_plan
from scaletrain.launch.rendezvous import Rounds, agent_rendezvous, counted

if TYPE_CHECKING:
    from scaletrain.env.base import ClusterEnv

# The plan used to live here; tests and callers still find it under its old name.
_plan = make_plan

__all__ = [
    "AGENT_SIGNALS",
    "LaunchReport",
    "Plan",
    "agent_config",
    "build_torchrun_args",
    "dry_run_command",
    "format_torchrun_command",
    "launch",
    "launch_environment",
]

_PROG = "scaletrain launch"
AGENT_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
"""What torch's agent forwards to the workers, waiting for them to end. Ctrl-C is not
among them: it is the launcher's to handle (see _Interrupts); with torch's handler a
second Ctrl-C waits out the agent's shutdown timeout again. SIGUSR1 and SIGUSR2 are
what schedulers send before a preemption (Slurm's --signal=USR1@90 reaches every
process of the step): the agent forwards them and waits for the workers to save,
instead of dying of them at once."""


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
    return make_plan(cfg, script, script_args, env=env, environ=environ).argv


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
    relaunch: Sequence[str] | None = None,
) -> str:
    """The shell command `launch` would amount to, with the environment it adds."""
    plan = make_plan(cfg, script, script_args, env=env, relaunch=relaunch)
    if plan.mode == "srun":
        return shlex.join(plan.argv)
    return format_torchrun_command(plan.argv, launch_environment(cfg, plan))


# --- running torchrun ------------------------------------------------------------------


def _exec_srun(plan: Plan, *, quiet: bool) -> None:
    """Become `srun ... <this command>` (never returns): signals sent to the batch script
    then reach srun, which forwards them to the launchers on every node."""
    if not quiet:
        print(
            f"{_PROG}: in a Slurm batch script: one launcher per node of the allocation "
            f"({plan.nnodes} node(s)): {shlex.join(plan.argv)}",
            file=sys.stderr,
            flush=True,
        )
    sys.stdout.flush()
    try:
        os.execvp(plan.argv[0], plan.argv)
    except OSError as exc:
        raise LaunchError(
            f"Cannot run srun to start one launcher per node: {exc}. Expected Slurm's srun "
            f"on PATH in a batch script. Fix: check the job's PATH, or pass --env local to "
            f"run on this node alone."
        ) from None


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
    if "GLOO_SOCKET_IFNAME" not in environ:
        if plan.mode == "standalone":
            # One node: every peer is local. Gloo otherwise binds the interface the host
            # name resolves to, which in containers and VPNs can be one peers cannot reach.
            added["GLOO_SOCKET_IFNAME"] = "lo"
        elif plan.gloo_ifname is not None:
            # Several nodes: the interface that routes to them (see plan.py); the host
            # name's address is 127.0.1.1 on Debian, which no peer can reach.
            added["GLOO_SOCKET_IFNAME"] = plan.gloo_ifname
    if plan.max_restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
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
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def agent_config(plan: Plan, cfg: LaunchConfig) -> Any:
    """torch's LaunchConfig for `plan`: what torchrun makes of the arguments --dry-run
    shows (`torchrun_argv`), with scaletrain's rendezvous (rendezvous.py) in place of
    torch's and the signals the agent forwards (AGENT_SIGNALS)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    return TorchLaunchConfig(
        **agent_rendezvous(plan),
        nproc_per_node=plan.nproc_per_node,
        role="default",  # torchrun's
        max_restarts=plan.max_restarts,
        monitor_interval=cfg.monitor_interval,
        start_method="spawn",
        # torchrun's variable for a prefix on each worker's lines, honoured as it does.
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        logs_specs=DefaultLogsSpecs(log_dir=cfg.log_dir, redirects=Std.from_str(cfg.redirects)),
        signals_to_handle=AGENT_SIGNALS,
    )


def _hosts_store(plan: Plan) -> bool:
    if plan.mode not in ("static", "c10d") or plan.host is None:
        return False
    if plan.hosts_store is not None:
        return plan.hosts_store
    from scaletrain.env.network import is_local, resolve

    try:
        return is_local(resolve(plan.host))
    except OSError:
        return False


class _AgentWatch:
    """What the agent did, for the message when it stops: the rendezvous rounds it
    entered and formed (a second one follows a worker failure or a node leaving), and
    the workers it started."""

    def __init__(self) -> None:
        self.rounds = Rounds()
        self.pids: list[int] = []
        """Every worker it started, in every round."""
        self.workers: Any = None
        """The agent's processes of the latest round (torch's process context)."""

    def started(self, pids: list[int], workers: Any) -> None:
        self.pids.extend(pids)
        self.workers = workers

    def exit_codes(self) -> list[int | None]:
        """How the latest round's workers ended (None: still running), once the agent
        has stopped them."""
        return exit_codes(self.workers)


@dataclasses.dataclass(slots=True)
class LaunchReport:
    """What a launch did, for a caller that tells the user in its own words
    (`scaletrain train`): filled in by `launch(..., report=)` as it returns."""

    interrupts: int = 0
    """Ctrl-C presses the launcher received (2 or more: it killed the workers)."""
    workers: list[int] = dataclasses.field(default_factory=list)
    """The pids of the workers it started on this node, in every round (all gone by the
    time launch() returns)."""


def _rendezvous_failure(exc: Exception, plan: Plan, cfg: LaunchConfig, watch: _AgentWatch) -> int:
    """Say why the rendezvous failed, in the words that fit when it failed; the exit code."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = f"{plan.host}:{plan.port}" if plan.host else "the local store"
    if isinstance(exc, RendezvousClosedError):
        print(
            f"{_PROG}: another node ended the job: the rendezvous at {where} was closed "
            f"({detail}). That node's workers failed with no restarts left, or it was "
            f"stopped. Its own output names the first failure.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ERROR
    rounds = watch.rounds
    if rounds.entered == 1 and rounds.formed and not _hosts_store(plan):
        # The agent polls the store while its workers run: the store's node went away.
        print(
            f"{_PROG}: node 0 (it hosts the rendezvous store at {where}) went away while "
            f"this node's workers ran ({detail}), and this node stopped them. The job had "
            "formed: node 0 ended it (a worker failed there with no restarts left, or it "
            "was stopped); its own output says why.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ERROR
    if rounds.entered > 1:
        print(
            f"{_PROG}: after the workers stopped (a worker failed, or a node left), the "
            f"nodes did not come back within --rdzv-timeout {cfg.rdzv_timeout}s for round "
            f"{rounds.entered} of the rendezvous at {where} ({detail}). The job ran before: a node "
            f"was killed or its launcher exited, and fewer than the minimum of --nnodes "
            f"{plan.nnodes} are left. Its output says why; to go on with fewer nodes, give "
            f"--nnodes a range such as 1:{plan.nnodes.split(':')[-1]}.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ERROR
    raise LaunchError(
        f"The rendezvous at {where} did not complete ({detail}). Expected --nnodes "
        f"{plan.nnodes} node(s) to join within --rdzv-timeout {cfg.rdzv_timeout}s, all "
        f"with the same endpoint and --rdzv-id. Fix: start the launcher on every node "
        f"with the same --nnodes, --rdzv-endpoint and --rdzv-id (a node that exited "
        f"early ends the rendezvous), or raise --rdzv-timeout if nodes start far apart."
    ) from exc


def _run_torchrun(
    plan: Plan, cfg: LaunchConfig, *, quiet: bool = False, report: LaunchReport | None = None
) -> int:
    interrupts = _Interrupts(quiet)
    watch = _AgentWatch()
    try:
        return _run_agent(plan, cfg, quiet, interrupts, watch)
    finally:
        if report is not None:
            report.interrupts = interrupts.count
            report.workers = list(watch.pids)


def _run_agent(
    plan: Plan, cfg: LaunchConfig, quiet: bool, interrupts: _Interrupts, watch: _AgentWatch
) -> int:
    # The agent's modules, imported before _quiet_agent looks for their loggers.
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    config = agent_config(plan, cfg)
    # Each worker starts through the orphan guard (guard.py): it is killed if this
    # agent dies; it exec()s `python -u [-m] SCRIPT ARGS` once the guard is set.
    entry, args = guarded_command(os.getpid(), plan.script, plan.script_args, module=plan.module)
    try:
        with (
            interrupts,
            _quiet_agent(quiet),
            counted(config.run_id) as watch.rounds,
            # Each worker starts with Ctrl-C held (guard.py); a Ctrl-C pressed meanwhile
            # reaches this process when the block ends, after the pids are known.
            watch_workers(watch.started, hold=sigint_held),
        ):
            elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        if interrupts.count > 1:
            return EXIT_ABORTED
        summary, code = summarize_failure(
            exc, redirects=cfg.redirects, log_dir=cfg.log_dir, prog=_PROG, workers_record=quiet
        )
        if summary:
            print(summary, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        # The agent was told to stop (Ctrl-C, scheduler preemption); it has already
        # forwarded the signal to the workers. Exit as a shell reports a signal.
        if interrupts.count > 1:
            return EXIT_ABORTED
        codes = watch.exit_codes()
        if codes and all(code == EXIT_PREEMPTED for code in codes):
            # Every worker saved on the signal it was given (rt.should_stop() loops,
            # scaletrain train): the job stopped to be started again, as 75 says.
            if not quiet:
                print(preempted_note(_PROG), file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        if not quiet and exc.sigval != signal.SIGINT:
            waiting = watch.rounds.entered > watch.rounds.formed
            state = f"waiting for --nnodes {plan.nnodes} node(s) to join" if waiting else ""
            print(
                f"{_PROG}: stopped by {signal.Signals(exc.sigval).name}"
                + (f" while {state}" if state else "; the workers were told to stop"),
                file=sys.stderr,
                flush=True,
            )
        return 128 + int(exc.sigval)
    except RendezvousError as exc:
        return _rendezvous_failure(exc, plan, cfg, watch)
    return EXIT_ABORTED if interrupts.count > 1 else 0


def launch(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    env: ClusterEnv | None = None,
    quiet: bool = False,
    relaunch: Sequence[str] | None = None,
    report: LaunchReport | None = None,
) -> int:
    """Run `script` (or module, with cfg.run_as_module) on this node's workers; return the exit code.

    Blocks until the workers of every node finish. Returns 0 on success, or the failed
    worker's exit code (128+N for signal N) after printing a short summary. Raises
    LaunchError when the job cannot start (missing script, port taken, unreachable or
    unresolvable endpoint) and ConfigError for a config that cannot work.

    Ctrl-C once asks the workers to stop (torch forwards SIGINT and waits for them);
    twice kills them at once and returns 130. `quiet` is for `scaletrain train`, whose
    workers say what happens and record their own errors: it hides the agent's own log
    lines and the launcher's Ctrl-C notice, and a worker that failed without a record
    is explained by how it ended (failures.summarize_failure).

    In a Slurm batch script (outside any srun task) the launcher runs `relaunch`, the
    command that started it, under srun with one task per node of the allocation, in
    place of this process (see batch.py); without `relaunch` it refuses.

    `report`, where given, is filled in with what happened (LaunchReport).
    """
    plan = make_plan(cfg, script, script_args, env=env, relaunch=relaunch)
    if plan.mode == "srun":
        _exec_srun(plan, quiet=quiet)
    check_target(script, cfg.run_as_module)
    check_network(plan, cfg)
    with _launch_environ(cfg, plan):
        return _run_torchrun(plan, cfg, quiet=quiet, report=report)
