"""The shipped plan presets, as data: each entry is what a plan file holds (description, rules, backend,
smooth, rotate, weights, kv_cache), read by :func:`diffquant.quant.plan.preset` through ``QuantPlan.from_dict`` like any plan file.

Weights: ``layers.*`` is every Linear inside the blocks (the LM head stays in full precision); sites:
``layers.*.input`` is the input of every such Linear. Every preset selects only sites all three attention
kinds have, so each applies to baseline, DIFF V1 and DIFF V2 models alike.
"""

from __future__ import annotations

import copy
from typing import Any

from diffquant.errors import DiffquantError


def sage_rules(granularity: str) -> list[dict[str, Any]]:
    """SageAttention's casts (Zhang et al. 2024) as plan rules: int8 Q and K at ``granularity`` (K smoothed:
    its mean over tokens subtracted first), P in fp8_e4m3 at the static scale 1/448, V in fp8_e4m3 per
    channel; what the fused kernel implements (diffquant.kernels.dispatch)."""
    return [
        {"sites": ["kind:q"], "scheme": f"int8:{granularity}"},
        {"sites": ["kind:k"], "scheme": {"format": "int8", "granularity": granularity, "smooth": True}},
        {"sites": ["kind:probs"], "scheme": {"format": "fp8_e4m3", "scale": 1.0 / 448.0}},
        {"sites": ["kind:v"], "scheme": "fp8_e4m3:channel"},
    ]


