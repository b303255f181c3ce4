"""What a resume may change, and how it says what it did.

A checkpoint holds the step, not a frozen learning-rate schedule: the schedule is
a function of the step and the run's length (scaletrain.train.schedule), so a resume
with another --max-steps or --epochs extends or shortens the run. Other settings
change what the run *means*, and resuming with them would silently produce a run
that neither configuration describes:

  recipe (or model, data), batch_size, accumulate   the model, data and samples per step
  lr (when given), schedule, warmup the learning-rate curve
  seed                              the order of the epochs still to come
  precision, clip_grad, sync_bn     the arithmetic of every step
  strategy family                   data-parallel, sharded, tensor, pipeline...

Those are refused with a table of what differs; `--fork NEW_RUN` starts a new run
from the checkpoint's weights with the new settings. Everything else may change on
resume: how long (max_steps, epochs), how it is watched or saved (log_every, track,
save_every, keep, async_save, hang_timeout, eval_batches, eval_batch_size), and how
many processes run it (nproc, nodes, backend): at another data-parallel size the
per-replica batch stays, the peak learning rate is the checkpoint's, and the loader
deals the epoch's remaining samples over the new ranks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.checkpoint import CheckpointManager, Resumed, load_weights
from scaletrain.checkpoint.state import collect_rng, restore_rng
from scaletrain.errors import ConfigError, spell
from scaletrain.runtime import Runtime
from scaletrain.train.config import TrainConfig
from scaletrain.train.length import RunLength

__all__ = [
    "MEANING",
    "changed_meaning",
    "check_fork_source",
    "check_meaning",
    "check_start",
    "fork_from",
    "has_checkpoints",
    "length_words",
    "read_json",
    "refuse_changes",
    "refuse_length",
    "resume_lines",
    "strategy_family",
]

MEANING = (
    "recipe",
    "model",
    "data",
    "batch_size",
    "accumulate",
    "lr",
    "schedule",
    "warmup",
    "seed",
    "precision",
    "clip_grad",
    "sync_bn",
)
"""Resolved settings a resume must keep (and the strategy's family, compared apart)."""

_FAMILIES = {
    "ddp": "data-parallel",
    "dp": "data-parallel",
    "single": "data-parallel",
    "fsdp": "sharded",
    "tensor": "tensor-parallel",
    "pipeline": "pipeline",
    "model-parallel": "model-parallel",
}


def strategy_family(strategy: str, mesh: str | None) -> str:
    """DDP, DP and one process train the same replicated model; FSDP, tensor and
    pipeline parallel (and meshes of them) each split it their own way."""
    if mesh:
        dims = sorted(part.split("=")[0].strip() for part in mesh.split(",") if part.strip())
        return "mesh " + "x".join(dims)
    return _FAMILIES.get(strategy, strategy)


def changed_meaning(
    saved: Mapping[str, Any], now: Mapping[str, Any], *, lr_given: bool
) -> list[tuple[str, Any, Any]]:
    """(setting, checkpoint's value, this run's) for every setting that alters the run.

    `saved` and `now` are resolved configurations (config.json). The peak learning
    rate counts only when given now: otherwise the checkpoint's is kept.
    """
    diffs = []
    for key in MEANING:
        if key == "lr" and not lr_given:
            continue
        if key in saved and saved[key] != now.get(key):
            diffs.append((key, saved[key], now.get(key)))
    was = strategy_family(str(saved.get("strategy")), saved.get("mesh"))
    is_ = strategy_family(str(now.get("strategy")), now.get("mesh"))
    if "strategy" in saved and was != is_:
        diffs.append(("strategy", f"{saved['strategy']} ({was})", f"{now.get('strategy')} ({is_})"))
    return diffs


def _shown(value: Any) -> str:
    return "(default)" if value is None else str(value)


def refuse_changes(diffs: list[tuple[str, Any, Any]], source: str) -> ConfigError:
    """The error for a resume whose settings alter the run: a table and two ways out."""
    rows = [(spell(key), _shown(old), _shown(new)) for key, old, new in diffs]
    widths = [max(len(r[i]) for r in [("setting", "checkpoint", "now"), *rows]) for i in range(3)]
    table = "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [("setting", "checkpoint", "now"), *rows]
    )
    revert = ", ".join(
        spell(key, old)
        if not isinstance(old, str) or key != "strategy"
        else spell(key, old.split()[0])
        for key, old, _ in diffs
        if old is not None
    )
    return ConfigError(
        f"the run in {source} was trained with other settings, and resuming it with these "
        "would change what the run means:\n"
        f"{table}\n"
        f"Fix: resume with the checkpoint's settings ({revert or 'leave them out'}), or start "
        f"a new run from this checkpoint's weights with the new ones: "
        f"{spell('fork', 'NEW_RUN')} (add {spell('fork_optimizer', True)} to take the "
        "optimizer state too).",
        field=diffs[0][0],
    )


