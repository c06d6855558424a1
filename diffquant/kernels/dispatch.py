"""Which attention path runs: torch SDPA, the explicit map path, the Triton kernel, or flash-attn.

On CUDA, a DIFF layer whose quantization plan asks for a variant the fused Triton kernel implements
(int8 / fp8 Q/K per token or per token block with K smoothing, fp8 P*V at P's static 1/448 scale with per-channel V,
static per-head n-bit logits) runs that kernel; an unquantized DIFF layer runs flash-attn when it is
installed; everything else takes the torch paths (fake-quant). ``Attention.last_path`` records what ran,
and ``path_summary`` reports it for ``diffquant info`` and run manifests.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from diffquant.kernels.flash import flash_available
from diffquant.kernels.reference import CoreQuant

PATHS = ("sdpa", "explicit", "triton", "flash")
# The kinds the Triton kernel and the flash-attn wrappers implement (models.config.DIFF_KINDS; kernels sit
# below models, so the names are spelled here). Every other kind takes the torch paths.
_KERNEL_KINDS = ("diff_v1", "diff_v2")
KERNEL_MODES = ("auto", "triton", "off")


def _scheme(tap) -> Any | None:
    q = getattr(tap, "quantizer", None)
    return None if q is None else q.scheme


def kernel_core(attn) -> CoreQuant | None:
    """The CoreQuant the Triton kernel implements for this layer's quantizers, or None if it cannot.

    Returns None for the baseline and the rival kinds (no kernel: SDPA or the explicit path serves them; the
    kernel knows no gate, sink or clip, so it must never see them), for any quantizer the kernel does not
    implement, and for layers with no quantizer at all (the fused torch / flash paths are faster there).
    """
    if attn.kind not in _KERNEL_KINDS or attn.head_dim not in (16, 32, 64, 128):
        return None
    if getattr(attn, "window", None) is not None:
        return None  # the kernel attends causally over every key: no sliding window
    if attn.diff_map.quantizer is not None:
        return None
    q, k, v = _scheme(attn.q), _scheme(attn.k), _scheme(attn.v)
    p1, p2 = _scheme(attn.probs1), _scheme(attn.probs2)
    l1, l2 = _scheme(attn.logits1), _scheme(attn.logits2)
    if not any((q, k, v, p1, p2, l1, l2)):
        return None
    fields: dict[str, Any] = {}
    if q is not None or k is not None:
        if q is None or k is None or q.format != k.format or q.granularity != k.granularity:
            return None
        per_token = q.granularity in ("token", "row")  # one scale per token: the kernel's block 1
        if q.format not in ("int8", "fp8_e4m3") or not (per_token or q.granularity.startswith("tokens(")):
            return None
        if q.is_static or k.is_static or q.smooth or not k.smooth or q.asymmetric or k.asymmetric:
            return None
        if q.scale is not None or k.scale is not None or q.scale_format != "fp32" or k.scale_format != "fp32":
            return None
        fields.update(qk=q.format, block=1 if per_token else q.group_size)
    if p1 is not None or p2 is not None or v is not None:
        probs_ok = p1 == p2 and p1 is not None and p1.format == "fp8_e4m3" and p1.scale == 1.0 / 448.0
        v_ok = v is not None and v.format == "fp8_e4m3" and v.granularity == "channel" and not v.is_static
        if not (probs_ok and v_ok) or v.smooth or v.scale is not None or v.scale_format != "fp32":
            return None
        fields["pv"] = "fp8_e4m3"
    if l1 is not None or l2 is not None:
        if l1 is None or l2 is None or l1 != l2 or not l1.format.startswith("int") or l1.asymmetric:
            return None
        if l1.calibration == "dynamic" or l1.granularity != "head" or l1.scale_format != "fp32" or l1.smooth:
            return None
        s1, s2 = attn.logits1.quantizer.scale, attn.logits2.quantizer.scale
        if s1 is None or s2 is None:
            return None
        fields["logits_bits"] = l1.element.bits
        return _with_logits_scales(attn, fields, s1, s2)
    return CoreQuant(**fields)


def _with_logits_scales(attn, fields: dict[str, Any], s1: torch.Tensor, s2: torch.Tensor) -> CoreQuant:
    """CoreQuant(**fields) with the two maps' static logit scales interleaved (2i, 2i + 1), built once per
    layer while those scale tensors stay the same objects, storage and version: CoreQuant checks that the
    scales are positive, which reads them on the host, a wait for the GPU that every forward would pay."""
    fixed = tuple(sorted(fields.items()))
    state = [(s.device, s.data_ptr(), s._version) for s in (s1, s2)]
    cached = attn.__dict__.get("_kernel_core_cache")
    if cached is not None:
        was_fixed, (was_s1, was_s2), was_state, core = cached
        if was_fixed == fixed and was_s1 is s1 and was_s2 is s2 and was_state == state:
            return core
    scales = torch.stack([s1.reshape(-1), s2.reshape(-1)], dim=1).reshape(-1)
    core = CoreQuant(**fields, logits_scale=scales)
    attn.__dict__["_kernel_core_cache"] = (fixed, (s1, s2), state, core)
    return core


def flash_ready(attn, x: torch.Tensor) -> bool:
    """An unquantized DIFF layer on CUDA with flash-attn installed and no map observed."""
    if not x.is_cuda or attn.kind not in _KERNEL_KINDS or attn._maps_observed():
        return False
    if getattr(attn, "window", None) is not None:
        return False  # diff_v*_flash call flash-attn without a window
    if any(getattr(t, "quantizer", None) is not None for t in (attn.q, attn.k, attn.v, *attn._map_taps())):
        return False

    return flash_available()


def run_kernel(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam, core: CoreQuant) -> torch.Tensor:
    """The layer's attention core through the Triton kernel: (B, H, T, dv), V1 epilogue included.

    Two passes when P is rounded to fp8, so the kernel rounds the normalised P exactly as the fake-quant
    path does (one pass rounds the running exp(S - m) like SageAttention: equivalent in distribution, not
    element for element). Quantized logits take the explicit path's fp32 P @ V (``exact``); otherwise an
    unquantized P @ V of a bf16 model rounds P to bf16 as the SDPA path it replaces does. Tile sizes and
    warps come from the kernel's launch table.
    """
    # Local: triton_diff imports Triton (slow, optional, needs TRITON_INTERPRET set first).
    from diffquant.kernels.triton_diff import diff_v1_attention, diff_v2_attention  # noqa: PLC0415

    two_pass = core.pv == "fp8_e4m3"
    exact = core.logits_bits is not None
    if attn.kind == "diff_v2":
        return diff_v2_attention(q, k, v, lam.squeeze(-1), quant=core, two_pass=two_pass, exact=exact)
    norm_weight = None if attn.norm.weight is None else attn.norm.weight
    return diff_v1_attention(
        q,
        k,
        v,
        lam,
        attn.lambda_init,
        norm_weight,
        eps=attn.norm.eps,
        quant=core,
        two_pass=two_pass,
        exact=exact,
    )


def path_summary(model) -> dict[str, int]:
    """How many layers ran each path in the last forward ('sdpa', 'explicit', 'triton', 'flash')."""
    return dict(Counter(getattr(a, "last_path", "not run") for a in model.attention_modules()))


def planned_paths(model, cuda: bool = True) -> dict[str, int]:
    """The path each layer would take for an uncached forward on CUDA (or CPU), without running it."""
    counts: Counter[str] = Counter()
    for attn in model.attention_modules():
        if attn.kernel != "off" and (cuda or attn.kernel == "triton") and kernel_core(attn) is not None:
            counts["triton"] += 1
        elif attn._use_explicit():
            counts["explicit"] += 1
        else:
            counts["sdpa (flash-attn for DIFF when installed)" if cuda else "sdpa"] += 1
    return dict(counts)
