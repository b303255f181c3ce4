"""Mistakes in a user's own model module, data and loss: each refused once, in the words
of the interface, naming the user's file and line, before any process where it can be.

Each case used to end in a traceback through scaletrain's own frames (importlib's,
the preflight's, autograd's), or in an error naming no function of the user's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import scaletrain as st
from scaletrain.errors import ConfigError, DatasetError, use_cli_names
from scaletrain.testing import launcher_variables
from scaletrain.train.model_module import check_recipe, load_recipe

GOOD = """
import torch
from torch import nn

def build():
    return nn.Linear(4, 3)

def datasets(split):
    return [(torch.zeros(4), i % 3) for i in range(8)]
"""


@pytest.fixture
def module(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "usermod.py"
    for name in [n for n in sys.modules if "usermod" in n]:
        del sys.modules[name]


def _refused(spec: str, **kw: object) -> str:
    with pytest.raises(ConfigError) as got:
        check_recipe(load_recipe(spec, **kw))  # type: ignore[arg-type]
    said = str(got.value)
    assert "scaletrain/train" not in said and "importlib" not in said, said
    return said


@pytest.mark.parametrize(
    ("source", "line", "words"),
    [
        ("import torch\nimport no_such_pkg_xyz\n", 2, "install 'no_such_pkg_xyz' into the Python"),
        ("import torch\ndef build(:\n    pass\n", 2, "correct your code at"),
        ("import torch\nraise RuntimeError('no GPU here')\n", 2, "correct your code at"),
    ],
    ids=["missing-package", "syntax", "raises"],
)
def test_a_module_that_fails_to_import_names_its_line(
    module: Path, source: str, line: int, words: str
) -> None:
    module.write_text(source)
    said = _refused(f"{module}:build")
    assert said.startswith(f"model='{module}:build': importing {module} raised ")
    assert f'File "{module}", line {line}' in said and words in said, said


def test_a_factory_that_raises_names_its_line_and_the_meta_device(module: Path) -> None:
    module.write_text(GOOD + "\ndef broken():\n    return nn.Linear(4, int('x'))\n")
    said = _refused(f"{module}:broken")
    assert "its factory, called on the meta device" in said and "ValueError" in said
    assert f"correct your code at {module}, line 12" in said, said


def test_an_initialisation_a_build_on_meta_refuses_shows_no_dispatch_frames(
    module: Path,
) -> None:
    """The check's build on meta runs under a torch-function mode (and the meta device
    is one): torch.overrides' frames between the user's line and torch.nn.init's said
    nothing the message does not."""
    module.write_text(
        GOOD + "\ndef negative():\n    return nn.init.normal_(nn.Linear(4, 3).weight, std=-1.0)\n"
    )
    said = _refused(f"{module}:negative")
    assert "std >= 0.0" in said and f"correct your code at {module}, line 12" in said, said
    assert "torch/overrides.py" not in said, said


def test_a_datasets_function_of_the_wrong_form_is_refused_before_it_is_called(
    module: Path,
) -> None:
    module.write_text(GOOD + "\ndef nothing():\n    return []\n")
    said = _refused(f"{module}:build", data=f"{module}:nothing")
    assert f"the datasets function {module}:nothing takes ()" in said
    assert "datasets(split) or datasets(split, data_dir)" in said, said


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("def data(split):\n    return [torch.zeros(4)] * 8\n", "data('train')[0] is a Tensor"),
        ("def data(split):\n    return [(1, 2, 3)] * 8\n", "data('train')[0] is a tuple of 3"),
        ("def data(split):\n    return open('/no/such/file')\n", "raised FileNotFoundError"),
    ],
    ids=["inputs-only", "triples", "raises"],
)
def test_data_that_is_not_pairs_or_raises_is_refused_with_its_name(
    module: Path, data: str, words: str
) -> None:
    module.write_text(GOOD + "\n" + data)
    recipe = load_recipe(f"{module}:build", data=f"{module}:data")
    with pytest.raises(ConfigError) as got:
        recipe.data(None, "train")
    assert words in str(got.value), got.value


def test_a_missing_data_module_is_refused_with_a_data_fix(module: Path) -> None:
    module.write_text(GOOD)
    use_cli_names()
    try:
        with pytest.raises(ConfigError) as got:
            load_recipe(f"{module}:build", data="no_such_module_xyz:ds")
    finally:
        use_cli_names(False)
    assert "--data path/to/model.py:datasets" in str(got.value), got.value


def test_a_loss_of_more_than_one_number_names_the_loss_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def per_sample(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets, reduction="none")

    for var in launcher_variables():
        monkeypatch.delenv(var)
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    with st.init() as rt:
        model = rt.setup(nn.Linear(4, 3))
        with pytest.raises(ConfigError) as got:
            rt.forward_backward(model, x, y, per_sample)
        said = str(got.value)
        assert "the loss_fn given to rt.forward_backward" in said and "per_sample" in said
        assert "a tensor of shape (8,)" in said and "loss.mean()" in said, said
        with pytest.raises(ConfigError, match=r"rt.backward's loss is a tensor of shape \(8,\)"):
            rt.backward(per_sample(model(x), y))
        rt.backward(per_sample(model(x), y).mean())  # one number: as before


def test_a_model_without_parameters_and_a_missing_name_speak_of_the_users_file(
    module: Path,
) -> None:
    # A model of no parameters failed later, in torch's optimizer ("optimizer got an
    # empty parameter list"); a missing name was said of "scaletrain_user__tmp_..._usermod",
    # the name the file was imported under, which was also the default run directory's.
    module.write_text(GOOD + "\ndef relu():\n    return nn.ReLU()\n")
    said = _refused(f"{module}:relu")
    assert "the factory's ReLU has no parameters, so there is nothing to train" in said
    said = _refused(f"{module}:nosuch")
    assert f"{module} has no 'nosuch'" in said and "scaletrain_user" not in said, said
    assert load_recipe(f"{module}:build").name == "usermod"


def test_a_factory_that_returns_no_model_says_what_it_returned_with_its_article(
    module: Path,
) -> None:
    """It said "the factory returned a int"."""
    module.write_text(GOOD + "\ndef three():\n    return 3\n\ndef table():\n    return {}\n")
    said = _refused(f"{module}:three")
    assert "the factory returned an int; expected a torch.nn.Module" in said, said
    assert "the factory returned a dict; expected" in _refused(f"{module}:table")


def test_a_file_that_is_not_python_and_a_spec_of_two_colons_say_what_is_expected(
    module: Path,
) -> None:
    # A text file was tried as a module name ("no module 'notes.txt' on the Python
    # path"); MODULE:NAME:x looked for a module named 'MODULE:NAME'.
    notes = module.parent / "notes.txt"
    notes.write_text("hello\n")
    said = _refused(str(notes))
    assert "is neither Python (a .py file) nor a Hugging Face config.json" in said, said
    module.write_text(GOOD)
    assert "expected MODULE:NAME" in _refused(f"{module}:build:x")


@pytest.mark.parametrize(
    "signature",
    ["split, *, data_dir=None", "split, data_dir", "split, data_dir=None", "split, **kw",
     "split, download=True", "*args"],
)  # fmt: skip
def test_each_datasets_form_the_check_accepts_is_called_so(module: Path, signature: str) -> None:
    # A keyword-only data_dir passed the check, then was called positionally
    # ("takes 1 positional argument but 2 were given"); a second parameter of another
    # name with a default (download=True) was handed the data directory.
    module.write_text(
        GOOD + f"\ndef data({signature}):\n"
        "    got = locals()\n"
        "    assert got.get('download', True) is True and not got.get('args', ('train',))[1:]\n"
        "    return [(torch.zeros(4), 0)] * 4\n"
    )
    recipe = load_recipe(f"{module}:build", data=f"{module}:data")
    check_recipe(recipe)
    assert len(recipe.data(None, "train")) == 4


def test_scaletrains_own_errors_inside_user_code_keep_their_words(module: Path) -> None:
    # A corpus reader's DatasetError, raised inside the user's datasets, was wrapped:
    # two Fix lines, the second ("correct your code") wrong.
    module.write_text(
        GOOD + "\nfrom scaletrain.errors import DatasetError\n"
        "def data(split):\n    raise DatasetError('no corpus at /x. Fix: --data-dir DIR.')\n"
    )
    with pytest.raises(DatasetError) as got:
        load_recipe(f"{module}:build", data=f"{module}:data").data(None, "train")
    assert str(got.value) == "no corpus at /x. Fix: --data-dir DIR."


def test_the_first_sample_is_read_without_moving_the_random_state(module: Path) -> None:
    module.write_text(
        GOOD + "\nclass Noisy(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return torch.rand(4), 0\n"
        "def data(split):\n    return Noisy()\n"
    )
    recipe = load_recipe(f"{module}:build", data=f"{module}:data")
    torch.manual_seed(0)
    recipe.data(None, "train")
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))


def test_a_windows_path_with_forward_slashes_is_a_path() -> None:
    from scaletrain.train.model_module import _resolve

    with pytest.raises(ConfigError, match="is not a file"):
        _resolve("C:/Users/me/model.py:build", field="model")