PRESET_TABLE: dict[str, dict[str, Any]] = {
    # ---- attention logits, dynamic absmax per tensor / head / row (DIFF paper, Fig. 8)
    "attn-logits-int8": {
        "description": "attention logits to int8, dynamic absmax per tensor (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int8:tensor"}],
    },
    "attn-logits-int8-head": {
        "description": "attention logits to int8, dynamic absmax per head (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int8:head"}],
    },
    "attn-logits-int8-row": {
        "description": "attention logits to int8, dynamic absmax per row (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int8:row"}],
    },
    "attn-logits-int6": {
        "description": "attention logits to int6, dynamic absmax per tensor (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int6:tensor"}],
    },
    "attn-logits-int6-head": {
        "description": "attention logits to int6, dynamic absmax per head (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int6:head"}],
    },
    "attn-logits-int6-row": {
        "description": "attention logits to int6, dynamic absmax per row (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int6:row"}],
    },
    "attn-logits-int4": {
        "description": "attention logits to int4, dynamic absmax per tensor (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int4:tensor"}],
    },
    "attn-logits-int4-head": {
        "description": "attention logits to int4, dynamic absmax per head (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int4:head"}],
    },
    "attn-logits-int4-row": {
        "description": "attention logits to int4, dynamic absmax per row (DIFF paper, Fig. 8)",
        "rules": [{"sites": ["kind:logits"], "scheme": "int4:row"}],
    },
    # ---- attention internals
    "attn-probs-int8": {
        "description": "softmax probabilities to asymmetric int8 per row",
        "rules": [
            {"sites": ["kind:probs"], "scheme": {"format": "int8", "granularity": "row", "symmetric": False}}
        ],
    },
    "qk-int8-pv-fp8": {
        "description": "SageAttention-style: int8 Q/K per 64-token block (K smoothed), "
        "P in fp8_e4m3 at the static scale 1/448, V in fp8_e4m3 per channel",
        "rules": sage_rules("tokens(64)"),
    },
    "qk-int8-token-pv-fp8": {
        "description": "qk-int8-pv-fp8 with a scale per token for Q and K (K smoothed): as fast in the "
        "kernel, which reads a scale per token either way; an outlier costs only its own token's precision",
        "rules": sage_rules("token"),
    },
    # ---- weights and Linear inputs
    "w8a8": {
        "description": "int8 weights per output channel, int8 Linear inputs per token (dynamic)",
        "rules": [
            {"modules": ["layers.*"], "scheme": "int8:channel"},
            {"sites": ["layers.*.input"], "scheme": "int8:token"},
        ],
    },
    "w8a8-tensor": {
        "description": "int8 weights per output channel, int8 Linear inputs per tensor (static absmax "
        "from calibration: SmoothQuant's per-tensor static setting, without smoothing)",
        "rules": [
            {"modules": ["layers.*"], "scheme": "int8:channel"},
            {
                "sites": ["layers.*.input"],
                "scheme": {"format": "int8", "granularity": "tensor", "calibration": "absmax"},
            },
        ],
    },
    "w8a8-smoothquant": {
        "description": "SmoothQuant (Xiao et al. 2023): smoothing alpha 0.5 from calibration act-scales, "
        "then w8a8-tensor (int8 weights per output channel, int8 Linear inputs per tensor, static absmax)",
        "smooth": {"alpha": 0.5},
        "rules": [
            {"modules": ["layers.*"], "scheme": "int8:channel"},
            {
                "sites": ["layers.*.input"],
                "scheme": {"format": "int8", "granularity": "tensor", "calibration": "absmax"},
            },
        ],
    },
    "w4a8": {
        "description": "int4 weights (the scheme's levels -7..7) in groups of 32, int8 Linear inputs per token "
        "(dynamic)",
        "rules": [
            {"modules": ["layers.*"], "scheme": "int4:group(32)"},
            {"sites": ["layers.*.input"], "scheme": "int8:token"},
        ],
    },
    "w4a16": {
        "description": "int4 weights (the scheme's levels -7..7) in groups of 32, activations unquantized",
        "rules": [{"modules": ["layers.*"], "scheme": "int4:group(32)"}],
    },
    "fp8": {
        "description": "fp8_e4m3 weights per output channel and Linear inputs per token",
        "rules": [
            {"modules": ["layers.*"], "scheme": "fp8_e4m3:channel"},
            {"sites": ["layers.*.input"], "scheme": "fp8_e4m3:token"},
        ],
    },
    "mxfp4": {
        "description": "OCP MXFP4 weights and Linear inputs (32-element blocks, E8M0 scales)",
        "rules": [
            {"modules": ["layers.*"], "scheme": "mxfp4"},
            {"sites": ["layers.*.input"], "scheme": "mxfp4"},
        ],
    },
    "nvfp4": {
        "description": "NVFP4 weights and Linear inputs (16-element blocks, E4M3 scales, fp32 tensor scale)",
        "rules": [
            {"modules": ["layers.*"], "scheme": "nvfp4"},
            {"sites": ["layers.*.input"], "scheme": "nvfp4"},
        ],
    },
    # ---- real backends
    "quanto-w8a8": {
        "description": "optimum-quanto qint8 weights and qint8 activations (static, calibrated)",
        "backend": {"name": "quanto", "weight_type": "qint8", "activation_type": "qint8"},
    },
    "quanto-w8": {
        "description": "optimum-quanto qint8 weights",
        "backend": {"name": "quanto", "weight_type": "qint8"},
    },
    "quanto-w4": {
        "description": "optimum-quanto qint4 weights",
        "backend": {"name": "quanto", "weight_type": "qint4"},
    },
    "bnb-int8": {
        "description": "bitsandbytes LLM.int8 (threshold 6.0)",
        "backend": {"name": "bnb", "mode": "int8", "threshold": 6.0},
    },
    "bnb-nf4": {
        # blocks of 32 so that widths like 672 (a DIFF V2 FFN) divide; bnb 0.50's CPU kernel needs that
        "description": "bitsandbytes NF4 weights (blocks of 32)",
        "backend": {"name": "bnb", "mode": "nf4", "blocksize": 32},
    },
}

