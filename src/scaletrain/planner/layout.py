"""The ways N devices can run one model: a strategy over a dp x tp x pp mesh, the
ZeRO stage its data parallelism shards at, a pipeline's schedule and microbatches,
whether tensor parallel splits its blocks' activations along the sequence, and
whether FSDP offloads its shards to the host."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.errors import ConfigError, unknown
from scaletrain.planner.schedule import SCHEDULES

__all__ = ["SCHEDULES", "STRATEGIES", "Layout", "layouts_for", "microbatch_counts"]

STRATEGIES = {"ddp": (0, "dp"), "fsdp": (3, "dp"), "fsdp-keep": (3, "dp"), "tensor": (0, "tp"),
              "pipeline": (0, "pp"), "fsdp x tp": (3, "dp tp"), "ddp x pp": (0, "dp pp")}  # fmt: skip
"""Each row's strategy: the ZeRO stage its data parallelism is, and the mesh dimensions
it spans. DDP replicates everything (0); FSDP shards parameters, gradients and
optimizer state (3), with reshard_after_forward=False too ("fsdp-keep",
`Layout.keeps`): each unit stays gathered from its forward to its backward, one
all-gather per unit."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One row of a plan: a strategy over a mesh (dp x tp x pp = devices)."""

    strategy: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    offload: bool = False
    """FSDP's CPU offload: the shards (parameters, gradients, optimizer state) live in
    host memory, each unit copied in for its gathers, and the optimizer steps there."""
    sp: bool = False
    """Sequence parallel (`TensorParallel(sequence_parallel=True)`): the blocks'
    activations between the sharded layers are split along the sequence too."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"Layout({self.strategy!r}): "
                + unknown("strategy", self.strategy, list(STRATEGIES)),
                field="layouts",
            )
        dims = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        if bad := [f"{k}={v!r}" for k, v in dims.items() if not _whole(v)]:
            raise ConfigError(
                f"Layout({self.strategy!r}, {', '.join(bad)}): dp, tp and pp are the devices of "
                "each mesh dimension, whole numbers >= 1. Fix: e.g. Layout('fsdp', dp=8).",
                field="layouts",
            )
        spans = STRATEGIES[self.strategy][1].split()
        if extra := [k for k, v in dims.items() if v > 1 and k not in spans]:
            used = {k for k, v in dims.items() if v > 1}
            fits = [name for name, (_, d) in STRATEGIES.items() if set(d.split()) == used]
            given = ", ".join(f"{k}={v}" for k, v in dims.items() if v > 1)
            raise ConfigError(
                f"Layout({self.strategy!r}, {given}): the {self.strategy} strategy spans "
                f"{' x '.join(spans)}, not {' and '.join(extra)}. Fix: "
                + (f"Layout({fits[0]!r}, {given})." if fits else
                   f"no strategy spans {' and '.join(sorted(used))} together; one of them.")
                ,
                field="layouts",
            )  # fmt: skip
        pipeline = (self.schedule, self.microbatches)
        if self.pp > 1 and (self.schedule not in SCHEDULES or not _whole(self.microbatches)):
            raise ConfigError(
                f"Layout({self.strategy!r}, pp={self.pp}, schedule={self.schedule!r}, "
                f"microbatches={self.microbatches!r}): a pipeline runs a schedule ("
                f"{', '.join(SCHEDULES)}) over microbatches, a whole number >= 1. Fix: e.g. "
                f"Layout({self.strategy!r}, pp={self.pp}, schedule='1f1b', microbatches=4).",
                field="layouts",
            )
        if self.pp == 1 and pipeline != (None, None):
            raise ConfigError(
                f"Layout({self.strategy!r}, schedule={self.schedule!r}, microbatches="
                f"{self.microbatches!r}): a schedule and microbatches are a pipeline's, and this "
                "layout has pp=1. Fix: pp=2 or more, or leave them out.",
                field="layouts",
            )
        if self.sp and self.tp == 1:
            raise ConfigError(
                f"Layout({self.strategy!r}, sp=True): sequence parallel splits what tensor "
                "parallel replicates, and this layout has tp=1. Fix: tp=2 or more, or sp=False.",
                field="layouts",
            )
        if self.offload and (self.stage != 3 or self.dp == 1):
            raise ConfigError(
                f"Layout({self.strategy!r}, dp={self.dp}, offload=True): offload is FSDP's "
                "CPU offload, of the shards of a fully sharded strategy, and one process "
                "trains unwrapped (its states on the device). Fix: strategy 'fsdp' or "
                "'fsdp x tp' with dp=2 or more, or offload=False.",
                field="layouts",
            )

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3) of its data parallelism (STRATEGIES)."""
        return STRATEGIES[self.strategy][0]

    @property
    def keeps(self) -> bool:
        """Whether FSDP keeps each unit gathered from its forward to its backward."""
        return self.strategy == "fsdp-keep"

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh(self) -> str:
        parts = [f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))]
        return ",".join(p for p in parts if not p.endswith("=1")) or "dp=1"

    @property
    def label(self) -> str:
        pipeline = "" if self.schedule is None else f" {self.schedule} m={self.microbatches}"
        extra = (" sp" if self.sp else "") + (" offload" if self.offload else "")
        return f"{self.strategy} {self.mesh}{pipeline}{extra}"


def _whole(value: object) -> bool:
    """Whether `value` is a whole number >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def microbatch_counts(pp: int) -> list[int]:
    """The microbatch counts a plan tries for pp stages, in order: the Pipeline
    strategy's default (4) where it gives every stage one, then pp, 2 pp, 3 pp, 4 pp."""
    return [m for m in dict.fromkeys((4, *range(pp, 4 * pp + 1, pp))) if m >= pp]


def _microbatches(pp: int, batch: int, layers: int) -> int | None:
    """The first of `microbatch_counts` that divides the batch (None: fewer layers than
    stages, or none divides it)."""
    if layers < pp:
        return None
    return next((m for m in microbatch_counts(pp) if batch % m == 0), None)


def layouts_for(
    devices: int, *, batch: int, layers: int, tensor: bool, offload: bool = False,
    sequence: bool = False,
) -> list[Layout]:  # fmt: skip
    """Every layout of `devices` this model can run: tensor parallel where it has a
    plan (`tensor`), each also sequence parallel where its blocks allow (`sequence`), a
    pipeline of pp stages where it has pp layers and a microbatch count that divides
    `batch`, FSDP offloading to the host where there is one (`offload`) at 2 devices
    or more (one process trains unwrapped, its states on the device)."""
    if devices == 1:
        return [Layout("ddp")]
    spill = [Layout("fsdp", dp=devices, offload=True)] if offload else []
    rows = [*(Layout(s, dp=devices) for s in ("ddp", "fsdp-keep", "fsdp")), *spill]
    sp = (False, True) if sequence else (False,)
    if tensor:
        rows += [Layout("tensor", tp=devices, sp=x) for x in sp]
    if m := _microbatches(devices, batch, layers):
        rows += [Layout("pipeline", pp=devices, schedule=s, microbatches=m) for s in SCHEDULES[:2]]
    for dp in (d for d in range(2, devices // 2 + 1) if devices % d == 0):
        other = devices // dp
        if tensor:
            rows += [Layout("fsdp x tp", dp=dp, tp=other, sp=x) for x in sp]
        if m := _microbatches(other, batch, layers):
            rows.append(Layout("ddp x pp", dp=dp, pp=other, schedule="1f1b", microbatches=m))
    return rows
