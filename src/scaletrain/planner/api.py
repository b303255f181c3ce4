"""`st.plan`: every layout of N devices for one model priced into a `Plan` (result.py),
the fastest that fits recommended. Nothing here runs a process or a device: a plan of
512 GPUs takes the seconds of one fake forward and backward (the model's profile).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from scaletrain.errors import ConfigError, say, spell, unknown
from scaletrain.hardware import load
from scaletrain.hardware.calibrate import load_calibrated
from scaletrain.planner.cost import DTYPE, estimate, gathered
from scaletrain.planner.layout import Layout, layouts_for, microbatch_counts
from scaletrain.planner.models import resolve_model
from scaletrain.planner.profile import ModelProfile, profile_model
from scaletrain.planner.result import Plan, count, recommend
from scaletrain.planner.structure import Model
from scaletrain.precision import PRECISIONS, canonical
from scaletrain.strategies.float8 import FLOAT8_GPUS, float8_layers, require_torchao
from scaletrain.strategies.levers import check_levers
from scaletrain.strategies.partition import list_layers, shared_between, split_layers
from scaletrain.strategies.pipeline.strategy import Pipeline
from scaletrain.strategies.tensor_plan import (
    check_tp_plan,
    matching_modules,
    sequence_parallel_blocks,
)

__all__ = ["PRECISIONS", "Plan", "plan"]

LONG_PROFILE = 10**9
"""Parameters from which a plan's profile takes minutes on a CPU (a fake step's ops
grow with the layers): `plan(progress=...)` is told before it begins."""
_KEPT_PROFILES = 16
_PROFILES: OrderedDict[tuple[str, ...], ModelProfile] = OrderedDict()
"""The profiles of the latest plans of recipes and config.json models (`PlannedModel.key`),
by what shapes them: a profile does not depend on the devices or the hardware, so a sweep
of them in one process (a notebook, plan_accuracy.py) profiles each model once."""


def _skipped(
    rows: list[Layout], cannot: Callable[[Layout], str | None], devices: int, layers: int,
    batch: int, name: str, tied: Sequence[int] = (),
) -> list[str]:  # fmt: skip
    """Why the tensor-parallel degrees and the pipelines (alone, or in a mesh with data
    parallelism) of the devices that a plan leaves out are left out; those of `tied`
    stages are said apart (their stages would share a weight)."""
    out, seen = [], set()
    for x in rows:
        if (why := cannot(x)) and x.tp not in seen:
            seen.add(x.tp)
            out.append(f"tp={x.tp}: {why.partition('. Fix:')[0]}")
    missing = [
        p for p in range(2, devices + 1)
        if devices % p == 0 and p not in tied and all(x.pp != p for x in rows)
    ]  # fmt: skip
    if few := [p for p in missing if p > layers]:
        out.append(f"{_pipes(few)}: {name} has {_layers(layers)}")
    if cut := [p for p in missing if p <= layers]:
        counts = sorted({m for p in cut for m in microbatch_counts(p)})
        out.append(
            f"{_pipes(cut)}: none of {_listed(counts)} microbatches divides "
            f"{spell('batch_size', batch)}. Fix: {spell('batch_size', math.lcm(*cut))} or a "
            "multiple"
        )
    return out


def _layers(n: int) -> str:
    return f"{n} top-level layer{'' if n == 1 else 's'}"


def _pipes(pps: list[int]) -> str:
    """pipeline pp=4, pipelines of pp=2, 4 or 8: the pipelines of these degrees."""
    return f"pipeline pp={pps[0]}" if len(pps) == 1 else f"pipelines of pp={_listed(pps)}"


def _listed(counts: list[int]) -> str:
    """4, 8 or 12: a list as said."""
    *most, last = map(str, counts)
    return f"{', '.join(most)} or {last}" if most else last


def _gbs(bandwidth: float) -> str:
    """450, 12.5, 1.32: GB/s to three figures."""
    return f"{bandwidth / 1e9:,.0f}" if bandwidth >= 1e11 else f"{bandwidth / 1e9:.3g}"


def _whole(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{spell(key, value)} must be a whole number >= 1, e.g. {spell(key, 4)}.", field=key
        )


def plan(
    recipe: str | None = None,
    *,
    model: str | None = None,
    devices: int = 1,
    hardware: str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32",
    ac: str = "none",
    ac_every: int | None = None,
    compile: bool = False,
    float8: bool = False,
    layouts: list[Layout] | None = None,
    accumulate: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Memory per device and step time of every layout of `devices` for a recipe, a
    model ("module:factory") or a Hugging Face config.json, on `hardware` (a shipped
    profile such as "h100-sxm", a hardware file, or None: this machine's calibration).
    `ac`/`ac_every`/`compile`/`float8`/`accumulate` as training takes them (`batch_size`
    samples per replica in each of `accumulate` micro-steps); `layouts` picks the rows.
    `progress` is told, in a line, of a profile that takes a while (a model of a
    billion parameters or more). `Plan.table()` is what `scaletrain plan` prints."""
    _whole("devices", devices)
    _whole("accumulate", accumulate)
    if batch_size is not None:
        _whole("batch_size", batch_size)
    if not isinstance(precision, str) or canonical(precision) not in PRECISIONS:
        raise ConfigError(unknown("precision", precision, PRECISIONS), field="precision")
    precision = canonical(precision)
    check_levers("plan(...)", ac, ac_every, compile)
    if layouts is not None and not (layouts := list(layouts)):
        raise ConfigError(
            "plan(..., layouts=[]) picks no row to plan. Fix: give at least one Layout, or "
            "leave out layouts for every layout of the devices.",
            field="layouts",
        )
    if bad := [x for x in layouts or () if not isinstance(x, Layout)]:
        raise ConfigError(
            f"plan(..., layouts=[{bad[0]!r}, ...]): expected Layout objects. Fix: e.g. "
            "layouts=[Layout('fsdp', dp=8)] (from scaletrain.planner import Layout).",
            field="layouts",
        )
    if not isinstance(float8, bool):
        raise ConfigError(f"plan(..., float8={float8!r}): expected True or False.", field="float8")
    if float8:
        require_torchao("plan(...)")
    hw = load(hardware) if hardware is not None else load_calibrated()
    if float8 and hw.fp8_flops() is None:
        raise ConfigError(
            f"{say(api='plan(...): ', cli='')}{spell('float8', True)}: {hw.name}'s hardware "
            f"file gives no fp8 FLOP/s ({hw.description}): its devices do not multiply float8 "
            "matrices, or neither its [flops] nor scaletrain's datasheet table has a figure "
            f"for them. Fix: a hardware file of GPUs with float8 ({FLOAT8_GPUS}), such as "
            f"{spell('hardware', 'h100-sxm')}, or `fp8 = ...` (achieved float8 FLOP/s) in the "
            f"file's [flops] table, or plan without {spell('float8')}.",
            field="float8",
        )
    # Training refuses a pipeline with these levers (strategies.pipeline.strategy).
    no_pipeline = (
        "float8's layers cannot be traced into stages (torch.export), so training refuses "
        f"{spell('float8', True)} with a pipeline" if float8
        else f"a pipeline checkpoints whole stages, with no k-th block for "
        f"{spell('ac_every', ac_every)}" if ac_every is not None
        else ""
    )  # fmt: skip
    planned = resolve_model(recipe, model, seq_len=seq_len, batch_size=batch_size)
    batch, net, seq = batch_size or planned.batch_size, planned.net, planned.seq_len or 0
    # The layers float8 converts, refused where there are none (before the profile).
    fp8 = float8_layers(net, planned.blocks, "plan(...)", "plan") if float8 else []
    # A declared plan names modules by pattern ("layers.*.self_attn.q_proj"), as
    # parallelize_module matches them; the formulas price modules by name.
    tp_plan = {n: s for k, s in (planned.tp_plan or {}).items() for n in matching_modules(net, k)}
    try:  # sequence parallel splits the tokens between the blocks of one ModuleList
        sp_blocks = sequence_parallel_blocks(net, tp_plan) if seq else []
    except ConfigError:
        sp_blocks = []

    no_tp = planned.no_tp or f"{planned.name} has no layers tensor parallel splits"

    def cannot(x: Layout) -> str | None:  # why the model cannot run x's tensor parallel
        if x.tp == 1:
            return None
        if not tp_plan:
            return f"{no_tp}. Fix: a layout with tp=1."
        try:
            check_tp_plan(net, tp_plan, x.tp)
        except ConfigError as exc:
            return str(exc)
        return None

    cut, skipped = list_layers(net), []
    layers = len(cut)

    @functools.cache
    def tied(stages: int) -> str:  # why training cannot cut the model into these stages
        shared = shared_between(net, split_layers(cut, stages)) if stages > 1 else []
        return (
            f"{planned.name}'s {shared[0]} is used by more than one stage (tied weights), "
            "and training refuses a pipeline whose stages share a parameter" if shared else ""
        )  # fmt: skip

    for x in layouts or ():  # before the profile, which takes minutes for a large model
        where = f"plan(..., layouts=[...]): {x.label}"
        if x.devices != devices:
            raise ConfigError(
                f"{where} runs on {x.devices} device(s), and the plan is of "
                f"{spell('devices', devices)}. Fix: {spell('devices', x.devices)}, or a "
                f"layout of {devices} devices.",
                field="layouts",
            )
        if x.sp and not (sp_blocks and seq % x.tp == 0):
            why = (
                "takes no sequence" if not seq
                else "has no blocks of one nn.ModuleList or nn.Sequential around its "
                "tensor-parallel layers" if not sp_blocks
                else f"has {seq} tokens per sample, which tp={x.tp} does not divide"
            )  # fmt: skip
            raise ConfigError(
                f"{where} is sequence parallel, and {planned.name} {why}. Fix: that layout "
                "with sp=False.",
                field="layouts",
            )
        if problem := cannot(x):
            raise ConfigError(f"{where}: {problem}", field="layouts")
        if x.pp > 1 and no_pipeline:
            raise ConfigError(
                f"{where}: {no_pipeline}. Fix: a layout without a pipeline.", field="layouts"
            )
        stages = x.pp * (2 if x.schedule == "interleaved-1f1b" else 1)
        if stages > max(1, layers) and stages > x.pp:
            fixes = [f"pp={layers // 2} or fewer" if layers >= 4 else "",
                     "schedule='1f1b'" if x.pp <= layers else ""]  # fmt: skip
            raise ConfigError(
                f"{where}: interleaved 1F1B runs 2 stages on each of the {x.pp} ranks, and "
                f"{planned.name} has {_layers(layers)}. Fix: "
                f"{', or '.join(f for f in fixes if f) or 'a layout without a pipeline'}.",
                field="layouts",
            )
        if x.pp > max(1, layers):
            raise ConfigError(
                f"{where}: {planned.name} has {_layers(layers)}, the most stages a "
                "pipeline cuts it into. Fix: "
                + (f"pp={layers} or fewer." if layers > 1 else "a layout without a pipeline."),
                field="layouts",
            )
        if why := tied(stages):
            raise ConfigError(f"{where}: {why}. Fix: a layout without a pipeline.", field="layouts")
        if x.microbatches and batch % x.microbatches:
            raise ConfigError(
                f"{where}: {x.microbatches} microbatches do not divide "
                f"{spell('batch_size', batch)}. Fix: microbatches that divide {batch}, or "
                "another batch size.",
                field="layouts",
            )
        if x.pp > 1:  # the schedule's own rules, as training checks them
            try:
                Pipeline(schedule=x.schedule or "1f1b", microbatches=x.microbatches or 1
                         ).check_layout(x.pp)  # fmt: skip
            except ConfigError as exc:
                raise ConfigError(f"{where}: training refuses it: {exc}", field="layouts") from None
        if x.offload and hw.host is None:
            raise ConfigError(
                f"plan(..., layouts=[...]): {x.label} offloads to the host, and {hw.name}'s "
                "hardware file has no [host] table. Fix: add one (memory, bandwidth, "
                "memory_bandwidth), or that layout with offload=False.",
                field="layouts",
            )
    if layouts is None:
        rows = layouts_for(
            devices, batch=batch, layers=layers, tensor=bool(tp_plan),
            offload=hw.host is not None, sequence=bool(sp_blocks),
        )  # fmt: skip
        layouts = [x for x in rows if not cannot(x) and not (x.sp and seq % x.tp)]
        pps = [p for p in range(2, min(devices, layers) + 1) if devices % p == 0]
        ties = [p for p in pps if tied(p)]  # the pipelines' stages that share a weight
        skipped = _skipped(rows, cannot, devices, layers, batch, planned.name, ties)
        if not tp_plan and devices > 1:  # none, or a declared one training refuses
            skipped.insert(0, f"tensor parallel: {no_tp}")
        if no_pipeline and devices > 1:  # the one reason, whatever else the model lacks
            layouts = [x for x in layouts if x.pp == 1]
            skipped = [x for x in skipped if not x.startswith("pipeline")]
            skipped.append(f"pipelines: {no_pipeline}")
        elif ties:
            layouts = [x for x in layouts if x.pp not in ties]
            skipped.append(f"{'pipelines' if ties == pps else _pipes(ties)}: {tied(ties[0])}")

    to_tell = [progress] if progress is not None else []  # said once

    def profiled(kind: bool) -> ModelProfile:  # the kept one where there is one
        levers = (batch, precision, ac, ac_every, kind, float8, torch.get_default_dtype())
        key = None if planned.key is None else (*planned.key, *map(str, levers))
        if key is not None and key in _PROFILES:
            _PROFILES.move_to_end(key)
            return _PROFILES[key]
        if to_tell and (params := sum(p.numel() for p in net.parameters())) >= LONG_PROFILE:
            to_tell.pop()(
                f"profiling {planned.name} ({count(params)} parameters): a fake forward, "
                "backward and optimizer step, a few minutes on a CPU for a model this size"
            )
        profile = profile_model(
            planned.build, planned.example(batch), planned.loss, planned.optimizer,
            precision=precision, ac=ac, ac_every=ac_every, name=planned.name,
            gathered=kind, float8=planned.blocks if float8 else None,
        )  # fmt: skip
        if key is not None:
            _PROFILES[key] = profile
            while len(_PROFILES) > _KEPT_PROFILES:
                _PROFILES.popitem(last=False)
        return profile

    # A sharded FSDP row's step runs in the compute dtype (cost.gathered): a profile of
    # its own, taken only where a row needs it.
    shapes = {
        kind: Model(
            profiled(kind),
            cut, planned.blocks, tp_plan, compiled=bool(compile), precision=precision,
            sp_blocks=sp_blocks, float8=fp8,
        )
        for kind in sorted({gathered(x, precision) for x in layouts})
    }  # fmt: skip
    result = Plan(
        model=planned.name, devices=devices, nodes=-(-devices // hw.devices_per_node),
        hardware=hw, precision=precision, batch_size=batch,
        profile=next(iter(shapes.values())).profile,
        rows=[estimate(x, shapes[gathered(x, precision)], hw, batch, accumulate)
              for x in layouts],
        recommended=None, reason="", skipped=skipped, float8=float8, accumulate=accumulate,
    )  # fmt: skip
    result.recommended, result.reason = recommend(result, bool(planned.blocks))
    dtype = DTYPE[precision]
    eight = f", float8's at {hw.matmul_flops('fp8') / 1e12:,.1f}" if float8 else ""
    result.assumptions = [
        f"matmuls at {hw.matmul_flops(dtype) / 1e12:,.1f} TFLOP/s ({dtype}){eight}, other "
        "kernels at "
        f"{hw.memory_bandwidth / 1e9:,.0f} GB/s, {hw.launch * 1e6:.1f} us per kernel launch: "
        + hw.sources.get("flops", hw.sources.get("efficiency", "the hardware file")),
        f"links: {_gbs(hw.intra.bandwidth)} GB/s inside a node, "
        f"{_gbs(hw.inter.bandwidth)} GB/s per device between nodes",
    ]
    if hw.reserve:
        result.assumptions.append(
            f"fits: the peak (what the step allocates) and {hw.reserve:.0%} over it that the "
            f"allocator holds, within {hw.memory / 2**30:,.1f} GiB: "
            + hw.sources.get("reserve", "the hardware file's reserve")
        )
    if compile:
        fused = "planner.cost.COMPILED_BYTES, COMPILED_KERNELS"
        result.assumptions.append(f"compiled: elementwise kernels fused ({fused})")
    return result
