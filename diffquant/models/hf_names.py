"""Native state-dict key -> Hugging Face key: the naming map of the HF converter, below the quantizers that name
modules the HF way (SmoothQuant act_scales)."""

from __future__ import annotations

from diffquant.models.config import ModelConfig


def hf_key_map(config: ModelConfig) -> dict[str, str]:
    """native state-dict key -> HF key, for every tensor the native model stores (tied head excluded)."""
    keys = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        keys["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layers):
        n, h = f"layers.{i}.", f"model.layers.{i}."
        keys[n + "attn_norm.weight"] = h + "input_layernorm.weight"
        if config.sandwich_norms:  # Gemma 2 / 3: post_attention_layernorm is the attention output's post-norm
            keys[n + "attn_post_norm.weight"] = h + "post_attention_layernorm.weight"
            keys[n + "mlp_norm.weight"] = h + "pre_feedforward_layernorm.weight"
            keys[n + "mlp_post_norm.weight"] = h + "post_feedforward_layernorm.weight"
        else:
            keys[n + "mlp_norm.weight"] = h + "post_attention_layernorm.weight"
        for proj in ("q", "k", "v", "o"):
            keys[f"{n}attn.{proj}_proj.weight"] = f"{h}self_attn.{proj}_proj.weight"
        if config.attention_bias:  # Qwen2: q/k/v biases (o_proj has none)
            for proj in ("q", "k", "v"):
                keys[f"{n}attn.{proj}_proj.bias"] = f"{h}self_attn.{proj}_proj.bias"
        if config.qk_norm:  # Qwen3: per-head RMSNorm weights of width head_dim
            for proj in ("q", "k"):
                keys[f"{n}attn.{proj}_norm.weight"] = f"{h}self_attn.{proj}_norm.weight"
        for proj in ("gate", "up", "down"):
            keys[f"{n}mlp.{proj}.weight"] = f"{h}mlp.{proj}_proj.weight"
        if config.attention == "diff_v1":
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                keys[f"{n}attn.{name}"] = f"{h}self_attn.{name}"
    return keys
