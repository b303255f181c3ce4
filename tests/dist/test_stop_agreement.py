"""The per-step stop agreement of `scaletrain train` is off the training loop's hot path.

Every step starts a non-blocking all-reduce of the signal flag (rt.any_rank_async) and
collects the previous step's; the only blocking rt.any_rank is the one before the first
step. (It was one blocking collective per step: a round trip between the ranks, ~3-5 ms
of "sync" per step in the ledger on a busy 2-core machine.) That every rank still stops
at the same step on a signal is tested end to end in tests/faults/test_interrupts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain import cli
from scaletrain.runtime import Runtime
from scaletrain.testing.datasets import write_fake_mnist


def test_one_blocking_agreement_per_run_not_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"blocking": 0, "started": 0, "collected": 0}
    any_rank, any_rank_async = Runtime.any_rank, Runtime.any_rank_async

    def counting_any_rank(self: Runtime, flag: bool) -> bool:
        calls["blocking"] += 1
        return any_rank(self, flag)

    def counting_async(self: Runtime, flag: bool) -> object:
        calls["started"] += 1
        pending = any_rank_async(self, flag)

        class Counted:
            def result(self) -> bool:
                calls["collected"] += 1
                return pending.result()

        return Counted()

    monkeypatch.setattr(Runtime, "any_rank", counting_any_rank)
    monkeypatch.setattr(Runtime, "any_rank_async", counting_async)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = write_fake_mnist(tmp_path / "data", n_train=200, n_test=20)
    args = ["train", "--nproc", "1", "--data-dir", str(data), "--batch-size", "20",
            "--max-steps", "8", "--eval-batches", "0", "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(args) == 0
    assert calls["blocking"] == 1  # before the first step (a Ctrl-C during set-up)
    # Steps 1-8 each start one; the last one is collected at the epoch's end.
    assert calls["started"] == 8 and calls["collected"] == 8


def test_stop_after_is_exact_without_an_agreement(tmp_path: Path) -> None:
    """--stop-after counts steps, the same on every rank: it stops at that step, not one later."""
    data = write_fake_mnist(tmp_path / "data", n_train=200, n_test=20)
    args = ["train", "--nproc", "1", "--data-dir", str(data), "--batch-size", "20",
            "--max-steps", "8", "--eval-batches", "0", "--out", str(tmp_path / "run"),
            "--stop-after", "3"]  # fmt: skip
    assert cli.main(args) == 0
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-000003"], ckpts
