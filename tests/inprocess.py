"""`scaletrain ...` run in the test's own process, as `python -m scaletrain ...` would run it.

A process that runs the command costs an import of torch (and of the compiler stack its
first optimizer imports), about 3 CPU-seconds on a 2-core machine, more than the few
steps most tests train. Where the process boundary is not what a test checks (a signal,
an exit code set by the interpreter, a launch), the same command runs here: the same
`cli.main`, its exit code returned, everything it writes to standard output and error
(file descriptors 1 and 2, so also what the processes it starts write) returned as
subprocess.run returns them (warnings among them, as a fresh interpreter shows them), in
the environment a fresh shell gives a job (launcher_free_env) and the working directory
given; all of them (and sys.path and the warning filters) restored afterwards. What
the product does once per process (a warning it gives once) it does once per test
process here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

__all__ = ["run_cli"]

_FRESH_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)
"""A fresh interpreter's warning filters (no -W, no PYTHONWARNINGS), first to last."""


def _to_stderr(
    message: Warning | str, category: type[Warning], filename: str, lineno: int,
    file: object = None, line: str | None = None,
) -> None:  # fmt: skip
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


_INSTALLED = (sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[1] / "src"))
"""Where installed packages and scaletrain's own modules live."""


def _forget_user_modules(before: set[str]) -> None:
    """Drop the modules the command imported from elsewhere (a --model or --data module
    from the test's directory): a process imports `mymodel` once, and the next test's
    `mymodel`, another file of the same name, would be the first one's."""
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if where and not where.startswith(_INSTALLED):
            del sys.modules[name]


def run_cli(
    *args: str, cwd: Path | str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `scaletrain *args` here; its exit code, standard output and standard error, as
    `subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True,
    text=True, cwd=cwd, env=env)` returns them (env: the whole environment, by default
    launcher_free_env())."""
    from scaletrain import cli
    from scaletrain.errors import use_cli_names
    from scaletrain.testing import launcher_free_env

    saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    saved_modules = set(sys.modules)
    saved_streams = sys.stdout, sys.stderr
    for stream in saved_streams:
        stream.flush()
    saved_fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            os.environ.clear()
            os.environ.update(launcher_free_env(saved_env) if env is None else env)
            if cwd is not None:
                os.chdir(cwd)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", closefd=False, encoding="utf-8", buffering=1)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False, encoding="utf-8", buffering=1)  # noqa: SIM115
            # Warnings as a fresh process shows them: on its stderr, not in pytest's record.
            with warnings.catch_warnings():
                warnings.resetwarnings()
                for action, category, module in _FRESH_FILTERS:
                    warnings.filterwarnings(action, category=category, module=module, append=True)
                warnings.showwarning = _to_stderr
                try:
                    code = cli.main(list(args))
                except SystemExit as exc:  # the parser's refusals, as the interpreter ends them
                    if isinstance(exc.code, str):
                        print(exc.code, file=sys.stderr)
                    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
        finally:
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
            os.chdir(saved_cwd)
            sys.path[:] = saved_path  # a --model module's directory, which the command adds
            _forget_user_modules(saved_modules)
            os.environ.clear()
            os.environ.update(saved_env)
            use_cli_names(False)
        said = []
        for sink in (out, err):
            sink.seek(0)
            said.append(sink.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(["scaletrain", *args], code, said[0], said[1])
