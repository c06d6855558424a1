"""Shared fixtures. Environment that must be set before heavy imports goes first."""

import json
import os

# Triton's interpreter must be chosen before any module defining @triton.jit kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from diffquant.models import DecoderLM, ModelConfig, matched_config  # noqa: E402

BASE = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=96
)


# The rival kinds' variants (issue 30) by test id: (kind, variant fields). A bare kind name is its default.
VARIANTS: dict[str, tuple[str, dict]] = {
    "gated-headwise": ("gated", {"gate": "headwise"}),
    "sink-zero": ("sink", {"sink": "zero"}),
    "clipped-wide": ("clipped", {"clip_gamma": -0.1, "clip_zeta": 1.1}),
}
ALL_KINDS = ("baseline", "diff_v1", "diff_v2", "gated", "sink", "clipped")


def tiny_model(kind: str, seed: int = 0, **overrides) -> DecoderLM:
    """A small random model of ``kind`` (parameter-matched to BASE), in eval mode, fp32. ``kind`` may name a
    variant of :data:`VARIANTS` (``gated-headwise``), matched in that variant."""
    import dataclasses

    name, variant = VARIANTS.get(kind, (kind, {}))
    config = dataclasses.replace(matched_config(BASE, name, **variant), **overrides)
    torch.manual_seed(seed)
    return DecoderLM(config).eval()


