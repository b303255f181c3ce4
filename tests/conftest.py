"""Fixtures every test gets: environment restored, process group destroyed, temp TMPDIR."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before torch is imported anywhere: one thread per process on a 2-core CI box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A suite started in the background by a non-interactive shell (`make test &`, some CI
# runners) inherits SIGINT ignored, and so would every process a test starts: the Ctrl-C
# tests would then press keys nobody hears. A handled signal is reset to its default at
# exec, so with Python's own handler here each child starts as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The suite's own cache directory, empty at its start and removed at its end: what a test
# finds in the cache (a calibration of this machine above all) is what a fresh clone's
# CI finds, never what the developer's ~/.cache holds. Processes the tests start inherit
# it. Set at import, before any test or fixture reads the cache.
_CACHE = tempfile.mkdtemp(prefix="scaletrain-test-cache-")
os.environ["SCALETRAIN_CACHE_DIR"] = _CACHE


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _api_names_after_each_test() -> Iterator[None]:
    # A test that runs the CLI in-process switches messages to flag names; the next
    # test speaks to the library again.
    yield
    from scaletrain.errors import use_cli_names

    use_cli_names(False)


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _tmpdir_for_error_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Failed spawns leave pytorch-errorfile-*.pickle in TMPDIR (torch's elastic agent
    # writes them there): keep them here.
    monkeypatch.setenv("TMPDIR", str(tmp_path))


_SLOW_FIRST = ("faults", "cluster", "launcher", "dist")
"""Test directories by the time their files take, longest first: the processes they
start (see the Makefile's test target)."""


def _slow_first(item: pytest.Item) -> int:
    parts = item.nodeid.split("/")  # "tests/faults/test_x.py::test_y", from the root
    folder = parts[1] if len(parts) > 2 else ""
    return _SLOW_FIRST.index(folder) if folder in _SLOW_FIRST else len(_SLOW_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest files first, the unit tests last (a stable sort keeps each file's own
    # order): two workers taking files in this order end together, where a long file
    # handed out last would run alone on one core at the end.
    items.sort(key=_slow_first)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
