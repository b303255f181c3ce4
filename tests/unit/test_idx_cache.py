"""A large gzipped IDX file is decompressed once, kept in the cache, and never trusted blindly."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data import idx
from scaletrain.data.idx import read_idx
from scaletrain.testing import write_idx


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(root))
    monkeypatch.setattr(idx, "CACHE_MIN_BYTES", 1000)  # the test arrays are small
    return root / "idx"


def _no_gzip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(data: bytes) -> bytes:
        raise AssertionError("decompressed again although a good copy was kept")

    monkeypatch.setattr(idx.gzip, "decompress", refuse)


def test_decompressed_once_then_read_from_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arr = np.arange(60 * 28 * 28, dtype=np.int32).reshape(60, 28, 28).astype(np.uint8)
    path = write_idx(tmp_path / "train-images-idx3-ubyte.gz", arr)
    np.testing.assert_array_equal(read_idx(path), arr)
    kept = list(cache.iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("train-images-idx3-ubyte-")
    assert kept[0].read_bytes() == gzip.decompress(path.read_bytes())
    _no_gzip(monkeypatch)
    np.testing.assert_array_equal(read_idx(path), arr)


def test_a_changed_source_is_decompressed_afresh(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "images.gz"
    first = np.zeros((40, 28, 28), dtype=np.uint8)
    write_idx(path, first)
    read_idx(path)
    second = np.full((40, 28, 28), 7, dtype=np.uint8)
    write_idx(path, second)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    np.testing.assert_array_equal(read_idx(path), second)


def test_a_damaged_copy_is_not_used(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arr = np.arange(50 * 28 * 28, dtype=np.int64).reshape(50, 28, 28).astype(np.uint8)
    path = write_idx(tmp_path / "images.gz", arr)
    read_idx(path)
    (kept,) = cache.iterdir()
    kept.write_bytes(kept.read_bytes()[:-100])  # truncated, e.g. a full disk
    np.testing.assert_array_equal(read_idx(path), arr)
    assert kept.stat().st_size == len(gzip.decompress(path.read_bytes()))  # replaced whole


def test_small_files_and_plain_files_are_not_kept(tmp_path: Path, cache: Path) -> None:
    small = write_idx(tmp_path / "labels.gz", np.arange(10, dtype=np.uint8))
    plain = write_idx(tmp_path / "images", np.zeros((40, 28, 28), dtype=np.uint8))
    read_idx(small)
    read_idx(plain)
    assert not cache.exists()


def test_an_unwritable_cache_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(blocker))
    monkeypatch.setattr(idx, "CACHE_MIN_BYTES", 1000)
    arr = np.ones((40, 28, 28), dtype=np.uint8)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "images.gz", arr)), arr)
    assert blocker.read_text() == "x"
