"""`make test` runs every test file: nothing under tests/ is left out of collection; the
suite's own helpers live under tests/, not in the package users install."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_file_is_collected_by_a_bare_pytest_run() -> None:
    """pytest's default norecursedirs skips directories named "dist" (and "build"):
    tests/dist, the multi-process tests, went unrun by `make test` until the
    project's own list replaced the default."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()


def test_the_packages_testing_modules_are_all_public_helpers() -> None:
    """scaletrain.testing ships in the wheel for users to test with: each of its modules
    is one its package imports. A helper only this suite uses (the report test's Chromium
    driver) lives under tests/ (tests/browser.py), and nothing in src/ imports tests/."""
    import scaletrain.testing

    package = Path(scaletrain.testing.__file__).parent
    init = ast.parse((package / "__init__.py").read_text())
    public = {n.module for n in init.body if isinstance(n, ast.ImportFrom)}
    modules = {f"scaletrain.testing.{p.stem}" for p in package.glob("*.py")} - {
        "scaletrain.testing.__init__"
    }
    assert modules - public == set()
    src = Path(scaletrain.testing.__file__).parents[1]
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "tests" or n.startswith("tests.") for n in names), path
