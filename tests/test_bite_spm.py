"""SentencePiece control tokens in the normal suite (issue 47 item 4): ``<bos>``, ``<eos>``, ``<pad>``,
``<unk>`` and ``<start_of_turn>`` stand for no text, so they count zero bytes in bits per byte and are
skipped when decoding; user-defined tokens (newline runs, space runs, an HTML tag) are text and count theirs.

The fixture is tests/test_gguf_spm.py's SentencePiece GGUF (Gemma's layout: control tokens, user-defined
tokens, 256 byte tokens, scored pieces; add_space_prefix false as in Gemma's file) and real text: the first
paragraphs of WikiText-2 test in Gemma's chat framing (``<start_of_turn>user\\n ... <eos>``). Each expected
count comes from the vocabulary and the text themselves, not from the tokenizer under test.
"""

from __future__ import annotations

import math

import torch

from diffquant.data.corpus import iter_documents
from diffquant.data.tokenizer import count_bytes
from diffquant.eval.perplexity import evaluate_bpb
from diffquant.io.convert_gguf import read_gguf_tokenizer
from diffquant.models import DecoderLM, ModelConfig
from tests.test_gguf_spm import BYTE, CONTROL, SP, USER, vocabulary, write

CONTROLS = ("<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>")


def _wikitext(chars: int = 600) -> str:
    text = next(iter_documents("wikitext2:test")).text
    return text[:chars]


def _chat(text: str) -> str:
    """Two turns of Gemma's chat framing around real text, with control tokens written in the text."""
    half = len(text) // 2
    return f"<bos><start_of_turn>user\n{text[:half]}<eos>\n<start_of_turn>model\n{text[half:]}<eos>"


def _text_bytes(text: str) -> int:
    """The UTF-8 bytes of ``text`` less the control tokens written in it (they stand for no text)."""
    for control in CONTROLS:
        text = text.replace(control, "")
    return len(text.encode("utf-8"))


def test_byte_lengths_are_zero_for_control_tokens_and_the_text_for_the_rest(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    tokens, _, types = vocabulary()
    want = []
    for token, kind in zip(tokens, types, strict=True):
        if kind == CONTROL:
            want.append(0)
        elif kind == BYTE:
            want.append(1)
        elif kind == USER:
            want.append(len(token.encode("utf-8")))
        else:
            want.append(len(token.replace(SP, " ").encode("utf-8")))
    assert tok.byte_lengths().tolist() == want
    assert sum(k == CONTROL for k in types) == len(CONTROLS)


def test_control_tokens_in_real_text_count_no_bytes_and_decode_to_nothing(tmp_path):
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    text = _chat(_wikitext())
    ids = tok.encode(text)
    tokens = vocabulary()[0]
    controls = [i for i in ids if tokens[i] in CONTROLS]
    assert len(controls) == 5  # each control token written in the text is one id
    assert tokens.index("\n") in ids  # user-defined: a token of its own, and text
    assert count_bytes(torch.tensor(ids), tok) == _text_bytes(text)
    stripped = text
    for control in CONTROLS:
        stripped = stripped.replace(control, "")
    assert tok.decode(ids) == stripped
    assert tok.decode([tokens.index("<start_of_turn>"), tokens.index("\n\n"), tokens.index("<table>")]) == (
        "\n\n<table>"
    )


def test_bits_per_byte_of_a_chat_transcript_count_only_its_text(tmp_path):
    """evaluate_bpb on a file of chat-framed WikiText: the bytes are the text's (control tokens none, the
    stream's BOS / EOS none), and bits per byte is the float64 NLL of the text tokens (a control token is
    no text: not scored) over them."""
    tok = read_gguf_tokenizer(write(tmp_path / "t.gguf"))
    text = _chat(_wikitext(300))
    source = tmp_path / "chat.txt"
    source.write_text(text, encoding="utf-8")
    n_ids = len(tok.encode(text)) + 2  # the stream frames the document with BOS and EOS
    config = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
        max_seq_len=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(config).double().eval()
    result = evaluate_bpb(model, str(source), max_tokens=n_ids, seq_len=n_ids, tokenizer=tok)
    assert result["n_bytes"] == _text_bytes(text)
    stream = torch.tensor([tok.bos_id, *tok.encode(text), tok.eos_id])
    with torch.no_grad():
        logp = torch.log_softmax(model(stream[None, :-1]).double(), -1)[0]
    tokens = vocabulary()[0]
    text_targets = torch.tensor([tokens[int(i)] not in CONTROLS for i in stream[1:]])
    assert int((~text_targets).sum()) == 6  # five written in the text, the stream's EOS
    nats = -float(logp.gather(-1, stream[1:, None])[text_targets].sum())
    assert result["n_tokens_scored"] == int(text_targets.sum())
    assert math.isclose(result["bits_per_byte"], nats / math.log(2) / _text_bytes(text), rel_tol=1e-9)
