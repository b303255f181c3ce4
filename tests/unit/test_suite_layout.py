"""`make test` runs every test file: nothing under tests/ is left out of collection."""

from __future__ import annotations

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
