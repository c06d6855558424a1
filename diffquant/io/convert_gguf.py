"""llama.cpp GGUF files -> native DecoderLM (baseline attention), with the tokenizer the file describes.

:func:`load_gguf` reads a ``llama``-architecture GGUF (what llama.cpp's ``convert_hf_to_gguf.py`` writes for
Llama, SmolLM, TinyLlama, ...): the config comes from the ``llama.*`` metadata, each tensor is dequantized
(F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants, ...: whatever ``gguf.quants.dequantize`` handles) and
assigned once by :func:`diffquant.io.assemble.assemble`, so the model is never held twice.

Loading holds the weights once, in the requested dtype, plus small bounded temporaries
(analysis/load/bench.py measures it):

- the header (metadata and tensor table) is parsed by :class:`GGUFFile` from plain reads, keeping each
  string as one ``bytes`` object; ``gguf.GGUFReader`` builds two numpy views per string (~160 MB for a
  49k-token vocabulary and its merges) and maps the whole file;
- each tensor is read with plain file reads of its own byte range, ``CHUNK_ELEMENTS`` values' worth of rows
  at a time, dequantized by ``gguf.quants.dequantize`` (rows hold whole quant blocks, so any row range is a
  valid input) and cast straight into a preallocated tensor of the target dtype. Nothing is memory-mapped,
  so the file's pages stay in the page cache, not in the process; no float32 copy of a whole tensor is
  ever made when the target is narrower; and ``dequantize``'s own temporaries (it holds its whole output
  twice) are bounded by a chunk.

Two layout facts matter:

- GGUF lists dimensions fastest-first (``ne[0]`` = columns), the reverse of torch, and stores rows
  contiguously, so a GGUF ``[576, 1536]`` is a torch ``(1536, 576)`` weight.
- llama.cpp rotates adjacent channel pairs (GPT-J style RoPE), HF Llama and the native model rotate the two
  halves of each head (GPT-NeoX style). The converter therefore permutes the rows of ``attn_q`` / ``attn_k``
  per head; :func:`ggml_rows_to_halves` undoes it.

:func:`gguf_tokenizer` rebuilds the tokenizer from the ``tokenizer.ggml.*`` metadata as a
``tokenizers.Tokenizer`` that splits text the way llama.cpp does for the file's ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pickle
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffquant.data.tokenizer import HFTokenizer
from diffquant.errors import DiffquantError
from diffquant.io.assemble import FLOAT_DTYPES, Transform, assemble, check_float_dtype, check_layer_count
from diffquant.io.gguf_spm import sentencepiece_tokenizer
from diffquant.io.gguf_vocab import (  # noqa: F401 (the token types stay importable from here)
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    special_ids,
    token_types,
    vocabulary_tokens,
)
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import DecoderLM
from diffquant.progress import step


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """What one ``general.architecture`` means, as llama.cpp's ``convert_hf_to_gguf.py`` writes it and its
    ``llama-model.cpp`` reads it back. Every key of the metadata is ``<name>.<key>``.

    ``permuted_qk``: Q / K rows written in the interleaved (GPT-J) RoPE order (``LlamaModel.permute``); the
    NeoX-RoPE families (Qwen2, Qwen3, Gemma 3) are written in HF's rotate-half order and kept as they are.
    ``attention_bias``: q / k / v biases (Qwen2). ``qk_norm``: ``attn_q_norm`` / ``attn_k_norm`` per head
    (Qwen3, Gemma 3). ``gemma``: Gemma 3's layer features (sandwich norms, (1 + w) norms stored as w + 1,
    sqrt(d) embedding scale, GeGLU, 5 sliding layers to 1 global layer).
    """

    name: str
    permuted_qk: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    a.name: a
    for a in (
        GGUFArchitecture("llama", permuted_qk=True),
        GGUFArchitecture("qwen2", attention_bias=True),
        GGUFArchitecture("qwen3", qk_norm=True),
        GGUFArchitecture("gemma3", qk_norm=True, gemma=True),
    )
}
# Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer is global (a fixed
# pattern, not in the file), sliding layers use RoPE base 10000 unscaled (rope_freq_base_train_swa).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# The layer index in a GGUF tensor name (``blk.3.attn_q.weight``).
GGUF_LAYER_PATTERN = r"blk\.(\d+)\."

# GPT-2's split pattern, as llama.cpp spells it (tokenizers' ByteLevel(use_regex=True) uses the same one,
# plus a final `|\s+` that changes nothing: llama.cpp keeps unmatched text as pieces of its own anyway).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2; Qwen2's tokenizer.json spells the contractions (?i:...)):
# Llama 3's pattern with each digit a piece of its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> llama.cpp's pre-tokenizer family (llama-vocab.cpp). Each family is a list of regexes
# applied in turn, each splitting the pieces of the previous one (matches and the text between them).
_PRE_FAMILY = {
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "gpt2": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "default": "default",
}


# ============================================================================================ model
def load_gguf(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """A native baseline DecoderLM (eval mode) from a llama-architecture GGUF file, tokenizer attached.

    ``dtype`` is what every dequantized tensor is cast to (None = float32: a quantized file has no floating
    dtype of its own to keep). The tokenizer rebuilt from the file's metadata is ``model.tokenizer``.
    """
    check_float_dtype(dtype, "requested dtype")
    file = Path(path)
    reader, config, tokenizer = read_gguf_model(file)
    source = gguf_tensors(reader, file, config, dtype or torch.float32)
    key_map = gguf_key_map(config)
    transforms = gguf_transforms(config, metadata(reader, "general.architecture"))
    # seconds for a small model, minutes for a large one on a busy machine: a line every interval then
    model = assemble(
        config,
        source,
        key_map,
        transforms,
        device,
        dtype or torch.float32,
        desc=f"load {file.name}: dequantize",
    )
    model.tokenizer = tokenizer  # a plain attribute: stages read getattr(model, "tokenizer", None)
    return model


def read_gguf_model(file: Path) -> tuple[GGUFFile, ModelConfig, HFTokenizer]:
    """The header, config and tokenizer of a GGUF, checked against each other, nothing dequantized.

    Shared by :func:`load_gguf` and the layer-streamed source (:mod:`diffquant.io.gguf_source`), so both
    refuse the same files with the same one-line errors. The ``tokenizer.ggml.*`` metadata is dropped from
    the returned header: the vocabulary and merges are ~100k ``bytes`` objects (a few MB), and the tokenizer
    holds its own copy.
    """
    reader = read_gguf(file)
    config = config_from_gguf(reader, str(file))
    tokenizer = cached_gguf_tokenizer(reader, str(file))
    if tokenizer.vocab_size > config.vocab_size:
        raise DiffquantError(
            f"{file}: the tokenizer produces ids up to {tokenizer.vocab_size - 1}, but the embedding has "
            f"{config.vocab_size} rows"
        )
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    return reader, config, tokenizer


def gguf_tensors(reader: GGUFFile, file: Path, config: ModelConfig, dtype: torch.dtype) -> GGUFTensors:
    """The tensors of ``file`` dequantized into ``dtype`` on ``get``, after the checks that need no data:
    the layer count the tensor names hold (:func:`config_from_gguf` checked it already for a config it
    read; repeated for a config from elsewhere), and every mapped tensor of a type gguf can dequantize."""
    source = GGUFTensors(reader, file, dtype, shifts=gguf_shifts(config))
    check_layer_count(config.n_layers, source.keys(), GGUF_LAYER_PATTERN, str(file))
    source.check_types(list(gguf_key_map(config).values()))
    return source


def read_gguf(file: Path) -> GGUFFile:
    """The header of ``file`` (metadata and tensor table, see :class:`GGUFFile`); a file that does not
    parse as GGUF, or cannot be read, is one line. Tensor data is read later, by :class:`GGUFTensors`."""
    if not file.is_file():
        raise DiffquantError(f"{file}: GGUF file {'not found' if not file.exists() else 'is not a file'}")
    try:
        return GGUFFile(file)
    except (MalformedGGUF, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DiffquantError(f"{file}: not a readable GGUF file ({reason})") from None


def metadata(reader: GGUFFile, key: str) -> Any:
    """The value of metadata ``key`` (int, float, bool, str or a flat list of them); None when absent.

    FLOAT32 values come back as the shortest decimal that reads back as the same float32 (1e-05, not
    9.999999747378752e-06): that is the number the converter was given, and it is the same float32. Strings
    are decoded here, so a string that is not UTF-8 fails only the key that reads it.
    """
    entry = reader.fields.get(key)
    if entry is None:
        return None
    kind, value = entry
    try:
        if kind == _ARRAY:
            item_kind, items = value
            return [b.decode("utf-8") for b in items] if item_kind == _STRING else list(items)
        if kind == _STRING:
            return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DiffquantError(
            f"{reader.path}: metadata {key} holds a string that is not UTF-8 ({err.reason})"
        ) from None
    if kind == _FLOAT32:
        return float(str(np.float32(value)))
    return value


def config_from_gguf(reader: Any, source: str) -> ModelConfig:
    """The native config the ``<arch>.*`` metadata describes (:data:`ARCHITECTURES`); whatever it cannot
    represent is one line."""
    arch_name = metadata(reader, "general.architecture")
    if arch_name not in ARCHITECTURES:
        what = "no general.architecture" if arch_name is None else f"general.architecture = {arch_name!r}"
        raise DiffquantError(
            f"{source}: {what}; supported GGUF architectures: {', '.join(map(repr, ARCHITECTURES))}"
        )
    arch = ARCHITECTURES[arch_name]
    prefix = arch.name + "."
    names = {t.name for t in reader.tensors}
    rope_scaling = _check_rope(reader, names, source, arch)
    experts = metadata(reader, prefix + "expert_count")
    if experts:
        raise DiffquantError(
            f"{source}: {prefix}expert_count = {experts}: mixture-of-experts models are not supported"
        )

    def need(key: str) -> Any:
        value = metadata(reader, prefix + key)
        if value is None:
            raise DiffquantError(f"{source}: missing metadata key '{prefix}{key}'")
        return value

    def integer(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise DiffquantError(
                f"{source}: {prefix}{key} = {value!r}, expected one integer (per-layer values are not supported)"
            )
        return value

    d_model = integer("embedding_length", need("embedding_length"))
    heads = integer("attention.head_count", need("attention.head_count"))
    kv_raw = metadata(reader, prefix + "attention.head_count_kv")
    kv_heads = heads if kv_raw is None else integer("attention.head_count_kv", kv_raw)
    head_dim = _head_dim(reader, d_model, heads, source, prefix)
    vocab = metadata(reader, prefix + "vocab_size")
    if vocab is None:
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else None
    if vocab is None and "token_embd.weight" in names:
        vocab = int(_tensor(reader, "token_embd.weight").shape[-1])  # GGUF order: (d_model, vocab)
    if vocab is None:
        raise DiffquantError(
            f"{source}: no {prefix}vocab_size, tokenizer.ggml.tokens or token_embd.weight to size the vocabulary"
        )
    theta = metadata(reader, prefix + "rope.freq_base")
    n_layers = integer("block_count", need("block_count"))
    fields: dict[str, Any] = {
        "attention": "baseline",
        "vocab_size": integer("vocab_size", vocab),
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn_dim": integer("feed_forward_length", need("feed_forward_length")),
        "max_seq_len": integer("context_length", need("context_length")),
        "rope_theta": 10000.0 if theta is None else float(theta),
        "rope_scaling": rope_scaling,
        "norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "tie_embeddings": "output.weight" not in names,
        "attention_bias": arch.attention_bias,
        "qk_norm": arch.qk_norm,
    }
    if arch.gemma:
        # Before the per-layer list: a block_count of a billion must not build a billion-entry list.
        check_layer_count(n_layers, names, GGUF_LAYER_PATTERN, f"{source} ({prefix}block_count)")
        fields.update(_gemma3_fields(reader, source, prefix, d_model, heads, head_dim, n_layers))
    try:
        config = ModelConfig(**fields)
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {str(err).removeprefix('model config: ')}") from None
    # Before anything per layer is built (key map, re-layouts, skeleton): a block_count of a billion would
    # otherwise build a billion-entry key map in `info` or a streamed run before any tensor check.
    check_layer_count(config.n_layers, names, GGUF_LAYER_PATTERN, f"{source} ({prefix}block_count)")
    return config


def _gemma3_fields(
    reader: Any, source: str, prefix: str, d_model: int, heads: int, head_dim: int, n_layers: int
) -> dict[str, Any]:
    """Gemma 3's layer features as llama.cpp runs a ``gemma3`` GGUF: the window from
    ``attention.sliding_window``, layer i global when (i + 1) % 6 == 0, sliding layers at RoPE base 10000,
    queries scaled by 1 / sqrt(head_dim) (llama.cpp uses 1 / sqrt(d_model / heads) for the 27B model only:
    refused, the native model has one scale), embeddings times sqrt(d_model), GeGLU, sandwich norms, and
    norm weights stored as w + 1 (convert_hf_to_gguf.py adds 1; the native model stores w, as transformers)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata(reader, prefix + key)
        if value:
            raise DiffquantError(
                f"{source}: {prefix}{key} = {value}: logit soft-capping is not supported (Gemma 3 has none)"
            )
    if n_layers == 62 and d_model // heads != head_dim:  # llama.cpp's LLM_TYPE_27B rule
        raise DiffquantError(
            f"{source}: a 62-layer gemma3 (27B) scales queries by 1/sqrt(embedding_length / head_count = "
            f"{d_model // heads}), not 1/sqrt(head width {head_dim}); the native attention has the latter only"
        )
    window = metadata(reader, prefix + "attention.sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise DiffquantError(
            f"{source}: {prefix}attention.sliding_window = {window!r}, expected an integer >= 1"
        )
    full = [(i + 1) % GEMMA3_SLIDING_PATTERN == 0 for i in range(n_layers)]
    return {
        "sliding_window": window,
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "rope_local_theta": GEMMA3_LOCAL_ROPE_BASE,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(d_model),
        "mlp_activation": "gelu_tanh",
    }


