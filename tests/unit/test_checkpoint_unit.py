"""Checkpoints in one process (world size 1, no process group).

Resume is bit-for-bit: after load, the losses, weights, batches and random
numbers of the resumed run equal the uninterrupted run's exactly (torch.equal,
==), because the same float32 operations run in the same order on the same
values. Every way a checkpoint can be bad raises CheckpointError and changes
nothing; nothing in a checkpoint file can run code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.checkpoint import (
    MANIFEST,
    PendingCheckpoint,
    checkpoint_path,
    consolidate,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    wait_pending,
)
from scaletrain.checkpoint.manifest import sha256_file
from scaletrain.checkpoint.state import loader_resume_state
from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.testing import launcher_variables
from scaletrain.train.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
N_SAMPLES = 40
BATCH = 8  # 5 batches per epoch: 8 steps cross an epoch boundary
STEPS = 8
SAVE_AT = 3


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Iterator[st.Runtime]:
    for var in launcher_variables():
        monkeypatch.delenv(var)
    runtime = st.init()
    assert runtime.world_size == 1
    yield runtime
    wait_pending()
    runtime.shutdown()


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randint(0, CONFIG.vocab_size, (N_SAMPLES, CONFIG.block_size), generator=g)
    )


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


class _Run:
    """Everything a training run holds, built fresh (as a restarted process would)."""

    def __init__(self, rt: st.Runtime, make_opt: Callable[[nn.Module], torch.optim.Optimizer]):
        torch.manual_seed(1)
        self.model = GPT(CONFIG)
        self.opt = make_opt(self.model)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.7)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        self.loader = rt.loader(_data(), batch_size=BATCH, shuffle=True, seed=7)
        self.batches = self._forever()

    def _forever(self) -> Iterator[torch.Tensor]:
        while True:
            for (batch,) in self.loader:
                yield batch

    def step(self) -> dict[str, Any]:
        idx = next(self.batches)
        # Random numbers from every generator a training step may use: python
        # (e.g. augmentation choices), numpy, torch (dropout inside the model).
        shift = random.randrange(CONFIG.vocab_size)
        noise = float(np.random.rand())
        logits = self.model((idx + shift) % CONFIG.vocab_size)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, CONFIG.vocab_size), idx[:, 1:].reshape(-1)
        ) * (1.0 + 1e-3 * noise)
        self.opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        return {"loss": loss.item(), "batch": idx.clone(), "shift": shift, "noise": noise}

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "scaler": self.scaler,
            "loader": self.loader,
        }


def _scramble_rng() -> None:
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)


@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "dcp"])
def test_resume_is_bit_for_bit(
    rt: st.Runtime,
    tmp_path: Path,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    sharded: bool,
) -> None:
    random.seed(0)
    np.random.seed(0)
    a = _Run(rt, make_opt)
    uninterrupted = []
    ckpt = checkpoint_path(tmp_path, SAVE_AT)
    for step in range(STEPS):
        if step == SAVE_AT:
            save_checkpoint(rt, ckpt, sharded=sharded, **a.state(), step=step, epoch=a.loader.epoch)
        uninterrupted.append(a.step())
    after = (random.random(), float(np.random.rand()), torch.rand(3))

    # A new process: fresh objects, other random states, then load.
    _scramble_rng()
    b = _Run(rt, make_opt)
    _scramble_rng()
    values = load_checkpoint(rt, ckpt, **b.state())
    assert values == {"step": SAVE_AT, "epoch": 0}
    resumed = [b.step() for _ in range(SAVE_AT, STEPS)]
    for got, want in zip(resumed, uninterrupted[SAVE_AT:], strict=True):
        assert torch.equal(got["batch"], want["batch"])  # the next batches
        assert (got["shift"], got["noise"]) == (want["shift"], want["noise"])
        assert got["loss"] == want["loss"]  # bitwise: dropout masks equal too
    for (name, x), y in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
    assert b.loader.epoch == a.loader.epoch == 1
    assert b.sched.state_dict() == a.sched.state_dict()
    assert b.scaler.state_dict() == a.scaler.state_dict()
    assert b.scaler.get_scale() > 2.0**10  # it grew, and the growth was restored
    a_state, b_state = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    for i in a_state:
        for key, value in a_state[i].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b_state[i][key]))
    assert (random.random(), float(np.random.rand())) == after[:2]
    assert torch.equal(torch.rand(3), after[2])


def test_layout_and_manifest(rt: st.Runtime, tmp_path: Path) -> None:
    run = _Run(rt, _adamw)
    ckpt = save_checkpoint(rt, checkpoint_path(tmp_path, 120), **run.state(), step=120)
    assert ckpt == tmp_path / "checkpoints" / "step-000120"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == sorted(
        [
            "loaders-rank0.json",
            MANIFEST,
            "model.pt",
            "optimizer.pt",
            "rng-rank0.pt",
            "scaler.pt",
            "scheduler.pt",
            "values.json",
        ]
    )
    manifest = read_manifest(ckpt)
    assert (manifest.kind, manifest.world_size, manifest.step) == ("full", 1, 120)
    assert set(manifest.files) == set(files) - {MANIFEST}
    for name, entry in manifest.files.items():
        assert sha256_file(ckpt / name) == entry
    model = manifest.objects["model"]
    assert model["class"] == "GPT" and len(model["fingerprint"]) == 64
    assert model["table"]["head.weight"] == [[16, 32], "float32"]
    # Optimizer state is keyed by parameter name, never by position.
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert "param_groups.head.weight.lr" in optim
    assert not any(k.startswith("state.0.") for k in optim)


def test_crash_during_save_keeps_previous(
    rt: st.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _Run(rt, _sgd)
    first = save_checkpoint(rt, checkpoint_path(tmp_path, 1), **run.state(), step=1)
    run.step()
    real_save = torch.save

    def dies_halfway(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and "head.weight" in obj:  # the model file
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            raise OSError("No space left on device (simulated)")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_halfway)
    second = checkpoint_path(tmp_path, 2)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(rt, second, **run.state(), step=2)
    monkeypatch.setattr(torch, "save", real_save)

    assert not (second / MANIFEST).exists()
    assert not list(second.glob(".*tmp*")), "the half-written temporary file was left"
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(rt, second, model=run.model)
    fresh = _Run(rt, _sgd)
    assert load_checkpoint(rt, first, **fresh.state()) == {"step": 1}


_HARD_CRASH = """
import os, sys, torch
import scaletrain as st
from scaletrain.checkpoint import save_checkpoint
rt = st.init()
model = torch.nn.Linear(4, 4)
save_checkpoint(rt, sys.argv[1], model=model, step=1)
real = torch.save
def killed(obj, f, *a, **k):
    if not (isinstance(obj, dict) and "weight" in obj):  # not the model file
        return real(obj, f, *a, **k)
    f.write(b"PK\\x03\\x04 half a zip")
    os._exit(9)  # no cleanup, no finally: the process is gone
