"""Dataset readers: IDX and CIFAR formats, finding files, every error a user can meet."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from scaletrain.data import (
    DATASETS,
    NORMALIZATION,
    ImageClassificationDataset,
    find_dataset_dir,
    load_dataset,
    read_cifar_batch,
    read_idx,
)
from scaletrain.data import datasets as datasets_mod
from scaletrain.errors import ConfigError, DatasetError
from scaletrain.testing import write_cifar, write_fake_mnist, write_idx

REAL_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _isolated_search_path(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Keep the user's data directories out of the search: only what a test gives is found."""
    empty = tmp_path_factory.mktemp("nowhere")
    monkeypatch.delenv("SCALETRAIN_DATA", raising=False)
    monkeypatch.chdir(empty)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: empty / "home"))
    monkeypatch.setattr(datasets_mod, "_SYSTEM_DATA_DIR", empty / "usr-share-datasets")
    return empty


# -- IDX ------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (np.uint8, (5, 28, 28)),
        (np.uint8, (7,)),
        (np.int8, (3, 2)),
        (np.int16, (4, 3)),
        (np.int32, (2, 2, 2, 2)),
        (np.float32, (6,)),
        (np.float64, (0, 3)),
    ],
)
def test_idx_round_trip(tmp_path: Path, suffix: str, dtype: type, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.random(shape) * 100 - 50).astype(dtype)
    path = write_idx(tmp_path / f"a-idx{suffix}", arr)
    back = read_idx(path)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)
    assert back.flags.writeable
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")


def test_idx_header_is_big_endian_mnist_layout(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x", np.zeros((60000, 28, 28), np.uint8)[:3])
    assert path.read_bytes()[:16] == bytes.fromhex("00000803 00000003 0000001c 0000001c")


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    arr = np.arange(10, dtype=np.uint8)
    gz = write_idx(tmp_path / "labels.gz", arr)
    renamed = tmp_path / "labels-without-suffix"
    renamed.write_bytes(gz.read_bytes())
    np.testing.assert_array_equal(read_idx(renamed), arr)


# -- MNIST family -----------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_fake_mnist_loads(tmp_path: Path, name: str, gz: bool) -> None:
    write_fake_mnist(tmp_path, n_train=50, n_test=20, seed=1, gz=gz)
    train = load_dataset(name, tmp_path, split="train")
    test = load_dataset(name, tmp_path, split="test")
    assert len(train) == 50 and len(test) == 20
    assert train.images.shape == (50, 1, 28, 28) and train.images.dtype == torch.uint8
    assert train.labels.dtype == torch.int64 and train.num_classes == 10
    assert (train.mean, train.std) == NORMALIZATION[name]
    x, y = train[3]
    assert x.dtype == torch.float32 and x.shape == (1, 28, 28) and isinstance(y, int)
    expected = (train.images[3].float() / 255 - train.mean[0]) / train.std[0]
    torch.testing.assert_close(x, expected)


def test_getitems_batch_equals_items_and_default_collate(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=64, n_test=8)
    ds = load_dataset("mnist", tmp_path)
    idx = [5, 0, 63, 17, 17]
    batch = ds.__getitems__(idx)
    for (xb, yb), i in zip(batch, idx, strict=True):
        x, y = ds[i]
        assert torch.equal(xb, x) and yb == y  # bitwise: same expression
    x, y = next(iter(DataLoader(ds, batch_size=16)))
    assert x.dtype == torch.float32 and x.shape == (16, 1, 28, 28)
    assert y.dtype == torch.int64 and y.shape == (16,)
    assert torch.equal(x, torch.stack([ds[i][0] for i in range(16)]))


def test_fake_mnist_is_learnable(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=500, n_test=100, seed=0)
    train, test = load_dataset("mnist", tmp_path), load_dataset("mnist", tmp_path, "test")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 7 * 7, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(train, batch_size=50, shuffle=True)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    x, y = next(iter(DataLoader(test, batch_size=100)))
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.9


def test_torchvision_layout_is_found(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path / "FashionMNIST" / "raw", n_train=10, n_test=5)
    write_fake_mnist(tmp_path / "MNIST" / "raw", n_train=12, n_test=5, gz=False)
    assert find_dataset_dir("fashion-mnist", tmp_path) == tmp_path / "FashionMNIST" / "raw"
    assert find_dataset_dir("FashionMNIST", tmp_path) == tmp_path / "FashionMNIST" / "raw"
    assert len(load_dataset("fashion_mnist", tmp_path)) == 10
    assert len(load_dataset("MNIST", tmp_path)) == 12


def test_usual_places_are_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_search_path: Path
) -> None:
    # $SCALETRAIN_DATA: only dataset-named subdirectories (MNIST and Fashion-MNIST
    # share file names, so the root itself must not answer for either).
    write_fake_mnist(tmp_path / "env" / "fashion-mnist", n_train=4, n_test=2)
    write_fake_mnist(tmp_path / "env", n_train=4, n_test=2)
    monkeypatch.setenv("SCALETRAIN_DATA", str(tmp_path / "env"))
    assert find_dataset_dir("fashion-mnist") == tmp_path / "env" / "fashion-mnist"
    with pytest.raises(DatasetError):
        find_dataset_dir("mnist")
    monkeypatch.delenv("SCALETRAIN_DATA")
    # ./data
    write_fake_mnist(_isolated_search_path / "data" / "MNIST" / "raw", n_train=4, n_test=2)
    assert find_dataset_dir("mnist") == _isolated_search_path / "data" / "MNIST" / "raw"
    # ~/.cache/scaletrain/<name> and the system directory hold files directly
    write_cifar(_isolated_search_path / "home" / ".cache" / "scaletrain" / "cifar10", n_train=5)
    write_fake_mnist(_isolated_search_path / "usr-share-datasets" / "fashion-mnist", 4, 2)
    home = _isolated_search_path / "home" / ".cache" / "scaletrain" / "cifar10"
    assert find_dataset_dir("cifar10") == home / "cifar-10-batches-py"
    assert find_dataset_dir("fashion-mnist") == (
        _isolated_search_path / "usr-share-datasets" / "fashion-mnist"
    )


