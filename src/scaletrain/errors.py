"""The errors scaletrain raises for problems a user can cause and fix.

Each message says what was received, what was expected, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "EnvironmentDetectionError",
    "LaunchError",
    "PeerFailure",
    "RankError",
    "ScaletrainError",
    "article",
    "closest",
    "interface",
    "near_fix",
    "say",
    "several",
    "spell",
    "unknown",
    "use_cli_names",
]

# Which interface the user typed: "api" (the library) or "cli" (a `scaletrain`
# command). A module global, not a ContextVar: saves run on background threads,
# which would not see a context set on the main one. Set once, at the CLI's entry.
_INTERFACE = "api"
_UNSET: Any = object()


def use_cli_names(on: bool = True) -> None:
    """Messages from here on name command-line flags (`--nproc 0`), not API fields
    (`on=False` goes back to the API's names)."""
    global _INTERFACE
    _INTERFACE = "cli" if on else "api"


def interface() -> str:
    """ "cli" inside a `scaletrain` command, else "api"."""
    return _INTERFACE


def spell(field: str, value: Any = _UNSET) -> str:
    """A setting as the user wrote it: `--max-steps 0` on the command line, `max_steps=0`
    in the library (`field` is the config field's name)."""
    if _INTERFACE == "cli":
        flag = "--" + field.replace("_", "-")
        if value is _UNSET:
            return flag
        if isinstance(value, bool):
            return flag if value else "--no-" + field.replace("_", "-")
        return f"{flag} {value}"
    return field if value is _UNSET else f"{field}={value!r}"


def say(*, api: str, cli: str) -> str:
    """The words for the interface in use: an API call or the equivalent command."""
    return cli if _INTERFACE == "cli" else api


def article(name: object) -> str:
    """`name` after its indefinite article, for a type's name in a message: "an int",
    "an OrderedDict", "a Tensor", "a UserDict" and "a OneCycleLR" (said you, won); an
    initialism by its first letter's name: "an SGD", "an LSTM", "a GRU"."""
    text = str(name)
    if text[:2].isalpha() and text[:2].isupper():
        vowel = text[0] in _LETTERS_SAID_WITH_A_VOWEL
    else:
        low = text.lower()
        vowel = low[:1] in _VOWELS and not low.startswith(_SAID_AS_CONSONANT)
    return f"{'an' if vowel else 'a'} {text}"


_VOWELS = frozenset("aeiou")
_SAID_AS_CONSONANT = ("eu", "one", "uni", "usa", "use", "usu", "uti", "uu")
_LETTERS_SAID_WITH_A_VOWEL = frozenset("AEFHILMNORSX")


def closest(value: object, choices: Sequence[str]) -> list[str]:
    """The choices a mistyped value most likely meant, at most 2: those it begins
    (`split` of split-net), else the close spellings (`gtp` of gpt); none if neither (a
    beginning of more than 2 says nothing: `n` of 9 flags)."""
    v = str(value).lower()
    starts = [c for c in choices if v and c.lower().startswith(v)]
    if 0 < len(starts) <= 2:
        return starts
    close = difflib.get_close_matches(v, list(choices), n=3, cutoff=0.6)
    # Choices one keystroke away (a letter added, dropped or changed) are each as likely:
    # `dpp` is `dp` or `ddp`.
    if len(one := [c for c in close if _one_edit(v, c.lower())]) >= 2:
        return one[:2]
    close = close[:2]
    if len(close) == 2:
        # A second spelling only when it is about as near as the first: `--nodez` is
        # `--nnodes` (0.73), not also `--model` (0.6).
        first, second = (difflib.SequenceMatcher(None, v, c.lower()).ratio() for c in close)
        if second < first - 0.1:
            close = close[:1]
    return close


def _one_edit(a: str, b: str) -> bool:
    """Whether `b` is `a` with one letter added, dropped or changed."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def near_fix(field: str, value: object, choices: Sequence[str]) -> str:
    """ " Fix: --hardware a100-sxm or --hardware a100-pcie." for the choices near a
    mistyped value, "" where none is."""
    near = closest(value, choices)
    return f" Fix: {' or '.join(spell(field, c) for c in near)}." if near else ""


def unknown(field: str, value: object, choices: Sequence[str]) -> str:
    """ "`--precision bf16` is not known; expected one of ...", and the fix where a
    choice is near."""
    return f"{spell(field, value)} is not known; expected one of {', '.join(choices)}." + near_fix(
        field, value, choices
    )


class ScaletrainError(RuntimeError):
    """Base class: a problem in the user's setup, reported as one clear paragraph."""


class ConfigError(ScaletrainError, ValueError):
    """A configuration value that cannot work (bad strategy, backend, flag...).

    `field` names the setting at fault when there is one, so a command can say where
    the value came from (a flag or a config file). `problems` holds the single errors
    an error made of several (see `several`) reports together.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        problems: Sequence[ConfigError] = (),
    ) -> None:
        super().__init__(message)
        self.field = field
        self.problems = tuple(problems)


def several(problems: Sequence[ConfigError]) -> ConfigError:
    """The problems of one set of settings as one error: each on its own line, so a user
    fixes them all in one pass (one alone is returned as it is)."""
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  - {p}" for p in problems)
    return ConfigError(f"{len(problems)} problems with the settings:\n{lines}", problems=problems)


class EnvironmentDetectionError(ScaletrainError):
    """The cluster environment is recognised but unusable as it is."""


class DatasetError(ScaletrainError, FileNotFoundError):
    """A dataset directory is missing files or holds files in the wrong format."""


class LaunchError(ScaletrainError):
    """The launcher cannot start: port in use, unreachable endpoint, missing script."""


class RankError(LaunchError):
    """A rank of `st.launch` failed: the first to fail, told once for the whole job.

    `rank` and `exit_code` name it; where it raised, `exc_type` and `exc_message` are its
    exception's, `traceback` is that rank's traceback as text, and `exception` the
    exception itself where it could be rebuilt here (it pickles), else None.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exit_code: int,
        exc_type: str | None = None,
        exc_message: str | None = None,
        traceback: str = "",
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback = traceback
        self.exception = exception


class CheckpointError(ScaletrainError):
    """A checkpoint that cannot be loaded: truncated, corrupted, foreign or mismatched."""


class PeerFailure(ScaletrainError):
    """Another rank failed and this one stops because of it: the other rank's error is
    the one to read (launchers report that one, not this)."""
