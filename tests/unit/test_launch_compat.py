"""launch/compat.py: the private members of torch the launcher reaches into are exactly
the ones it was checked against; a torch that changes one fails here, not in a launch."""

from __future__ import annotations

import pytest
import torch

from scaletrain.launch import compat

INSTALLED = torch.__version__.split("+")[0]
NAMES = sorted({name for recorded in compat.CHECKED.values() for name in recorded})


def test_the_installed_torch_is_one_compat_was_checked_against() -> None:
    assert INSTALLED in compat.CHECKED, (
        f"torch {INSTALLED} is not among the versions launch/compat.py was checked against "
        f"({', '.join(compat.CHECKED)}). Check each wrapper there against this torch's code, "
        f"then record its fingerprints in CHECKED."
    )


@pytest.mark.parametrize("name", NAMES)
def test_each_private_member_is_as_recorded(name: str) -> None:
    recorded = compat.CHECKED.get(INSTALLED, {})
    members = compat.patched()
    assert name in members, f"torch {INSTALLED} has no {name}: launch/compat.py needs a new way"
    assert name in recorded, f"{name} is not recorded for torch {INSTALLED}"
    assert compat.fingerprint(members[name]) == recorded[name], (
        f"torch {INSTALLED}'s {name} is not the one launch/compat.py was checked against: "
        f"read its new code, fit the wrapper to it, then record {compat.fingerprint(members[name])}"
    )


def _before(self: object, worker_group: object) -> dict[int, int]:
    return {0: 1}


def _after(self: object, worker_group: object) -> dict[int, int]:
    return {0: 2}


def _renamed(self: object, group: object) -> dict[int, int]:
    return {0: 1}


def test_a_changed_body_or_signature_changes_the_fingerprint() -> None:
    # What the recorded comparison rests on: a new body, or a new parameter list, is seen.
    signature, source = compat.fingerprint(_before)
    assert compat.fingerprint(_after)[1] != source
    assert compat.fingerprint(_renamed)[0] != signature
    assert compat.fingerprint(_before) == (signature, source)


def test_workers_are_watched_for_one_launch_only() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._start_workers
    held: list[str] = []
    seen: list[tuple[list[int], object]] = []

    class Hold:
        def __enter__(self) -> None:
            held.append("in")

        def __exit__(self, *exc: object) -> None:
            held.append("out")

    class Agent:
        _pcontext = "the workers"

    # The wrapper calls what it wraps: here a stand-in for torch's method.
    LocalElasticAgent._start_workers = _before  # type: ignore[method-assign,assignment]
    try:
        with compat.watch_workers(lambda p, w: seen.append((p, w)), hold=Hold):
            assert LocalElasticAgent._start_workers(Agent(), None) == {0: 1}  # type: ignore[arg-type]
        assert LocalElasticAgent._start_workers is _before  # type: ignore[comparison-overlap]
    finally:
        LocalElasticAgent._start_workers = original  # type: ignore[method-assign]
    assert seen == [([1], "the workers")] and held == ["in", "out"]


def test_the_declared_torch_range_is_what_is_tested_and_checked() -> None:
    # pyproject's torch range admits only releases the tests run on (the Makefile's
    # torch) and compat.py was checked against: a wider range needs a CI job on its
    # lowest release and a record in compat.CHECKED first.
    import re
    from pathlib import Path

    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    (torch_req,) = (r for d in project["dependencies"] if (r := Requirement(d)).name == "torch")
    made = re.search(r"^TORCH_VERSION := (\S+)$", (root / "Makefile").read_text(), re.M)
    assert made is not None
    assert torch_req.specifier.contains(made[1]), (torch_req, made[1])
    assert torch_req.specifier.contains(torch.__version__), (torch_req, torch.__version__)
    checked = {v.rsplit(".", 1)[0] for v in compat.CHECKED}
    admitted = {f"2.{minor}" for minor in range(40) if torch_req.specifier.contains(f"2.{minor}.0")}
    assert admitted <= checked, f"{torch_req} admits torch {sorted(admitted - checked)}, untested"
