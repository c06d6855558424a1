"""Byte tokenizer, text sources, fingerprints and deterministic token windows."""

from pathlib import Path

import pytest
import torch

import diffquant.data.corpus as corpus
from diffquant import DiffquantError
from diffquant.data import ByteTokenizer, Document, fingerprint, iter_documents, token_windows

WIKITEXT = Path(__file__).parents[2] / "shared/data/wikitext-2-raw"
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
    (root / "z.bin").write_bytes(b"ignored anyway")
    assert fingerprint(str(root)) == fingerprint(str(root))


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


# ----------------------------------------------------------------------------------------- wikitext
@pytest.mark.skipif(not WIKITEXT.is_dir(), reason=f"WikiText-2 raw not present at {WIKITEXT}")
def test_wikitext_source():
    test_file = WIKITEXT / "wiki.test.raw"
    w = token_windows(str(test_file), n_tokens=4096, seq_len=512)
    assert w.shape == (8, 512)
    tok = ByteTokenizer()
    assert w[0, 0].item() == BOS
    assert tok.decode(w[0, :40]).startswith(" \n = Robert Boulter = \n")
    assert list(iter_documents(str(test_file)))[0].name == "wiki.test.raw"
    # the folder also holds SOURCE.txt (provenance notes), which a folder source reads as text
    names = [doc.name for doc in iter_documents(str(WIKITEXT))]
    assert names == ["SOURCE.txt", "wiki.test.raw", "wiki.valid.raw"]
