"""Byte tokenizer, text sources, fingerprints and deterministic token streams and windows."""

import hashlib
import json
import sysconfig
from pathlib import Path

import pytest
import torch

import diffquant.data.corpus as corpus
from diffquant import DiffquantError
from diffquant.data import (
    ByteTokenizer,
    Document,
    fingerprint,
    iter_documents,
    stdlib_split,
    token_stream,
    token_windows,
)

WIKITEXT = Path(__file__).parents[1] / "diffquant/data/wikitext2"  # shipped in the package
BOS, EOS = 256, 257


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip_and_special_ids():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    text = "plain ASCII, é, ü, ✓ and 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("ab", bos=True, eos=True) == [BOS, 97, 98, EOS]
    assert tok.encode_bytes(b"\xff\x00", eos=True) == [255, 0, EOS]
    assert tok.decode([BOS, 104, tok.pad_id, 105, EOS]) == "hi"
    assert tok.decode(torch.tensor([BOS, 0xC3, 0xA9])) == "é"
    assert tok.decode([0xC3]) == "\ufffd"  # a window cut inside a character does not fail
    with pytest.raises(ValueError):
        tok.decode([-1])


# ------------------------------------------------------------------------------------------- folders
def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / "a" / "c.md").write_bytes("é".encode())
    (root / "b.txt").write_bytes(b"hi\n")
    (root / "empty.txt").write_bytes(b"")  # skipped: no text
    (root / "z.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (root / ".hidden.txt").write_bytes(b"secret")
    (root / ".git").mkdir()
    (root / ".git" / "notes.txt").write_bytes(b"nope")
    return root


def test_folder_documents_in_relative_path_order(tmp_path):
    root = _folder(tmp_path)
    docs = list(iter_documents(str(root)))
    assert docs == [Document("a/c.md", "é"), Document("b.txt", "hi\n")]
    assert list(iter_documents(str(root / "b.txt"))) == [Document("b.txt", "hi\n")]


def test_folder_windows_exact(tmp_path):
    root = str(_folder(tmp_path))
    # stream: [BOS] é [EOS] [BOS] h i \n [EOS]  = 9 tokens
    stream = [BOS, 0xC3, 0xA9, EOS, BOS, ord("h"), ord("i"), ord("\n"), EOS]
    w = token_windows(root, n_tokens=8, seq_len=4)
    assert w.dtype == torch.long
    assert w.tolist() == [stream[0:4], stream[4:8]]
    assert token_windows(root, n_tokens=5, seq_len=4).tolist() == [stream[0:4], stream[4:8]]  # ceil
    assert token_windows(root, n_tokens=3, seq_len=3).tolist() == [stream[0:3]]
    assert token_windows(root, n_tokens=9, seq_len=9).tolist() == [stream]
    # fewer tokens than asked but at least one window: what there is
    assert token_windows(root, n_tokens=100, seq_len=4).shape == (2, 4)


def test_windows_stop_reading_once_enough_tokens(tmp_path, monkeypatch):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(20):
        (root / f"{i:02d}.txt").write_text("x" * 10)  # 12 tokens each with BOS / EOS
    reads = []
    original = corpus._read
    monkeypatch.setattr(corpus, "_read", lambda *a: reads.append(a[1]) or original(*a))
    w = token_windows(str(root), n_tokens=20, seq_len=10)
    assert w.shape == (2, 10)
    assert reads == ["00.txt", "01.txt"]


def test_fingerprint_stable_and_sensitive(tmp_path):
    root = _folder(tmp_path)
    first = fingerprint(str(root))
    assert first == fingerprint(str(root))
    assert len(first) == 64 and int(first, 16) >= 0
    (root / "b.txt").write_bytes(b"hi!\n")
    changed = fingerprint(str(root))
    assert changed != first
    (root / "b.txt").rename(root / "b2.txt")
    assert fingerprint(str(root)) != changed  # the name is part of it
    renamed = fingerprint(str(root))
    (root / "z.bin").write_bytes(b"\x00\x01 not text")  # a folder source reads text files only
    assert fingerprint(str(root)) == renamed
    # and the hash is the documented one: length-prefixed (name, content) of every document, in order
    h = hashlib.sha256(b"diffquant-corpus-v1\0")
    for doc in iter_documents(str(root)):
        for part in (doc.name.encode(), doc.text.encode()):
            h.update(len(part).to_bytes(8, "little") + part)
    assert renamed == h.hexdigest()


# -------------------------------------------------------------------------------------------- errors
def _one_line_naming(exc: pytest.ExceptionInfo, source: str) -> str:
    message = str(exc.value)
    assert "\n" not in message
    assert repr(source) in message
    return message


def test_bad_sources_raise_one_line_errors(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DiffquantError) as info:
        iter_documents(missing)  # raises at once, before iteration
    msg = _one_line_naming(info, missing)
    assert "no such file or folder" in msg and "'stdlib'" in msg

    with pytest.raises(DiffquantError) as info:
        iter_documents("")
    _one_line_naming(info, "")

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(DiffquantError) as info:
        iter_documents(str(empty_dir))
    assert "no text found" in _one_line_naming(info, str(empty_dir))

    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_bytes(b"")
    with pytest.raises(DiffquantError) as info:
        token_windows(str(blank), 10, 5)
    assert "no text found" in _one_line_naming(info, str(blank))

    root = str(_folder(tmp_path))
    with pytest.raises(DiffquantError) as info:
        token_windows(root, n_tokens=10, seq_len=10)
    assert "has 9 tokens, fewer than one window of seq_len 10" in _one_line_naming(info, root)
    for n_tokens, seq_len in [(0, 4), (4, 0), (-3, 4), (4, 2.5), (True, 4)]:
        with pytest.raises(DiffquantError) as info:
            token_windows(root, n_tokens, seq_len)
        _one_line_naming(info, root)


# -------------------------------------------------------------------------------------------- stdlib
def test_stdlib_source():
    names = set()
    for doc in iter_documents("stdlib"):
        names.add(doc.name)
        assert "/test/" not in f"/{doc.name}" and "/tests/" not in f"/{doc.name}"
        assert "site-packages" not in doc.name and doc.name.endswith(".py")
        if {"os.py", "json/__init__.py"} <= names:
            break
    assert {"os.py", "json/__init__.py"} <= names
    first = token_windows("stdlib", n_tokens=1000, seq_len=128)
    again = token_windows("stdlib", n_tokens=1000, seq_len=128)
    assert first.shape == (8, 128)
    assert torch.equal(first, again)
    assert first[0, 0].item() == BOS
    doc = next(iter_documents("stdlib"))
    assert first[0, 1 : 1 + 20].tolist() == list(doc.text.encode("utf-8"))[:20]


def _stdlib_names() -> list[str]:
    return [name for name, _ in corpus._entries("stdlib")]


def test_stdlib_train_validation_split_by_path_hash():
    names = _stdlib_names()
    expected_val = [n for n in names if int(hashlib.sha256(n.encode()).hexdigest(), 16) % 20 == 0]
    val = [name for name, _ in corpus._entries("stdlib:validation")]
    train = [name for name, _ in corpus._entries("stdlib:train")]
    assert val == expected_val  # the documented rule, in the source's sorted order
    assert sorted(val + train) == names and not set(val) & set(train)
    assert 0.02 < len(val) / len(names) < 0.10  # ~5 %
    assert all(stdlib_split(n) == "validation" for n in val)
    assert all(stdlib_split(n) == "train" for n in train)
    # documents follow the split
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = list(iter_documents("stdlib:validation"))
    assert [d.name for d in docs] == [n for n in val if (root / n).stat().st_size > 0]  # empty files skipped
    assert next(iter_documents("stdlib:train")).name == next(n for n in train if (root / n).stat().st_size)
    assert docs[0].text == (root / docs[0].name).read_bytes().decode("utf-8", errors="replace")
    fp = fingerprint("stdlib:validation")
    assert fp == fingerprint("stdlib:validation") and len(fp) == 64
    stream = token_stream("stdlib:validation", max_tokens=50)
    assert stream[0].item() == BOS and stream[1:50].tolist() == list(docs[0].text.encode())[:49]


def test_unknown_stdlib_split_names_the_allowed_ones():
    for bad in ("stdlib:test", "stdlib:", "stdlib:Train"):
        with pytest.raises(DiffquantError) as info:
            iter_documents(bad)
        msg = _one_line_naming(info, bad)
        assert "'stdlib:train'" in msg and "'stdlib:validation'" in msg


# --------------------------------------------------------------------------------------------- jsonl
def test_jsonl_file_one_document_per_line(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"text": "first", "meta": 1}),
        "",  # blank lines are not records
        json.dumps({"text": "line\nbreak é"}),
        json.dumps({"text": ""}),  # empty text: skipped like an empty file
        json.dumps({"text": "u\u2028v"}),  # a raw line separator inside a string is not a record break
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs = list(iter_documents(str(path)))
    assert docs == [
        Document("data.jsonl:1", "first"),
        Document("data.jsonl:3", "line\nbreak é"),
        Document("data.jsonl:5", "u\u2028v"),
    ]
    stream = token_stream(str(path))
    expected = []
    for doc in docs:
        expected += [BOS, *doc.text.encode("utf-8"), EOS]
    assert stream.tolist() == expected
    assert fingerprint(str(path)) == fingerprint(str(path))


