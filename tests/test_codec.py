"""The dataclass JSON codec (codec.py): every kind of field it declares round-trips, and a document that does not
fit is refused with the place in it that is wrong."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import pytest

from entmtp.codec import NOT_WRITTEN, CodecError, from_json, to_json
from entmtp.errors import EntMTPError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Leaf:
    name: str
    size: int
    weight: float
    kind: Literal["a", "b"] = "a"
    note: str | None = None  # left out when None


@dataclass(frozen=True)
class Checked:
    value: int

    def __post_init__(self):
        if self.value < 0:
            raise EntMTPError(f"value must be >= 0, got {self.value}")


@dataclass(frozen=True)
class Root:
    leaves: tuple[Leaf, ...]
    by_depth: Mapping[int, tuple[int | str, ...]]
    pair: tuple[int, str]
    colour: Colour
    flag: bool
    record: Mapping | None  # any JSON, as it is
    checked: Checked | None = None
    extra: tuple[Leaf, ...] = ()  # left out when empty
    path: str | None = field(default=None, compare=False, metadata=NOT_WRITTEN)


ROOT = Root(
    leaves=(Leaf("x", 1, 0.5), Leaf("y", 2, 1.0, "b", "note")),
    by_depth={1: (0, "L0"), 2: ()},
    pair=(3, "three"),
    colour=Colour.BLUE,
    flag=True,
    record={"cpu": {"flags": ["avx2"]}, "n": None},
    checked=Checked(4),
    path="not written",
)


def test_every_kind_of_field_round_trips_through_json_text():
    d = to_json(ROOT)
    assert d == {
        "leaves": [
            {"name": "x", "size": 1, "weight": 0.5, "kind": "a"},
            {"name": "y", "size": 2, "weight": 1.0, "kind": "b", "note": "note"},
        ],
        "by_depth": {"1": [0, "L0"], "2": []},
        "pair": [3, "three"],
        "colour": "blue",
        "flag": True,
        "record": {"cpu": {"flags": ["avx2"]}, "n": None},
        "checked": {"value": 4},
    }
    back = from_json(Root, json.loads(json.dumps(d)))
    assert back == ROOT and back.path is None  # the field that is not written comes back as its default
    assert to_json(back) == d


def test_absent_fields_take_their_defaults_and_an_integer_is_a_float_as_it_was_written():
    d = {"name": "x", "size": 1, "weight": 2}
    leaf = from_json(Leaf, d)
    assert leaf == Leaf("x", 1, 2.0) and json.dumps(to_json(leaf)) == json.dumps({**d, "kind": "a"})


@pytest.mark.parametrize(
    "edit, where, problem",
    [
        (lambda d: d.update(colour_name="red"), "colour_name", r"unknown field 'colour_name' \(a Root has"),
        (lambda d: d["leaves"][1].update(size2=1), r"leaves\[1\]\.size2", "unknown field 'size2'"),
        (lambda d: d.pop("pair"), "the document", "lacks the field 'pair'"),
        (lambda d: d["leaves"][0].update(size="1"), r"leaves\[0\]\.size", "expected int, got str"),
        (lambda d: d["leaves"][0].update(size=True), r"leaves\[0\]\.size", "expected int, got bool"),
        (lambda d: d["leaves"][0].update(kind="c"), r"leaves\[0\]\.kind", "'c' is not one of 'a', 'b'"),
        (lambda d: d.update(colour="green"), "colour", "'green' is not one of 'red', 'blue'"),
        (lambda d: d.update(pair=[3]), "pair", r"expected a list of 2 values, got list \[3\]"),
        (lambda d: d["by_depth"].update(deep=[]), r"by_depth\.deep", "expected an integer key"),
        (lambda d: d["by_depth"].update({"3": [0.5]}), r"by_depth\.3\[0\]", "expected str, got float"),
        (lambda d: d.update(leaves={}), "leaves", "expected a list, got dict"),
        (lambda d: d.update(checked={"value": -1}), "checked", "value must be >= 0, got -1"),
    ],
)
def test_a_document_that_does_not_fit_is_refused_with_the_place_that_is_wrong(edit, where, problem):
    d = to_json(ROOT)
    edit(d)
    with pytest.raises(CodecError, match=rf"^{where}: {problem}"):
        from_json(Root, d)


def test_numpy_values_are_written_as_the_python_values_they_hold():
    """Calibration computes with numpy: its arrays and scalars are written as lists and numbers."""
    np = pytest.importorskip("numpy")
    leaf = Leaf("x", np.int64(3), np.float64(0.25))
    assert to_json(leaf) == {"name": "x", "size": 3, "weight": 0.25, "kind": "a"}
    d = to_json(Root((leaf,), {1: np.array([0, 1])}, (3, "three"), Colour.RED, np.bool_(False), None))
    assert d["by_depth"] == {"1": [0, 1]} and d["flag"] is False
    assert json.loads(json.dumps(d)) == d


def test_a_string_enum_in_a_str_field_reads_as_its_plain_string():
    """A document made in memory may hold an acceptance `Rule` (a str enum) where a field is a str (a profile
    migrated from an older file): it reads as the string, so the object and its JSON text agree."""
    from entmtp.accept import Rule

    leaf = from_json(Leaf, {"name": Rule.TYPICAL, "size": 1, "weight": 0.5})
    assert type(leaf.name) is str and leaf.name == "typical"
