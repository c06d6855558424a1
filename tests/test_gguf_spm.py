"""SentencePiece-style GGUF tokenizers (``tokenizer.ggml.model = llama``: Gemma, Llama-2, Mistral-v0.1).

Small GGUF files are written with ``gguf.GGUFWriter`` in the layout llama.cpp's converter gives Gemma:
control tokens first (score -1000), user-defined runs of newlines / real spaces and an HTML tag (-1000), the
256 byte tokens (score 0), then SentencePiece pieces with U+2581 scored -rank, and no merges. Their ids are
compared with a brute-force SentencePiece BPE written here (merge the adjacent pair whose concatenation has
the best priority, leftmost on ties; characters outside the vocabulary -> their UTF-8 byte tokens), which
shares no code with diffquant/io/gguf_spm.py. The real Gemma-3-270M file is compared with transformers'
own GGUF reader at the end (marked ``real``).
"""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from diffquant.data.tokenizer import load_tokenizer
from diffquant.errors import DiffquantError
from diffquant.io.convert_gguf import read_gguf_tokenizer

SP = "\u2581"
CONTROL, USER, BYTE, NORMAL = 3, 4, 6, 1

# SentencePiece pieces, best first (their score is about -rank).
PIECES = [
    SP,
    "e",
    "t",
    "h",
    "a",
    "o",
    "n",
    "l",
    "r",
    "d",
    "w",
    "i",
    "s",
    "c",
    "H",
    "T",
    ",",
    ".",
    "1",
    "2",
    "é",
    "▁t",
    "he",
    "ll",
    "lo",
    "or",
    "ld",
    "in",
    "is",
    "an",
    "nd",
    "▁w",
    "▁a",
    "▁i",
    "▁s",
    "▁c",
    "at",
    "on",
    "He",
    "Hel",
    "Hell",
    "Hello",
    "▁Hello",
    "▁wor",
    "▁world",
    "▁is",
    "▁an",
    "▁and",
    "▁in",
    "▁on",
    "▁cat",
    "ca",
    "▁ca",
    "12",
    "▁1",
    "▁12",
    "▁T",
    "Th",
    "The",
    "▁The",
    "wor",
    "world",
    "▁é",
    "ét",
    "▁hel",
    "hel",
]
# Written after every piece but scored near the top, so merge order by score and by file position differ
# (llama.cpp merges by score).
LATE = {"▁the": -0.5, "▁h": -0.25}
SPACE_RUNS = ["  ", "   "]  # user-defined, stored with real spaces (Gemma's ids 138..167)


def vocabulary(with_bytes: tuple[int, ...] = tuple(range(256))) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    types = [CONTROL] * len(tokens)
    for user in ["\n", "\n\n", "\n\n\n", *SPACE_RUNS, "<table>"]:
        tokens.append(user)
        types.append(USER)
    scores = [-1000.0] * len(tokens)
    for b in with_bytes:
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    for rank, piece in enumerate(PIECES):
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float(rank) - (1.0 if rank else 0.0))
    for piece, score in LATE.items():
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    return tokens, scores, types


def write(
    path: Path,
    *,
    add_prefix: bool | None = False,
    add_bos: bool | None = True,
    model: str = "llama",
    scores: object = "default",
    types: object = "default",
    with_bytes: tuple[int, ...] = tuple(range(256)),
) -> Path:
    """A tokenizer-only GGUF (no tensors: the tokenizer reader needs none). ``add_prefix`` / ``add_bos``
    None leave the key out; ``scores`` / ``types`` None leave the array out, a list replaces it."""
    tokens, real_scores, real_types = vocabulary(with_bytes)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(real_scores if scores == "default" else scores)
    if types is not None:
        w.add_token_types(real_types if types == "default" else types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)  # a single id, as llama.cpp writes it
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    if add_prefix is not None:
        w.add_add_space_prefix(add_prefix)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ================================================================================ the reference
