"""What a `scaletrain train` run says of itself: the header it opens with and the
summary it closes with.

The header's lines (what trains on what, how and for how long, the notes about the run
directory, what a resume or fork did, a changed learning rate) go to the observers'
on_run_start with the run's size and length; the summary, the run's last record, to
on_run_end and to the caller; a fork's parent to both and to config.json. All of it is
read from a Session (scaletrain.train.session) once it is set up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaletrain.observe.events import RunInfo
from scaletrain.train.resume import resume_lines
from scaletrain.train.schedule import lr_at

if TYPE_CHECKING:
    from scaletrain.train.session import Session

__all__ = ["fork_parent", "plural", "run_info", "run_summary"]


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def run_info(session: Session, resolved: dict[str, Any]) -> RunInfo:
    """What the observers' on_run_start hears: the run's size and length, its header, and
    its resolved config (config.json's contents)."""
    rt = session.rt
    header = _header_lines(session)
    return RunInfo(
        out=session.out,
        rank=rt.rank,
        world_size=rt.world_size,
        start_step=session.done.step,
        total_steps=session.total_steps,
        steps_per_epoch=session.steps_per_epoch,
        epochs=session.epochs,
        global_batch=session.global_batch,
        header=header,
        config=resolved,
    )


def _header_lines(session: Session) -> list[str]:
    """The run's header: what it trains, how and for how long, then its notes, what its
    resume or fork did, and a learning rate the resume changed."""
    cfg, rt, recipe = session.cfg, session.rt, session.recipe
    layout = f"mesh {rt.mesh_shape}, " if rt.mesh_shape else ""
    extras = [f"precision {cfg.precision}"] if cfg.precision != "32" else []
    if cfg.accumulate > 1:
        extras.append(f"accumulate {cfg.accumulate}")
    if cfg.ac != "none":  # the large-model levers, as the run's flags name them
        k = cfg.ac_every or 0
        nth = f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"
        every = f", every {nth} block whole" if k else ""
        extras.append(f"activation checkpointing {cfg.ac}{every}")
    extras += [name for name, on in (("compiled", cfg.compile), ("float8", cfg.float8)) if on]
    micro = f" x {cfg.accumulate} micro-steps" if cfg.accumulate > 1 else ""
    kind, what = ("model", recipe.spec) if recipe.spec else ("recipe", recipe.name)
    header = [
        f"scaletrain train: {kind} [bold]{what}[/] on {recipe.dataset} "
        f"({len(session.train_set):,} train / {len(session.test_set):,} test samples"
        f"{_data_words(session)})",
        f"  strategy {cfg.strategy}{' + sync-bn' if session.sync_bn else ''}, {layout}"
        f"{plural(rt.world_size, 'process', 'processes')} x {rt.backend} on "
        f"{rt.device.type}, batch {session.batch_size}/replica x {rt.dp_size}{micro} (global "
        f"{session.global_batch}), {_describe_lr(session)}, "
        f"{plural(session.epochs, 'epoch')}, "
        f"{plural(session.total_steps, 'step')}" + (f", {', '.join(extras)}" if extras else ""),
    ]
    header += [f"  {note}" for note in session.notes]
    header += resume_lines(
        session.done.resumed,
        session.done.values,
        session.total_steps,
        fork=cfg.fork_optimizer if cfg.fork else None,
        dp_size=rt.dp_size,
        length={"max_steps": cfg.max_steps, "epochs": session.epochs_wanted},
    )
    header += _lr_change(session)
    return header


def _lr_change(session: Session) -> list[str]:
    """A resume at another length whose learning rate at the resumed step differs
    from the one the checkpoint's run would have used there: both values, said."""
    done, cfg = session.done, session.cfg
    saved_total = done.values.get("total_steps")
    if cfg.fork or done.resumed is None or done.resumed.path is None or not saved_total:
        return []
    saved_total = int(saved_total)
    if saved_total == session.total_steps or done.step >= session.total_steps:
        return []
    was = lr_at(
        done.step,
        peak=session.lr,
        total_steps=saved_total,
        warmup=session.warmup,
        schedule=cfg.schedule,
    )
    now = session.lr_at(done.step)
    if abs(now - was) <= 1e-9 * max(abs(was), abs(now)):
        return []
    return [
        f"  learning rate at step {done.step + 1}: {was:.3g} -> {now:.3g} (the "
        f"{cfg.schedule} schedule now spans {session.total_steps} steps, not {saved_total})"
    ]


def _data_words(session: Session) -> str:
    if session.recipe.spec is not None:
        # A model module reads its own data; the directory given is passed to it.
        return f"; data: {session.data_path}" if session.data_path else ""
    return f"; data: {session.data_path or 'generated in memory'}"


def _describe_lr(session: Session) -> str:
    if session.total_steps <= session.warmup:
        # Say it: a short trial never reaches the peak, which is by design.
        return (
            f"lr {session.lr:g} after a {session.warmup}-step warm-up (this "
            f"{session.total_steps}-step run ends inside it, at lr "
            f"{session.lr_at(session.total_steps - 1):.3g})"
        )
    return f"lr {session.lr:g} ({session.warmup} warm-up steps, then {session.cfg.schedule})"


def fork_parent(session: Session) -> dict[str, Any] | None:
    """Where a fork came from: the checkpoint (or model.pt), its step, and whether it
    took the optimizer state; None for a run that is not a fork."""
    resumed = session.done.resumed
    if session.done.forked is None or resumed is None:
        return None
    step = resumed.values.get("step")
    return {
        "run": session.cfg.out,
        "checkpoint": str(session.done.forked),
        "step": int(step) if step is not None else None,
        "optimizer": bool(session.cfg.fork_optimizer),
    }


def run_summary(session: Session) -> dict[str, Any]:
    """The finished run's last record: what trained, how long it took, how fast, its
    last evaluation, where it came from (a fork) and its last checkpoint."""
    done, rt, recipe = session.done, session.rt, session.recipe
    compiling = session.compile_time() - done.compile_before
    summary: dict[str, Any] = {
        "event": "summary",
        "recipe": recipe.name if recipe.spec is None else None,
        "model": recipe.spec,
        "task": recipe.task,
        "strategy": session.cfg.strategy,
        "mesh": rt.mesh_shape,
        "world_size": rt.world_size,
        "backend": rt.backend,
        "device": rt.device.type,
        "steps": done.step,
        "started_at": session.run_start_step,
        "epochs": session.epochs,
        "train_time_s": done.train_time,
        "compile_time_s": session.compile_time(),
        # Throughput of training, not of compiling (the ledger leaves those steps out
        # of its step time too).
        "samples_per_s": done.samples / max(done.train_time - session.compile_time(), 1e-9),
        # This start's (a resumed run's part): what the closing line reports.
        "start_time_s": done.train_time - done.time_before,
        "start_compile_time_s": compiling,
        "start_samples_per_s": (done.samples - done.samples_before)
        / max(done.train_time - done.time_before - compiling, 1e-9),
        "val_loss": done.last_eval.loss if done.last_eval else None,
        "val_acc": done.last_eval.accuracy if done.last_eval else None,
        "out": str(session.out),
    }
    parent = fork_parent(session)
    if parent is not None:
        summary["forked_from"] = parent
    if done.saved is not None and done.saved.name == f"step-{done.step:06d}":
        # The last step's checkpoint (save_last) and what it costs on disk.
        summary["checkpoint"] = str(done.saved)
        summary["checkpoint_bytes"] = sum(
            f.stat().st_size for f in done.saved.rglob("*") if f.is_file()
        )
    return summary
