"""The one checker of user input (diffquant.schema)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

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


@dataclass
class _Renamed:
    RENAMED: ClassVar[dict[str, str]] = {"group_size": "group"}
    group: int = key(32, min=1)


@dataclass
class _RenamedDoc:
    section: _Renamed = field(default_factory=_Renamed)


def test_a_renamed_key_is_refused_naming_the_new_one():
    from diffquant.schema import DOCS

    Doc = _RenamedDoc
    with pytest.raises(DiffquantError) as err:
        check(Doc, {"section": {"group_size": 8}}, "p")
    assert str(err.value) == "p: section.group_size: renamed 'group'"
    with pytest.raises(DiffquantError) as err:  # a plan document's style says where the keys are listed
        check(Doc, {"section": {"group_size": 8}}, "p", style=DOCS)
    assert str(err.value) == "p: section.group_size: renamed 'group' (see docs/plans.md)"
    assert check(Doc, {"section": {"group": 8}}, "p") == {"section": {"group": 8}}
    with pytest.raises(DiffquantError, match="unknown key 'size'"):  # any other key: the usual message
        check(Doc, {"section": {"size": 8}}, "p", style=DOCS)


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


# ------------------------------------------------------------------------- booleans are not numbers
def _schema_dataclasses() -> list[type]:
    """Every dataclass the checker sees: the roots it is called with (a recipe, a plan, a scheme, a training
    config, a model config, each task type's parameters), every dataclass defined in a module that uses
    :func:`diffquant.schema.key`, and every dataclass nested in their fields."""
    import dataclasses
    import importlib
    import inspect
    from pathlib import Path
    from typing import get_args

    import diffquant
    from diffquant.eval.tasks import TASK_TYPES
    from diffquant.models.config import ModelConfig
    from diffquant.quant.plan import PlanDoc
    from diffquant.quant.schemes import Scheme
    from diffquant.schema import fields_of
    from diffquant.stages import Recipe
    from diffquant.train.trainer import TrainConfig

    found = [Recipe, PlanDoc, Scheme, TrainConfig, ModelConfig, *(t.params for t in TASK_TYPES.values())]
    root = Path(diffquant.__file__).parent
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "from diffquant.schema import" not in text or " key(" not in text:
            continue
        module = importlib.import_module(
            "diffquant." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        )
        for _, obj in inspect.getmembers(module, inspect.isclass):
            own = dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
            if own and any("check" in f.metadata for f in dataclasses.fields(obj)):
                found.append(obj)

    def nested(tp):
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield tp
        for t in get_args(tp):
            yield from nested(t)

    out: list[type] = []
    while found:
        cls = found.pop()
        if cls in out:
            continue
        out.append(cls)
        for _, tp in fields_of(cls):
            found.extend(nested(tp))
    return out


def _float_slots(tp):
    """A value with True where ``tp`` takes a float: True, [True] or {'k': True}; None when it takes none."""
    from typing import Union, get_args, get_origin

    options = get_args(tp) if get_origin(tp) in (Union, __import__("types").UnionType) else (tp,)
    if float in options:
        return True
    for t in options:
        args = get_args(t)
        if get_origin(t) is list and args and _float_slots(args[0]) is True:
            return [True]
        if get_origin(t) is dict and len(args) == 2 and _float_slots(args[1]) is True:
            return {"k": True}
    return None


def test_true_is_never_a_number_in_any_schema():
    """YAML reads `yes` / `true` as a boolean, and Python's True == 1: a float field anywhere (plans, schemes,
    the train and model configs, stages, task parameters) must refuse it, with the field named, whether the
    field is checked by its annotation or by a check of its own."""
    from diffquant.schema import check_value, fields_of

    classes = _schema_dataclasses()
    names = {c.__name__ for c in classes}
    assert {
        "Recipe",
        "ProfileStage",
        "PlanDoc",
        "Scheme",
        "TrainConfig",
        "ModelConfig",
        "RetrievalParams",
    } <= names
    assert {"SmoothSpec", "BackendSpec", "RuleDoc", "CalibData", "ModelOptions"} <= names  # nested ones too
    tried = []
    for cls in classes:
        for f, tp in fields_of(cls):
            value = _float_slots(tp)
            if value is None:
                continue
            tried.append(f"{cls.__name__}.{f.name}")
            with pytest.raises(DiffquantError, match=f.name):
                check_value(value, tp, f.metadata, "src", f.name)
    # the float fields are found (a walk that finds none would pass vacuously)
    for expected in ("Scheme.percentile", "SmoothSpec.alpha", "BackendSpec.threshold", "TrainConfig.lr",
                     "TrainConfig.needle_fraction", "ModelConfig.norm_eps", "ModelConfig.v1_lambda_init",
                     "RetrievalParams.depths"):  # fmt: skip
        assert expected in tried, (expected, tried)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("plan", "smooth.alpha"),
        ("scheme", "percentile"),
        ("model", "norm_eps"),
        ("train", "needle_fraction"),
        ("task", "depths"),
    ],
)
def test_true_is_refused_through_each_entry_point(entry, message, tmp_path):
    """The same through the functions users reach (a plan file, a scheme, a model config, a training recipe,
    a task), so a hand-written path around the checker cannot accept True either."""
    from diffquant.eval.tasks import parse_task
    from diffquant.models.config import ModelConfig
    from diffquant.quant.plan import QuantPlan
    from diffquant.quant.schemes import Scheme
    from diffquant.train.trainer import TrainConfig

    with pytest.raises(DiffquantError, match=message):
        if entry == "plan":
            QuantPlan.from_dict(
                {"rules": [{"sites": "kind:resid", "scheme": "int8"}], "smooth": {"alpha": True}}
            )
        elif entry == "scheme":
            Scheme.parse({"format": "int8", "calibration": "percentile", "percentile": True})
        elif entry == "model":
            ModelConfig.from_dict({"norm_eps": True})
        elif entry == "train":
            TrainConfig(name="t", needle_fraction=True)
        else:
            parse_task({"type": "retrieval", "depths": [0, True]})
