"""Pipeline parallel: the model cut into stages, one (or more) per rank, fed microbatches.

Built on `torch.distributed.pipelining`: its tracer (`pipeline()`, torch.export
underneath) cuts the user's unchanged model before the named submodules, and its
schedules (GPipe, 1F1B, Interleaved 1F1B) run the microbatches through the stages.

Why the stages are built lazily, at the first `forward_backward`/`predict`: the
tracer needs an example microbatch, and `rt.setup(model, optimizer)` has none. So
`setup()` returns a `PipelineModule` that holds the full model, and the optimizer
comes back as the same object. At the first batch the model is traced, this rank's
stage(s) are built, and the optimizer's param_groups are rewritten in place to this
rank's stage parameters (the tracer keeps the user's parameter objects, it does not
copy them, so the optimizer needs no rebuild and LR schedulers built on it keep
working).

Shapes: a traced stage has the microbatch shape baked in (torch.export specialises
the batch dimension, e.g. a `reshape(2, -1)` in ConvNet), and the train/eval mode
too (BatchNorm). A new input shape or mode therefore builds another set of stages
(about a second per trace), cached per (shape, dtype, mode): a smaller last training
batch just costs one extra trace, as long as it still divides into `microbatches`
equal parts (else a ConfigError says so; use `drop_last=True` in training loaders).
`predict` takes any batch size: it pads the batch (repeating its last sample) up to
the microbatch size it already traced when the batch fits, else to the next multiple
of `microbatches`, and slices the padding off the outputs.

Losses: `loss_fn(outputs, targets)` runs on the last stage once per microbatch and
should average over its microbatch (as cross_entropy does); the step's gradient is
then the batch mean's, and the returned loss (the same on every pipeline rank) is the
mean over microbatches, which equals the batch mean for equal microbatches. A model
with batch-coupled layers (BatchNorm) sees microbatches, as under gradient
accumulation; evaluate in eval() mode, where padding rows cannot leak into the
real ones.

Scope: this strategy spans the "pp" dimension only. With a mesh that also has "dp",
`data_parallel` hands all stages of a replica the same shard, and averaging the
stage gradients over "dp" is the composing strategy's job (strategies/mesh.py).

What each rank's full model holds: every rank keeps the whole user model (`rt.unwrap`),
but trains only the parameters of its own stage(s); the other stages' tensors stay at
their initial values on that rank. `PipelineModule.stage_state_dict()` gives this
rank's share under the full model's names; the union over the pipeline ranks is the
trained model's state dict.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from scaletrain.errors import ConfigError
from scaletrain.strategies.base import Strategy, register

if TYPE_CHECKING:
    from scaletrain.runtime import Runtime

__all__ = ["SCHEDULES", "Pipeline", "PipelineModule", "balance_stages", "pipeline_layers"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Schedule names: fill-drain, one-forward-one-backward, and 1F1B over virtual stages."""

_INTERLEAVED_STAGES_PER_RANK = 2
"""Virtual stages per rank for `interleaved-1f1b` when `stages` is left to None."""


