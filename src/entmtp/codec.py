"""One JSON codec for dataclasses: a dataclass is a JSON object of its fields, read and written by the types its
annotations declare, so no class writes its own `to_json`/`from_json`.

  a dataclass        an object of its fields, in field order; a field holding None or () where that is its
                     default is left out, and a field that is absent takes its default
  tuple[X, ...]      a list (tuple[X, Y]: a list of that length)
  Mapping[K, V]      an object (dict[K, V] too); int keys are written as strings
  X | None           X, or null (X | Y: the first of them that the value reads as)
  Literal[a, b]      one of its values
  an Enum            its value
  float              a number (an integer stays one, so a document reads back as it was written: JSON
                     does not tell 1 from 1.0, and Python compares them equal)
  int, str, bool     as they are (a str subclass, such as a str enum, reads as its plain string)
  Mapping, dict, Any any JSON value, copied as it is (a record whose keys the code does not fix)

Writing also takes numpy arrays and scalars where the type says tuple or number (read back as tuples and
Python numbers).

A field with `metadata=NOT_WRITTEN` (the file a document was read from) is neither written nor read.

Reading refuses what it cannot place: an unknown field, a missing field, a value of the wrong kind, or one the
class's own checks refuse. The `CodecError` names where, as a path into the document
(`modes.greedy.bank[3]`), and the caller adds which file.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache, partial

NOT_WRITTEN = {"json": False}  # field metadata: not part of the JSON form


class CodecError(ValueError):
    """A JSON value that does not fit its type; `where` is its path in the document ("" for the whole)."""

    def __init__(self, problem: str, where: str = ""):
        super().__init__(f"{where or 'the document'}: {problem}")
        self.where, self.problem = where, problem

    def inside(self, key: str | int) -> CodecError:
        """The same error, seen from the container that holds the value at `key` (a field name or an index)."""
        part = f"[{key}]" if isinstance(key, int) else str(key)
        sep = "" if not self.where or self.where.startswith("[") else "."
        return CodecError(self.problem, part + sep + self.where)


class JsonForm:
    """A dataclass's `to_json()` and `cls.from_json(d)`, by this codec."""

    def to_json(self) -> dict:
        return to_json(self)

    @classmethod
    def from_json(cls, data):
        return from_json(cls, data)


def to_json(value):
    """The JSON form (dicts, lists, numbers, strings, None) of `value`: a dataclass or any value the module
    docstring lists."""
    if value is None or isinstance(value, str | int | float):
        return value
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict | Mapping):
        return {str(k) if isinstance(k, int) else k: to_json(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "tolist"):  # a numpy array or scalar (what calibration computed), as Python values
        return to_json(value.tolist())
    return {f.name: to_json(v) for f in _fields(type(value)) if not _left_out(f, v := getattr(value, f.name))}


def from_json(cls: type, data):
    """The `cls` (a dataclass, or any type the module docstring lists) that `data` is the JSON form of;
    `CodecError` naming the place in the document where it does not fit."""
    return _reader(cls)(data)


def _left_out(f: dataclasses.Field, value) -> bool:
    return value is None and f.default is None or isinstance(value, tuple) and not value and f.default == ()


@cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("json", True))


@cache
def _reader(tp) -> Callable:
    """The function that reads a JSON value as `tp` (made once per type: reading a large document calls it
    for every value)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or tp in (dict, Mapping):
        return _as_is
    if dataclasses.is_dataclass(tp):
        return partial(_read_dataclass, tp)
    if origin in (typing.Union, types.UnionType):
        options = tuple(_reader(a) for a in args if a is not type(None))
        return partial(_read_union, type(None) in args, options)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return partial(_read_list, _reader(args[0]))
    if origin is tuple:
        return partial(_read_fixed, tuple(_reader(a) for a in args))
    if origin in (dict, Mapping):
        return partial(_read_mapping, args[0] is int, _reader(args[1]))
    if origin is typing.Literal:
        return partial(_read_literal, args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return partial(_read_enum, tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"the codec cannot read {tp!r}: see entmtp.codec for the types it reads")


@cache
def _plan(cls: type) -> tuple[tuple[str, Callable, bool], ...]:
    """(name, reader, required) per field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _reader(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in _fields(cls)
    )


def _as_is(data):
    return data


def _read_dataclass(cls: type, data):
    if not isinstance(data, dict | Mapping):
        raise CodecError(f"expected an object (a {cls.__name__}), got {_kind(data)}")
    plan, kwargs = _plan(cls), {}
    for name, read, required in plan:
        if name in data:
            try:
                kwargs[name] = read(data[name])
            except CodecError as e:
                raise e.inside(name) from None
        elif required:
            raise CodecError(f"lacks the field {name!r} (a {cls.__name__} needs it)")
    if len(kwargs) < len(data):
        names = [name for name, _, _ in plan]
        unknown = next(k for k in data if k not in names)
        raise CodecError(f"unknown field {unknown!r} (a {cls.__name__} has {', '.join(names)})", unknown)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # the class's own checks (__post_init__)
        raise CodecError(str(e)) from None


def _read_union(nullable: bool, options: tuple[Callable, ...], data):
    """None where the union allows it, else the first of `options` that reads `data` (int | str: an integer,
    else a string)."""
    if data is None and nullable:
        return None
    for read in options[:-1]:
        try:
            return read(data)
        except CodecError:
            pass
    return options[-1](data)


def _read_list(read: Callable, data) -> tuple:
    if not isinstance(data, list):
        raise CodecError(f"expected a list, got {_kind(data)}")
    out = []
    for i, v in enumerate(data):
        try:
            out.append(read(v))
        except CodecError as e:
            raise e.inside(i) from None
    return tuple(out)


def _read_fixed(reads: tuple[Callable, ...], data) -> tuple:
    if not isinstance(data, list) or len(data) != len(reads):
        raise CodecError(f"expected a list of {len(reads)} values, got {_kind(data)}")
    out = []
    for i, (read, v) in enumerate(zip(reads, data, strict=True)):
        try:
            out.append(read(v))
        except CodecError as e:
            raise e.inside(i) from None
    return tuple(out)


def _read_mapping(int_keys: bool, read: Callable, data) -> dict:
    if not isinstance(data, dict | Mapping):
        raise CodecError(f"expected an object, got {_kind(data)}")
    out = {}
    for k, v in data.items():
        try:
            out[_int_key(k) if int_keys else k] = read(v)
        except CodecError as e:
            raise e.inside(k) from None
    return out


def _int_key(k: str) -> int:
    try:
        return int(k)
    except ValueError:
        raise CodecError(f"expected an integer key, got {k!r}") from None


def _read_literal(values: tuple, data):
    if data not in values:
        raise CodecError(f"{data!r} is not one of {', '.join(map(repr, values))}")
    return data


def _read_enum(tp: type[enum.Enum], data):
    try:
        return tp(data)
    except ValueError:
        raise CodecError(f"{data!r} is not one of {', '.join(repr(m.value) for m in tp)}") from None


def _scalar(tp: type) -> Callable:
    def read(data):
        if type(data) is tp or tp is float and type(data) is int:
            return data
        if tp is str and isinstance(data, str):  # a str enum (accept.Rule) in a document made in memory
            return str.__str__(data)
        raise CodecError(f"expected {tp.__name__}, got {_kind(data)}")

    return read


_SCALARS = {tp: _scalar(tp) for tp in (float, int, str, bool)}


def _kind(data) -> str:
    return "null" if data is None else f"{type(data).__name__} {data!r}"[:80]
