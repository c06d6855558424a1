"""fp32 torch reference of the (quantized) attention core of the baseline, DIFF V1, DIFF V2 and the rivals.

The inputs are already projected and rotated (RoPE), in the layout the model's ``q``/``k``/``v`` taps see:
(batch, heads, positions, channels). Everything is computed in fp32 except the casts a :class:`CoreQuant`
asks for, so this module is the oracle for the Triton kernels in :mod:`diffquant.kernels.triton_diff` and is
itself checked against the model's fake-quant attention (``tests/test_kernels.py``).

Semantics followed (formulas only, written from the papers):

* DIFF V1 (Ye et al., "Differential Transformer", arXiv 2410.05258, Eq. 1-3; unilm ``multihead_flashdiff_1``):
  head_i = (1 - lambda_init) * RMSNorm_2d(A1 V - lambda A2 V) * weight, A_c = softmax(Q_c K_c^T / sqrt(d)).
* DIFF V2 (the DIFF V2 post, unilm ``multihead_flashdiffv2``): out_i = A[2i] V - lambda_{i,t} A[2i+1] V, the two
  query heads of a pair interleaved and sharing one kv head.
* The rivals (issue 30) on the baseline's GQA core: gated (Qiu et al. 2025, arXiv 2505.06708, Sec. 2.2, G1):
  out = (A V) ⊙ g with g = sigmoid(x W_theta) given; sink (Miller 2023; gpt-oss): p_j = exp(l_j) /
  (exp(s_h) + sum_k exp(l_k)); clipped (Bondarenko et al. 2023, arXiv 2306.12929, Sec. 4.1):
  p = clip((zeta - gamma) softmax(l) + gamma, 0, 1). No Triton kernel implements them (``dispatch`` sends
  them to the torch paths); these cores are the oracle of the model's paths under the same CoreQuant casts.
* SageAttention (Zhang et al. 2024, arXiv 2410.02367): int8 Q/K per block of tokens, K "smoothed" by its mean
  over tokens (softmax-invariant: it shifts every logit of a query row by the same q . mean(K)), and fp8 P*V
  with P scaled by 448 (the e4m3 maximum) before the cast.

Where CoreQuant and the model's fake-quant plans could be read two ways, this module follows the model
(:mod:`diffquant.quant.schemes` / :mod:`diffquant.quant.fake`) exactly, so that a plan and a CoreQuant give the
same numbers:

* Q/K blocks are ``tokens(block)`` blocks: per (batch, head), ``block`` consecutive positions from position 0,
  the last one partial; scale = absmax / max_code (1 for an all-zero block); the codes are the format's own
  rounding (``get_format(...).round``: round-half-even for int8, RNE + saturation for e4m3).
* K smoothing subtracts the mean over *all* positions (per batch, head, channel) before quantizing and adds it
  back after (``smooth: true``), so the dequantized K includes the mean, as in the model.
* The sink logit is not quantized with the logits (the model's ``logits`` tap holds the key logits only);
  P's cast applies to the probabilities after the sink / clip, what the model's ``probs`` tap sees.
* P in fp8: each softmax map is quantized on its own (the model has separate ``probs1``/``probs2`` taps for
  the two maps of a DIFF head), normalized probabilities, static scale s = float32(1/448): round(P / s) * s.
  Note P / float32(1/448) is not bitwise P * 448; the model's arithmetic is kept.
* V in fp8: the model's ``fp8_e4m3:channel`` granularity, one absmax scale per (batch, channel) over all kv
  heads and all positions of the sample (not per block, not per head).
* Logits: quantized after the 1/sqrt(d) scaling, before the causal mask, with a static scale per *query*
  head: ``logits_scale`` has one entry per head of ``q`` (2H for DIFF, interleaved like q: entry 2i is the
  model's ``logits1`` scale of head i, 2i+1 its ``logits2`` scale), or is a scalar (one per tensor).
* pv "bf16": P and V rounded to bfloat16 (round-to-nearest-even), product accumulated in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffquant.errors import DiffquantError
from diffquant.formats import get_format, int_format

__all__ = [
    "FP8_P_SCALE",
    "CoreQuant",
    "TokenQuant",
    "attention_probs",
    "baseline_core",
    "clipped_core",
    "diff_v1_core",
    "diff_v2_core",
    "gated_core",
    "kv_heads_baseline",
    "kv_heads_v1",
    "kv_heads_v2",
    "logits_scales",
    "quantize_probs",
    "quantize_qk",
    "quantize_tokens",
    "quantize_values",
    "sink_core",
]

QK_FORMATS = (None, "int8", "fp8_e4m3")
PV_FORMATS = ("fp32", "bf16", "fp8_e4m3")
FP8_P_SCALE = 448.0  # e4m3 max: P in [0, 1] is scaled onto the full e4m3 range (SageAttention)


@dataclass(frozen=True)
class CoreQuant:
    """Which casts the attention core applies (all else fp32). The default quantizes nothing.

    qk: None | "int8" | "fp8_e4m3": Q and K fake-quantized per ``block`` tokens (per batch and head), K
        smoothed (its mean over tokens subtracted before quantizing and added back; SageAttention).
    block: tokens per Q/K scale block (the ``tokens(n)`` granularity).
    pv: "fp32" | "bf16" | "fp8_e4m3": the operands of P @ V. fp8: P at the static scale 1/448 and V with one
        absmax scale per (batch, channel).
    logits_bits: n-bit symmetric quantization (codes +-(2^(n-1) - 1)) of the scaled logits with the static
        scales ``logits_scale`` (one per query head, or a scalar).
    """

    qk: str | None = None
    block: int = 64
    pv: str = "fp32"
    logits_bits: int | None = None
    logits_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qk not in QK_FORMATS:
            raise DiffquantError(f"CoreQuant.qk={self.qk!r}; expected one of {QK_FORMATS}")
        if self.pv not in PV_FORMATS:
            raise DiffquantError(f"CoreQuant.pv={self.pv!r}; expected one of {PV_FORMATS}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise DiffquantError(f"CoreQuant.block={self.block!r}; expected an integer >= 1")
        if self.logits_bits is not None:
            int_format(self.logits_bits)  # raises for bits outside 2..8
            if self.logits_scale is None:
                raise DiffquantError("CoreQuant.logits_bits needs logits_scale (static per-head scales)")
            if not torch.all(torch.as_tensor(self.logits_scale) > 0):
                raise DiffquantError("CoreQuant.logits_scale must be > 0")

    @property
    def logits_qmax(self) -> float:
        """Largest logit code, 2^(bits-1) - 1 (the restricted symmetric range of ``int{bits}``)."""
        return float((1 << (self.logits_bits - 1)) - 1) if self.logits_bits else 0.0


# ------------------------------------------------------------------------------------------ quantizers
@dataclass(frozen=True)
class TokenQuant:
    """Q or K quantized per block of tokens: codes (fp32 values on the format's codebook, (B, h, T, d)),
    the per-token copy of each block's scale (B, h, T) and the smoothing mean (B, h, 1, d) or None.

    Kernels take the codes and per-token scales directly (the scale of a token is the scale of its block, so a
    kernel's tile size need not match the quantization block); ``dequant`` is what the model computes.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor | None

    def dequant(self) -> torch.Tensor:
        x = self.codes * self.scale[..., None]
        return x if self.mean is None else x + self.mean


def quantize_tokens(x: torch.Tensor, fmt: str, block: int, smooth: bool = False) -> TokenQuant:
    """Absmax-quantize ``x`` (B, h, T, d) per (batch, head, block of ``block`` tokens) to ``fmt``.

    Same arithmetic as the model's ``FakeQuant`` with granularity ``tokens(block)`` (and ``smooth``): blocks
    start at position 0, a partial last block is padded with zeros (which never change an absmax), non-finite
    values are ignored by the absmax, and an all-zero block gets scale 1.
    """
    element = get_format(fmt)
    xf = x.float()
    mean = None
    if smooth:
        mean = x.mean(dim=2, keepdim=True, dtype=torch.float32)  # the model's and the Triton quantizer's
        xf = xf - mean
    b, h, t, d = xf.shape
    pad = (-t) % block
    if pad:
        xf = torch.cat([xf, xf.new_zeros(b, h, pad, d)], dim=2)
    view = xf.reshape(b, h, (t + pad) // block, block, d)
    mag = view.abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros((), dtype=mag.dtype, device=mag.device))
    scale = mag.amax(dim=(3, 4), keepdim=True) / element.max_value
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = element.round(view / scale).reshape(b, h, t + pad, d)[:, :, :t]
    per_token = scale.expand(b, h, (t + pad) // block, block, 1).reshape(b, h, t + pad)[:, :, :t]
    return TokenQuant(codes, per_token.contiguous(), mean)


def quantize_qk(
    q: torch.Tensor, k: torch.Tensor, quant: CoreQuant
) -> tuple[torch.Tensor, torch.Tensor, TokenQuant | None, TokenQuant | None]:
    """(q, k) as the attention core sees them (fp32, fake-quantized when ``quant.qk``), and the TokenQuants."""
    if quant.qk is None:
        return q.float(), k.float(), None, None
    tq = quantize_tokens(q, quant.qk, quant.block, smooth=False)
    tk = quantize_tokens(k, quant.qk, quant.block, smooth=True)
    return tq.dequant(), tk.dequant(), tq, tk


def quantize_values(v: torch.Tensor, pv: str) -> tuple[torch.Tensor, torch.Tensor]:
    """V's codes (fp32 values) and scale (B, 1, 1, dv) for the P @ V operand format ``pv``.

    fp8: one absmax scale per (batch, channel) over every head and position (the model's ``channel``
    granularity on the ``v`` tap). bf16: a plain cast (scale 1). fp32: unchanged.
    """
    vf = v.float()
    ones = vf.new_ones(vf.shape[0], 1, 1, vf.shape[-1])
    if pv == "fp32":
        return vf, ones
    if pv == "bf16":
        return vf.to(torch.bfloat16).float(), ones
    element = get_format(pv)
    mag = vf.abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros((), dtype=mag.dtype, device=mag.device))
    scale = mag.amax(dim=(1, 2), keepdim=True) / element.max_value
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return element.round(vf / scale), scale


def quantize_probs(p: torch.Tensor, pv: str) -> torch.Tensor:
    """P as the P @ V product sees it: fp8 at the static scale float32(1/448) (the model's arithmetic,
    round(P / s) * s), bf16 by a cast, fp32 unchanged."""
    if pv == "fp32":
        return p
    if pv == "bf16":
        return p.to(torch.bfloat16).float()
    s = torch.tensor(1.0 / FP8_P_SCALE, dtype=torch.float32, device=p.device)
    return get_format(pv).round(p / s) * s


def logits_scales(quant: CoreQuant, n_q_heads: int, device: torch.device) -> torch.Tensor | None:
    """``quant.logits_scale`` as an fp32 vector with one entry per query head, or None."""
    if quant.logits_bits is None:
        return None
    s = torch.as_tensor(quant.logits_scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() == 1:
        s = s.expand(n_q_heads)
    if s.numel() != n_q_heads:
        raise DiffquantError(
            f"CoreQuant.logits_scale has {s.numel()} entries; expected one per query head ({n_q_heads}) or 1"
        )
    return s.contiguous()


# ------------------------------------------------------------------------------------------ head maps
def kv_heads_v2(n_q_heads: int, n_kv_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """DIFF V2: query head j reads kv head j // (2H / Hkv); both heads of a pair share one kv head. Made on
    ``device`` (an index built on the host and copied would make the host wait for the GPU)."""
    _check_groups(n_q_heads // 2, n_kv_heads, "diff_v2")
    return torch.arange(n_q_heads, device=device) // (n_q_heads // n_kv_heads)


def kv_heads_v1(n_q_heads: int, n_k_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """DIFF V1: component c of pair i (q head 2i + c) reads K component 2j + c of kv pair j = i // (H / Hkv);
    made on ``device``."""
    heads, kv_pairs = n_q_heads // 2, n_k_heads // 2
    _check_groups(heads, kv_pairs, "diff_v1")
    j = torch.arange(n_q_heads, device=device) // 2 // (heads // kv_pairs)
    return 2 * j + torch.arange(n_q_heads, device=device) % 2


def kv_heads_baseline(n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Baseline GQA: head h reads kv head h // (H / Hkv)."""
    _check_groups(n_heads, n_kv_heads, "baseline")
    return torch.arange(n_heads) // (n_heads // n_kv_heads)


def _check_groups(heads: int, kv_heads: int, what: str) -> None:
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise DiffquantError(
            f"{what}: {heads} output heads do not split into groups over {kv_heads} kv heads"
        )


# ------------------------------------------------------------------------------------------ core
def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_head: torch.Tensor,
    *,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
    logits_scale: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    clip: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Softmax maps (B, nq, T, S) of (already quantized) q (B, nq, T, d) against k (B, nk, S, d).

    Query head j reads k head ``kv_head[j]``. Logits = q k^T / sqrt(d) in fp32 (as the model: matmul, then the
    scale), logit quantization with ``logits_scale`` (nq,), causal mask aligned bottom-right (query t of T sees
    keys <= S - T + t, the model's rule for prefill and cached decoding), fp32 softmax, then P's own cast.
    ``sink`` (nq,): one more logit per head in each row's denominator (its probability dropped); ``clip``
    (gamma, zeta): the clipped softmax clip((zeta - gamma) p + gamma, 0, 1).
    """
    kx = k.index_select(1, kv_head.to(k.device))
    logits = torch.matmul(q, kx.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if quant.logits_bits is not None:
        s = logits_scale.view(1, -1, 1, 1)
        qmax = quant.logits_qmax
        logits = torch.round(logits / s).clamp(-qmax, qmax) * s
    t, s_len = q.shape[2], k.shape[2]
    if causal:
        q_pos = torch.arange(s_len - t, s_len, device=q.device)[:, None]
        valid = torch.arange(s_len, device=q.device)[None, :] <= q_pos
        logits = logits.masked_fill(~valid, float("-inf"))
    if sink is None:
        p = torch.softmax(logits, dim=-1)
    else:
        column = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        p = torch.softmax(torch.cat([column, logits], dim=-1), dim=-1)[..., 1:]
    if clip is not None:
        gamma, zeta = clip
        p = ((zeta - gamma) * p + gamma).clamp(0.0, 1.0)
    return quantize_probs(p, quant.pv)


def _check4(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise DiffquantError(
            f"{name}: expected (batch, heads, positions, channels), got shape {tuple(x.shape)}"
        )


def diff_v2_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    *,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
) -> torch.Tensor:
    """DIFF V2 core: q (B, 2H, T, d) interleaved pairs, k/v (B, Hkv, S, d), lam (B, H, T) in (0, 1).

    Returns (B, H, T, d) fp32: out_i = A[2i] V - lam_i A[2i+1] V, query head j on kv head j // (2H / Hkv).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check4(name, x)
    nq = q.shape[1]
    if nq % 2:
        raise DiffquantError(f"diff_v2_core: q must hold 2H interleaved heads, got {nq}")
    kv_head = kv_heads_v2(nq, k.shape[1])
    qf, kf, _, _ = quantize_qk(q, k, quant)
    vq, vs = quantize_values(v, quant.pv)
    vf = (vq * vs).index_select(1, kv_head[0::2].to(v.device))
    ls = logits_scales(quant, nq, q.device)
    outs = []
    for c in (0, 1):
        p = attention_probs(
            qf[:, c::2], kf, kv_head[c::2], causal=causal, quant=quant,
            logits_scale=None if ls is None else ls[c::2],
        )  # fmt: skip
        outs.append(torch.matmul(p, vf))
    return outs[0] - lam.float()[..., None] * outs[1]


def diff_v1_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: float | torch.Tensor,
    lambda_init: float,
    norm_weight: torch.Tensor | None,
    *,
    eps: float = 1e-5,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
) -> torch.Tensor:
    """DIFF V1 core: q (B, 2H, T, d), k (B, 2Hkv, S, d) interleaved components, v (B, Hkv, S, 2d).

    Returns (B, H, T, 2d) fp32: (1 - lambda_init) * RMSNorm(A1 V - lam A2 V) * norm_weight, the RMS over the
    head's 2d channels; pair i reads kv pair i // (H / Hkv).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check4(name, x)
    nq, nk = q.shape[1], k.shape[1]
    if nq % 2 or nk % 2:
        raise DiffquantError(
            f"diff_v1_core: q and k must hold interleaved component pairs, got {nq} and {nk}"
        )
    if v.shape[1] * 2 != nk or v.shape[-1] != 2 * q.shape[-1]:
        raise DiffquantError(
            f"diff_v1_core: v must be (B, {nk // 2}, S, {2 * q.shape[-1]}), got {tuple(v.shape)}"
        )
    kv_head = kv_heads_v1(nq, nk)
    qf, kf, _, _ = quantize_qk(q, k, quant)
    vq, vs = quantize_values(v, quant.pv)
    vf = (vq * vs).index_select(1, (kv_head[0::2] // 2).to(v.device))
    ls = logits_scales(quant, nq, q.device)
    outs = []
    for c in (0, 1):
        p = attention_probs(
            qf[:, c::2], kf, kv_head[c::2], causal=causal, quant=quant,
            logits_scale=None if ls is None else ls[c::2],
        )  # fmt: skip
        outs.append(torch.matmul(p, vf))
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=q.device)
    x = outs[0] - lam_t * outs[1]
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if norm_weight is not None:
        y = y * norm_weight.float()
    return y * (1.0 - lambda_init)


def baseline_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
    sink: torch.Tensor | None = None,
    clip: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Baseline GQA core: q (B, H, T, d), k/v (B, Hkv, S, d) -> (B, H, T, d) fp32. ``sink`` / ``clip``: the
    rivals' softmax (see :func:`attention_probs`; :func:`sink_core`, :func:`clipped_core`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check4(name, x)
    kv_head = kv_heads_baseline(q.shape[1], k.shape[1])
    qf, kf, _, _ = quantize_qk(q, k, quant)
    vq, vs = quantize_values(v, quant.pv)
    vf = (vq * vs).index_select(1, kv_head.to(v.device))
    if sink is not None and sink.shape != (q.shape[1],):
        raise DiffquantError(
            f"sink: expected one logit per head, shape ({q.shape[1]},), got {tuple(sink.shape)}"
        )
    p = attention_probs(
        qf, kf, kv_head, causal=causal, quant=quant, logits_scale=logits_scales(quant, q.shape[1], q.device),
        sink=sink, clip=clip,
    )  # fmt: skip
    return torch.matmul(p, vf)


def gated_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    *,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
) -> torch.Tensor:
    """Gated attention core (Qiu et al. 2025, G1): the baseline core times ``gate`` (B, H, T, 1 | d), the
    sigmoid gates (head-wise or element-wise) -> (B, H, T, d) fp32."""
    _check4("gate", gate)
    out = baseline_core(q, k, v, causal=causal, quant=quant)
    if gate.shape[:3] != out.shape[:3] or gate.shape[-1] not in (1, out.shape[-1]):
        raise DiffquantError(
            f"gate: expected (B, H, T, 1 or {out.shape[-1]}) = {tuple(out.shape[:3])}, got {tuple(gate.shape)}"
        )
    return out * gate.float()


def sink_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    *,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
) -> torch.Tensor:
    """Sink attention core: the baseline core with one sink logit per head (``sink`` (H,); zeros = softmax-
    off-by-one) in every softmax denominator -> (B, H, T, d) fp32."""
    return baseline_core(q, k, v, causal=causal, quant=quant, sink=sink)


def clipped_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    gamma: float = -0.025,
    zeta: float = 1.0,
    causal: bool = True,
    quant: CoreQuant = CoreQuant(),
) -> torch.Tensor:
    """Clipped-softmax core (Bondarenko et al. 2023): the baseline core with P = clip((zeta - gamma) softmax +
    gamma, 0, 1) -> (B, H, T, d) fp32."""
    return baseline_core(q, k, v, causal=causal, quant=quant, clip=(gamma, zeta))
