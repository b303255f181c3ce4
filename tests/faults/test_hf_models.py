"""A Hugging Face model trained by `scaletrain train --model` under every strategy equals
one process: examples/hf_llama.py (a LlamaForCausalLM from a config, no download), 6
steps of the same global batch of 16 sequences, AdamW, fp32 on the CPU.

Tolerance: every weight within 2e-6 of the one-process run's, and, where every rank
sees the whole batch (tensor, pipeline), every step's loss within 1e-5 (a data-parallel
run's record is rank 0's half of the batch). Measured: 1e-7 for the weights and 5e-7
for the losses; the strategies only reorder floating-point sums (all-reduces, sharded
matrix products, microbatches).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.inprocess import run_cli

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUNS = {
    # name: (flags, whether every rank sees the whole batch)
    "ddp": (["--nproc", "2", "--batch-size", "8"], False),
    "fsdp": (["--nproc", "2", "--batch-size", "8", "--strategy", "fsdp"], False),
    "tensor": (["--nproc", "2", "--batch-size", "16", "--strategy", "tensor"], True),
    "fsdp x tp": (["--nproc", "4", "--batch-size", "8", "--strategy", "fsdp",
                   "--mesh", "dp=2,tp=2"], False),
    "pipeline": (["--nproc", "2", "--batch-size", "16", "--strategy", "pipeline"], True),
}  # fmt: skip


def _train(out: Path, *flags: str) -> str:
    """`scaletrain train` of examples/hf_llama.py, with its launcher in this process
    (tests/inprocess.py): the ranks are processes all the same, but not the launcher's
    imports of torch and transformers (nor a one-process run's)."""
    done = run_cli(
        "train", "--model", "examples/hf_llama.py:build", "--max-steps", "6", "--log-every",
        "1", "--eval-batches", "0", "--hang-timeout", "0", "--no-save-last", "--out", str(out),
        *flags, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _losses(run: Path) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "one"
    log = _train(out, "--nproc", "1", "--batch-size", "16")
    assert "model examples/hf_llama.py:build on examples/hf_llama.py:datasets" in log
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """RUNS["fsdp"] stopped after 3 steps and resumed to its end, and a copy of it as it
    was when stopped (a sharded checkpoint, no model.pt): each process imports
    transformers, so the strategy's run and the export's are one."""
    root = tmp_path_factory.mktemp("hf-fsdp")
    run, stopped = root / "run", root / "stopped"
    _train(run, *RUNS["fsdp"][0], "--stop-after", "3")
    shutil.copytree(run, stopped, symlinks=True)
    assert "resumed from" in _train(run, *RUNS["fsdp"][0])
    return stopped, run


@pytest.mark.parametrize("name", list(RUNS))
def test_a_hugging_face_llama_under_each_strategy_equals_one_process(
    name: str, one_process: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    flags, whole_batch = RUNS[name]
    if name == "fsdp":
        run = request.getfixturevalue("fsdp_run")[1]  # stopped at step 3 and resumed
    else:
        run = tmp_path / "run"
        _train(run, *flags)
    ref = torch.load(one_process / "model.pt", weights_only=True)
    got = torch.load(run / "model.pt", weights_only=True)
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=2e-6, msg=key)
    if whole_batch:
        for a, b in zip(_losses(run), _losses(one_process), strict=True):
            assert abs(a - b) <= 1e-5, (a, b)


def test_export_writes_a_directory_from_pretrained_loads(
    tmp_path: Path, fsdp_run: tuple[Path, Path]
) -> None:
    """`scaletrain checkpoint export RUN DIR`: a run stopped under FSDP (a sharded
    checkpoint, no model.pt) and the same run finished (its model.pt) each give a
    Hugging Face directory whose model computes the run's logits."""
    from transformers import LlamaForCausalLM

    from scaletrain.checkpoint import consolidate, latest_checkpoint

    stopped, finished = fsdp_run
    assert not (stopped / "model.pt").exists()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def export(run: Path, name: str) -> tuple[str, torch.Tensor]:
        done = run_cli("checkpoint", "export", str(run), str(tmp_path / name), cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        model = LlamaForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            return done.stdout, model(tokens).logits

    def logits_of(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        sys.path.insert(0, str(ROOT / "examples"))
        try:
            import hf_llama
        finally:
            sys.path.pop(0)
        model = hf_llama.build().eval()
        model.load_state_dict(weights)
        with torch.no_grad():
            return model(tokens).logits

    said, got = export(stopped, "stopped")
    checkpoint = latest_checkpoint(stopped)
    assert checkpoint is not None and f"from {checkpoint}" in said, said
    whole = torch.load(consolidate(checkpoint, tmp_path / "c.pt"), weights_only=True)
    torch.testing.assert_close(got, logits_of(whole), rtol=0, atol=0)
    said, got = export(finished, "finished")
    assert f"from {finished / 'model.pt'}" in said, said
    torch.testing.assert_close(
        got, logits_of(torch.load(finished / "model.pt", weights_only=True)), rtol=0, atol=0
    )
    # Nothing is written over, and a model that is not a Hugging Face one is refused.
    again = run_cli("checkpoint", "export", str(finished), str(tmp_path / "finished"), cwd=ROOT)
    assert again.returncode == 2 and "never writes over" in again.stderr, again.stderr
