"""SentencePiece-style tokenizers (Llama / Mistral tokenizer.json files) end to end.

The fixture (conftest.train_sentencepiece_like, built offline with `tokenizers`) has what those files have:
byte-fallback pieces ``<0xNN>`` for characters outside the vocabulary, U+2581 for spaces, a dummy-prefix
space in front of every text (a normalizer in Llama-2's file, a Metaspace pre-tokenizer in newer ones), and
BOS put in front by the post-processor. Every number is checked against a count made independently: the
UTF-8 bytes of the documents themselves, log-probabilities from one float64 forward, lm-eval's own split.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, train_sentencepiece_like

from diffquant.data import HFTokenizer, load_tokenizer, token_stream
from diffquant.data.tokenizer import count_bytes, text_bytes
from diffquant.errors import DiffquantError

tokenizers = pytest.importorskip("tokenizers")

SENTENCES = [
    "The river bends twice before it reaches the old mill.",
    "Bakers in the market square start work while the streets are still dark.",
    "On quiet mornings the fog settles over the fields.",
]
# Documents with characters the tokenizer never saw (byte fallback: 2-4 pieces each), a newline, digits,
# double spaces: what real text brings.
DOCS = [
    "The river bends twice.",
    "Café au lait, naïve résumé ✓ 日本語",
    "The fog  settles over the mill. ",
    "Bakers start work\nwhile it is dark: 4821 loaves",
    "Zürich",
]
# A document that starts with a space: Llama-2's normalizer prepends the dummy prefix to it as to any text;
# a Metaspace(prepend_scheme 'first') tokenizer takes that space as the prefix, so " The" and "The" get the
# same ids there and no count from ids can tell their bytes apart (checked only for 'llama2').
LEADING_SPACE = " The fog settles over the mill."
LLAMA_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
LAYOUTS = ("llama2", "metaspace")


def _folder(tmp_path: Path, layout: str = "llama2", config: dict | None = LLAMA_CONFIG) -> Path:
    folder = tmp_path / f"sp-{layout}"
    train_sentencepiece_like(folder, SENTENCES, layout=layout, config=config)
    return folder


def _jsonl(tmp_path: Path, docs: list[str]) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fixture_is_a_byte_fallback_sentencepiece(tmp_path, layout):
    tok = load_tokenizer(_folder(tmp_path, layout))
    backend = tok.backend
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    for doc in DOCS:
        ids = tok.encode(doc)
        assert tok.decode(ids) == doc  # dummy prefix stripped, byte pieces fused back into characters
    pieces = backend.encode("naïve 日本", add_special_tokens=False).tokens
    assert pieces[0].startswith("\u2581") and "<0xC3>" in pieces and "<0xE6>" in pieces
    lengths = tok.byte_lengths()
    assert all(int(lengths[3 + b]) == 1 for b in range(256))  # <0x00> .. <0xFF>: one byte each
    assert int(lengths[backend.token_to_id("\u2581river")]) == len(" river")
    assert tok.prefix_bytes == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bits_per_byte_divides_by_the_bytes_of_the_text(tmp_path, layout):
    """Every text token of a JSONL source scored once (chained windows): the bytes are exactly the UTF-8
    bytes of the documents (the dummy-prefix space of each is not one of them), and bits per byte is the
    float64 NLL over those bytes."""
    from diffquant.eval.perplexity import evaluate_bpb

    tok = load_tokenizer(_folder(tmp_path, layout))
    docs = DOCS + [LEADING_SPACE] * (layout == "llama2")
    source = _jsonl(tmp_path, docs)
    stream = token_stream(source, None, tok)
    want_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert count_bytes(stream, tok) == want_bytes
    assert stream[0] == tok.bos_id and int((stream == tok.eos_id).sum()) == len(docs)
    model = tiny_model("baseline", vocab_size=tok.vocab_size, max_seq_len=512)
    n = stream.numel()
    got = evaluate_bpb(model, source, max_tokens=n, seq_len=n, windows="chained", tokenizer=tok, batch_size=2)
    assert got["tokens"] == n and got["n_windows"] == 1
    with torch.no_grad():
        logp = torch.log_softmax(model(stream[None]).double()[0, :-1], dim=-1)
    specials = {tok.bos_id, tok.eos_id}
    targets = [t for t in range(1, stream.numel()) if int(stream[t]) not in specials]
    nats = -sum(float(logp[t - 1, stream[t]]) for t in targets)
    assert got["n_tokens_scored"] == len(targets) and got["n_bytes"] == want_bytes
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / want_bytes, rel=1e-6)


def test_text_bytes_per_position_match_the_decoded_text(tmp_path):
    """Position by position: the bytes of a document's first k tokens are the bytes of their decoded text
    (the decoder strips the dummy prefix), for every k, across document boundaries."""
    tok = load_tokenizer(_folder(tmp_path))
    for doc in [*DOCS, LEADING_SPACE]:
        ids = tok.frame(doc)
        per = text_bytes(torch.tensor(ids), tok).tolist()
        for k in range(1, len(ids) + 1):
            decoded = tok.backend.decode(ids[:k], skip_special_tokens=True)
            if "\ufffd" in decoded:  # cut inside a character's byte pieces
                continue
            assert sum(per[:k]) == len(decoded.encode("utf-8")), (doc, k)


def test_offsets_locate_text_in_byte_fallback_pieces(tmp_path):
    tok = load_tokenizer(_folder(tmp_path))
    text = "The code is 4821, naïve ✓ mill"
    ids, offsets = tok.encode_offsets(text)
    assert ids == tok.encode(text) and len(offsets) == len(ids)
    lo, hi = text.index("4821"), text.index("4821") + 4
    inside = [i for i, (s, e) in enumerate(offsets) if s < hi and e > lo]
    assert "4821" in tok.decode([ids[i] for i in inside])
    # the byte pieces of one character all point at that character
    check = text.index("✓")
    pieces = [i for i, (s, e) in enumerate(offsets) if (s, e) == (check, check + 1)]
    assert [tok.backend.id_to_token(ids[i]) for i in pieces] == ["<0xE2>", "<0x9C>", "<0x93>"]


def test_lm_eval_loglikelihood_splits_at_the_continuation(tmp_path):
    """lm-eval's (context, continuation) split through diffquant's adapter: the continuation is the
    tokens of ' bends twice' after encode(context), and its log-likelihood is the float64 sum over them
    from one forward of [BOS] + context + continuation."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from diffquant.eval.lmeval import DiffquantLM

    tok = load_tokenizer(_folder(tmp_path))
    model = tiny_model("baseline", vocab_size=tok.vocab_size, max_seq_len=128)
    model.tokenizer = tok
    pairs = [("The river", " bends twice"), ("Café au", " lait ✓"), ("", "Zürich mill")]
    lm = DiffquantLM(model, batch_size=2)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs])
    for (ctx, cont), (ll, _) in zip(pairs, got, strict=True):
        whole = tok.encode(ctx + cont)
        context = tok.encode(ctx) if ctx else []
        assert whole[: len(context)] == context  # the split falls on a token boundary here
        continuation = whole[len(context) :]
        assert tok.decode(continuation).strip() == cont.strip()
        ids = torch.tensor([[tok.bos_id, *whole]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).double()[0, :-1], dim=-1)
        n = len(continuation)
        want = sum(float(logp[-n + j, continuation[j]]) for j in range(n))
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------------- special tokens from the files
def test_bare_tokenizer_json_folder_takes_bos_from_its_post_processor(tmp_path):
    """No tokenizer_config.json (a folder holding only tokenizer.json): BOS is the token the file's own
    post-processor puts in front, so documents are framed as the model was trained."""
    folder = _folder(tmp_path, config=None)
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json"]
    tok = load_tokenizer(folder)
    want = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode("The river").ids
    assert (tok.bos_id, tok.add_bos) == (want[0], True)
    assert tok.frame("The river") == want  # eos: none named anywhere, so none


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_eos_and_bos_ids_given_as_lists(tmp_path, file):
    folder = _folder(tmp_path, config=None)
    (folder / file).write_text(json.dumps({"bos_token_id": [1], "eos_token_id": [2, 1], "pad_token_id": -1}))
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.frame("mill") == [1, *tok.encode("mill"), 2]
    # generation_config.json is read before config.json; tokenizer_config.json names tokens before both
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_tokenizer(folder).eos_id == 0
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(folder).eos_id == 2


@pytest.mark.parametrize("value", ["2", [2, "x"], True, {"id": 2}, 2.0])
def test_malformed_special_ids_are_refused(tmp_path, value):
    folder = _folder(tmp_path, config=None)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(DiffquantError) as info:
        load_tokenizer(folder)
    message = str(info.value)
    assert "config.json" in message and "eos_token_id" in message and repr(value) in message
    assert "\n" not in message


def test_bos_token_not_in_the_vocabulary_is_refused(tmp_path, capsys):
    from diffquant.cli import main

    folder = _folder(tmp_path, config={**LLAMA_CONFIG, "bos_token": "<|begin_of_text|>"})
    with pytest.raises(DiffquantError) as info:
        load_tokenizer(folder)
    message = str(info.value)
    assert "tokenizer_config.json" in message and "bos_token '<|begin_of_text|>'" in message
    assert "not in the vocabulary" in message
    out = tmp_path / "run"
    assert main(["profile", "init:baseline:tiny", "--tokenizer", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "<|begin_of_text|>" in err and not out.exists()
