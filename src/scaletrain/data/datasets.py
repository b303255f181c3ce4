"""MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100: finding their files and loading them.

The files are read in their published formats, without torchvision: IDX
(optionally gzipped) for the MNIST family (data/idx.py), Python pickles for
CIFAR (data/cifar.py). Every problem a user can have with them (not found,
truncated, wrong file, foreign pickle) is a DatasetError that names the dataset,
the file or directories, what was expected and what to do.

Images are kept as one uint8 tensor and normalised per batch, so a DataLoader
batch is one tensor index instead of a Python loop over samples.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain.data.cifar import read_cifar_batch, unpickle
from scaletrain.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx_file
from scaletrain.errors import ConfigError, DatasetError, say

__all__ = [
    "CLASSES",
    "DATASETS",
    "IDX_FILES",
    "NORMALIZATION",
    "SPLITS",
    "ImageClassificationDataset",
    "canonical_name",
    "find_dataset_dir",
    "load_dataset",
]

DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist", "cifar10", "cifar100")
"""Names accepted by `load_dataset` and `find_dataset_dir`."""

SPLITS: tuple[str, ...] = ("train", "test")

NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
"""Per-channel (mean, std) of each training set, on pixel values scaled to [0, 1]."""

CLASSES: dict[str, tuple[str, ...]] = {
    "mnist": tuple(str(i) for i in range(10)),
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": (
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ),
    # CIFAR-100's 100 names are read from its `meta` file when present.
    "cifar100": tuple(str(i) for i in range(100)),
}
"""Class names by label, per dataset."""

_ALIASES = {
    "mnist": "mnist",
    "fashion-mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar-10": "cifar10",
    "cifar100": "cifar100",
    "cifar-100": "cifar100",
}

IDX_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
"""(images, labels) IDX file names of each split of the MNIST family (plain, or + ".gz")."""

_CIFAR_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "cifar10": {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
    "cifar100": {"train": ("train",), "test": ("test",)},
}
_CIFAR_LABEL_KEY = {"cifar10": "labels", "cifar100": "fine_labels"}

# Subdirectories of a data root where each dataset is commonly unpacked:
# torchvision's `<Class>/raw`, the tarballs' own directory names, plain names.
_SUBDIRS = {
    "mnist": ("MNIST/raw", "mnist", "mnist/raw", "MNIST"),
    "fashion-mnist": (
        "FashionMNIST/raw",
        "fashion-mnist",
        "fashion_mnist",
        "fashion-mnist/raw",
        "FashionMNIST",
    ),
    "cifar10": ("cifar-10-batches-py", "cifar10", "cifar10/cifar-10-batches-py"),
    "cifar100": ("cifar-100-python", "cifar100", "cifar100/cifar-100-python"),
}

_HOW_TO_GET = {
    "mnist": "download the four MNIST IDX files (plain or .gz) into it",
    "fashion-mnist": (
        "on Debian/Ubuntu `apt install dataset-fashion-mnist` (installs "
        "/usr/share/datasets/fashion-mnist), or download the four Fashion-MNIST IDX files "
        "(plain or .gz) into it"
    ),
    "cifar10": "extract cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) there",
    "cifar100": "extract cifar-100-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) there",
}

# Where distribution packages install datasets (Debian: dataset-fashion-mnist).
_SYSTEM_DATA_DIR = Path("/usr/share/datasets")


def canonical_name(name: str) -> str:
    """The dataset's name in DATASETS for any accepted spelling ("FashionMNIST", "cifar-10")."""
    key = name.strip().lower().replace("_", "-")
    if key not in _ALIASES:
        raise ConfigError(
            f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}"
            " (pass --dataset with one of these names)"
        )
    return _ALIASES[key]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


# ---------------------------------------------------------------------------
# Finding the files
# ---------------------------------------------------------------------------


def _required(name: str, split: str | None) -> list[tuple[str, ...]]:
    """Files needed, each as the alternatives that satisfy it (plain or .gz for IDX)."""
    splits = SPLITS if split is None else (split,)
    if name in ("mnist", "fashion-mnist"):
        return [(f, f + ".gz") for s in splits for f in IDX_FILES[s]]
    return [(f,) for s in splits for f in _CIFAR_FILES[name][s]]


