"""The IDX file format of the MNIST family: read, checked, plain or gzipped.

Every problem with a file (unreadable, truncated, not IDX, images and labels
swapped) is a DatasetError naming the dataset, the file and the fix.

A large gzipped file is decompressed once and kept, decompressed, in scaletrain's
cache directory (idx/, see cachedir.py): decompressing is paid at every start of
every rank, reading the kept copy is a plain file read. The copy is named after the source's
path, size and modification time, so a changed source is decompressed afresh, and
it is used only when its length is the one the gzip trailer records. Nothing is
written next to the user's data, and the cache is only ever a copy: where it
cannot be written, the file is decompressed as before.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from scaletrain.cachedir import cache_dir
from scaletrain.errors import DatasetError

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "IDX_TYPES", "read_idx", "read_idx_file"]

# IDX type codes (third magic byte) -> big-endian numpy dtype.
IDX_TYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
IDX_IMAGES_MAGIC = 0x00000803  # uint8, 3 dimensions (N, rows, cols)
IDX_LABELS_MAGIC = 0x00000801  # uint8, 1 dimension (N,)


CACHE_MIN_BYTES = 4 << 20
"""Gzipped files that decompress to fewer bytes are not kept: they decompress in
milliseconds (MNIST's labels, test sets of tests)."""


def _kept_copy(path: Path, f: BinaryIO) -> tuple[Path | None, int]:
    """Where the decompressed copy of gzipped `path` (open as `f`) is kept (None: too
    small to keep), and the length its gzip trailer records (ISIZE: modulo 2**32)."""
    st = os.fstat(f.fileno())
    if st.st_size < 18:  # shorter than gzip's header and trailer: decompressing says why
        return None, 0
    f.seek(-4, os.SEEK_END)
    size = int.from_bytes(f.read(4), "little")
    if size < CACHE_MIN_BYTES:
        return None, size
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return cache_dir() / "idx" / f"{name}-{digest}", size


def _decompressed(path: Path, f: BinaryIO) -> bytes:
    """The contents of gzipped `path`: its kept copy when there is a good one (the
    compressed file is then not read at all), else decompressed, and kept if large."""
    kept, size = _kept_copy(path, f)
    if kept is not None:
        with contextlib.suppress(OSError):
            if kept.stat().st_size % (1 << 32) == size:
                return kept.read_bytes()
    f.seek(0)
    raw = gzip.decompress(f.read())
    if kept is not None and len(raw) % (1 << 32) == size:
        # Written whole, then renamed: a reader (another rank) sees all or nothing.
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=kept.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(raw)
                os.replace(tmp, kept)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return raw


def _read_bytes(path: Path, dataset: str) -> bytes:
    try:
        with path.open("rb") as f:
            # Decide by content, not by name: a gzipped file saved without .gz
            # (or the reverse) is common after manual downloads. IDX data starts
            # with two zero bytes, gzip with 1f 8b, so the two cannot be confused.
            if f.read(2) == b"\x1f\x8b":
                raw = _decompressed(path, f)
            else:
                f.seek(0)
                raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(
            f"{dataset}: cannot read {path}: {exc}. The file is missing, unreadable or a "
            "truncated/corrupted gzip; replace it with a fresh copy."
        ) from exc
    return raw


def read_idx_file(path: Path, *, magic: int | None, dataset: str) -> np.ndarray:
    """The array in `path`, checked against `magic` (None: any IDX array) and its header."""
    raw = _read_bytes(path, dataset)
    fix = "replace it with a fresh copy of the file"
    if len(raw) < 4:
        raise DatasetError(
            f"{dataset}: {path} is truncated: {len(raw)} bytes, shorter than the 4-byte IDX "
            f"magic; {fix}."
        )
    (got,) = struct.unpack(">I", raw[:4])
    code, ndim = raw[2], raw[3]
    if raw[0] != 0 or raw[1] != 0 or code not in IDX_TYPES or ndim == 0:
        want = f"0x{magic:08X}" if magic is not None else "0x0000TTDD (TT a type code, DD dims)"
        raise DatasetError(
            f"{dataset}: {path} is not an IDX file: magic 0x{got:08X}, expected {want}; {fix}."
        )
    if magic is not None and got != magic:
        kinds = {IDX_IMAGES_MAGIC: "images (uint8, 3-D)", IDX_LABELS_MAGIC: "labels (uint8, 1-D)"}
        raise DatasetError(
            f"{dataset}: {path} has IDX magic 0x{got:08X} ({kinds.get(got, 'another IDX array')}), "
            f"expected 0x{magic:08X} ({kinds.get(magic, '')}); the file is mislabelled or "
            f"swapped; {fix}."
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(
            f"{dataset}: {path} is truncated: {len(raw)} bytes, shorter than its {header}-byte "
            f"IDX header; {fix}."
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(IDX_TYPES[code])
    count = int(np.prod(dims, dtype=np.int64))
    expected = header + count * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise DatasetError(
            f"{dataset}: {path} is {what}: the header says shape {tuple(dims)} of {dtype.name} "
            f"= {expected} bytes with the header, the file has {len(raw)}; {fix}."
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(dims)
    # One copy, to native byte order and into writable memory (torch warns
    # about, and must not write into, the read-only buffer of `raw`).
    return np.array(data, dtype=dtype.newbyteorder("="))


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (plain or gzipped) into a native-endian numpy array."""
    return read_idx_file(Path(path), magic=None, dataset="IDX")
