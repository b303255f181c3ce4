"""One declaration per setting: a config dataclass becomes CLI flags and a config file format.

A config is a `@dataclass(kw_only=True, slots=True)` whose fields each carry a
one-line docstring (the string literal right after the field, as in PEP 257's
attribute docstrings). From that single declaration:

- `add_flags(parser, Config)` adds one `--field-name` flag per field, its help the
  docstring, its type and choices the annotation (`int`, `float`, `str`, `bool`,
  `Literal[...]`, optionally `| None`), its default shown from the dataclass (a field
  of another type has no flag: it is excluded, and given one by hand if at all);
- `read_config_file(path, Config)` reads a YAML (or JSON: YAML is a superset) file
  holding the same field names and checks every value's type;
- `typed_flags(namespace)` returns only the flags the user actually typed, so flags
  override a config file and everything else keeps the dataclass default;
- `build_config(Config, file, flags)` makes the config from both, every problem of
  either reported in one error.

torchtitan builds its CLI from its config dataclasses with tyro; this is the small
subset a flat config needs, with no dependency and no import of torch (so `--help`
answers at once).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import re
import sys
import textwrap
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, get_args, get_origin

from scaletrain.errors import ConfigError, article, closest, several
from scaletrain.exitcodes import EXIT_USAGE
from scaletrain.spellings import ALIASES, canonical

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = [
    "RESERVED_FILE_KEYS",
    "FieldSpec",
    "Parser",
    "add_flags",
    "build_config",
    "command_parser",
    "field_docs",
    "field_specs",
    "read_config_file",
    "typed_flags",
]

RESERVED_FILE_KEYS = ("run",)
"""Keys a config file may hold besides the fields: `run` (facts a finished run wrote
beside its settings in config.json: world size, versions...), read by no one."""

_SUPPRESS: Any = argparse.SUPPRESS
_C = TypeVar("_C")


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """What a field's annotation and docstring say about it."""

    name: str
    base: type
    """int, float, str or bool (the Literal's value type for Literal fields); object
    for an annotation no flag or config-file value can have (a mapping, say)."""
    optional: bool
    """The annotation allows None."""
    choices: tuple[Any, ...] | None
    """The Literal's values, else None."""
    default: Any
    doc: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _unpack(annotation: Any) -> tuple[type, bool, tuple[Any, ...] | None]:
    args = get_args(annotation)
    optional = False
    if get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        optional = len(members) < len(args)
        if len(members) != 1:
            raise TypeError(f"unsupported config annotation {annotation!r}")
        annotation = members[0]
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        return type(choices[0]), optional, tuple(choices)
    if annotation in (int, float, str, bool):
        return annotation, optional, None
    return object, optional, None


@functools.cache
def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """Every field of the config dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=False)
    docs = field_docs(cls)
    specs = []
    for f in dataclasses.fields(cls):
        base, optional, choices = _unpack(hints[f.name])
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring")
        default = f.default if f.default is not dataclasses.MISSING else None
        specs.append(FieldSpec(f.name, base, optional, choices, default, docs[f.name]))
    return tuple(specs)


def _help(spec: FieldSpec) -> str:
    text = spec.doc
    if spec.default is not None and spec.base is not bool and "default" not in text.lower():
        text += f" (default: {spec.default})"
    # argparse formats help with %-style: a literal % must be doubled.
    return text.replace("%", "%%")


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    metavars: Mapping[str, str] = {},
    exclude: Collection[str] = (),
    groups: Sequence[tuple[str, Sequence[str]]] = (),
    switches: Collection[str] = (),
    names: Mapping[str, Sequence[str]] = {},
) -> dict[str, Any]:
    """One flag per field of `cls` (a parser or an argument group), except the fields
    named in `exclude`. Defaults are not stored in the namespace: `typed_flags` tells
    what the user typed. Returns the sections made for `groups`, by title, for flags
    added by hand.

    `groups` are (title, field names) pairs: each becomes a section of --help, its
    fields in the order given (fields in no group follow, on `parser` itself).
    `switches` are bool fields that ask for something once, for this start
    (`--overwrite`): they are off unless given, so they get only the flag that turns
    them on; a `--no-` form would do nothing. `names` gives a field option strings of
    its own instead of `--field-name` (other spellings a user brings: `-m`, torchrun's
    `--nproc_per_node`), the first long one shown as its flag.
    """
    placed: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    for title, fields in groups:
        shown = [n for n in fields if n not in exclude]
        if shown:
            section = sections[title] = parser.add_argument_group(title)
            placed.update(dict.fromkeys(shown, section))
    specs = {s.name: s for s in field_specs(cls)}
    unknown = [n for n in placed if n not in specs]
    if unknown:
        raise TypeError(f"flag groups name {unknown}, which are not fields of {cls.__name__}")
    order = [*placed, *(n for n in specs if n not in placed)]
    for name in order:
        spec = specs[name]
        if spec.name in exclude:
            continue
        if spec.base is object:
            raise TypeError(f"{cls.__name__}.{spec.name} can have no flag: exclude it")
        options = list(names.get(spec.name, (spec.flag,)))
        flag = next(o for o in options if o.startswith("--"))
        target = placed.get(spec.name, parser)
        kwargs: dict[str, Any] = {"dest": spec.name, "default": _SUPPRESS, "help": _help(spec)}
        if spec.base is bool:
            kwargs["action"] = (
                "store_true" if spec.name in switches else argparse.BooleanOptionalAction
            )
        else:
            # Other spellings (--precision bf16) become the value's own name before
            # argparse checks the choices.
            kwargs["type"] = (
                functools.partial(_spelled, spec.name, spec.base)
                if spec.name in ALIASES
                else spec.base
            )
            kwargs["metavar"] = (metavars or {}).get(spec.name, spec.name.upper())
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
                kwargs["metavar"] = "{" + ",".join(map(str, spec.choices)) + "}"
        target.add_argument(*options, **kwargs)
        if spec.base is bool and spec.name in switches and isinstance(parser, Parser):
            off = "--no-" + flag[2:]
            parser.elsewhere = {
                **parser.elsewhere,
                off: f"leave out {off}: {flag} is off unless given",
            }
    return sections


def _spelled(name: str, base: type, text: str) -> Any:
    return canonical(name, base(text))


def typed_flags(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` whose flags were given on the command line."""
    return {s.name: getattr(ns, s.name) for s in field_specs(cls) if hasattr(ns, s.name)}