def test_jsonl_inside_folder_and_fingerprint_sees_records(tmp_path):
    root = _folder(tmp_path)
    (root / "a" / "d.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "yz"}))
    names = [d.name for d in iter_documents(str(root))]
    assert names == ["a/c.md", "a/d.jsonl:1", "a/d.jsonl:2", "b.txt"]
    assert [d.text for d in iter_documents(str(root))][1:3] == ["x", "yz"]
    before = fingerprint(str(root))
    (root / "a" / "d.jsonl").write_text(
        json.dumps({"text": "x", "extra": 1}) + "\n" + json.dumps({"text": "yz"})
    )
    assert fingerprint(str(root)) == before  # only the text counts, not other fields


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"body": "no text"}), "no 'text' field"),
        (json.dumps(["text"]), "no 'text' field"),
        (json.dumps({"text": 3}), "must be a string"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n\n" + line + "\n")
    with pytest.raises(DiffquantError) as info:
        list(iter_documents(str(path)))
    msg = _one_line_naming(info, str(path))
    assert "bad.jsonl:3" in msg and needle in msg
    # in a folder the relative name is given
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    path.rename(folder / "sub" / "bad.jsonl")
    with pytest.raises(DiffquantError) as info:
        list(iter_documents(str(folder)))
    assert "sub/bad.jsonl:3" in _one_line_naming(info, str(folder))


# -------------------------------------------------------------------------------------- token_stream
def test_token_stream_is_the_stream_windows_cut(tmp_path):
    root = str(_folder(tmp_path))
    stream = [BOS, 0xC3, 0xA9, EOS, BOS, ord("h"), ord("i"), ord("\n"), EOS]
    full = token_stream(root)
    assert full.dtype == torch.long and full.dim() == 1
    assert full.tolist() == stream
    assert token_stream(root, None).tolist() == stream
    for k in (1, 3, 4, 8, 9, 100):
        assert token_stream(root, k).tolist() == stream[:k]
    for seq_len in (1, 2, 3, 4):
        w = token_windows(root, n_tokens=9, seq_len=seq_len)
        assert torch.equal(w.flatten(), full[: w.numel()])
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(DiffquantError) as info:
            token_stream(root, bad)
        assert "max_tokens" in _one_line_naming(info, root)


def test_token_stream_stops_reading_once_enough_tokens(tmp_path, monkeypatch):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(20):
        (root / f"{i:02d}.txt").write_text("x" * 10)  # 12 tokens each
    reads = []
    original = corpus._read
    monkeypatch.setattr(corpus, "_read", lambda *a: reads.append(a[1]) or original(*a))
    assert token_stream(str(root), 13).numel() == 13
    assert reads == ["00.txt", "01.txt"]
    reads.clear()
    assert token_stream(str(root), 12).numel() == 12
    assert reads == ["00.txt"]
    reads.clear()
    assert token_stream(str(root)).numel() == 240
    assert len(reads) == 20


# ----------------------------------------------------------------------------------------- wikitext
def test_wikitext_source():
    """The WikiText-2 raw test split shipped in the package (read as a file path, bytes: no skip anywhere)."""
    test_file = WIKITEXT / "wiki.test.raw"
    w = token_windows(str(test_file), n_tokens=4096, seq_len=512)
    assert w.shape == (8, 512)
    tok = ByteTokenizer()
    assert w[0, 0].item() == BOS
    assert tok.decode(w[0, :40]).startswith(" \n = Robert Boulter = \n")
    assert list(iter_documents(str(test_file)))[0].name == "wiki.test.raw"
    # the folder also holds its README (provenance and licence), which a folder source reads as text
    names = [doc.name for doc in iter_documents(str(WIKITEXT))]
    assert names == ["README.md", "wiki.test.raw", "wiki.valid.raw"]


# ---------------------------------------------------------------------------------------- encodings
TEXT_WITH_ACCENTS = "Grüße aus Zürich ✓\nZweite Zeile: naïve café\n"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-8-sig", "utf-32"])
def test_text_with_a_byte_order_mark_is_decoded_as_it_says(tmp_path, encoding, caplog):
    """What Windows editors and PowerShell's `>` write: a byte-order mark, then UTF-16 / UTF-8 / UTF-32.
    The text read (and tokenized) is the file's text, without the mark, and no warning is needed."""
    path = tmp_path / "windows.txt"
    data = TEXT_WITH_ACCENTS.encode(encoding)
    if encoding == "utf-16-be":  # Python writes the BE mark only with the generic codec's native order
        data = b"\xfe\xff" + data
    path.write_bytes(data)
    with caplog.at_level("WARNING"):
        docs = list(iter_documents(str(path)))
    assert [d.text for d in docs] == [TEXT_WITH_ACCENTS] and not caplog.records
    assert token_stream(str(path)).tolist() == [BOS, *TEXT_WITH_ACCENTS.encode("utf-8"), EOS]
    (tmp_path / "utf8").mkdir()
    plain = _write(tmp_path / "utf8" / "windows.txt", TEXT_WITH_ACCENTS)
    assert fingerprint(str(path)) == fingerprint(str(plain))


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def test_utf16_without_a_mark_or_binary_is_refused(tmp_path):
    """UTF-16 without a byte-order mark is valid UTF-8 for ASCII text (every other byte a NUL): read as
    UTF-8 the model would see a NUL after every letter. It is refused in one line naming the file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    _write(folder / "a.txt", "fine text\n")
    (folder / "b.txt").write_bytes("plain ASCII words".encode("utf-16-le"))
    with pytest.raises(DiffquantError) as info:
        list(iter_documents(str(folder)))
    message = _one_line_naming(info, str(folder))
    assert "b.txt" in message and "NUL" in message and "UTF-16" in message and "byte 1" in message
    broken = tmp_path / "broken.txt"
    broken.write_bytes(b"\xff\xfe" + "ok".encode("utf-16-le") + b"\x00\xd8")  # a lone surrogate at the end
    with pytest.raises(DiffquantError) as info:
        list(iter_documents(str(broken)))
    assert "UTF-16-LE byte-order mark" in _one_line_naming(info, str(broken))


def test_a_request_beyond_the_source_says_how_many_tokens_it_has(tmp_path, caplog):
    """--tokens far beyond the text: the stream is what the source holds, and one warning (once per
    source, tokenizer and request) gives that count; a request the source meets says nothing."""
    root = str(_folder(tmp_path))  # 9 byte tokens
    with caplog.at_level("WARNING"):
        assert token_stream(root, 5).numel() == 5
        assert token_windows(root, 8, 4).shape == (2, 4)
        assert not caplog.records
        assert token_stream(root, 1_000_000).numel() == 9
        assert token_stream(root, 1_000_000).numel() == 9  # said once
        assert token_windows(root, 50_000, 4).shape == (2, 4)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "holds 9 tokens" in messages[0] and "1,000,000 asked for" in messages[0] and root in messages[0]
    assert "holds 9 tokens" in messages[1] and "50,000 asked for" in messages[1]
