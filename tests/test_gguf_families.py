"""`gguf:` for the NeoX-RoPE families llama.cpp writes: qwen2, qwen3 and gemma3, against transformers.

Each fixture is a random tiny transformers model (the same builder as tests/test_families.py) written to GGUF
here the way llama.cpp's ``convert_hf_to_gguf.py`` writes that architecture: its tensor names (the table
below, written out from llama.cpp's ``gguf-py/gguf/tensor_mapping.py``), no Q/K permutation (the NeoX RoPE
families keep HF's rotate-half rows), Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, and for Gemma 3
every norm weight stored as w + 1 (``Gemma3Model.modify_tensors``). The reference is the transformers model
the file was written from, and, where it reads the architecture, transformers' own GGUF loader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_families import _hf_model, _rel, _transformers
from test_gguf import Q, _add_tensor
from test_gguf import tok_files as tok_files  # noqa: F401 (the fixture, shared)

from diffquant.errors import DiffquantError
from diffquant.io import load_model

gguf = pytest.importorskip("gguf")
VOCAB = 448  # above the shared tokenizer's 401 ids (the rest written as unused tokens)
RTOL = 1e-5  # fp32 weights written as F32: only summation order differs

# HF name inside a layer -> llama.cpp's GGUF name (blk.N.<name>)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",  # Llama / Qwen: the pre-MLP norm
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3 renames the norms around the MLP (llama.cpp: post_attention_norm, ffn_norm, post_ffw_norm).
GEMMA_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_family_gguf(path: Path, hf_model, arch: str, tok, qtype=Q.F32, pre: str = "default") -> Path:
    """``hf_model`` as llama.cpp's converter writes an ``arch`` GGUF (metadata, names, norm shift), its
    tokenizer the shared byte-level BPE under pre-tokenizer ``pre``."""
    c = hf_model.config
    gemma = arch == "gemma3"
    names = GEMMA_NAMES if gemma else LAYER_NAMES
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch != "qwen2":  # Qwen3Model / Gemma3Model write the head widths
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = c.rope_parameters["full_attention"] if gemma else c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if gemma:
        w.add_sliding_window(c.sliding_window)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(0)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tok.tokens + [f"<unused{i}>" for i in range(c.vocab_size - len(tok.tokens))])
    w.add_token_types(tok.types + [5] * (c.vocab_size - len(tok.tokens)))
    w.add_token_merges(tok.merges)
    g = np.random.default_rng(0)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"]}
    tensors["output_norm.weight"] = state["model.norm.weight"]
    if not c.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            key = f"model.layers.{i}.{hf_name}"
            if key in state:
                tensors[f"blk.{i}.{gguf_name}"] = state[key]
    for name, array in tensors.items():
        if gemma and name.endswith("norm.weight"):
            array = array + np.float32(1)  # llama.cpp: data_torch + 1 for every Gemma norm
        kind = Q.F32 if array.ndim == 1 else qtype
        _add_tensor(w, name, np.ascontiguousarray(array), kind, g)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QWEN = {
    # 10 layers, GQA, tied, biases (Qwen2 always has q/k/v biases)
    "qwen2": (
        "qwen2",
        {
            "num_hidden_layers": 10,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
    ),
    # head_dim 24 != 64 / 4, an eps large enough that the q/k norms' eps shows, untied head
    "qwen3": (
        "qwen3",
        {
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "rms_norm_eps": 1e-3,
            "tie_word_embeddings": False,
        },
    ),
}


def _ids(vocab: int, length: int = 24, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(QWEN))
def test_qwen_gguf_matches_transformers(tmp_path, tok_files, name):  # noqa: F811 (the shared fixture)
    model_type, overrides = QWEN[name]
    hf_model = _hf_model(model_type, overrides, seed=5, vocab=VOCAB)
    path = write_family_gguf(tmp_path / f"{name}.gguf", hf_model, model_type, tok_files)
    model = load_model(f"gguf:{path}")
    c = model.config
    assert (c.attention_bias, c.qk_norm, c.tie_embeddings) == (
        name == "qwen2",
        name == "qwen3",
        hf_model.config.tie_word_embeddings,
    )
    assert c.head_dim == (24 if name == "qwen3" else 16) and c.n_layers == hf_model.config.num_hidden_layers
    ids = _ids(c.vocab_size)
    with torch.no_grad():
        ref = hf_model(ids).logits
        got = model(ids)
    rel = _rel(got, ref)
    print(f"\n{name}: max rel logits diff vs the transformers model {rel:.2e}")
    assert rel < RTOL, rel


def test_qwen2_tokenizer_equals_transformers_gguf_loader(tmp_path, tok_files):  # noqa: F811
    """tokenizer.ggml.pre = qwen2 (what llama.cpp writes for Qwen2 / Qwen2.5 / Qwen3): the Llama 3 regex
    with single digits (\\p{N}, not \\p{N}{1,3}), merges applied (no whole-word lookup), no BOS. The
    reference is transformers' own GGUF tokenizer for a qwen2 file; the shared fixture's merges join
    digits only after a space, so two merges of bare digits are added ("1 2", "12 3"): under a Llama 3
    split "123" would be one token."""
    import dataclasses

    from test_gguf import DIGIT_FREE, USER_TOKEN, WITH_DIGITS

    from diffquant.io.convert_gguf import read_gguf_tokenizer

    tf = _transformers()
    model_type, overrides = QWEN["qwen2"]
    hf_model = _hf_model(model_type, {**overrides, "num_hidden_layers": 1}, seed=6, vocab=VOCAB)
    tok = dataclasses.replace(
        tok_files,
        tokens=tok_files.tokens + ["12", "123"],
        types=tok_files.types + [1, 1],
        merges=tok_files.merges + ["1 2", "12 3"],
    )
    path = write_family_gguf(tmp_path / "qwen2.gguf", hf_model, "qwen2", tok, pre="qwen2")
    ours = read_gguf_tokenizer(path)
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    vocab = dict(enumerate(tok.tokens))
    for text in DIGIT_FREE + WITH_DIGITS + ["Qwen2.5-7B: 131072 tokens, 3x faster\n\n  in 2025!", "a1234"]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert all(sum(c.isdigit() for c in vocab[i]) <= 1 for i in ids), text  # one digit per token
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert not ours.add_bos and ours.encode(USER_TOKEN) == [len(tok_files.tokens) - 1]
    llama3 = write_family_gguf(tmp_path / "llama3.gguf", hf_model, "qwen2", tok, pre="llama-bpe")
    assert read_gguf_tokenizer(llama3).encode("a1234")[-2] == len(tok.tokens) - 1  # "123": the fixture tells
    assert len(ours.encode("a1234")) == 5  # them apart


def test_qwen2_quantized_gguf_matches_transformers_gguf_loader(tmp_path, tok_files):  # noqa: F811
    """Q8_0 / Q5_0 weights: the same dequantized model as transformers' GGUF loader builds (qwen2 only:
    its qwen3 reader ignores attention.key_length)."""
    tf = _transformers()
    model_type, overrides = QWEN["qwen2"]
    hf_model = _hf_model(model_type, overrides, seed=6, vocab=VOCAB)
    for qtype in (Q.Q8_0, Q.Q5_0):
        path = write_family_gguf(tmp_path / f"{qtype.name}.gguf", hf_model, "qwen2", tok_files, qtype)
        ours = load_model(f"gguf:{path}")
        theirs = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
        ids = _ids(ours.config.vocab_size)
        with torch.no_grad():
            rel = _rel(ours(ids), theirs(ids).logits)
        print(f"\nqwen2 {qtype.name}: max rel logits diff vs transformers' GGUF loader {rel:.2e}")
        assert rel < 1e-4, rel


def test_qwen2_gguf_without_biases_is_one_line(tmp_path, tok_files):  # noqa: F811
    """A qwen2 file missing its biases names the first missing tensor."""
    model_type, overrides = QWEN["qwen2"]
    hf_model = _hf_model(model_type, {**overrides, "num_hidden_layers": 2}, seed=7, vocab=VOCAB)
    for i in range(2):
        for p in ("q", "k", "v"):
            del hf_model.model.layers[i].self_attn._modules[f"{p}_proj"].bias
            hf_model.model.layers[i].self_attn._modules[f"{p}_proj"].bias = None
    path = write_family_gguf(tmp_path / "nobias.gguf", hf_model, "qwen2", tok_files)
    with pytest.raises(DiffquantError, match=r"missing tensor blk\.0\.attn_q\.bias and 5 more") as excinfo:
        load_model(f"gguf:{path}")
    assert "\n" not in str(excinfo.value)


def _gemma_model(seed: int, layers: int = 7):
    """A tiny Gemma 3 as llama.cpp would run its GGUF: every 6th layer global, sliding layers at RoPE base
    10000 (both fixed in llama.cpp, not in the file), a window of 4 keys over 24-token sequences."""
    from test_gemma3 import _hf_model as gemma_hf_model

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return gemma_hf_model(
        {
            "vocab_size": VOCAB,
            "num_hidden_layers": layers,
            "layer_types": types,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        seed=seed,
    )


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda t: t.name)
def test_gemma3_gguf_matches_transformers(tmp_path, tok_files, qtype):  # noqa: F811
    """Norm weights stored as w + 1 and shifted back in float32, GeGLU, sandwich norms, sqrt(d) embedding
    scale, q/k norms, layer 5 global among sliding layers: logits equal the transformers model the file was
    written from (Q8_0: that model with the same Q8_0 round trip of its matrices)."""
    hf_model = _gemma_model(seed=9)
    path = write_family_gguf(tmp_path / "g.gguf", hf_model, "gemma3", tok_files, qtype)
    model = load_model(f"gguf:{path}")
    c = model.config
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.head_dim) == (4, 5000.0, 10000.0, 24)
    assert c.norm_unit_offset and c.sandwich_norms and c.qk_norm and c.mlp_activation == "gelu_tanh"
    if qtype != Q.F32:  # the reference gets the same rounding of every matrix the file holds
        with torch.no_grad():
            for p in hf_model.parameters():
                if p.dim() == 2:
                    q = gguf.quants.quantize(p.detach().float().numpy(), qtype)
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype)).reshape(p.shape))
    ids = _ids(c.vocab_size)
    with torch.no_grad():
        rel = _rel(model(ids), hf_model(ids).logits)
    print(f"\ngemma3 {qtype.name}: max rel logits diff vs the transformers model {rel:.2e}")
    assert rel < RTOL, rel
    # Stored w + 1, read back as (w + 1) - 1 in float32: w up to the rounding of 1 + w (2^-23 per unit).
    norm = model.layers[0].attn_post_norm.weight
    ref = hf_model.model.layers[0].post_attention_layernorm.weight.detach()
    assert torch.equal(norm, (ref + 1) - 1) and (norm - ref).abs().max() <= 2**-23 * 2


def test_gemma3_gguf_refusals(tmp_path, tok_files):  # noqa: F811
    hf_model = _gemma_model(seed=10, layers=2)
    path = write_family_gguf(tmp_path / "g.gguf", hf_model, "gemma3", tok_files)
    reader_fields = gguf.GGUFReader(path).fields
    assert "gemma3.attention.sliding_window" in reader_fields
    capped = tmp_path / "capped.gguf"
    w = gguf.GGUFWriter(str(capped), "gemma3")
    for field in reader_fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(
            field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None
        )
    w.add_float32("gemma3.final_logit_softcapping", 30.0)
    for t in gguf.GGUFReader(path).tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        DiffquantError, match=r"gemma3.final_logit_softcapping = 30.0: logit soft-capping"
    ) as e:
        load_model(f"gguf:{capped}")
    assert "\n" not in str(e.value)


def test_gemma3_and_qwen2_ggufs_stream_like_the_whole_model(tmp_path, tok_files):  # noqa: F811
    """`--stream on` reads a gemma3 / qwen2 GGUF stage by stage with the same per-architecture transforms
    (norm shift, biases): logits and perplexity equal the whole model's, bit for bit."""
    from diffquant.eval.perplexity import evaluate_stream
    from diffquant.stream import evaluate_streamed, logits_streamed

    model_type, overrides = QWEN["qwen2"]
    files = {
        "gemma3": write_family_gguf(tmp_path / "g.gguf", _gemma_model(seed=3), "gemma3", tok_files),
        "qwen2": write_family_gguf(
            tmp_path / "q.gguf", _hf_model(model_type, overrides, seed=4, vocab=VOCAB), "qwen2", tok_files
        ),
    }
    for name, path in files.items():
        spec = f"gguf:{path}"
        whole = load_model(spec)
        ids = _ids(whole.config.vocab_size, batch=3)
        with torch.no_grad():
            want = torch.cat([whole(ids[:2]), whole(ids[2:])])
        assert torch.equal(logits_streamed(spec, ids, batch_size=2), want), name
        stream = _ids(whole.config.vocab_size, length=100, batch=1, seed=2).flatten()
        a = evaluate_stream(whole, stream, seq_len=24, batch_size=2)
        b = evaluate_streamed(spec, stream, seq_len=24, batch_size=2)
        assert a["perplexity"] == b["perplexity"] and a["tokens"] == b["tokens"], name