# ---- outlier remedies side by side (the remedies study): round-to-nearest weights per output channel and
# Linear inputs per token (dynamic), with no remedy, SmoothQuant smoothing (alpha 0.5), QuaRot rotation
# (R1 residual, R2 heads, R4 online before down_proj; Hadamard) or both (rotation first, then smoothing).
QUAROT_ROTATION = {"residual": "hadamard", "heads": "hadamard", "ffn": "hadamard", "qk": "none"}
INT4_SCHEME = " (the scheme's levels -7..7)"  # the rule schemes' int4, not the weights section's GPTQ grid
ROTATION_WORDS = "QuaRot rotation (Hadamard R1 residual, R2 heads, R4 online before down)"


def _remedy_presets() -> dict[str, dict[str, Any]]:
    """w8a8 / w4a8-channel / w4a4, each plain and with -smooth, -quarot, -quarot-smooth (w4a8's remedies
    drop "-channel": w4a8-quarot is w4a8-channel rotated; the plain w8a8 is the entry above)."""
    remedies = {
        "": ("", None, False),
        "-smooth": ("SmoothQuant smoothing alpha 0.5, then ", {"alpha": 0.5}, False),
        "-quarot": (f"{ROTATION_WORDS}, then ", None, True),
        "-quarot-smooth": (
            f"{ROTATION_WORDS}, then SmoothQuant smoothing alpha 0.5, then ",
            {"alpha": 0.5},
            True,
        ),
    }
    out = {}
    for bits, (w, a) in {
        "w8a8": ("int8", "int8"),
        "w4a8-channel": ("int4", "int8"),
        "w4a4": ("int4", "int4"),
    }.items():
        for suffix, (words, smooth, rotate) in remedies.items():
            name = bits.removesuffix("-channel") + suffix if suffix else bits
            entry: dict[str, Any] = {
                "description": f"{words}{w} weights{INT4_SCHEME if w == 'int4' else ''} per output channel "
                f"(round to nearest), {a} Linear inputs per token (dynamic)",
                "rules": [
                    {"modules": ["layers.*"], "scheme": f"{w}:channel"},
                    {"sites": ["layers.*.input"], "scheme": f"{a}:token"},
                ],
            }
            if smooth is not None:
                entry["smooth"] = dict(smooth)
            if rotate:
                entry["rotate"] = dict(QUAROT_ROTATION)
            out[name] = entry
    out["quarot"] = {
        "description": f"{ROTATION_WORDS} alone, nothing quantized: the rotated float model (the same logits), "
        "to profile what rotation does to outliers",
        "rotate": dict(QUAROT_ROTATION),
    }
    return out


# ---- weights as the field reports them (the weights section, diffquant/quant/weights.py): one grid (GPTQ's:
# symmetric 2^b levels, -8..7 at int4, or asymmetric for HQQ and AWQ), the codes chosen by round-to-nearest,
# GPTQ, HQQ or AWQ. Not the rule schemes' int4 (levels -7..7): docs/plans.md, "two int4 grids".
METHOD_WORDS = {
    "rtn": "round to nearest",
    "gptq": "GPTQ (Frantar et al. 2022; sequential, calibration data)",
    "hqq": "HQQ (Badri & Shaji 2023; asymmetric, data-free)",
    "awq": "AWQ (Lin et al. 2024; activation-aware scales, asymmetric, calibration data)",
}


def _weight_presets() -> dict[str, dict[str, Any]]:
    """w4a16 / w3a16 in groups of 128 (the W4A16 tables' rows) and of 32 (models narrower than 128) by each
    method; w4a8 / w4a4 with int4 weights per output channel by rtn or gptq, plain and rotated (QuaRot's
    W4A4 rows: rotation, then GPTQ)."""
    out: dict[str, dict[str, Any]] = {}
    for group in (128, 32):
        for bits in (4, 3):
            for method, words in METHOD_WORDS.items():
                weights: dict[str, Any] = {"method": method, "format": f"int{bits}", "group": group}
                out[f"w{bits}a16-{method}-g{group}"] = {
                    "description": f"int{bits} weights on GPTQ's grid ({2**bits} levels) in groups of {group} "
                    f"by {words}, activations unquantized",
                    "weights": weights,
                }
    for act in ("int8", "int4"):
        name = f"w4a{act[3:]}"
        for method in ("rtn", "gptq"):
            for rotate in (False, True):
                words = f"{ROTATION_WORDS}, then " if rotate else ""
                entry: dict[str, Any] = {
                    "description": f"{words}int4 weights on GPTQ's grid (16 levels) per output channel by "
                    f"{METHOD_WORDS[method]}, {act} Linear inputs per token (dynamic)",
                    "weights": {"method": method, "format": "int4", "group": "channel"},
                    "rules": [{"sites": ["layers.*.input"], "scheme": f"{act}:token"}],
                }
                if rotate:
                    entry["rotate"] = dict(QUAROT_ROTATION)
                out[f"{name}{'-quarot' if rotate else ''}-{method}"] = entry
    return out


