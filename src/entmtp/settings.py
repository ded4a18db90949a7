"""Command-line flags made from dataclass fields, so a setting is declared once: as a field, with its help.

    @dataclass(frozen=True)
    class Spec:
        dtype: str = setting("auto", choices=("auto", "float32"), help="the weights' dtype")
        pack: bool = setting(True, help="leave the linear layers unpacked")  # flag: --no-pack
        kv: str = "auto"  # a plain field: no flag

`add_arguments(parser, Spec)` adds one argument per `setting` field; `from_args(Spec, args)` reads them back
into a `Spec`. The rules, the same for every class:

  flag     `--field-name`; a bool that is True by default gets `--no-field-name`, which turns it off
           (`from_args` keeps the field's sense); `flag=` names another.
  dest     argparse's own (the flag without dashes, `-` as `_`), so `args.no_pack` still reads the flag.
  type     the default's type, else the annotation's first of int, float, str; `type=` names another (a
           parser such as `csv`). `repeat=True`: the flag may be given again, each value appended.
  help     the field's; `%(default)s` in it prints the default.

A command that takes a setting with another default or help passes `changes={"dtype": {...}}` (argparse
keywords, and `flag` for its own spelling); `only=`/`skip=` choose the fields, `prefix=` puts a word before
each flag's name (`--eval-prompts`). A field declared with `add=`/`read=` (a composite setting such as prompt
lookup's several flags) adds and reads its own arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

KEY = "entmtp.setting"  # the field metadata key that holds a field's `Setting`
MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one field appears on the command line (the arguments of `setting`)."""

    help: str | None = None
    flag: str | None = None
    choices: tuple | None = None
    type: Callable | None = None
    metavar: str | None = None
    repeat: bool = False
    add: Callable | None = None  # add(parser, changes): a composite setting adds its own arguments
    read: Callable | None = None  # read(args) -> the field's value


def setting(
    default=MISSING,
    *,
    help: str | None = None,
    flag: str | None = None,
    choices: Iterable | None = None,
    type: Callable | None = None,
    metavar: str | None = None,
    repeat: bool = False,
    add: Callable | None = None,
    read: Callable | None = None,
    default_factory=MISSING,
):
    """A dataclass field that is also a command-line flag (the module docstring says how)."""
    meta = Setting(
        help, flag, tuple(choices) if choices is not None else None, type, metavar, repeat, add, read
    )
    return dataclasses.field(default=default, default_factory=default_factory, metadata={KEY: meta})


def settings_of(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """(field, its Setting) for every field of `cls` declared with `setting`, in declaration order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata]


def flag_of(f: dataclasses.Field, s: Setting, prefix: str = "") -> str:
    """The field's flag: `--PREFIXname`, `--no-PREFIXname` for a bool that is on by default, or the one it
    names (`flag=`, whatever the prefix)."""
    if s.flag is not None:
        return s.flag
    name = prefix + f.name.replace("_", "-")
    return f"--no-{name}" if _negated(f) else f"--{name}"


def dest_of(f: dataclasses.Field, s: Setting, prefix: str = "") -> str:
    """Where argparse keeps the flag's value: its own rule, the flag without dashes (`args.no_pack`)."""
    return flag_of(f, s, prefix).lstrip("-").replace("-", "_")


def add_arguments(
    parser,
    cls,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    prefix: str = "",
    changes: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """One argument per `setting` field of `cls` (`only` these, none of `skip`), its flag's name after
    `prefix` (`eval-`). `changes`: per field name, argparse keywords that replace the field's own (another
    default, help or choices for this command), and `flag`: this command's own spelling of the flag (its
    value still read by `from_args`)."""
    wanted = set(only) if only is not None else None
    changes = changes or {}
    for f, s in settings_of(cls):
        if (wanted is not None and f.name not in wanted) or f.name in skip:
            continue
        change = dict(changes.get(f.name, {}))
        if s.add is not None:
            s.add(parser, change)
            continue
        flag = change.pop("flag", flag_of(f, s, prefix))
        parser.add_argument(flag, dest=dest_of(f, s, prefix), **{**_keywords(f, s), **change})


def from_args(cls, args: argparse.Namespace, *, prefix: str = "", **values):
    """A `cls` from parsed `args`: each `setting` field its flag's value (a flag this command does not have:
    the field's default), then `values` on top (fields a command sets itself, plain fields too)."""
    kwargs = {}
    for f, s in settings_of(cls):
        if f.name in values:
            continue
        if s.read is not None:
            kwargs[f.name] = s.read(args)
            continue
        dest = dest_of(f, s, prefix)
        if hasattr(args, dest):
            value = getattr(args, dest)
            kwargs[f.name] = (not value) if _negated(f) else value  # --no-pack given: pack=False
    return cls(**kwargs, **values)


def _negated(f: dataclasses.Field) -> bool:
    """A bool field that is on by default: its flag turns it off."""
    return f.default is True


def _keywords(f: dataclasses.Field, s: Setting) -> dict:
    """argparse's keywords for a plain field."""
    default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(default, bool):  # the flag says the opposite of the default: given, it is True
        return dict(action="store_true", help=s.help)
    kw: dict[str, Any] = dict(default=default, help=s.help)
    if s.repeat:
        kw["action"] = "append"
    kw["type"] = s.type or _type_of(f, default)
    if s.choices is not None:
        kw["choices"] = list(s.choices)
    if s.metavar is not None:
        kw["metavar"] = s.metavar
    return kw


_TYPES = {"int": int, "float": float, "str": str}


def _type_of(f: dataclasses.Field, default) -> Callable:
    """The default's type, else the annotation's first of int, float and str (`int | None` -> int), an item's
    for a list (`list[str] | None` -> str: a repeated flag's)."""
    if type(default) in _TYPES.values():
        return type(default)
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for part in annotation.replace(" ", "").split("|"):
        part = part.removeprefix("list[").removesuffix("]")
        if part in _TYPES:
            return _TYPES[part]
    raise TypeError(f"setting {f.name!r} ({annotation}): give type= to parse its flag")


def csv(value: str) -> tuple[str, ...]:
    """A comma list as a tuple of its non-empty items (`type=csv` for a tuple setting)."""
    return tuple(s.strip() for s in value.split(",") if s.strip())
