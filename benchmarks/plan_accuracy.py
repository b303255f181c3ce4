"""How right `scaletrain plan` is: three tables.

1. `--part zero`: model-state memory per device against the published formulas,
   for the models the tests build (their parameter counts from the meta device):
   the ZeRO paper's four stages (Rajbhandari et al. 2020, figure 1: fp16 weights and
   gradients, fp32 master weights and Adam's moments, 16 bytes a parameter) and
   DeepSpeed's two estimators (`estimate_zero2_model_states_mem_needs`,
   `estimate_zero3_model_states_mem_needs` without offload: 4 psi + 16 psi / N, and
   4 x the largest layer + 18 psi / N), priced by the planner's `model_states`;
   and the planner's own DDP and FSDP rows at bf16-mixed (torch keeps fp32 weights,
   the same 16 bytes a parameter) against the paper's stages 0 and 3.
2. `--part torchtitan`: torchtitan's published Llama 3.1 runs, planned on paper from
   the model alone on the `h100-96gb` hardware file, against the figures of its
   performance page (benchmarks/llama3_h100_202412_torchtitan.md of
   github.com/pytorch/torchtitan, docs/performance.md before June 2025; runs of
   December 2024 on Meta's Grand Teton hosts: 8 H100 96GB HBM2e at 500 W per host,
   400 Gb/s RDMA per GPU; memory is torch.cuda's max reserved, throughput tokens per
   second per GPU at step 90). Table 1: 8B, FSDP on 8 GPUs, local batch 2, sequence
   8192, selective checkpointing, eager, compiled, and compiled with float8 training;
   Table 3: the same on 128 GPUs; Table 4 (the 2-D row): 70B, FSDP 32 x TP 8 on 256
   GPUs, local batch 16, full checkpointing, compiled, float8. The 70B is its Hugging
   Face config.json (Llama
   3.1 70B's published sizes), built on the meta device. Selective checkpointing is
   planned with the runs' own policy, torchtitan's (its llama3 `_apply_ac`, op mode:
   matmul, attention and reduce-scatter outputs kept, but every second matmul of a
   block recomputed), installed for the profile; `--part what-if` plans table 1's
   eager row with scaletrain's own policy instead (every matmul's output kept), which
   is what `scaletrain train --ac selective` runs. Each FSDP row is also counted by
   torch's own FSDPMemTracker (`_tracked_gib`: the same step, sharded as torchtitan
   shards it, on a fake process group in this process), a check of the plan that
   needs no GPU; the 2-D row is not (a fake 256-rank mesh of DTensors, not tried).
   The plan's peak is what the step allocates, the published figure what CUDA's
   caching allocator reserved: each row is compared as the peak times 1 + the
   hardware file's `reserve` (the allocator's hold). That figure is itself read off
   the 8B rows against torch's tracker, so the comparison is not independent of them;
   the tracker's column is.
3. `--part here`: this machine calibrated (`scaletrain plan --calibrate`), then the
   recipes trained (on a CPU at 1 and 2 processes; on a GPU one process at fp32 and
   bf16-mixed) and each run's `plan --check`: predicted vs measured step time and
   memory (a CPU's RSS growth, a GPU's CUDA peak). On a CPU it is reported as it
   comes: this box's run-to-run noise is larger than the model's error; on one GPU
   the target is 10%.

    .venv/bin/python benchmarks/plan_accuracy.py --part zero
    .venv/bin/python benchmarks/plan_accuracy.py --part torchtitan   # minutes: fake 70B
    .venv/bin/python benchmarks/plan_accuracy.py --part what-if      # scaletrain's policy
    .venv/bin/python benchmarks/plan_accuracy.py --part here [--keep FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

GIB = 2**30

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip
"""Llama 3.1 70B's sizes (its model card's config.json)."""

PUBLISHED = [
    # (table, model, devices, layout, batch, seq, ac, compile, float8, GiB, tokens/s/GPU)
    ("1", "llama-8b", 8, ("fsdp", 8, 1), 2, 8192, "selective", False, False, 82.4, 5762),
    ("1", "llama-8b", 8, ("fsdp", 8, 1), 2, 8192, "selective", True, False, 77.0, 6667),
    ("1", "llama-8b", 8, ("fsdp", 8, 1), 2, 8192, "selective", True, True, 76.8, 8532),
    ("3", "llama-8b", 128, ("fsdp", 128, 1), 2, 8192, "selective", False, False, 67.0, 5605),
    ("3", "llama-8b", 128, ("fsdp", 128, 1), 2, 8192, "selective", True, False, 62.0, 6514),
    ("3", "llama-8b", 128, ("fsdp", 128, 1), 2, 8192, "selective", True, True, 61.8, 8380),
    ("4", "70b", 256, ("fsdp x tp", 32, 8), 16, 8192, "full", True, True, 71.9, 829),
]
"""Table 4's run is tensor parallel with sequence and loss parallelism: planned as the
`sp` layout, with torchtitan's embeddings, final norm and head split over tp too
(`_torchtitans_tp`), and its cross-entropy computed as torch's loss_parallel computes it
(`_loss_parallel_cross_entropy`)."""


def zero() -> None:
    import torch

    from scaletrain.planner.cost import States, model_states
    from scaletrain.planner.layout import Layout
    from scaletrain.train.recipes import get_recipe

    paper = States((("params", 2, 3), ("grads", 2, 2), ("optimizer", 12, 1)))
    ds = States(
        (("params", 2, 3), ("grads", 2, 3, 0), ("fp32 grads", 4, 1), ("optimizer", 12, 1)),
        transient={"params": 2, "grads": 2},
    )
    print("| model | params | N | stage | formula GiB | planner GiB | error |")
    print("|---|---:|---:|---|---:|---:|---:|")
    worst = 0.0
    for name in ("llama-1b", "llama-8b"):
        with torch.device("meta"):
            net = get_recipe(name).build()
        psi = sum({id(p): p.numel() for p in net.parameters()}.values())
        largest = max(sum(p.numel() for p in m.parameters()) for m in net.children())
        for n in (8, 64):
            rows = [
                (
                    f"paper {s}",
                    [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n][s],
                    model_states(psi, n, s, paper),
                )
                for s in range(4)
            ] + [
                ("deepspeed 2", 4 * psi + 16 * psi / n, model_states(psi, n, 2, ds)),
                ("deepspeed 3", 4 * largest + 18 * psi / n, model_states(psi, n, 3, ds, largest)),
            ]
            for label, want, got in rows:
                err = sum(got.values()) / want - 1
                worst = max(worst, abs(err))
                print(f"| {name} | {psi / 1e9:.2f}B | {n} | {label} | {want / GIB:.2f} | "
                      f"{sum(got.values()) / GIB:.2f} | {err:+.2%} |")  # fmt: skip
    import scaletrain as st

    p = st.plan("llama-1b", devices=8, hardware="h100-sxm", precision="bf16-mixed",
                batch_size=1, seq_len=256, layouts=[Layout("ddp", dp=8), Layout("fsdp", dp=8)])  # fmt: skip
    psi = p.profile.params
    for row, want in zip(p.rows, (16 * psi, 16 * psi / 8), strict=True):
        m = row.memory
        got = m.params + m.grads + m.optimizer
        worst = max(worst, abs(got / want - 1))
        print(f"| llama-1b (planner row {row.layout.label}) | {psi / 1e9:.2f}B | 8 | "
              f"{row.layout.stage} | {want / GIB:.4f} | {got / GIB:.4f} | {got / want - 1:+.2%} |")  # fmt: skip
    print(f"\nlargest error: {worst:.3%} (target: within 1%)")


def torchtitan() -> None:
    import scaletrain as st
    import scaletrain.planner.api as api
    import scaletrain.strategies.levers as levers
    from scaletrain.planner.layout import Layout

    levers.selective_policy = _torchtitans_selective()  # type: ignore[assignment]
    api.Model = _torchtitans_tp  # type: ignore[assignment,misc]
    resolve = api.resolve_model

    def loss_parallel(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(resolve(*args, **kwargs), loss=_loss_parallel_cross_entropy)

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(LLAMA_70B), encoding="utf-8")
        print(
            "| table | model | GPUs | layout | batch x seq | AC | compile | float8 | GiB published | "
            "GiB planned | GiB torch's tracker | GiB planned reserved | error | "
            "tok/s/GPU published | planned | error |"
        )
        print("|---|---|---:|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        tracked: dict[tuple[object, ...], str] = {}
        plans: dict[tuple[object, ...], object] = {}
        for table, model, gpus, layout, batch, seq, ac, compiled, eight, gib, tps in PUBLISHED:
            strategy, dp, tp = layout
            which = {"recipe": model} if model != "70b" else {"model": str(config)}
            key = (model, gpus, batch, seq, ac, compiled, eight)
            if key not in plans:  # one plan for the rows of the same model, devices and step
                layouts = [Layout(s, dp=d, tp=t, sp=t > 1) for _, m, g, (s, d, t), *rest
                           in PUBLISHED if (m, g, *rest[:5]) == key]  # fmt: skip
                # torchtitan's loss is loss parallel wherever it runs tensor parallel.
                tensor = any(x.tp > 1 for x in layouts)
                api.resolve_model = loss_parallel if tensor else resolve
                plans[key] = st.plan(
                    **which, devices=gpus, hardware="h100-96gb",
                    batch_size=batch, seq_len=seq, precision="bf16-mixed", ac=ac,
                    compile=compiled, float8=eight, layouts=layouts,
                )  # fmt: skip
            p = plans[key]
            want = Layout(strategy, dp=dp, tp=tp, sp=tp > 1)
            row = next(r for r in p.rows if r.layout == want)  # type: ignore[attr-defined]
            mem, rate = row.memory.total / GIB, p.tokens_per_device(row)  # type: ignore[attr-defined]
            # What the published figure is (max reserved): the peak and the allocator's hold.
            held = mem * (1 + p.hardware.reserve)  # type: ignore[attr-defined]
            if tp == 1 and not eight and (model, dp) not in tracked:  # it counts a bf16 step
                tracked[model, dp] = f"{_tracked_gib(model, dp, batch, seq):.1f}"
            print(f"| {table} | {model} | {gpus} | {row.layout.label} | {batch} x {seq} | {ac} | "
                  f"{'yes' if compiled else 'no'} | {'yes' if eight else 'no'} | {gib} | {mem:.1f} | "
                  f"{'-' if eight else tracked.get((model, dp), '-')} | {held:.1f} | "
                  f"{held / gib - 1:+.1%} | "
                  f"{tps:,} | {rate:,.0f} | {rate / tps - 1:+.1%} |",
                  flush=True)  # fmt: skip
    torch_s, planned, aten = _loss_parallel_gib()
    print(
        f"\nTable 4's loss alone, peak GiB per rank: torch's loss_parallel {torch_s:.1f}, "
        f"as planned {planned:.1f}, aten's fused cross-entropy {aten:.1f}"
    )


def _torchtitans_tp(profile: object, layers: list[Any], units: object, tp_plan: Any,
                    **kw: Any) -> object:  # fmt: skip
    """The planner's model of a run with torchtitan's tensor-parallel plan (its llama3
    `apply_tp`) where it goes beyond scaletrain's: the embeddings rowwise, the final
    norm sequence parallel and the head colwise with loss parallelism, so every
    activation, the logits and the loss's included, is split over tp (at the profile's
    peak and at the head's alike); and sequence parallel's inputs gathered once per
    attention and feed-forward module (`PrepareModuleInput`, as scaletrain's
    TensorParallel shares one gather among the layers taking one input), named by the
    module, whose inputs torchtitan's float8 styles gather in float8. The planner's two
    gathers of the sequence at the blocks' ends (scaletrain's) stay: two of a step's
    hundreds of collectives."""
    from scaletrain.planner.structure import Model

    class Torchtitan(Model):
        def tp_split(self, sp: bool = False, recomputing: bool = True) -> float:
            if not sp:
                return super().tp_split(sp, recomputing)
            p = self.profile
            return float(p.activation_bytes if recomputing else p.head_activation_bytes)

        def gatherers(self) -> list[str]:
            return sorted({n.rpartition(".")[0] for n in super().gatherers()})

    if tp_plan:
        heads = {"model.embed_tokens": "rowwise", "lm_head": "colwise"}
        tp_plan = {**tp_plan, **{k: v for k, v in heads.items() if k not in tp_plan}}
        kw["sp_blocks"] = [m for x in layers for m in x.members]
    return Torchtitan(profile, layers, units, tp_plan, **kw)  # type: ignore[arg-type]


def _loss_parallel_cross_entropy(outputs: Any, targets: Any) -> Any:
    """torchtitan's loss, cross_entropy(pred.float()), as torch's loss_parallel computes
    it on each rank of table 4's run (torch.distributed.tensor.parallel.loss): its
    log_softmax decomposed into the max, the shifted logits, their exponentials' sum and
    the shifted logits less its log, each an fp32 tensor of the rank's logits (the max's
    and the sum's all-reduces aside), and its backward merged into nll_loss's: a zero
    gradient with -1 at the targets, plus the softmax, times the loss's gradient. aten's
    fused log_softmax allocates only its output, so the profile of `Recipe.loss` holds
    none of these temporaries, which are the size of the logits in fp32."""
    import torch

    class LossParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, target: Any) -> Any:
            shifted = x - torch.amax(x, 1, keepdim=True)
            result = shifted - torch.log(torch.sum(torch.exp(shifted), 1, keepdim=True))
            del shifted
            ctx.save_for_backward(result, target)
            return -torch.gather(result, 1, target[:, None]).mean()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            result, target = ctx.saved_tensors
            grad_input = torch.zeros_like(result)
            grad_input[torch.arange(len(target)), target] = -1.0
            return (grad_input + torch.exp(result)) * (grad / len(target)), None

    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return LossParallel.apply(logits.flatten(0, 1).float(), targets.flatten())


def _loss_parallel_gib(batch: int = 16, seq: int = 8192, vocab: int = 128256, tp: int = 8
                       ) -> tuple[float, float, float]:  # fmt: skip
    """Peak GiB per rank of table 4's loss alone, from one rank's logits on (bf16, a
    `tp`-th of the vocabulary) to their gradient, as torch's MemTracker counts it under
    fake tensors: torch's loss_parallel on them as a DTensor of a one-rank mesh (each
    rank runs the same ops on its shard whatever tp is, the all-reduces aside; the
    tracker counts a DTensor of more ranks at its global size),
    `_loss_parallel_cross_entropy`, and aten's fused cross-entropy (what the profile
    held before)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        peaks = []
        for kind in ("torch", "planned", "aten"):
            with FakeTensorMode():
                shard = torch.randn(batch, seq, vocab // tp, dtype=torch.bfloat16)
                shard.requires_grad_()
                y = torch.randint(0, vocab, (batch, seq))
                tracker = MemTracker()
                with tracker:
                    logits = shard * 1.0  # the head's output: not a leaf
                    if kind == "torch":
                        whole = DTensor.from_local(logits, mesh, [Shard(-1)])
                        with loss_parallel():
                            loss = torch.nn.functional.cross_entropy(
                                whole.flatten(0, 1).float(), y.flatten()
                            )
                            del whole, logits
                            loss.backward()
                    else:
                        loss = (
                            _loss_parallel_cross_entropy(logits, y) if kind == "planned"
                            else torch.nn.functional.cross_entropy(
                                logits.flatten(0, 1).float(), y.flatten())
                        )  # fmt: skip
                        del logits
                        loss.backward()
            peak = tracker.get_tracker_snapshot("peak")
            peaks.append(float(next(iter(peak.values()))["Total"]) / GIB)
        return peaks[0], peaks[1], peaks[2]
    finally:
        dist.destroy_process_group()


def _tracked_gib(recipe: str, dp: int, batch: int, seq: int) -> float:
    """Peak GiB per GPU of an FSDP row as torch's FSDPMemTracker counts it: the model
    sharded as torchtitan shards it (each block a unit, resharded after its forward but
    the last; the root; bf16 gathers, fp32 reductions; its selective policy), one eager
    step under fake tensors on a fake process group of `dp` ranks in this process. The
    step is torchtitan's: the logits dropped before the backward, AdamW's state
    already there. Like the plan, it counts what the step allocates, not what CUDA's
    caching allocator reserves around it."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import checkpoint

    from scaletrain.train.recipes import get_recipe

    policy = _torchtitans_selective()()  # type: ignore[operator]

    class Checkpointed(torch.nn.Module):
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: Any) -> Any:
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=policy)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        mesh = init_device_mesh("cpu", (dp,))  # outside fake tensors: it reads its ranks
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with FakeTensorMode():
            model = get_recipe(recipe).build()
            blocks = model.layers
            for i, block in enumerate(list(blocks)):
                blocks[i] = Checkpointed(block)
                fully_shard(blocks[i], mesh=mesh, mp_policy=mp,
                            reshard_after_forward=i < len(blocks) - 1)  # fmt: skip
            fully_shard(model, mesh=mesh, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
            x, y = tokens[:, :-1], tokens[:, 1:]

            def step() -> None:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                del logits
                loss.backward()
                opt.step()
                opt.zero_grad()

            step()
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((x, y))
            with tracker:
                step()
            peak = tracker.get_tracker_snapshot("peak")
        return float(next(iter(peak.values()))["Total"]) / GIB
    finally:
        dist.destroy_process_group()


def _torchtitans_selective() -> object:
    """torchtitan's op-level selective policy (its llama3 `_apply_ac`): matmuls,
    attention and reduce-scatters keep their outputs, except every second matmul of a
    block, which is recomputed. scaletrain's keeps every matmul's output."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from scaletrain.strategies.levers import selective_keeps

    mm = torch.ops.aten.mm.default

    def context() -> object:
        counts = {True: 0, False: 0}

        def policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
            again = bool(getattr(ctx, "is_recompute", False))
            if op == mm:
                counts[again] += 1
            keep = selective_keeps(op) and not (op == mm and counts[again] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return lambda: context


def what_if() -> None:
    """Table 1's eager row again, with scaletrain's own selective policy in place of
    torchtitan's: how much more memory keeping every matmul's output takes."""
    import scaletrain as st
    from scaletrain.planner.layout import Layout

    p = st.plan("llama-8b", devices=8, hardware="h100-96gb", batch_size=2, seq_len=8192,
                precision="bf16-mixed", ac="selective", layouts=[Layout("fsdp", dp=8)])  # fmt: skip
    row = p.rows[0]
    mem, rate = row.memory.total / GIB, p.tokens_per_device(row)
    print(
        "| table | model | GPUs | policy | GiB published | GiB planned | error | "
        "tok/s/GPU published | planned | error |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    print(f"| 1 | llama-8b | 8 | scaletrain's selective | 82.4 | {mem:.1f} | {mem / 82.4 - 1:+.1%} "
          f"| 5,762 | {rate:,.0f} | {rate / 5762 - 1:+.1%} |")  # fmt: skip


def here(steps: int, keep: str | None) -> None:
    import importlib.util

    import torch

    from scaletrain import cli
    from scaletrain.hardware import load
    from scaletrain.observe.metrics.records import peak_memory
    from scaletrain.planner.check import check_run
    from scaletrain.strategies.float8 import FLOAT8_MIN_CAPABILITY

    with tempfile.TemporaryDirectory() as tmp:
        hw = Path(keep) if keep else Path(tmp) / "this-machine.toml"
        assert cli.main(["plan", "--calibrate", str(hw)]) == 0
        gpu = torch.cuda.is_available()
        # On a GPU, one process (the plan of one GPU the issue targets) at two precisions,
        # and gpt (the recipe whose blocks' Linears float8 converts) compiled in float8
        # where the GPU has float8 matmuls and torchao is installed; on this CPU, 1 and 2
        # Gloo processes.
        eight = (
            gpu
            and torch.cuda.get_device_capability(0) >= FLOAT8_MIN_CAPABILITY
            and importlib.util.find_spec("torchao") is not None
            and load(hw).fp8_flops() is not None  # a GPU the datasheet table gives fp8 for
        )
        runs: list[tuple[int, str, str, tuple[str, ...]]] = (
            [(1, "ddp", "32", ()), (1, "ddp", "bf16-mixed", ())]
            + ([(1, "ddp", "bf16-mixed", ("--compile", "--float8"))] if eight else [])
            if gpu
            else [(1, "ddp", "32", ()), (2, "ddp", "32", ()), (2, "fsdp", "32", ())]
        )
        # On a GPU, CUDA's reserved peak beside the allocated one the plan predicts: the
        # caching allocator's share, which published runs' figures (max reserved) hold.
        print(
            "| recipe | processes | strategy | precision | levers | step ms predicted | measured | "
            "error | memory MiB predicted | measured | error |" + (" reserved MiB |" if gpu else "")
        )
        print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else ""))
        for recipe in ("convnet", "gpt", "split-net"):
            for nproc, strategy, precision, levers in runs:
                if levers and recipe != "gpt":
                    continue
                said = " ".join(levers) or "-"
                run = Path(tmp) / f"{recipe}-{nproc}-{strategy}-{precision}{''.join(levers)}"
                code = cli.main(
                    ["train", "--recipe", recipe, "--nproc", str(nproc), "--strategy", strategy,
                     "--precision", precision, "--max-steps", str(steps), "--ledger-every",
                     "10", "--eval-batches", "0", "--no-save-last", "--out", str(run), *levers]
                )  # fmt: skip
                if code != 0:
                    print(f"| {recipe} | {nproc} | {strategy} | {precision} | {said} | "
                          f"run failed ({code}) |")  # fmt: skip
                    continue
                c = check_run(run, str(hw))
                t = c.predicted.time.total
                mem = f"{c.predicted_memory / 2**20:.1f} | " + (
                    f"{c.memory / 2**20:.1f} | {c.predicted_memory / c.memory - 1:+.0%}"
                    if c.memory
                    else "- | -"
                )
                reserved = max(
                    (p["reserved_peak"] or 0 for p in peak_memory(run).values()), default=0
                )
                print(f"| {recipe} | {nproc} | {strategy} | {precision} | {said} | {t * 1e3:.1f} | "
                      f"{c.step_s * 1e3:.1f} | {t / c.step_s - 1:+.0%} | {mem} |"
                      + (f" {reserved / 2**20:.1f} |" if gpu else ""))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("zero", "torchtitan", "what-if", "here"), required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--keep", metavar="FILE", help="--part here: keep the calibration there")
    args = parser.parse_args()
    parts = {
        "zero": zero,
        "torchtitan": torchtitan,
        "what-if": what_if,
        "here": lambda: here(args.steps, args.keep),
    }
    parts[args.part]()


if __name__ == "__main__":
    main()