def reference(text: str, add_prefix: bool) -> list[int]:
    """SentencePiece BPE as llama.cpp's llm_tokenizer_spm runs it, by brute force.

    Control tokens and user-defined tokens other than space runs are matched whole in the raw text
    (leftmost, longest); each stretch between them gets a U+2581 in front when ``add_prefix`` and its spaces
    become U+2581. Space-run tokens are looked up as U+2581 runs and merge before any piece (user-defined
    tokens win over merges); otherwise the pair whose concatenation has the highest score merges, ties by
    file position, then leftmost. What is left and is no token becomes its UTF-8 byte tokens."""
    tokens, scores, types = vocabulary()
    spelled = [SP * len(t) if types[i] == USER and not t.strip(" ") else t for i, t in enumerate(tokens)]
    ids = {t: i for i, t in enumerate(spelled)}
    whole = [t for t, s, k in zip(tokens, spelled, types, strict=True) if k in (CONTROL, USER) and t == s]

    def priority(piece: str) -> tuple:
        i = ids[piece]
        return (0 if types[i] == USER else 1, -scores[i], i)

    def spm(fragment: str) -> list[int]:
        fragment = (SP if add_prefix else "") + fragment.replace(" ", SP)
        symbols = list(fragment)
        while True:
            best = None
            for j in range(len(symbols) - 1):
                merged = symbols[j] + symbols[j + 1]
                if merged in ids and (
                    best is None or priority(merged) < priority(symbols[best] + symbols[best + 1])
                ):
                    best = j
            if best is None:
                break
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
        out = []
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")])
        return out

    out, start, i = [], 0, 0
    while i < len(text):
        match = max((t for t in whole if text.startswith(t, i)), key=len, default=None)
        if match is None:
            i += 1
            continue
        if i > start:
            out += spm(text[start:i])
        out.append(ids[match])
        i += len(match)
        start = i
    if start < len(text):
        out += spm(text[start:])
    return out


TEXTS = [
    "Hello world, the cat is on the mat.",
    " leading space and trailing ",
    "a  the  and   cat    is     on      it",
    "line\n\nbreak\n\n\nHello\n\n\n\nworld\n",
    "<table>the cat</table> <table>",
    "emoji 😀 and 漢字 and é and ü",
    "<bos>Hello<start_of_turn>the<eos>",
    "The 12 cats, the 21 hats.",
    "",
    " ",
    "     ",
]


def fuzz(seed: int, n: int = 60) -> list[str]:
    alphabet = list("ethaonlrdwiscHT,.12é ") + [" ", " ", "\n", "ü", "😀", "漢", "<table>", "the ", "Hello"]
    g = random.Random(seed)
    return ["".join(g.choice(alphabet) for _ in range(g.randint(1, 30))) for _ in range(n)]


@pytest.mark.parametrize("add_prefix", [False, True, None], ids=["no-prefix", "prefix", "key-missing"])
def test_ids_equal_the_sentencepiece_reference(tmp_path, add_prefix):
    """Every id equals the brute-force SentencePiece BPE, for add_space_prefix false, true and absent
    (llama.cpp's default for llama vocabularies: true)."""
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf", add_prefix=add_prefix))
    expect_prefix = True if add_prefix is None else add_prefix
    for text in TEXTS + fuzz(7):
        assert tok.encode(text) == reference(text, expect_prefix), repr(text)


