"""Text sources for calibration, profiling and evaluation: WikiText-2 (shipped), the Python standard library
(whole or split), a text file, a JSONL file or a folder.

Profiles, quantization scales and perplexities are only comparable when they saw the same tokens, so every
source reads in a fixed order (sorted relative paths), windows are cut deterministically, and
:func:`fingerprint` names the exact text a result came from. The ``stdlib`` source needs no download:
every Python install carries ~30 MB of real text (code, docstrings, comments), which suits offline
machines and tests. ``stdlib:train`` / ``stdlib:validation`` split it by a hash of each file's relative
path, so calibration and evaluation text never overlap and the split is the same on every machine that
has the same files (no random seed, no file list to ship). ``wikitext2:test`` / ``wikitext2:validation``
are the raw WikiText-2 splits shipped inside the package (CC BY-SA 3.0, see data/wikitext2/README.md), each
read as one document: the text the field reports perplexity on (GPTQ, SmoothQuant, llama.cpp's perplexity
tool all read wiki.test.raw as one stream).
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from diffquant.data.tokenizer import ByteTokenizer, Tokenizer
from diffquant.errors import DiffquantError
from diffquant.textfiles import MAX_TEXT_BYTES, check_regular_file, jsonl_records, read_bytes_bounded

STDLIB = "stdlib"
STDLIB_SPLITS = ("train", "validation")
# 1 in VALIDATION_MODULUS stdlib files (by path hash) is validation text: ~5 % of the files.
VALIDATION_MODULUS = 20
TEXT_SUFFIXES = (".txt", ".raw", ".md", ".py", ".json", ".jsonl", ".csv", ".rst", ".tokens")
# Directories of the standard library that are not the library itself (installed packages, test suites
# with deliberately odd files, bytecode caches).
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
WIKITEXT2 = "wikitext2"
WIKITEXT2_SPLITS = {"test": "wiki.test.raw", "validation": "wiki.valid.raw"}
WIKITEXT2_DIR = Path(__file__).parent / "wikitext2"
_EXPECTED = (
    "expected 'wikitext2:test', 'wikitext2:validation', 'stdlib', 'stdlib:train', 'stdlib:validation', "
    "a text or .jsonl file or a folder of text files"
)


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


def stdlib_split(relative_path: str) -> str:
    """``'validation'`` for ~1 in 20 stdlib files, else ``'train'``, decided by the file's relative posix path.

    A hash of the path (not a seeded shuffle, not the file content) keeps the split stable across machines,
    runs and edits of a file, and lets a file be assigned without listing the others.
    """
    digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
    return "validation" if int(digest, 16) % VALIDATION_MODULUS == 0 else "train"


def _stdlib_entries(split: str | None) -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, lambda f: f.endswith(".py"), lambda d: d in _STDLIB_SKIP)
    if split is None:
        return files
    return [(name, path) for name, path in files if stdlib_split(name) == split]


def _entries(source: str) -> list[tuple[str, Path]]:
    """The files a source consists of, without reading them (so a small request reads little)."""
    if source == STDLIB:
        return _stdlib_entries(None)
    if source.startswith(WIKITEXT2 + ":") or source == WIKITEXT2:
        split = source.partition(":")[2]
        if split not in WIKITEXT2_SPLITS:
            allowed = ", ".join(repr(f"{WIKITEXT2}:{s}") for s in WIKITEXT2_SPLITS)
            raise DiffquantError(
                f"data source {source!r}: unknown WikiText-2 split {split!r}; expected {allowed}"
            )
        return [(WIKITEXT2_SPLITS[split], WIKITEXT2_DIR / WIKITEXT2_SPLITS[split])]
    if source.startswith(STDLIB + ":"):
        # The prefix is reserved: a file really named like this is reachable as ./stdlib:name.
        split = source[len(STDLIB) + 1 :]
        if split not in STDLIB_SPLITS:
            allowed = ", ".join(repr(f"{STDLIB}:{s}") for s in STDLIB_SPLITS)
            raise DiffquantError(
                f"data source {source!r}: unknown stdlib split {split!r}; expected {allowed}"
            )
        return _stdlib_entries(split)
    path = Path(source).expanduser() if source else None
    if path is not None and path.exists() and not path.is_dir():  # a device or FIFO: refused by _read
        return [(path.name, path)]
    if path is not None and path.is_dir():
        # Hidden files and folders (.git, editor state) are never meant as corpus text.
        return _walk(
            path,
            lambda f: not f.startswith(".") and f.lower().endswith(TEXT_SUFFIXES),
            lambda d: d.startswith("."),
        )
    raise DiffquantError(f"data source {source!r}: no such file or folder; {_EXPECTED}")


_WARNED: set[tuple[str, str]] = set()


# Byte-order marks, longest first (UTF-32 LE starts with the UTF-16 LE mark): the encoding they announce.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)


def _read(source: str, name: str, path: Path) -> str:
    """A file's text. Text is UTF-8; a file that starts with a byte-order mark (what Windows editors and
    PowerShell write: UTF-16, UTF-8 with BOM) is decoded as the mark says, without the mark. A NUL byte in
    a file without one is refused: it is UTF-16 / UTF-32 without a mark or not text, and as UTF-8 every
    other byte would be a NUL "character" the model reads. A byte that does not decode (a Latin-1 file,
    say) becomes U+FFFD, which is 3 bytes in UTF-8, so such a file reads as more bytes than it has; a
    warning says how many."""
    try:  # a regular file of at most MAX_TEXT_BYTES: a FIFO or /dev/zero in a folder is refused, not read
        data = read_bytes_bounded(path, MAX_TEXT_BYTES, "text file")
    except DiffquantError as err:
        raise DiffquantError(f"data source {source!r}: {err}") from None
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom) :].decode(encoding)
            except UnicodeDecodeError as err:
                raise DiffquantError(
                    f"data source {source!r}: {name} starts with a {encoding.upper()} byte-order mark but "
                    f"is not {encoding.upper()} (byte {err.start + len(bom)} does not decode)"
                ) from None
    if b"\0" in data:
        raise DiffquantError(
            f"data source {source!r}: {name} holds NUL bytes (first at byte {data.index(0)}): UTF-16 or "
            "UTF-32 without a byte-order mark, or not text; save it as UTF-8"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
        if (source, name) in _WARNED:  # once per file and process, however often it is read
            return text
        _WARNED.add((source, name))
        logging.getLogger(__name__).warning(
            "data source %r: %s is not UTF-8: %d undecodable byte sequence(s) read as U+FFFD (3 bytes each)",
            source,
            name,
            bad,
        )
        return text


def _is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(".jsonl")


def _jsonl_documents(source: str, name: str, text: str) -> Iterator[Document]:
    """One document per line of a JSONL file, from its ``"text"`` field, named ``name:LINE`` (1-based).

    JSONL is how most released corpora ship (one record per line with a ``text`` field); reading it as
    raw text would feed the model JSON quoting and escapes instead of the text. Blank lines are skipped
    (a trailing newline is not a record); empty texts are skipped like empty files.
    """
    for lineno, record in jsonl_records(text, f"data source {source!r}: {name}"):
        where = f"data source {source!r}: {name}:{lineno}"
        if not isinstance(record, dict) or "text" not in record:
            raise DiffquantError(f"{where}: no 'text' field (expected a JSON object with a 'text' string)")
        value = record["text"]
        if not isinstance(value, str):
            raise DiffquantError(f"{where}: field 'text' must be a string, got {type(value).__name__}")
        if value:
            yield Document(f"{name}:{lineno}", value)


def iter_documents(source: str) -> Iterator[Document]:
    """The documents of ``source`` in a fixed order, read lazily one at a time.

    ``source`` is ``'stdlib'`` (the running Python's standard-library .py files, without site-packages,
    test/tests folders and __pycache__), ``'stdlib:train'`` / ``'stdlib:validation'`` (the ~95 % / ~5 %
    of those files chosen by :func:`stdlib_split`), a path to a text file (one document, whatever its
    suffix), a ``.jsonl`` file (one document per line, its ``"text"`` field, named ``file.jsonl:LINE``),
    or a folder (every non-hidden file under it with a suffix in TEXT_SUFFIXES; .jsonl files inside it
    are read as JSONL too). Files are sorted by relative path and decoded as UTF-8 with replacement
    characters; empty files and texts are skipped. A missing source raises at once; a source without any
    text raises once iteration finds none.
    """
    entries = _entries(source)
    if not entries:
        raise DiffquantError(f"data source {source!r}: no text found")
    for _, path in entries:  # a FIFO or a device among the files: refused now, before a run writes anything
        try:
            check_regular_file(path, "text file")
        except DiffquantError as err:
            raise DiffquantError(f"data source {source!r}: {err}") from None
    return _read_documents(source, entries)


def _read_documents(source: str, entries: list[tuple[str, Path]]) -> Iterator[Document]:
    found = False
    for name, path in entries:
        text = _read(source, name, path)
        if _is_jsonl(path):
            for doc in _jsonl_documents(source, name, text):
                found = True
                yield doc
        elif text:
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


def _check_count(source: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DiffquantError(f"data source {source!r}: {name} must be an integer >= 1, got {value!r}")


def token_stream(
    source: str, max_tokens: int | None = None, tokenizer: Tokenizer | None = None, *, bos: bool = True
) -> torch.Tensor:
    """The first ``max_tokens`` ids (1-D, long) of ``source``'s token stream; ``None`` for all of it.

    The stream is ``tokenizer.frame(document)`` for each document in order ([BOS] + tokens + [EOS] for
    the byte tokenizer; BOS only where the model expects it, EOS where the tokenizer has one): the one
    sequence that :func:`token_windows` cuts into rows and that perplexity evaluation slides over, so
    both see the same tokens for the same source. Documents are read only until ``max_tokens`` are
    there; a shorter source yields what it has, and a warning says how many tokens that is.
    ``tokenizer`` defaults to :class:`ByteTokenizer`; ``bos=False`` frames the documents without BOS (a
    perplexity task's ``bos: none`` or ``window``).
    """
    tokenizer = tokenizer or ByteTokenizer()
    stream = _stream(source, max_tokens, tokenizer, bos)
    if max_tokens is not None:
        _warn_short(source, tokenizer, stream.numel(), max_tokens)
    return stream


def _warn_short(source: str, tokenizer: Tokenizer, have: int, wanted: int) -> None:
    """Say once per source, tokenizer and request that a source holds fewer tokens than asked for: the
    results record the tokens they read, but a --tokens far beyond the text would otherwise pass unnoticed."""
    key = (source, tokenizer.fingerprint(), wanted)
    if have >= wanted or key in _SHORT_WARNED:
        return
    _SHORT_WARNED.add(key)
    logging.getLogger(__name__).warning(
        "data source %r holds %s tokens of tokenizer %s, fewer than the %s asked for: all %s are used",
        source,
        f"{have:,}",
        tokenizer.name,
        f"{wanted:,}",
        f"{have:,}",
    )


_SHORT_WARNED: set[tuple[str, str, int]] = set()


def _stream(source: str, max_tokens: int | None, tokenizer: Tokenizer, bos: bool = True) -> torch.Tensor:
    """:func:`token_stream` without the warning (:func:`token_windows` asks for whole windows)."""
    if max_tokens is not None:
        _check_count(source, "max_tokens", max_tokens)
    pieces: list[torch.Tensor] = []
    have = 0
    for doc in iter_documents(source):
        ids = torch.tensor(tokenizer.frame(doc.text, bos=bos), dtype=torch.long)
        pieces.append(ids)
        have += ids.numel()
        if max_tokens is not None and have >= max_tokens:
            break
    stream = torch.cat(pieces)
    return stream if max_tokens is None else stream[:max_tokens]


def token_windows(
    source: str, n_tokens: int, seq_len: int, tokenizer: Tokenizer | None = None, *, quiet: bool = False
) -> torch.Tensor:
    """The first ceil(n_tokens / seq_len) windows (n_windows, seq_len) of ``source``'s token stream, long.

    The stream (:func:`token_stream`) is each document framed by the tokenizer, in order, cut into
    consecutive non-overlapping windows (a window may span documents, as in LM pretraining). Documents are
    read only until enough tokens are there. A source shorter than the request yields the whole windows it
    has (fewer rows; the caller reports it); one shorter than a single window is an error. ``tokenizer``
    defaults to :class:`ByteTokenizer`; ``quiet``: no warning for a short source (a probe that takes what
    there is).
    """
    _check_count(source, "n_tokens", n_tokens)
    _check_count(source, "seq_len", seq_len)
    n_windows = math.ceil(n_tokens / seq_len)
    tokenizer = tokenizer or ByteTokenizer()
    stream = _stream(source, n_windows * seq_len, tokenizer)
    have = stream.numel()
    if have < seq_len:
        raise DiffquantError(
            f"data source {source!r} has {have} tokens, fewer than one window of seq_len {seq_len}"
        )
    if not quiet:
        _warn_short(source, tokenizer, have, n_tokens)
    n_windows = min(n_windows, have // seq_len)
    return stream[: n_windows * seq_len].view(n_windows, seq_len)


def default_text(tokenizers, purpose: str = "eval") -> str:
    """The text a stage reads when none is named, for models with these tokenizers.

    Models compared side by side read the same text, so one model with a learned tokenizer moves all of
    them to WikiText-2 (test for profiles and evaluation, validation for calibration, so calibration
    never sees the evaluated text); byte-level models alone keep the text the zoo was trained and
    validated on (the stdlib splits).
    """
    if all(isinstance(t, ByteTokenizer) for t in tokenizers):
        return {"eval": "stdlib:validation", "profile": "stdlib:validation", "calib": "stdlib:train"}[purpose]
    return {"eval": "wikitext2:test", "profile": "wikitext2:test", "calib": "wikitext2:validation"}[purpose]