torch.save = killed
save_checkpoint(rt, sys.argv[2], model=model, step=2)
"""


def test_killed_process_leaves_previous_checkpoint_loadable(rt: st.Runtime, tmp_path: Path) -> None:
    first, second = tmp_path / "checkpoints" / "a", tmp_path / "checkpoints" / "b"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-c", _HARD_CRASH, str(first), str(second)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr.decode()
    assert [p.name[:10] for p in second.glob(".*.tmp-*")] == [".model.pt."], (
        "expected the half file"
    )
    assert not (second / MANIFEST).exists()
    assert latest_checkpoint(tmp_path) == first
    model = torch.nn.Linear(4, 4)
    assert load_checkpoint(rt, first, model=model) == {"step": 1}
    # Saving again over the interrupted directory works and cleans it.
    save_checkpoint(rt, second, model=model, step=2)
    assert not list(second.glob(".*.tmp-*"))
    assert latest_checkpoint(tmp_path) == second


def test_keep_last_k(rt: st.Runtime, tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    leftover = tmp_path / "checkpoints" / "step-000000"
    leftover.mkdir(parents=True)  # an interrupted save: no manifest
    for step in range(1, 6):
        save_checkpoint(rt, checkpoint_path(tmp_path, step), keep=2, model=model, step=step)
        if step == 1:
            save_checkpoint(rt, tmp_path / "checkpoints" / "best", model=model, step=step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best", "step-000000", "step-000004", "step-000005"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 5)
    with pytest.raises(ConfigError, match="keep=0"):
        save_checkpoint(rt, checkpoint_path(tmp_path, 6), keep=0, model=model)


def _saved(rt: st.Runtime, tmp_path: Path) -> tuple[_Run, Path]:
    run = _Run(rt, _adamw)
    run.step()
    return run, save_checkpoint(rt, checkpoint_path(tmp_path, 1), **run.state(), step=1)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(run: _Run, before: dict[str, torch.Tensor], rng: torch.Tensor) -> None:
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, before[k]), f"a failed load changed {k}"
    assert not run.opt.state, "a failed load filled the optimizer"
    assert torch.equal(torch.get_rng_state(), rng), "a failed load restored the RNG"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", r"model\.pt is truncated: \d+ bytes, the manifest says \d+"),
        ("flip", r"optimizer\.pt is corrupted: its sha256 differs"),
        ("delete-file", r"scheduler\.pt is missing"),
        ("delete-manifest", r"incomplete: it has no manifest\.json"),
        ("garble-manifest", r"manifest\.json is unreadable"),
        ("future-version", r"format version 99; this scaletrain reads versions up to 1"),
    ],
)
def test_damaged_checkpoint_is_refused_and_nothing_changes(
    rt: st.Runtime, tmp_path: Path, damage: str, message: str
) -> None:
    _, ckpt = _saved(rt, tmp_path)
    if damage == "truncate":
        data = (ckpt / "model.pt").read_bytes()
        (ckpt / "model.pt").write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        data = bytearray((ckpt / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0x01
        (ckpt / "optimizer.pt").write_bytes(bytes(data))
    elif damage == "delete-file":
        (ckpt / "scheduler.pt").unlink()
    elif damage == "delete-manifest":
        (ckpt / MANIFEST).unlink()
    elif damage == "garble-manifest":
        (ckpt / MANIFEST).write_text('{"format": "scaletrain-checkpoint", "vers')
    else:
        data = json.loads((ckpt / MANIFEST).read_text())
        data["version"] = 99
        (ckpt / MANIFEST).write_text(json.dumps(data))
    fresh = _Run(rt, _adamw)
    before, rng = _weights(fresh.model), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(rt, ckpt, **fresh.state())
    _assert_untouched(fresh, before, rng)
    assert latest_checkpoint(tmp_path) is None


def test_latest_skips_a_damaged_newest(rt: st.Runtime, tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    older = save_checkpoint(rt, checkpoint_path(tmp_path, 1), model=model)
    newer = save_checkpoint(rt, checkpoint_path(tmp_path, 2), model=model)
    data = bytearray((newer / "model.pt").read_bytes())
    data[-30] ^= 0xFF
    (newer / "model.pt").write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path, verify=False) == newer  # sizes still match
    assert latest_checkpoint(tmp_path) == older


def test_foreign_model_names_the_differences(rt: st.Runtime, tmp_path: Path) -> None:
    _, ckpt = _saved(rt, tmp_path)
    other = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=48))
    before = _weights(other)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(rt, ckpt, model=other)
    text = str(err.value)
    assert "another model" in text
    assert "not in the checkpoint: blocks.2." in text  # the extra layer
    assert (
        "blocks.0.attn.k_proj.weight: checkpoint has shape (32, 32) float32, the model (48, 48)"
        in text
    )
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_mismatched_objects_are_named(rt: st.Runtime, tmp_path: Path) -> None:
    run, ckpt = _saved(rt, tmp_path)
    fresh = _Run(rt, _sgd)
    with pytest.raises(CheckpointError, match="holds an AdamW state for 'optimizer', but an SGD"):
        load_checkpoint(rt, ckpt, model=fresh.model, optimizer=fresh.opt)
    with pytest.raises(CheckpointError, match="has no stateful named 'warmup'; it holds: model"):
        load_checkpoint(rt, ckpt, model=fresh.model, warmup=fresh.sched)
    with pytest.raises(ConfigError, match="plain values are not passed in"):
        load_checkpoint(rt, ckpt, model=fresh.model, step=3)
    with pytest.raises(ConfigError, match=r"Convert it with \.item\(\)"):
        save_checkpoint(rt, tmp_path / "x", model=run.model, loss=torch.tensor(1.0))
    with pytest.raises(ConfigError, match="pass the model too"):
        save_checkpoint(rt, tmp_path / "x", optimizer=run.opt)
    with pytest.raises(ConfigError, match="holds other things"):
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
        save_checkpoint(rt, tmp_path / "notes", model=run.model)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_optimizer_that_does_not_fit_is_refused_and_left_fresh(
    rt: st.Runtime, tmp_path: Path
) -> None:
    _, ckpt = _saved(rt, tmp_path)
    fresh = _Run(rt, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, amsgrad=True))
    before, rng = _weights(fresh.model), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"state\.tok_emb\.weight\.max_exp_avg_sq is not in"):
        load_checkpoint(rt, ckpt, **fresh.state())
    _assert_untouched(fresh, before, rng)


def test_loader_position_maps_to_another_world_size() -> None:
    # Saved by 2 ranks mid-epoch (position 3 of 10 each), resumed by 4 ranks: the 14
    # samples neither rank reached are dealt over the 4 new ranks.
    old = [ShardedSampler(20, num_replicas=2, rank=r, seed=1, pad=False) for r in range(2)]
    seen = [i for s in old for i in s.indices().tolist()[:3]]
    saved = [dict(s.state_dict(), position=3) for s in old]
    for rank in range(4):
        here = ShardedSampler(20, num_replicas=4, rank=rank, seed=1, pad=False)
        chosen, problem = loader_resume_state("loader", here, saved, rank=rank, world_size=4)
        assert problem is None and chosen is not None
        assert (chosen["epoch"], chosen["position"], chosen["num_replicas"]) == (0, 0, 4)
        here.load_state_dict(chosen)
        seen += list(here)
    assert sorted(seen) == list(range(20))
    # At an epoch boundary: all done -> the next epoch from its start.
    done = [dict(s, position=10) for s in saved]
    here = ShardedSampler(20, num_replicas=4, rank=1, seed=1, pad=False)
    chosen, problem = loader_resume_state("loader", here, done, rank=1, world_size=4)
    assert problem is None and chosen is not None
    assert (chosen["epoch"], chosen["position"], chosen["reshard"]) == (1, 0, [])
    # Another dataset (or seed) is refused before anything changes.
    other = ShardedSampler(21, num_replicas=4, rank=1, seed=1, pad=False)
    chosen, problem = loader_resume_state("loader", other, saved, rank=1, world_size=4)
    assert chosen is None and problem is not None and "dataset_len=20" in problem
    assert other.position == 0 and other.epoch == 0


_EVIL_MARKER = "scaletrain-pwned.txt"


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _plant(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file AND fix its manifest entry, as an attacker with write access would."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    entry = sha256_file(ckpt / name)
    manifest["files"][name] = {"sha256": entry.sha256, "bytes": entry.size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_malicious_pickle_is_refused_without_running(rt: st.Runtime, tmp_path: Path) -> None:
    marker = tmp_path / _EVIL_MARKER
    model = torch.nn.Linear(3, 3)
    full = save_checkpoint(rt, tmp_path / "full", model=model)
    buf = io.BytesIO()
    torch.save({"weight": _Evil(marker)}, buf)
    _plant(full, "model.pt", buf.getvalue())
    with pytest.raises(CheckpointError, match="refused without running"):
        load_checkpoint(rt, full, model=model)
    with pytest.raises(CheckpointError, match="refused without running"):
        consolidate(full, tmp_path / "out.pt")

    sharded = save_checkpoint(rt, tmp_path / "dcp", sharded=True, model=model)
    _plant(sharded, ".metadata", pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match="not DCP metadata and was refused"):
        load_checkpoint(rt, sharded, model=model)
    with pytest.raises(CheckpointError, match="not DCP metadata and was refused"):
        consolidate(sharded, tmp_path / "out.pt")
    assert not marker.exists(), "a pickle from the checkpoint ran code"


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "dcp"])
def test_consolidate_gives_a_plain_state_dict(
    rt: st.Runtime, tmp_path: Path, sharded: bool
) -> None:
    run, _ = _saved(rt, tmp_path)
    ckpt = save_checkpoint(rt, tmp_path / "c", sharded=sharded, **run.state())
    out = consolidate(ckpt, tmp_path / "weights" / "gpt.pt")
    weights = torch.load(out, weights_only=True)
    bare = GPT(CONFIG)
    bare.load_state_dict(weights)  # strict: every key, no wrapper prefix
    for k, v in run.model.state_dict().items():
        assert torch.equal(bare.state_dict()[k], v), k
        assert type(weights[k]) is torch.Tensor


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "dcp"])
def test_async_save_writes_the_state_at_the_call(
    rt: st.Runtime, tmp_path: Path, sharded: bool
) -> None:
    run, _ = _saved(rt, tmp_path)
    at_save = _weights(run.model)
    handle = save_checkpoint(
        rt, checkpoint_path(tmp_path, 2), async_save=True, sharded=sharded, **run.state(), step=2
    )
    assert isinstance(handle, PendingCheckpoint)
    with torch.no_grad():  # training goes on while the checkpoint is written
        for p in run.model.parameters():
            p.add_(1.0)
    # The next save waits for the pending one by itself.
    save_checkpoint(rt, checkpoint_path(tmp_path, 3), sharded=sharded, **run.state(), step=3)
    assert handle.done() and handle.wait() == checkpoint_path(tmp_path, 2)
    fresh = _Run(rt, _adamw)
    assert load_checkpoint(rt, handle.path, **fresh.state())["step"] == 2
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, at_save[k]), k
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 3)


def test_loader_alone_round_trips(rt: st.Runtime, tmp_path: Path) -> None:
    loader = rt.loader(_data(), batch_size=BATCH, seed=3)
    it = iter(loader)
    next(it), next(it)
    ckpt = save_checkpoint(rt, tmp_path / "l", loader=loader)
    expected = [b[0] for b in it]
    other = rt.loader(_data(), batch_size=BATCH, seed=3)
    assert isinstance(other, ShardedLoader)
    load_checkpoint(rt, ckpt, loader=other)
    assert other.sampler.position == 2 * BATCH
    assert all(torch.equal(a, b[0]) for a, b in zip(expected, other, strict=True))


@pytest.mark.gpu
def test_cuda_state_round_trips_through_cpu_files(rt: st.Runtime, tmp_path: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = GPT(CONFIG).to(device)
    opt = _adamw(model)
    model(torch.randint(0, 16, (2, 8), device=device)).sum().backward()
    opt.step()
    ckpt = save_checkpoint(rt, tmp_path / "gpu", model=model, optimizer=opt)
    # Files hold CPU tensors: the checkpoint loads on a machine without a GPU.
    assert torch.load(ckpt / "model.pt", weights_only=True)["head.weight"].device.type == "cpu"
    expected = torch.rand(4, device=device) if rt.device.type == "cuda" else None
    torch.cuda.manual_seed(4321)
    fresh = GPT(CONFIG).to(device)
    fresh_opt = _adamw(fresh)
    load_checkpoint(rt, ckpt, model=fresh, optimizer=fresh_opt)
    for k, v in model.state_dict().items():
        assert fresh.state_dict()[k].device == device
        assert torch.equal(fresh.state_dict()[k], v), k
    if expected is not None:  # this rank's CUDA generator was saved and restored
        assert torch.equal(torch.rand(4, device=device), expected)
