"""A Hugging Face config.json trained by `scaletrain train --model DIR/config.json`,
checked by `scaletrain plan --check` and exported, as docs/own-model.md shows: the docs'
own file and commands, the training as real processes (the Recipe and the refusals:
tests/unit/test_hf_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain import cli
from tests.cpu_hardware import cpu_hardware_file
from tests.docblocks import commands, example
from tests.inprocess import run_cli

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_the_docs_config_json_trains_under_fsdp_and_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(example("hf-config-json"))
    train, check = commands("hf-config-commands")
    assert train[:4] == ["scaletrain", "train", "--model", "tiny-llama/config.json"], train
    assert "fsdp" in train and check[:3] == ["scaletrain", "plan", "--check"], check
    # Its launcher in this process (tests/inprocess.py): the ranks are processes all the
    # same, but not the launcher's imports of torch and transformers.
    done = run_cli(
        *train[1:], "--log-every", "1", "--eval-batches", "1", "--hang-timeout", "60",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model tiny-llama/config.json on python sources (byte-level)" in done.stdout
    assert "strategy fsdp" in done.stdout and "2 processes" in done.stdout
    run = tmp_path / "runs" / "tiny-llama"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert len(losses) == 4 and all(4.0 < loss < 7.0 for loss in losses)  # about log(256)
    assert json.loads((run / "config.json").read_text())["model"] == "tiny-llama/config.json"
    # In this process (one start of Python less); a test never reads this machine's
    # calibration, which the docs' command does.
    monkeypatch.chdir(tmp_path)
    hardware = cpu_hardware_file(tmp_path / "cpu.toml")
    assert cli.main([*check[1:], "--hardware", str(hardware)]) == 0
    out = capsys.readouterr().out
    assert "check: fsdp dp=2" in out and "step time" in out
    # The run's model, rebuilt from the file it names, loads its weights and is written out.
    assert cli.main(["checkpoint", "export", str(run), "hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
