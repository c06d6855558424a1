"""microsoft/unilm Diff-Transformer checkpoints (DIFF V1 and V2) -> native DecoderLM.

unilm ships attention modules, not a model format, so a "unilm checkpoint" here is a folder this module
defines: ``config.json`` (schema below) and ``model.safetensors`` holding a Llama-shaped decoder whose
attention modules are unilm's ``MultiheadFlashDiff1`` (V1) or ``MultiheadFlashDiffV2`` (V2), with their
parameter names, under a Meta-Llama-style key map for the rest.

config.json (unknown keys are an error, so a typo is never silently ignored)::

    attention       "diff_v1" | "diff_v2"                                  required
    vocab_size      int                                                    required
    d_model         int (unilm embed_dim / d_model)                        required
    n_layers        int                                                    required
    n_heads         int: V1 differential heads (unilm num_heads, already
                    half a baseline's), V2 output heads (unilm num_heads)  required
    n_kv_heads      int: V1 kv pairs (decoder_kv_attention_heads),
                    V2 kv heads (num_kv_heads)                             default n_heads
    head_dim        int: width d of one Q/K component                      default V1 d_model // n_heads // 2,
                                                                                   V2 d_model // n_heads
    ffn_dim         int: SwiGLU hidden width                               required
    max_seq_len     int                                                    required
    rope_theta      float: RoPE base of the rel_pos tables                 default 10000
    norm_eps        float: eps of the block and final RMSNorms             default 1e-5
    subln_eps       float: V1 per-head RMSNorm eps (unilm: 1e-5)           default 1e-5
    tie_embeddings  bool: LM head shares embed_tokens (no output.weight)   default false

Key map (unilm key -> native key, N = layer index)::

    embed_tokens.weight                        -> embed.weight
    layers.N.attention_norm.weight             -> layers.N.attn_norm.weight
    layers.N.attention.q_proj|k_proj|v_proj.weight -> layers.N.attn.q_proj|k_proj|v_proj.weight
    V1: layers.N.attention.out_proj.weight     -> layers.N.attn.o_proj.weight
        layers.N.attention.lambda_q1|k1|q2|k2  -> layers.N.attn.lambda_q1|k1|q2|k2
        layers.N.attention.subln.weight        -> layers.N.attn.norm.weight
    V2: layers.N.attention.o_proj.weight (or out_proj.weight) -> layers.N.attn.o_proj.weight
        layers.N.attention.lambda_proj.weight  -> layers.N.attn.lambda_proj.weight
    layers.N.ffn_norm.weight                   -> layers.N.mlp_norm.weight
    layers.N.feed_forward.w1.weight            -> layers.N.mlp.gate.weight   (w2(silu(w1 x) * w3 x))
    layers.N.feed_forward.w3.weight            -> layers.N.mlp.up.weight
    layers.N.feed_forward.w2.weight            -> layers.N.mlp.down.weight
    norm.weight                                -> norm.weight
    output.weight                              -> lm_head.weight (absent or ignored when tied)

Head layout: unilm pairs heads interleaved exactly like the native model (V1 q sub-heads 2i, 2i+1 and k
sub-heads 2j, 2j+1, one 2d value head per kv pair; V2 query heads 2i, 2i+1), so no head permutation is
needed. Only RoPE differs; see :func:`interleaved_to_rotate_half`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json
from diffquant.io.assemble import Transform, assemble, check_float_dtype, check_layer_count
from diffquant.io.safetensors_source import checkpoint_folder, open_tensors
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import DecoderLM
from diffquant.names import CONFIG_FILE

UNILM_KINDS = ("diff_v1", "diff_v2")
_REQUIRED = ("attention", "vocab_size", "d_model", "n_layers", "n_heads", "ffn_dim", "max_seq_len")
_OPTIONAL = ("n_kv_heads", "head_dim", "rope_theta", "norm_eps", "subln_eps", "tie_embeddings")


def load_unilm(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """A native DecoderLM (eval mode) from a unilm-layout folder (config.json + model.safetensors)."""
    folder = checkpoint_folder(path)
    check_float_dtype(dtype, "requested dtype")
    config = config_from_unilm(read_json(folder / CONFIG_FILE), str(folder / CONFIG_FILE))
    with open_tensors(folder, device) as source:
        check_layer_count(config.n_layers, source.keys(), r"layers\.(\d+)\.", str(folder / CONFIG_FILE))
        key_map = unilm_key_map(config, set(source.keys()))
        optional = frozenset({"output.weight"}) if config.tie_embeddings else frozenset()
        return assemble(config, source, key_map, _transforms(config), device, dtype, optional)


def config_from_unilm(data: Any, source: str) -> ModelConfig:
    """Translate the documented config.json schema into a ModelConfig (one-line errors)."""
    if not isinstance(data, dict):
        raise DiffquantError(f"{source}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise DiffquantError(
            f"{source}: unknown key(s) {', '.join(unknown)}; allowed keys: "
            f"{', '.join(sorted(_REQUIRED + _OPTIONAL))}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise DiffquantError(f"{source}: missing key(s) {', '.join(missing)}")
    kind = data["attention"]
    if kind not in UNILM_KINDS:
        raise DiffquantError(f"{source}: attention = {kind!r}, expected one of {', '.join(UNILM_KINDS)}")
    d_model, n_heads = data["d_model"], data["n_heads"]
    per_head = 2 * n_heads if kind == "diff_v1" else n_heads  # unilm: embed_dim // num_heads // 2 for V1
    default_dim = (
        d_model // per_head if isinstance(d_model, int) and isinstance(n_heads, int) and n_heads else 0
    )
    fields = {
        "attention": kind,
        "vocab_size": data["vocab_size"],
        "d_model": d_model,
        "n_layers": data["n_layers"],
        "n_heads": n_heads,
        "n_kv_heads": data.get("n_kv_heads", n_heads),
        "head_dim": data.get("head_dim", default_dim),
        "ffn_dim": data["ffn_dim"],
        "max_seq_len": data["max_seq_len"],
        "rope_theta": data.get("rope_theta", 10000.0),
        "norm_eps": data.get("norm_eps", 1e-5),
        "tie_embeddings": data.get("tie_embeddings", False),
    }
    if kind == "diff_v1":
        fields.update(v1_norm_affine=True, v1_norm_eps=data.get("subln_eps", 1e-5), v1_lambda_init=None)
    elif "subln_eps" in data:
        raise DiffquantError(f"{source}: subln_eps applies to attention 'diff_v1' only, got 'diff_v2'")
    try:
        return ModelConfig(**fields)
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {str(err).removeprefix('model config: ')}") from None


def unilm_key_map(config: ModelConfig, available: set[str]) -> dict[str, str]:
    """native key -> unilm key (see the module docstring); V2's output projection may be o_proj or
    out_proj (unilm's V2 module says o_proj, its V1 module and older code out_proj)."""
    keys = {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}
    if not config.tie_embeddings:
        keys["lm_head.weight"] = "output.weight"
    for i in range(config.n_layers):
        n, u = f"layers.{i}.", f"layers.{i}."
        a = u + "attention."
        keys[n + "attn_norm.weight"] = u + "attention_norm.weight"
        keys[n + "mlp_norm.weight"] = u + "ffn_norm.weight"
        for proj in ("q_proj", "k_proj", "v_proj"):
            keys[f"{n}attn.{proj}.weight"] = f"{a}{proj}.weight"
        if config.attention == "diff_v1":
            keys[n + "attn.o_proj.weight"] = a + "out_proj.weight"
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                keys[f"{n}attn.{name}"] = a + name
            keys[n + "attn.norm.weight"] = a + "subln.weight"
        else:
            out = (
                "o_proj"
                if a + "o_proj.weight" in available or a + "out_proj.weight" not in available
                else "out_proj"
            )
            keys[n + "attn.o_proj.weight"] = f"{a}{out}.weight"
            keys[n + "attn.lambda_proj.weight"] = a + "lambda_proj.weight"
        keys[n + "mlp.gate.weight"] = u + "feed_forward.w1.weight"
        keys[n + "mlp.up.weight"] = u + "feed_forward.w3.weight"
        keys[n + "mlp.down.weight"] = u + "feed_forward.w2.weight"
    return keys


def interleaved_to_rotate_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each d-wide head's rows from interleaved (GPT-J) to rotate-half (NeoX) RoPE order.

    unilm rotates channel pairs (2i, 2i+1) by angle pos * theta^(-2i/d); the native model rotates pairs
    (i, i + d/2) by the same angle. Moving row 2i to i and row 2i+1 to i + d/2 makes the native rotation of
    the permuted head exactly the permuted unilm rotation. Q and K get the same permutation within every
    head, and a dot product over a head is invariant under permuting both operands alike, so all attention
    logits (hence maps and outputs) are unchanged. V is not rotated and keeps its order.
    """
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)]).to(w.device)
    rows = w.reshape(-1, head_dim, w.shape[-1])
    return rows[:, perm].reshape(w.shape)


def _transforms(config: ModelConfig) -> dict[str, Transform]:
    d = config.head_dim
    out: dict[str, Transform] = {}
    for i in range(config.n_layers):
        for proj in ("q_proj", "k_proj"):
            out[f"layers.{i}.attn.{proj}.weight"] = lambda w: interleaved_to_rotate_half(w, d)
    return out
