"""Experiment trackers: where a run's scalars and settings go besides metrics.jsonl.

A tracker is three calls (`Tracker`): `start(run_dir, params)` once, before the first
step, with the run's directory and its settings; `log(scalars, step)` with named numbers
at an optimizer step; `close(status)` at the end. `scaletrain train` feeds every tracker
named by `--track` through one observer (`TrackerObserver`) on rank 0; a loop of your own
calls the same objects directly:

    tracker = st.MLflowTracker()
    tracker.start(run_dir, {"lr": lr, "batch_size": batch_size})
    ...
    tracker.log({"train/loss": loss.item()}, step)
    tracker.close()

Only rank 0 writes: on any other rank (torch.distributed's rank once the process group
exists, else the launcher's RANK) the calls do nothing, so a loop need not guard them.

This module imports neither torch nor a tracker's package until a tracker starts: the
train config checks `--track` with it, and `scaletrain --help` stays instant.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlparse

from scaletrain.errors import ConfigError, closest, spell
from scaletrain.observe.events import EvalEvent, LoopObserver, RunInfo, say_off

if TYPE_CHECKING:
    from scaletrain.observe.metrics.ledger import StepLedger
    from scaletrain.observe.metrics.stragglers import Straggler
    from scaletrain.observe.metrics.window import WindowStats

__all__ = [
    "MLFLOW_RUN_FILE",
    "TRACKERS",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerObserver",
    "TrackerStatus",
    "flat_params",
    "make_trackers",
    "track_names",
    "track_problems",
]

TrackerStatus = Literal["finished", "stopped", "failed"]
"""How the run ended: trained to its end, stopped early (a signal, --stop-after) to be
resumed, or failed."""


@runtime_checkable
class Tracker(Protocol):
    """What the training loop calls; any object with these members is a tracker."""

    name: str
    """How messages name it ("MLflow")."""

    def start(self, run_dir: Path, params: Mapping[str, Any]) -> None:
        """Once, before the first step: the run's directory and its settings (nested
        mappings allowed: config.json's shape)."""

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Named numbers ("train/loss") at optimizer step `step`."""

    def close(self, status: TrackerStatus = "finished") -> None:
        """The end (also of a failed run); calls after it do nothing."""


def _rank() -> int:
    """This process's global rank: torch.distributed's once the process group exists,
    else the launcher's RANK (a tracker started before st.init), else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as flat text values, keys joined with "." (run.world_size), the
    form parameter stores take; None reads "None" (a default left to the run)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        else:
            flat[name] = str(value)
    return flat


class TensorBoardTracker:
    """Scalars as TensorBoard events in `logdir` (default RUN/tensorboard), the settings
    as a text summary `config`. Needs the `tensorboard` package."""

    name = "TensorBoard"

    def __init__(self, logdir: str | Path | None = None) -> None:
        self.logdir = Path(logdir) if logdir is not None else None
        self._writer: Any = None
        self._closed = False

    def start(self, run_dir: str | Path, params: Mapping[str, Any]) -> None:
        if self._closed or self._writer is not None or _rank() != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        logdir = self.logdir or Path(run_dir) / "tensorboard"
        self.logdir = logdir
        # SummaryWriter creates its events file when constructed: only here, at start.
        self._writer = SummaryWriter(log_dir=str(logdir))
        if params:
            text = json.dumps(params, indent=2, default=str)
            # Indented four spaces: TensorBoard renders it as a code block.
            self._writer.add_text("config", "    " + text.replace("\n", "\n    "))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        if self._writer is None or self._closed:
            return
        for key, value in scalars.items():
            self._writer.add_scalar(key, float(value), step)

    def close(self, status: TrackerStatus = "finished") -> None:
        self._closed = True
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


MLFLOW_RUN_FILE = "mlflow.json"
"""RUN/mlflow.json: the MLflow run this run directory logs to, per tracking store, so
a resumed run continues it rather than starting a second one."""
_RUN_STORE = "mlruns"
"""The store inside the run directory (the default): keyed by this name in
MLFLOW_RUN_FILE, so a run directory moved elsewhere still finds its MLflow run."""
_MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
_PARAM_CHARS = 500
"""Longest parameter value every MLflow store accepts (newer ones take more)."""


