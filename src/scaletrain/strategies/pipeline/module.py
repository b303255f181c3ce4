"""PipelineModule: the full model plus this rank's traced stages and their schedule.

Stages are traced at the first batch (the tracer needs an example microbatch) and
cached per input shape, dtype, mode and microbatch size; see the package docstring.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from scaletrain.errors import ConfigError
from scaletrain.strategies.levers import apply_levers
from scaletrain.strategies.pipeline.inputs import batch_size, pad, to_device, trailing

__all__ = ["PipelineModule"]


@dataclass(slots=True)
class _Built:
    """One traced shape/mode: this rank's stages and the schedule that drives them."""

    schedule: Any
    stages: list[Any]
    microbatch_size: int
    out_meta: Any = None
    """(treespec, [(shape, dtype)]) of the padded outputs, learnt once from the last stage."""
    out_spec: Any = None
    """The model's own output structure (`_output_spec`), on the ranks of the last stage."""


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
        ac: str = "none",
        compile: bool | str = False,
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
        self.ac = ac
        self.compile_stages = compile
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
        self._out_spec: Any = None
        self._watchers: list[tuple[Callable[[nn.Module], None], Callable[[], None]]] = []
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

    def watch_stages(
        self, stage: Callable[[nn.Module], None], schedule: Callable[[], None]
    ) -> None:
        """Call `stage(submodule)` on every stage this rank runs (now for those built,
        at their build for the rest) and `schedule()` as each training step's schedule
        starts: the step ledger's hooks (scaletrain.observe.metrics.hooks.watch_stages), since
        the schedule never calls this module's forward."""
        self._watchers.append((stage, schedule))
        for built in self._built.values():
            for s in built.stages:
                stage(s.submod)

    # -- training -----------------------------------------------------------------
    def build(self, inputs: Any) -> None:
        """Trace and build this rank's stages for batches shaped like `inputs`, now.

        Normally the first train step does it. Build earlier when something needs the
        stages before training (loading a checkpoint, whose optimizer state covers only
        this rank's stages) through `rt.prepare`: it traces under the run's autocast, as
        the steps run. Traced without it, under bf16-mixed, a stage would expect float32
        from the stage before, which sends bf16.
        """
        batch = batch_size(inputs)
        if batch % self.microbatches == 0:
            self._get(inputs, batch // self.microbatches, train=True)

    def train_step(
        self,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Run the schedule's forward and backward over the microbatches; the mean loss."""
        batch = batch_size(inputs)
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
        self._loss_fn, self._out_spec = loss_fn, built.out_spec
        self._mb_losses = []
        args = (to_device(inputs, self.device),) if self.holds_first else ()
        target = targets.to(self.device) if self.holds_last else None
        for _, schedule in self._watchers:
            schedule()
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
        loss = self._loss_fn(_as_model_output(output, self._out_spec), target)
        self._mb_losses.append(loss.detach())
        return loss / self.microbatches

    # -- evaluation ---------------------------------------------------------------
    def predict(self, inputs: Any) -> Any:
        """The full model's outputs for `inputs` (any batch size), on every rank."""
        batch = batch_size(inputs)
        need = -(-batch // self.microbatches)
        mode = self.module.training
        # Reuse a traced microbatch size that fits, so a smaller last batch costs no trace.
        fitting = [
            key[3]
            for key in self._built
            if key[0] == "predict" and key[1] == trailing(inputs) and key[2] == mode
        ]
        fitting = [size for size in fitting if size >= need]
        mb = min(fitting) if fitting else need
        padded = pad(inputs, mb * self.microbatches)
        built = self._get(padded, mb, train=False)
        args = (to_device(padded, self.device),) if self.holds_first else ()
        out = built.schedule.step(*args, return_outputs=True)
        if built.out_meta is None:
            meta: list[Any] = [None]
            if self.holds_last:
                leaves, spec = pytree.tree_flatten(_as_model_output(out, built.out_spec))
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
        key = ("train" if train else "predict", trailing(inputs), mode, microbatch_size)
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
        pipe = self._trace(to_device(example, self.device))
        stages = [pipe.build_stage(i, self.device, self.pp_group) for i in self.stage_indices]
        for s in stages:
            # A stage is one traced graph, with no blocks left inside: the levers act on
            # it whole (checkpointing each microbatch's stage forward is GPipe's
            # rematerialisation). Evaluation keeps nothing to recompute.
            apply_levers(
                s.submod,
                ac=self.ac if train else "none",
                compile=self.compile_stages,
                blocks=[""],
                owner="Pipeline(...)",
            )
        for watch, _ in self._watchers:
            for s in stages:
                watch(s.submod)
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
        out_spec = self._output_spec(to_device(example, self.device)) if self.holds_last else None
        return _Built(schedule, stages, microbatch_size, out_spec=out_spec)

    def _output_spec(self, example: Any) -> Any:
        """The model's own output structure (a Hugging Face ModelOutput around its
        logits), which the traced last stage returns as bare leaves: what one forward on
        fake tensors returns (no memory, no values), its parameters and buffers fakes too,
        so that what the forward updates in place (BatchNorm's counts) stays as it was.
        None where it cannot run there."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        module = self.module
        try:
            with (
                FakeTensorMode(allow_non_fake_inputs=True) as mode,
                _no_kv_cache(module),
                torch.no_grad(),
            ):
                fake = pytree.tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, example
                )
                named = [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]  # fmt: skip
                state: dict[str, Any] = {name: mode.from_tensor(t) for name, t in named}
                out = torch.func.functional_call(module, state, (fake,))
                return pytree.tree_flatten(out)[1]
        except Exception:  # the trace ran it; a hook of the user's may not run on fakes
            return None

    def _trace(self, example: Any) -> Any:
        from torch.distributed.pipelining import SplitPoint, pipeline

        spec = dict.fromkeys(self.split_points, SplitPoint.BEGINNING)
        try:
            with (
                _restore_forwards(self.module, self.split_points),
                _no_kv_cache(self.module),
                warnings.catch_warnings(),
            ):
                # torch 2.13's own tracer trips its own pytree deprecation; not the user's.
                warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec", FutureWarning)
                pipe = pipeline(self.module, mb_args=(example,), split_spec=spec)
        except RuntimeError as e:
            raise ConfigError(
                f"the pipeline tracer (torch.export) could not capture "
                f"{type(self.module).__name__} with an example microbatch of shapes "
                f"{trailing(example)}: {e}. The model's forward must be traceable as one "
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


def _as_model_output(output: Any, spec: Any) -> Any:
    """The last stage's `output` in the model's own structure `spec` (`_output_spec`):
    a loss function gets what the model returns under every strategy (`out.logits`)."""
    if spec is None:
        return output
    leaves, own = pytree.tree_flatten(output)
    if own == spec or len(leaves) != spec.num_leaves:
        return output
    return pytree.tree_unflatten(leaves, spec)


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model traced without its key-value cache (config.use_cache: its
    DynamicCache is an output torch.export cannot return, and training keeps none), the
    user's setting put back after."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None))}
    # A composite model's parts have configs of their own (a vision-language model's
    # text_config), which its language model reads.
    parts = [getattr(c, "text_config", None) for c in configs.values()]
    configs.update({id(c): c for c in parts if c is not None})
    cached = [c for c in configs.values() if getattr(c, "use_cache", None)]
    for config in cached:
        config.use_cache = False
    try:
        yield
    finally:
        for config in cached:
            config.use_cache = True


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