def test_split_only_needs_its_files(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=4, n_test=2)
    (tmp_path / "train-images-idx3-ubyte.gz").unlink()
    assert find_dataset_dir("mnist", tmp_path, split="test") == tmp_path
    assert len(load_dataset("mnist", tmp_path, "test")) == 2
    with pytest.raises(DatasetError, match="lacks train-images-idx3-ubyte"):
        load_dataset("mnist", tmp_path, "train")


@pytest.mark.skipif(not REAL_FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets_mod, "_SYSTEM_DATA_DIR", REAL_FASHION.parent)
    assert find_dataset_dir("fashion-mnist") == REAL_FASHION
    train = load_dataset("fashion-mnist")
    test = load_dataset("fashion-mnist", split="test")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    pixels = train.images.float() / 255
    assert abs(pixels.mean().item() - 0.2860) < 1e-3 and abs(pixels.std().item() - 0.3530) < 1e-3


# -- CIFAR ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_cifar_round_trip(tmp_path: Path, kind: str) -> None:
    out = write_cifar(tmp_path, kind, n_train=23, n_test=7, seed=2)
    assert out.name == {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}[kind]
    train, test = load_dataset(kind, tmp_path), load_dataset(kind, tmp_path, "test")
    assert len(train) == 23 and len(test) == 7
    assert train.images.shape == (23, 3, 32, 32) and train.num_classes == (
        10 if kind == "cifar10" else 100
    )
    # Same content as the files read the way the CIFAR page shows (encoding="bytes").
    files = ["data_batch_1", "data_batch_2"] if kind == "cifar10" else ["train"]
    label_key = b"labels" if kind == "cifar10" else b"fine_labels"
    parts = []
    for f in files:
        with open(out / f, "rb") as fh:
            d = pickle.load(fh, encoding="bytes")  # our own file: safe
        assert d[b"data"].dtype == np.uint8 and d[b"data"].shape[1] == 3072
        if kind == "cifar100":
            assert len(d[b"coarse_labels"]) == len(d[b"fine_labels"])
        parts.append(d)
    data = np.concatenate([d[b"data"] for d in parts])
    labels = [y for d in parts for y in d[label_key]]
    n = len(data)
    assert torch.equal(train.images[:n], torch.from_numpy(data).view(n, 3, 32, 32))
    assert train.labels[:n].tolist() == labels
    # Row-major channel planes: the first 1024 bytes are the red 32 x 32 image.
    assert torch.equal(train.images[0, 0].flatten(), torch.from_numpy(data[0, :1024]))
    # Files look like the Python 2 originals: protocol 2, numpy.core, no _codecs.
    raw = (out / files[0]).read_bytes()
    assert raw[:2] == b"\x80\x02" and b"numpy.core.multiarray" in raw and b"_codecs" not in raw
    if kind == "cifar100":
        assert train.classes[:2] == ("fine_0", "fine_1")


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_resaved_by_python3_loads(tmp_path: Path, protocol: int) -> None:
    rng = np.random.default_rng(0)
    entry = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 9]}
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(entry, protocol=protocol))
    images, labels = read_cifar_batch(path, num_classes=10)
    np.testing.assert_array_equal(images.reshape(4, 3072), entry[b"data"])
    assert labels.tolist() == [0, 1, 2, 9]


