"""Model FLOPs utilisation: FLOPs per step counted once, against a measured and a datasheet peak.

- FLOPs per step: `torch.utils.flop_counter.FlopCounterMode` around one whole step
  (every micro-batch's forward and backward), on every rank, once; with torch.compile
  told to run eager meanwhile (`FlopCounter`: the count is the model's arithmetic, and
  the compiled model compiles at the next step).
- Measured peak: a short matmul benchmark in the training dtype at start, cached per
  device, dtype, threads, processes per node and torch version
  (peak_flops.json in scaletrain's cache directory, see cachedir.py), so later runs
  skip it. A run that achieves more than it (MFU above 100%) proves it was measured
  while the device was busy: `forget_peak` drops it, and the next run measures again.
  (A CPU entry measured during other work had made every later 2-process run on this
  machine report 128-134% MFU.)
- Datasheet peak: dense (not the "with sparsity" figure), from scaletrain.hardware's
  one table of GPUs (devices.toml, which the planner's hardware profiles name too),
  matched by name. An unknown device has NO datasheet peak: MFU is then given against
  the measured one only. (torchtitan falls back to the A100's figure for unknown
  devices, which is how users have seen 563% MFU.)
- An MFU above 100% is flagged as a measurement error, never shown as a result.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.cachedir import cache_dir
from scaletrain.hardware import datasheet_peak

__all__ = [
    "FlopCounter",
    "Mfu",
    "attention_flops",
    "compute_mfu",
    "datasheet_peak",
    "forget_peak",
    "measure_peak",
    "peak_dtype",
]


def peak_dtype(precision: str, device_type: str) -> str:
    """The matmul dtype a precision setting trains in: "bf16", "fp16", "tf32" or "fp32"."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("fp16"):
        return "fp16"
    if device_type == "cuda":
        import torch

        if torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
    return "fp32"


def _cache_file() -> Path:
    return cache_dir() / "peak_flops.json"


def _peak_key(device_name: str, dtype: str, processes: int) -> str:
    import torch

    return (
        f"{device_name}|{dtype}|threads={torch.get_num_threads()}|procs={processes}|"
        f"torch={torch.__version__}"
    )


def forget_peak(device_name: str, dtype: str, *, processes: int = 1) -> bool:
    """Drop the cached peak `measure_peak` would return; True if there was one."""
    key = _peak_key(device_name, dtype, processes)
    path = _cache_file()
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(known, dict) or known.pop(key, None) is None:
        return False
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)
    return True


def measure_peak(
    device: Any,
    dtype: str,
    *,
    device_name: str,
    processes: int = 1,
    seconds: float = 0.3,
    cache: bool = True,
    size: int | None = None,
) -> float:
    """FLOP/s of a square matmul in `dtype` on `device`, measured for ~`seconds` (cached).

    `processes`: ranks sharing this node, which run it at the same time (on CPU they
    share the cores, and so they will while training). `size`: the matrices' side
    (default 4096 on a GPU, 512 on a CPU). "fp8" is torch._scaled_mm's e4m3 matmul
    with a bf16 output (what float8 training's linears run), on a GPU that has one."""
    key = _peak_key(device_name, dtype, processes) + (f"|n={size}" if size else "")
    path = _cache_file()
    known: dict[str, float] = {}
    if cache:
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(path.read_text(encoding="utf-8"))
        if key in known:
            return float(known[key])
    from scaletrain.hardware.measure import matmul_flops

    peak = matmul_flops(device, dtype, size=size, seconds=seconds)
    if cache:
        known[key] = peak
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(known, f, indent=1)
            os.replace(tmp, path)
    return peak


_SDPA = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_cudnn_attention")  # fmt: skip
"""Fused attention ops: torch before 2.13 asserts in their FLOP formulas when keys and
values have fewer heads than the queries (grouped-query attention, as Llama's)."""


def attention_flops(query: Any, key: Any, value: Any) -> int:
    """FLOPs of softmax(q k^T) v for q (b, heads, s_q, d), k (b, kv_heads, s_k, d) and v
    (b, kv_heads, s_k, d_v): each query head multiplies its group's keys and values."""
    b, heads, s_q, d = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    return 2 * b * heads * s_q * s_k * d + 2 * b * heads * s_q * s_k * d_v