def test_missing_add_space_prefix_is_llama_default(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf", add_prefix=None))
    ids = tok.encode("Hello world")
    assert tok.backend.id_to_token(ids[0]) == "▁Hello" and tok.prefix_bytes == 1
    assert tok.decode(ids) == "Hello world"


def test_add_space_prefix_false_keeps_text_as_is(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf", add_prefix=False))
    assert [tok.backend.id_to_token(i) for i in tok.encode("Hello world")] == ["Hello", "▁world"]
    assert tok.prefix_bytes == 0 and tok.decode(tok.encode(" Hello")) == " Hello"


def test_merges_follow_scores_not_file_order(tmp_path):
    """llama.cpp merges the pair whose merged token scores highest: " he" is "▁h" (last in the file, scored
    near the top) + "e", not "▁" + "he"; " at" is "▁a" + "t" ("▁a" outscores "at")."""
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    assert [tok.backend.id_to_token(i) for i in tok.encode(" he")] == ["▁h", "e"]
    assert [tok.backend.id_to_token(i) for i in tok.encode(" at")] == ["▁a", "t"]
    assert [tok.backend.id_to_token(i) for i in tok.encode(" the")] == ["▁the"]
    assert [tok.backend.id_to_token(i) for i in tok.encode("Hello")] == ["Hello"]


def test_byte_fallback_for_characters_outside_the_vocabulary(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    ids = tok.encode("😀漢")
    assert [tok.backend.id_to_token(i) for i in ids] == [f"<0x{b:02X}>" for b in "😀漢".encode()]
    assert tok.decode(ids) == "😀漢" and 3 not in ids  # never <unk>


def test_user_defined_tokens_stay_whole(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    vocab = tok.backend.get_vocab()
    assert tok.encode("<table>") == [vocab["<table>"]]
    assert tok.encode("\n\n\nHello") == [vocab["\n\n\n"], vocab["Hello"]]
    assert tok.decode(tok.encode("a<table>\n\nb")) == "a<table>\n\nb"


def test_space_runs_are_respelled_and_merge_first(tmp_path):
    """Space-run tokens (real spaces in the file) match the U+2581 runs of the text, before any piece:
    ' ' x 5 is "  " + "   " (BPE merges pairs first), and "▁▁" wins over the better-scored "▁the"."""
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    ids = {t: i for t, i in tok.backend.get_vocab().items()}
    assert tok.encode("a     the") == [ids["a"], ids[SP * 2], ids[SP * 3], ids["t"], ids["he"]]
    assert tok.encode("  ") == [vocabulary()[0].index("  ")]  # the file's id, stored with real spaces
    assert tok.decode(tok.encode("a     the")) == "a     the"


@pytest.mark.parametrize("add_prefix", [False, True])
def test_round_trip_offsets_and_byte_lengths(tmp_path, add_prefix):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf", add_prefix=add_prefix))
    lengths = tok.byte_lengths()
    for text in [t for t in TEXTS + fuzz(11) if "<bos>" not in t and t.strip(" ")]:
        ids = tok.encode(text)
        if not add_prefix:
            assert tok.decode(ids) == text, repr(text)
            assert int(lengths[ids].sum()) == len(text.encode("utf-8")), repr(text)
        elif "<table>" not in text and "\n" not in text:
            assert tok.decode(ids) == text, repr(text)
            assert int(lengths[ids].sum()) == len(text.encode("utf-8")) + 1, repr(text)  # the prefix
        got, offsets = tok.encode_offsets(text)
        assert got == ids and len(offsets) == len(ids)


def test_special_ids_frame_save_and_reload(tmp_path):
    path = write(tmp_path / "t.gguf", add_bos=None)
    tok = read_gguf_tokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (2, 1, 0, True)  # add_bos: llama.cpp default
    assert tok.vocab_size == len(vocabulary()[0]) and "sentencepiece" in tok.name
    assert tok.frame("Hello")[0] == 2
    (tmp_path / "saved").mkdir()
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    for text in TEXTS + fuzz(3):
        assert again.encode(text) == tok.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (2, 1, 0)
    assert read_gguf_tokenizer(path).fingerprint() == tok.fingerprint()
    assert read_gguf_tokenizer(write(tmp_path / "u.gguf", add_bos=False)).add_bos is False


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scores": None}, r"tokenizer\.ggml\.scores has no entries"),
        ({"scores": [0.0] * 10}, r"tokenizer\.ggml\.scores has 10 entries, expected one per token"),
        ({"types": [1] * 10}, r"tokenizer\.ggml\.token_type has 10 entries, expected one per token"),
        ({"with_bytes": tuple(range(255))}, r"tokenizer\.ggml\.tokens has byte tokens but not <0xFF>"),
        ({"model": "bert"}, r"tokenizer\.ggml\.model = 'bert' is not supported \(supported: 'gpt2'.*'llama'"),
    ],
    ids=["no-scores", "short-scores", "short-types", "missing-byte", "unsupported"],
)
def test_bad_files_are_one_line_errors(tmp_path, kwargs, match):
    path = write(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(DiffquantError, match=match) as excinfo:
        read_gguf_tokenizer(path)
    assert str(path) in _one_line(excinfo)


# The real Gemma-3 file's tokenizer against transformers': tests/test_real_gemma3.py (it fetches the file).