def resume_lines(
    resumed: Resumed | None,
    values: Mapping[str, Any],
    total: int,
    *,
    fork: bool | None,
    dp_size: int = 1,
    length: Mapping[str, Any] | None = None,
) -> list[str]:
    """The header's lines about where the run starts: checkpoints skipped (and why), the
    checkpoint resumed or forked from, and whether the run was extended or shortened.
    `fork`: None for a resume, else whether the optimizer state came along. `length`:
    the settings of the run's length now (max_steps, epochs), which say whether a new
    end was asked for."""
    if resumed is None:
        return []
    lines = [f"  skipped {path}: {why}" for path, why in resumed.rejected]
    if resumed.path is None:
        return lines
    if fork is not None:
        taken = "weights and optimizer state" if fork else "weights"
        return [*lines, f"  forked from {resumed.path}: its {taken}, from step 0"]
    saved_total = values.get("total_steps")
    saved = values.get("config") or {}
    saved_dp = saved.get("run", {}).get("data_parallel_size")
    regrouped = saved_dp is not None and saved_dp != dp_size
    asked = any(saved.get(k, v) != v for k, v in (length or {}).items())
    step = int(values["step"])
    if regrouped and not asked and saved_total and int(saved_total) != total:
        # Not an extension asked for: the same epochs take another number of steps.
        words = (
            f"resumed at step {step} from {resumed.path}; the run now ends at step {total} "
            f"(it was {saved_total}: the global batch changed with the data-parallel size)"
        )
    else:
        words = length_words(resumed.path, step, int(saved_total) if saved_total else None, total)
    lines.append(f"  {words}")
    if regrouped:
        lines.append(
            f"  data-parallel size {saved_dp} -> {dp_size}: the rest of the epoch is dealt "
            f"over {dp_size} replica{'s' if dp_size != 1 else ''}; the batch per replica and "
            "the peak learning rate stay"
        )
    return lines


def length_words(path: Path, step: int, saved_total: int | None, total: int) -> str:
    """The header's words for a resume: "resumed at step 20, extending to 40 (it was 20)
    from PATH" when the run's length changed (or shortening), else "resumed from PATH at
    step 20/40"."""
    if saved_total is None or saved_total == total:
        return f"resumed from {path} at step {step}/{total}"
    verb = "extending" if total > saved_total else "shortening"
    return f"resumed at step {step}, {verb} to {total} (it was {saved_total}) from {path}"


def check_meaning(
    saved: Mapping[str, Any] | None, now: Mapping[str, Any], lr_given: bool, source: str
) -> None:
    """Raise the table of `refuse_changes` if `now` alters the run `saved` describes."""
    if saved is None:
        return
    diffs = changed_meaning(saved, now, lr_given=lr_given)
    if diffs:
        raise refuse_changes(diffs, source)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None if there is none to read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def has_checkpoints(out: Path) -> bool:
    """Whether OUT/checkpoints holds a checkpoint whose save finished (valid or not)."""
    folder = out / "checkpoints"
    return folder.is_dir() and any((d / "manifest.json").is_file() for d in folder.iterdir())


def fork_from(rt: Runtime, source: Path, state: dict[str, Any], *, fork: str) -> Resumed:
    """Load `state` (the model; the optimizer too when asked) from the newest valid
    checkpoint of `source`, or, for a finished run that kept none, the weights of its
    model.pt; this run's RNG stays as it was: a fork is a new run."""
    rng = collect_rng(rt.device)
    found = CheckpointManager(rt, source).resume(**state)
    if found.path is None and (source / "model.pt").is_file():
        check_fork_source(source, fork=fork, optimizer="optimizer" in state)
        load_weights(rt, source / "model.pt", state["model"])
        found = Resumed(source / "model.pt", {}, found.rejected)
    restore_rng(rng, rt.device)
    if found.path is None:
        check_fork_source(source, fork=fork, optimizer="optimizer" in state)
    return found


