"""The one YAML reader for recipes, plans and command-line values.

YAML is data here, never a program and never a compression format: ``safe_load`` already refuses
``!!python`` tags, and this loader also refuses anchors / aliases (a 504-byte file of nested aliases
expands to gigabytes: the "billion laughs" attack) and duplicate keys (the second silently wins in plain
PyYAML, so a recipe would not run what it says). Both are one-line errors naming the file and line.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from diffquant.errors import DiffquantError

MAX_YAML_BYTES = 1 << 20  # recipes and plans are a few KB; a megabyte is not a configuration


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases and without duplicate mapping keys."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted"
            )
        node = super().compose_node(parent, index)
        anchor = getattr(node, "anchor", None)  # set by some PyYAML versions only
        if anchor:
            raise _Refused(f"line {node.start_mark.line + 1}: YAML anchors (&{anchor}) are not accepted")
        return node

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _Refused(
                        f"line {key_node.start_mark.line + 1}: duplicate key {key!r} (first on line {seen[key]})"
                    )
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base constructor reports it
                pass
        return super().construct_mapping(node, deep=deep)


class _Refused(Exception):
    pass


def parse_yaml(text: str, source: str) -> Any:
    """``text`` as YAML data; one-line DiffquantError naming ``source`` for anything it refuses."""
    if len(text.encode("utf-8", errors="replace")) > MAX_YAML_BYTES:
        raise DiffquantError(
            f"{source}: {len(text):,} characters; a YAML file here is at most {MAX_YAML_BYTES:,} bytes"
        )
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _Refused as err:
        raise DiffquantError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise DiffquantError(f"{source}: not valid YAML ({' '.join(str(err).split())})") from None


def read_yaml_file(path: str | Path, what: str = "file") -> Any:
    """A YAML file's data; a missing, unreadable, non-UTF-8 or oversized file is a one-line error."""
    path = Path(path)
    try:
        if path.is_dir():
            raise DiffquantError(f"{path}: is a folder, expected a YAML {what}")
        if path.stat().st_size > MAX_YAML_BYTES:
            raise DiffquantError(
                f"{path}: {path.stat().st_size:,} bytes; a YAML {what} here is at most {MAX_YAML_BYTES:,} bytes"
            )
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DiffquantError(f"{path}: {what} not found") from None
    except UnicodeDecodeError as err:
        raise DiffquantError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read ({err.strerror or err})") from None
    return parse_yaml(text, str(path))


def jsonl_records(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed record) for each non-blank line of JSONL ``text``; a line that is not
    JSON is a one-line DiffquantError naming ``where:LINE``. Split on "\\n" only, not splitlines(): JSON
    strings may hold raw U+2028 and friends, which are not record separators."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DiffquantError(
                f"{where}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
            ) from None


def read_yaml(path: str | Path, overrides: list[str] | None = None) -> Any:
    """A recipe file's YAML with ``--set`` overrides applied (run and train recipes alike)."""
    raw = read_yaml_file(path, "recipe")
    for item in overrides or []:
        raw = apply_override(raw, item)
    return raw


_INDEX = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def apply_override(raw: Any, item: str) -> Any:
    """Set ``a.b[0].c=value`` (value parsed as YAML) in a copy of ``raw``."""
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise DiffquantError(f"--set {item!r}: expected PATH=VALUE")
    raw = copy.deepcopy(raw) if isinstance(raw, dict) else {}
    node: Any = raw
    parts: list[Any] = []
    for part in key.split("."):
        match = _INDEX.match(part)
        if not match:
            raise DiffquantError(f"--set {item!r}: bad path element {part!r}")
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        try:
            if isinstance(part, int):
                node = node[part]
            else:
                if part not in node or node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        except (IndexError, KeyError, TypeError):
            raise DiffquantError(f"--set {item!r}: path {key!r} does not exist in the recipe") from None
    parsed = parse_yaml(value, f"--set {item!r}")
    try:
        node[parts[-1]] = parsed
    except (IndexError, TypeError):
        raise DiffquantError(f"--set {item!r}: path {key!r} does not exist in the recipe") from None
    return raw


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_json(path: str | Path, what: str = "file") -> Any:
    """Parsed JSON, or a one-line DiffquantError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DiffquantError(f"{path}: {what} not found") from None
    except UnicodeDecodeError:
        raise DiffquantError(f"{path}: {what} is not a text file") from None
    except json.JSONDecodeError as err:
        raise DiffquantError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror})") from None


def write_json_atomic(path: str | Path, data: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
