"""Errors the user's own code raises while scaletrain runs it (a model module's import,
factory or data): one ConfigError naming the user's file and line, not a traceback
through scaletrain's frames."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from scaletrain.errors import ConfigError

__all__ = ["raised_in_user_code", "user_code_error"]


def _frames(exc: BaseException) -> list[tuple[Any, int, str]]:
    """(frame, line, module name) of each frame of the traceback, outermost first."""
    return [
        (frame, lineno, str(frame.f_globals.get("__name__", "")))
        for frame, lineno in traceback.walk_tb(exc.__traceback__)
    ]


def _ours(module: str, filename: str) -> bool:
    """A frame of scaletrain's or of Python's import machinery. Frames are told apart by
    their module's name, not their file's path (symlinks, a project inside its
    virtualenv)."""
    return (
        module == "scaletrain" or module.startswith(("scaletrain.", "importlib.", "_frozen"))
        or module == "importlib" or filename.startswith("<frozen ")
    )  # fmt: skip


_TORCH_INTERNALS = ("torch._", "torch.utils._", "torch.utils.flop_counter", "torch.overrides",
                    "torch.distributed._tools", "torch.nn.modules.module")  # fmt: skip
"""torch's dispatch (a torch-function mode's handling among it), fake-tensor, counting
and module-call machinery (and torch's own `torch._check`): frames between a user's
line and the check that raised, which say less than the message does."""


def _own_frames(exc: BaseException) -> traceback.StackSummary:
    """The traceback's frames that are neither scaletrain's nor Python's import
    machinery (`_ours`): the user's code and what it called."""
    user = [(f, n) for f, n, m in _frames(exc) if not _ours(m, f.f_code.co_filename)]
    return traceback.StackSummary.extract(iter(user))


def _outside_libraries(summary: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """The frames of files outside the installed packages and the standard library:
    the user's own."""
    import sysconfig

    libraries = tuple(
        os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "purelib", "platlib")
    )
    return [
        f for f in summary if not f.filename.startswith(libraries) and f.filename[:1] != "<"
    ]  # generated code ("<string>": a dataclass's __init__) is no one's own line


def raised_in_user_code(exc: BaseException) -> bool:
    """Whether `exc` is the user's own code's error: their code (a file outside
    scaletrain, the installed packages and the standard library) is on its traceback,
    and it was not raised in scaletrain's own (a dispatch mode or hook of scaletrain's
    beneath their forward: scaletrain's bug, told by its traceback)."""
    frames = _frames(exc)
    if frames and _ours(frames[-1][2], frames[-1][0].f_code.co_filename):
        return False
    return bool(_outside_libraries(_own_frames(exc)))


def user_code_error(exc: BaseException, doing: str, field: str, fix: str = "") -> ConfigError:
    """A ConfigError for an exception the user's own code raised while `doing`: its type
    and message, and the traceback from the first frame that is neither scaletrain's nor
    Python's import machinery (the user's code and what it called), so the one message
    printed points at their line rather than at ours (`_own_frames`)."""
    summary = _own_frames(exc)
    own = _outside_libraries(summary)  # the user's own line: the deepest of these
    kept = [
        (f, n) for f, n, m in _frames(exc)
        if not _ours(m, f.f_code.co_filename) and not m.startswith(_TORCH_INTERNALS)
        and m != "torch"
    ]  # fmt: skip
    shown = "".join(traceback.StackSummary.extract(iter(kept)).format()[-8:])
    at = f"{own[-1].filename}, line {own[-1].lineno}" if own else ""
    if isinstance(exc, SyntaxError) and exc.filename:  # its own place: no frame shows it
        shown += f'  File "{exc.filename}", line {exc.lineno}\n    {(exc.text or "").strip()}\n'
        at = f"{exc.filename}, line {exc.lineno}"
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing:
        fix = (
            f"install {missing!r} into the Python that runs scaletrain ({sys.executable}), "
            "or, if it is a module of your own, add its directory to PYTHONPATH"
        )
    else:
        fix = (f"correct your code at {at}" if at else "correct your code") + (
            f". {fix}" if fix else ""
        )
    return ConfigError(
        f"{doing} raised {type(exc).__name__}: {exc}\n{shown.rstrip()}\nFix: {fix}.".replace(
            "\n\n", "\n"
        ),
        field=field,
    )
