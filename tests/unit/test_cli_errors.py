"""argparse's refusals, as the commands' own: one line, exit 2, the fix where a flag or
choice is near (not argparse's usage block: 30 lines for `train`)."""

from __future__ import annotations

import pytest

from scaletrain import cli
from scaletrain.errors import closest, unknown


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["plan", "--devices", "abc"], "invalid int value: 'abc'. See: scaletrain plan --help."),
        (["train", "--precision", "bf16"], "Fix: --precision bf16-mixed or --precision bf16-true."),
        (["train", "--recipe", "gtp"], "Fix: --recipe gpt."),
        (["tain"], "Fix: scaletrain train."),
        (["train", "--max-stpes", "3"], "Fix: --max-steps (not --max-stpes)."),
        (["plan", "--hardwre=x", "--devices", "2"], "Fix: --hardware (not --hardwre=x)."),
        (
            ["train", "--bogus", "1"],
            "unrecognized arguments: --bogus 1. See: scaletrain train --help.",
        ),
        (["job"], "the following arguments are required: KIND. See: scaletrain job --help."),
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
    assert unknown("recipe", "gtp", ["convnet", "gpt"]).endswith("Fix: recipe='gpt'.")


def test_plans_take_a_precision_by_the_names_st_init_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import scaletrain as st

    p = st.plan("gpt", devices=8, hardware="h100-sxm", precision="bf16")
    assert "precision bf16-mixed" in p.table()
    code = cli.main(["plan", "--recipe", "gpt", "--devices", "2", "--precision", "bf16x"])
    assert code == 2
    assert "Fix: --precision bf16-mixed." in capsys.readouterr().err
