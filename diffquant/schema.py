"""One checker for user input: a mapping (a recipe, a task, a plan section) validated against a dataclass.

The dataclass is the schema. Each field's annotation says what a value may be (``str``, ``int``, ``float``,
``bool`` (not an int), ``None``, unions, ``list[T]``, ``dict[str, T]``, nested dataclasses, ``Literal``
choices, ``Any``); its default makes it optional; :func:`key` adds metadata: integer or number bounds
(``min`` / ``max``; integers always stay below 2**63, what torch and numpy take), the words of a message
(``what``, ``each`` for a list's items or a mapping's values), a ``check`` of its own (a function returning
what was expected, or None when the value is fine), and the ``help`` of the command-line option made from
the field (:func:`add_options`). An unknown key is an error naming the allowed ones; a missing required key,
a wrong type and a value out of range are one-line :class:`DiffquantError` messages naming the key's path
(``profile.tokens``, ``eval.tasks[1].seq_len``), what was expected and what was given. A key a schema
renamed is refused in one line naming the new one: the dataclass lists ``RENAMED: ClassVar[dict[str, str]]``
(old key -> new key), which :func:`check` consults before the unknown-key error.

How a message names a key is a :class:`Style`: recipes name paths (the default), tasks name their
parameters (``bpb parameter 'tokens'``); the checks are the same.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

from diffquant.errors import DiffquantError
from diffquant.names import PLAIN_NAME_RULE, is_plain_name

INT_LIMIT = 2**63  # integers are checked below this (torch and numpy take int64)


def key(
    default: Any = dataclasses.MISSING,
    *,
    help: str = "",  # noqa: A002 (argparse's word)
    min: float | None = None,  # noqa: A002
    max: float | None = None,  # noqa: A002
    what: str | None = None,
    each: str | None = None,
    check: Callable[[Any], str | None] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | None = None,
    cli: bool = True,
) -> Any:
    """A schema field: ``default`` (a list or dict default is copied per instance; none: required) and its
    metadata. ``flag`` renames the command-line option (default ``--field-name``), ``choices`` limits it;
    ``cli=False`` keeps the field out of :func:`add_options`."""
    meta = {"help": help, "min": min, "max": max, "what": what, "each": each, "check": check}
    meta |= {"flag": flag, "metavar": metavar, "choices": choices, "cli": cli}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Style:
    """How messages name keys. The default names paths: ``SOURCE: profile.tokens: expected int, got 'x'``,
    python type names for a wrong type, words for a value out of range."""

    type_names = True

    def name(self, path: str) -> str:
        return path

    def unknown(self, prefix: str, key: str, allowed: Sequence[str]) -> str:
        under = f" under {prefix[:-1]}" if prefix else ""
        return f"unknown key '{prefix}{key}'; allowed keys{under}: {', '.join(allowed)}"

    def missing(self, path: str) -> str:
        return f"missing required key '{path}'"

    def renamed(self, path: str, new: str) -> str:
        """The message of a key the schema renamed (``RENAMED``): ``KEY: renamed 'NEW'``."""
        return f"{self.name(path)}: renamed '{new}'"

    def words(self, tp: Any, meta: Mapping[str, Any]) -> str:
        """What a value must be, in words (:func:`describe`)."""
        return describe(tp, meta)

    def got(self, value: Any, expected: str) -> str:
        """How a refused value is shown after ``got``."""
        return repr(value)

    def bad(self, path: str, expected: str, value: Any) -> str:
        """The message of a refused value: ``KEY: expected WHAT, got VALUE``."""
        return f"{self.name(path)}: expected {expected}, got {self.got(value, expected)}"


PATHS = Style()


def type_name(value: Any) -> str:
    """'a string', 'an integer', ... : a YAML value's type in words."""
    names = {bool: "a boolean", str: "a string", int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class AssignStyle(Style):
    """Messages of a config whose keys are fields: ``'steps' = True, expected an integer >= 1`` (with
    ``field=True``: ``field 'steps' = ...``); bounds in words, lower bounds as ``>= N``."""

    type_names = False

    def __init__(self, field: bool = False) -> None:
        self.field = field

    def bad(self, path: str, expected: str, value: Any) -> str:
        return f"{'field ' if self.field else ''}'{path}' = {value!r}, expected {expected}"

    def words(self, tp: Any, meta: Mapping[str, Any]) -> str:
        return at_least_words(tp, meta)


class DocStyle(Style):
    """Messages of a document read as a whole (a quantization plan, a scheme): ``rules[0]: unknown key 'x';
    allowed keys: a, b`` (sorted), a value shown with its type (``got '0.5' (a string)``), a non-mapping by
    its type name (``expected a mapping, got float``), bounds in words."""

    type_names = False

    def unknown(self, prefix: str, key: str, allowed: Sequence[str]) -> str:
        head = f"{prefix[:-1]}: " if prefix else ""
        return f"{head}unknown key '{key}'; allowed keys: {', '.join(sorted(allowed))}"

    def missing(self, path: str) -> str:
        parent, _, leaf = path.rpartition(".")
        return f"{parent}: missing key '{leaf}'" if parent else f"missing key '{leaf}'"

    def renamed(self, path: str, new: str) -> str:
        return f"{super().renamed(path, new)} (see {KEYS_PAGE})"

    def got(self, value: Any, expected: str) -> str:
        if expected == "a mapping":
            return type(value).__name__
        return f"{value!r} ({type_name(value)})"


DOCS = DocStyle()
KEYS_PAGE = "docs/plans.md"  # the table of every plan key, old spellings included (DocStyle.renamed)


def fields_of(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved annotation) of a schema dataclass, in declaration order."""
    hints = get_type_hints(cls, include_extras=False)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def check(cls: type, raw: Any, where: str, *, style: Style = PATHS, prefix: str = "") -> dict[str, Any]:
    """``raw`` checked against the dataclass ``cls``: a dict of every field (defaults filled in, nested
    dataclasses as dicts) in declaration order; raises a one-line DiffquantError starting with ``where``."""
    if not isinstance(raw, Mapping):
        raise _error(where, f"expected a mapping at the top level, got {type(raw).__name__}")
    spec = fields_of(cls)
    allowed = [f.name for f, _ in spec]
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    for name in raw:
        if name not in allowed:
            if name in renamed:
                raise _error(where, style.renamed(f"{prefix}{name}", renamed[name]))
            raise _error(where, f"{style.unknown(prefix, str(name), allowed)}")
    out: dict[str, Any] = {}
    for f, tp in spec:
        path = f"{prefix}{f.name}"
        if _is_dataclass(tp):
            value = raw.get(f.name)
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                enabled = any(g.name == "enabled" for g in dataclasses.fields(tp))
                hint = f" (to turn the stage off: {path}: {{enabled: false}})" if enabled else ""
                got = style.got(value, "a mapping")
                raise _error(where, f"{style.name(path)}: expected a mapping, got {got}{hint}")
            out[f.name] = check(tp, value, where, style=style, prefix=f"{path}.")
            continue
        if f.name not in raw:
            if is_required(f):
                raise _error(where, f"{style.missing(path)}")
            out[f.name] = (
                f.default_factory() if f.default is dataclasses.MISSING else copy.deepcopy(f.default)
            )
            continue
        out[f.name] = check_value(raw[f.name], tp, f.metadata, where, path, style)
    return out


def _error(where: str, text: str) -> DiffquantError:
    return DiffquantError(f"{where}: {text}" if where else text)


def check_value(
    value: Any, tp: Any, meta: Mapping[str, Any], where: str, path: str, style: Style = PATHS
) -> Any:
    """One value against an annotation (and a field's metadata); returns it (nested dataclasses as dicts)."""
    own = meta.get("check")
    if own is not None:
        expected = own(value)
        if expected is not None:
            raise _error(where, style.bad(path, expected, value))
        return value
    matched = _match(value, tp)
    if matched is None:
        what = meta.get("what") or (_type_names(tp) if style.type_names else style.words(tp, meta))
        raise _error(where, style.bad(path, what, value))
    if _is_dataclass(matched):
        return check(matched, value, where, style=style, prefix=f"{path}.")
    origin, args = get_origin(matched), get_args(matched)
    if origin is list and args:
        item = {"what": meta.get("each")}
        return [check_value(v, args[0], item, where, f"{path}[{i}]", style) for i, v in enumerate(value)]
    if origin is dict and len(args) == 2:
        item = {"what": meta.get("each")}
        return {k: check_value(v, args[1], item, where, f"{path}.{k}", style) for k, v in value.items()}
    if matched in (int, float) and not _in_range(value, meta):
        # an integer past int64 meets the bound a style may leave unsaid (``>= 0``): name both ends then
        huge = isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT
        what = describe(tp, meta) if huge else style.words(tp, meta)
        raise _error(where, style.bad(path, what, value))
    return value


def at_least_words(tp: Any, meta: Mapping[str, Any]) -> str:
    """:func:`describe`, a lower bound alone as ``an integer >= 1``."""
    if (
        not meta.get("what")
        and meta.get("min") is not None
        and meta.get("max") is None
        and tp in (int, float)
    ):
        return f"{'an integer' if tp is int else 'a number'} >= {meta['min']:g}"
    return describe(tp, meta)


def describe(tp: Any, meta: Mapping[str, Any] | None = None) -> str:
    """What a value of ``tp`` is, in words: ``an integer in [1, 2**63 - 1] or null``, ``one of 'a', 'b'``."""
    meta = meta or {}
    if meta.get("what"):
        return meta["what"]
    options = _options(tp)
    words = [_word(t, meta) for t in options if t is not type(None)]
    return " or ".join(words + (["null"] if type(None) in options else [])) or "null"


def _word(tp: Any, meta: Mapping[str, Any]) -> str:
    if tp is bool:
        return "true or false"
    if tp in (int, float):
        low, high = meta.get("min"), meta.get("max")
        noun = "an integer" if tp is int else "a number"
        if low is None and high is None:
            return noun
        top = "2**63 - 1" if high is None and tp is int else ("inf" if high is None else f"{high:g}")
        return f"{noun} in [{'-inf' if low is None else f'{low:g}'}, {top}]"
    if tp is str:
        return "a string"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is list or tp is list:
        return "a list"
    if get_origin(tp) is dict or tp is dict or _is_dataclass(tp):
        return "a mapping"
    return "anything" if tp is Any else getattr(tp, "__name__", str(tp))


def _type_names(tp: Any) -> str:
    names = []
    for t in _options(tp):
        if get_origin(t) is Literal:
            names.append(_word(t, {}))
        else:
            names.append(getattr(get_origin(t) or t, "__name__", str(t)))
    return " or ".join(names)


def _options(tp: Any) -> tuple:
    if get_origin(tp) in (typing.Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _match(value: Any, tp: Any) -> Any:
    """The member of ``tp`` (a union's option) that ``value`` has the type of, or None."""
    for t in _options(tp):
        if t is Any:
            return t
        if t is type(None):
            if value is None:
                return t
        elif t is bool:
            if isinstance(value, bool):
                return t
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return t
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return t
        elif get_origin(t) is Literal:
            if any(value == a and type(value) is type(a) for a in get_args(t)):
                return t
        elif _is_dataclass(t) or get_origin(t) is dict or t is dict:
            if isinstance(value, Mapping):
                return t
        elif get_origin(t) is list or t is list:
            if isinstance(value, list):
                return t
        elif isinstance(t, type) and isinstance(value, t):
            return t
    return None


def _in_range(value: Any, meta: Mapping[str, Any]) -> bool:
    low, high = meta.get("min"), meta.get("max")
    if isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def _is_dataclass(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# ----------------------------------------------------------------------------------------------- plain names
def plain_name(value: Any) -> str | None:
    """A :func:`key` ``check``: None for a plain name (:func:`diffquant.names.is_plain_name`), else what was
    expected. For a value that becomes a file or folder name (a recipe's ``name``: runs/NAME)."""
    return None if is_plain_name(value) else f"a plain name ({PLAIN_NAME_RULE})"


def require_plain_name(name: Any, where: str, path: str) -> str:
    """``name`` if it is a plain name, else a one-line DiffquantError ``WHERE: PATH: 'x' is not a plain
    name (...)``: for the keys of a mapping (a recipe's model and seed-group names), which become file names
    in the run folder, so a name like ``../../x`` or ``/abs/x`` would write outside it."""
    if not is_plain_name(name):
        raise _error(
            where,
            f"{path}: {name!r} is not a plain name ({PLAIN_NAME_RULE}); it becomes a file name in the run folder",
        )
    return name


# ------------------------------------------------------------------------------------- command-line options
class Extend(argparse.Action):
    """``nargs="+"`` that accumulates: ``--plan a --plan b`` is ``--plan a b`` (argparse's own ``store``
    keeps only the last, silently dropping ``a``). The default is replaced by what the first flag gives, not
    extended (argparse's ``extend`` appends to it: ``--format svg`` would draw png too)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        current = getattr(namespace, self.dest, None)
        given = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, given + list(values))


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Sequence[str] | None = None,
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One ``--flag`` per field of ``cls`` (``only`` these; none with ``cli=False``), named ``flags[name]``
    or ``--field-name``, with the field's default (or ``defaults[name]``) and its ``help``. Values are parsed
    by type (``int``, ``float``; a ``list`` takes one or more values; a ``bool`` is a switch: ``--name`` when
    it defaults to false, ``--no-name`` when true); :func:`check_args` then checks them as a recipe's keys are
    checked, naming the flag."""
    flags, defaults = flags or {}, defaults or {}
    for f, tp in fields_of(cls):
        meta = f.metadata
        if (only is not None and f.name not in only) or not meta.get("cli", True):
            continue
        default = defaults.get(f.name, field_default(f))
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help") or None}
        options = [t for t in _options(tp) if t is not type(None)]
        if options == [bool]:
            flag = flags.get(f.name) or ("--" if default is False else "--no-") + f.name.replace("_", "-")
            parser.add_argument(flag, action="store_false" if default else "store_true", **kwargs)
            continue
        kwargs["default"] = default
        flag = flags.get(f.name) or "--" + f.name.replace("_", "-")
        kwargs["metavar"] = meta.get("metavar") or flag.lstrip("-").replace("-", "_").upper()
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        base = options[0] if options else str
        if get_origin(base) is list:
            kwargs["nargs"], kwargs["action"] = "+", Extend  # --sites a --sites b: both
            base = (get_args(base) or (str,))[0]
        if get_origin(base) is Literal:
            kwargs["choices"] = get_args(base)
        elif base in (int, float):
            kwargs["type"] = base
        if "choices" in kwargs:
            kwargs.pop("metavar")
        parser.add_argument(flag, **kwargs)


class FlagStyle(Style):
    """Command-line messages name the flag: ``--tokens: expected an integer >= 1, got 0``."""

    type_names = False

    def __init__(self, flags: Mapping[str, str] | None = None) -> None:
        self.flags = flags or {}

    def name(self, path: str) -> str:
        return self.flags.get(path) or "--" + path.replace("_", "-")

    def words(self, tp: Any, meta: Mapping[str, Any]) -> str:
        return at_least_words(tp, meta)


def check_args(
    cls: type, args: argparse.Namespace, *, flags: Mapping[str, str] | None = None, **values: Any
) -> dict[str, Any]:
    """The fields of ``cls`` read from parsed command-line ``args`` (or given in ``values``), checked by
    :func:`check`; a bad value is an error naming its flag (``--tokens: expected ...``)."""
    raw = {f.name: getattr(args, f.name) for f, _ in fields_of(cls) if hasattr(args, f.name)}
    return check(cls, {**raw, **values}, "", style=FlagStyle(flags))


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh copy of a list / dict one); None for a required field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
