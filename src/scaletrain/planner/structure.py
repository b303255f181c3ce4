"""A model's structure as the formulas see it, beyond its profile (`Model`): its
layers, FSDP's units, tensor parallel's plan, the blocks sequence parallel splits and
float8's layers; and the bytes per parameter each precision trains and computes in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from scaletrain.planner.profile import ModelProfile
from scaletrain.strategies.partition import Layer, split_layers

__all__ = ["COMPUTE", "DTYPE", "MASTER", "Model", "Share"]

MASTER = {"32": 4.0, "bf16-mixed": 4.0, "fp16-mixed": 4.0, "bf16-true": 2.0}
"""Bytes per parameter of the weights (and gradients) a precision trains: mixed
precision keeps fp32 weights and casts for the matmuls."""
COMPUTE = {"32": 4.0, "bf16-mixed": 2.0, "fp16-mixed": 2.0, "bf16-true": 2.0}
"""Bytes per parameter the matmuls read (what FSDP gathers under its mixed precision)."""
DTYPE = {"32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "bf16"}


class Share(NamedTuple):
    """What one device (a pipeline stage, a tensor-parallel shard) holds of the
    model's parameters, of its trained ones (their gradients and optimizer state), of
    the step's work and of the activations the layers keep: fractions of the whole."""

    params: float
    trained: float
    work: float
    acts: float


