"""The configuration of a `scaletrain train` run: declared once, here.

Each field is one setting with its docstring; `scaletrain train` generates one flag
per field from this class (scaletrain.settings) and reads the same names from a
`--config FILE`, and a run writes its resolved values (every default filled in) to
`RUN/config.json`, which `--config` reads back. This module imports no torch, so
`scaletrain --help` answers at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from scaletrain.errors import ConfigError, several, spell
from scaletrain.observe.hang.heartbeat import DEFAULT_HANG_TIMEOUT_S

if TYPE_CHECKING:
    from scaletrain.strategies import Strategy

__all__ = [
    "FLAG_GROUPS",
    "METAVARS",
    "SCHEDULES",
    "SINGLE_PROCESS_STRATEGIES",
    "SWITCHES",
    "TrainConfig",
]

SCHEDULES = ("cosine", "linear", "constant")
"""Learning-rate shapes after the warm-up (see scaletrain.train.schedule)."""

SINGLE_PROCESS_STRATEGIES = ("dp", "model-parallel", "single")
"""Strategies that run in ONE process (driving every local device from it)."""

METAVARS = {
    "nproc": "N", "epochs": "N", "max_steps": "N", "batch_size": "N", "lr": "LR",
    "warmup": "STEPS", "accumulate": "K", "clip_grad": "NORM", "seed": "N",
    "data_dir": "DIR", "num_workers": "N", "eval_batch_size": "N", "eval_batches": "N",
    "out": "RUN", "log_every": "N", "save_every": "N", "keep": "K", "stop_after": "N",
    "max_restarts": "K", "monitor_interval": "S", "hang_timeout": "S", "mesh": "DIMS",
    "nnodes": "N|MIN:MAX",
    "node_rank": "R", "rdzv_endpoint": "HOST:PORT", "rdzv_id": "ID", "local_addr": "ADDR",
    "fork": "NEW_RUN", "ledger_every": "K", "profile": "STEPS", "model": "MODULE:NAME",
    "data": "MODULE:NAME", "track": "NAMES", "ac_every": "K",
}  # fmt: skip
"""The placeholder each flag shows in --help."""

FLAG_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("what to train", ("recipe", "model", "data", "data_dir", "num_workers", "seed")),
    ("processes and parallelism", (
        "nproc", "strategy", "mesh", "backend", "precision", "sync_bn",
    )),
    ("memory and speed (large models)", ("ac", "ac_every", "compile", "float8")),
    ("length and optimizer", (
        "epochs", "max_steps", "batch_size", "accumulate", "lr", "schedule", "warmup",
        "clip_grad",
    )),
    ("evaluation", ("eval_batches", "eval_batch_size")),
    ("run directory and checkpoints", (
        "out", "save_every", "save_last", "keep", "async_save", "stop_after", "overwrite",
        "fork", "fork_optimizer",
    )),
    ("output and measurement", ("log_every", "ledger", "ledger_every", "profile", "track")),
    ("failures", ("max_restarts", "hang_timeout", "monitor_interval")),
    ("several machines (each node runs the same command)", (
        "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "local_addr", "env",
    )),
)  # fmt: skip
"""The sections of `scaletrain train --help`: every field in one, in the order shown."""

SWITCHES = ("overwrite", "fork_optimizer")
"""Bool fields that ask for something once, for this start, rather than describe the run
(config.json records them off): their flag turns them on, and there is no --no- form."""

Recipe = Literal["convnet", "split-net", "wrn", "gpt", "llama", "llama-1b", "llama-8b"]
ClusterKind = Literal["auto", "local", "slurm", "mpi", "torchelastic", "sagemaker", "kubeflow"]
StrategyName = Literal["ddp", "fsdp", "tensor", "pipeline", "dp", "model-parallel", "single"]
Schedule = Literal["cosine", "linear", "constant"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything `scaletrain train` needs; every field is one flag and one config-file key."""

    recipe: Recipe | None = None
    """Model, data and optimizer settings to train (default: convnet; gpt for tensor parallel)."""
    model: str | None = None
    """Your own model instead of a recipe: MODULE:NAME, a module (or .py file) and its factory; its module's datasets(), loss(), optimizer() are used where it defines them. Or a Hugging Face config.json (or its directory): its causal LM from random weights, on byte-level Python sources."""
    data: str | None = None
    """Your own data for --model: MODULE:NAME of a function of the split (and the --data-dir) returning a Dataset of (inputs, targets) (default: the model module's datasets)."""
    strategy: StrategyName = "ddp"
    """How the model is spread over the processes."""
    mesh: str | None = None
    """Device mesh such as dp=2,tp=2 (FSDP x tensor) or dp=2,pp=2 (DDP x pipeline)."""
    nproc: int | None = None
    """Processes on this node (default: one per GPU, else 2 on CPU; 1 for dp, model-parallel, single)."""
    backend: Literal["nccl", "gloo"] | None = None
    """Communication backend (default: nccl on GPUs, gloo on CPUs)."""
    precision: Literal["32", "bf16-mixed", "fp16-mixed", "bf16-true"] = "32"
    """Numeric precision: fp16-mixed needs a GPU; bf16-mixed works everywhere."""
    sync_bn: bool | None = None
    """SyncBatchNorm across data-parallel ranks (default: the recipe's choice)."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing of the model's blocks: full recomputes each block's forward in backward (least memory); selective keeps matmul and attention outputs and recomputes the rest, or with --ac-every K recomputes every K-th block."""
    ac_every: int | None = None
    """With --ac selective: checkpoint every K-th block whole instead of every block at the op level."""
    compile: bool = False
    """torch.compile each block; the first steps take longer (the ledger shows it as compile time); on CPU it needs a C++ compiler."""
    float8: bool = False
    """Train the blocks' Linear layers in float8 (torchao; GPUs of compute capability 8.9+ such as L4, H100, H200, B200; pip install 'scaletrain[float8]'); fast only with --compile."""
    epochs: int | None = None
    """Passes over the training set (default: the recipe's)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in all (default: run every epoch)."""
    batch_size: int | None = None
    """Samples per data-parallel replica per step, in each of its --accumulate micro-steps
    (default: the recipe's)."""
    lr: float | None = None
    """Peak learning rate (default: the recipe's, scaled linearly with the global batch)."""
    schedule: Schedule = "cosine"
    """Learning rate after the warm-up: cosine or linear decay to 0 at the last step, or constant."""
    warmup: int | None = None
    """Steps of linear learning-rate warm-up from 0 (default: the recipe's)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    clip_grad: float | None = None
    """Clip gradients to this whole-model norm (default: no clipping)."""
    seed: int = 0
    """Seed for weights, shuffling and augmentation: same seed, same run."""
    data_dir: str | None = None
    """Directory holding the dataset files (default: search the usual places)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    eval_batch_size: int | None = None
    """Samples per rank per evaluation batch (default: the recipe's)."""
    eval_batches: int | None = None
    """Evaluation batches per rank after each epoch; 0: skip evaluation (default: the whole test set)."""
    out: str | None = None
    """Run directory for metrics, checkpoints and the model (default: runs/<recipe>-<job id, else time>)."""
    log_every: int = 20
    """Steps between metric records and progress lines."""
    save_every: int | None = None
    """Save a checkpoint every N steps into OUT/checkpoints (default: only at the end and when stopped)."""
    save_last: bool = True
    """Keep a checkpoint of the last step, to extend or fork the run later (it holds the optimizer state: about 3x model.pt's size with Adam)."""
    keep: int = 3
    """Checkpoints kept in OUT/checkpoints; older ones are pruned."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""
    stop_after: int | None = None
    """Save and stop after N steps of this run; starting again resumes."""
    max_restarts: int = 0
    """Restart the workers up to K times after a failure; they resume from the last checkpoint."""
    monitor_interval: float = 0.1
    """Seconds between the launcher's checks of its workers: a failed or finished worker is noticed up to this much later."""
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    """Seconds a rank may make no progress before the job ends with a diagnosis; 0: off."""
    fork: str | None = None
    """Start a NEW run in this directory from the weights of OUT's newest checkpoint, with the settings given now."""
    fork_optimizer: bool = False
    """With --fork: take the optimizer state (moments, and fp16-mixed's loss scale) too, to continue rather than fine-tune (this start only)."""
    overwrite: bool = False
    """Replace a finished run in OUT (or in the --fork directory) instead of refusing to touch it (this start only)."""
    ledger: bool = True
    """Step ledger: where every rank's time goes (OUT/observe/), stragglers named, a table at the end."""
    ledger_every: int = 50
    """Steps between the ledger's cross-rank windows (one small all-gather each)."""
    profile: str | None = None
    """Steps to record with torch.profiler on every rank, e.g. 10-15 (traces in OUT/traces/)."""
    track: str | None = None
    """Experiment trackers rank 0 writes to, comma-separated: tensorboard (OUT/tensorboard), mlflow (OUT/mlruns, or $MLFLOW_TRACKING_URI), or none (default: tensorboard where installed)."""
    nnodes: str | None = None
    """Nodes in the job, N or an elastic range MIN:MAX (default: 1, or what the cluster says)."""
    node_rank: int | None = None
    """This node's index; node 0 hosts the rendezvous at --rdzv-endpoint."""
    rdzv_endpoint: str | None = None
    """HOST:PORT where the nodes meet (node 0's address), the same on every node."""
    rdzv_id: str | None = None
    """Job id shared by every node (default: the scheduler's job id, else scaletrain)."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (default: the interface that routes to them)."""
    env: ClusterKind = "auto"
    """Cluster environment to read; auto detects it, local runs here as one node (even in sbatch)."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise several(problems)

    def _problems(self) -> list[ConfigError]:
        """Every setting that cannot work, each with its fix: all of them at once, so a
        config file with several mistakes is fixed in one pass."""
        problems: list[ConfigError] = []

        def bad(field: str, expected: str, fix: str) -> None:
            value = getattr(self, field)
            problems.append(
                ConfigError(f"{spell(field, value)}: expected {expected}. Fix: {fix}.", field=field)
            )

        at_least_one = {
            "epochs": "passes over the data",
            "max_steps": "optimizer steps",
            "batch_size": "samples per replica per step",
            "eval_batch_size": "samples per rank per evaluation batch",
            "log_every": "steps between records",
            "save_every": "steps between checkpoints",
            "stop_after": "steps",
            "keep": "checkpoints to keep",
            "accumulate": "micro-batches per step (1: no accumulation)",
            "ledger_every": "steps between the ledger's windows",
            "ac_every": "blocks between checkpointed ones",
        }
        for field, what in at_least_one.items():
            value = getattr(self, field)
            if value is not None and value < 1:
                bad(field, f"a whole number >= 1 ({what})", f"pass e.g. {spell(field, 1)}")
        if self.nproc is not None and self.nproc < 1:
            bad(
                "nproc",
                "a number of processes >= 1",
                f"pass e.g. {spell('nproc', 2)}, or leave it out for one per GPU (2 on CPU)",
            )
        for field in ("eval_batches", "warmup"):
            value = getattr(self, field)
            if value is not None and value < 0:
                bad(field, "a whole number >= 0", f"pass e.g. {spell(field, 0)}")
        if self.num_workers < 0:
            bad(
                "num_workers",
                "a number of loader processes >= 0",
                f"pass {spell('num_workers', 0)}",
            )
        if self.max_restarts < 0:
            bad("max_restarts", "a number of restarts >= 0", f"pass {spell('max_restarts', 0)}")
        if not 0 < self.monitor_interval < math.inf:
            bad(
                "monitor_interval",
                "a positive, finite number of seconds",
                f"leave it out (0.1) or pass e.g. {spell('monitor_interval', 1)}",
            )
        if self.lr is not None and not self.lr > 0:
            bad("lr", "a positive learning rate", f"pass e.g. {spell('lr', 0.05)}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            bad("clip_grad", "a positive gradient norm", f"pass e.g. {spell('clip_grad', 1.0)}")
        if self.hang_timeout < 0:
            bad(
                "hang_timeout",
                "seconds >= 0 (0 turns the watchdog off)",
                f"pass e.g. {spell('hang_timeout', 600)}",
            )
        if self.data_dir is not None and not self.data_dir.strip():
            bad(
                "data_dir",
                "a directory holding the dataset",
                "pass the directory, or leave the setting out to search the usual places",
            )
        if self.out is not None and not self.out.strip():
            bad(
                "out",
                "a run directory",
                "pass a directory, or leave it out for runs/<recipe>-<time>",
            )
        if self.fork is not None and not self.fork.strip():
            bad(
                "fork",
                "the directory of the new run",
                f"pass e.g. {spell('fork', 'runs/finetune')}",
            )
        same = self.fork is not None and self.out is not None
        if same and Path(str(self.fork)).resolve() == Path(str(self.out)).resolve():
            problems.append(
                ConfigError(
                    f"{spell('fork', self.fork)} names the run it forks from "
                    f"({spell('out', self.out)}); a fork is a new run beside it. Fix: name a "
                    f"new directory, e.g. {spell('fork', str(self.out).rstrip('/') + '-fork')}.",
                    field="fork",
                )
            )
        if self.fork_optimizer and self.fork is None:
            problems.append(
                ConfigError(
                    f"{spell('fork_optimizer', True)} takes the optimizer state into a fork, "
                    f"but no {spell('fork')} was given. Fix: add {spell('fork', 'NEW_RUN')}, or "
                    f"drop {spell('fork_optimizer', True)} (a resume restores the optimizer "
                    "anyway).",
                    field="fork_optimizer",
                )
            )
        if self.profile is not None:
            from scaletrain.observe.metrics.profiling import parse_steps

            try:
                parse_steps(self.profile)
            except ConfigError as exc:
                problems.append(exc)
            if not self.ledger:
                problems.append(
                    ConfigError(
                        f"{spell('profile', self.profile)} needs the step ledger, which "
                        f"{spell('ledger', False)} turns off. Fix: drop "
                        f"{spell('ledger', False)}.",
                        field="profile",
                    )
                )
        if self.track is not None:
            from scaletrain.observe.report.trackers import track_problems

            problems += track_problems(self.track)
        if self.ac_every is not None and self.ac != "selective":
            problems.append(
                ConfigError(
                    f"{spell('ac_every', self.ac_every)} picks every K-th block for "
                    f"{spell('ac', 'selective')}, but the mode is {spell('ac', self.ac)}. Fix: "
                    f"add {spell('ac', 'selective')}, or drop {spell('ac_every')}.",
                    field="ac_every",
                )
            )
        self._check_model(problems)
        self._check_nodes(bad, problems)
        if self.strategy in SINGLE_PROCESS_STRATEGIES and self.nproc is not None and self.nproc > 1:
            problems.append(
                ConfigError(
                    f"{spell('strategy', self.strategy)} runs in ONE process (it drives every "
                    f"local device from there), but {spell('nproc', self.nproc)} asks for "
                    f"{self.nproc}. Fix: {spell('nproc', 1)} (or leave it out), or "
                    f"{spell('strategy', 'ddp')} for one process per device.",
                    field="nproc",
                )
            )
        return problems

    def _check_model(self, problems: list[ConfigError]) -> None:
        if self.model is not None and self.recipe is not None:
            problems.append(
                ConfigError(
                    f"{spell('recipe', self.recipe)} and {spell('model', self.model)} both say "
                    f"what to train. Fix: keep one of them.",
                    field="model",
                )
            )
        if self.data is not None and self.model is None:
            problems.append(
                ConfigError(
                    f"{spell('data', self.data)} gives the data of your own model, but no "
                    f"{spell('model')} was given (a recipe brings its data). Fix: add "
                    f"{spell('model', 'MODULE:NAME')}, or drop {spell('data')}.",
                    field="data",
                )
            )
        for field in ("model", "data"):
            value = getattr(self, field)
            if value is None:
                continue
            where, colon, name = value.rpartition(":")
            if (
                not value.strip()
                or any(c.isspace() for c in value)
                or (colon and not (where and name))
            ):
                problems.append(
                    ConfigError(
                        f"{spell(field, value)}: expected MODULE:NAME, a module (or .py file) "
                        f"and the name in it. Fix: e.g. {spell(field, 'mymodels:build')}.",
                        field=field,
                    )
                )

    def _check_nodes(
        self, bad: Callable[[str, str, str], None], problems: list[ConfigError]
    ) -> None:
        from scaletrain.env.network import node_range, split_endpoint

        max_nodes: int | None = 1
        if self.nnodes is not None:
            try:
                _, max_nodes = node_range(self.nnodes)
            except ValueError as exc:
                max_nodes = None  # unknown: the node rank is not checked against it
                bad(
                    "nnodes",
                    f"a node count such as 2, or a range MIN:MAX such as 1:4 ({exc})",
                    f"pass e.g. {spell('nnodes', 2)}",
                )
        if (
            max_nodes is not None
            and self.node_rank is not None
            and not 0 <= self.node_rank < max_nodes
        ):
            bad(
                "node_rank",
                f"an index in 0..{max_nodes - 1} for {spell('nnodes', self.nnodes or 1)}",
                f"give node 0 {spell('node_rank', 0)} and the others 1, 2, ..., or raise "
                f"{spell('nnodes')}",
            )
        if self.rdzv_endpoint is not None:
            try:
                split_endpoint(self.rdzv_endpoint)
            except ValueError as exc:
                bad(
                    "rdzv_endpoint",
                    f"HOST:PORT of node 0, the same on every node ({exc})",
                    f"pass e.g. {spell('rdzv_endpoint', 'node0:29500')}",
                )
        if max_nodes is not None and max_nodes > 1 and self.rdzv_endpoint is None:
            problems.append(
                ConfigError(
                    f"{spell('nnodes', self.nnodes)} spans several machines, but no "
                    f"{spell('rdzv_endpoint')} says where they meet. Expected HOST:PORT of node "
                    f"0, the same on every node. Fix: on every node pass "
                    f"{spell('rdzv_endpoint', 'NODE0:29500')} and {spell('rdzv_id', 'JOB')}, "
                    f"and on node 0 also {spell('node_rank', 0)}.",
                    field="rdzv_endpoint",
                )
            )
        for field in ("rdzv_id", "local_addr"):
            value = getattr(self, field)
            if value is not None and (not value.strip() or any(c.isspace() for c in value)):
                bad(field, "a value without spaces", f"pass e.g. {spell(field, 'job42')}")

    def run_name(self) -> str:
        """What the run is called in default run directories and job names: the recipe,
        or the name of a --model's factory (its module's name for MODULE:build, its
        directory's for a config.json)."""
        if self.model is None:
            return self.resolved_recipe()
        where, _, name = self.model.rpartition(":") if ":" in self.model else (self.model, "", "")
        if not name or name == "build":
            path = Path(where)
            if where.endswith(".json") or path.is_dir():
                # A Hugging Face config.json: the directory that holds it names the model.
                name = (path.resolve().parent if where.endswith(".json") else path.resolve()).name
            else:
                name = path.stem if where.endswith(".py") else where.rsplit(".", 1)[-1]
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "model"

    def resolved_recipe(self) -> str:
        """The recipe to run: the one asked for, else the default for the strategy (a
        --model run has none: see scaletrain.train.recipes.recipe_for)."""
        if self.recipe is not None:
            return self.recipe
        # Tensor parallel shards Linear pairs; the default ConvNet has none, the GPT does.
        return "gpt" if self.strategy == "tensor" or "tp=" in (self.mesh or "") else "convnet"

    def strategy_object(self) -> Strategy:
        """The strategy named, with the levers (--ac, --ac-every, --compile, --float8) set on it."""
        from scaletrain.strategies import STRATEGIES

        return STRATEGIES[self.strategy](
            ac=self.ac, ac_every=self.ac_every, compile=self.compile, float8=self.float8
        )

    def default_nproc(self, gpus: int) -> int:
        """Processes on this node when --nproc is not given."""
        if self.nproc is not None:
            return self.nproc
        if self.strategy in SINGLE_PROCESS_STRATEGIES:
            return 1
        return gpus or 2

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes` applied (and validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
