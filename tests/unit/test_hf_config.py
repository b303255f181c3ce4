"""A Hugging Face config.json as what `scaletrain train --model` trains: its Recipe (the
model from random weights on the byte corpus, or on --data), the run's name, what
`plan --check` plans for such a run, and every mistake in it refused in the parent, in
the CLI's words, before any process starts (tests/faults/test_hf_config.py trains one)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from scaletrain import cli
from scaletrain.errors import ConfigError
from scaletrain.train.config import TrainConfig
from scaletrain.train.model_module import check_recipe, load_recipe

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 48, "torch_dtype": "bfloat16",
}  # fmt: skip

DATA = """
import torch

def datasets(split, data_dir=None):
    x = torch.randint(0, 20, (16, 10))
    return torch.utils.data.TensorDataset(x, x)
"""


def _config(folder: Path, settings: dict[str, Any] | str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return path


def test_a_config_json_is_a_recipe_that_pretrains_its_model_on_the_byte_corpus(
    tmp_path: Path,
) -> None:
    path = _config(tmp_path / "tiny-llama", LLAMA)
    recipe = load_recipe(str(path))
    check_recipe(recipe)
    assert (recipe.spec, recipe.name) == (str(path), "tiny-llama")
    assert recipe.name == TrainConfig(model=str(path)).run_name()
    assert TrainConfig(model=str(path.parent)).run_name() == "tiny-llama"
    assert (recipe.dataset, recipe.task, recipe.token_loss) == (
        "python sources (byte-level)", "language-model", True,
    )  # fmt: skip
    net = recipe.build()
    assert type(net).__name__ == "LlamaForCausalLM" and not net.config.use_cache
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    optimizer = recipe.optimizer(net.parameters(), recipe.scaled_lr(64))
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 0.1)
    # Sequences of max_position_embeddings (48) where that is under 64 tokens.
    inputs, targets = recipe.example(2)
    assert inputs.shape == (2, 48) and int(inputs.max()) < 300
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert recipe.locate_data(None) is not None
    x, y = recipe.data(None, "test")[0]
    assert x.shape == y.shape == (48,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256
    # A longer model still trains at 64 tokens; the directory names the file as well.
    longer = load_recipe(
        str(_config(tmp_path / "long", {**LLAMA, "max_position_embeddings": 4096}).parent)
    )
    assert longer.example(1)[0].shape == (1, 64) and longer.name == "long"


def test_a_config_json_trains_on_the_data_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata.py").write_text(DATA)
    path = _config(tmp_path / "small-vocab", {**LLAMA, "vocab_size": 20})
    recipe = load_recipe(str(path), data="mydata:datasets")
    assert recipe.dataset == "mydata:datasets" and recipe.locate_data(None) is None
    assert len(recipe.data(None, "train")) == 16 and recipe.example(3)[0].shape == (3, 10)
    # Without it, a vocabulary that cannot hold the bytes is refused.
    with pytest.raises(ConfigError, match=r"its vocab_size is 20, .* bytes"):
        load_recipe(str(path)).locate_data(None)


def test_plan_check_plans_a_config_json_run_at_the_sequence_it_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan of a config.json assumes up to 4,096 tokens a sample; its run trained at 64."""
    import scaletrain.planner.check as check

    path = _config(tmp_path / "tiny", {**LLAMA, "max_position_embeddings": 512})
    run = tmp_path / "run"
    (run / "observe").mkdir(parents=True)
    settings = {"model": str(path), "strategy": "fsdp", "nproc": 2, "batch_size": 8}
    (run / "config.json").write_text(json.dumps(settings))
    asked: dict[str, Any] = {}
    monkeypatch.setattr(check, "measured", lambda run, records=None: (0.1, None, False))
    monkeypatch.setattr(
        check, "plan", lambda *a, **kw: asked.update(kw) or SimpleNamespace(rows=[None])
    )
    check.check_run(run, "h100-sxm")
    assert (asked["model"], asked["seq_len"], asked["batch_size"]) == (str(path), 64, 8)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (None, ["--model {path}: no file {path}", "Hugging Face config.json"]),
        ("{model_type: llama", ["--model {path}: {path} is not JSON", "Fix: the config.json"]),
        ({**LLAMA, "model_type": "lama"}, ["its model_type is 'lama'", "did it mean llama"]),
        ({**LLAMA, "vocab_size": 64}, ["--model {path}: its vocab_size is 64", "256 or more",
                                       "--data MODULE:NAME"]),
    ],
    ids=["missing", "not-json", "unknown-model-type", "vocab-too-small"],
)  # fmt: skip
def test_a_config_json_that_cannot_train_is_refused_in_the_parent_in_the_clis_words(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: dict[str, Any] | str | None,
    words: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    path = Path("missing/config.json") if settings is None else _config(tmp_path / "m", settings)
    code = cli.main(["train", "--model", str(path), "--nproc", "2", "--max-steps", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    for word in words:
        assert word.format(path=path) in err, err
    assert "Traceback" not in err and err.count("scaletrain: error") == 1
    assert "model=" not in err and not (tmp_path / "runs").exists()