def check_fork_source(source: Path, *, fork: str, optimizer: bool) -> None:
    """Refuse a fork that has nothing to start from: no checkpoint and no model.pt in
    `source`, or only a model.pt when the optimizer state is asked for too. Reads
    names only (the CLI calls it before any process starts)."""
    if has_checkpoints(source):
        return
    if not (source / "model.pt").is_file():
        raise ConfigError(
            f"{spell('fork', fork)} starts from {spell('out', str(source))}, but it holds "
            "no checkpoint and no model.pt. Fix: point "
            f"{spell('out')} at a run that trained (a finished one, or one saved with "
            f"{spell('save_every')}), or leave the fork out to start from scratch.",
            field="out",
        )
    if optimizer:
        raise ConfigError(
            f"{spell('fork_optimizer', True)}: the run in {source} kept no checkpoint, only "
            "its weights (model.pt), so there is no optimizer state to take. Fix: leave "
            f"{spell('fork_optimizer', True)} out to fork from its weights.",
            field="fork_optimizer",
        )


def refuse_length(cfg: TrainConfig, out: Path, path: Path, step: int, total: int) -> None:
    """Stop a resume past the run's (new) end before anything is written.

    At the run's last step it finishes at once when it had not (a save, then a crash
    before model.pt); one that finished is refused: there is nothing to train.
    """
    if step < total:
        return
    finished = (out / "model.pt").is_file()
    if step == total and not finished:
        return
    field = "max_steps" if cfg.max_steps is not None else "epochs"
    if step == total:
        raise ConfigError(
            f"the run in {out} already finished at step {step} of {total}; there is "
            f"nothing left to train. Fix: extend it ({spell('max_steps')} or "
            f"{spell('epochs')} beyond its length), start a new run from its weights with "
            f"{spell('fork', 'NEW_RUN')}, or add {spell('overwrite', True)} to train it "
            "again from step 0.",
            field=field,
        )
    length = spell(field, getattr(cfg, field)) if getattr(cfg, field) is not None else "the recipe"
    raise ConfigError(
        f"the run in {out} resumes at step {step} ({path.name}), past the {total} steps "
        f"that {length} now gives it; a run cannot be shortened to before its checkpoint. "
        f"Fix: ask for at least {step} steps, or start a new, shorter run from these "
        f"weights with {spell('fork', 'NEW_RUN')}.",
        field=field,
    )


def check_start(config: TrainConfig, *, recipe: Any, dp_size: int) -> None:
    """Before any process starts: the refusals a start would meet in its workers that
    the run directory's files decide (a fork with nothing to start from; a resume with
    settings that change the run, shorter than its checkpoint, of a finished run, or
    with a --profile window past its end). Reads file names, the newest checkpoint's
    manifest and values (not its tensors), and writes nothing, so a refused start leaves
    the disk as it was. What needs the checkpoint loaded (a damaged newest one, another
    data-parallel size's length) the workers still check."""
    from scaletrain.checkpoint import latest_checkpoint
    from scaletrain.checkpoint.layout import VALUES

    if config.out is None:
        return
    source = Path(config.out)
    if config.fork is not None:
        check_fork_source(source, fork=config.fork, optimizer=config.fork_optimizer)
        return
    if config.overwrite:
        return  # the run in OUT is replaced: nothing of it is resumed
    path = latest_checkpoint(source, verify=False) if has_checkpoints(source) else None
    values = read_json(path / VALUES) if path is not None else None
    total: int | None = None
    if path is not None and values is not None and isinstance(values.get("step"), int):
        saved = values.get("config") if isinstance(values.get("config"), dict) else None
        now = config.replace(
            recipe=recipe.name if recipe.spec is None else None,
            batch_size=config.batch_size or recipe.batch_size,
            warmup=recipe.warmup if config.warmup is None else config.warmup,
            sync_bn=recipe.sync_bn if config.sync_bn is None else config.sync_bn,
        ).to_dict()
        check_meaning(saved, now, config.lr is not None, str(path))
        saved_dp = ((saved or {}).get("run") or {}).get("data_parallel_size")
        recorded = {k: values.get(k) for k in ("steps_per_epoch", "epoch", "epoch_end")}
        if saved_dp == dp_size and all(isinstance(v, int) for v in recorded.values()):
            step = int(values["step"])
            total = RunLength.resumed_total(
                recorded,  # type: ignore[arg-type]
                step=step,
                epochs=config.epochs or recipe.epochs,
                max_steps=config.max_steps,
            )
            refuse_length(config, source, path, step, total)
    if config.profile is not None:
        from scaletrain.observe.metrics.profiling import parse_steps, window_past_end

        first, _ = parse_steps(config.profile)
        if total is None and path is None and config.max_steps is not None:
            total = config.max_steps  # at most: an epoch count may end it sooner
        if total is not None and first > total:
            raise window_past_end(config.profile, total)
