"""DIFF attention on stock flash-attn (imported lazily; CUDA only).

DIFF V2 was designed for this (DIFF V2 post): its 2h query heads of width d run as ONE ordinary causal GQA
flash call, and each output head is the pair difference out[2i] - lambda * out[2i+1]. DIFF V1's value
heads are 2d wide while flash-attn needs equal Q/K/V head dims, so it runs in the split-V form of unilm's
``multihead_flashdiff_2``: V split into two d-wide halves, four calls, concatenated (mathematically equal).
"""

from __future__ import annotations

import importlib.util

import torch


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flash_attn_func on (B, heads, T, d) tensors; returns (B, heads, T, d)."""
    from flash_attn import flash_attn_func  # noqa: PLC0415 (optional GPU library)

    out = flash_attn_func(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        causal=True,
    )
    return out.transpose(1, 2)


def diff_v2_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """q (B, 2H, T, d) interleaved pairs, k/v (B, Hkv, T, d), lam (B, H, T, 1) -> (B, H, T, d)."""
    out = _flash(q, k, v)  # GQA: query head j reads kv head j // (2H / Hkv), as in the model
    return (out[:, 0::2].float() - lam * out[:, 1::2].float()).to(q.dtype)


def diff_v1_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """q (B, 2H, T, d), k (B, 2Hkv, T, d) interleaved components, v (B, Hkv, T, 2d) -> (B, H, T, 2d),
    before the per-head norm (the caller applies it, as on every other path)."""
    d = q.shape[-1]
    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    v1, v2 = v[..., :d], v[..., d:]
    o1 = torch.cat([_flash(q1, k1, v1), _flash(q1, k1, v2)], dim=-1)
    o2 = torch.cat([_flash(q2, k2, v1), _flash(q2, k2, v2)], dim=-1)
    return (o1.float() - lam * o2.float()).to(q.dtype)
