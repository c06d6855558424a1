"""Which windows of a perplexity evaluation start with BOS (the ``bos`` key of ppl / bpb / decode tasks),
checked against transformers' own loss on windows built in the test from transformers' tokenizer.

A tiny random HF Llama with a SentencePiece-style tokenizer that adds BOS (as Llama / Gemma do), on real text
(WikiText-2 test, one document): ``stream`` = [BOS] + text + [EOS] cut into disjoint windows (only window 0
starts with BOS), ``none`` = text + [EOS] cut the same way, ``window`` = BOS + seq_len - 1 text tokens per
window. Each scores seq_len - 1 targets per window, none of them a BOS.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, train_sentencepiece_like
from test_sentencepiece import LLAMA_CONFIG, SENTENCES

from diffquant.errors import DiffquantError

WIKITEXT = Path(__file__).resolve().parents[1] / "diffquant" / "data" / "wikitext2" / "wiki.test.raw"
SEQ, N = 32, 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from diffquant.io import load_model

    folder = tmp_path_factory.mktemp("bos")
    train_sentencepiece_like(folder, SENTENCES, config=LLAMA_CONFIG)
    save_tiny_llama(folder, context=64, vocab_size=400)
    text = folder / "text.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    ours = load_model(f"hf:{folder}").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return ours, theirs, tok, text


def _reference(theirs, tok, text: Path, bos: str) -> float:
    """exp(mean NLL) of transformers' model over N windows of SEQ built here by the convention."""
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False).input_ids + [tok.eos_token_id]
    if bos == "stream":
        windows = torch.tensor([tok.bos_token_id, *ids][: N * SEQ]).view(N, SEQ)
    elif bos == "none":
        windows = torch.tensor(ids[: N * SEQ]).view(N, SEQ)
    else:
        body = torch.tensor(ids[: N * (SEQ - 1)]).view(N, SEQ - 1)
        windows = torch.cat([torch.full((N, 1), tok.bos_token_id), body], dim=1)
    with torch.no_grad():
        losses = [theirs(w[None], labels=w[None]).loss.item() for w in windows]
    return math.exp(sum(losses) / N)  # equal-length windows: the mean of the means is the mean


@pytest.mark.parametrize("bos", ["stream", "window", "none"])
def test_each_bos_convention_equals_transformers(llama, bos):
    from diffquant.eval.perplexity import evaluate_bpb

    ours, theirs, tok, text = llama
    out = evaluate_bpb(ours, str(text), max_tokens=N * SEQ, seq_len=SEQ, windows="disjoint", bos=bos)
    assert (out["bos"], out["n_windows"], out["n_tokens_scored"]) == (bos, N, N * (SEQ - 1))
    assert out["perplexity"] == pytest.approx(_reference(theirs, tok, text, bos), rel=1e-5)


def test_the_conventions_differ_and_a_task_records_its_own(llama, tmp_path):
    """The three give different numbers (else the key would not matter); the task key reaches the result,
    decode mode included (its prefill holds the window's BOS)."""
    from diffquant.eval.tasks import parse_task, run_task

    ours, _, _, text = llama
    got = {}
    for bos in ("stream", "window", "none"):
        task = parse_task(f"ppl:data={text},tokens={N * SEQ},seq_len={SEQ},windows=disjoint,bos={bos}")
        got[bos] = run_task(ours, task, batch_size=2)
        assert got[bos]["bos"] == bos
    assert len({round(r["perplexity"], 6) for r in got.values()}) == 3
    decode = parse_task(f"ppl:data={text},tokens={N * SEQ},seq_len={SEQ},decode=8,bos=window")
    out = run_task(ours, decode, batch_size=2)
    assert out["bos"] == "window" and out["decode"] == 8


def test_bos_window_refuses_what_it_cannot_do(llama):
    from diffquant.eval.perplexity import evaluate_bpb
    from diffquant.eval.tasks import parse_task

    ours, _, _, text = llama
    with pytest.raises(
        DiffquantError, match="bos 'window' puts BOS before each disjoint window; it excludes"
    ):
        evaluate_bpb(ours, str(text), max_tokens=N * SEQ, seq_len=SEQ, windows="chained", bos="window")
    with pytest.raises(DiffquantError, match="bos"):
        parse_task("ppl:bos=always")
