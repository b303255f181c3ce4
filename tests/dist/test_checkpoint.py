"""Real Gloo ranks: DDP checkpoints resume bit-for-bit; FSDP2 checkpoints reshard 2 -> 4 -> 1.

Two spawned jobs share one temporary run directory: world size 2 trains and
saves (DDP full; FSDP2 sharded, sync and async), then world size 4 loads what
it saved. The test process (no process group) loads and consolidates the same
checkpoints. Comparisons are exact (torch.equal): loading copies values, it
computes nothing.
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

CONFIG_KW = {"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 32}
PER_RANK_BATCH = 4
N_SAMPLES = 64  # 8 batches per rank per epoch at world size 2


def _gpt(dropout: float = 0.0) -> nn.Module:
    from scaletrain.train.models import GPT, GPTConfig

    torch.manual_seed(1)
    return GPT(GPTConfig(**CONFIG_KW, dropout=dropout))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, 16, (N_SAMPLES, 8), generator=g))


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16), idx[:, 1:].reshape(-1))


def _fsdp(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _gpt()
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    opt.zero_grad()
    _loss(model, torch.randint(0, 16, (PER_RANK_BATCH, 8), generator=g)).backward()
    opt.step()


def _full(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Whole weights (and flattened optimizer state) gathered from the shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    out: dict[str, Any] = {
        "model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    }
    if opt is not None:
        out["optim"] = get_optimizer_state_dict(
            model,
            opt,
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )
    # Copies: scalar state such as Adam's `step` is returned by reference.
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out)


def _stage(rank: int) -> nn.Module:
    """Rank 0 keeps the embeddings and block 0, rank 1 block 1 and the head, as pipeline
    stages do: the ranks hold different parameters, under the whole model's names."""
    model = _gpt()
    if rank == 0:
        model.blocks[1] = nn.Identity()  # type: ignore[index]
        model.ln_f, model.head = nn.Identity(), nn.Identity()
    else:
        model.tok_emb, model.pos_emb = nn.Identity(), nn.Identity()
        model.blocks[0] = nn.Identity()  # type: ignore[index]
    return model


def _flat_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _ddp_run(rt: Any) -> dict[str, Any]:
    from scaletrain.checkpoint import save_checkpoint

    bare = _gpt(dropout=0.1)
    model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = rt.loader(_dataset(), batch_size=PER_RANK_BATCH, seed=5)
    return {"model": model, "opt": opt, "sched": sched, "loader": loader, "save": save_checkpoint}