def _head_dim(reader: Any, d_model: int, heads: int, source: str, prefix: str = "llama.") -> int:
    """The head width, read as llama.cpp reads it (llama-model.cpp, load_hparams): key and value widths
    are attention.key_length / value_length, each defaulting to embedding_length / head_count; the rotary
    width rope.dimension_count defaults to the key width and must equal it (no partial rotary embeddings).
    The native attention rotates the whole head and has one width for Q, K and V, so all three must agree."""
    default = d_model // heads if heads else 0
    key = metadata(reader, prefix + "attention.key_length")
    value = metadata(reader, prefix + "attention.value_length")
    rope = metadata(reader, prefix + "rope.dimension_count")
    head_dim = default if key is None else key
    if rope is not None and rope != head_dim:
        raise DiffquantError(
            f"{source}: {prefix}rope.dimension_count = {rope} differs from the head width {head_dim}"
            f"{'' if key is not None else f' (no {prefix}attention.key_length: embedding_length / head_count)'}; "
            "the native model rotates whole heads (llama.cpp refuses this too: invalid n_rot)"
        )
    value_dim = default if value is None else value
    if value_dim != head_dim:
        said = (
            f"{prefix}attention.value_length = {value}"
            if value is not None
            else f"the value width {value_dim} (no {prefix}attention.value_length: embedding_length / head_count)"
        )
        raise DiffquantError(
            f"{source}: {said} differs from the key width {head_dim}; the native attention has one head width"
        )
    return head_dim


