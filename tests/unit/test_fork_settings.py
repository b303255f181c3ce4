"""The new settings of issue 8 (--fork, --fork-optimizer, --overwrite) and the
CheckpointManager's arguments: each mistake is refused at once, in the caller's words."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import scaletrain as st
from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.testing import launcher_variables
from scaletrain.train.config import TrainConfig


@pytest.fixture
def cli_words() -> Iterator[None]:
    use_cli_names()
    yield
    use_cli_names(False)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"fork": " "}, "fork=' ': expected the directory of the new run"),
        ({"out": "runs/a", "fork": "runs/a/"}, "names the run it forks from"),
        ({"fork_optimizer": True}, "but no fork was given"),
    ],
)
def test_fork_mistakes_in_the_library(settings: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**settings)  # type: ignore[arg-type]


def test_fork_mistakes_on_the_command_line(cli_words: None) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(out="runs/a", fork="runs/a")
    assert "--fork runs/a names the run it forks from (--out runs/a)" in str(info.value)
    assert "--fork runs/a-fork" in str(info.value)
    with pytest.raises(ConfigError, match="--fork-optimizer takes the optimizer state"):
        TrainConfig(fork_optimizer=True)


def test_manager_arguments_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from scaletrain.checkpoint import CheckpointManager

    for var in launcher_variables():
        monkeypatch.delenv(var)
    with st.init() as rt:
        with pytest.raises(ConfigError, match=r"every=0\): expected an int >= 1"):
            CheckpointManager(rt, tmp_path, every=0)
        with pytest.raises(ConfigError, match=r"keep=0\): expected an int >= 1"):
            CheckpointManager(rt, tmp_path, keep=0)
        manager = CheckpointManager(rt, tmp_path, every=5, keep=2)
        assert [s for s in range(12) if manager.due(s)] == [5, 10]
        assert manager.resume().path is None  # an empty folder: nothing to resume
        manager.close()