class MLflowTracker:
    """Scalars as MLflow metrics, the settings as MLflow parameters, one MLflow run per
    run directory.

    The tracking store is `tracking_uri`, else $MLFLOW_TRACKING_URI, else a file store
    in the run directory (RUN/mlruns: `mlflow ui --backend-store-uri RUN/mlruns`). MLflow
    3 refuses file stores unless MLFLOW_ALLOW_FILE_STORE is true, which a store named by
    its directory asks for: for one, the variable is set to true in this process where
    it is unset (set to false, MLflow's refusal is this tracker's failure). The
    experiment is `experiment`, else $MLFLOW_EXPERIMENT_NAME, else "scaletrain"; the run
    is named `run_name`, else after the run directory.

    The MLflow run's id is kept in RUN/mlflow.json: a resumed run logs to the same MLflow
    run. MLflow keeps a parameter's first value; a resume that changes one (a longer
    --max-steps) records the new value as the tag `resumed.<key>`. Needs mlflow (the
    `mlflow-skinny` package: `pip install 'scaletrain[mlflow]'`).
    """

    name = "MLflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        """The MLflow run logged to (after start)."""
        self._client: Any = None
        self._closed = False

    def start(self, run_dir: str | Path, params: Mapping[str, Any]) -> None:
        if self._closed or self._client is not None or _rank() != 0:
            return
        run_dir = Path(run_dir)
        uri = key = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
        if not uri:
            uri, key = (run_dir / _RUN_STORE).resolve().as_uri(), _RUN_STORE
        if urlparse(uri).scheme in ("", "file"):
            # A directory named as the store asks for a file store (see the class).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        ids_file = run_dir / MLFLOW_RUN_FILE
        ids = _read_ids(ids_file)
        run_id = self._continue(client, ids.get(key))
        if run_id is None:
            name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "scaletrain"
            run = client.create_run(
                _experiment_id(client, name),
                run_name=self.run_name or run_dir.resolve().name,
                tags={"scaletrain.run_dir": str(run_dir.resolve())},
            )
            run_id = run.info.run_id
            ids[key] = run_id
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_ids(ids_file, ids)
        self._client, self.run_id = client, run_id
        self._params(flat_params(params))

    @staticmethod
    def _continue(client: Any, run_id: str | None) -> str | None:
        """`run_id` marked running again, or None when the store has no such live run
        (deleted, or another store): a new run is made."""
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.lifecycle_stage != "active":
            return None
        client.update_run(run_id, status="RUNNING")
        return run_id

    def _params(self, flat: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        data = self._client.get_run(self.run_id).data
        had, tags = data.params, data.tags
        values = {k: v[:_PARAM_CHARS] for k, v in flat.items()}
        new = [Param(k, v) for k, v in values.items() if k not in had]
        # This start's value where it differs from the first's (or differed before).
        changed = [
            RunTag(f"resumed.{k}", v)
            for k, v in values.items()
            if k in had and (had[k] != v or f"resumed.{k}" in tags)
        ]
        # Batches of 100: the most parameters one call may carry.
        for i in range(0, max(len(new), len(changed)), 100):
            self._client.log_batch(self.run_id, params=new[i : i + 100], tags=changed[i : i + 100])

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        if self._client is None or self._closed:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step)) for k, v in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: TrackerStatus = "finished") -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.set_terminated(self.run_id, status=_MLFLOW_STATUS[status])


def _read_ids(path: Path) -> dict[str, str]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    runs = value.get("runs") if isinstance(value, dict) else None
    return {str(k): str(v) for k, v in runs.items()} if isinstance(runs, dict) else {}


def _write_ids(path: Path, ids: Mapping[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"runs": dict(ids)}, indent=2) + "\n")
    tmp.replace(path)


def _experiment_id(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    from mlflow.exceptions import MlflowException

    try:
        return str(client.create_experiment(name))
    except MlflowException:
        # Made meanwhile by another run on the same store.
        return str(client.get_experiment_by_name(name).experiment_id)


TRACKERS: dict[str, tuple[Callable[[], Tracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "pip install tensorboard"),
    "mlflow": (MLflowTracker, "mlflow", "pip install 'scaletrain[mlflow]'"),
}
"""`--track` name -> (the tracker, the module it needs, how to install it)."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def track_names(track: str | None) -> tuple[str, ...]:
    """The trackers `--track` asks for; None: TensorBoard where it is installed."""
    if track is None:
        return ("tensorboard",) if _installed("tensorboard") else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in track.split(",") if n.strip()))
    return () if names == ("none",) else names


