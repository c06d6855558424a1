"""Text sources for calibration and profiling: the Python standard library, a text file or a folder.

Profiles and quantization scales are only comparable when they saw the same tokens, so every source reads
in a fixed order (sorted relative paths), windows are cut deterministically, and :func:`fingerprint`
names the exact text a result came from. The ``stdlib`` source needs no download: every Python install
carries ~30 MB of real text (code, docstrings, comments), which suits offline machines and tests.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from diffquant.data.tokenizer import ByteTokenizer
from diffquant.errors import DiffquantError

STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".raw", ".md", ".py", ".json", ".jsonl", ".csv", ".rst", ".tokens")
# Directories of the standard library that are not the library itself (installed packages, test suites
# with deliberately odd files, bytecode caches).
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
_EXPECTED = "expected 'stdlib', a text file or a folder of text files"


@dataclass(frozen=True)
class Document:
    """One text of a source; ``name`` is its path relative to the source (the file name for a file)."""

    name: str
    text: str


def _walk(root: Path, keep_file, skip_dir) -> list[tuple[str, Path]]:
    """(relative posix name, path) of the files under ``root`` that ``keep_file`` accepts, sorted by name."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for fname in filenames:
            if keep_file(fname):
                path = Path(dirpath) / fname
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _entries(source: str) -> list[tuple[str, Path]]:
    """The files a source consists of, without reading them (so a small request reads little)."""
    if source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        return _walk(root, lambda f: f.endswith(".py"), lambda d: d in _STDLIB_SKIP)
    path = Path(source).expanduser() if source else None
    if path is not None and path.is_file():
        return [(path.name, path)]
    if path is not None and path.is_dir():
        # Hidden files and folders (.git, editor state) are never meant as corpus text.
        return _walk(
            path,
            lambda f: not f.startswith(".") and f.lower().endswith(TEXT_SUFFIXES),
            lambda d: d.startswith("."),
        )
    raise DiffquantError(f"data source {source!r}: no such file or folder; {_EXPECTED}")


def _read(source: str, name: str, path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DiffquantError(f"data source {source!r}: cannot read {name!r}: {exc.strerror or exc}") from None
    return data.decode("utf-8", errors="replace")


def iter_documents(source: str) -> Iterator[Document]:
    """The documents of ``source`` in a fixed order, read lazily one at a time.

    ``source`` is ``'stdlib'`` (the running Python's standard-library .py files, without site-packages,
    test/tests folders and __pycache__), a path to a text file (one document, whatever its suffix), or a
    folder (every non-hidden file under it with a suffix in TEXT_SUFFIXES). Files are sorted by relative
    path and decoded as UTF-8 with replacement characters; empty files are skipped. A missing source
    raises at once; a source without any text raises once iteration finds none.
    """
    entries = _entries(source)
    if not entries:
        raise DiffquantError(f"data source {source!r}: no text found")
    return _read_documents(source, entries)


def _read_documents(source: str, entries: list[tuple[str, Path]]) -> Iterator[Document]:
    found = False
    for name, path in entries:
        text = _read(source, name, path)
        if text:
            found = True
            yield Document(name, text)
    if not found:
        raise DiffquantError(f"data source {source!r}: no text found")


def fingerprint(source: str) -> str:
    """sha256 (hex) over the relative name, UTF-8 byte length and UTF-8 content of every document.

    Names and contents are length-prefixed so no two different corpora hash alike by shifting bytes
    between fields. The content is the decoded text re-encoded (what the tokenizer sees), so it equals the
    file bytes for valid UTF-8. Reads the whole source.
    """
    h = hashlib.sha256(b"diffquant-corpus-v1\0")
    for doc in iter_documents(source):
        name = doc.name.encode("utf-8")
        content = doc.text.encode("utf-8")
        h.update(len(name).to_bytes(8, "little"))
        h.update(name)
        h.update(len(content).to_bytes(8, "little"))
        h.update(content)
    return h.hexdigest()


def token_windows(
    source: str, n_tokens: int, seq_len: int, tokenizer: ByteTokenizer | None = None
) -> torch.Tensor:
    """The first ceil(n_tokens / seq_len) windows (n_windows, seq_len) of ``source``'s token stream, long.

    The stream is [BOS] + tokens + [EOS] for each document in order, cut into consecutive non-overlapping
    windows (a window may span documents, as in LM pretraining). Documents are read only until enough
    tokens are there. A source shorter than the request yields the whole windows it has (fewer rows; the
    caller reports it); one shorter than a single window is an error. ``tokenizer`` defaults to
    :class:`ByteTokenizer`.
    """
    for name, value in (("n_tokens", n_tokens), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DiffquantError(f"data source {source!r}: {name} must be an integer >= 1, got {value!r}")
    tokenizer = tokenizer or ByteTokenizer()
    n_windows = math.ceil(n_tokens / seq_len)
    need = n_windows * seq_len
    pieces: list[torch.Tensor] = []
    have = 0
    for doc in iter_documents(source):
        ids = torch.tensor(tokenizer.encode(doc.text, bos=True, eos=True), dtype=torch.long)
        pieces.append(ids)
        have += ids.numel()
        if have >= need:
            break
    if have < seq_len:
        raise DiffquantError(
            f"data source {source!r} has {have} tokens, fewer than one window of seq_len {seq_len}"
        )
    n_windows = min(n_windows, have // seq_len)
    return torch.cat(pieces)[: n_windows * seq_len].view(n_windows, seq_len)
