"""The strategy axis: how a model is placed and wrapped for many devices.

A strategy is a small dataclass whose fields are its configuration
(`st.DDP(bucket_cap_mb=50)`) and whose methods do the wrapping. Users pick one by
name ("ddp") or by instance; the registry maps names to classes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from scaletrain.dist.replicas import first_replica_values
from scaletrain.errors import ConfigError, article, near_fix
from scaletrain.strategies.float8 import check_float8, convert_float8, float8_layers, plain_tensor
from scaletrain.strategies.levers import apply_levers, check_compiler, check_levers, lever_blocks

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology
    from scaletrain.precision import Precision

__all__ = [
    "STRATEGIES",
    "Strategy",
    "parameter_names",
    "rebind_optimizer",
    "rebind_to_wrapped",
    "register",
    "remember_parameter_names",
    "resolve_strategy",
]

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy under its `name`."""
    STRATEGIES[cls.name] = cls
    return cls


@dataclass(kw_only=True, slots=True)
class Strategy:
    """Base class. A strategy overrides the public methods it changes, except five,
    whose work every strategy shares and which call a `_hook` for its own part:
    validate, check_model and setup_module (the checks come first: `_validate`,
    `_check_model`, `_setup_module`), full_state_dict (the snapshot and replica 0's
    buffers come after `_full_state_dict`) and predict (no grad around `_predict`).
    `_blocks` names the blocks the levers act on.

    What a method needs of the run it is given as the run's Topology (resolved once by
    st.init): ranks, device, backend and mesh coordinates; nothing else is shared.
    """

    name: ClassVar[str] = "base"
    mesh_dim: ClassVar[str] = "dp"
    """The dimension this strategy spans when no mesh is given: the implicit mesh is
    every rank along it (Topology.resolve)."""

    ac: str = "none"
    """Activation checkpointing of the model's blocks: "none", "full" (every block) or
    "selective" (see ac_every); scaletrain.strategies.levers says how."""
    ac_every: int | None = None
    """With ac="selective": checkpoint every k-th block whole; None: every block at the
    op level (matmul and attention outputs kept, the cheap ops recomputed)."""
    compile: bool | str = False
    """torch.compile each block, after tensor parallel and checkpointing, before FSDP/DDP:
    True (inductor), or a backend's name ("aot_eager" traces the same graphs without
    generating code: the first thing to try when a compiled run misbehaves)."""
    float8: bool = False
    """Train the Linear layers of the model's blocks in float8 (torchao's Float8Linear;
    GPUs of compute capability 8.9+, `pip install 'scaletrain[float8]'`), applied first,
    before tensor parallel; under FSDP the weights are all-gathered in float8. Fast only
    with compile=True."""

    def __post_init__(self) -> None:
        check_levers(f"{type(self).__name__}(...)", self.ac, self.ac_every, self.compile)
        if not isinstance(self.float8, bool):
            raise ConfigError(
                f"{type(self).__name__}(float8={self.float8!r}) must be True or False.",
                field="float8",
            )

    @property
    def uses_levers(self) -> bool:
        """Whether checkpointing, compile or float8 is asked for."""
        return self.ac != "none" or self.compile is not False or self.float8

    def validate(self, topo: Topology) -> None:
        """Fail before training if this strategy cannot work on topo's backend/devices."""
        if self.float8:
            check_float8(topo.device, f"{type(self).__name__}(...)")
        if self.compile:
            check_compiler(topo.device, self.compile)
        self._validate(topo)

    def check_model(self, module: nn.Module, topo: Topology) -> None:
        """The checks setup_module makes on `module`, without wrapping it, without devices
        and without a process group (`module` may live on the meta device): a launcher
        calls it so that a model this strategy cannot split fails before any process
        starts, with the message a worker would give."""
        owner = f"{type(self).__name__}(...)"
        lever_blocks(module, self.ac, self._blocks(module), owner=owner)
        if self.float8:
            float8_layers(module, self._blocks(module), owner=owner)
        self._check_model(module, topo)

    def setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"setup() expected a torch.nn.Module, got {type(module).__name__}. Pass the model "
                "itself, e.g. rt.setup(model, optimizer)."
            )
        return self._setup_module(module, topo)

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        """The optimizer for the module setup_module returned (a wrapper that replaced
        the parameters points it at the new ones)."""
        return optimizer

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module, without wrapper prefixes in its state dict."""
        return module

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        return contextlib.nullcontext()

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        """(rank, size) among the replicas that see different data: the "dp" coordinate
        of the topology's mesh (given, or this strategy's implicit one).

        Ranks that share a model replica (tensor or pipeline parallel peers) share
        a data-parallel rank: they must be fed the same batch.
        """
        return topo.dp_rank, topo.dp_size

    def home_device(self, topo: Topology) -> torch.device:
        """The device this process computes on (inputs go there, NCCL binds to it).

        One GPU per local rank by default; a strategy whose process owns several
        devices (DDP with a device map) names the first of its own.
        """
        return topo.device

    def checkpoint_module(self, module: nn.Module) -> nn.Module:
        """The module whose state this rank saves and loads (a pipeline rank: its stages)."""
        return module

    def prepare(self, module: nn.Module, example_inputs: Any) -> None:
        """Build whatever the strategy builds lazily from the first batch (pipeline
        stages), so state can be loaded into it before the first step."""
        return None

    def adopt_precision(self, precision: Precision, topo: Topology) -> None:
        """Let a strategy that handles precision itself (FSDP's policy) configure it."""
        return None

    def model_parallel_group(self, topo: Topology) -> Any:
        """Process group over which ranks hold DIFFERENT plain (non-DTensor) parameters
        (pipeline stages), for whole-model norms; None when there is none."""
        return None

    def full_state_dict(self, module: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """Plain CPU tensors of the whole model, on every rank (a collective).

        A snapshot under every strategy: no tensor shares memory with the live
        parameters or buffers, so later steps do not change it. (On the CPU,
        `.cpu()` of a replicated model's tensors is the tensor itself; gathered
        shards are new tensors already and are not copied again.)
        """
        state = self._full_state_dict(module, topo)
        live = _storages(module)
        state = {k: v.clone() if _storage(v) in live else v for k, v in state.items()}
        # Buffers are each replica's own (scaletrain.dist.replicas): the model is
        # data-parallel replica 0's, on every rank.
        names = sorted(
            {n for n, _ in self.unwrap(module).named_buffers(remove_duplicate=False)} & state.keys()
        )
        first = first_replica_values([state[n] for n in names], topo)
        state.update(zip(names, first, strict=True))
        return state

    @contextlib.contextmanager
    def first_replica_buffers(self, module: nn.Module, topo: Topology) -> Iterator[None]:
        """Inside the block every data-parallel replica holds replica 0's buffers; each
        rank's own come back on exit (scaletrain.dist.replicas). A collective."""
        buffers = [
            b
            for _, b in self.checkpoint_module(module).named_buffers(remove_duplicate=False)
            if not _is_dtensor(b)
        ]
        if topo.dp_size == 1 or not buffers:
            yield
            return
        first = first_replica_values(buffers, topo)
        own = [b.detach().clone() for b in buffers]
        with torch.no_grad():
            for b, v in zip(buffers, first, strict=True):
                b.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, v in zip(buffers, own, strict=True):
                    b.copy_(v)

    def forward_backward(
        self,
        module: nn.Module,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One micro-step: forward, loss, backward. Returns the detached loss.

        The loss is the same on every rank of a model replica (a pipeline computes
        it on its last stage and shares it), so callers can log it anywhere.
        """
        outputs = module(inputs)
        # Model parallel ends on another device than it starts: follow the outputs.
        loss = loss_fn(outputs, targets.to(_device_of(outputs), non_blocking=True))
        loss.backward()
        return loss.detach()

    def batch_splits(self) -> int:
        """Into how many parts forward_backward cuts a batch, averaging their losses (a
        pipeline's microbatches; 1 for the others): a loss normalised over a whole
        step multiplies by it to undo that mean (scaletrain.train.loop.train_step)."""
        return 1

    def predict(self, module: nn.Module, inputs: Any) -> Any:
        """Evaluation forward (no grad): the outputs, on every rank of the replica.

        Strategies whose forward runs collectives (FSDP, tensor, pipeline) need every
        rank to call this the same number of times; `scaletrain.train.evaluate` does.
        """
        with torch.no_grad():
            return self._predict(module, inputs)

    def apply_float8(
        self, module: nn.Module, *, fsdp_all_gather: bool = False, blocks: list[str] | None = None
    ) -> None:
        """Convert `module`'s blocks' Linear layers to float8 if this strategy's `float8`
        says so, in place. Strategies call it first, on the model's device, before tensor
        parallel and the other levers (see scaletrain.strategies.levers); `fsdp_all_gather`
        where FSDP will shard it over more than one rank."""
        if self.float8:
            convert_float8(
                module,
                self._blocks(module) if blocks is None else blocks,
                fsdp_all_gather=fsdp_all_gather,
                owner=f"{type(self).__name__}(...)",
            )

    def apply_levers(self, module: nn.Module, blocks: list[str] | None = None) -> None:
        """Checkpoint and compile `module`'s blocks as this strategy's fields say, in
        place. Strategies call it where the order holds (after tensor parallel, before
        FSDP/DDP wrap: see scaletrain.strategies.levers); `blocks` default to the
        strategy's own (`_blocks`)."""
        apply_levers(
            module,
            ac=self.ac,
            ac_every=self.ac_every,
            compile=self.compile,
            blocks=self._blocks(module) if blocks is None else blocks,
            owner=f"{type(self).__name__}(...)",
        )

    # -- hooks -----------------------------------------------------------------
    def _validate(self, topo: Topology) -> None:
        return None

    def _blocks(self, module: nn.Module) -> list[str] | None:
        """The blocks the levers act on; None: the model's auto-detected ones."""
        return None

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        return None

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        self.apply_float8(module)
        self.apply_levers(module)
        return module

    def _full_state_dict(self, module: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        # torch's state-dict API gathers DTensor shards (FSDP, TP) and strips DDP's
        # `module.` prefix; on plain modules it is just state_dict().
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(
            self.unwrap(module),
            options=StateDictOptions(full_state_dict=True, cpu_offload=False),
        )
        return {k: plain_tensor(_full_tensor(v)).detach().cpu() for k, v in state.items()}

    def _predict(self, module: nn.Module, inputs: Any) -> Any:
        # The unwrapped module: a wrapper's forward may run collectives (DDP's buffer
        # broadcast) that ranks with one eval batch fewer than their peers never join.
        return self.unwrap(module)(inputs)


def _full_tensor(value: Any) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _device_of(outputs: Any) -> torch.device:
    if isinstance(outputs, torch.Tensor):
        return outputs.device
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0].device
    if isinstance(outputs, dict):
        for value in outputs.values():
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def rebind_optimizer(
    optimizer: torch.optim.Optimizer,
    old_names: dict[int, str],
    module: nn.Module,
    *,
    drop_missing: bool = False,
) -> torch.optim.Optimizer:
    """Point `optimizer` at `module`'s new (DTensor) parameters, in place, and return it.

    FSDP's fully_shard and tensor parallel's parallelize_module swap parameters for
    new DTensor objects, so an optimizer built on the originals would update tensors
    the model no longer uses. The optimizer object is kept (not rebuilt with
    type(opt)(groups, **opt.defaults), which raises TypeError for torch 2.13's AdamW
    whose defaults hold decoupled_weight_decay), so LR schedulers built on it keep
    working. `old_names` maps id(original parameter) -> name, taken before the
    wrapper ran. With `drop_missing`, parameters the module no longer holds (another
    pipeline stage's) leave the optimizer instead of raising.
    """
    if any(optimizer.state.values()):
        raise ConfigError(
            f"rt.setup() got {article(type(optimizer).__name__)} that already has state (it "
            "has stepped, or a checkpoint was loaded into it). The strategy replaces the "
            "model's parameters, so that state cannot follow. Fix: call rt.setup(model, "
            "optimizer) before the first optimizer.step() and before loading a checkpoint "
            "(rt.load, CheckpointManager.resume): the load restores the set-up model's."
        )
    current = dict(module.named_parameters())
    new_groups: list[list[nn.Parameter]] = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if drop_missing and name is not None and name not in current:
                continue
            if name is None or name not in current:
                raise ConfigError(
                    f"the {type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not in the model given to setup(). Build the "
                    "optimizer from model.parameters() of that same model."
                )
            params.append(current[name])
        new_groups.append(params)
    # Swapped only once every parameter was found: a failure leaves the optimizer as is.
    for group, params in zip(optimizer.param_groups, new_groups, strict=True):
        group["params"] = params
    optimizer.state.clear()
    return optimizer


# Parameter names taken before a wrapper (fully_shard, parallelize_module) replaced
# the parameters, per wrapped model, for setup_optimizer, which runs after
# setup_module. Weak: a dropped model frees them.
_NAMES_BEFORE: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def remember_parameter_names(module: nn.Module, names: dict[int, str]) -> None:
    """Record `names` (from parameter_names, taken before wrapping) for `module`.

    A second wrapper on the same module (FSDP over tensor parallel) keeps the first
    names: they are the ones the user's optimizer was built with.
    """
    _NAMES_BEFORE.setdefault(module, names)


def rebind_to_wrapped(optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
    """rebind_optimizer with the names remembered for `module` (no-op if not wrapped)."""
    names = _NAMES_BEFORE.get(module)
    if names is None:
        # Not wrapped (one process): the optimizer's parameters are the model's.
        return optimizer
    return rebind_optimizer(optimizer, names, module)


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> qualified name, to find parameters again after wrapping."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def resolve_strategy(
    spec: str | Strategy | None, *, mesh: Mapping[str, int] | None = None
) -> Strategy:
    """A strategy instance from a name, an instance, or None (DDP).

    With a mesh that has tensor ("tp") or pipeline ("pp") dimensions larger than 1,
    the result composes the named strategy with them (see strategies/mesh.py).
    """
    strategy: Strategy | None = None
    if spec is None:
        spec = "ddp"
    if isinstance(spec, Strategy):
        strategy = spec
    elif isinstance(spec, str):
        key = spec.strip().lower()
        if key in STRATEGIES:
            strategy = STRATEGIES[key]()
    elif isinstance(spec, type) and issubclass(spec, Strategy):
        name = next((k for k, v in STRATEGIES.items() if v is spec), None)
        raise ConfigError(
            f"strategy={spec.__name__} is the class; expected a strategy object or a name. "
            f"Fix: strategy=st.{spec.__name__}() (its options in the parentheses)"
            + (f", or strategy={name!r}." if name else "."),
            field="strategy",
        )
    if strategy is not None:
        if mesh and any(mesh.get(d, 1) > 1 for d in ("tp", "pp")):
            # Here, not at the top: mesh.py builds its composites on this module's Strategy.
            from scaletrain.strategies.mesh import compose

            return compose(strategy, mesh)
        return strategy
    raise ConfigError(
        f"strategy={spec!r} is not known; expected one of {', '.join(sorted(STRATEGIES))} "
        "or a strategy object such as st.DDP(bucket_cap_mb=50)."
        + near_fix("strategy", spec, sorted(STRATEGIES)),
        field="strategy",
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard
    return int(plain_tensor(local).untyped_storage().data_ptr())


def _storages(module: nn.Module) -> set[int]:
    """Where the live parameters and buffers of `module` keep their data."""
    return {_storage(t) for t in (*module.parameters(), *module.buffers())}