def _check_rope(reader: Any, names: set[str], source: str, arch: GGUFArchitecture) -> dict[str, Any] | None:
    """The native ``rope_scaling``: None (plain RoPE) for every architecture but one case, Gemma 3's linear
    scaling of its global layers (the 4B-27B models: llama.cpp applies rope.scaling.factor to the non-sliding
    layers only, as ``ModelConfig.layer_rope`` does). Any other scaling metadata, or a per-frequency factors
    tensor, is refused in one line."""
    prefix = arch.name + "."
    kind = metadata(reader, prefix + "rope.scaling.type")
    factor = metadata(reader, prefix + "rope.scaling.factor")
    linear = metadata(reader, prefix + "rope.scale_linear")
    scaled = (
        (kind is not None and kind != "none")
        or (factor is not None and factor not in (0.0, 1.0))
        or (linear is not None and linear != 1.0)
    )
    if "rope_freqs.weight" in names:
        raise DiffquantError(
            f"{source}: tensor rope_freqs.weight (per-frequency RoPE scaling, as in Llama 3.1) is not supported; "
            "the native model has plain RoPE"
        )
    if not scaled:
        return None
    if arch.gemma and kind == "linear" and linear is None and isinstance(factor, float) and factor >= 1:
        return {"rope_type": "linear", "factor": factor}
    found = ", ".join(
        f"{prefix}{k} = {v!r}"
        for k, v in (
            ("rope.scaling.type", kind),
            ("rope.scaling.factor", factor),
            ("rope.scale_linear", linear),
        )
        if v is not None
    )
    raise DiffquantError(
        f"{source}: RoPE scaling ({found}) is not supported; the native model has plain RoPE"
    )


