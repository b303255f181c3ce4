"""The ways N devices can run one model: strategy, mesh, pipeline schedule and microbatches."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "layouts_for"]


@dataclass(frozen=True, slots=True)
class Layout:
    """One row of a plan: a strategy over a mesh (dp x tp x pp = devices)."""

    strategy: str
    """"ddp", "fsdp", "tensor", "pipeline", "fsdp x tp" or "ddp x pp"."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str | None = None
    microbatches: int | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh(self) -> str:
        parts = [f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))]
        return ",".join(p for p in parts if not p.endswith("=1")) or "dp=1"

    @property
    def label(self) -> str:
        text = f"{self.strategy} {self.mesh}"
        if self.schedule is not None:
            text += f" {self.schedule} m={self.microbatches}"
        return text


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n // 2 + 1) if n % a == 0 and n // a >= 2]


def _microbatches(pp: int, batch: int) -> int | None:
    """The Pipeline strategy's default (4) when it divides the batch and 1F1B accepts
    it (at least one per stage), else the smallest multiple of pp that does."""
    for m in (4, *range(pp, 4 * pp + 1, pp)):
        if m >= pp and batch % m == 0:
            return m
    return None


def layouts_for(
    devices: int, *, batch: int, layers: int, tensor_ok: bool, schedules: tuple[str, ...] = ()
) -> list[Layout]:
    """Every layout of `devices` this model can use.

    Tensor parallel needs Linear pairs (`tensor_ok`); a pipeline of pp stages needs at
    least pp layers and a microbatch count that divides `batch`.
    """
    if devices == 1:
        return [Layout("ddp", dp=1)]
    rows = [Layout("ddp", dp=devices), Layout("fsdp", dp=devices)]
    if tensor_ok:
        rows.append(Layout("tensor", tp=devices))
    if layers >= devices:
        m = _microbatches(devices, batch)
        if m is not None:
            for schedule in schedules or ("1f1b", "gpipe"):
                rows.append(Layout("pipeline", pp=devices, schedule=schedule, microbatches=m))
    for dp, other in _factor_pairs(devices):
        if tensor_ok:
            rows.append(Layout("fsdp x tp", dp=dp, tp=other))
        if layers >= other:
            m = _microbatches(other, batch)
            if m is not None:
                rows.append(Layout("ddp x pp", dp=dp, pp=other, schedule="1f1b", microbatches=m))
    return rows