def grouped_mm_flops(mat_a: Any, mat_b: Any, *_: Any, **__: Any) -> int:
    """FLOPs of torch._grouped_mm (a mixture of experts' matmuls): each row of `mat_a`
    multiplies the one group's matrix its offsets place it in, so the count is the
    dense product's whatever the routing. Two 2-D operands split their shared
    dimension into groups (a weight gradient: (m, k) x (k, n)); otherwise each of the
    output's elements sums over `mat_a`'s last dimension."""
    a, b = tuple(mat_a.shape), tuple(mat_b.shape)
    groups = a[0] if len(a) == 3 and len(b) == 3 else 1  # a batch of matrices each
    return 2 * groups * a[-2 if len(a) == 3 else 0] * a[-1] * b[-1]


def conv_backward_flops(grad: Any, x: Any, w: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of a convolution's backward: the forward's for each gradient it computes
    (the input's, the weight's), each the forward's products again. torch's formula
    counts the weight's gradient as if the convolution had one group: a depthwise
    one's (a Mamba block's) by the channel count too many."""
    from torch.utils.flop_counter import conv_flop_count

    transposed, mask = args[4], args[7]
    forward = conv_flop_count(list(x.shape), list(w.shape), list(grad.shape), transposed)
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))


def _formulas() -> dict[Any, Any]:
    """FLOP formulas torch's counter lacks or miscounts: the CPU's fused attention (a
    model's attention would count 0 on a CPU, and in a plan profiled there), the
    grouped matmul of a mixture of experts (its experts would count 0 anywhere), and a
    grouped convolution's backward."""
    import torch

    aten = torch.ops.aten
    out: dict[Any, Any] = {
        aten._grouped_mm: grouped_mm_flops,
        aten.convolution_backward: conv_backward_flops,
    }
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        out[fwd] = lambda q, k, v, *a, **kw: attention_flops(q, k, v)
    if bwd is not None:
        # (grad_out, q, k, v, ...): the gradients of q, k and v: twice the forward.
        out[bwd] = lambda g, q, k, v, *a, **kw: 2 * attention_flops(q, k, v)
    return out


class FlopCounter:
    """FLOPs of whatever runs between `start()` and `stop()` on this thread (and the
    autograd threads it starts): one training step, once.

    Counting never stops training: an op whose FLOP formula raises counts as 0 and
    is named in `problems` (the MFU is then a lower bound), except fused attention
    with grouped-query heads, which is counted here (`attention_flops`)."""

    def __init__(self) -> None:
        self._mode: Any = None
        self._eager: Any = None
        self._last: Any = None
        self.total: int | None = None
        self.recomputed = 0
        """FLOPs of forwards activation checkpointing ran again in the backward: in
        `total` (they take time), not in the model's FLOPs an MFU counts (PaLM's
        definition: a step's FLOPs without rematerialisation; with them it is the
        hardware FLOPs utilisation, which checkpointing raises as it slows the step)."""
        self.problems: list[str] = []
        """"aten.op: the error" for each op whose FLOPs were not counted."""

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> bool:
        """Count from now; False (nothing started) inside a torch.compile'd callable: a
        model compiled after rt.setup, whose forward hooks run inside it. A dispatch mode
        entered there would keep every frame after it from ever compiling, and the
        compiler's stance cannot change inside it."""
        if _in_compiled_region():
            return False
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self.recomputed = 0
        if hasattr(self._mode, "mod_tracker"):
            self._mode.mod_tracker = _recompute_free_tracker()
        registry = getattr(self._mode, "flop_registry", None)
        if isinstance(registry, dict):
            formulas = {**registry, **_formulas()}
            guarded = {op: self._guarded(op, f) for op, f in formulas.items()}
            self._mode.flop_registry = _Undecomposed(guarded)
        self._eager = _force_eager()
        self._mode.__enter__()
        return True

    def _guarded(self, op: Any, formula: Any) -> Any:
        name = str(getattr(op, "__name__", op)).split(".")[0]

        def count(*args: Any, **kwargs: Any) -> int:
            flops = counted(*args, **kwargs)
            if getattr(getattr(self._mode, "mod_tracker", None), "recomputing", 0):
                self.recomputed += flops
            return flops

        def counted(*args: Any, **kwargs: Any) -> int:
            try:
                return int(formula(*args, **kwargs))
            except Exception as exc:
                if name in _SDPA and len(args) >= 3:
                    return attention_flops(*args[:3])
                if name.removesuffix("_backward") in _SDPA and len(args) >= 4:
                    # (grad_out, q, k, v, ...): the gradients of q, k and v: 2x forward.
                    return 2 * attention_flops(*args[1:4])
                problem = f"aten.{name}: {type(exc).__name__}: {exc}".strip()
                if problem not in self.problems:
                    self.problems.append(problem)
                return 0

        return count

    def count(self) -> int:
        """FLOPs counted so far; counting goes on."""
        if self._mode is None:
            return self.total or 0
        return int(self._mode.get_total_flops())

    def running(self) -> set[str]:
        """The modules whose forward or backward runs now ("Model.sub.name", and
        "Global"): empty when not counting."""
        tracker = getattr(self._mode, "mod_tracker", None)
        return set(tracker.parents) if tracker is not None else set()

    def by_module(self) -> dict[str, dict[Any, int]]:
        """FLOPs per module ("Model.sub.name": {op: flops}) of the last count."""
        mode = self._mode if self._mode is not None else self._last
        return {} if mode is None else dict(mode.get_flop_counts())

    def stop(self) -> int:
        mode, self._mode = self._mode, None
        self._last = mode
        if mode is None:
            return self.total or 0
        mode.__exit__(None, None, None)
        eager, self._eager = self._eager, None
        if eager is not None:
            eager.__exit__(None, None, None)
        self.total = int(mode.get_total_flops())
        return self.total


class _Undecomposed(dict[Any, Any]):
    """FLOP formulas, which also hold (for FlopCounterMode's one question, whether to
    decompose an op) every op that has a kernel of its own.

    FlopCounterMode asks of each op it runs whether it holds a formula for it (by
    overload, where formulas are held by op packet, so the answer is no) and runs an
    op that has a decomposition as that: silu_backward as sigmoid, mul, add..., so the
    counted step ran other kernels than every other step, with more temporaries alive
    at its peak (a SwiGLU's backward). Here an op with a kernel of its own runs as
    itself (it counts what it counted before: nothing, having no formula); an op that
    is only a composition (linear or matmul under inference_mode) still decomposes
    into the matmuls that count."""

    def __contains__(self, op: object) -> bool:
        if super().__contains__(op):
            return True
        has = getattr(op, "has_kernel_for_dispatch_key", None)
        if has is None:  # an op packet (FlopCounterMode's question of a formula)
            return False
        import torch

        keys = torch._C.DispatchKey
        try:
            return any(has(k) for k in (keys.CPU, keys.CUDA, keys.CompositeExplicitAutograd))
        except RuntimeError:  # an op the dispatcher does not hold (prim::device)
            return False


def _recompute_free_tracker() -> Any:
    """torch's ModuleTracker (what FlopCounterMode names each FLOP's modules by), whose
    hooks on a forward run inside the backward (activation checkpointing's
    recomputation) keep nothing alive.

    Its forward hooks register a gradient hook on each module's inputs and outputs
    (to tell when the backward reaches the module) in torch's "all" mode, whose hook
    holds the tensors' autograd nodes, and with them the graph and its saved tensors,
    until the hook is removed: when the count ends. The recomputed forward of a
    non-reentrant checkpoint never sees a backward of its own, so every recomputed
    block's saved tensors stayed alive until the count ended: the counted step (a run's
    first, for MFU; a plan's profile) took the memory of no checkpointing. Inside the
    backward the hooks are registered in "any" mode, which holds no node and still
    fires where a backward does run (a reentrant checkpoint)."""
    import torch
    from torch.autograd.graph import register_multi_grad_hook
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils._pytree import tree_leaves
    from torch.utils.module_tracker import ModuleTracker

    class Tracker(ModuleTracker):
        recomputing = 0
        """How deep this is in modules' forwards run inside the backward (>0: the ops
        now running are a checkpoint's recomputation)."""

        def __enter__(self) -> Any:
            super().__enter__()
            # The post hook also runs when a forward raises: a checkpoint's recomputation
            # stops early by raising inside a module (torch's early stop), and the depth
            # must come back down with it.
            self._fw_post_handle.remove()
            self._fw_post_handle = register_module_forward_hook(
                self._fw_post_hook, always_call=True
            )
            return self

        def _hook(self, values: Any, fn: Any) -> None:
            grads = [
                t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if grads:
                self._hooks.append(register_multi_grad_hook(grads, fn, mode="any"))

        def _fw_pre_hook(self, mod: Any, input: Any) -> None:
            if not self.is_bw:
                return super()._fw_pre_hook(mod, input)
            self.recomputing += 1
            name = self._get_mod_name(mod)
            self._get_append_fn(name, False)()
            self._hook(input, self._get_pop_fn(name, True))

        def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
            if not self.is_bw:
                return super()._fw_post_hook(mod, input, output)
            self.recomputing = max(0, self.recomputing - 1)
            name = self._get_mod_name(mod)
            self._get_pop_fn(name, False)()
            self._hook(output, self._get_append_fn(name, True))

    return Tracker()


def _in_compiled_region() -> bool:
    """Whether this runs inside a torch.compile'd callable: traced by dynamo, or run
    between its graphs (dynamo's frame callback is then set, to compile what it calls)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False  # nothing was ever compiled
    import torch

    if torch.compiler.is_compiling():
        return True
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch without it: only a trace is known
        return False
    return get_eval_frame_callback() not in (None, False)


def _force_eager() -> Any:
    """torch.compile's stance set to "force_eager" (the stance object: its __exit__
    restores the previous one), or None where nothing can be compiled yet (dynamo not
    loaded), the stance cannot change (inside a compiled region) or torch has none.

    Dynamo does not compile a frame under a dispatch mode such as FlopCounterMode, and
    torch up to 2.13 at least then marks that code to be skipped for good (torch issue
    190286): a model compiled before rt.setup ran eager for the whole run, silently.
    Under "force_eager" dynamo is not asked at all, so nothing is marked: the counted
    step runs eager (its FLOPs are the model's arithmetic) and the next one compiles."""
    dynamo = sys.modules.get("torch._dynamo")
    set_stance = getattr(dynamo, "set_stance", None)
    if set_stance is None:
        return None
    try:
        stance = set_stance("force_eager")
        stance.__enter__()  # set already by the constructor in torch 2.13; harmless
    except RuntimeError:
        return None
    return stance


@dataclass(frozen=True, slots=True)
class Mfu:
    flops_per_step: float
    step_s: float
    achieved: float
    """FLOP/s this rank achieved (flops_per_step / step_s)."""
    peak_measured: float | None
    peak_datasheet: float | None
    mfu_measured: float | None
    mfu_datasheet: float | None
    error: str | None = None
    """Set when an MFU came out above 100%: the measurement is wrong, not the GPU fast."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "flops_per_step": self.flops_per_step,
            "step_s": self.step_s,
            "achieved": self.achieved,
            "peak_measured": self.peak_measured,
            "peak_datasheet": self.peak_datasheet,
            "mfu_measured": self.mfu_measured,
            "mfu_datasheet": self.mfu_datasheet,
            "error": self.error,
        }


def compute_mfu(
    flops_per_step: float,
    step_s: float,
    peak_measured: float | None,
    peak_datasheet: float | None,
) -> Mfu:
    achieved = flops_per_step / step_s if step_s > 0 else 0.0
    measured = achieved / peak_measured if peak_measured else None
    datasheet = achieved / peak_datasheet if peak_datasheet else None
    error = None
    over = [
        (name, v)
        for name, v in (("measured", measured), ("datasheet", datasheet))
        if v is not None and v > 1.0
    ]
    if over:
        error = (
            "MFU above 100% against the "
            + " and ".join(f"{name} peak ({v:.0%})" for name, v in over)
            + ": a measurement error (FLOPs counted for work that did not run, a step "
            "time cut short, or a peak measured while the device was shared), not a result"
        )
    return Mfu(
        flops_per_step, step_s, achieved, peak_measured, peak_datasheet, measured, datasheet, error
    )