_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
"""A number as YAML 1.2 (and JSON) reads it. PyYAML reads YAML 1.1, where a number needs a
dot before its exponent: `lr: 1e-2` arrives as the string '1e-2'."""


def _type_fix(spec: FieldSpec, value: Any) -> str:
    """How to write `spec` in a config file, for a value of the wrong type."""
    name = spec.name
    if spec.base is bool:
        return f"{name}: true or {name}: false"
    number: float | None = None
    if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, str) and _YAML12_FLOAT.fullmatch(value.strip())
    ):
        number = float(value)
    if spec.base is int:
        if number is not None and number.is_integer():
            # Digits arrive as a string only when quoted; 1e3 arrives as one unquoted.
            quoted = isinstance(value, str) and value.strip().lstrip("+-").isdigit()
            return f"{name}: {int(number)}" + (" (a number, without quotes)" if quoted else "")
        if number is not None:
            return f"a whole number, e.g. {name}: {round(number)}"
    example = spec.default if spec.default is not None else {int: 1, float: 0.1}.get(spec.base)
    return f"e.g. {name}: {example}"


def _coerce(spec: FieldSpec, value: Any, where: str) -> Any:
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(
            f"{where}: {spec.name} is null, but it needs a value ({spec.doc}). Fix: give it "
            f"a value or remove the line to use the default ({spec.default!r}).",
            field=spec.name,
        )
    expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    ok = False
    if spec.base is bool:
        ok = isinstance(value, bool)
    elif spec.base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif spec.base is float:
        if isinstance(value, str) and _YAML12_FLOAT.fullmatch(value.strip()):
            value = float(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        # YAML reads `precision: 32` as a number: a string field takes its text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(
            f"{where}: {spec.name}: {value!r} is not {expected[spec.base]} ({spec.doc}). "
            f"Fix: {_type_fix(spec, value)}.",
            field=spec.name,
        )
    value = canonical(spec.name, value)
    if spec.choices is not None and value not in spec.choices:
        near = closest(value, [str(c) for c in spec.choices])
        fix = f" Fix: {' or '.join(f'{spec.name}: {c}' for c in near)}." if near else ""
        raise ConfigError(
            f"{where}: {spec.name}: {value!r} is not one of {', '.join(map(repr, spec.choices))}."
            + fix,
            field=spec.name,
        )
    return value


def read_config_file(
    path: str | Path, cls: type, *, problems: list[ConfigError] | None = None
) -> dict[str, Any]:
    """The fields set in the YAML/JSON file `path`, checked against `cls`'s fields.

    Every wrong value and unknown key is found in one pass: raised together as one
    ConfigError, or with `problems` appended to it (the values returned are then the
    good ones). A file that cannot be read as a mapping raises at once.
    """
    import yaml

    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the config file {file}: {exc.strerror or exc}. Expected a YAML or "
            "JSON file of settings (e.g. the config.json a run wrote)."
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {file} is not valid YAML/JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {file} holds {article(type(data).__name__)}; expected a mapping of "
            "setting: value, e.g. `recipe: gpt` and `max_steps: 100` on separate lines."
        )
    specs = {s.name: s for s in field_specs(cls) if s.base is not object}
    values: dict[str, Any] = {}
    unknown = []
    found: list[ConfigError] = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in RESERVED_FILE_KEYS:
            continue
        if name not in specs:
            unknown.append(str(key))
            continue
        try:
            values[name] = _coerce(specs[name], value, str(file))
        except ConfigError as exc:
            found.append(exc)
    if unknown:
        import difflib

        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key.replace("-", "_"), list(specs), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        found.append(
            ConfigError(
                f"config file {file} sets {', '.join(hints)}, which "
                f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}. Known "
                f"settings: {', '.join(specs)}."
            )
        )
    if problems is not None:
        problems.extend(found)
    elif found:
        raise several(found)
    return values