def gguf_key_map(config: ModelConfig) -> dict[str, str]:
    """native state-dict key -> GGUF tensor name (llama.cpp's names), for every tensor the native baseline
    model stores: q / k / v biases (Qwen2), q / k norms (Qwen3, Gemma 3) and the post-attention / post-FFN
    norms (Gemma 3) where the config has them."""
    keys = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not config.tie_embeddings:
        keys["lm_head.weight"] = "output.weight"
    for i in range(config.n_layers):
        n, g = f"layers.{i}.", f"blk.{i}."
        keys[n + "attn_norm.weight"] = g + "attn_norm.weight"
        keys[n + "mlp_norm.weight"] = g + "ffn_norm.weight"
        if config.sandwich_norms:
            keys[n + "attn_post_norm.weight"] = g + "post_attention_norm.weight"
            keys[n + "mlp_post_norm.weight"] = g + "post_ffw_norm.weight"
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            keys[f"{n}attn.{proj}_proj.weight"] = f"{g}{name}.weight"
        if config.attention_bias:
            for proj in ("q", "k", "v"):
                keys[f"{n}attn.{proj}_proj.bias"] = f"{g}attn_{proj}.bias"
        if config.qk_norm:
            keys[n + "attn.q_norm.weight"] = g + "attn_q_norm.weight"
            keys[n + "attn.k_norm.weight"] = g + "attn_k_norm.weight"
        for proj in ("gate", "up", "down"):
            keys[f"{n}mlp.{proj}.weight"] = f"{g}ffn_{proj}.weight"
    return keys


def gguf_shifts(config: ModelConfig) -> dict[str, float]:
    """GGUF tensor name -> the constant added to its values before the cast to the target dtype: -1 on every
    norm weight of a model with (1 + w) norms (llama.cpp's Gemma converters store w + 1; transformers' GGUF
    loader subtracts 1 in float32 too, so the weights match it bit for bit in any dtype)."""
    if not config.norm_unit_offset:
        return {}
    return {name: -1.0 for name in gguf_key_map(config).values() if name.endswith("norm.weight")}


# The permutation follows llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute): the rows of one head,
# (2, d/2) in HF's rotate-half order (first half, second half), are written as (d/2, 2), so that channel i
# and channel i + d/2 (a rotation pair in rotate-half RoPE) become the adjacent rows 2i, 2i + 1 that ggml's
# interleaved RoPE rotates together. Undoing it is the transpose back, head by head.
def ggml_rows_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (heads, d/2, 2) -> (heads, 2, d/2): llama.cpp's interleaved Q/K layout to rotate-half."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def gguf_transforms(config: ModelConfig, arch: str = "llama") -> dict[str, Transform]:
    """Per native key: the re-layout applied to the dequantized tensor (Q with n_heads, K with n_kv_heads),
    for the architectures llama.cpp writes permuted (:attr:`GGUFArchitecture.permuted_qk`); none else."""
    out: dict[str, Transform] = {}
    if not ARCHITECTURES[arch].permuted_qk:
        return out
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        out[a + "q_proj.weight"] = lambda w, n=config.n_heads: ggml_rows_to_halves(w, n)
        out[a + "k_proj.weight"] = lambda w, n=config.n_kv_heads: ggml_rows_to_halves(w, n)
    return out