def _candidates(name: str, root: str | Path | None) -> list[Path]:
    dirs: list[Path] = []
    if root is not None:
        # A directory the user named is the only place looked at: silently falling back
        # to another copy would train on data they did not ask for.
        base = Path(root).expanduser()
        return [base, *(base / s for s in _SUBDIRS[name])]
    # General data roots hold several datasets side by side. MNIST and
    # Fashion-MNIST use the same file names, so there only a subdirectory
    # named for the dataset may answer, never the root itself.
    general = [
        Path(p).expanduser() for p in os.environ.get("SCALETRAIN_DATA", "").split(os.pathsep) if p
    ]
    general.append(Path.cwd() / "data")
    for base in general:
        dirs += [base / s for s in _SUBDIRS[name]]
    # Directories named for the dataset can hold the files directly.
    specific: list[Path] = []
    try:
        specific.append(Path.home() / ".cache" / "scaletrain" / name)
    except RuntimeError:  # no home directory (some containers): skip that place
        pass
    specific.append(_SYSTEM_DATA_DIR / name)
    for base in specific:
        dirs += [base, *(base / s for s in _SUBDIRS[name])]
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _present(directory: Path, alternatives: tuple[str, ...]) -> Path | None:
    for f in alternatives:
        if (directory / f).is_file():
            return directory / f
    return None


def find_dataset_dir(
    name: str, root: str | Path | None = None, *, split: str | None = None
) -> Path:
    """Return the first directory that holds the files of dataset `name`.

    With `root`, only `root` and its dataset subdirectories (e.g.
    `root/FashionMNIST/raw`, torchvision's layout, or `root/cifar-10-batches-py`) are
    searched: a directory the user named that lacks the files is an error, never a
    reason to use another copy. Without it, in order: dataset subdirectories of each path in `$SCALETRAIN_DATA` and of
    `./data`, then `~/.cache/scaletrain/<name>` and `/usr/share/datasets/<name>`
    (where Debian's dataset-fashion-mnist installs). With `split`, only that
    split's files are required; otherwise all of them.
    """
    name = canonical_name(name)
    if split is not None:
        _check_split(split)
    required = _required(name, split)
    searched = _candidates(name, root)
    notes: list[str] = []
    for d in searched:
        if not d.is_dir():
            notes.append(str(d))
            continue
        missing = [alts for alts in required if _present(d, alts) is None]
        if not missing:
            return d
        notes.append(f"{d} (exists, lacks {', '.join(a[0] for a in missing)})")
    expected = ", ".join(" or ".join(alts) for alts in required)
    if root is not None:
        base = Path(root).expanduser()
        if not base.exists():
            what = "does not exist"
        elif not base.is_dir():
            what = "is not a directory"
        else:
            what = "does not hold them"
        given = say(api=f"root={str(root)!r}", cli=f"--data-dir {root}")
        raise DatasetError(
            f"{name}: {given}: the {split or 'train and test'} files {expected} are "
            f"expected there, and {base} {what}. Looked in: {'; '.join(notes)}. Fix: point "
            f"{say(api='root', cli='--data-dir')} at the directory holding these files, or "
            f"leave it out to search the usual places; to get them, {_HOW_TO_GET[name]}."
        )
    raise DatasetError(
        f"{name}: no directory holds the {split or 'train and test'} files. "
        f"Expected files: {expected}. Searched: {'; '.join(notes)}. "
        f"Fix: pass {say(api='root=', cli='--data-dir')} pointing at a directory with these files, or set "
        f"SCALETRAIN_DATA to a directory with a {_SUBDIRS[name][0]!r} subdirectory; "
        f"to get them, {_HOW_TO_GET[name]}."
    )