# ---- KV caches for decoding (the kv_cache section, diffquant/quant/kv_cache.py; KIVI, Liu et al. 2024): keys
# per channel, values per token, min-max groups, a full-precision window of recent tokens. Groups of 32 and a
# 128-token window are KIVI's setting (heads of 64+, SmolLM2); the "-g8" family fits the zoo's heads of 24
# (groups of 8, a 32-token window in a 512-token context). Variants change one thing: keys per token (what
# transformers' QuantizedCache does by default), 4 attention-sink tokens kept, a smaller window, pre-RoPE keys.
def _kv_presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for suffix, group, window, small in (("", 32, 128, 32), ("-g8", 8, 32, 8)):
        base = {"keys": "channel", "values": "token", "group": group, "window": window}
        words = f"groups of {group}, {window} recent tokens in full precision"
        for bits in (8, 4, 2):
            out[f"kv{bits}{suffix}"] = {
                "description": f"KV cache int{bits} (KIVI): keys per channel, values per token, {words}",
                "kv_cache": {"format": f"int{bits}", **base},
            }
        out[f"kv4{suffix}-token-keys"] = {
            "description": f"KV cache int4 with keys per token (transformers' QuantizedCache default), {words}",
            "kv_cache": {**base, "format": "int4", "keys": "token"},
        }
        out[f"kv2{suffix}-sinks"] = {
            "description": f"KV cache int2 (KIVI), {words}, the first 4 tokens (attention sinks) kept",
            "kv_cache": {**base, "format": "int2", "sinks": 4},
        }
        out[f"kv2{suffix}-r{small}"] = {
            "description": f"KV cache int2 (KIVI), groups of {group}, only {small} recent tokens in full precision",
            "kv_cache": {**base, "format": "int2", "window": small},
        }
        out[f"kv2{suffix}-prerope"] = {
            "description": f"KV cache int2, keys quantized before RoPE (KVQuant), {words}",
            "kv_cache": {**base, "format": "int2", "pre_rope": True},
        }
    out["kv4-compact"] = {
        "description": "KV cache int4 (KIVI) in 0.28x the bytes of bf16: groups of 64, float16 scales and zeros, "
        "128 recent tokens in full precision",
        "kv_cache": {
            "format": "int4",
            "keys": "channel",
            "values": "token",
            "group": 64,
            "window": 128,
            "scale_dtype": "float16",
        },
    }
    return out


PRESET_TABLE.update({k: v for k, v in _remedy_presets().items() if k not in PRESET_TABLE})
PRESET_TABLE.update({k: v for k, v in _kv_presets().items() if k not in PRESET_TABLE})
PRESET_TABLE.update({k: v for k, v in _weight_presets().items() if k not in PRESET_TABLE})
PRESETS = tuple(sorted(PRESET_TABLE))


def preset_data(name: str) -> dict[str, Any]:
    """The plan dict of preset ``name`` (a copy, with its name), as ``QuantPlan.from_dict`` reads it."""
    if name not in PRESET_TABLE:
        raise DiffquantError(f"unknown plan preset {name!r}; presets: {', '.join(PRESETS)}")
    return {"name": name, **copy.deepcopy(PRESET_TABLE[name])}
