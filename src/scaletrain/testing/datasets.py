"""Small datasets in the exact published file formats, for tests and smoke runs.

Written in the formats `scaletrain.data` reads (IDX for the MNIST family, Python 2
pickles for CIFAR), so test data takes the same path through the readers as the
real files do.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.data.datasets import CLASSES, IDX_FILES, canonical_name
from scaletrain.data.idx import IDX_TYPES
from scaletrain.errors import ConfigError

__all__ = ["write_cifar", "write_fake_mnist", "write_idx"]

_CIFAR_DIR = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_IDX_CODES: dict[str, int] = {
    np.dtype(t).newbyteorder("=").str[1:]: c for c, t in IDX_TYPES.items()
}


def write_idx(path: str | Path, array: np.ndarray | torch.Tensor) -> Path:
    """Write `array` as an IDX file; gzipped when `path` ends with .gz."""
    arr = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    key = arr.dtype.newbyteorder("=").str[1:]
    if key not in _IDX_CODES:
        raise ConfigError(
            f"write_idx: dtype {arr.dtype} has no IDX type code; expected one of "
            "uint8, int8, int16, int32, float32, float64"
        )
    if not 1 <= arr.ndim <= 255:
        raise ConfigError(f"write_idx: arrays must have 1..255 dimensions, received {arr.ndim}")
    code = _IDX_CODES[key]
    payload = (
        struct.pack(">BBBB", 0, 0, code, arr.ndim)
        + struct.pack(f">{arr.ndim}I", *arr.shape)
        + np.ascontiguousarray(arr, dtype=IDX_TYPES[code]).tobytes()
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)  # mtime=0: same bytes on every run
    path.write_bytes(payload)
    return path


# Writing: the originals were pickled by Python 2 with protocol 2, where
# bytes were `str` and went out as (SHORT_)BINSTRING, and numpy 1 named
# numpy.core.multiarray. Python 3's pickle cannot produce that (it wraps bytes
# in _codecs.encode), so the few opcodes are written directly: the test files
# then take the same path through the reader as the real ones.


def _p2_bytes(b: bytes) -> bytes:
    if len(b) < 256:
        return pickle.SHORT_BINSTRING + bytes([len(b)]) + b
    return pickle.BINSTRING + struct.pack("<i", len(b)) + b


def _p2_int(i: int) -> bytes:
    if 0 <= i < 256:
        return pickle.BININT1 + bytes([i])
    return pickle.BININT + struct.pack("<i", i)


def _p2(obj: Any) -> bytes:
    if isinstance(obj, bytes):
        return _p2_bytes(obj)
    if isinstance(obj, bool) or not isinstance(obj, int | list | dict | np.ndarray):
        raise TypeError(f"cannot write {type(obj).__name__} in the CIFAR pickle format")
    if isinstance(obj, int):
        return _p2_int(obj)
    if isinstance(obj, list):
        return pickle.EMPTY_LIST + pickle.MARK + b"".join(_p2(x) for x in obj) + pickle.APPENDS
    if isinstance(obj, dict):
        items = b"".join(_p2(k) + _p2(v) for k, v in obj.items())
        return pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS
    arr = np.ascontiguousarray(obj, dtype=np.uint8)
    dtype = (
        pickle.GLOBAL + b"numpy\ndtype\n"
        + _p2_bytes(b"u1") + _p2_int(0) + _p2_int(1) + pickle.TUPLE3 + pickle.REDUCE
        + pickle.MARK + _p2_int(3) + _p2_bytes(b"|") + pickle.NONE * 3
        + _p2_int(-1) + _p2_int(-1) + _p2_int(0) + pickle.TUPLE + pickle.BUILD
    )  # fmt: skip
    shape = pickle.MARK + b"".join(_p2_int(d) for d in arr.shape) + pickle.TUPLE
    return (
        pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n"
        + pickle.GLOBAL + b"numpy\nndarray\n"
        + _p2_int(0) + pickle.TUPLE1 + _p2_bytes(b"b") + pickle.TUPLE3 + pickle.REDUCE
        + pickle.MARK + _p2_int(1) + shape + dtype + pickle.NEWFALSE
        + _p2_bytes(arr.tobytes()) + pickle.TUPLE + pickle.BUILD
    )  # fmt: skip


def _dump_py2(obj: dict[bytes, Any], path: Path) -> None:
    path.write_bytes(pickle.PROTO + b"\x02" + _p2(obj) + pickle.STOP)


def _class_images(
    rng: np.random.Generator, labels: np.ndarray, templates: np.ndarray
) -> np.ndarray:
    """Class template (blocky, high contrast) plus noise: learnable in a few steps."""
    base = templates[labels].astype(np.float32) * 150.0 + 50.0
    noisy = base + rng.normal(0.0, 35.0, size=base.shape).astype(np.float32)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _templates(rng: np.random.Generator, classes: int, channels: int, size: int) -> np.ndarray:
    block = 4
    grid = rng.random((classes, channels, size // block, size // block)) > 0.5
    return grid.repeat(block, axis=2).repeat(block, axis=3)


def write_fake_mnist(
    directory: str | Path, n_train: int = 600, n_test: int = 100, seed: int = 0, gz: bool = True
) -> Path:
    """Write a small MNIST-format dataset (4 IDX files, 28 x 28, 10 classes) into `directory`.

    Each class is a fixed blocky pattern plus noise, so a small ConvNet learns
    it in a few steps; useful for tests and smoke runs without the real data.
    """
    out = Path(directory)
    rng = np.random.default_rng(seed)
    templates = _templates(rng, 10, 1, 28)[:, 0]
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images_name, labels_name = IDX_FILES[split]
        write_idx(out / (images_name + suffix), _class_images(rng, labels, templates))
        write_idx(out / (labels_name + suffix), labels)
    return out


def write_cifar(
    directory: str | Path,
    kind: str = "cifar10",
    n_train: int = 500,
    n_test: int = 100,
    seed: int = 0,
) -> Path:
    """Write a small dataset in the exact CIFAR-10/100 file format under `directory`.

    Creates `directory/cifar-10-batches-py` (data_batch_1..5, test_batch,
    batches.meta) or `directory/cifar-100-python` (train, test, meta) and
    returns that subdirectory.
    """
    kind = canonical_name(kind)
    if kind not in _CIFAR_DIR:
        raise ConfigError(f"write_cifar: kind must be 'cifar10' or 'cifar100', received {kind!r}")
    out = Path(directory) / _CIFAR_DIR[kind]
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    classes = 10 if kind == "cifar10" else 100
    templates = _templates(rng, classes, 3, 32)

    def entry(n: int, label: bytes) -> dict[bytes, Any]:
        labels = rng.integers(0, classes, size=n)
        d: dict[bytes, Any] = {b"batch_label": label}
        if kind == "cifar10":
            d[b"labels"] = labels.tolist()
        else:
            d[b"fine_labels"] = labels.tolist()
            d[b"coarse_labels"] = (labels // 5).tolist()
        d[b"data"] = _class_images(rng, labels, templates).reshape(n, 3072)
        d[b"filenames"] = [f"img_{i:05d}.png".encode() for i in range(n)]
        return d

    if kind == "cifar10":
        sizes = [len(part) for part in np.array_split(np.arange(n_train), 5)]
        for i, n in enumerate(sizes, start=1):
            _dump_py2(entry(n, f"training batch {i} of 5".encode()), out / f"data_batch_{i}")
        _dump_py2(entry(n_test, b"testing batch 1 of 1"), out / "test_batch")
        meta = {
            b"label_names": [c.encode() for c in CLASSES["cifar10"]],
            b"num_cases_per_batch": max(sizes),
            b"num_vis": 3072,
        }
        _dump_py2(meta, out / "batches.meta")
    else:
        _dump_py2(entry(n_train, b"training"), out / "train")
        _dump_py2(entry(n_test, b"testing"), out / "test")
        meta = {
            b"fine_label_names": [f"fine_{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse_{i}".encode() for i in range(20)],
        }
        _dump_py2(meta, out / "meta")
    return out


# ---------------------------------------------------------------------------
