"""Checkpoints without a shared filesystem: a disk per node, each with its part.

Each of two Gloo ranks gets its own directory for "the" run directory, which is what
the same path on two nodes' own disks is. A full (DDP) checkpoint must then be
written once per disk and resume from the parts; one that only one disk holds whole
is passed over for one every disk holds; a sharded checkpoint is refused at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    )


def _job(base: str) -> dict[str, Any]:
    import torch.distributed as dist

    import scaletrain as st
    from scaletrain.checkpoint import CheckpointManager, checkpoint_path

    rt = st.init(strategy="ddp")
    disk = Path(base) / f"disk{rt.rank}"  # the same run directory, on each node's own disk
    bare = _model()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    loader = rt.loader(_data(), batch_size=4, seed=3)
    manager = CheckpointManager(rt, disk, every=2, keep=None)
    batches = iter(loader)
    for step in range(1, 5):
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # A value each rank sees differently (a timer): rank 0's is the checkpoint's.
        manager.maybe_save(step, model=model, optimizer=opt, loader=loader, who=rt.rank)
    manager.close()
    parts = sorted(p.name for p in checkpoint_path(disk, 4).iterdir())
    # A save cut short on one node: disk 1 lost step 4's manifest.
    dist.barrier()
    if rt.rank == 1:
        (checkpoint_path(disk, 4) / "manifest.json").unlink()
    dist.barrier()
    fresh = _model()
    model2, opt2 = rt.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    loader2 = rt.loader(_data(), batch_size=4, seed=3)
    again = CheckpointManager(rt, disk)
    resumed = again.resume(model=model2, optimizer=opt2, loader=loader2)
    again.close()
    out = {
        "disks": again.disks.groups,
        "parts": parts,
        "resumed": resumed.path.name if resumed.path else None,
        "step": resumed.values.get("step"),
        "who": resumed.values.get("who"),
        "rejected": [(p.name, why) for p, why in resumed.rejected],
        "weights": {k: v.clone() for k, v in rt.unwrap(model2).state_dict().items()},
    }
    rt.shutdown()
    return out


def test_a_full_checkpoint_is_written_on_each_disk_and_resumes_from_them(tmp_path: Path) -> None:
    # Issue 10 (4): ranks on another node failed writing their RNG files; a checkpoint
    # was rank 0's files alone, on rank 0's disk.
    r0, r1 = run_ranks(_job, 2, str(tmp_path), timeout=240)
    assert r0["disks"] == ((0,), (1,))
    # Each disk holds the model and every rank's sampler position, and its own RNG.
    assert "model.pt" in r0["parts"] and "model.pt" in r1["parts"]
    assert {"loaders-rank0.json", "loaders-rank1.json"} <= set(r0["parts"]) & set(r1["parts"])
    assert "rng-rank0.pt" in r0["parts"] and "rng-rank1.pt" not in r0["parts"]
    assert "rng-rank1.pt" in r1["parts"] and "rng-rank0.pt" not in r1["parts"]
    # Step 4 is whole on disk 0 only: both ranks pass it over for step 2.
    for r in (r0, r1):
        assert (r["resumed"], r["step"], r["who"]) == ("step-000002", 2, 0)
        assert r["rejected"][0][0] == "step-000004"
    assert "ranks [1] do not hold its part" in r0["rejected"][0][1]
    assert "did not finish on this node" in r1["rejected"][0][1]
    for key, value in r0["weights"].items():
        assert torch.equal(value, r1["weights"][key])  # both loaded the same step


def _sharded_job(base: str) -> list[str]:
    import scaletrain as st
    from scaletrain.checkpoint import CheckpointManager
    from scaletrain.errors import CheckpointError, ConfigError
    from scaletrain.train.models import GPT, GPTConfig

    rt = st.init(strategy="fsdp")
    torch.manual_seed(0)
    bare = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=32))
    model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
    manager = CheckpointManager(rt, Path(base) / f"disk{rt.rank}")
    messages = []
    # At the start (resume), before any training; and at a save for a loop without one.
    for call in (
        lambda: manager.resume(model=model, optimizer=opt),
        lambda: manager.maybe_save(1, force=True, model=model, optimizer=opt),
    ):
        try:
            call()
            messages.append("accepted")
        except (CheckpointError, ConfigError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    manager.close()
    rt.shutdown()
    return messages


def test_a_sharded_checkpoint_without_a_shared_filesystem_is_refused(tmp_path: Path) -> None:
    for messages in run_ranks(_sharded_job, 2, str(tmp_path), timeout=240):
        # Bad input at the start (resume); a checkpoint that cannot be written at a save.
        assert messages[0].startswith("ConfigError: ") and messages[1].startswith("Checkpoint")
        assert "CheckpointManager's folder on a filesystem every node shares" in messages[0]
        for message in messages:
            assert "do not share this directory" in message, message
            assert "model is split across ranks" in message and "every node shares" in message
    assert not any((tmp_path / f"disk{r}" / "checkpoints").exists() for r in (0, 1))