def _tensor(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def dequantizable_types() -> frozenset[Any]:
    """The ggml types ``gguf.quants.dequantize`` turns into float32: F32, F16 and every quant class the
    installed ``gguf`` defines (BF16, Q4_0 ... Q8_0, the K-quants, IQ*, ...), found by their ``qtype``."""
    import gguf  # noqa: PLC0415 (optional at import: slow, read only for gguf: models)

    found = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    for obj in vars(gguf.quants).values():
        qtype = getattr(obj, "qtype", None)
        if isinstance(obj, type) and isinstance(qtype, gguf.GGMLQuantizationType):
            found.add(qtype)
    return frozenset(found)


# Values' worth of rows dequantized at a time: bounds the float32 temporaries of a load (dequantize holds
# its output twice) to a few chunks of 4 MiB, whatever the size of the tensor.
CHUNK_ELEMENTS = 1 << 20


class GGUFTensors:
    """The tensors of a GGUF as :func:`~diffquant.io.assemble.assemble` reads a ``TensorSource``: names,
    torch-order shapes, and on ``get`` the tensor dequantized into ``dtype`` (every supported type
    dequantizes to float32, which is cast exactly as ``Tensor.to`` would: the same values).

    ``get`` reads the tensor's bytes from the file ``chunk_elements`` values' worth of whole rows at a time
    and casts each dequantized chunk into a preallocated tensor, so a load holds each weight once, in
    ``dtype``, plus one chunk; the file is never mapped.
    """

    def __init__(
        self,
        reader: GGUFFile,
        file: Path,
        dtype: torch.dtype = torch.float32,
        chunk_elements: int = CHUNK_ELEMENTS,
        shifts: dict[str, float] | None = None,
    ) -> None:
        check_float_dtype(dtype, "requested dtype")
        self._tensors = {t.name: t for t in reader.tensors}
        self._shifts = dict(shifts or {})  # name -> constant added in float32 before the cast (gguf_shifts)
        self._file = file
        self._dtype = dtype
        self._chunk = max(1, int(chunk_elements))

    def keys(self) -> list[str]:
        return list(self._tensors)

    def file(self, key: str) -> Path:
        return self._file

    def shape(self, key: str) -> tuple[int, ...]:
        """Torch order: GGUF lists dimensions fastest-first, so reversed."""
        return tuple(reversed(self._tensors[key].shape))

    def dtype_tag(self, key: str) -> str:
        """The dtype ``get`` returns (:meth:`check_types` refuses types that do not dequantize)."""
        return FLOAT_DTYPES[self._dtype]

    def type_name(self, key: str) -> str:
        return self._tensors[key].tensor_type.name

    def check_types(self, keys: Sequence[str]) -> None:
        """Refuse, before anything is dequantized, a tensor of a type gguf cannot dequantize (integers,
        F64, types newer than the installed gguf)."""
        supported = dequantizable_types()
        for key in keys:
            t = self._tensors.get(key)
            if t is not None and t.tensor_type not in supported:
                raise DiffquantError(
                    f"{self._file}: tensor {key} has type {t.tensor_type.name}, which cannot be dequantized "
                    f"(supported: {', '.join(sorted(q.name for q in supported))})"
                )

    def get(self, key: str) -> torch.Tensor:
        """The tensor in torch order and ``dtype``: a fresh tensor, dequantized a chunk of rows at a time."""
        import gguf  # noqa: PLC0415 (optional at import: slow, read only for gguf: models)

        t = self._tensors[key]
        out = torch.empty(self.shape(key), dtype=self._dtype)
        if t.n_elements == 0:
            return out
        cols = t.shape[0] if t.shape else 1  # a row: ne[0] values, whole quant blocks (GGUFFile checks)
        rows = t.n_elements // cols
        row_bytes = t.n_bytes // rows
        step = max(1, min(rows, self._chunk // cols))
        raw = np.empty(step * row_bytes, dtype=np.uint8)
        flat = out.view(rows, cols)
        try:
            with open(self._file, "rb", buffering=0) as f:
                for first in range(0, rows, step):
                    n = min(step, rows - first)
                    chunk = raw[: n * row_bytes]
                    _read_exactly(f, t.offset + first * row_bytes, chunk)
                    values = gguf.quants.dequantize(chunk.reshape(n, row_bytes), t.tensor_type)
                    if values.shape != (n, cols) or values.dtype != np.float32:
                        raise ValueError(
                            f"dequantized to {values.dtype} {values.shape}, expected ({n}, {cols})"
                        )
                    if key in self._shifts:
                        values = values + np.float32(self._shifts[key])
                    flat[first : first + n].copy_(torch.from_numpy(values))
        except (NotImplementedError, ValueError, OSError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DiffquantError(
                f"{self._file}: tensor {key} ({t.tensor_type.name}) is unreadable ({reason})"
            ) from None
        return out


def _read_exactly(f: Any, offset: int, into: np.ndarray) -> None:
    """Fill ``into`` (uint8) with the file's bytes from ``offset`` on; a file that ends first is an OSError."""
    view = memoryview(into).cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"the file ends at byte {offset + got}, inside the tensor's data")
        got += n


# ========================================================================================= GGUF header
# GGUF value types (gguf.GGUFValueType) -> numpy dtype, little-endian; STRING and ARRAY are structured.
_NUMERIC = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_NUMERIC.update({11: "<i8", 12: "<f8"})
_UINT32, _FLOAT32, _STRING, _ARRAY = 4, 6, 8, 9
_U32, _U64, _U64_DTYPE = struct.Struct("<I"), struct.Struct("<Q"), np.dtype("<u8")
READ_VERSIONS = (2, 3)  # what gguf.GGUFReader reads too (version 1 had 32-bit counts)
_FIRST_READ = 1 << 18


class MalformedGGUF(ValueError):
    """The file does not parse as GGUF (:func:`read_gguf` makes it one line)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table; ``shape`` in GGUF order (``ne[0]``, the row length, first)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    offset: int  # of the data, from the start of the file


class GGUFFile:
    """The header of a little-endian GGUF (version 2 or 3), parsed from plain reads of its first bytes.

    ``fields``: key -> (value type, value), the value a Python int / float / bool, ``bytes`` for a string
    (decoded by :func:`metadata`), or (item type, flat list) for an array. ``tensors``: the tensor table
    (:class:`GGUFTensorInfo`), each tensor's byte range checked to lie inside the file, to start at a
    multiple of the alignment the header gives (``general.alignment``, default 32) and to share no byte
    with another tensor's (the one check every reader of a GGUF goes through). Anything malformed
    raises :class:`MalformedGGUF` with the reason; no length read from the file is trusted beyond its size,
    so a corrupt count cannot allocate more than the file holds.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields: dict[str, tuple[int, Any]] = {}
        self.tensors: list[GGUFTensorInfo] = []
        with open(self.path, "rb") as f:
            self._file, self._size, self._buf, self._pos = f, os.fstat(f.fileno()).st_size, b"", 0
            try:
                self._parse()
            finally:
                del self._file, self._buf

    def _parse(self) -> None:
        import gguf  # noqa: PLC0415 (optional at import: slow, read only for gguf: models)

        if self._size == 0:
            raise MalformedGGUF("the file is empty")
        if self._u32() != gguf.GGUF_MAGIC:
            raise MalformedGGUF("GGUF magic invalid")
        version = self._u32()
        if version not in READ_VERSIONS:
            if version and not version & 0xFFFF:
                raise MalformedGGUF("big-endian GGUF files are not supported")
            raise MalformedGGUF(f"GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = self._u64(), self._u64()
        for _ in range(n_kv):
            key = self._name("metadata key")
            if key in self.fields:
                raise MalformedGGUF(f"duplicate metadata key {key}")
            kind = self._u32()
            self.fields[key] = (kind, self._value(kind, key))
        table = []
        for _ in range(n_tensors):
            name = self._name("tensor name")
            dims = self._numbers(_U64_DTYPE, self._u32())
            table.append((name, tuple(int(d) for d in dims), self._u32(), self._u64()))
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            kind, alignment = self.fields["general.alignment"]
            if kind != _UINT32 or alignment <= 0 or alignment & (alignment - 1):
                raise MalformedGGUF("general.alignment must be a UINT32 power of two")
        start = -(-self._pos // alignment) * alignment
        names: set[str] = set()
        for name, dims, raw_type, offset in table:
            if offset % alignment:
                raise MalformedGGUF(
                    f"tensor {name} starts at data offset {offset}, not a multiple of the alignment {alignment}"
                )
            self.tensors.append(self._tensor_info(name, dims, raw_type, start + offset, names))
        _check_disjoint(self.tensors)
        _check_packed(self.tensors, start, alignment, self._size)

    def _tensor_info(
        self, name: str, dims: tuple[int, ...], raw_type: int, offset: int, names: set[str]
    ) -> GGUFTensorInfo:
        import gguf  # noqa: PLC0415 (optional at import: slow, read only for gguf: models)

        if name in names:
            raise MalformedGGUF(f"duplicate tensor {name}")
        names.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise MalformedGGUF(f"tensor {name} has type {raw_type}, unknown to the installed gguf") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(dims)
        if dims and dims[0] % block:
            raise MalformedGGUF(
                f"tensor {name}: rows of {dims[0]} values are not whole {qtype.name} blocks of {block}"
            )
        n_bytes = n_elements // block * type_size
        if offset + n_bytes > self._size:
            raise MalformedGGUF(
                f"tensor {name} ends at byte {offset + n_bytes}, past the end of the file ({self._size} bytes)"
            )
        return GGUFTensorInfo(name, qtype, dims, n_elements, n_bytes, offset)

    # ---------------------------------------------------------------- reading the header
    def _need(self, end: int) -> None:
        """Make bytes [0, end) of the file available in the buffer (read on, doubling)."""
        if end <= len(self._buf):
            return
        if end > self._size:
            raise MalformedGGUF(f"the file ends at byte {self._size}, inside its header")
        want = min(self._size, max(end, 2 * len(self._buf), _FIRST_READ))
        self._file.seek(len(self._buf))
        more = self._file.read(want - len(self._buf))
        self._buf += more
        if len(self._buf) < end:
            raise MalformedGGUF(f"the file ends at byte {len(self._buf)}, inside its header")

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        self._need(end)
        out = self._buf[self._pos : end]
        self._pos = end
        return out

    def _u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def _u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def _name(self, what: str) -> str:
        raw = self._take(self._u64())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedGGUF(f"a {what} is not UTF-8 ({raw[:40]!r})") from None

    def _numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype)

    def _strings(self, count: int) -> list[bytes]:
        out = []
        pos, buf, unpack = self._pos, self._buf, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > len(buf):
                self._need(pos + 8)
                buf = self._buf
            end = pos + 8 + unpack(buf, pos)[0]
            if end > len(buf):
                self._need(end)
                buf = self._buf
            out.append(buf[pos + 8 : end])
            pos = end
        self._pos = pos
        return out

    def _value(self, kind: int, key: str) -> Any:
        if kind == _STRING:
            return self._take(self._u64())
        if kind in _NUMERIC:
            return self._numbers(np.dtype(_NUMERIC[kind]), 1).tolist()[0]
        if kind == _ARRAY:
            return self._array(key)
        raise MalformedGGUF(f"metadata {key} has value type {kind}, which GGUF does not define")

    def _array(self, key: str) -> tuple[int, list[Any]]:
        """(innermost item type, flat items): nested arrays are flattened, as gguf's reader does."""
        kind, count = self._u32(), self._u64()
        if kind == _STRING:
            return kind, self._strings(count)
        if kind in _NUMERIC:
            return kind, self._numbers(np.dtype(_NUMERIC[kind]), count).tolist()
        if kind == _ARRAY:
            inner, items = _STRING, []
            for _ in range(count):
                inner, sub = self._array(key)
                items += sub
            return inner, items
        raise MalformedGGUF(f"metadata {key} is an array of value type {kind}, which GGUF does not define")


def _check_disjoint(tensors: Sequence[GGUFTensorInfo]) -> None:
    """No two tensors may share bytes: offsets pointing into another tensor's data (token_embd.weight at
    output.weight's bytes) parse, dequantize and run, and give a silently wrong model. Sorted by start,
    any overlap shows between neighbours (if A overlaps a later C, A overlaps everything between them)."""
    spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in tensors if t.n_bytes)
    for (start, end, name), (next_start, next_end, next_name) in zip(spans, spans[1:], strict=False):
        if next_start < end:
            raise MalformedGGUF(
                f"tensors {name} (bytes {start} to {end - 1}) and {next_name} (bytes {next_start} to "
                f"{next_end - 1}) overlap; each tensor needs a byte range of its own"
            )


def _check_packed(tensors: Sequence[GGUFTensorInfo], start: int, alignment: int, size: int) -> None:
    """The data section as llama.cpp lays it out: in offset order, each tensor starts where the previous one
    ends rounded up to the alignment (the first at the section's start ``start``, and the file of ``size``
    bytes ends with the last one's padding). A tensor whose type field was rewritten to a smaller type
    (Q8_0 -> Q5_0) keeps its offset but reads fewer bytes, leaving a gap no writer leaves, and its bytes would
    be decoded as another format (NaN and noise): a gap larger than the padding is refused, naming the tensor
    before it. (A larger type overlaps the next tensor: :func:`_check_disjoint`.)"""
    expected, before = start, None
    for info in sorted((t for t in tensors if t.n_bytes), key=lambda t: t.offset):
        if info.offset > expected:
            where = _tensor_end(before) if before is not None else f"the data section starts at byte {start}"
            raise MalformedGGUF(
                f"{where}, but the next tensor {info.name} starts at byte {info.offset}: "
                f"{info.offset - expected} bytes more than the padding to the alignment {alignment}; {_PACKED}"
            )
        expected, before = -(-(info.offset + info.n_bytes) // alignment) * alignment, info
    if before is not None and size > expected:
        raise MalformedGGUF(
            f"{_tensor_end(before)}, the last tensor, but the file goes on to byte {size}: "
            f"{size - expected} bytes more than the padding to the alignment {alignment}; {_PACKED}"
        )


_PACKED = "tensors are packed back to back, so a type or shape in the tensor table is wrong"


def _tensor_end(info: GGUFTensorInfo) -> str:
    return (
        f"tensor {info.name} ({info.tensor_type.name}, shape {list(info.shape)}) ends at byte "
        f"{info.offset + info.n_bytes}"
    )


# ========================================================================================= tokenizer
def read_gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a GGUF file, without dequantizing any weight (only the metadata is parsed)."""
    file = Path(path)
    return cached_gguf_tokenizer(read_gguf(file), str(file))


# Tokenizers built from GGUF metadata, newest last, by a digest of that metadata and the file's name. One
# command reads a GGUF's header several times (`info`: the skeleton, its size, whether it would stream;
# `profile`: the check, the load): Gemma 3's 262k-piece SentencePiece vocabulary takes 2-3 s to rebuild, and
# was rebuilt four times. A file whose metadata changed has another digest (so a rewritten file is never
# served a stale tokenizer); the two newest are kept (a profile of two models).
_TOKENIZERS: dict[tuple[str, str], HFTokenizer] = {}
_TOKENIZERS_KEPT = 2


def cached_gguf_tokenizer(reader: Any, source: str = "GGUF") -> HFTokenizer:
    """:func:`gguf_tokenizer`, built once per distinct ``tokenizer.ggml.*`` metadata (and ``source``, which
    its name and messages carry); a line on stderr when the build runs past the progress interval."""
    digest = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.ggml.")):
        digest.update(pickle.dumps((key, reader.fields[key]), protocol=pickle.HIGHEST_PROTOCOL))
    cache_key = (source, digest.hexdigest())
    tokenizer = _TOKENIZERS.pop(cache_key, None)
    if tokenizer is None:
        with step(f"{Path(source).name}: build the tokenizer", announce=False):
            tokenizer = gguf_tokenizer(reader, source)
    _TOKENIZERS[cache_key] = tokenizer
    while len(_TOKENIZERS) > _TOKENIZERS_KEPT:
        del _TOKENIZERS[next(iter(_TOKENIZERS))]
    return tokenizer


def gguf_tokenizer(reader: Any, source: str = "GGUF") -> HFTokenizer:
    """The tokenizer a GGUF describes, as llama.cpp runs it (byte-level BPE, ``tokenizer.ggml.model = gpt2``).

    Vocabulary and merges come from ``tokenizer.ggml.tokens`` / ``merges``; control tokens (type 3) become
    special added tokens and user-defined ones (type 4) plain added tokens, so both stay whole. Text is
    split by the regexes llama.cpp uses for ``tokenizer.ggml.pre``: this is why ``smollm`` splits every
    digit (SmolLM2 was trained that way; transformers' own GGUF loader uses plain GPT-2 splitting there).
    BOS / EOS / PAD ids and ``add_bos`` come from the metadata; ``add_bos`` defaults to llama.cpp's default
    for the pre-tokenizer (True for the Llama-3 family, else False). ``llama`` vocabularies (SentencePiece
    BPE: Gemma, Llama-2, Mistral-v0.1) are built by :mod:`diffquant.io.gguf_spm`.
    """
    model = metadata(reader, "tokenizer.ggml.model")
    if model is None:
        raise DiffquantError(f"{source}: no tokenizer metadata (tokenizer.ggml.model is missing)")
    if model == "llama":  # SentencePiece BPE with byte fallback (Gemma, Llama-2, Mistral-v0.1)
        return sentencepiece_tokenizer(lambda key: metadata(reader, key), source)
    if model != "gpt2":
        raise DiffquantError(
            f"{source}: tokenizer.ggml.model = {model!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)"
        )
    pre = metadata(reader, "tokenizer.ggml.pre")
    pre = "default" if pre is None else pre  # llama.cpp's fallback for files written before the key existed
    if pre not in _PRE_FAMILY:
        raise DiffquantError(
            f"{source}: tokenizer.ggml.pre = {pre!r} is not supported (supported: {', '.join(_PRE_FAMILY)})"
        )

    def read(key: str) -> Any:
        return metadata(reader, key)

    tokens = vocabulary_tokens(read, source)
    merges = read("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise DiffquantError(f"{source}: tokenizer.ggml.merges is missing (byte-level BPE needs its merges)")
    types = token_types(read, len(tokens), source)
    family = _PRE_FAMILY[pre]
    backend = _byte_level_bpe(tokens, merges, types or [], family, source)
    ids = special_ids(read)
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = family == "llama3"
    return HFTokenizer(
        backend,
        name=f"{source} (GGUF {model}/{pre})",
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        add_bos=add_bos,
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], family: str, source: str) -> Any:
    """A ``tokenizers.Tokenizer``: BPE over the file's vocabulary and merges, llama.cpp's splitting."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (imported on use: slow import)

    vocab = {
        token: i for i, token in enumerate(tokens)
    }  # a repeated token keeps its last id, as in llama.cpp
    pairs = []
    for rank, merge in enumerate(merges):
        # llama.cpp splits at the first space after the first character (a piece is never empty).
        cut = merge.find(" ", 1)
        if cut < 0:
            raise DiffquantError(f"{source}: tokenizer.ggml.merges[{rank}] = {merge!r} is not 'left right'")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=family == "llama3")
    except Exception as err:  # tokenizers raises a bare Exception for merges outside the vocabulary
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DiffquantError(f"{source}: tokenizer vocabulary and merges disagree ({reason})") from None
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_map = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split(pattern: str) -> Any:
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    if family == "digits":  # \p{N} one by one, then the GPT-2 pattern (what SmolLM2's tokenizer.json does)
        steps = [pre_tokenizers.Digits(individual_digits=True), byte_level]
    elif family == "gpt2":
        steps = [byte_level]
    elif family == "llama3":
        steps = [split(_LLAMA3_SPLIT), byte_map]
    elif family == "qwen2":
        steps = [split(_QWEN2_SPLIT), byte_map]
    else:  # llama.cpp's default list for BPE vocabularies
        steps = [
            split(r"[\p{P}\$\+<=>\^~\|]+"),
            split(_GPT2_SPLIT),
            split(r"\p{N}+"),
            split("[0-9][0-9][0-9]"),
            byte_map,
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == TOKEN_CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == TOKEN_USER_DEFINED]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok
