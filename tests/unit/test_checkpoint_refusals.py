"""Loads that fail change nothing; runs whose checkpoints are bad say so (issue 8).

One process, world size 1. A "doctored" checkpoint has its files replaced AND its
manifest rewritten to match, as a bad copy or a person with write access would leave
it: the sha256 checks pass, and only comparing what is read with what it is loaded
into can refuse it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.checkpoint import MANIFEST, checkpoint_path, save_checkpoint, wait_pending
from scaletrain.checkpoint.manifest import sha256_file
from scaletrain.errors import CheckpointError
from scaletrain.testing import launcher_variables


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Iterator[st.Runtime]:
    for var in launcher_variables():
        monkeypatch.delenv(var)
    runtime = st.init()
    yield runtime
    wait_pending()
    runtime.shutdown()


def _net(width: int = 8) -> nn.Module:
    torch.manual_seed(width)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def _plant(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file AND fix its manifest entry."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    entry = sha256_file(ckpt / name)
    manifest["files"][name] = {"sha256": entry.sha256, "bytes": entry.size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("stepped", [True, False], ids=["stepped-optimizer", "fresh-optimizer"])
def test_swapped_full_files_are_refused_before_anything_is_copied(
    rt: st.Runtime, tmp_path: Path, stepped: bool
) -> None:
    """Point 7: another model's model.pt under a rewritten manifest raised a bare
    RuntimeError after copying the matching names (Linear(4, 8) -> the first layer)."""
    ours, theirs = _net(8), _net(6)
    ckpt = save_checkpoint(rt, tmp_path / "ours", model=ours, optimizer=_stepped(ours))
    other = save_checkpoint(rt, tmp_path / "theirs", model=theirs, optimizer=_stepped(theirs))
    _plant(ckpt, "model.pt", (other / "model.pt").read_bytes())

    model = _net(8)
    model[0].weight.data.fill_(7.0)  # type: ignore[index]
    opt = _stepped(model) if stepped else torch.optim.AdamW(model.parameters(), lr=0.1)
    before = _state(model, opt)
    with pytest.raises(CheckpointError, match="holds another model"):
        rt.load(ckpt, model=model, optimizer=opt)
    assert _unchanged(before, _state(model, opt))
    assert bool(opt.state) == stepped  # a never-stepped optimizer stays never-stepped


def test_swapped_optimizer_file_is_refused(rt: st.Runtime, tmp_path: Path) -> None:
    ours = _net(8)
    ckpt = save_checkpoint(rt, tmp_path / "ours", model=ours, optimizer=_stepped(ours))
    # The right class name in the manifest, another optimizer's state in the file.
    m = _net(8)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(2, 4)).sum().backward()
    sgd.step()
    donor = save_checkpoint(rt, tmp_path / "donor", model=m, optimizer=sgd)
    _plant(ckpt, "optimizer.pt", (donor / "optimizer.pt").read_bytes())
    model = _net(8)
    opt = _stepped(model)
    before = _state(model, opt)
    with pytest.raises(CheckpointError, match="does not fit"):
        rt.load(ckpt, model=model, optimizer=opt)
    assert _unchanged(before, _state(model, opt))


def test_truncated_distcp_under_a_rewritten_manifest_changes_nothing(
    rt: st.Runtime, tmp_path: Path
) -> None:
    """Point 7: DCP raised CheckpointException (a BaseException: `except Exception` let it
    through) after it had already written into the parameters."""
    ours = _net(8)
    ckpt = save_checkpoint(rt, tmp_path / "c", sharded=True, model=ours, optimizer=_stepped(ours))
    shard = next(p.name for p in ckpt.iterdir() if p.suffix == ".distcp")
    _plant(ckpt, shard, (ckpt / shard).read_bytes()[:-200])
    model = _net(8)
    model[0].weight.data.fill_(7.0)  # type: ignore[index]
    opt = _stepped(model)
    before = _state(model, opt)
    with pytest.raises(CheckpointError, match="damaged"):
        try:
            rt.load(ckpt, model=model, optimizer=opt)
        except Exception:
            raise
        except BaseException as exc:  # what used to escape
            pytest.fail(f"{type(exc).__name__} escaped: {exc}")
    assert _unchanged(before, _state(model, opt))


@pytest.mark.parametrize("strategy", ["ddp", "single"])
def test_full_state_dict_is_a_snapshot(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 8: at world size 1 (and under DDP) it shared memory with the parameters."""
    for var in launcher_variables():
        monkeypatch.delenv(var)
    with st.init(strategy=strategy) as rt:
        model = rt.setup(_net(8))
        snapshot = rt.full_state_dict(model)
        kept = {k: v.clone() for k, v in snapshot.items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert _unchanged(kept, snapshot)


def _run_with_checkpoints(rt: st.Runtime, run: Path, steps: tuple[int, ...]) -> nn.Module:
    from scaletrain.checkpoint import CheckpointManager

    model = _net(8)
    opt = _stepped(model)
    manager = CheckpointManager(rt, run, every=1, keep=None)
    for step in steps:
        manager.maybe_save(step, model=model, optimizer=opt)
    manager.close()
    return model


def test_manager_falls_back_with_the_reason_and_refuses_when_none_loads(
    rt: st.Runtime, tmp_path: Path
) -> None:
    """Point 3, in the library: the newest valid checkpoint, each newer one with its reason;
    none valid -> an error listing all, nothing deleted."""
    from scaletrain.checkpoint import CheckpointManager

    _run_with_checkpoints(rt, tmp_path, (1, 2, 3))
    (checkpoint_path(tmp_path, 4)).mkdir()  # a save that never finished
    bad = checkpoint_path(tmp_path, 3) / "optimizer.pt"
    bad.write_bytes(bad.read_bytes()[:50])
    model = _net(8)
    resumed = CheckpointManager(rt, tmp_path).resume(model=model, optimizer=_stepped(model))
    assert resumed.path == checkpoint_path(tmp_path, 2) and resumed.values == {"step": 2}
    reasons = dict(resumed.rejected)
    assert "no manifest.json" in reasons[checkpoint_path(tmp_path, 4)]
    assert "optimizer.pt is truncated" in reasons[checkpoint_path(tmp_path, 3)]
    for step in (1, 2):
        p = checkpoint_path(tmp_path, step) / "model.pt"
        p.write_bytes(p.read_bytes()[:-1])
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(
        CheckpointError, match=r"holds 3 checkpoint\(s\) \(and 1 save\(s\) that"
    ) as info:
        CheckpointManager(rt, tmp_path).resume(model=model)
    assert "step-000001: " in str(info.value) and "step-000003: " in str(info.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names


def test_pruning_keeps_older_checkpoints_while_newer_ones_are_damaged(
    rt: st.Runtime, tmp_path: Path
) -> None:
    """keep=2 used to count a damaged checkpoint as one of the two it keeps."""
    from scaletrain.checkpoint import CheckpointManager

    _run_with_checkpoints(rt, tmp_path, (1, 2, 3))
    for step in (2, 3):
        p = checkpoint_path(tmp_path, step) / "model.pt"
        p.write_bytes(p.read_bytes()[:-1])
    model = _net(8)
    opt = _stepped(model)
    manager = CheckpointManager(rt, tmp_path, every=1, keep=2)
    manager.maybe_save(10, model=model, optimizer=opt)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002", "step-000003", "step-000010"]
    manager.maybe_save(11, model=model, optimizer=opt)
    manager.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000010", "step-000011"]


def _checkpoint_cmd(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from scaletrain.cli import main
    from scaletrain.errors import use_cli_names

    try:
        code = main(["checkpoint", *args])
    finally:
        use_cli_names(False)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_checkpoint_commands_say_what_the_path_is(
    rt: st.Runtime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Point 6: each used to say "its save never finished (crash, kill...)"."""
    empty = tmp_path / "empty"
    empty.mkdir()
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "train.py").write_text("print('hi')\n")
    finished = tmp_path / "finished"
    finished.mkdir()
    torch.save(_net(8).state_dict(), finished / "model.pt")
    (finished / "metrics.jsonl").write_text("{}\n")
    corrupt = tmp_path / "corrupt"
    _run_with_checkpoints(rt, corrupt, (1, 2, 3))
    for ckpt in (corrupt / "checkpoints").iterdir():
        (ckpt / "optimizer.pt").write_bytes(b"x")
    out = str(tmp_path / "out.pt")
    expected = {
        str(empty): "is an empty directory",
        str(scripts): "holds no checkpoint and is not a run directory (it holds train.py)",
        str(finished): "is a finished run without checkpoints: its model.pt",
        str(tmp_path / "nope"): "does not exist",
    }
    for path, words in expected.items():
        code, log = _checkpoint_cmd("consolidate", path, out, capsys=capsys)
        assert code == 2 and words in log and "never finished" not in log, log
        code, log = _checkpoint_cmd("latest", path, capsys=capsys)
        assert code == 2 and words in log, log
    code, log = _checkpoint_cmd("latest", str(corrupt), capsys=capsys)
    assert code == 2, log
    assert "found 3 checkpoints and rejected all of them" in log
    assert log.count("optimizer.pt is truncated") == 3
    code, log = _checkpoint_cmd("consolidate", str(corrupt), out, capsys=capsys)
    assert code == 2 and "found 3 checkpoints and rejected all of them" in log, log


def test_a_refused_resume_counts_and_names_each_checkpoint_once(
    rt: st.Runtime, tmp_path: Path
) -> None:
    """Issue 26 item 16: "holds 3 checkpoint(s)" listed 4 (an unfinished save too), each
    path printed twice (the listing, then again inside its reason), and every reason
    carried advice naming latest_checkpoint(), a function the docs never teach."""
    from scaletrain.checkpoint import CheckpointManager

    _run_with_checkpoints(rt, tmp_path, (1, 2, 3))
    checkpoint_path(tmp_path, 4).mkdir()  # a save that never finished
    for step in (1, 2, 3):
        p = checkpoint_path(tmp_path, step) / "model.pt"
        p.write_bytes(p.read_bytes()[:-1])
    model = _net(8)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(rt, tmp_path).resume(model=model)
    message = str(info.value)
    assert "holds 3 checkpoint(s) (and 1 save(s) that never finished) and none" in message, message
    for step in (1, 2, 3, 4):
        assert message.count(checkpoint_path(tmp_path, step).name) == 1, message
    assert "latest_checkpoint" not in message and "()" not in message, message


def test_checkpoint_latest_says_which_newer_checkpoints_it_skipped(
    rt: st.Runtime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 16: `checkpoint latest` / `consolidate` fell back over a damaged newest
    checkpoint without a word; the advice of a damaged one named a Python function."""
    from scaletrain.cli import main
    from scaletrain.errors import use_cli_names

    _run_with_checkpoints(rt, tmp_path, (1, 2, 3))
    bad = checkpoint_path(tmp_path, 3) / "model.pt"
    bad.write_bytes(bad.read_bytes()[:-1])
    capsys.readouterr()
    try:
        assert main(["checkpoint", "latest", str(tmp_path)]) == 0
        out = capsys.readouterr()
        assert out.out.strip() == str(checkpoint_path(tmp_path, 2))  # stdout: the path alone
        assert "skipped step-000003, newer than step-000002: model.pt is truncated" in out.err
        assert main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "m.pt")]) == 0
        assert "skipped step-000003" in capsys.readouterr().err
        code = main(["checkpoint", "consolidate", str(bad.parent), str(tmp_path / "m.pt")])
        err = capsys.readouterr().err
    finally:
        use_cli_names(False)
    assert code == 2 and "`scaletrain checkpoint latest RUN`" in err, err
    assert "latest_checkpoint" not in err and err.count(str(bad.parent)) == 1, err


def test_loading_a_run_or_its_checkpoints_folder_says_it_is_not_a_checkpoint(
    rt: st.Runtime, tmp_path: Path
) -> None:
    """rt.load of a run's directory (or its checkpoints/) said the checkpoint was
    "incomplete ... its save never finished (crash, kill ...)": nothing had crashed; it
    is not a checkpoint, and the message says where one is."""
    run = tmp_path / "run"
    _run_with_checkpoints(rt, run, (1, 2))
    cases = {
        run: "is a run's directory (it holds checkpoints/)",
        run / "checkpoints": "holds checkpoints (step-000001, step-000002)",
    }
    for path, words in cases.items():
        with pytest.raises(CheckpointError) as got:
            rt.load(path, model=_net(8))
        said = str(got.value)
        assert f"{path} is not a checkpoint: it {words}" in said, said
        assert "never finished" not in said and "CheckpointManager(rt, RUN).resume" in said
    # A save that never finished (an empty directory: killed at once) is still told so.
    unfinished = run / "checkpoints" / "step-000003"
    unfinished.mkdir()
    with pytest.raises(CheckpointError, match="never finished"):
        rt.load(unfinished, model=_net(8))


def test_a_refusal_names_the_users_class_not_fsdps() -> None:
    """fully_shard makes a sharded module an instance of a class of its own, named
    FSDP + the user's ("FSDPMLP"): a checkpoint's refusal named that one."""
    from torch.distributed.fsdp import FSDPModule

    from scaletrain.checkpoint.layout import user_class

    class MLP(torch.nn.Linear):
        pass

    sharded = type("FSDPMLP", (FSDPModule, MLP), {})  # as fully_shard makes it
    module = MLP(2, 2)
    module.__class__ = sharded
    assert type(module).__name__ == "FSDPMLP" and user_class(module) == "MLP"
    assert user_class(torch.nn.Linear(2, 2)) == "Linear"