class ImageClassificationDataset(Dataset[tuple[torch.Tensor, int]]):
    """Images (uint8 N x C x H x W) and labels (int64 N), normalised on access.

    `ds[i]` is (float32 C x H x W, int). A DataLoader with automatic batching
    calls `__getitems__` with a whole batch of indices: that is one tensor
    index and one normalisation for the batch, and the result (a list of
    (x, y) pairs) is what the default collate turns into
    (x float32 B x C x H x W, y int64 B).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        classes: Sequence[str] | None = None,
        name: str = "images",
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ConfigError(
                f"{name}: images must be a uint8 N x C x H x W tensor, received "
                f"{images.dtype} with shape {tuple(images.shape)}"
            )
        if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
            raise ConfigError(
                f"{name}: labels must be 1-D with one label per image ({images.shape[0]}), "
                f"received shape {tuple(labels.shape)}"
            )
        c = images.shape[1]
        if len(mean) != c or len(std) != c or min(std) <= 0:
            raise ConfigError(
                f"{name}: mean and std need {c} values (one per channel, std > 0), "
                f"received mean={tuple(mean)}, std={tuple(std)}"
            )
        self.images = images.contiguous()
        self.labels = labels.to(torch.int64).contiguous()
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.name = name
        if classes is None:
            n_cls = int(self.labels.max()) + 1 if len(self.labels) else 0
            classes = tuple(str(i) for i in range(n_cls))
        self.classes = tuple(classes)
        if len(self.labels) and (
            int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)
        ):
            raise ConfigError(
                f"{name}: labels range over [{int(self.labels.min())}, {int(self.labels.max())}], "
                f"expected [0, {len(self.classes) - 1}] for {len(self.classes)} classes"
            )
        # (x / 255 - mean) / std as one multiply-add; the same expression for
        # single items and batches keeps them bitwise equal.
        std_t = torch.tensor(self.std, dtype=torch.float32).view(c, 1, 1)
        mean_t = torch.tensor(self.mean, dtype=torch.float32).view(c, 1, 1)
        self._scale = 1.0 / (255.0 * std_t)
        self._shift = -mean_t / std_t

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (..., C, H, W) -> float32 normalised with this dataset's mean/std."""
        return images.to(torch.float32).mul_(self._scale).add_(self._shift)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.normalize(self.images[index]), int(self.labels[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        # torch's _MapDatasetFetcher passes a batch's indices here and hands the
        # result to collate_fn, which expects a list of samples.
        idx = torch.as_tensor(indices, dtype=torch.int64)
        x = self.normalize(self.images[idx])
        return list(zip(x.unbind(0), self.labels[idx].tolist(), strict=True))

    def __repr__(self) -> str:
        n, c, h, w = self.images.shape
        return f"ImageClassificationDataset({self.name!r}, n={n}, shape=({c}, {h}, {w}), classes={self.num_classes})"


def _load_idx_pair(name: str, directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = IDX_FILES[split]
    paths = []
    for f in (images_name, labels_name):
        p = _present(directory, (f, f + ".gz"))
        if p is None:  # found a moment ago; removed since (e.g. a concurrent cleanup)
            raise DatasetError(f"{name}: {directory} lacks {f} (or {f}.gz)")
        paths.append(p)
    images = read_idx_file(paths[0], magic=IDX_IMAGES_MAGIC, dataset=name)
    labels = read_idx_file(paths[1], magic=IDX_LABELS_MAGIC, dataset=name)
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"{name}: {paths[0]} holds {images.shape[0]} images but {paths[1]} holds "
            f"{labels.shape[0]} labels; the files come from different sets or one is "
            "damaged; replace them with fresh copies."
        )
    if labels.size and labels.max() >= 10:
        raise DatasetError(
            f"{name}: {paths[1]} has labels up to {labels.max()}, expected 0..9; "
            "replace it with a fresh copy."
        )
    return images[:, None], labels.astype(np.int64)


def _cifar100_classes(directory: Path) -> tuple[str, ...]:
    meta = directory / "meta"
    if meta.is_file():
        names = unpickle(meta, "cifar100").get("fine_label_names")
        if isinstance(names, list) and len(names) == 100:
            return tuple(n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names)
    return CLASSES["cifar100"]


def load_dataset(
    name: str, root: str | Path | None = None, split: str = "train"
) -> ImageClassificationDataset:
    """Load "mnist", "fashion-mnist", "cifar10" or "cifar100" (`split` "train" or "test").

    Files are found with `find_dataset_dir(name, root, split=split)`. CIFAR-100
    uses the 100 fine labels.
    """
    name = canonical_name(name)
    _check_split(split)
    directory = find_dataset_dir(name, root, split=split)
    classes = CLASSES[name]
    if name in ("mnist", "fashion-mnist"):
        images, labels = _load_idx_pair(name, directory, split)
    else:
        parts = [
            read_cifar_batch(
                directory / f,
                label_key=_CIFAR_LABEL_KEY[name],
                num_classes=len(classes),
                dataset=name,
            )
            for f in _CIFAR_FILES[name][split]
        ]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        if name == "cifar100":
            classes = _cifar100_classes(directory)
    mean, std = NORMALIZATION[name]
    return ImageClassificationDataset(
        torch.from_numpy(np.ascontiguousarray(images)),
        torch.from_numpy(labels),
        mean=mean,
        std=std,
        classes=classes,
        name=f"{name}/{split}",
    )
