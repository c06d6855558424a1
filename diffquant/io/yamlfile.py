"""The one YAML reader for recipes, plans and command-line values.

YAML is data here, never a program and never a compression format: ``safe_load`` already refuses
``!!python`` tags, and this loader also refuses anchors / aliases (a 504-byte file of nested aliases
expands to gigabytes: the "billion laughs" attack) and duplicate keys (the second silently wins in plain
PyYAML, so a recipe would not run what it says). Both are one-line errors naming the file and line.
"""

from __future__ import annotations

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
