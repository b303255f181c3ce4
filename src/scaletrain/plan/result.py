"""`Plan`: every layout of N devices for one model, as data and as the table
`scaletrain plan` prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.plan.costs import Estimate
from scaletrain.plan.hardware import Hardware
from scaletrain.plan.profile import ModelProfile

__all__ = ["Plan", "throughput"]


@dataclass(slots=True)
class Plan:
    """Every layout of `devices` for one model: rows, the recommended one and why."""

    model: str
    devices: int
    nodes: int
    hardware: Hardware
    precision: str
    profile: ModelProfile
    rows: list[Estimate]
    recommended: Estimate | None
    reason: str
    assumptions: list[str] = field(default_factory=list)

    def row(self, label: str) -> Estimate:
        for r in self.rows:
            if r.layout.label == label or r.layout.strategy == label:
                return r
        raise KeyError(label)

    def table(self) -> str:
        mib = 2**20
        head = (
            f"{'layout':<28} {'fits':<5} {'params':>8} {'grads':>8} {'optim':>8} {'acts':>8} "
            f"{'buffers':>8} {'runtime':>8} {'total':>8} | {'compute':>8} {'comm':>8} {'bubble':>8} {'wait':>8} {'step':>8} {'samples/s':>10}"
        )
        lines = [
            f"{self.model} on {self.devices} device(s) over {self.nodes} node(s), "
            f"{self.hardware.description}, precision {self.precision}, batch "
            f"{self.profile.batch_size} per replica; memory MiB per device, time ms per step "
            "(comm = exposed communication, wait = for the slowest rank; runtime = the "
            "processes' own memory beyond the tensors, and for FSDP here what the allocator "
            "keeps"
            + (
                "; on GPUs the total is the peak: with the gradients alive at the "
                "activations' peak where the others come later)"
                if self.hardware.cores is None
                else ")"
            ),
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            m, t = r.memory, r.time
            mark = "*" if r is self.recommended else ""
            lines.append(
                f"{(r.layout.label + mark):<28} {('yes' if r.fits else 'NO'):<5} "
                f"{m.params / mib:8.1f} {m.grads / mib:8.1f} {m.optimizer / mib:8.1f} "
                f"{m.activations / mib:8.1f} {m.buffers / mib:8.1f} {(m.runtime + m.group + m.held) / mib:8.1f} "
                f"{m.total / mib:8.1f} | "
                f"{t.compute * 1e3:8.1f} {t.exposed * 1e3:8.1f} {t.bubble * 1e3:8.1f} "
                f"{t.wait * 1e3:8.1f} {t.total * 1e3:8.1f} {throughput(r, self.profile.batch_size):10,.0f}"
            )
            if r.overflow:
                lines.append(f"    does not fit: {r.overflow}")
        lines.append(f"recommended: {self.reason}")
        lines.extend(f"assumption: {a}" for a in self.assumptions)
        return "\n".join(lines)


def throughput(row: Estimate, batch: int) -> float:
    """Samples per second: every data-parallel replica (dp of them) takes `batch`."""
    return batch * row.layout.dp / max(row.time.total, 1e-12)
