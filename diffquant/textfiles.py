"""The one YAML reader for recipes, plans and command-line values, and the one bounded file reader.

YAML is data here, never a program and never a compression format: ``safe_load`` already refuses
``!!python`` tags, and this loader also refuses anchors / aliases (a 504-byte file of nested aliases
expands to gigabytes: the "billion laughs" attack), duplicate keys (the second silently wins in plain
PyYAML, so a recipe would not run what it says) and nesting deeper than :data:`MAX_NESTING` levels (PyYAML
composes nodes recursively: ``[[[[...]]]]`` 3,000 deep is a RecursionError). All are one-line errors naming
the file and line. Parsed JSON is held to the same nesting bound (:func:`parse_json`).

Every file read as text, YAML or JSON goes through :func:`read_bytes_bounded`: a path that is not a regular
file (``/dev/zero``, ``/dev/urandom``, a FIFO, a socket) is refused before it is opened for reading, and a
regular file is read up to its kind's limit plus one byte, never further. ``stat().st_size`` alone is no
bound: it is 0 for devices and FIFOs, which then never end or never answer.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError

MAX_YAML_BYTES = 1 << 20  # recipes and plans are a few KB; a megabyte is not a configuration
# Limits of the bounded reader by kind of file (each refusal names its limit). Configs (config.json,
# tokenizer_config.json, card.json, plan and run records) are kilobytes; 16 MiB leaves room for a long chat
# template or a large added-token table. A tokenizer.json of a 256k vocabulary is ~35 MB. JSON artifacts
# (profiles with --topk 10000 reach ~100 MB) and text corpora (WikiText-103 is ~540 MB) are data.
MAX_CONFIG_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 256 << 20
MAX_JSON_BYTES = 1 << 30
MAX_TEXT_BYTES = 2 << 30
# The deepest nesting of lists / mappings a YAML or JSON document may have. Recipes, plans and configs
# nest a handful of levels; the parsers (and deepcopy, and the checks after them) recurse per level.
MAX_NESTING = 100

_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _size_words(limit: int) -> str:
    """``16 MiB`` / ``1 GiB``: a limit in the unit it was chosen in."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if limit >= 1 << shift and limit % (1 << shift) == 0:
            return f"{limit >> shift} {unit}"
    return f"{limit:,} bytes"