def test_cifar_dir_given_directly(tmp_path: Path) -> None:
    out = write_cifar(tmp_path, "cifar10", n_train=5, n_test=2)
    assert find_dataset_dir("cifar-10", out) == out
    assert find_dataset_dir("cifar10", tmp_path) == out


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    out = write_cifar(tmp_path, "cifar10", n_train=5, n_test=2)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2)
    assert b"system" in payload
    (out / "data_batch_3").write_bytes(payload)
    monkeypatch.setattr(os, "system", lambda cmd: calls.append(cmd) or 0)
    with pytest.raises(DatasetError, match=r"refusing to load (posix|os|nt)\.system"):
        load_dataset("cifar10", tmp_path)
    assert not marker.exists() and calls == []


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps({b"data": eval}, protocol=2),  # builtins.eval
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x04\x00\x00\x00rot13\x86R.",
        b"\x80\x02cnumpy\nload\nX\x01\x00\x00\x00x\x85R.",
    ],
    ids=["builtins-eval", "codecs-other-encoding", "numpy-load"],
)
def test_other_globals_are_refused(tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / "batch"
    path.write_bytes(payload)
    with pytest.raises(DatasetError, match="refused"):
        read_cifar_batch(path)


# -- errors -----------------------------------------------------------------------


def test_missing_files_error_names_everything(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as err:
        find_dataset_dir("fashion-mnist", tmp_path / "given")
    msg = str(err.value)
    assert msg.startswith("fashion-mnist:")
    for f in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert f"{f} or {f}.gz" in msg
    assert (
        str(tmp_path / "given") in msg and str(tmp_path / "given" / "FashionMNIST" / "raw") in msg
    )
    # A directory the user named is the only place looked at (no fallback to another copy).
    assert "does not exist" in msg and "Looked in: " in msg
    assert "/usr/share/datasets/fashion-mnist;" not in msg.split("Fix:")[0]
    assert "root=" in msg and "dataset-fashion-mnist" in msg
    assert isinstance(err.value, FileNotFoundError)


def test_missing_files_without_a_directory_names_the_search_path(
    _isolated_search_path: Path,
) -> None:
    with pytest.raises(DatasetError) as err:
        find_dataset_dir("mnist")
    msg = str(err.value)
    assert msg.startswith("mnist:") and "SCALETRAIN_DATA" in msg and "root=" in msg


def test_a_named_directory_never_falls_back_to_another_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A good copy where the search would find it, and an empty directory the user named.
    write_fake_mnist(tmp_path / "env" / "fashion-mnist", n_train=10, n_test=2)
    monkeypatch.setenv("SCALETRAIN_DATA", str(tmp_path / "env"))
    assert find_dataset_dir("fashion-mnist") == tmp_path / "env" / "fashion-mnist"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="does not hold them"):
        find_dataset_dir("fashion-mnist", tmp_path / "empty")


def test_partial_directory_error_says_what_lacks(tmp_path: Path) -> None:
    out = write_cifar(tmp_path, "cifar10", n_train=5, n_test=2)
    (out / "data_batch_4").unlink()
    with pytest.raises(DatasetError, match=r"cifar-10-batches-py \(exists, lacks data_batch_4\)"):
        load_dataset("cifar10", tmp_path)
    assert len(load_dataset("cifar10", tmp_path, "test")) == 2


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_idx(tmp_path: Path, gz: bool) -> None:
    write_fake_mnist(tmp_path, n_train=10, n_test=2, gz=gz)
    name = "train-images-idx3-ubyte" + (".gz" if gz else "")
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:-100])
    match = "truncated/corrupted gzip" if gz else r"truncated: the header says shape \(10, 28, 28\)"
    with pytest.raises(DatasetError, match=match):
        load_dataset("mnist", tmp_path)


def test_idx_shorter_than_header(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"\x00\x00\x08\x03\x00\x00")
    with pytest.raises(DatasetError, match="shorter than its 16-byte IDX header"):
        read_idx(tmp_path / "x")
    (tmp_path / "y").write_bytes(b"\x00")
    with pytest.raises(DatasetError, match="shorter than the 4-byte IDX magic"):
        read_idx(tmp_path / "y")


def test_idx_trailing_bytes(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x", np.zeros(4, np.uint8))
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(DatasetError, match="longer than its header says"):
        read_idx(path)


def test_wrong_magic(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=10, n_test=2, gz=False)
    images, labels = tmp_path / "train-images-idx3-ubyte", tmp_path / "train-labels-idx1-ubyte"
    swapped = images.read_bytes()
    images.write_bytes(labels.read_bytes())
    labels.write_bytes(swapped)
    with pytest.raises(DatasetError, match=r"magic 0x00000801 \(labels.*expected 0x00000803"):
        load_dataset("mnist", tmp_path)
    images.write_bytes(b"PK\x03\x04" + b"\x00" * 100)  # e.g. a zip saved under the name
    with pytest.raises(
        DatasetError, match=r"not an IDX file: magic 0x504B0304, expected 0x00000803"
    ):
        load_dataset("mnist", tmp_path)


def test_count_mismatch(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=10, n_test=2)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(9, np.uint8))
    with pytest.raises(DatasetError, match=r"holds 10 images but .* holds 9 labels"):
        load_dataset("fashion-mnist", tmp_path)


