"""Hugging Face checkpoints <-> native DecoderLM: ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma3_text``
<-> baseline, ``diffllama`` <-> DIFF V1.

The other families are Llama plus one or two :class:`ModelConfig` fields: Qwen2 = q/k/v biases
(``attention_bias``), Qwen3 = per-head q/k RMSNorm (``qk_norm``), Mistral = ``sliding_window``; windowed
Qwen2/3 (``use_sliding_window``) import when the window covers every layer or none (see :func:`_window`).
Gemma 3 (text) sets the per-layer ``layer_types`` / ``rope_local_theta`` and the Gemma fields (see
:func:`_gemma3_fields`); the multimodal ``gemma3`` folder is refused.

Import (:func:`load_hf`) reads a local HF folder (``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``) lazily with ``safe_open``: the model is built on the meta device and each
tensor is read, re-laid out, cast and assigned once, so a checkpoint is never held twice. Export
(:func:`export_hf`) writes the inverse layout into a folder that ``transformers`` ``from_pretrained`` reads.
transformers itself is not needed for either direction.

Layouts (see shared/reference/diff-attention.md):

- HF DiffLlama counts *component* heads: ``num_attention_heads`` = 2 x differential pairs. Pair i is q head
  i with q head i + H/2 (contiguous halves), likewise K (j, j + Hkv/2), and the pair's 2d-wide value is
  concat(v head j, v head j + Hkv/2).
- Native DIFF V1 interleaves the components: q rows (H/2, 2, d), k rows (Hkv/2, 2, d), v rows (Hkv/2, 2d).

Both use rotate-half RoPE on each d-wide component, the same lambda reparameterisation, the same
lambda_init schedule and (1 - lambda_init) * RMSNorm_2d, so the conversion is a pure row permutation of
q/k/v (o_proj's columns already agree: output head i is columns [2d i, 2d (i + 1)) in both).

Shared with the other converters: the lazy safetensors reading (:mod:`diffquant.io.safetensors_source`) and
the meta-device assembly (:mod:`diffquant.io.assemble`), both re-exported here, their old import path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from diffquant.data.tokenizer import HFTokenizer, load_tokenizer
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json, save_tensors, write_folder_atomic
from diffquant.io.assemble import (  # noqa: F401 (FLOAT_DTYPES: public here too)
    FLOAT_DTYPES,
    Transform,
    assemble,
    check_float_dtype,
    check_layer_count,
)
from diffquant.io.safetensors_source import TensorSource, open_tensors  # noqa: F401 (public here too)
from diffquant.io.safetensors_source import checkpoint_folder as _folder
from diffquant.models.config import HF_KINDS, ROPE_SCALING_KEYS, ModelConfig, rope_scaling_problem
from diffquant.models.hf_names import hf_key_map
from diffquant.models.transformer import DecoderLM
from diffquant.names import CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, WEIGHTS_FILE  # noqa: F401 (INDEX_FILE: public here too)

SUPPORTED_MODEL_TYPES = {
    "llama": "baseline",
    "diffllama": "diff_v1",
    "qwen2": "baseline",
    "qwen3": "baseline",
    "mistral": "baseline",
    "gemma3_text": "baseline",
}
# HF class defaults (transformers 5.x config classes) for keys a config.json may leave out.
_RMS_EPS_DEFAULT = {
    "llama": 1e-6,
    "diffllama": 1e-5,
    "qwen2": 1e-6,
    "qwen3": 1e-6,
    "mistral": 1e-6,
    "gemma3_text": 1e-6,
}
# The others derive it: hidden_size / num_attention_heads.
_HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma3_text": 256}
# Families whose attention_bias key puts a bias on all four projections (o_proj too), which the native model
# (biases on q/k/v only) cannot hold; Qwen2 always has q/k/v biases, and Mistral has no such key.
_ALL_FOUR_BIAS = ("llama", "diffllama", "qwen3", "gemma3_text")
# Gemma3TextConfig's defaults: RoPE bases of full / sliding layers, the window, the layer pattern.
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_WINDOW = 4096
_GEMMA3_PATTERN = 6


# ============================================================================================ import
def load_hf(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """A native DecoderLM (eval mode) from a local HF ``llama`` or ``diffllama`` folder.

    ``dtype`` casts every tensor as it is read (e.g. ``torch.bfloat16``); None keeps the checkpoint's
    dtype (that of the embedding, so a mixed-precision file still yields a single-dtype model).
    """
    folder = _folder(path)
    check_float_dtype(dtype, "requested dtype")
    hf = read_json(folder / CONFIG_FILE)
    config = config_from_hf(hf, str(folder / CONFIG_FILE))
    # Some tied checkpoints store the head anyway (a copy of the embedding); the tie makes it redundant.
    optional = frozenset({"lm_head.weight"}) if config.tie_embeddings else frozenset()
    with open_tensors(folder, device) as source:
        check_layer_count(
            config.n_layers, source.keys(), r"model\.layers\.(\d+)\.", str(folder / CONFIG_FILE)
        )
        key_map = hf_key_map(config)
        transforms = _import_transforms(config)
        model = assemble(config, source, key_map, transforms, device, dtype, optional)
    model.tokenizer = _folder_tokenizer(folder)
    return model


def _folder_tokenizer(folder: Path):
    """The folder's own tokenizer (tokenizer.json with its special tokens), or None when it has none."""
    return load_tokenizer(folder) if (folder / TOKENIZER_FILE).is_file() else None


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Translate an HF config dict, rejecting whatever the native model cannot represent (one line each)."""
    if not isinstance(hf, dict):
        raise DiffquantError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        raise DiffquantError(
            f"{source}: model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration; only the text "
            "model (model_type 'gemma3_text', Gemma3ForCausalLM) is read"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DiffquantError(
            f"{source}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise DiffquantError(
            f"{source}: quantized checkpoint (quantization_config.quant_method={method!r}); the native model "
            "holds floating-point weights only (float32, float16, bfloat16)"
        )
    gemma = _gemma3_fields(hf, source) if model_type == "gemma3_text" else {}
    rope_scaling = gemma["rope_scaling"] if gemma else _check_rope(hf, source)
    if model_type in _ALL_FOUR_BIAS and hf.get("attention_bias"):
        raise DiffquantError(
            f"{source}: attention_bias = true, expected false ({model_type} then biases o_proj too; the native "
            "model has q/k/v biases only, as Qwen2)"
        )
    if hf.get("mlp_bias"):
        raise DiffquantError(f"{source}: mlp_bias = true, expected false (the native MLP has no biases)")
    act = hf.get("hidden_act", "silu")
    if act != "silu" and not gemma:  # Gemma3 reads hidden_activation (checked in _gemma3_fields)
        raise DiffquantError(f"{source}: hidden_act = {act!r}, expected 'silu' (the native MLP is SwiGLU)")

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise DiffquantError(f"{source}: missing key '{key}'")
        return hf[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    ints = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
    head_dim = hf.get("head_dim", _HEAD_DIM_DEFAULT.get(model_type)) or (hidden // heads if ints else 0)
    theta = gemma["rope_theta"] if gemma else _rope_theta(hf, source)
    fields: dict[str, Any] = {
        "attention": SUPPORTED_MODEL_TYPES[model_type],
        "vocab_size": need("vocab_size"),
        "d_model": hidden,
        "n_layers": need("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn_dim": need("intermediate_size"),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta,
        "rope_scaling": rope_scaling,
        "norm_eps": hf.get("rms_norm_eps", _RMS_EPS_DEFAULT[model_type]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": hf.get("initializer_range") or 0.02,
        "attention_bias": model_type == "qwen2",  # Qwen2Attention: bias=True on q/k/v whatever the config
        "qk_norm": model_type == "qwen3",
        "sliding_window": _window(hf, model_type, source),
    }
    if gemma:
        fields.update(gemma)
        fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))  # Gemma3TextConfig's default
        fields["max_seq_len"] = hf.get("max_position_embeddings", 131_072)
        # Gemma3TextScaledWordEmbedding: sqrt(hidden_size), rounded to the weights' dtype in the forward.
        fields["embed_scale"] = hidden**0.5 if isinstance(hidden, int) and hidden > 0 else hidden
        if head_dim != hf.get("query_pre_attn_scalar", 256):
            raise DiffquantError(
                f"{source}: query_pre_attn_scalar = {json.dumps(hf.get('query_pre_attn_scalar', 256))}, "
                f"expected head_dim = {head_dim} (the native model scales logits by 1/sqrt(head_dim))"
            )
    if model_type == "diffllama":
        # num_attention_heads counts component heads; native counts differential pairs (and kv pairs).
        for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if not isinstance(value, int) or value % 2:
                raise DiffquantError(
                    f"{source}: {key} = {value!r}, expected an even integer (DiffLlama pairs its heads)"
                )
        fields.update(
            n_heads=heads // 2,
            n_kv_heads=kv_heads // 2,
            v1_norm_affine=False,  # HF's group norm has no weight
            v1_norm_eps=fields["norm_eps"],  # HF uses rms_norm_eps for the group norm too
            v1_lambda_init=None,  # HF always uses the depth schedule
        )
    try:
        return ModelConfig(**fields)
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {str(err).removeprefix('model config: ')}") from None


def _gemma3_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 3 ModelConfig fields of a ``gemma3_text`` config (transformers' Gemma3TextConfig), or a
    one-line refusal of what the native model cannot compute.

    Layers: ``layer_types``, or in a 4.x file without it ``sliding_window_pattern`` (layer i full when
    (i + 1) % pattern == 0; 6 by default). RoPE: 5.x ``rope_parameters`` with one entry per layer type, or
    4.x ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (the scaling applies to full layers
    only); sliding layers take plain RoPE. Refused: another activation than gelu_pytorch_tanh, logit
    soft-capping, bidirectional attention."""
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise DiffquantError(
            f"{source}: hidden_activation = {json.dumps(act)}, expected 'gelu_pytorch_tanh' (the native GeGLU "
            "is the tanh GELU)"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise DiffquantError(
                f"{source}: {key} = {json.dumps(hf[key])}, expected null (the native model has no logit "
                "soft-capping)"
            )
    if hf.get("use_bidirectional_attention"):
        raise DiffquantError(
            f"{source}: use_bidirectional_attention = true, expected false (the native model is causal)"
        )
    n_layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", _GEMMA3_PATTERN))
        if (
            not isinstance(pattern, int)
            or isinstance(pattern, bool)
            or pattern < 1
            or not isinstance(n_layers, int)
        ):
            raise DiffquantError(
                f"{source}: sliding_window_pattern = {json.dumps(pattern)}, expected an integer >= 1 (every "
                "pattern-th layer is full attention)"
            )
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}:
        raise DiffquantError(
            f"{source}: layer_types = {json.dumps(types)}, expected a list of 'full_attention' / "
            "'sliding_attention'"
        )
    window = hf.get("sliding_window", _GEMMA3_WINDOW) if "sliding_attention" in types else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise DiffquantError(
            f"{source}: sliding_window = {json.dumps(window)}, expected an integer >= 1 (layer_types has "
            "sliding_attention layers)"
        )
    thetas, scalings = _gemma3_rope(hf, source)
    if scalings["sliding_attention"] is not None:
        raise DiffquantError(
            f"{source}: rope_parameters.sliding_attention = "
            f"{json.dumps(hf['rope_parameters']['sliding_attention'])}, expected plain RoPE (rope_type "
            "'default'): the native model scales the full layers' RoPE only"
        )

    def number(value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    return {
        "layer_types": list(types),
        "sliding_window": window,
        "rope_theta": number(thetas["full_attention"]),
        "rope_local_theta": number(thetas["sliding_attention"]),
        "rope_scaling": scalings["full_attention"],
        "qk_norm": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
    }


def _gemma3_rope(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(RoPE base, native rope_scaling) per layer type of a gemma3_text config, either version's keys."""
    thetas = dict(_GEMMA3_THETA)
    scalings: dict[str, Any] = {"full_attention": None, "sliding_attention": None}
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(thetas):
            raise DiffquantError(
                f"{source}: rope_parameters = {json.dumps(params)}, expected an object with entries "
                "'full_attention' / 'sliding_attention' (Gemma 3 gives each layer type its RoPE)"
            )
        for kind, rope in params.items():
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise DiffquantError(
                    f"{source}: rope_parameters.{kind}: expected an object or null, got {type(rope).__name__}"
                )
            if rope.get("rope_theta") is not None:
                thetas[kind] = rope["rope_theta"]
            scalings[kind] = _rope_scaling_from(rope, f"rope_parameters.{kind}", source)
    # 4.x keys (5.x reads them too: rope_scaling updates the full layers' entry, the bases are defaults).
    legacy_scaling = hf.get("rope_scaling")
    if legacy_scaling:
        if not isinstance(legacy_scaling, dict):
            raise DiffquantError(
                f"{source}: rope_scaling: expected an object or null, got {type(legacy_scaling).__name__}"
            )
        scaling = _rope_scaling_from(legacy_scaling, "rope_scaling", source)
        if params is not None and params.get("full_attention") and scalings["full_attention"] != scaling:
            raise DiffquantError(
                f"{source}: rope_scaling = {json.dumps(legacy_scaling)} and rope_parameters.full_attention = "
                f"{json.dumps(params['full_attention'])} describe different RoPE scalings; expected one"
            )
        scalings["full_attention"] = scaling
    for key, kind in (("rope_theta", "full_attention"), ("rope_local_base_freq", "sliding_attention")):
        value = hf.get(key)
        if value is None:
            continue
        stated = (params or {}).get(kind) or {}
        if stated.get("rope_theta") is not None and float(stated["rope_theta"]) != float(value):
            raise DiffquantError(
                f"{source}: {key} = {json.dumps(value)} and rope_parameters.{kind}.rope_theta = "
                f"{json.dumps(stated['rope_theta'])} disagree; expected one RoPE base"
            )
        thetas[kind] = value
    return thetas, scalings


def _window(hf: dict[str, Any], model_type: str, source: str) -> int | None:
    """The native ``sliding_window`` of an HF config (None = full attention), as transformers applies it.

    Mistral: ``sliding_window`` in every layer (4096 when the key is absent, null = none). Qwen2 / Qwen3: the
    window is ``sliding_window`` when ``use_sliding_window``, on the layers ``layer_types`` marks
    ``sliding_attention`` (by default layers >= ``max_window_layers``). The native model has one window for
    all layers, so a file that windows some layers but not others is refused.
    """
    if model_type == "mistral":
        window = hf.get("sliding_window", 4096)
    elif model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    else:
        return None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise DiffquantError(
            f"{source}: sliding_window = {json.dumps(window)}, expected null or an integer >= 1"
        )
    if model_type == "mistral":
        return window
    n_layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        if window is None:
            return None
        first = hf.get("max_window_layers", 28)
        if not isinstance(n_layers, int) or not isinstance(first, int) or isinstance(first, bool):
            raise DiffquantError(
                f"{source}: max_window_layers = {json.dumps(first)}, expected an integer (the first layer "
                "of the sliding window)"
            )
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    kinds = set(types) if isinstance(types, list) else {None}
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise DiffquantError(
            f"{source}: layer_types = {json.dumps(types)}, expected a list of 'full_attention' / "
            "'sliding_attention'"
        )
    if kinds == {"full_attention", "sliding_attention"}:
        first = types.index("sliding_attention")
        raise DiffquantError(
            f"{source}: layer_types mixes full_attention and sliding_attention layers (first windowed layer "
            f"{first} of {len(types)}), expected one kind for every layer (the native model has one window)"
        )
    if kinds == {"sliding_attention"}:
        if window is None:
            raise DiffquantError(
                f"{source}: layer_types are sliding_attention but the window is null (use_sliding_window = "
                f"{json.dumps(hf.get('use_sliding_window', False))}), expected a sliding_window"
            )
        return window
    return None


# RoPE keys a config.json may carry, per transformers version (both spellings describe one scheme):
# 4.x: top-level ``rope_theta`` + ``rope_scaling`` {"type" (old) or "rope_type", factor, ...} or null;
# 5.x: ``rope_parameters`` {"rope_type", "rope_theta", factor, ...} (a "type" key survives from 4.x inputs).
# 5.x reads ``rope_scaling`` too, and prefers it over ``rope_parameters``; so does this importer.
_ROPE_TYPE_KEYS = ("rope_type", "type")
_ROPE_BOOKKEEPING = {*_ROPE_TYPE_KEYS, "rope_theta", "partial_rotary_factor"}


def _check_rope(hf: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The native ``rope_scaling`` (None = plain RoPE) of an HF config, or a one-line refusal.

    Supported: default, ``linear`` and ``llama3`` (see :data:`diffquant.models.config.ROPE_SCALING_KEYS`).
    Refused: every other type (dynamic, yarn, longrope, su, ...), unknown or missing keys, partial rotary
    embeddings, and a file whose ``rope_scaling`` and ``rope_parameters`` describe different scalings.
    """
    scalings: dict[str, dict[str, Any] | None] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise DiffquantError(f"{source}: {key}: expected an object or null, got {type(value).__name__}")
        if value:  # {} means "nothing set", as transformers reads it
            scalings[key] = _rope_scaling_from(value, key, source)
    if not scalings:
        return None
    chosen = scalings.get("rope_scaling", scalings.get("rope_parameters"))
    other = scalings.get("rope_parameters")
    # Both present: rope_scaling wins in both transformers versions, so a plain rope_parameters next to it
    # is harmless, but two different scalings mean the file is ambiguous.
    if "rope_scaling" in scalings and other is not None and other != chosen:
        raise DiffquantError(
            f"{source}: rope_scaling = {json.dumps(hf['rope_scaling'])} and rope_parameters = "
            f"{json.dumps(hf['rope_parameters'])} describe different RoPE scalings; expected one, or both equal"
        )
    return chosen


def _rope_scaling_from(rope: dict[str, Any], key: str, source: str) -> dict[str, Any] | None:
    """One HF RoPE dict (``rope_scaling`` or ``rope_parameters``) as a native ``rope_scaling``."""
    supported = f"supported rope types: default, {', '.join(ROPE_SCALING_KEYS)}"
    types = [rope[k] for k in _ROPE_TYPE_KEYS if k in rope]
    if len(types) > 1 and types[0] != types[1]:
        raise DiffquantError(
            f"{source}: {key} = {json.dumps(rope)}: 'type' and 'rope_type' disagree; expected one type"
        )
    rope_type = types[0] if types else "default"
    if rope_type != "default" and (not isinstance(rope_type, str) or rope_type not in ROPE_SCALING_KEYS):
        raise DiffquantError(
            f"{source}: {key}.rope_type = {json.dumps(rope_type)} is not supported; {supported}"
        )
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise DiffquantError(
            f"{source}: {key}.partial_rotary_factor = {json.dumps(partial)}, expected 1.0 (the native model "
            "rotates every channel of a head)"
        )
    params = {k: v for k, v in rope.items() if k not in _ROPE_BOOKKEEPING}
    want = ROPE_SCALING_KEYS.get(rope_type, ())
    missing = [k for k in want if k not in params]
    extra = sorted(set(params) - set(want))
    if missing or extra:
        problem = f"missing {', '.join(missing)}" if missing else f"unknown key(s) {', '.join(extra)}"
        expected = f"keys {', '.join(want)}" if want else "no scaling keys"
        raise DiffquantError(
            f"{source}: {key} = {json.dumps(rope)}: {problem}; rope_type {json.dumps(rope_type)} takes "
            f"{expected} ({supported})"
        )
    if rope_type == "default":
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for name in want:
        value = params[name]
        # JSON may spell 8.0 as 8 (or 8192 as 8192.0); store one canonical form so configs compare equal.
        if name == "original_max_position_embeddings":
            scaling[name] = int(value) if isinstance(value, float) and value.is_integer() else value
        else:
            scaling[name] = float(value) if type(value) is int else value
    problem = rope_scaling_problem(scaling)
    if problem is not None:
        raise DiffquantError(f"{source}: {key} = {json.dumps(rope)}: {problem}")
    return scaling


def _rope_theta(hf: dict[str, Any], source: str) -> Any:
    """RoPE base: wherever the file states it (``rope_parameters`` for 5.x, top level for 4.x, or inside
    ``rope_scaling``), else 10000. The versions read different places, so differing values are refused."""
    found: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            found[f"{key}.rope_theta"] = rope["rope_theta"]
    if hf.get("rope_theta") is not None:
        found["rope_theta"] = hf["rope_theta"]
    if not found:
        return 10000.0
    values = list(found.values())
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric and len({float(v) for v in values}) > 1:
        stated = ", ".join(f"{k} = {json.dumps(v)}" for k, v in found.items())
        raise DiffquantError(f"{source}: {stated} disagree; expected one RoPE base")
    return values[0]


# Why a weight permutation rather than a "contiguous halves" layout option in DiffV1Attention: the permuted
# model is bit-for-bit the native DIFF V1 model, so every downstream stage (taps, per-head statistics,
# quantization plans, Triton kernels, the explicit map path) sees one layout and needs no second code path
# to test; the permutation costs one copy of three matrices at load time, and exporting inverts it exactly.
def halves_to_interleaved(w: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """Rows (2, n_pairs, r) -> (n_pairs, 2, r): HF's contiguous halves to native interleaved pairs."""
    return w.reshape(2, n_pairs, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)


def interleaved_to_halves(w: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """Rows (n_pairs, 2, r) -> (2, n_pairs, r): the inverse of :func:`halves_to_interleaved`."""
    return w.reshape(n_pairs, 2, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)


def _import_transforms(config: ModelConfig) -> dict[str, Transform]:
    """Per native key: the re-layout applied to the HF tensor (DIFF V1 q/k/v only)."""
    if config.attention != "diff_v1":
        return {}
    out: dict[str, Transform] = {}
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        out[a + "q_proj.weight"] = lambda w, n=config.n_heads: halves_to_interleaved(w, n)
        # One permutation serves K (rows (2, Hkv/2, d)) and V (rows (2, Hkv/2, d) -> (Hkv/2, 2d)).
        out[a + "k_proj.weight"] = lambda w, n=config.n_kv_heads: halves_to_interleaved(w, n)
        out[a + "v_proj.weight"] = lambda w, n=config.n_kv_heads: halves_to_interleaved(w, n)
    return out


# ============================================================================================ export
def export_hf(model: DecoderLM, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write ``model`` as an HF folder (config.json + model.safetensors), atomically.

    baseline -> ``llama``, or the family its fields name (:func:`hf_model_type`: ``gemma3_text`` for the
    Gemma fields, ``qwen3`` for qk-norm, ``qwen2`` for q/k/v biases, ``mistral`` for a window alone); DIFF V1
    -> ``diffllama`` (a per-head norm
    weight is folded into o_proj); DIFF V2 and the rival kinds (gated, sink, clipped) have no HF format.
    Tensors keep the model's dtype.
    """
    config = model.config
    hf_model_type(config)  # refuses a combination no HF family holds, before anything is written
    if getattr(model, "quant_plan", None) is not None:
        raise DiffquantError(
            "export: model is quantized; HF llama/diffllama folders hold unquantized weights only"
        )
    if config.attention == "diff_v1":
        if config.v1_lambda_init is not None:
            raise DiffquantError(
                f"export: v1_lambda_init = {config.v1_lambda_init}, expected null (HF DiffLlama always uses "
                "the depth schedule 0.8 - 0.6 exp(-0.3 depth))"
            )
        if config.v1_norm_eps != config.norm_eps:
            raise DiffquantError(
                f"export: v1_norm_eps = {config.v1_norm_eps} differs from norm_eps = {config.norm_eps}; HF "
                "DiffLlama uses rms_norm_eps for both"
            )
    state = model.state_dict()
    dtype = state["embed.weight"].dtype
    check_float_dtype(dtype, "model dtype")
    tensors: dict[str, torch.Tensor] = {}
    for native, hf_key in hf_key_map(config).items():
        tensor = state[native].detach()
        if config.attention == "diff_v1":
            tensor = _export_v1_tensor(model, native, tensor)
        tensors[hf_key] = tensor.to("cpu").contiguous()
    hf = hf_config(config, dtype)

    tokenizer = getattr(model, "tokenizer", None)
    if isinstance(tokenizer, HFTokenizer):  # the folder is only usable with the ids the model reads
        hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        save_tensors(tensors, tmp / WEIGHTS_FILE)
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save(tmp)

    return write_folder_atomic(out_dir, write, overwrite)


def _export_v1_tensor(model: DecoderLM, native: str, tensor: torch.Tensor) -> torch.Tensor:
    """Inverse permutation of q/k/v; o_proj with the per-head norm weight folded in (when there is one)."""
    config = model.config
    name = native.split(".")[-2] if native.endswith(".weight") else ""
    if name == "q_proj":
        return interleaved_to_halves(tensor, config.n_heads)
    if name in ("k_proj", "v_proj"):
        return interleaved_to_halves(tensor, config.n_kv_heads)
    if name == "o_proj" and config.v1_norm_affine:
        depth = int(native.split(".")[1])
        weight = model.layers[depth].attn.norm.weight.detach()
        return fold_norm_weight(tensor, weight, config.n_heads, native)
    return tensor


def fold_norm_weight(o_proj: torch.Tensor, weight: torch.Tensor, n_heads: int, name: str) -> torch.Tensor:
    """o_proj with the V1 per-head RMSNorm weight folded into its input columns.

    The norm multiplies channel c of every head by weight[c] (one (2d,) weight shared by all heads), then
    (1 - lambda_init) scales, then o_proj is linear: o_proj (w * x) = (o_proj diag(tile(w))) x. So column
    2d h + c of o_proj is scaled by weight[c]. Done in fp32 and cast back; a result the model's dtype cannot
    hold (overflow to inf, e.g. float16 with a large norm weight) is refused rather than written.
    """
    folded = (o_proj.float() * weight.float().repeat(n_heads)[None, :]).to(o_proj.dtype)
    if not torch.isfinite(folded).all():
        raise DiffquantError(
            f"export: folding the V1 norm weight into {name} overflows {str(o_proj.dtype).removeprefix('torch.')}"
            " (max |o_proj * weight| = "
            f"{(o_proj.float().abs().amax(0) * weight.float().abs().repeat(n_heads)).max().item():.3g}); "
            "convert the model to float32 first"
        )
    return folded


# model_type -> (architecture class, ModelConfig fields it holds beyond Llama's).
_EXPORT_FAMILIES = {
    "llama": ("LlamaForCausalLM", ()),
    "diffllama": ("DiffLlamaForCausalLM", ()),
    "qwen2": ("Qwen2ForCausalLM", ("attention_bias", "sliding_window")),
    "qwen3": ("Qwen3ForCausalLM", ("qk_norm", "sliding_window")),
    "mistral": ("MistralForCausalLM", ("sliding_window",)),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        (
            "qk_norm",
            "sliding_window",
            "layer_types",
            "rope_local_theta",
            "norm_unit_offset",
            "sandwich_norms",
            "embed_scale",
            "mlp_activation",
        ),
    ),
}
# What Gemma3ForCausalLM always computes: these fields must hold these values for a gemma3_text export.
_GEMMA3_REQUIRED = {
    "qk_norm": True,
    "norm_unit_offset": True,
    "sandwich_norms": True,
    "mlp_activation": "gelu_tanh",
    "attention_bias": False,
}


def hf_model_type(config: ModelConfig) -> str:
    """The HF ``model_type`` that holds ``config``: the smallest family with its fields, or a one-line refusal
    (Qwen3's ``attention_bias`` biases o_proj too, so qk-norm with q/k/v-only biases has no HF family)."""
    if config.attention not in HF_KINDS:
        raise DiffquantError(
            f"export: attention {config.attention!r} has no Hugging Face format (supported: baseline -> llama, "
            "diff_v1 -> diffllama)"
        )
    gemma = {
        "layer_types": config.layer_types is not None,
        "rope_local_theta": config.rope_local_theta is not None,
        "norm_unit_offset": config.norm_unit_offset,
        "sandwich_norms": config.sandwich_norms,
        "embed_scale": config.embed_scale != 1.0,
        "mlp_activation": config.mlp_activation != "silu",
    }
    if any(gemma.values()):
        field = next(f for f, on in gemma.items() if on)
        if config.attention != "baseline":
            raise DiffquantError(
                f"export: {field} = {json.dumps(getattr(config, field))} with attention "
                f"{config.attention!r}: only Gemma 3 (a baseline) holds it in Hugging Face format"
            )
        for key, want in _GEMMA3_REQUIRED.items():
            if getattr(config, key) != want:
                raise DiffquantError(
                    f"export: {field} = {json.dumps(getattr(config, field))} needs Gemma 3 (gemma3_text), which "
                    f"also has {key} = {json.dumps(want)}; this model has {json.dumps(getattr(config, key))}"
                )
        # Gemma3TextScaledWordEmbedding scales by sqrt(hidden_size) whatever the file says.
        if config.embed_scale != config.d_model**0.5:
            raise DiffquantError(
                f"export: embed_scale = {config.embed_scale}, expected sqrt(d_model) = {config.d_model**0.5} "
                "(Gemma 3 scales its embeddings by sqrt(hidden_size))"
            )
        return "gemma3_text"
    if config.attention == "diff_v1":
        return "diffllama"
    if config.qk_norm and config.attention_bias:
        raise DiffquantError(
            "export: attention_bias = true with qk_norm = true, expected one of them (Qwen3's attention_bias "
            "biases o_proj too; no HF family has q/k/v-only biases with qk-norm)"
        )
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of the exported folder.

    RoPE is written both ways (``rope_theta`` + ``rope_scaling`` for transformers 4.x, ``rope_parameters``
    for 5.x) so either reads it, scaling included; token ids are null because native models carry no
    tokenizer.
    """
    diff = config.attention == "diff_v1"
    model_type = hf_model_type(config)
    heads, kv_heads = (
        (2 * config.n_heads, 2 * config.n_kv_heads) if diff else (config.n_heads, config.n_kv_heads)
    )
    dtype_name = str(dtype).removeprefix("torch.")
    hf: dict[str, Any] = {
        "architectures": [_EXPORT_FAMILIES[model_type][0]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if config.rope_scaling is not None:
        scaling = dict(config.rope_scaling)
        hf["rope_parameters"] = {**scaling, "rope_theta": config.rope_theta}
        # "type" too: transformers before 4.43 read only that spelling (for linear; llama3 is newer anyway).
        hf["rope_scaling"] = {"type": scaling["rope_type"], **scaling}
    if diff:
        hf["lambda_std_dev"] = 0.1
    elif model_type == "llama":
        hf["mlp_bias"] = False
    if model_type == "gemma3_text":
        _gemma3_config(config, hf)
    elif model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    elif model_type in ("qwen2", "qwen3"):
        # Every layer windowed (max_window_layers 0), or none; layer_types spelled out for transformers 5.x.
        window = config.sliding_window
        kind = "full_attention" if window is None else "sliding_attention"
        hf.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=0 if window is not None else config.n_layers,
            layer_types=[kind] * config.n_layers,
        )
        if model_type == "qwen2":
            del hf["attention_bias"]  # Qwen2 has q/k/v biases whatever the key says; leave no false claim
    return hf


def _gemma3_config(config: ModelConfig, hf: dict[str, Any]) -> None:
    """Rewrite the Llama-shaped ``hf`` as a gemma3_text config.json: both transformers versions' RoPE keys
    (5.x ``rope_parameters`` per layer type, 4.x ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``),
    ``layer_types`` spelled out, the scalar the logits are scaled by (1/sqrt(head_dim)), no soft-capping."""
    window = config.sliding_window
    types = (
        config.layer_types or ["full_attention" if window is None else "sliding_attention"] * config.n_layers
    )
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        full = {**config.rope_scaling, "rope_theta": config.rope_theta}
    local = config.rope_local_theta or config.rope_theta
    del hf["hidden_act"]
    hf.pop("rope_scaling", None)
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        rope_local_base_freq=local,
        layer_types=types,
        # transformers needs a number even when no layer is sliding (the importer then reads null back)
        sliding_window=window if window is not None else config.max_seq_len,
        query_pre_attn_scalar=config.head_dim,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    if config.rope_scaling is not None:
        hf["rope_scaling"] = dict(config.rope_scaling)
