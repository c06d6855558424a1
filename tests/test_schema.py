"""The one checker of user input (diffquant.schema)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from diffquant.errors import DiffquantError
from diffquant.schema import check, key


@dataclass
class Inner:
    format: Literal["int8", "int4"] = key("int8")


@dataclass
class Outer:
    name: str = key()
    tokens: int = key(16, min=1)
    ratio: float | None = key(None, min=0, max=1)
    on: bool = key(True)
    sites: list[str] = key(["*"])
    scheme: Inner = field(default_factory=Inner)
    rules: list[Inner] = key([])


def test_defaults_are_filled():
    assert check(Outer, {"name": "x"}, "r") == {
        "name": "x", "tokens": 16, "ratio": None, "on": True, "sites": ["*"], "scheme": {"format": "int8"}, "rules": []
    }  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "r: missing required key 'name'"),
        ({"name": "x", "tokns": 1}, "r: unknown key 'tokns'; allowed keys: name, tokens"),
        ({"name": "x", "tokens": True}, "r: tokens: expected int, got True"),
        ({"name": "x", "tokens": 0}, "r: tokens: expected an integer in [1, 2**63 - 1], got 0"),
        ({"name": "x", "ratio": 2}, "r: ratio: expected a number in [0, 1] or null, got 2"),
        ({"name": "x", "sites": [1]}, "r: sites[0]: expected str, got 1"),
        ({"name": "x", "scheme": {"format": "int3"}}, "r: scheme.format: expected one of 'int8', 'int4'"),
        (
            {"name": "x", "rules": [{}, {"fmt": 1}]},
            "r: unknown key 'rules[1].fmt'; allowed keys under rules[1]",
        ),
    ],
)
def test_errors_name_the_key_path(raw, message):
    with pytest.raises(DiffquantError) as err:
        check(Outer, raw, "r")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------ document / field styles
@dataclass
class _Smooth:
    alpha: float = key(0.5, min=0, max=1)


@dataclass
class _Doc:
    rules: list[Inner] = key([])
    smooth: _Smooth | None = key(None, what="a mapping")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"smooth": {"alpha": "1"}}, "p: smooth.alpha: expected a number in [0, 1], got '1' (a string)"),
        ({"smooth": 0.5}, "p: smooth: expected a mapping, got float"),
        ({"smooth": {"beta": 1}}, "p: smooth: unknown key 'beta'; allowed keys: alpha"),
    ],
)
def test_doc_style_messages(doc, message):
    from diffquant.schema import DOCS

    with pytest.raises(DiffquantError) as err:
        check(_Doc, doc, "p", style=DOCS)
    assert str(err.value) == message


def test_assign_style_messages():
    from diffquant.schema import AssignStyle

    @dataclass
    class Cfg:
        steps: int = key(1, min=1)

    with pytest.raises(DiffquantError) as err:
        check(Cfg, {"steps": True}, "r", style=AssignStyle())
    assert str(err.value) == "r: 'steps' = True, expected an integer >= 1"
    with pytest.raises(DiffquantError) as err:
        check(Cfg, {"steps": 0}, "m", style=AssignStyle(field=True))
    assert str(err.value) == "m: field 'steps' = 0, expected an integer >= 1"
