"""The Runtime `scaletrain.init()` returns: the whole public training API.

It builds on two base classes, whose methods its API reference lists with its own:
place.py's Place (rt.rank, rt.device, rt.device_mesh: where this process is in the
job) and collectives.py's Collectives (rt.reduce, rt.gather, rt.any_rank, rt.barrier:
what the ranks do together). arguments.py checks what a loop hands rt.forward_backward,
rt.backward, rt.save and rt.load.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import torch
from torch import nn

from scaletrain import dist as _dist
from scaletrain.accumulation import AccumulationStep, Accumulator
from scaletrain.checkpoint import CheckpointScope
from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.data.loader import check_dataset
from scaletrain.dist.topology import Topology
from scaletrain.env.base import ClusterEnv
from scaletrain.errors import ConfigError
from scaletrain.observe.metrics import phases as _phases
from scaletrain.observe.metrics.ledger import StepLedger
from scaletrain.precision import Precision
from scaletrain.runtime.arguments import by_name, check_clip, check_setup, one_number
from scaletrain.runtime.collectives import Collectives
from scaletrain.runtime.signals import StopRequest
from scaletrain.runtime.stopping import StopAgreement
from scaletrain.strategies import Strategy

__all__ = ["Runtime", "current"]


OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class Runtime(Collectives):
    """This process's place in the job and the tools to train in it.

    Made by `scaletrain.init()`; holds the detected environment, the process group,
    the device and the strategy.
    """

    def __init__(
        self,
        *,
        env: ClusterEnv,
        strategy: Strategy,
        backend: str | None = None,
        device: torch.device | None = None,
        mesh_shape: Mapping[str, int] | None = None,
        precision: Precision | None = None,
        topology: Topology | None = None,
    ) -> None:
        if topology is None:
            if backend is None or device is None:
                raise TypeError("Runtime() needs a topology, or a backend and a device.")
            topology = Topology.resolve(
                env, device=device, backend=backend, mesh=mesh_shape, implicit_dim=strategy.mesh_dim
            )
        self.env = env
        self.topology = topology
        """This process's place in the job, as the strategy and checkpoints see it."""
        self.precision = precision or Precision(device=topology.device)
        self._accumulation = Accumulator()
        self.strategy = strategy
        self._closed = False
        self.ledger: StepLedger | None = None
        """Where this rank's time goes, step by step (scaletrain.observe.metrics.ledger); made by
        st.init, driven by hooks rt.setup and rt.loader install. None when turned off."""
        self._stopping: StopAgreement | None = None
        self._stop_reason: str | None = None
        self._loaders: weakref.WeakSet[ShardedLoader] = weakref.WeakSet()
        self._set_up: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        """The models rt.setup returned, and the modules it wrapped: set up once each."""

    def __repr__(self) -> str:
        return (
            f"Runtime(rank={self.rank}, local_rank={self.local_rank}, "
            f"world_size={self.world_size}, backend={self.backend!r}, device={self.device}, "
            f"strategy={type(self.strategy).__name__}, env={self.env.kind!r})"
        )

    # -- model ------------------------------------------------------------------
    @overload
    def setup(self, model: nn.Module) -> nn.Module: ...

    @overload
    def setup(self, model: nn.Module, optimizer: OptimizerT) -> tuple[nn.Module, OptimizerT]: ...

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this process's device and wrap it for the strategy. Once
        per model: use what it returns (a second setup would wrap the wrapper).

        An optimizer made before it is passed to it: FSDP and tensor parallel replace the
        model's parameters with sharded ones, and setup moves the optimizer onto them; one
        left out would step the old tensors, which the model no longer uses. With
        `rt.setup(model)` alone, make the optimizer after it, from what it returned."""
        check_setup(model, optimizer)
        if model in self._set_up:
            raise ConfigError(
                f"rt.setup(model): this {type(model).__name__} is already set up (rt.setup "
                "returned it, or wrapped it): a second setup would wrap it again, and its "
                "first backward fails. Fix: call rt.setup once per model and use what it "
                "returned; a new optimizer is built on the parameters of the model it "
                "returned (rt.setup(model, optimizer) moves one made before it)."
            )
        model = self.precision.convert_module(model)
        wrapped = self.strategy.setup_module(model, self.topology)
        opt = (
            None
            if optimizer is None
            else self.strategy.setup_optimizer(optimizer, wrapped, self.topology)
        )
        self._set_up.update((model, wrapped, self.strategy.unwrap(wrapped)))
        if self.ledger is not None:
            from scaletrain.observe.metrics.attach import attach_model

            attach_model(self.ledger, wrapped, opt)
        return wrapped if opt is None else (wrapped, opt)

    def prepare(self, model: nn.Module, example_inputs: Any) -> None:
        """Build lazily-built parts (pipeline stages) from an example batch now, e.g.
        before rt.load(), whose optimizer state covers only this rank's stages.

        Under the run's autocast, as forward_backward runs them: a stage traced without
        it expects float32 from the stage before, which sends bf16 under bf16-mixed."""
        with self.precision.forward_context():
            self.strategy.prepare(model, self.precision.convert_input(example_inputs))

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper setup() added."""
        return self.strategy.unwrap(model)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's plain CPU state dict, without wrapper prefixes.

        Gathers shards (FSDP, tensor parallel) and stages (pipeline): a collective,
        so every rank must call it; every rank gets the same result, with the
        buffers of data-parallel replica 0 (see `first_replica_buffers`).
        """
        return self.strategy.full_state_dict(model, self.topology)

    def first_replica_buffers(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Inside the block every data-parallel replica holds replica 0's buffers.

        Buffers (BatchNorm's running statistics) are each rank's own: gradients keep
        parameters equal, nothing keeps buffers equal but DDP's copy of rank 0's
        before each forward. The model at a step is therefore data-parallel rank 0's,
        as DDP would hold it; `model.pt`, checkpoints and `full_state_dict` record
        that one, and `scaletrain.train.evaluate` evaluates it. On exit each rank's
        own buffers come back, so training goes on exactly as if the block had not
        run. A collective: every rank enters it.
        """
        return self.strategy.first_replica_buffers(model, self.topology)

    def forward_backward(
        self,
        model: nn.Module,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward, loss and backward for any strategy (a pipeline runs its schedule).

        For data-parallel strategies this is `loss_fn(model(x), y).backward()`; it
        exists so the same loop also drives pipeline stages. Returns the detached loss.
        """
        # Gradient accumulation (1/k) and fp16 loss scaling multiply the loss that is
        # backpropagated; the loss returned for logging is the true one.
        mult = self._accumulation.scale

        def scaled_loss(outputs: Any, target: torch.Tensor) -> torch.Tensor:
            return self.precision.scale(one_number(loss_fn(outputs, target), loss_fn) * mult)

        with self.precision.forward_context():
            loss = self.strategy.forward_backward(
                model, self.precision.convert_input(inputs), targets, scaled_loss
            )
        if mult == 1.0 and self.precision.scaler is None:
            return loss
        return loss.float() / (self.precision.loss_scale() * mult)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() with accumulation's 1/k and fp16 loss scaling applied.

        For loops that call the model themselves instead of rt.forward_backward.
        """
        self.precision.scale(one_number(loss, None) * self._accumulation.scale).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), through the GradScaler under fp16-mixed."""
        self.precision.step(optimizer)

    def accumulate(
        self, model: nn.Module, steps: int
    ) -> contextlib.AbstractContextManager[AccumulationStep]:
        """One micro-step of gradient accumulation over `steps` micro-batches.

        Inside the block the gradient all-reduce is skipped on the first steps-1
        micro-steps (DDP's no_sync, FSDP's requires-gradient-sync off), and losses
        given to rt.forward_backward / rt.backward count 1/steps, so k micro-steps
        equal one step on a k-times larger batch. Step the optimizer when `.sync`:

            with rt.accumulate(model, steps=4) as micro:
                loss = rt.forward_backward(model, x, y, loss_fn)
            if micro.sync:
                rt.step(optimizer)
                optimizer.zero_grad()
        """
        return self._accumulation.window(model, steps, self.strategy.no_sync)

    def clip_grad_norm(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip gradients by the norm of the WHOLE model, whatever the strategy.

        Sharded gradients (FSDP, tensor parallel) are combined across their mesh and
        pipeline stages' norms across the stages, so every rank clips with the same
        global norm a single process would compute. Returns that norm.
        """
        check_clip(optimizer, max_norm, norm_type)
        self.precision.unscale(optimizer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        group = self.strategy.model_parallel_group(self.topology)
        with self._phase(_phases.OPTIMIZER):
            total = _dist.global_grad_norm(grads, norm_type, group=group, device=self.device)
            _dist.clip_grads_(grads, total, max_norm)
        return total

    def predict(self, model: nn.Module, inputs: Any) -> Any:
        """Evaluation outputs (no grad) on every rank of the model replica."""
        if self.ledger is not None:
            self.ledger.forward_begin(False)  # evaluation, until the next training forward
        with self.precision.forward_context():
            return self.strategy.predict(model, self.precision.convert_input(inputs))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's precision for forward code outside rt.forward_backward and
        rt.predict (a head, a metric, generation): the same context they run the model
        in. torch.autocast to bfloat16 under "bf16-mixed", to float16 under "fp16-mixed";
        nothing under "32", "bf16-true" (the weights are bfloat16 themselves) or FSDP
        (its MixedPrecisionPolicy casts the sharded modules)."""
        return self.precision.forward_context()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient all-reduce inside the block (accumulation micro-steps)."""
        return self.strategy.no_sync(model)

    # -- data -------------------------------------------------------------------
    def loader(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> ShardedLoader:
        """A loader giving this rank its shard, reshuffled each epoch, resumable mid-epoch.

        For evaluation pass `shuffle=False, pad=False`: shards then differ by at most
        one sample and every sample is counted exactly once across ranks.
        """
        check_dataset(dataset)
        sampler = ShardedSampler(
            dataset,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=pad,
        )
        loader = ShardedLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            drop_last=drop_last,
            collate_fn=collate_fn,
        )
        if self.ledger is not None:
            from scaletrain.observe.metrics.hooks import watch_loader

            watch_loader(self.ledger, loader)
        self._loaders.add(loader)
        return loader

    # -- stopping on a signal ---------------------------------------------------------
    def should_stop(self) -> bool:
        """True on every rank, after the same step, once SIGTERM, SIGUSR1 or a first
        Ctrl-C reached any rank: the stop `scaletrain train` makes, for a loop of your own.
        Then save, `rt.shutdown()` and exit with `st.EXIT_PREEMPTED` (75); the next start
        resumes from that checkpoint.

        Call it once per step at the same point on every rank (it is a collective, on
        scaletrain's CPU group: no GPU synchronisation). The first call starts taking
        those signals (in the main thread, until rt.shutdown); before it they do what
        they did, so a loop that never asks keeps its usual Ctrl-C. Each call collects
        the previous call's flag and starts the next without waiting
        (scaletrain.runtime.stopping): a signal is answered one step after it arrives,
        and the loop never waits for the slowest rank here. Once True it stays True;
        `rt.stop_reason` says why. A second Ctrl-C ends the process at once (exit 130)
        without saving; the checkpoints already written stay complete.
        """
        if self._stop_reason is not None:
            return True
        if self._stopping is None:
            self._stopping = StopAgreement(self, StopRequest(saving=False).install(), None)
        self._stop_reason = self._stopping.after_step(0)
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why `should_stop()` said to stop ("signal SIGTERM", "Ctrl-C", "a signal on
        another rank"); None until it did."""
        return self._stop_reason

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- checkpoints ----------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        *unnamed: Any,
        keep: int | None = None,
        async_save: bool = False,
        **state: Any,
    ) -> Any:
        """Save models, optimizers, schedulers, scalers, loaders and plain values.

        Also saves every rank's RNG state. Full checkpoints (DDP, DP, model parallel)
        are written by rank 0, atomically, with a sha256 manifest; sharded ones (FSDP,
        tensor, pipeline, meshes) through torch.distributed.checkpoint, optionally
        asynchronously (training continues; the handle's .wait() finishes it). `keep`
        prunes older checkpoints of the same run. A collective: every rank calls it.
        """
        from scaletrain.checkpoint import save_checkpoint

        by_name("save", path, unnamed)
        if not state:
            raise ConfigError(
                "rt.save(path): nothing to save. Fix: pass the state by name, e.g. "
                "rt.save(path, model=model, optimizer=optimizer, step=step)."
            )
        return save_checkpoint(
            self.checkpoint_scope(), path, keep=keep, async_save=async_save, **state
        )

    def load(self, path: str | os.PathLike[str], *unnamed: Any, **state: Any) -> dict[str, Any]:
        """Restore the objects given in `state` in place; return the saved plain values.

        Verifies checksums and that the checkpoint fits the model first: a truncated,
        corrupted or foreign checkpoint raises CheckpointError and changes nothing.
        """
        from scaletrain.checkpoint import load_checkpoint

        by_name("load", path, unnamed)
        return load_checkpoint(self.checkpoint_scope(), path, **state)

    def checkpoint_scope(self) -> CheckpointScope:
        """What checkpoints need of this run: its topology and the strategy's model views.

        Lets scaletrain.checkpoint.save_checkpoint / load_checkpoint take the Runtime.
        """
        return CheckpointScope(
            topology=self.topology,
            unwrap=self.strategy.unwrap,
            checkpoint_module=self.strategy.checkpoint_module,
            timed=lambda: self._phase(_phases.CHECKPOINT, mode=True),
        )

    def profile(
        self, steps: str | tuple[int, int], out: str | os.PathLike[str] | None = None
    ) -> None:
        """Record a torch.profiler window over `steps` ("10-15") on every rank into
        OUT/traces/ (OUT: the ledger's run directory, or `out`): one trace per rank,
        merged into one after the run, and the overlap of communication with compute
        (scaletrain.observe.metrics.profiling)."""
        from scaletrain.observe.metrics.profiling import arm_profile

        arm_profile(self.ledger, steps, out, rank=self.rank, world_size=self.world_size)

    def shutdown(self, *, failed: bool = False) -> None:
        """Leave the job cleanly; safe to call twice.

        The step ledger's summary is gathered from every rank first (a collective);
        `failed=True` (a rank failed, its peers may be gone) skips that. Then the process
        groups are destroyed so that no Gloo thread is left holding anything of Python's
        when the interpreter exits (scaletrain.dist.destroy says why)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close(failed)
        finally:
            if self._stopping is not None and self._stop_reason is None:
                # Signals do again what they did before the first rt.should_stop(). After
                # an agreed stop they stay taken: the process is on its way out with exit
                # 75, and a launcher that stops the rest of a job once one worker has
                # exited (torch's agent sends SIGTERM) must not turn that into a death
                # by signal.
                self._stopping.stop.restore()

    def _close(self, failed: bool) -> None:
        if self._stopping is not None and not failed:
            # The flag the last rt.should_stop() started is still in flight on the
            # control group, which goes below: every rank collects it here.
            self._stopping.collect()
        if self.ledger is not None:
            # One process gathers from itself, no collective needed: its summary is
            # written whether or not a process group exists (a 1-process run has none).
            alone = self.ledger.world_size == 1
            self.ledger.finish(collective=not failed and (_dist.is_initialized() or alone))
        from scaletrain.checkpoint import wait_pending

        # An asynchronous save still writing needs the process group to finish.
        wait_pending()
        if self.ledger is not None and not failed:
            from scaletrain.observe.metrics.hooks import settle_callbacks

            # The default group's threads free the ledger's bucket callbacks; that group
            # outlives this call while the loop holds its DDP model: freed before exit.
            settle_callbacks()
        _dist.destroy(failed=failed)
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.shutdown(failed=exc_type is not None)


_CURRENT: Runtime | None = None
"""The Runtime of this process (st.init sets it; shutdown clears it)."""


def current() -> Runtime | None:
    """The Runtime st.init() made in this process and that is not shut down, if any."""
    return _CURRENT


def set_current(rt: Runtime | None) -> None:
    global _CURRENT
    _CURRENT = rt