def test_label_out_of_range(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, n_train=3, n_test=2)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([0, 1, 12], np.uint8))
    with pytest.raises(DatasetError, match=r"labels up to 12, expected 0\.\.9"):
        load_dataset("mnist", tmp_path)


def test_bad_cifar_contents(tmp_path: Path) -> None:
    out = write_cifar(tmp_path, "cifar10", n_train=5, n_test=2)
    test_batch = out / "test_batch"
    good = test_batch.read_bytes()
    test_batch.write_bytes(good[: len(good) // 2])
    with pytest.raises(DatasetError, match="truncated or corrupted"):
        load_dataset("cifar10", tmp_path, "test")
    test_batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}, protocol=2))
    with pytest.raises(DatasetError, match=r"has keys \['data'\], expected 'data' and 'labels'"):
        load_dataset("cifar10", tmp_path, "test")
    bad = {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}
    test_batch.write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(DatasetError, match=r"expected uint8 N x 3072"):
        load_dataset("cifar10", tmp_path, "test")
    bad = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]}
    test_batch.write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(DatasetError, match="2 images but 3 'labels'"):
        load_dataset("cifar10", tmp_path, "test")
    bad = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}
    test_batch.write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(DatasetError, match=r"labels range over \[0, 10\], expected \[0, 9\]"):
        load_dataset("cifar10", tmp_path, "test")
    test_batch.write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(DatasetError, match="holds a list, expected a dict"):
        load_dataset("cifar10", tmp_path, "test")


def test_unknown_name_and_split() -> None:
    with pytest.raises(ConfigError) as err:
        load_dataset("imagenet")
    assert all(n in str(err.value) for n in DATASETS)
    with pytest.raises(ConfigError, match="unknown split 'val'; expected one of train, test"):
        load_dataset("mnist", split="val")


def test_dataset_validates_inputs() -> None:
    images = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="uint8 N x C x H x W"):
        ImageClassificationDataset(images.float(), torch.zeros(4), mean=[0], std=[1])
    with pytest.raises(ConfigError, match="one label per image"):
        ImageClassificationDataset(images, torch.zeros(3), mean=[0], std=[1])
    with pytest.raises(ConfigError, match="mean and std need 1 values"):
        ImageClassificationDataset(images, torch.zeros(4), mean=[0, 0], std=[1, 1])
    with pytest.raises(ConfigError, match=r"expected \[0, 1\] for 2 classes"):
        ImageClassificationDataset(
            images, torch.tensor([0, 1, 2, 0]), mean=[0], std=[1], classes=["a", "b"]
        )


def test_gzip_helper_matches_stdlib(tmp_path: Path) -> None:
    # write_idx's gzip is ordinary gzip (readable by zcat / torchvision).
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    path = write_idx(tmp_path / "a.gz", arr)
    plain = write_idx(tmp_path / "a", arr)
    assert gzip.decompress(path.read_bytes()) == plain.read_bytes()


def test_the_python_corpus_reads_every_py_file_and_never_walks_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The corpus root is the standard library by default, whose site-packages holds the
    interpreter's installed packages, often most of its tree: they are not the corpus,
    and walking them only to drop their files afterwards slowed the start of every
    process of a gpt, llama or Hugging Face run."""
    from scaletrain.data.text import load_python_corpus

    for name, text in {
        "a.py": "a = 1\n",
        "pkg/b.py": "b = 2\n",
        "pkg/readme.txt": "not python\n",
        "site-packages/c.py": "c = 3\n",
        "pkg/site-packages/deep/d.py": "d = 4\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    scanned: list[str] = []
    scandir = os.scandir

    def recording(path: Any = ".") -> Any:
        scanned.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", recording)
    train = load_python_corpus("train", block_size=2, root=tmp_path, test_fraction=0.5)
    test = load_python_corpus("test", block_size=2, root=tmp_path, test_fraction=0.5)
    monkeypatch.undo()
    # Two files, a.py and pkg/b.py (sorted; every second one tests): nothing else.
    assert bytes(train.tokens.tolist()) == b"a = 1\n"
    assert bytes(test.tokens.tolist()) == b"b = 2\n"
    assert scanned and not [p for p in scanned if "site-packages" in Path(p).parts]
    with pytest.raises(DatasetError, match="no .py files under"):
        load_python_corpus("train", root=tmp_path / "site-packages", block_size=1)