def train_byte_bpe(folder, sentences, *, prepend_bos: bool = False, config: dict | None = None):
    """A small byte-level BPE trained on ``sentences`` (vocab 300, specials <|endoftext|> = 0, <|bos|> = 1),
    saved as ``folder``/tokenizer.json + tokenizer_config.json (``config`` adds keys); ``prepend_bos`` makes
    its post-processor put BOS in front, as Llama tokenizers do. Returns the tokenizer.json path."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(sentences) * 4, trainer)
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 1)]
        )
    path = folder / "tokenizer.json"
    tok.save(str(path))
    meta = {
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": prepend_bos,
        **(config or {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(meta))
    return path


def train_sentencepiece_like(
    folder, sentences, *, layout: str = "llama2", vocab_size: int = 200, config: dict | None = None
):
    """A SentencePiece-style BPE as Llama / Mistral tokenizer.json files hold it, trained offline on
    ``sentences``: ids 0-2 ``<unk> <s> </s>`` (specials), 3-258 the byte-fallback pieces ``<0x00>`` ..
    ``<0xFF>``, then the learned pieces with U+2581 for spaces; a dummy-prefix space in front of every text;
    decoder Replace(U+2581 -> space) + ByteFallback + Fuse + Strip(1 leading space); the post-processor puts
    ``<s>`` in front. ``layout`` 'llama2': normalizer Prepend + Replace, no pre-tokenizer (Llama-2's file);
    'metaspace': pre-tokenizer Metaspace(prepend_scheme 'first', split False), no normalizer (the newer
    layout transformers writes). Writes ``folder``/tokenizer.json; ``config`` (a dict) is written as
    tokenizer_config.json, None writes none (a bare tokenizer.json folder). Returns the tokenizer.json path."""
    import json

    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    space = "\u2581"
    folder.mkdir(parents=True, exist_ok=True)
    # Pieces are learned per word, each word starting with U+2581 (as sentencepiece splits), so no piece
    # spans a word boundary.
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="always", split=True)
    learner.train_from_iterator(
        list(sentences) * 4, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    )
    learned = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if layout == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    elif layout == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="first", split=False)
    else:
        raise ValueError(f"layout {layout!r}: expected 'llama2' or 'metaspace'")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    path = folder / "tokenizer.json"
    tok.save(str(path))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def save_tiny_llama(folder, *, context: int, **config):
    """A tiny random transformers Llama (vocab 320: larger than a 300-id test tokenizer, as real checkpoints
    pad their vocabularies; 2 layers, hidden 64, 4 / 2 heads) with unit-scale weights (default inits give
    near-uniform logits), saved into ``folder``; ``config`` overrides LlamaConfig fields."""
    import transformers

    cfg = transformers.LlamaConfig(
        **{
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": context,
            "tie_word_embeddings": False,
            **config,
        }
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(folder)
    return folder


# Progress lines appear only when a step takes longer than a few seconds, i.e. on a busy machine: a test that
# compares what a command prints (a README example, "one line" errors) would pass or fail with the machine's
# load. Every test runs quiet; tests of progress itself opt out (tests/test_progress.py), and
# DIFFQUANT_TEST_PROGRESS=1 turns this off (test_progress plays a busy machine with it and sees the failures).
TEST_PROGRESS_ENV = "DIFFQUANT_TEST_PROGRESS"


@pytest.fixture(autouse=True)
def quiet_progress(monkeypatch):
    from diffquant import progress

    if os.environ.get(TEST_PROGRESS_ENV) != "1":
        monkeypatch.setenv(progress.QUIET_ENV, "1")
    progress.set_quiet(None)
    yield
    progress.set_quiet(None)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """SmolLM2-135M's GGUF path and transformers' own model of it, loaded once per session: its GGUF
    dequantization costs half a minute, and the tests comparing logits (test_gguf) and perplexity
    (test_real_smollm2) against it would otherwise each pay it."""
    transformers = pytest.importorskip("transformers")
    from diffquant.io import fetch

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, reference.eval()


# `diffquant quantize` of SmolLM2 in the real tests: calibration on 2 x 256 tokens of the default calibration
# text (WikiText-2 validation), the error report on 256 held-out tokens (small, to keep the suite short).
SMOLLM2_QUANTIZE_ARGS = ["--seq-len", "256", "--calib-tokens", "512", "--eval-tokens", "256"]


@pytest.fixture(scope="session")
def smollm2_quantized(tmp_path_factory):
    """``quantize(plan, name=None) -> folder``: SmolLM2 quantized by ``diffquant quantize --plan PLAN`` with
    :data:`SMOLLM2_QUANTIZE_ARGS`, once per plan and session (``plan`` a preset name, or a plan file's text
    with ``name`` its folder's name). GPTQ's 210 Linears take ~30 s on two cores: the export tests
    (test_export_real) and GPTQ's own check (test_weights) read the same folder instead of each paying it."""
    from diffquant.cli import main
    from diffquant.io import fetch

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    base = tmp_path_factory.mktemp("smollm2-quantized")

    def quantize(plan: str, name: str | None = None):
        out = base / (name or plan)
        if not out.exists():
            if name is not None:
                (base / f"{name}.yaml").write_text(plan)
                plan = str(base / f"{name}.yaml")
            argv = ["quantize", f"gguf:{path}", "--plan", plan, "--out", str(out), *SMOLLM2_QUANTIZE_ARGS]
            assert main(argv) == 0
        return out

    return quantize


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """One ``diffquant demo`` per test session (two minutes on two cores), shared by the tests that read its
    output and its run folder (tests/test_readme.py, tests/test_zoo.py): running it once per test doubled
    the suite's slowest step without asserting anything more. A fresh process, quiet, as a user would run it.
    """
    import subprocess
    import sys
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("demo-run") / "demo"
    env = {**os.environ, "DIFFQUANT_QUIET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "diffquant.cli", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    return SimpleNamespace(out=out, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)


@pytest.fixture(params=["baseline", "diff_v1", "diff_v2"])
def kind(request) -> str:
    return request.param


@pytest.fixture(params=ALL_KINDS)
def any_kind(request) -> str:
    """Every attention kind, the rivals (gated, sink, clipped) too: for the checks that every stage works
    on every kind (paths, decoding, checkpoints, rotation, streaming, presets)."""
    return request.param


def assert_close_tree(a, b, where: str = "", rel: float = 1e-6) -> None:
    """Equal structure, strings, ints and locations; floats equal to ``rel`` (statistics merged in another
    order, e.g. across torchrun ranks, round differently)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_close_tree(a[key], b[key], f"{where}.{key}", rel)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close_tree(x, y, f"{where}[{i}]", rel)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=rel, abs=1e-12, nan_ok=True), where  # NaN equals NaN here
    else:
        assert a == b, where


def shard_safetensors(folder, n_shards: int) -> None:
    """Split ``folder``'s model.safetensors into ``n_shards`` shards with a model.safetensors.index.json
    (tensors dealt round-robin in sorted order), as Hugging Face writes large checkpoints."""
    single = folder / "model.safetensors"
    tensors = load_file(str(single))
    keys = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::n_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    single.unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