@register
@dataclass(kw_only=True, slots=True)
class Pipeline(Strategy):
    """Pipeline parallel over the "pp" ranks (all ranks without a mesh)."""

    name: ClassVar[str] = "pipeline"

    stages: int | Sequence[str] | None = None
    """N (balance N stages by parameter count), split-point module names, or None (one per rank)."""
    schedule: str = "1f1b"
    """"gpipe", "1f1b" or "interleaved-1f1b" (several virtual stages per rank)."""
    microbatches: int = 4
    """Equal parts each batch is cut into; more shrink the pipeline bubble."""

    def __post_init__(self) -> None:
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
                "ModuleList entries counted one by one). Fix: fewer stages (or fewer pipeline "
                "ranks), or name the split points to cut inside a layer, e.g. "
                "Pipeline(stages=['layer1.2', 'layer2'])."
            )
        cut = balance_stages([size for _, size in layers], n)
        return tuple(layers[i][0] for i in cut)

    # -- hooks ----------------------------------------------------------------
    def _validate(self, rt: Runtime) -> None:
        if rt.mesh_shape is not None and "pp" not in rt.mesh_shape:
            raise ConfigError(
                f"strategy 'pipeline' needs a 'pp' dimension in the mesh, but the mesh is "
                f"{rt.mesh_shape}. Add it, e.g. mesh={{'pp': 2, 'dp': 2}}, or leave mesh "
                "unset to pipeline over all ranks."
            )
        pp_size = _pp_size(rt)
        if pp_size > 1:
            self.check_layout(pp_size)

    def _setup_module(self, module: nn.Module, rt: Runtime) -> nn.Module:
        module = module.to(rt.device)
        pp_size = _pp_size(rt)
        if pp_size == 1:
            # One process (or pp=1): nothing to pipeline; the same script runs unchanged.
            if isinstance(self.stages, tuple):
                _check_split_names(module, self.stages)
            return module
        self.check_layout(pp_size)
        split = self.split_points(module, pp_size)
        mesh = rt.device_mesh("pp")
        return PipelineModule(
            module,
            split_points=split,
            schedule=self.schedule,
            microbatches=self.microbatches,
            group=mesh.get_group(),
            pp_rank=mesh.get_local_rank(),
            pp_size=pp_size,
            device=rt.device,
        )

    def _checkpoint_module(self, module: nn.Module) -> nn.Module:
        if isinstance(module, PipelineModule) and module.is_built:
            return module.stage_view()
        return module

    def _prepare(self, module: nn.Module, example_inputs: Any) -> None:
        if isinstance(module, PipelineModule) and not module.is_built:
            module.build(example_inputs)

    def _full_state_dict(self, module: nn.Module, rt: Runtime) -> dict[str, torch.Tensor]:
        if not isinstance(module, PipelineModule) or not module.is_built:
            return Strategy._full_state_dict(self, module, rt)
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

    def _setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, rt: Runtime
    ) -> torch.optim.Optimizer:
        if isinstance(module, PipelineModule):
            module.attach_optimizer(optimizer)
        return optimizer

    def _unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, PipelineModule) else module

    def _data_parallel(self, rt: Runtime) -> tuple[int, int]:
        # Every stage of one replica must see the same batch: only "dp" splits the data.
        return rt.mesh_coordinate("dp"), rt.mesh_size("dp")

    def _model_parallel_group(self, rt: Runtime) -> Any:
        # Stages hold different parameters: whole-model norms sum over the stages.
        if rt.world_size == 1 or (rt.mesh_size("pp") == 1 and rt.mesh_shape is not None):
            return None
        return rt.device_mesh("pp").get_group()

    def _forward_backward(
        self,
        module: nn.Module,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        if not isinstance(module, PipelineModule):
            return Strategy._forward_backward(self, module, inputs, targets, loss_fn)
        return module.train_step(inputs, targets, loss_fn)

    def _predict(self, module: nn.Module, inputs: Any) -> Any:
        if not isinstance(module, PipelineModule):
            return Strategy._predict(self, module, inputs)
        return module.predict(inputs)


@dataclass(slots=True)
class _Built:
    """One traced shape/mode: this rank's stages and the schedule that drives them."""

    schedule: Any
    stages: list[Any]
    microbatch_size: int
    out_meta: Any = None
    """(treespec, [(shape, dtype)]) of the padded outputs, learnt once from the last stage."""


class PipelineModule(nn.Module):
    """What `rt.setup` returns under `Pipeline`: the full model plus this rank's stages.

    It is not called like a model: `rt.forward_backward` trains, `rt.predict`
    evaluates, `rt.unwrap` gives the full user model.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        split_points: Sequence[str],
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        pp_rank: int,
        pp_size: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.module = module
        self.split_points = tuple(split_points)
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.pp_group = group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.device = device
        self.num_stages = len(self.split_points) + 1
        per_rank = self.num_stages // pp_size
        # Loop-style placement, as torch's schedules expect: rank r holds r, r+P, ...
        self.stage_indices = [pp_rank + k * pp_size for k in range(per_rank)]
        self.holds_first = 0 in self.stage_indices
        self.holds_last = self.num_stages - 1 in self.stage_indices
        self._built: dict[tuple[Any, ...], _Built] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._local_names: set[str] | None = None
        self._remote_ids: set[int] = set()
        self._loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
        self._mb_losses: list[torch.Tensor] = []
        floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
        self._loss_dtype = floats[0] if floats else torch.float32

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            "a pipeline-parallel model is not called directly: each rank holds only its "
            "stage(s). Train with rt.forward_backward(model, inputs, targets, loss_fn) and "
            "evaluate with rt.predict(model, inputs); rt.unwrap(model) is the full model."
        )

    # -- public views -----------------------------------------------------------
    @property
    def is_built(self) -> bool:
        """True once the first batch has traced the model and built this rank's stages."""
        return self._local_names is not None

    def stage_parameter_names(self) -> list[str]:
        """Names (in the full model) of the parameters this rank trains."""
        return [n for n, _ in self.module.named_parameters() if n in self._require_local()]

    def stage_view(self) -> nn.Module:
        """A module holding exactly this rank's stage tensors, under their full-model names.

        The same Parameter and buffer objects, in plain containers along the original
        paths, so state-dict tools (checkpoints) see what this rank trains and nothing
        stale: every rank keeps the whole model, but only its stages are current.
        """
        local = self._require_local()
        view = nn.Module()
        tensors = [
            *((n, t, True) for n, t in self.module.named_parameters(remove_duplicate=False)),
            *((n, t, False) for n, t in self.module.named_buffers(remove_duplicate=False)),
        ]
        for name, tensor, is_param in tensors:
            if name not in local:
                continue
            *path, leaf = name.split(".")
            container = view
            for part in path:
                child = container._modules.get(part)
                if child is None:
                    child = nn.Module()
                    container.add_module(part, child)
                container = child
            if is_param:
                container.register_parameter(leaf, tensor)  # type: ignore[arg-type]
            else:
                container.register_buffer(leaf, tensor)
        return view

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's share of the full model's state dict (its stages' params and buffers).

        The union over the ranks of the pipeline group is the trained model.
        """
        local = self._require_local()
        return {k: v for k, v in self.module.state_dict().items() if k in local}

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep `optimizer` to trim its param_groups to this rank's stages when they exist."""
        own = {id(p) for p in self.module.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    raise ConfigError(
                        f"the {type(optimizer).__name__} holds a parameter of shape "
                        f"{tuple(p.shape)} that is not in the model given to setup(). Build "
                        "the optimizer from model.parameters() of that same model."
                    )
        self._optimizers.append(optimizer)
        if self.is_built:
            self._trim(optimizer)

    # -- training -----------------------------------------------------------------
    def build(self, inputs: Any) -> None:
        """Trace and build this rank's stages for batches shaped like `inputs`, now.

        Normally the first train step does it. Call it earlier when something needs the
        stages before training: loading a checkpoint, whose optimizer state covers
        only this rank's stages.
        """
        batch = _batch_size(inputs)
        if batch % self.microbatches == 0:
            self._get(inputs, batch // self.microbatches, train=True)

    def train_step(
        self,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Run the schedule's forward and backward over the microbatches; the mean loss."""
        batch = _batch_size(inputs)
        if batch % self.microbatches:
            raise ConfigError(
                f"Pipeline(microbatches={self.microbatches}) cuts each batch into "
                f"{self.microbatches} equal microbatches, but this batch has {batch} "
                f"sample(s). Fix: a batch size that is a multiple of {self.microbatches} "
                "(drop_last=True in the training loader keeps the last batch full), or "
                f"microbatches set to a divisor of {batch}."
            )
        if not isinstance(targets, torch.Tensor) or targets.shape[:1] != (batch,):
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
            raise ConfigError(
                f"forward_backward got targets {got} for a batch of {batch}; the pipeline "
                "cuts targets along dim 0 like the inputs, so they need the same batch size."
            )
        built = self._get(inputs, batch // self.microbatches, train=True)
        self._loss_fn = loss_fn
        self._mb_losses = []
        args = (_to(inputs, self.device),) if self.holds_first else ()
        target = targets.to(self.device) if self.holds_last else None
        try:
            built.schedule.step(*args, target=target, return_outputs=False)
        finally:
            self._loss_fn = None
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_last:
            loss = torch.stack([x.double() for x in self._mb_losses]).mean()
        self._mb_losses = []
        dist.broadcast(loss, src=self._last_rank(), group=self.pp_group)
        return loss.to(self._loss_dtype)

    def _scaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        # torch's scale_grads=True divides *all* .grad by M after the step, which would
        # also shrink gradients accumulated by earlier calls (no_sync accumulation).
        # Scaling each microbatch's loss by 1/M gives the batch-mean gradient instead.
        assert self._loss_fn is not None
        loss = self._loss_fn(output, target)
        self._mb_losses.append(loss.detach())
        return loss / self.microbatches

    # -- evaluation ---------------------------------------------------------------
    def predict(self, inputs: Any) -> Any:
        """The full model's outputs for `inputs` (any batch size), on every rank."""
        batch = _batch_size(inputs)
        need = -(-batch // self.microbatches)
        mode = self.module.training
        # Reuse a traced microbatch size that fits, so a smaller last batch costs no trace.
        fitting = [
            key[3]
            for key in self._built
            if key[0] == "predict" and key[1] == _trailing(inputs) and key[2] == mode
        ]
        fitting = [size for size in fitting if size >= need]
        mb = min(fitting) if fitting else need
        padded = _pad(inputs, mb * self.microbatches)
        built = self._get(padded, mb, train=False)
        args = (_to(padded, self.device),) if self.holds_first else ()
        out = built.schedule.step(*args, return_outputs=True)
        if built.out_meta is None:
            meta: list[Any] = [None]
            if self.holds_last:
                leaves, spec = pytree.tree_flatten(out)
                meta = [(spec, [(t.shape, t.dtype) for t in leaves])]
            with warnings.catch_warnings():
                # Unpickling the TreeSpec builds a LeafSpec, which torch 2.13 deprecates
                # in its own pytree code: a warning about torch, not the user's model.
                warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec", FutureWarning)
                dist.broadcast_object_list(meta, src=self._last_rank(), group=self.pp_group)
            built.out_meta = meta[0]
        spec, shapes = built.out_meta
        if self.holds_last:
            leaves = [t.contiguous() for t in pytree.tree_flatten(out)[0]]
        else:
            leaves = [torch.empty(s, dtype=d, device=self.device) for s, d in shapes]
        for leaf in leaves:
            dist.broadcast(leaf, src=self._last_rank(), group=self.pp_group)
        return pytree.tree_unflatten([leaf[:batch] for leaf in leaves], spec)

    # -- building -----------------------------------------------------------------
    def _get(self, inputs: Any, microbatch_size: int, *, train: bool) -> _Built:
        mode = self.module.training
        key = ("train" if train else "predict", _trailing(inputs), mode, microbatch_size)
        built = self._built.get(key)
        if built is None:
            built = self._build(inputs, microbatch_size, train=train)
            self._built[key] = built
        return built

    def _build(self, inputs: Any, microbatch_size: int, *, train: bool) -> _Built:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        example = pytree.tree_map(
            lambda t: t[:microbatch_size] if isinstance(t, torch.Tensor) else t, inputs
        )
        pipe = self._trace(_to(example, self.device))
        stages = [pipe.build_stage(i, self.device, self.pp_group) for i in self.stage_indices]
        if self._local_names is None:
            self._learn_ownership(pipe)
        loss_fn = self._scaled_loss if train else None
        schedule: Any
        if self.schedule_name == "interleaved-1f1b":
            schedule = ScheduleInterleaved1F1B(
                stages, self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        elif self.schedule_name == "1f1b" and train:
            schedule = Schedule1F1B(
                stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        else:
            # Forward-only evaluation runs GPipe's fill-drain for the single-stage schedules.
            schedule = ScheduleGPipe(
                stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        return _Built(schedule=schedule, stages=stages, microbatch_size=microbatch_size)

    def _trace(self, example: Any) -> Any:
        from torch.distributed.pipelining import SplitPoint, pipeline

        spec = dict.fromkeys(self.split_points, SplitPoint.BEGINNING)
        try:
            with _restore_forwards(self.module, self.split_points), warnings.catch_warnings():
                # torch 2.13's own tracer trips its own pytree deprecation; not the user's.
                warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec", FutureWarning)
                pipe = pipeline(self.module, mb_args=(example,), split_spec=spec)
        except RuntimeError as e:
            raise ConfigError(
                f"the pipeline tracer (torch.export) could not capture "
                f"{type(self.module).__name__} with an example microbatch of shapes "
                f"{_trailing(example)}: {e}. The model's forward must be traceable as one "
                "graph: no data-dependent Python control flow on tensor values."
            ) from e
        if pipe.num_stages != self.num_stages:
            raise ConfigError(
                f"splitting {type(self.module).__name__} before {list(self.split_points)} "
                f"gave {pipe.num_stages} stage(s), not {self.num_stages}: a split point "
                "splits only where its module's forward is called, once, in the model's "
                "forward (containers such as ModuleList are never called; a module called "
                "twice cannot begin one stage). Fix: name modules that run once, in order."
            )
        if pipe.replicated_params:
            shared = ", ".join(sorted({n for m in pipe.replicated_params for n in m.values()}))
            raise ConfigError(
                f"parameter(s) {shared} are used by more than one stage (tied weights). The "
                "tracer copies them per stage and the copies would drift apart. Fix: choose "
                "split points that keep the modules sharing them in one stage."
            )
        return pipe

    def _learn_ownership(self, pipe: Any) -> None:
        """Which of the full model's tensors this rank's stages use (the tracer keeps the
        model's own parameter and buffer objects: checked here, by identity)."""
        names: dict[int, list[str]] = {}
        for n, t in [
            *self.module.named_parameters(remove_duplicate=False),
            *self.module.named_buffers(remove_duplicate=False),
        ]:
            names.setdefault(id(t), []).append(n)
        local: set[str] = set()
        remote: set[str] = set()
        remote_ids: set[int] = set()
        for index in range(pipe.num_stages):
            stage = pipe.get_stage_module(index)
            for t in [*stage.parameters(), *stage.buffers()]:
                if id(t) not in names:
                    if isinstance(t, nn.Parameter):
                        raise ConfigError(
                            f"the pipeline tracer copied a parameter of shape "
                            f"{tuple(t.shape)} instead of keeping the model's own, so training "
                            "would update a copy. Pipeline this model with split points that "
                            "keep shared modules in one stage."
                        )
                    continue  # a constant the tracer made (not model state)
                if index in self.stage_indices:
                    local.update(names[id(t)])
                else:
                    remote.update(names[id(t)])
                    remote_ids.add(id(t))
        # State no stage uses (an unused buffer) goes with the first stage, so the union
        # of the ranks' stage_state_dict() is still the whole state dict.
        if self.holds_first:
            local.update(set(self.module.state_dict()) - local - remote)
        self._local_names = local
        local_ids = {id(p) for n, p in self.module.named_parameters() if n in local}
        self._remote_ids = remote_ids - local_ids
        for optimizer in self._optimizers:
            self._trim(optimizer)

    def _last_rank(self) -> int:
        """Global rank of the pipeline rank holding the last stage (loop placement: P-1)."""
        return dist.get_global_rank(self.pp_group, self.pp_size - 1)

    def _trim(self, optimizer: torch.optim.Optimizer) -> None:
        # In place: the user's optimizer object (and any LR scheduler on it) stays valid.
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) not in self._remote_ids]
            for p in group["params"]:
                if id(p) in self._remote_ids:
                    optimizer.state.pop(p, None)
            group["params"] = kept

    def _require_local(self) -> set[str]:
        if self._local_names is None:
            raise ConfigError(
                "the pipeline stages are built at the first rt.forward_backward or "
                "rt.predict call (tracing needs an example batch); call one first."
            )
        return self._local_names


# -- model inspection -------------------------------------------------------------------
def pipeline_layers(model: nn.Module) -> list[tuple[str, int]]:
    """(first module name, parameter count) of each layer the balancer may cut between.

    Layers are the model's top-level children in order, ModuleList/ModuleDict entries
    counted one by one; a child without parameters (dropout, activation) joins the
    layer before it, so no stage begins with one.
    """
    entries: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            entries.extend((f"{name}.{sub}", m) for sub, m in child.named_children())
        else:
            entries.append((name, child))
    seen: set[int] = set()
    layers: list[list[Any]] = []
    leading = 0
    for name, child in entries:
        size = 0
        for p in child.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel()
        has_params = any(True for _ in child.parameters())
        if has_params:
            layers.append([name, size])
        elif layers:
            layers[-1][1] += size
        else:
            leading += size
    if layers:
        layers[0][1] += leading
    return [(str(n), int(s)) for n, s in layers]


def balance_stages(sizes: Sequence[int], n: int) -> list[int]:
    """Indices where stages 1..n-1 begin: contiguous, the largest stage as small as it can be.

    Ties (several cuts with the same largest stage) go to the most even one (least
    sum of squared stage sizes).
    """
    k = len(sizes)
    if not 1 <= n <= k:
        raise ValueError(f"cannot cut {k} layer(s) into {n} non-empty stage(s)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def total(i: int, j: int) -> int:
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[s][j]: smallest possible largest stage cutting the first j layers into s stages.
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for s in range(1, n + 1):
        for j in range(s, k + 1):
            best[s][j] = min(max(best[s - 1][i], total(i, j)) for i in range(s - 1, j))
    limit = best[n][k]
    # Among cuts within `limit`, the least sum of squares; remember where each stage began.
    sq = [[inf] * (k + 1) for _ in range(n + 1)]
    start = [[0] * (k + 1) for _ in range(n + 1)]
    sq[0][0] = 0
    for s in range(1, n + 1):
        for j in range(s, k + 1):
            for i in range(s - 1, j):
                if total(i, j) <= limit and sq[s - 1][i] + total(i, j) ** 2 < sq[s][j]:
                    sq[s][j] = sq[s - 1][i] + total(i, j) ** 2
                    start[s][j] = i
    cuts: list[int] = []
    j = k
    for s in range(n, 0, -1):
        j = start[s][j]
        cuts.append(j)
    return sorted(cuts)[1:]


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


def _pp_size(rt: Runtime) -> int:
    if rt.mesh_shape is not None:
        return rt.mesh_size("pp")
    return rt.world_size


def _batch_size(inputs: Any) -> int:
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if not leaves or any(t.dim() == 0 for t in leaves):
        raise ConfigError(
            f"the pipeline cuts inputs into microbatches along dim 0, but got "
            f"{type(inputs).__name__} with no batched tensor. Pass a tensor (or a tuple of "
            "tensors) whose first dimension is the batch."
        )
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise ConfigError(f"pipeline inputs disagree on the batch size (dim 0): {sorted(sizes)}.")
    return int(leaves[0].shape[0])


def _trailing(inputs: Any) -> tuple[Any, ...]:
    """Everything about the inputs a trace depends on, but the batch size."""
    leaves, spec = pytree.tree_flatten(inputs)
    return (
        str(spec),
        tuple(
            (tuple(t.shape[1:]), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
            for t in leaves
        ),
    )


def _to(inputs: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def _pad(inputs: Any, size: int) -> Any:
    """Repeat the last sample up to `size` rows (valid values for any input: token ids too)."""

    def pad(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.shape[0] == size:
            return t
        extra = t[-1:].expand(size - t.shape[0], *t.shape[1:])
        return torch.cat([t, extra])

    return pytree.tree_map(pad, inputs)


@contextlib.contextmanager
def _restore_forwards(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Undo the tracer's patching: annotate_split_points rebinds each split module's
    forward in place and leaves it, so the user's model would keep calling pipe_split()."""
    try:
        yield
    finally:
        for name in names:
            with contextlib.suppress(AttributeError):
                sub = model.get_submodule(name)
                sub.__dict__.pop("forward", None)
                sub.__dict__.pop("_orig_forward", None)
