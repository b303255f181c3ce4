"""Mesh shapes and compositions are checked before any process group exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scaletrain as st
from scaletrain.runtime import parse_mesh
from scaletrain.strategies import FSDPxTP, PipelinexDDP, compose, resolve_strategy


def test_mesh_from_dict_or_string_in_canonical_order() -> None:
    assert parse_mesh({"tp": 2, "dp": 2}, 4) == {"dp": 2, "tp": 2}
    assert parse_mesh("dp=2, pp=2", 4) == {"pp": 2, "dp": 2}
    assert parse_mesh(None, 4) is None


def test_mesh_whose_product_differs_from_the_world_size_says_so() -> None:
    with pytest.raises(st.ConfigError) as info:
        parse_mesh({"dp": 2, "tp": 2}, 2)
    message = str(info.value)
    assert "4 ranks" in message and "world size 2" in message and "start 4 processes" in message


@pytest.mark.parametrize(
    ("mesh", "words"),
    [
        ({"dp": 2, "ep": 2}, "'ep'"),
        ("dp=two", "NAME=SIZE"),
        ({"dp": 0, "tp": 4}, "sizes must be >= 1"),
    ],
)
def test_bad_meshes_name_the_problem(mesh: object, words: str) -> None:
    with pytest.raises(st.ConfigError, match=words):
        parse_mesh(mesh, 4)  # type: ignore[arg-type]


def test_no_module_sets_another_modules_names_at_import() -> None:
    """resolve_strategy composes through mesh.py's compose, imported where it is used:
    mesh.py once set `base._COMPOSE = compose` at its own import, so what a name in
    base.py meant depended on which module had been imported first."""
    patches = []
    for path in sorted((Path(st.__file__).parent).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        modules = {
            (alias.asname or alias.name).split(".")[0]
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                owner = target.value if isinstance(target, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id in modules:
                    patches.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    assert patches == []


def test_compositions() -> None:
    assert isinstance(resolve_strategy("fsdp", mesh={"dp": 2, "tp": 2}), FSDPxTP)
    assert isinstance(resolve_strategy("tensor", mesh={"dp": 2, "tp": 2}), FSDPxTP)
    assert isinstance(resolve_strategy("ddp", mesh={"dp": 2, "pp": 2}), PipelinexDDP)
    pipe = st.Pipeline(schedule="gpipe", microbatches=2)
    composite = resolve_strategy(pipe, mesh={"dp": 2, "pp": 2})
    # A copy: the composite owns the levers, and the user's object keeps its settings.
    assert isinstance(composite, PipelinexDDP) and composite.pipeline == pipe
    # A mesh with data parallel only needs no composite.
    assert isinstance(resolve_strategy("fsdp", mesh={"dp": 4}), st.FSDP)


@pytest.mark.parametrize(
    ("strategy", "mesh", "words"),
    [
        ("ddp", {"dp": 2, "tp": 2}, "strategy='fsdp'"),
        ("fsdp", {"dp": 2, "pp": 2}, "strategy='ddp'"),
        ("fsdp", {"pp": 2, "dp": 1, "tp": 2}, "Drop one of tp/pp"),
        ("dp", {"dp": 2, "tp": 2}, "strategy='fsdp'"),
    ],
)
def test_unsupported_compositions_fail_with_the_fix(
    strategy: str, mesh: dict[str, int], words: str
) -> None:
    with pytest.raises(st.ConfigError, match=words):
        compose(resolve_strategy(strategy), mesh)