def track_problems(track: str) -> list[ConfigError]:
    """What is wrong with a `--track` value: unknown names, none among others, a
    tracker whose package is not installed."""
    names = [n.strip().lower() for n in track.split(",") if n.strip()]
    choices = [*TRACKERS, "none"]
    expected = f"a comma-separated list of {', '.join(TRACKERS)}, or none"
    problems: list[ConfigError] = []
    if not names:
        problems.append(
            ConfigError(
                f"{spell('track', track)}: expected {expected}. Fix: pass e.g. "
                f"{spell('track', 'tensorboard,mlflow')}, or {spell('track', 'none')}.",
                field="track",
            )
        )
    for name in dict.fromkeys(names):
        if name == "none" and len(set(names)) > 1:
            problems.append(
                ConfigError(
                    f"{spell('track', track)}: none means no tracker, but other trackers "
                    f"are named with it. Fix: {spell('track', 'none')} alone, or drop none.",
                    field="track",
                )
            )
        elif name not in choices:
            near = closest(name, list(TRACKERS))
            fixed = ",".join(near[0] if n == name else n for n in names) if near else None
            fix = (
                spell("track", fixed)
                if fixed
                else f"name only these, e.g. {spell('track', 'tensorboard,mlflow')}"
            )
            problems.append(
                ConfigError(
                    f"{spell('track', track)}: {name!r} is not a tracker scaletrain writes to; "
                    f"expected {expected}. Fix: {fix}.",
                    field="track",
                )
            )
        elif name in TRACKERS and not _installed(TRACKERS[name][1]):
            problems.append(
                ConfigError(
                    f"{spell('track', track)}: {name} needs the {TRACKERS[name][1]} package, "
                    f"which is not installed. Fix: {TRACKERS[name][2]}, or leave {name} out "
                    "of the list.",
                    field="track",
                )
            )
    return problems


def make_trackers(track: str | None) -> list[Tracker]:
    """A new tracker for each name `--track` asks for (see `track_names`)."""
    return [TRACKERS[name][0]() for name in track_names(track)]


class TrackerObserver(LoopObserver):
    """Feeds a tracker from the training loop's events (rank 0): the settings at the
    start, loss, lr and samples/s every logging window, each evaluation, and (with the
    step ledger) every ledger window's phase medians and maxima, in milliseconds.

    A tracker only reports: one that fails is said once and is off for the rest of the
    run; training goes on (`LoopObserver.reports`)."""

    def __init__(self, tracker: Tracker, ledger: StepLedger | None = None) -> None:
        self.tracker = tracker
        self.reports = f"the {tracker.name} tracker"
        self._off = False
        self._status: TrackerStatus = "failed"
        if ledger is not None:
            ledger.listeners.append(self._window)

    def on_run_start(self, info: RunInfo) -> None:
        # Started once the start is accepted, not at construction: a start that is
        # refused (a resume whose settings change the run's meaning, no valid
        # checkpoint) must leave the run directory exactly as it found it, and a tracker
        # creates its files when it starts (SummaryWriter its events file, MLflow its
        # store and run). Nor at the first scalar: that is the ledger's first window,
        # inside a step, and importing TensorBoard there (a quarter of a second; MLflow
        # takes a second) read as the step's synchronisation.
        self.tracker.start(info.out, info.config)

    def _log(self, scalars: Mapping[str, float], step: int) -> None:
        if not self._off:
            self.tracker.log(scalars, step)

    def on_log(self, record: Mapping[str, Any]) -> None:
        self._log(
            {
                "train/loss": float(record["loss"]),
                "train/lr": float(record["lr"]),
                "train/samples_per_s": float(record["samples_per_s"]),
            },
            int(record["step"]),
        )

    def on_eval(self, event: EvalEvent) -> None:
        self._log(
            {"eval/loss": event.loss, f"eval/{event.metric.replace(' ', '_')}": event.accuracy},
            event.step,
        )

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        self._status = "stopped"

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self._status = "finished"

    def _window(self, stats: WindowStats, newly: list[Straggler]) -> None:
        # Called by the ledger, outside the observers' guard: a failure here is said
        # once and turns this tracker off; it never reaches the ledger.
        if self._off:
            return
        from scaletrain.observe.metrics.phases import PHASES

        scalars: dict[str, float] = {}
        for name in (*PHASES, "step"):
            s = stats.spreads[name]
            # Compiling steps are not in a window's medians: their seconds, apart.
            if s.median == s.median and name != "compile":  # not NaN
                scalars[f"ledger/{name}_ms_median"] = s.median * 1e3
                scalars[f"ledger/{name}_ms_max"] = s.max * 1e3
        compiled = max((w.compile_s for w in stats.ranks), default=0.0)
        if compiled > 0:
            scalars["ledger/compile_s"] = compiled
        try:
            self.tracker.log(scalars, stats.last_step)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.close()
            say_off(self.reports, exc)

    def close(self) -> None:
        if self._off:
            return
        self._off = True  # nothing reaches the tracker after this (a ledger window)
        self.tracker.close(self._status)
