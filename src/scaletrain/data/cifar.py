"""The CIFAR-10/100 file format: Python 2 pickles, read without running their code.

Every problem with a file (unreadable, truncated, foreign pickle, wrong keys or
shapes) is a DatasetError naming the dataset, the file and the fix.
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.errors import DatasetError, article

__all__ = ["read_cifar_batch", "unpickle"]


def _numpy_function(name: str, modules: tuple[str, ...]) -> Callable[..., Any]:
    # numpy 2 moved numpy.core to numpy._core (and warns on the old name);
    # the real CIFAR files, pickled by numpy 1, name numpy.core.multiarray.
    for module in modules:
        try:
            fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
            return fn
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"numpy's {name} not found in {modules}")


def _latin1_encode(obj: str, encoding: str = "utf-8") -> bytes:
    # Python 3 pickles bytes with protocol < 3 as _codecs.encode(str, "latin1").
    # Only that one use is let through, not the whole codec machinery.
    if encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return obj.encode("latin1")


class _Refused(pickle.UnpicklingError):
    """A pickle asked for something outside the allow-list."""


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that can build nothing but builtin containers, bytes and numpy arrays.

    Unpickling runs whatever callable the file names (a pickle can say
    "call os.system('...')"), so loading a downloaded pickle with plain
    `pickle.load` executes code from the internet. Every callable a pickle can
    reach goes through `find_class`; allowing only the numpy array
    reconstruction the CIFAR files use leaves such a file nothing to call.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) not in allowed:
            raise _Refused(
                f"refusing to load {module}.{name}: a CIFAR file holds only dicts, lists, "
                "bytes, ints and numpy arrays"
            )
        return allowed[(module, name)]


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Callable[..., Any]]:
    reconstruct = _numpy_function(
        "_reconstruct", ("numpy._core.multiarray", "numpy.core.multiarray")
    )
    # Pickle protocol 5 (a file re-saved by Python 3.8+) builds arrays from a buffer.
    frombuffer = _numpy_function("_frombuffer", ("numpy._core.numeric", "numpy.core.numeric"))
    return {
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy.core.numeric", "_frombuffer"): frombuffer,
        ("numpy._core.numeric", "_frombuffer"): frombuffer,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }


def unpickle(path: Path, dataset: str) -> dict[str, Any]:
    """A CIFAR pickle's dict, str keys; only arrays and builtin containers can be built."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{dataset}: cannot read {path}: {exc}") from exc
    try:
        # latin1 is the decoding numpy documents for Python 2 pickles: the
        # original files' str objects (keys, raw array bytes) come back as
        # str and numpy re-encodes its array data from latin1 losslessly.
        obj = _CifarUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except _Refused as exc:
        raise DatasetError(
            f"{dataset}: {path} was refused: {exc}. It is not a CIFAR file (or was "
            "tampered with); replace it with the file from the official CIFAR tarball."
        ) from exc
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
    ) as exc:
        raise DatasetError(
            f"{dataset}: {path} is truncated or corrupted ({type(exc).__name__}: {exc}); "
            "replace it with the file from the official CIFAR tarball."
        ) from exc
    if not isinstance(obj, dict):
        raise DatasetError(
            f"{dataset}: {path} holds {article(type(obj).__name__)}, expected a dict with keys "
            "'data' and labels; replace it with the file from the official CIFAR tarball."
        )
    # Keys are bytes when written by Python 3 with bytes keys, str when the
    # Python 2 originals are read with encoding="latin1": accept both.
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def read_cifar_batch(
    path: str | Path,
    *,
    label_key: str = "labels",
    num_classes: int | None = None,
    dataset: str = "cifar",
) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR pickle: (images uint8 N x 3 x 32 x 32, labels int64 N).

    `label_key` is "labels" for CIFAR-10 and "fine_labels" or "coarse_labels"
    for CIFAR-100.
    """
    path = Path(path)
    entry = unpickle(path, dataset)
    fix = "replace it with the file from the official CIFAR tarball"
    if "data" not in entry or label_key not in entry:
        raise DatasetError(
            f"{dataset}: {path} has keys {sorted(entry)}, expected 'data' and {label_key!r}; {fix}."
        )
    data = entry["data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
    ):
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise DatasetError(
            f"{dataset}: {path}: 'data' is {dtype} with shape {shape}, expected uint8 "
            f"N x 3072 (3 x 32 x 32); {fix}."
        )
    try:
        labels = np.asarray(entry[label_key], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DatasetError(
            f"{dataset}: {path}: {label_key!r} is not a list of ints; {fix}."
        ) from exc
    if labels.shape != (data.shape[0],):
        raise DatasetError(
            f"{dataset}: {path} has {data.shape[0]} images but {labels.size} {label_key!r}; "
            f"the counts must agree; {fix}."
        )
    if (
        num_classes is not None
        and labels.size
        and (labels.min() < 0 or labels.max() >= num_classes)
    ):
        raise DatasetError(
            f"{dataset}: {path}: labels range over [{labels.min()}, {labels.max()}], "
            f"expected [0, {num_classes - 1}]; {fix}."
        )
    return data.reshape(-1, 3, 32, 32), labels