@dataclass(frozen=True, slots=True)
class Model:
    """What the formulas need of a model beyond its profile: its layers (for pipeline
    stages), the units FSDP shards, tensor parallel's plan (module name: style), the
    blocks sequence parallel splits (none where it cannot) and the layers float8
    training converts (none without it)."""

    profile: ModelProfile
    layers: Sequence[Layer]
    units: Sequence[str]
    tp_plan: Mapping[str, str] | None = None
    compiled: bool = False
    precision: str = "32"
    sp_blocks: Sequence[str] = ()
    float8: Sequence[str] = ()

    def _sum(self, names: Sequence[str], attr: str) -> float:
        mods = self.profile.modules
        return float(sum(getattr(mods[n], attr) for n in names if n in mods))

    def held_activations(self) -> int:
        """What the top-level layers (blocks in a ModuleList among them) leave alive for
        the backward, at the profile's batch; the root's children where it has none."""
        names = [m for x in self.layers for m in x.members] or [
            n for n in self.profile.modules if n and "." not in n
        ]
        return int(self._sum(names, "activation_bytes"))

    def _holders(self) -> list[str]:
        return sorted({n.rpartition(".")[0] for n in self.tp_plan or {}})

    def tp_shares(self) -> Share:
        """Fractions tensor parallel divides: of the parameters and of the trained ones,
        its planned layers'; of the work, the FLOPs of the (attention and MLP) modules
        holding them."""
        if not self.tp_plan:
            return Share(0.0, 0.0, 0.0, 0.0)
        p, layers = self.profile, list(self.tp_plan)
        params = self._sum(layers, "param_bytes") / max(1, p.param_bytes)
        trained = self._sum(layers, "trainable_bytes") / max(1, p.trainable_bytes)
        flops = self._sum(self._holders(), "flops") / max(1.0, p.flops)
        return Share(min(params, 1.0), min(trained, 1.0), min(flops, 1.0), 0.0)

    def tp_split(self, sp: bool = False, recomputing: bool = True) -> float:
        """Bytes of the peak (at the profile's batch) tensor parallel divides: what the
        modules holding its layers keep for the backward, less their outputs (a rowwise
        layer's, whole on every rank); with sequence parallel, all the blocks keep. Under
        checkpointing also one block's recomputation: what those modules (with sequence
        parallel, the block's children) hold when run again, less their outputs likewise.
        Where a holder is the block itself, its recomputation is not seen and counts
        whole (`recomputing` False: no block is being recomputed, as before the
        backward reaches the blocks). The rest (embeddings, head, the loss) is whole."""
        if not self.tp_plan:
            return 0.0
        mods, whole = self.profile.modules, 0 if sp else 1  # a rowwise output is whole

        def part(names: Sequence[str], attr: str) -> float:
            return sum(max(0, getattr(mods[n], attr) - whole * mods[n].output_bytes)
                       for n in names if n in mods)  # fmt: skip

        if sp:
            kept = part(self.sp_blocks, "activation_bytes")
            groups = [[c for c in mods if c.rpartition(".")[0] == b] for b in self.sp_blocks]
        else:
            holders = self._holders()
            kept = part(holders, "activation_bytes")
            groups = [[h for h in holders if h.startswith(u + ".")] for u in self.units]
        if not recomputing:
            return kept
        return kept + max((part(g, "recomputed_bytes") for g in groups), default=0.0)

    def tp_messages(self, sp: bool = False) -> tuple[int, int, float]:
        """(rowwise layers, colwise inputs) of tensor parallel, whose collectives a step
        runs, and the bytes of each collective. A rowwise layer's output is all-reduced,
        or with sequence parallel reduce-scattered; each input of the colwise layers
        (`gatherers`) has its gradient all-reduced in the backward, or with sequence
        parallel is gathered and its gradient reduce-scattered."""
        if not self.tp_plan:
            return 0, 0, 0.0
        rows = self.styled("rowwise")
        cols = len(self.gatherers())
        return len(rows), cols, self._sum(rows, "output_bytes") / max(1, len(rows))

    def styled(self, style: str) -> list[str]:
        """The layers tensor parallel's plan gives `style` ("colwise", "rowwise")."""
        return [n for n, s in (self.tp_plan or {}).items() if s == style]

    def gatherers(self) -> list[str]:
        """The colwise layers that redistribute their input (sequence parallel: gather
        it): of those that take the same tensor in one call of the module holding them
        (ModuleCost.input: an attention's q, k and v), the first, as TensorParallel
        shares it; a float8 layer each (float8's styles share nothing)."""
        mods, seen, out = self.profile.modules, set(), []
        for n in self.styled("colwise"):
            took = mods[n].input if n in mods and not self.in_float8(n) else 0
            key = (n.rpartition(".")[0], took) if took else n
            if key not in seen:
                seen.add(key)
                out.append(n)
        return out

    def in_float8(self, name: str) -> bool:
        """Whether float8 training converts the layer `name`, or every layer of tensor
        parallel's plan under the module `name` (a gatherer of torchtitan's plan; "" the
        root): float8's styles gather such a layer's input in float8."""
        under = [n for n in self.tp_plan or {} if not name or n.startswith(f"{name}.")]
        return name in self.float8 or (bool(under) and set(under) <= set(self.float8))

    def recompute(self, names: Sequence[str]) -> list[int]:
        """How far checkpointing's recomputation ran each module (ModuleCost.recompute)."""
        mods = self.profile.modules
        return [mods[n].recompute if n in mods else 0 for n in names]

    def edge(self, pp: int) -> int:
        """Bytes (at the profile's batch) of the largest send between pp stages."""
        stages = split_layers(self.layers, pp)[:-1]
        return max(self.profile.modules[s[-1].members[-1]].output_bytes for s in stages)

    def stage_shares(self, pp: int) -> list[Share]:
        """Each of pp stages' shares (one stage: the whole); what sits outside the
        layers goes to the first stage's parameters and the last stage's work (the
        loss)."""
        if pp == 1:
            return [Share(1.0, 1.0, 1.0, 1.0)]
        p = self.profile
        members = [[m for x in s for m in x.members] for s in split_layers(self.layers, pp)]
        attrs = ("param_bytes", "trainable_bytes", "flops", "activation_bytes")
        par, trained, work, acts = ([self._sum(ms, a) for ms in members] for a in attrs)
        par[0] += max(0.0, p.param_bytes - sum(par))
        trained[0] += max(0.0, p.trainable_bytes - sum(trained))
        work[-1] += max(0.0, p.flops - sum(work))
        total = [max(1.0, sum(x)) for x in (par, trained, work, acts)]
        return [
            Share(*(x / t for x, t in zip(row, total, strict=True)))
            for row in zip(par, trained, work, acts, strict=True)
        ]

    def blocks_in_one_stage(self, pp: int) -> bool:
        """Whether one of pp stages holds every block (FSDP's units) of a model of
        several: one of its top-level layers holds them all."""
        stages = [[m for x in s for m in x.members] for s in split_layers(self.layers, pp)]
        return len(self.units) > 1 and any(
            all(any(u == m or u.startswith(m + ".") for m in s) for u in self.units) for s in stages
        )

    def unit_params(self, trained: bool = False) -> list[float]:
        """Parameters (bytes at training precision) of each FSDP unit and of the root
        holding the rest; `trained`: of those, the trained ones' (the gradients it
        reduces). One entry per unit either way."""
        own = [self._sum([u], "param_bytes") for u in self.units]
        rest = self.profile.param_bytes - sum(own)
        if not trained:
            return [*own, rest] if rest > 0 else own
        grads = [self._sum([u], "trainable_bytes") for u in self.units]
        left = self.profile.trainable_bytes - sum(grads)
        return [*grads, max(0.0, left)] if rest > 0 else grads

    def gathered(self) -> list[float]:
        """Bytes FSDP gathers per byte of each `unit_params` entry: the compute dtype's,
        and one byte for a float8 layer's weights (FSDP's float8 all-gather)."""
        cast, one = COMPUTE[self.precision] / MASTER[self.precision], 1 / MASTER[self.precision]
        f8 = [self._sum([n for n in self.float8 if n.startswith(u + ".")], "param_bytes")
              for u in self.units]  # fmt: skip
        return [cast - (cast - one) * min(1.0, f / max(1.0, own))
                for f, own in zip([*f8, 0.0], self.unit_params(), strict=False)]  # fmt: skip
