"""The Pipeline strategy: its options, the stage layout rules, and its hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.dist.mesh import device_mesh
from scaletrain.errors import ConfigError, say, spell
from scaletrain.strategies.base import Strategy, register
from scaletrain.strategies.blocks import auto_wrap_targets
from scaletrain.strategies.partition import balance_stages, list_layers
from scaletrain.strategies.pipeline.module import PipelineModule

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology

__all__ = ["SCHEDULES", "Pipeline", "pipeline_layers", "refuse_ac_every", "refuse_float8"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Schedule names: fill-drain, one-forward-one-backward, and 1F1B over virtual stages."""

_INTERLEAVED_STAGES_PER_RANK = 2
"""Virtual stages per rank for `interleaved-1f1b` when `stages` is left to None."""


def refuse_float8() -> None:
    """float8 is refused for pipelines (alone or with DDP), in one line with the fix."""
    raise ConfigError(
        f"{spell('float8', True)} with a pipeline: its stages are traced (torch.export) from "
        "the model, and the tracer cannot capture float8's layers (tensor subclasses in "
        f"their forward). Fix: train the pipeline without {spell('float8')}, or use "
        f"{spell('strategy', 'fsdp')} or {spell('strategy', 'tensor')}, which take it.",
        field="float8",
    )


def refuse_ac_every(ac_every: int | None, owner: str) -> None:
    """A pipeline checkpoints whole stages: the tracer leaves no blocks inside them, so
    there is no k-th block for ac_every to pick."""
    if ac_every is None:
        return
    raise ConfigError(
        f"{say(api=f'{owner}: ', cli='')}{spell('ac_every', ac_every)} with a pipeline: it "
        "checkpoints whole stages (the tracer leaves no blocks inside them), so there is "
        f"no k-th block. Fix: {spell('ac', 'full')} (each stage's forward recomputed per "
        f"microbatch) or {spell('ac', 'selective')} without {spell('ac_every')} (op level, "
        "inside each stage).",
        field="ac_every",
    )


