"""argparse's refusals, as the commands' own: one line, exit 2, the fix where a flag or
choice is near (not argparse's usage block: 30 lines for `train`)."""

from __future__ import annotations

import pytest

from scaletrain import cli
from scaletrain.errors import article, closest, unknown


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["plan", "--devices", "abc"], "invalid int value: 'abc'. See: scaletrain plan --help."),
        (["train", "--precision", "bf16-mix"], "Fix: --precision bf16-mixed."),
        (["train", "--strategy", "pipe"], "Fix: --strategy pipeline."),
        (["train", "--recipe", "gtp"], "Fix: --recipe gpt."),
        (["tain"], "Fix: scaletrain train."),
        (["train", "--max-stpes", "3"], "Fix: --max-steps (not --max-stpes)."),
        (["plan", "--hardwre=x", "--devices", "2"], "Fix: --hardware (not --hardwre=x)."),
        (
            ["train", "--bogus", "1"],
            "unrecognized arguments: --bogus 1. See: scaletrain train --help.",
        ),
        # A word before the command is the whole CLI's.
        (["--bogus", "train"], "scaletrain: error: unrecognized arguments: --bogus. See:"),
        (["job"], "the following arguments are required: KIND. See: scaletrain job --help."),
        # A subcommand's subcommand: its own flags, its own --help.
        (["job", "sbatch", "--nodez", "2"], "scaletrain job sbatch: error: unrecognized"),
        (["job", "sbatch", "--nodez", "2"], "Fix: --nnodes (not --nodez)."),
        # A beginning of many flags names none; each flag by its first long name, once.
        (["train", "-n", "3"], "See: scaletrain train --help."),
        (["train", "--no", "3"], "See: scaletrain train --help."),
        (["launch", "--nproc", "1", "s.py"], "Fix: --nproc-per-node (not --nproc)."),
        # Flags from elsewhere (torchrun, another command): what to pass here instead, not
        # the nearest spelling (issue 26).
        (["train", "--log-dir", "x"], "Fix: --out DIR: a run keeps its logs"),
        (["train", "--nproc-per-node", "2"], "Fix: --nproc N"),
        (["train", "--master-port", "29500"], "--rdzv-endpoint HOST:PORT replaces"),
        (["launch", "--standalone", "s.py"], "Fix: leave it out: one node is the default"),
        (["launch", "--master-port", "29500", "s.py"], "--rdzv-endpoint HOST:PORT replaces"),
        (["launch", "--master_addr", "h", "s.py"], "--rdzv-endpoint HOST:PORT replaces"),
        (["job", "sbatch", "--nproc-per-node", "4"], "or --nproc N for the processes"),
        (["train", "--no-overwrite"], "Fix: leave out --no-overwrite: --overwrite is off"),
        (["job", "sbatch", "--no-fork-optimizer"], "leave out --no-fork-optimizer"),
    ],
)
def test_a_parser_refusal_is_one_line_with_the_fix(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert words in err and err.count("error:") == 1


def test_the_choices_a_typo_meant() -> None:
    assert closest("bf16", ["32", "bf16-mixed", "bf16-true"]) == ["bf16-mixed", "bf16-true"]
    assert closest("gtp", ["convnet", "gpt", "wrn"]) == ["gpt"]
    assert closest("fp8", ["32", "bf16-mixed"]) == []
    assert closest("n", ["nproc", "nnodes", "no-ledger", "node-rank"]) == []
    # One keystroke from two choices: both (`dpp` said only `dp`, not the likelier `ddp`).
    strategies = ["ddp", "fsdp", "tensor", "pipeline", "dp", "model-parallel", "single"]
    assert sorted(closest("dpp", strategies)) == ["ddp", "dp"]
    assert closest("nodez", ["nnodes", "model", "nproc"]) == ["nnodes"]
    assert unknown("recipe", "gtp", ["convnet", "gpt"]).endswith("Fix: recipe='gpt'.")


def test_plans_take_a_precision_by_the_names_st_init_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import scaletrain as st

    p = st.plan("gpt", devices=8, hardware="h100-sxm", precision="bf16")
    assert "precision bf16-mixed" in p.table()
    code = cli.main(
        [
            "plan",
            "--recipe",
            "gpt",
            "--devices",
            "2",
            "--hardware",
            "h100-sxm",
            "--precision",
            "bf16x",
        ]
    )
    assert code == 2
    assert "Fix: --precision bf16-mixed." in capsys.readouterr().err


def test_other_spellings_of_a_value_are_taken_by_every_interface(tmp_path: object) -> None:
    from pathlib import Path

    from scaletrain.settings import read_config_file
    from scaletrain.train.config import TrainConfig

    ns = cli.build_parser("train").parse_args(["train", "--precision", "bf16"])
    assert ns.precision == "bf16-mixed"
    assert cli.train_config(ns).precision == "bf16-mixed"
    config = Path(str(tmp_path)) / "run.yaml"
    config.write_text("precision: fp32\n")
    assert read_config_file(config, TrainConfig)["precision"] == "32"


def test_python_m_launch_refuses_in_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    from scaletrain.launch.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--nproc", "1", "train.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert "python -m scaletrain.launch: error:" in err and "Fix: --nproc-per-node" in err


@pytest.mark.parametrize(
    ("args", "wrong"),
    [
        (["train", "--log-dir", "x"], "--log-every"),
        (["job", "sbatch", "--nproc-per-node", "4"], "Fix: --gpus-per-node (not"),
        (["train", "--no-overwrite"], "Fix: --overwrite (not"),
    ],
)
def test_a_flag_from_elsewhere_is_not_taken_for_a_typo(
    capsys: pytest.CaptureFixture[str], args: list[str], wrong: str
) -> None:
    with pytest.raises(SystemExit):
        cli.main(args)
    assert wrong not in capsys.readouterr().err


def test_a_types_name_in_a_message_takes_the_article_it_is_said_with() -> None:
    """The messages that name a value's type said "a int", "a AdamW", "a OrderedDict"."""
    names = ["int", "OrderedDict", "AdamW", "Tensor", "list", "UserDict", "OneCycleLR"]
    assert [article(n) for n in names] == [
        "an int", "an OrderedDict", "an AdamW", "a Tensor", "a list", "a UserDict",
        "a OneCycleLR",
    ]  # fmt: skip
    # An initialism by its first letter's name.
    assert [article(n) for n in ["SGD", "LSTM", "MSELoss", "GRU", "URL"]] == [
        "an SGD", "an LSTM", "an MSELoss", "a GRU", "a URL",
    ]  # fmt: skip