def _ddp_train(parts: dict[str, Any], batches: Any, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        (idx,) = next(batches)
        noise = random.random() + float(np.random.rand())  # python and numpy RNG in the loop
        loss = _loss(parts["model"], idx) * (1.0 + 1e-3 * noise)
        parts["opt"].zero_grad()
        loss.backward()
        parts["opt"].step()
        parts["sched"].step()
        losses.append(loss.item())
    return losses


def _job2(run_dir: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.checkpoint import load_checkpoint, read_manifest, save_checkpoint, wait_pending

    rt = st.init(strategy="ddp")
    rank = rt.rank
    res: dict[str, Any] = {}

    # -- DDP: full checkpoint, resumed on the same 2 ranks --------------------------------
    a = _ddp_run(rt)
    # Different RNG streams per rank: restoring one rank's state on another would show.
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    batches = iter(a["loader"])
    _ddp_train(a, batches, 3)
    ddp_dir = Path(run_dir) / "ddp" / "step-000003"
    save_checkpoint(
        rt, ddp_dir, model=a["model"], optimizer=a["opt"], scheduler=a["sched"],
        loader=a["loader"], step=3,
    )  # fmt: skip
    sampler = a["loader"].sampler
    res["ddp_seen"] = sampler.indices()[: sampler.position].tolist()
    res["ddp_saved"] = {k: v.clone() for k, v in rt.unwrap(a["model"]).state_dict().items()}
    res["ddp_opt_saved"] = a["opt"].state_dict()
    uninterrupted = _ddp_train(a, batches, 3)
    res["ddp_final"] = {k: v.clone() for k, v in rt.unwrap(a["model"]).state_dict().items()}

    b = _ddp_run(rt)
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    values = load_checkpoint(
        rt, ddp_dir, model=b["model"], optimizer=b["opt"], scheduler=b["sched"], loader=b["loader"]
    )
    res["ddp_values"] = values
    res["ddp_position"] = b["loader"].sampler.position
    res["ddp_loaded"] = {k: v.clone() for k, v in rt.unwrap(b["model"]).state_dict().items()}
    res["ddp_opt_loaded"] = b["opt"].state_dict()
    resumed = _ddp_train(b, iter(b["loader"]), 3)
    res["ddp_losses"] = (uninterrupted, resumed)
    res["ddp_resumed_final"] = {k: v.clone() for k, v in rt.unwrap(b["model"]).state_dict().items()}
    res["ddp_manifest"] = read_manifest(ddp_dir).to_json()
    del a, b
    import gc

    gc.collect()

    # -- FSDP2: sharded checkpoints, sync then async ------------------------------------
    model, opt = _fsdp(rank)
    for step in range(2):
        _fsdp_step(model, opt, rank, step)
    sync_dir = Path(run_dir) / "fsdp" / "sync"
    save_checkpoint(rt, sync_dir, model=model, optimizer=opt, step=2)
    res["fsdp_sync"] = _full(model, opt)
    res["fsdp_manifest"] = read_manifest(sync_dir).to_json()

    _fsdp_step(model, opt, rank, 2)
    res["fsdp_async"] = _full(model, opt)
    handle = save_checkpoint(
        rt, Path(run_dir) / "fsdp" / "async", async_save=True, model=model, optimizer=opt, step=3
    )
    _fsdp_step(model, opt, rank, 3)  # training goes on while the checkpoint is written
    res["async_path"] = str(handle.wait())
    res["fsdp_after_async"] = _full(model)
    wait_pending()
    res["fsdp_async_manifest"] = read_manifest(Path(res["async_path"])).to_json()
    del model, opt

    # -- Pipeline-like stages: each rank holds other parameters ----------------------
    stage = _stage(rank)
    stage_opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for p in stage.parameters():
        p.grad = torch.full_like(p, 0.01 * (rank + 1))
    stage_opt.step()
    stage_dir = save_checkpoint(rt, Path(run_dir) / "stages", model=stage, optimizer=stage_opt)
    res["stage_weights"] = {k: v.clone() for k, v in stage.state_dict().items()}
    res["stage_optim"] = _flat_optim(stage, stage_opt)
    res["stage_manifest"] = read_manifest(stage_dir).to_json()
    rt.shutdown()
    if rank == 0:
        return res
    keys = ("ddp_losses", "ddp_values", "stage_weights", "stage_optim", "ddp_seen")
    return {k: res[k] for k in keys}


def _job4(run_dir: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.checkpoint import load_checkpoint
    from scaletrain.errors import CheckpointError

    rt = st.init(strategy="ddp")
    rank = rt.rank
    res: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _fsdp(rank)
        res["values"] = load_checkpoint(
            rt, Path(run_dir) / "fsdp" / "sync", model=model, optimizer=opt
        )
        res["fsdp_sync"] = _full(model, opt)
        res["local_rows"] = model.tok_emb.weight.to_local().shape[0]  # type: ignore[union-attr,operator]
        load_checkpoint(rt, Path(run_dir) / "fsdp" / "async", model=model)
        res["fsdp_async"] = _full(model)
    res["warnings"] = [str(w.message) for w in caught if "RNG" in str(w.message)]

    # A full (DDP) checkpoint into FSDP2 shards on 4 ranks: weights and optimizer map.
    model, opt = _fsdp(rank)
    ddp_dir = Path(run_dir) / "ddp" / "step-000003"
    load_checkpoint(rt, ddp_dir, model=model, optimizer=opt)
    res["ddp_into_fsdp"] = _full(model)

    # Its loader was saved mid-epoch by 2 ranks: here the 4 ranks share what was left.
    loader = rt.loader(_dataset(), batch_size=PER_RANK_BATCH, seed=5)
    load_checkpoint(rt, ddp_dir, loader=loader)
    res["rest"] = list(loader.sampler)
    res["rest_batches"] = len(list(iter(loader)))

    # A loader over another dataset is refused, and nothing is changed.
    other = torch.utils.data.TensorDataset(torch.zeros(N_SAMPLES + 1, 8, dtype=torch.long))
    loader = rt.loader(other, batch_size=PER_RANK_BATCH, seed=5)
    fresh, fresh_opt = _fsdp(rank)
    before = _full(fresh)["model"]
    try:
        load_checkpoint(rt, ddp_dir, model=fresh, optimizer=fresh_opt, loader=loader)
        res["loader_error"] = None
    except CheckpointError as exc:
        res["loader_error"] = str(exc)
    after = _full(fresh)["model"]
    res["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    res["opt_untouched"] = not fresh_opt.state
    res["position"] = loader.sampler.position
    del model, opt, fresh, fresh_opt
    rt.shutdown()
    return res


_CACHE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _CACHE:
        run_dir = tmp_path_factory.mktemp("ckpt-run")
        _CACHE["run_dir"] = run_dir
        _CACHE["w2"] = run_ranks(_job2, 2, str(run_dir), timeout=240)
        _CACHE["w4"] = run_ranks(_job4, 4, str(run_dir), timeout=240)
    return _CACHE


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _equal_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        _equal(a["state"][i], b["state"][i])


def test_ddp_full_checkpoint_resumes_bit_for_bit(jobs: dict[str, Any]) -> None:
    w2 = jobs["w2"]
    r0 = w2[0]
    manifest = r0["ddp_manifest"]
    assert (manifest["kind"], manifest["world_size"], manifest["step"]) == ("full", 2, 3)
    assert {"model.pt", "optimizer.pt", "scheduler.pt", "rng-rank0.pt", "rng-rank1.pt",
            "loaders-rank0.json", "loaders-rank1.json", "values.json"} == set(manifest["files"])  # fmt: skip
    assert not any(k.startswith("module.") for k in manifest["objects"]["model"]["table"])
    _equal(r0["ddp_loaded"], r0["ddp_saved"])
    _equal_optimizer_state(r0["ddp_opt_loaded"], r0["ddp_opt_saved"])
    assert r0["ddp_position"] == 3 * PER_RANK_BATCH
    for r in w2:
        assert r["ddp_values"] == {"step": 3}
        uninterrupted, resumed = r["ddp_losses"]
        # Bitwise: same batches, same per-rank dropout masks and python/numpy draws.
        assert resumed == uninterrupted
    _equal(r0["ddp_resumed_final"], r0["ddp_final"])
    assert w2[0]["ddp_losses"] != w2[1]["ddp_losses"], "ranks should see different data"


def test_fsdp_checkpoint_saved_on_2_loads_on_4(jobs: dict[str, Any]) -> None:
    r0, w4 = jobs["w2"][0], jobs["w4"]
    manifest = r0["fsdp_manifest"]
    assert (manifest["kind"], manifest["world_size"]) == ("sharded", 2)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "optim-values.pt"} <= set(
        manifest["files"]
    )
    assert w4[0]["local_rows"] == 16 // 4  # really sharded 4 ways
    assert w4[0]["values"] == {"step": 2}
    _equal(w4[0]["fsdp_sync"]["model"], r0["fsdp_sync"]["model"])
    _equal(w4[0]["fsdp_sync"]["optim"], r0["fsdp_sync"]["optim"])
    # RNG states of 2 ranks do not map to 4: skipped, and rank 0 says so.
    assert any("were NOT restored" in w for w in w4[0]["warnings"])


def test_async_sharded_save_holds_the_state_at_the_call(jobs: dict[str, Any]) -> None:
    r0, w4 = jobs["w2"][0], jobs["w4"]
    assert r0["fsdp_async_manifest"]["step"] == 3
    _equal(w4[0]["fsdp_async"]["model"], r0["fsdp_async"]["model"])
    moved = r0["fsdp_after_async"]["model"]
    assert not torch.equal(moved["head.weight"], r0["fsdp_async"]["model"]["head.weight"])


def test_full_checkpoint_loads_into_fsdp_at_another_world_size(jobs: dict[str, Any]) -> None:
    _equal(jobs["w4"][0]["ddp_into_fsdp"]["model"], jobs["w2"][0]["ddp_saved"])


def test_mid_epoch_loader_resumes_at_another_world_size(jobs: dict[str, Any]) -> None:
    """2 ranks saved 3 batches into the epoch; 4 ranks see every other sample once."""
    seen = [i for r in jobs["w2"] for i in r["ddp_seen"]]
    rest = [i for r in jobs["w4"] for i in r["rest"]]
    assert len(seen) == 2 * 3 * PER_RANK_BATCH
    assert sorted(seen + rest) == list(range(N_SAMPLES))
    # (64 - 24) / 4 ranks = 10 samples each: 3 batches of 4 (the last one partial).
    assert [r["rest_batches"] for r in jobs["w4"]] == [3, 3, 3, 3]


def test_loader_of_another_dataset_is_refused_and_changes_nothing(jobs: dict[str, Any]) -> None:
    for r in jobs["w4"]:
        error = r["loader_error"]
        assert error is not None
        assert "cannot resume" in error and "dataset_len=64" in error
        assert r["untouched"] and r["opt_untouched"] and r["position"] == 0


def test_one_process_loads_and_consolidates_the_sharded_checkpoint(
    jobs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    import scaletrain as st
    from scaletrain.checkpoint import consolidate, load_checkpoint

    run_dir, r0 = jobs["run_dir"], jobs["w2"][0]
    sync_dir = run_dir / "fsdp" / "sync"
    rt = st.init()
    try:
        model = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with pytest.warns(UserWarning, match="saved by 2 ranks and this job has 1"):
            values = load_checkpoint(rt, sync_dir, model=model, optimizer=opt)
        assert values == {"step": 2}
        _equal(model.state_dict(), r0["fsdp_sync"]["model"])
        _equal(_full(model, opt)["optim"], r0["fsdp_sync"]["optim"])
    finally:
        rt.shutdown()

    # Pipeline-like stages saved by 2 ranks, loaded whole into one process.
    w2 = jobs["w2"]
    manifest = r0["stage_manifest"]
    assert manifest["kind"] == "sharded"
    assert {"optim-values-rank0.pt", "optim-values-rank1.pt"} <= set(manifest["files"])
    rt = st.init()
    try:
        model = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with pytest.warns(UserWarning, match="NOT restored"):
            load_checkpoint(rt, run_dir / "stages", model=model, optimizer=opt)
        _equal(model.state_dict(), {**w2[0]["stage_weights"], **w2[1]["stage_weights"]})
        _equal(_flat_optim(model, opt), {**w2[0]["stage_optim"], **w2[1]["stage_optim"]})
    finally:
        rt.shutdown()

    for ckpt, expected in ((sync_dir, r0["fsdp_sync"]["model"]),
                           (run_dir / "ddp" / "step-000003", r0["ddp_saved"])):  # fmt: skip
        out = consolidate(ckpt, tmp_path / f"{ckpt.name}.pt")
        weights = torch.load(out, weights_only=True)
        bare = _gpt()
        bare.load_state_dict(weights)
        _equal(bare.state_dict(), expected)
    assert os.environ.get("RANK") is None