def build_config(cls: type[_C], file: str | Path | None, flags: Mapping[str, Any]) -> _C:
    """`cls(**values)` from the config `file` (if any) and the `flags` typed, which win.

    Every problem is reported in one ConfigError, not one per try: the file's wrong
    values and unknown keys, then those `cls` refuses (it raises a ConfigError whose
    `problems` are all it found), each of the latter saying when the value came from
    the file.
    """
    problems: list[ConfigError] = []
    values = {} if file is None else read_config_file(file, cls, problems=problems)
    values.update(flags)
    config = None
    try:
        config = cls(**values)
    except ConfigError as exc:
        for problem in exc.problems or (exc,):
            if file is not None and problem.field is not None and problem.field not in flags:
                problem = ConfigError(
                    f"{problem} (The value comes from {file}.)", field=problem.field
                )
            problems.append(problem)
    if problems:
        raise several(problems)
    assert config is not None
    return config


# -- parsers ------------------------------------------------------------------------

_CHOICE = re.compile(
    r"argument (?P<flag>[^:]+): invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)"
)


class Parser(argparse.ArgumentParser):
    """argparse's refusals in one line, as the commands' own errors are: what was
    received and what is expected (argparse's words), the fix where a choice is near,
    else where the flags are described; not argparse's usage block (30 lines for
    `train`) above it."""

    elsewhere: Mapping[str, str] = {}
    """Flags this command does not take that users bring from elsewhere (torchrun's
    `--standalone`, another command's flag) -> the fix in this command's terms, said
    instead of the nearest spelling (`--log-dir` is not a misspelt `--log-every`).
    Keys are long flags with dashes; `--a_b` is looked up as `--a-b`."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """argparse drops a write that fails; one to a stdout whose reader went away
        (`--help | head`) is raised, for the command's own rule (cli.main: exit 141)."""
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
        except BrokenPipeError:
            if file is sys.stdout:
                raise
        except (AttributeError, OSError):
            pass

    def error(self, message: str) -> NoReturn:
        m = _CHOICE.fullmatch(message)
        said: list[str] = []
        if m is not None:
            choices = [c.strip().strip("'") for c in m["choices"].split(",")]
            names = m["flag"].split("/")
            flag = next((n for n in names if n.startswith("--")), names[-1])
            said = [
                f"{flag} {c}" if flag.startswith("-") else f"{self.prog} {c}"
                for c in closest(m["value"], choices)
            ]
        self.refuse(message, " or ".join(said))

    def refuse(self, message: str, fix: str = "") -> NoReturn:
        """Exit 2 with one line: the message, then the fix, else where the flags are."""
        then = f"Fix: {fix}." if fix else f"See: {self.prog} --help."
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}. {then}\n")

    def unrecognized(self, extra: list[str]) -> NoReturn:
        """Flags this command does not take, with the ones of its that are near."""
        # Each flag by its first long name (--nproc-per-node, not also --nproc_per_node).
        known: dict[str, str] = {}
        for action in self._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            known.update({o[2:]: longs[0] for o in longs})

        def near(flag: str) -> str:
            name = flag.split("=")[0]
            instead = self.elsewhere.get(name.replace("_", "-"))
            if instead is not None:
                return instead
            found = dict.fromkeys(known[k] for k in closest(name[2:], list(known)))
            return f"{' or '.join(found)} (not {flag})" if found else ""

        fixes = [f for flag in extra if flag.startswith("--") and (f := near(flag))]
        self.refuse(f"unrecognized arguments: {' '.join(extra)}", ", ".join(fixes))


def command_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> Parser:
    """The parser of the (sub)command `ns` chose, down every level (`job sbatch`): the
    flags a typo is compared with, and whose --help the refusal names."""
    current = parser
    while current._subparsers is not None:
        chosen = None
        for action in current._subparsers._group_actions:
            choices = getattr(action, "choices", None) or {}
            picked = getattr(ns, action.dest, None) if action.dest else None
            if isinstance(picked, str) and isinstance(choices.get(picked), Parser):
                chosen = choices[picked]
        if chosen is None:
            break
        current = chosen
    assert isinstance(current, Parser)
    return current