def read_bytes_bounded(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; one-line DiffquantError naming the
    path and ``what`` it should be for a missing file, a folder, a device / FIFO / socket (refused before it
    is opened for reading: opening a FIFO blocks, reading /dev/zero never ends) and a file over ``limit``
    (read up to ``limit + 1`` bytes, so a file that grows while it is read is caught too). Symbolic links are
    followed."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DiffquantError(f"{path}: {what} not found") from None
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    _require_regular(path, info.st_mode, what)
    if info.st_size > limit:
        raise DiffquantError(_too_large(path, f"{info.st_size:,} bytes", what, limit))
    try:
        # O_NONBLOCK: should the path be swapped for a FIFO after the stat, open() still returns at once
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    try:
        _require_regular(path, os.fstat(fd).st_mode, what)  # what was opened, not what was stat'ed
        chunks: list[bytes] = []
        total = 0
        want = info.st_size + 1  # one read for a file that did not change; more if it grew
        while total <= limit:
            chunk = os.read(fd, min(max(want - total, 1 << 16), limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise DiffquantError(_too_large(path, "more bytes than that", what, limit))
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (another user's process counts as running): what
    decides that a temporary named after its writer's pid is stale (the native compile's, fetch's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True
    return True


def check_regular_file(path: str | Path, what: str = "file") -> None:
    """Refuse, in one line, a ``path`` that is not there or is not a regular file (a device, a FIFO, a
    socket, a folder): what :func:`read_bytes_bounded` would refuse, checked without opening it (a source's
    files are checked so before a run starts, read later)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DiffquantError(f"{path}: {what} not found") from None
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    _require_regular(path, mode, what)


def _require_regular(path: Path, mode: int, what: str) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((word for test, word in _KINDS if test(mode)), "not a regular file")
    raise DiffquantError(f"{path}: is {kind}, not a regular file; expected a {what}")


def _too_large(path: Path, size: str, what: str, limit: int) -> str:
    return f"{path}: {size}; a {what} here is at most {_size_words(limit)} ({limit:,} bytes)"


def read_text_bounded(path: str | Path, limit: int, what: str = "file") -> str:
    """:func:`read_bytes_bounded` decoded as UTF-8; bytes that do not decode are a one-line error."""
    data = read_bytes_bounded(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DiffquantError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None


def nesting_error(source: str, depth: int, where: str = "") -> DiffquantError:
    """The one-line refusal of a document nested deeper than :data:`MAX_NESTING`."""
    at = f"{where}: " if where else ""
    return DiffquantError(
        f"{source}: {at}nested more than {MAX_NESTING} levels deep (lists / mappings inside each other; "
        f"got {depth} or more)"
    )


def check_nesting(value: Any, source: str) -> Any:
    """``value`` (parsed JSON / YAML data) if it nests at most :data:`MAX_NESTING` lists / mappings deep,
    else a one-line DiffquantError. Walked with a stack, not recursion, so any depth is measured safely."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_NESTING:
            raise nesting_error(source, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def parse_json(text: str | bytes, source: str) -> Any:
    """``text`` as JSON data, nested at most :data:`MAX_NESTING` deep; a one-line DiffquantError naming
    ``source`` for invalid JSON and for deeper nesting (which json.loads itself meets as a RecursionError)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DiffquantError(f"{source}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise nesting_error(source, MAX_NESTING + 1) from None
    return check_nesting(value, source)


class YAMLRefused(Exception):
    """What a loader here refuses (an alias, a duplicate key, too deep a nesting): ``line N: why``; the
    caller names the file."""


@functools.cache
def _loaders() -> dict[str, type]:
    """The YAML loaders, built on first use: importing this module does not import yaml (the CLI's
    ``--help`` imports modules that import this one, and must stay instant)."""
    import yaml  # noqa: PLC0415 (slow import: on first use, not by the CLI's --help)

    class DepthLimitedLoader(yaml.SafeLoader):
        """SafeLoader refusing lists / mappings nested deeper than :data:`MAX_NESTING` (:class:`YAMLRefused`),
        counted as nodes are composed, before PyYAML's recursion could overflow. The base of every YAML loader
        in diffquant (lm-eval task YAMLs read as data too)."""

        _depth = 0

        def compose_node(self, parent, index):  # type: ignore[override]
            if self._depth >= MAX_NESTING and self.check_event(
                yaml.SequenceStartEvent, yaml.MappingStartEvent
            ):
                line = self.peek_event().start_mark.line + 1
                raise YAMLRefused(
                    f"line {line}: nested more than {MAX_NESTING} levels deep (lists / mappings inside each other)"
                )
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    class _StrictLoader(DepthLimitedLoader):
        """The recipes' loader: :class:`DepthLimitedLoader` without aliases and without duplicate mapping keys."""

        def compose_node(self, parent, index):  # type: ignore[override]
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise YAMLRefused(
                    f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted"
                )
            node = super().compose_node(parent, index)
            anchor = getattr(node, "anchor", None)  # set by some PyYAML versions only
            if anchor:
                raise YAMLRefused(
                    f"line {node.start_mark.line + 1}: YAML anchors (&{anchor}) are not accepted"
                )
            return node

        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise YAMLRefused(
                            f"line {key_node.start_mark.line + 1}: duplicate key {key!r} (first on line {seen[key]})"
                        )
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base constructor reports it
                    pass
            return super().construct_mapping(node, deep=deep)

    return {"DepthLimitedLoader": DepthLimitedLoader, "StrictLoader": _StrictLoader}


def __getattr__(name: str) -> Any:
    """PEP 562: ``DepthLimitedLoader`` (the base of every YAML loader in diffquant: lists / mappings nested
    deeper than MAX_NESTING are refused with :class:`YAMLRefused`) is built on first access."""
    if name == "DepthLimitedLoader":
        return _loaders()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_yaml(text: str, source: str) -> Any:
    """``text`` as YAML data; one-line DiffquantError naming ``source`` for anything it refuses."""
    if len(text.encode("utf-8", errors="replace")) > MAX_YAML_BYTES:
        raise DiffquantError(
            f"{source}: {len(text):,} characters; a YAML file here is at most {MAX_YAML_BYTES:,} bytes"
        )
    import yaml  # noqa: PLC0415 (slow import: on first use, not by the CLI's --help)

    try:
        return yaml.load(text, Loader=_loaders()["StrictLoader"])  # noqa: S506 (a SafeLoader subclass)
    except YAMLRefused as err:
        raise DiffquantError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise DiffquantError(f"{source}: not valid YAML ({' '.join(str(err).split())})") from None


def read_yaml_file(path: str | Path, what: str = "file") -> Any:
    """A YAML file's data; a missing, unreadable, non-UTF-8 or oversized file, or one that is not a regular
    file (a device, a FIFO: :func:`read_bytes_bounded`), is a one-line error."""
    path = Path(path)
    if path.is_dir():
        raise DiffquantError(f"{path}: is a folder, expected a YAML {what}")
    text = read_text_bounded(path, MAX_YAML_BYTES, what)
    return parse_yaml(text, str(path))


def jsonl_records(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed record) for each non-blank line of JSONL ``text``; a line that is not
    JSON is a one-line DiffquantError naming ``where:LINE``. Split on "\\n" only, not splitlines(): JSON
    strings may hold raw U+2028 and friends, which are not record separators."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DiffquantError(
                f"{where}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except RecursionError:
            raise nesting_error(f"{where}:{lineno}", MAX_NESTING + 1) from None
        yield lineno, check_nesting(record, f"{where}:{lineno}")


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
    if len(parts) > MAX_NESTING:  # each part is a level of nesting the override would create
        raise nesting_error(f"--set {item[:40]!r}...", len(parts), "its path")
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


def read_json(path: str | Path, what: str = "file", limit: int = MAX_JSON_BYTES) -> Any:
    """Parsed JSON (UTF-8, at most ``limit`` bytes, nested at most :data:`MAX_NESTING` deep, from a regular
    file: :func:`read_bytes_bounded`), or a one-line DiffquantError naming the file and what is wrong."""
    path = Path(path)
    data = read_bytes_bounded(path, limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DiffquantError(f"{path}: {what} is not a text file") from None
    return parse_json(text, str(path))


def write_json_atomic(path: str | Path, data: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