@register
@dataclass(kw_only=True, slots=True)
class Pipeline(Strategy):
    """Pipeline parallel over the "pp" ranks (all ranks without a mesh)."""

    name: ClassVar[str] = "pipeline"
    # Every stage of one replica must see the same batch: alone, the strategy spans
    # "pp" and only a "dp" mesh dimension splits the data.
    mesh_dim: ClassVar[str] = "pp"

    stages: int | Sequence[str] | None = None
    """N (balance N stages by parameter count), split-point module names, or None (one per rank)."""
    schedule: str = "1f1b"
    """"gpipe", "1f1b" or "interleaved-1f1b" (several virtual stages per rank)."""
    microbatches: int = 4
    """Equal parts each batch is cut into; more shrink the pipeline bubble."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        key = str(self.schedule).strip().lower().replace("_", "-")
        key = {"interleaved1f1b": "interleaved-1f1b", "interleaved": "interleaved-1f1b"}.get(
            key, key
        )
        if key not in SCHEDULES:
            raise ConfigError(
                f"Pipeline(schedule={self.schedule!r}) is not a known schedule; expected one "
                f"of {', '.join(map(repr, SCHEDULES))}."
            )
        self.schedule = key
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int):
            raise ConfigError(
                f"Pipeline(microbatches={self.microbatches!r}) must be an int >= 1, e.g. 4."
            )
        if self.microbatches < 1:
            raise ConfigError(
                f"Pipeline(microbatches={self.microbatches}) must be >= 1, e.g. 4 (each batch "
                "is cut into that many equal microbatches)."
            )
        self.stages = _normalise_stages(self.stages)
        if self.float8:
            refuse_float8()
        refuse_ac_every(self.ac_every, "Pipeline(...)")

    def _blocks(self, module: nn.Module) -> list[str] | None:
        # Whole stages (see refuse_ac_every); in one process, the model's blocks, or the
        # model whole when it has none, as its stages would be.
        return auto_wrap_targets(module) or [""]

    # -- layout ---------------------------------------------------------------
    def num_stages(self, pp_size: int) -> int:
        """Stages over a pipeline group of `pp_size` ranks (all ranks together)."""
        if self.stages is None:
            per_rank = _INTERLEAVED_STAGES_PER_RANK if self.schedule == "interleaved-1f1b" else 1
            return pp_size * per_rank
        if isinstance(self.stages, int):
            return self.stages
        return len(self.stages) + 1

    def check_layout(self, pp_size: int) -> None:
        """Stages, ranks, schedule and microbatches fit together (torch's own rules)."""
        n = self.num_stages(pp_size)
        described = _describe_stages(self.stages)
        if self.schedule != "interleaved-1f1b":
            if n != pp_size:
                raise ConfigError(
                    f"Pipeline({described}, schedule={self.schedule!r}) makes {n} stage(s), "
                    f"but the {self.schedule} schedule runs exactly one stage per rank and the "
                    f"pipeline group has {pp_size} ranks. Fix: {_stages_fix(pp_size)}, or "
                    "schedule='interleaved-1f1b' for several stages per rank."
                )
            if self.schedule == "1f1b" and self.microbatches < n:
                # Schedule1F1B: "Number of microbatches must be >= the number of stages".
                raise ConfigError(
                    f"Pipeline(schedule='1f1b', microbatches={self.microbatches}) needs at "
                    f"least as many microbatches as stages ({n}): 1F1B keeps every stage busy "
                    f"with one microbatch in flight each. Fix: microbatches={n} or more (it must "
                    "divide the batch size), or schedule='gpipe'."
                )
            return
        if n % pp_size or n // pp_size < 2:
            raise ConfigError(
                f"Pipeline({described}, schedule='interleaved-1f1b') makes {n} stage(s) over "
                f"{pp_size} ranks; interleaving needs the same number of stages on every rank, "
                f"at least 2 each: a multiple of {pp_size} that is >= {2 * pp_size}. Fix: "
                f"stages={2 * pp_size} (or stages=None for {_INTERLEAVED_STAGES_PER_RANK} per "
                "rank), or schedule='1f1b' for one stage per rank."
            )
        # ScheduleInterleaved1F1B: rounds = max(1, M // pp_size) must divide M.
        rounds = max(1, self.microbatches // pp_size)
        if self.microbatches % rounds:
            good = [m for m in range(pp_size, 4 * pp_size + 1) if m % max(1, m // pp_size) == 0]
            raise ConfigError(
                f"Pipeline(schedule='interleaved-1f1b', microbatches={self.microbatches}) on "
                f"{pp_size} ranks: torch's Interleaved 1F1B runs microbatches in rounds of "
                f"{pp_size} and needs microbatches divisible by the number of rounds "
                f"({rounds}). Fix: e.g. microbatches={', '.join(map(str, good[:4]))} (any "
                f"multiple of {pp_size} works)."
            )

    def split_points(self, model: nn.Module, pp_size: int) -> tuple[str, ...]:
        """The module names that begin stages 1..N-1: checked, or balanced by parameters."""
        n = self.num_stages(pp_size)
        if isinstance(self.stages, tuple):
            _check_split_names(model, self.stages)
            return self.stages
        layers = pipeline_layers(model)
        if n > len(layers):
            names = ", ".join(name for name, _ in layers)
            raise ConfigError(
                f"a pipeline with more stages than layers: {n} stages asked for "
                f"({_describe_stages(self.stages)} over {pp_size} rank(s), schedule="
                f"{self.schedule!r}), but {type(model).__name__} has only {len(layers)} "
                f"layer(s) to share out ({names}: its top-level children that hold parameters, "
                "ModuleList and nn.Sequential entries counted one by one). Fix: fewer stages "
                "(or fewer pipeline ranks), or name the split points to cut inside a layer, "
                "e.g. Pipeline(stages=['layer1.2', 'layer2'])."
            )
        cut = balance_stages([size for _, size in layers], n)
        return tuple(layers[i][0] for i in cut)

    # -- hooks ----------------------------------------------------------------
    def _validate(self, topo: Topology) -> None:
        if topo.mesh_given and "pp" not in topo.mesh_shape:
            raise ConfigError(
                f"strategy 'pipeline' needs a 'pp' dimension in the mesh, but the mesh is "
                f"{topo.mesh_shape}. Add it, e.g. mesh={{'pp': 2, 'dp': 2}}, or leave mesh "
                "unset to pipeline over all ranks."
            )
        pp_size = _pp_size(topo)
        if pp_size > 1:
            self.check_layout(pp_size)

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        pp_size = _pp_size(topo)
        if pp_size == 1:
            if isinstance(self.stages, tuple):
                _check_split_names(module, self.stages)
            return
        self.check_layout(pp_size)
        self.split_points(module, pp_size)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        pp_size = _pp_size(topo)
        if pp_size == 1:
            # One process (or pp=1): nothing to pipeline; the same script runs unchanged.
            if isinstance(self.stages, tuple):
                _check_split_names(module, self.stages)
            self.apply_levers(module)
            return module
        self.check_layout(pp_size)
        split = self.split_points(module, pp_size)
        mesh = device_mesh(topo, "pp")
        return PipelineModule(
            module,
            split_points=split,
            schedule=self.schedule,
            microbatches=self.microbatches,
            group=mesh.get_group(),
            pp_rank=mesh.get_local_rank(),
            pp_size=pp_size,
            device=topo.device,
            ac=self.ac,
            compile=self.compile,
        )

    def checkpoint_module(self, module: nn.Module) -> nn.Module:
        if isinstance(module, PipelineModule) and module.is_built:
            return module.stage_view()
        return module

    def prepare(self, module: nn.Module, example_inputs: Any) -> None:
        if isinstance(module, PipelineModule) and not module.is_built:
            module.build(example_inputs)

    def _full_state_dict(self, module: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        if not isinstance(module, PipelineModule) or not module.is_built:
            return Strategy._full_state_dict(self, module, topo)
        # Each stage trained only its own layers: gather every stage's share (plain CPU
        # tensors, in memory between our own ranks) and take each tensor from its owner.
        local = {k: v.detach().cpu() for k, v in module.stage_state_dict().items()}
        parts: list[Any] = [None] * module.pp_size
        dist.all_gather_object(parts, local, group=module.pp_group)
        owned: dict[str, torch.Tensor] = {}
        for part in parts:
            owned.update(part)
        full = module.module.state_dict()
        return {k: owned[k] if k in owned else v.detach().cpu() for k, v in full.items()}

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        if isinstance(module, PipelineModule):
            module.attach_optimizer(optimizer)
        return optimizer

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, PipelineModule) else module

    def model_parallel_group(self, topo: Topology) -> Any:
        # Stages hold different parameters: whole-model norms sum over the stages.
        if topo.world_size == 1 or (topo.mesh_given and topo.size("pp") == 1):
            return None
        return device_mesh(topo, "pp").get_group()

    def forward_backward(
        self,
        module: nn.Module,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        if not isinstance(module, PipelineModule):
            return Strategy.forward_backward(self, module, inputs, targets, loss_fn)
        return module.train_step(inputs, targets, loss_fn)

    def batch_splits(self) -> int:
        return self.microbatches

    def _predict(self, module: nn.Module, inputs: Any) -> Any:
        if not isinstance(module, PipelineModule):
            return Strategy._predict(self, module, inputs)
        return module.predict(inputs)


def pipeline_layers(model: nn.Module) -> list[tuple[str, int]]:
    """(first module name, parameter count) of each layer the balancer may cut between:
    the layers of scaletrain.strategies.partition.list_layers."""
    return [(layer.name, layer.size) for layer in list_layers(model)]


def _check_split_names(model: nn.Module, names: Sequence[str]) -> None:
    modules = dict(model.named_modules())
    containers = (nn.ModuleList, nn.ModuleDict)
    bad = [n for n in names if not n or n not in modules]
    empty = [n for n in names if n in modules and n and isinstance(modules[n], containers)]
    if bad or empty:
        layers = [name for name, _ in pipeline_layers(model)]
        if bad:
            what = f"{', '.join(map(repr, bad))}: not submodule(s) of {type(model).__name__}"
        else:
            what = (
                f"{', '.join(map(repr, empty))}: container(s) (ModuleList/ModuleDict) that are "
                "never called, so nothing can begin there"
            )
        raise ConfigError(
            f"Pipeline(stages={list(names)!r}): {what}. Split points are names of submodules "
            f"that begin a stage; valid names include {', '.join(map(repr, layers))} and "
            f"any other of its {len(modules) - 1} submodules (print(dict(model.named_modules())"
            ".keys()) lists them)."
        )


def _normalise_stages(stages: Any) -> int | tuple[str, ...] | None:
    if stages is None:
        return None
    if isinstance(stages, bool):
        raise ConfigError(f"Pipeline(stages={stages!r}) must be an int, module names, or None.")
    if isinstance(stages, int):
        if stages < 1:
            raise ConfigError(
                f"Pipeline(stages={stages}) must be >= 1: the number of stages, e.g. 2."
            )
        return stages
    if isinstance(stages, str):
        # "blocks.2,blocks.4" from a command line or config file.
        stages = [s.strip() for s in stages.split(",") if s.strip()]
    if not isinstance(stages, Sequence) or not all(isinstance(s, str) and s for s in stages):
        raise ConfigError(
            f"Pipeline(stages={stages!r}) must be an int (stages balanced by parameter count), "
            "a list of module names where stages begin (e.g. ['blocks.2']), or None (one stage "
            "per rank)."
        )
    names = tuple(stages)
    if not names:
        raise ConfigError(
            "Pipeline(stages=[]) names no split point; give at least one module name, e.g. "
            "['blocks.2'], or stages=None for one stage per rank."
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"Pipeline(stages={list(names)!r}) repeats {dupes}; name each once.")
    return names


def _describe_stages(stages: int | Sequence[str] | None) -> str:
    if isinstance(stages, tuple):
        return f"stages={list(stages)!r}"
    return f"stages={stages!r}"


def _stages_fix(pp_size: int) -> str:
    return f"stages={pp_size} or stages=None (one per rank), or {pp_size - 1} split point name(s)"


def _pp_size(topo: Topology) -> int:
    return topo.size("pp") if topo.mesh_given else topo.world_size
