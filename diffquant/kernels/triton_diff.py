"""Fused forward kernels for DIFF V1 and DIFF V2 attention in Triton (causal prefill, GQA, quantized variants).

One program owns (batch, differential head i, block of ``block_m`` queries) and makes ONE pass over the K/V
tiles of the head's kv group, keeping two online softmaxes side by side (running max m, running sum l and an
output accumulator per map), in the FlashAttention-2 form (Dao 2023, arXiv 2307.08691, Algorithm 1):

    m_new = max(m, rowmax(S)),  alpha = exp(m - m_new),  P = exp(S - m_new),
    l = alpha * l + rowsum(P),  acc = alpha * acc + P V,  and at the end O = acc / l.

Both maps of a DIFF head read the same V tile (V2: also the same K tile), which is the point of fusing them:
V is loaded once for two maps. The epilogue combines the maps:

* DIFF V2 (DIFF V2 post; unilm ``multihead_flashdiffv2``): out = acc1 / l1 - lambda_t * acc2 / l2, lambda per
  token and head.
* DIFF V1 (DIFF paper arXiv 2410.05258, Eq. 1-3): x = acc1 / l1 - lambda * acc2 / l2 over the 2d-wide value
  head, then (1 - lambda_init) * RMSNorm(x) * weight. A program owns whole 2d rows, so the norm is local.

Quantized variants (SageAttention, Zhang et al. 2024, arXiv 2410.02367 / 2411.10958):

* ``qk`` int8 / fp8_e4m3: Q and K are quantized per block of tokens by one Triton kernel each
  (:func:`diffquant.kernels.triton_quant.quantize_tokens_triton`, bit-identical to the reference's
  :func:`diffquant.kernels.reference.quantize_tokens`, K smoothed by its mean over tokens), handed to the kernel
  as codes plus a per-token copy of the block scale; the kernel takes dot(codes_q, codes_k) (int8 x int8 -> int32
  on a GPU, exact) times scale_q * scale_k. The smoothing mean only shifts each query row's logits by
  q . mean(K), which softmax ignores, so it is dropped, except when the logits themselves are quantized: then
  the shift is passed in as a per-row bias so the quantized logits equal the model's.
* ``pv`` fp8_e4m3: P is scaled by 448 and rounded to e4m3 in the kernel, V is quantized in torch per channel
  (the model's ``fp8_e4m3:channel``), the V scale / 448 is applied in the epilogue. As in SageAttention, the P
  that is rounded is the running-max-relative exp(S - m_running) in [0, 1], not the final normalized
  probability the reference rounds: both are within one e4m3 rounding (relative 2^-4) of the exact value, so
  kernel and reference differ by at most two roundings per element (see the tests for the bound).
  ``pv`` bf16: P and V rounded to bfloat16 before the product (the FlashAttention-2 habit), fp32 accumulation.
  ``two_pass=True`` instead makes a first pass for the row max and sum only and rounds the exactly normalized
  P in the second, as the model's fake-quant ``probs`` taps do (P / float32(1/448) for fp8): then kernel and
  reference agree to fp32 level (but for rare flips at rounding ties), at the price of computing Q K^T twice.
* ``logits_bits``: round(S / s_h) clamped to +-(2^(b-1) - 1) times s_h, with a static scale per query head.

Rounding is written out with fp32 / integer arithmetic instead of Triton casts, because Triton's interpreter
(CPU) does not implement the narrowing casts faithfully (seen with triton 3.7.1: fp32 -> e4m3 rounds ties away
from zero, does not saturate (500 -> 256) and flushes subnormals; fp32 -> bf16 truncates, also with
``fp_downcast_rounding="rtne"``), and a kernel must compute the same numbers on CPU and GPU:

* round-half-to-even: (x + 1.5 * 2^23) - 1.5 * 2^23 for |x| < 2^22 (the fp32 adder does the rounding);
* bf16: add 0x7FFF + (lowest kept bit) to the fp32 bits and clear the low 16 bits (RNE);
* e4m3 (OCP OFP8, max 448, 3 mantissa bits, subnormal quantum 2^-9): clamp to +-448, take the binade exponent
  e = floor(log2 |y|) from the float bits, clamp e to [-6, 8], and round y / 2^(e-3) half-to-even, exactly
  as :class:`diffquant.quant.formats.ElementFormat` does. On a GPU the rounded value is then cast to
  ``tl.float8e4nv`` (exact, it is on the codebook), so that the single-pass P @ V runs as an fp8 tensor-core
  product; the two-pass P @ V and Q K^T of fp8 codes take exact products instead (see ``_dot``: Hopper's fp8
  tensor cores do not accumulate in fp32).

Interpreter notes (``TRITON_INTERPRET=1``): ``tl.dot`` on bf16 operands is wrong there (triton#11584), so when
interpreting every tile is upcast to fp32 before ``tl.dot`` (exact: bf16 and e4m3 values are fp32 values, and
int8 dot products stay below 2^24 for d <= 128). Compiled, bf16 / int8 tiles go to the tensor cores as they
are (int8 x int8 -> int32 when the reduction dim is >= 32, else through bf16, which is exact for int8 codes
and e4m3 values), e4m3 tiles only in the single-pass P @ V (elsewhere through bf16: ``_dot``), and fp32 tiles
use ``input_precision="ieee"`` (TF32 would lose the 1e-4 match; use bf16 inputs or ``pv="bf16"`` for speed).
Every variant compiles for sm_90 (checked offline with ``triton.compile``: the RNE add pair survives into the
PTX, and tests/test_kernels.py checks which wgmma each variant issues). On an H200 (torch 2.11, Triton 3.6,
issue 45) every bf16 case of ``pytest -m gpu`` passed; the fp32 cases that used fp8 tensor cores in exact
paths failed, which ``_dot`` now avoids (a GPU run confirms it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from diffquant.errors import DiffquantError
from diffquant.kernels.reference import (
    FP8_P_SCALE,
    CoreQuant,
    kv_heads_v1,
    kv_heads_v2,
    logits_scales,
)
from diffquant.kernels.triton_quant import (
    _interpreting,
    _rne,
    _round_e4m3,
    quantize_tokens_triton,
    quantize_values_triton,
)

__all__ = ["diff_v1_attention", "diff_v2_attention", "kernel_constants", "kernel_round", "launch_config"]

_QK_MODES = {None: 0, "int8": 1, "fp8_e4m3": 2}
_PV_MODES = {"fp32": 0, "bf16": 1, "fp8_e4m3": 2}
# Masked logits are -1e30 in the kernel, not -inf, so that (masked - running max) never is (-inf) - (-inf) = NaN.
_P_STEP = float(torch.tensor(1.0 / FP8_P_SCALE, dtype=torch.float32))  # the model's fp32 P scale 1/448


# ------------------------------------------------------------------------------------------ device helpers
@triton.jit
def _round_bf16(x):
    """Round fp32 ``x`` to the nearest bfloat16 value, ties to even, returned as fp32 (finite inputs).

    Adding 0x7FFF plus the lowest kept bit to the float's bits and clearing the low 16 bits is RNE at 8
    significand bits; a carry into the exponent is the correct round-up to the next binade.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, NATIVE8: tl.constexpr, FAST8: tl.constexpr):
    """a @ b with fp32 accumulation: exact products, fp32 sums, except for e4m3 tiles with FAST8.

    Interpreter (UPCAST): fp32 operands, since its bf16 dot is wrong. Compiled: fp32 tiles in IEEE fp32 (not
    TF32); bf16 / fp16 on the tensor cores; int8 -> int32 tensor-core products when the reduction dim is >= 32
    (NATIVE8; exact); e4m3 tiles on the fp8 tensor cores only with FAST8 (and NATIVE8). Otherwise the codes go
    through bf16, which holds every int8 code and every e4m3 value exactly (2x the 8-bit MMA cost).

    Why FAST8: Hopper's fp8 MMA does not accumulate in fp32. It sums in fixed point aligned to the largest
    addend (the running sum included) and truncates ~14 bits below it (DeepSeek-V3 report, 3.3.2), and
    Triton lets it accumulate a whole tile that way on sm_90 (``max_num_imprecise_acc`` defaults to 2^30).
    So fp8 products are only used where the kernel promises SageAttention's statistical equivalence (the
    single-pass P V); Q K^T of fp8 codes and the two-pass P V, which promise the reference's numbers, keep
    exact products (issue 45: the GPU's fp32 tests of exactly those, qk-fp8 and the pv-fp8 / sage two-pass
    runs, failed by the margin this accumulation gives; an emulation of it in the interpreter reproduces the
    failures, see tests/test_kernels.py::test_fp8_tensor_core_accumulation_is_kept_out_of_exact_paths).
    """
    # one return at the end: the compiler visits code after a constexpr branch's return too
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        out = tl.dot(a, b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.int8 and NATIVE8:
        out = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    elif a.dtype == tl.float8e4nv and NATIVE8 and FAST8:
        out = tl.dot(a, b)
    elif a.dtype == tl.int8 or a.dtype == tl.float8e4nv:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _logits(
    q, k, qs, ks, qb, ls, sm_scale,
    QK_MODE: tl.constexpr, LOGITS_QMAX: tl.constexpr, UPCAST: tl.constexpr, NATIVE8: tl.constexpr,
):  # fmt: skip
    """Scaled (and optionally quantized) logits of a (BM, D) query tile against a (BN, D) key tile.

    Quantized Q/K: the tiles hold codes, the logit is dot(codes) * scale_q * scale_k / sqrt(d).
    """
    s = _dot(q, tl.trans(k), UPCAST, NATIVE8, False)  # exact: the logits of the same codes as the reference
    if QK_MODE != 0:  # noqa: SIM108 (constexpr branches, one compiled)
        s = s * (qs * sm_scale)[:, None] * ks[None, :]
    else:
        s = s * sm_scale
    if LOGITS_QMAX > 0:
        s = s + qb[:, None]
        t = tl.minimum(tl.maximum(tl.div_rn(s, ls), -LOGITS_QMAX), LOGITS_QMAX)
        s = _rne(t) * ls
    return s


@triton.jit
def _pv(
    p, v, p_step, PV_MODE: tl.constexpr, TWO_PASS: tl.constexpr, UPCAST: tl.constexpr, NATIVE8: tl.constexpr,
    HW_CAST: tl.constexpr,
):  # fmt: skip
    """P (BM, BN) fp32 in [0, 1] times a V tile (BN, DV), in the operand format PV_MODE.

    fp8: one pass rounds exp(S - m_running) * 448 (SageAttention); two passes round the normalized P as the
    model does, round(P / p_step) with p_step = float32(1/448). The scale goes back on in the epilogue.
    """
    if PV_MODE == 2:
        if TWO_PASS:  # noqa: SIM108 (constexpr branches, one compiled)
            y = tl.div_rn(p, p_step)
        else:
            y = p * 448.0
        if HW_CAST:
            # compiled: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_90: RNE, saturating at
            # 448, subnormals kept), the same numbers as _round_e4m3 in far fewer instructions
            p8 = y.to(tl.float8e4nv)
        else:
            p8 = _round_e4m3(y)
            if not UPCAST:
                p8 = p8.to(tl.float8e4nv)  # exact: p8 is on the e4m3 codebook
        out = _dot(p8, v, UPCAST, NATIVE8, not TWO_PASS)  # fp8 tensor cores in the single (Sage) pass only
    elif PV_MODE == 1:
        if HW_CAST:
            pb = p.to(tl.bfloat16)  # compiled fp32 -> bf16 casts round to nearest even (cvt.rn.bf16x2.f32)
            if v.dtype == tl.bfloat16:  # noqa: SIM108 (constexpr branches, one compiled)
                vb = v
            else:
                vb = v.to(tl.bfloat16)
        else:
            pb = _round_bf16(p)
            vb = _round_bf16(v.to(tl.float32))
            if not UPCAST:
                pb = pb.to(tl.bfloat16)  # exact, as above
                vb = vb.to(tl.bfloat16)
        out = _dot(pb, vb, UPCAST, NATIVE8, False)
    else:
        out = _dot(p, v, UPCAST, NATIVE8, False)
    return out


@triton.jit
def _tile_logits(
    k_base, ks_base, kh1, kh2, start_n, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
    stride_kh, stride_kt, T, S, sm_scale,
    BLOCK_N: tl.constexpr, K_PER_KV: tl.constexpr, CAUSAL: tl.constexpr, QK_MODE: tl.constexpr,
    LOGITS_QMAX: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Logits (BM, BN) of both maps against key tile ``start_n``.

    MASKED: the tile may hold keys past S or (causal) keys some of the block's queries must not see; those
    entries are -1e30. Unmasked tiles (every key < S and visible to every query of the block: all but the
    last one or two tiles of a causal row block) skip the load masks and the (BM, BN) select.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < S
    k_rows = offs_n[:, None] * stride_kt
    k1 = _load_rows(k_base + kh1 * stride_kh + k_rows, n_ok, MASKED)
    ks1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    if QK_MODE != 0:
        ks1 = tl.load(ks_base + kh1 * S + offs_n, mask=n_ok, other=0.0)
    if K_PER_KV == 2:
        k2 = _load_rows(k_base + kh2 * stride_kh + k_rows, n_ok, MASKED)
        ks2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        if QK_MODE != 0:
            ks2 = tl.load(ks_base + kh2 * S + offs_n, mask=n_ok, other=0.0)
    else:
        k2 = k1
        ks2 = ks1
    s1 = _logits(q1, k1, qs1, ks1, qb1, ls1, sm_scale, QK_MODE, LOGITS_QMAX, UPCAST, q1.shape[1] >= 32)
    s2 = _logits(q2, k2, qs2, ks2, qb2, ls2, sm_scale, QK_MODE, LOGITS_QMAX, UPCAST, q2.shape[1] >= 32)
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            # query t sees keys <= S - T + t (bottom-right aligned; T == S in prefill)
            visible = visible & (offs_n[None, :] <= (S - T + offs_m)[:, None])
        s1 = tl.where(visible, s1, -1.0e30)
        s2 = tl.where(visible, s2, -1.0e30)
    return s1, s2, offs_n, n_ok


@triton.jit
def _load_rows(ptrs, n_ok, MASKED: tl.constexpr):
    """A (BN, width) tile of key or value rows; MASKED: rows past S (not ``n_ok``) read 0, else no mask."""
    if MASKED:  # noqa: SIM108 (constexpr branches, one compiled)
        x = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _first_pass(
    lo, hi, m1, m2, l1, l2, acc1, acc2,
    k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
    stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
    BLOCK_N: tl.constexpr, K_PER_KV: tl.constexpr, CAUSAL: tl.constexpr, QK_MODE: tl.constexpr,
    PV_MODE: tl.constexpr, LOGITS_QMAX: tl.constexpr, TWO_PASS: tl.constexpr, UPCAST: tl.constexpr,
    HW_CAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Key tiles lo..hi of the online softmax (FlashAttention-2, Algorithm 1) for both maps; with TWO_PASS
    only the row max and sum (the second pass does P V)."""
    for start_n in range(lo, hi, BLOCK_N):
        s1, s2, offs_n, n_ok = _tile_logits(
            k_base, ks_base, kh1, kh2, start_n, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
            stride_kh, stride_kt, T, S, sm_scale,
            BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, LOGITS_QMAX, UPCAST, MASKED,
        )  # fmt: skip
        m1_new = tl.maximum(m1, tl.max(s1, 1))
        m2_new = tl.maximum(m2, tl.max(s2, 1))
        alpha1 = tl.exp(m1 - m1_new)
        alpha2 = tl.exp(m2 - m2_new)
        p1 = tl.exp(s1 - m1_new[:, None])
        p2 = tl.exp(s2 - m2_new[:, None])
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        if not TWO_PASS:
            v = _load_rows(v_base + offs_n[:, None] * stride_vt, n_ok, MASKED)
            acc1 = acc1 * alpha1[:, None] + _pv(
                p1, v, p_step, PV_MODE, TWO_PASS, UPCAST, BLOCK_N >= 32, HW_CAST
            )
            acc2 = acc2 * alpha2[:, None] + _pv(
                p2, v, p_step, PV_MODE, TWO_PASS, UPCAST, BLOCK_N >= 32, HW_CAST
            )
        m1 = m1_new
        m2 = m2_new
    return m1, m2, l1, l2, acc1, acc2


@triton.jit
def _second_pass(
    lo, hi, m1, m2, l1, l2, acc1, acc2,
    k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
    stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
    BLOCK_N: tl.constexpr, K_PER_KV: tl.constexpr, CAUSAL: tl.constexpr, QK_MODE: tl.constexpr,
    PV_MODE: tl.constexpr, LOGITS_QMAX: tl.constexpr, UPCAST: tl.constexpr, HW_CAST: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Two-pass mode: the exactly normalized P = exp(S - m) / l, quantized as the model quantizes it."""
    for start_n in range(lo, hi, BLOCK_N):
        s1, s2, offs_n, n_ok = _tile_logits(
            k_base, ks_base, kh1, kh2, start_n, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
            stride_kh, stride_kt, T, S, sm_scale,
            BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, LOGITS_QMAX, UPCAST, MASKED,
        )  # fmt: skip
        p1 = tl.exp(s1 - m1[:, None]) / l1[:, None]
        p2 = tl.exp(s2 - m2[:, None]) / l2[:, None]
        v = _load_rows(v_base + offs_n[:, None] * stride_vt, n_ok, MASKED)
        acc1 += _pv(p1, v, p_step, PV_MODE, True, UPCAST, BLOCK_N >= 32, HW_CAST)
        acc2 += _pv(p2, v, p_step, PV_MODE, True, UPCAST, BLOCK_N >= 32, HW_CAST)
    return acc1, acc2


@triton.jit
def _diff_attn_fwd(
    Q, K, V, LAM, OUT,
    QS, KS, QB, VS, LS, NW,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_lb, stride_lh, stride_lt,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_heads, n_rep, n_q_heads, n_k_heads, T, S,
    sm_scale, p_step, out_scale, eps,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_PER_KV: tl.constexpr, IS_V1: tl.constexpr, CAUSAL: tl.constexpr,
    QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, LOGITS_QMAX: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, TWO_PASS: tl.constexpr, UPCAST: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """One (batch, head, query block): two online softmaxes over the shared K/V tiles, then the epilogue."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    i = pid_bh % n_heads
    j = i // n_rep  # kv head (V2) / kv pair (V1) of differential head i
    qh1 = 2 * i
    qh2 = 2 * i + 1
    kh1 = j * K_PER_KV  # V2: both maps on K head j; V1: K components 2j and 2j + 1
    kh2 = j * K_PER_KV + (K_PER_KV - 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    m_ok = offs_m < T

    q_base = Q + b.to(tl.int64) * stride_qb + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q1 = tl.load(q_base + qh1 * stride_qh, mask=m_ok[:, None], other=0.0)
    q2 = tl.load(q_base + qh2 * stride_qh, mask=m_ok[:, None], other=0.0)
    qs1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    qs2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    qb1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    qb2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    ls1 = tl.full([], 1.0, tl.float32)  # the logits' static scales, read only when they are quantized
    ls2 = ls1
    if LOGITS_QMAX > 0:
        ls1 = tl.load(LS + qh1)
        ls2 = tl.load(LS + qh2)
    if QK_MODE != 0:
        qs_base = QS + (b * n_q_heads).to(tl.int64) * T + offs_m
        qs1 = tl.load(qs_base + qh1 * T, mask=m_ok, other=0.0)
        qs2 = tl.load(qs_base + qh2 * T, mask=m_ok, other=0.0)
    if LOGITS_QMAX > 0 and QK_MODE != 0:
        qb_base = QB + (b * n_q_heads).to(tl.int64) * T + offs_m
        qb1 = tl.load(qb_base + qh1 * T, mask=m_ok, other=0.0)
        qb2 = tl.load(qb_base + qh2 * T, mask=m_ok, other=0.0)

    m1 = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    m2 = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, DV], dtype=tl.float32)

    k_base = K + b.to(tl.int64) * stride_kb + offs_d[None, :] * stride_kd
    v_base = V + b.to(tl.int64) * stride_vb + j * stride_vh + offs_dv[None, :] * stride_vd
    ks_base = KS + (b * n_k_heads).to(tl.int64) * S
    hi = S
    full = S // BLOCK_N * BLOCK_N  # tiles below ``full`` hold no key past S
    if CAUSAL:
        hi = tl.minimum(S, S - T + (pid_m + 1) * BLOCK_M)
        # tiles wholly at or before the block's first query position are visible to all its queries
        first = S - T + pid_m * BLOCK_M
        full = tl.minimum(full, tl.maximum(first + 1, 0) // BLOCK_N * BLOCK_N)
    m1, m2, l1, l2, acc1, acc2 = _first_pass(
        0, full, m1, m2, l1, l2, acc1, acc2,
        k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
        stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
        BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, PV_MODE, LOGITS_QMAX, TWO_PASS, UPCAST, HW_CAST, False,
    )  # fmt: skip
    m1, m2, l1, l2, acc1, acc2 = _first_pass(
        full, hi, m1, m2, l1, l2, acc1, acc2,
        k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
        stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
        BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, PV_MODE, LOGITS_QMAX, TWO_PASS, UPCAST, HW_CAST, True,
    )  # fmt: skip

    # key 0 is visible to every row (causal prefill) or all keys are (non-causal), so l1, l2 >= 1
    if TWO_PASS:
        acc1, acc2 = _second_pass(
            0, full, m1, m2, l1, l2, acc1, acc2,
            k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
            stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
            BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, PV_MODE, LOGITS_QMAX, UPCAST, HW_CAST, False,
        )  # fmt: skip
        acc1, acc2 = _second_pass(
            full, hi, m1, m2, l1, l2, acc1, acc2,
            k_base, ks_base, v_base, kh1, kh2, offs_m, q1, q2, qs1, qs2, qb1, qb2, ls1, ls2,
            stride_kh, stride_kt, stride_vt, T, S, sm_scale, p_step,
            BLOCK_N, K_PER_KV, CAUSAL, QK_MODE, PV_MODE, LOGITS_QMAX, UPCAST, HW_CAST, True,
        )  # fmt: skip
        o1 = acc1
        o2 = acc2
        if PV_MODE == 2:
            vs = tl.load(VS + b * DV + offs_dv) * p_step
            o1 = o1 * vs[None, :]
            o2 = o2 * vs[None, :]
    else:
        o1 = acc1 / l1[:, None]
        o2 = acc2 / l2[:, None]
        if PV_MODE == 2:
            vs = tl.load(VS + b * DV + offs_dv) * (1.0 / 448.0)
            o1 = o1 * vs[None, :]
            o2 = o2 * vs[None, :]
    lam = tl.load(LAM + b.to(tl.int64) * stride_lb + i * stride_lh + offs_m * stride_lt, mask=m_ok, other=0.0)
    x = o1 - lam.to(tl.float32)[:, None] * o2
    if IS_V1:
        ms = tl.sum(x * x, 1) / DV
        x = x * (1.0 / tl.sqrt(ms + eps))[:, None]
        if HAS_WEIGHT:
            w = tl.load(NW + offs_dv).to(tl.float32)
            x = x * w[None, :]
        x = x * out_scale
    if OUT.dtype.element_ty == tl.bfloat16:
        x = _round_bf16(x)  # RNE here; the interpreter's own bf16 cast truncates
    o_ptr = OUT + b.to(tl.int64) * stride_ob + i * stride_oh + offs_m[:, None] * stride_ot
    tl.store(o_ptr + offs_dv[None, :] * stride_od, x.to(OUT.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _round_kernel(X, Y, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0)
    if MODE == 0:
        y = _rne(x)
    elif MODE == 1:
        y = _round_e4m3(x)
    else:
        y = _round_bf16(x)
    tl.store(Y + offs, y, mask=ok)


# ------------------------------------------------------------------------------------------ host side
def kernel_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernels' in-register rounding applied to fp32 ``x``: "int" (half to even, |x| < 2^22),
    "fp8_e4m3" or "bf16". Exposed so tests can hold it against :mod:`diffquant.quant.formats` and torch casts."""
    modes = {"int": 0, "fp8_e4m3": 1, "bf16": 2}
    if fmt not in modes:
        raise DiffquantError(f"kernel_round: fmt {fmt!r}; expected one of {', '.join(modes)}")
    xf = x.detach().float().contiguous().reshape(-1)
    y = torch.empty_like(xf)
    block = 1024
    _round_kernel[(triton.cdiv(xf.numel(), block),)](xf, y, xf.numel(), MODE=modes[fmt], BLOCK=block)
    return y.reshape(x.shape)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_dims(d: int, block_m: int, block_n: int) -> None:
    if not (_pow2(d) and 16 <= d <= 128):
        raise DiffquantError(
            f"triton diff attention: head dim {d} unsupported; the kernel tiles need a power of two in 16..128"
        )
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not (_pow2(blk) and blk >= 16):
            raise DiffquantError(f"triton diff attention: {name}={blk} must be a power of two >= 16")


# Launch configurations for the compiled kernel (sm_90), per (kind, value head width, Q/K format, P @ V format):
# (query tile rows, key tile rows, warps, software-pipeline stages). Chosen offline from what Triton 3.6 (the
# H200's) and 3.9 compile for sm_90 at the bench's T = 4096 shapes (analysis/kernels/compiled.py --sweep,
# compiled.json): the largest tile that fits the 232,448 bytes of shared memory and spills no register in
# both, then 3 stages, then fewer registers. Not yet timed: ``analysis/kernels/bench.py --tune`` times every
# such candidate on the GPU, and its "best" replaces these. DIFF V1 at head dim 128 with fp8 P @ V (two
# 256-wide fp32 accumulators) spills ~1 KB in every candidate; the smallest spill is taken.
_CONFIGS: dict[tuple[str, int, str | None, str], tuple[int, int, int, int]] = {
    ("diff_v2", 64, None, "bf16"): (128, 64, 8, 3),
    ("diff_v2", 128, None, "bf16"): (128, 32, 8, 3),
    ("diff_v2", 64, "int8", "fp8_e4m3"): (128, 64, 8, 3),
    ("diff_v2", 128, "int8", "fp8_e4m3"): (64, 64, 8, 3),
    ("diff_v2", 64, "fp8_e4m3", "fp8_e4m3"): (128, 64, 8, 3),
    ("diff_v2", 128, "fp8_e4m3", "fp8_e4m3"): (64, 32, 8, 3),
    ("diff_v1", 128, None, "bf16"): (128, 64, 8, 3),
    ("diff_v1", 256, None, "bf16"): (64, 32, 8, 3),
    ("diff_v1", 128, "int8", "fp8_e4m3"): (64, 64, 8, 3),
    ("diff_v1", 256, "int8", "fp8_e4m3"): (64, 32, 8, 2),
}
# Any other variant (fp32 operands, the exact P @ V, one of Q/K or P/V quantized): small tiles, 8 warps.
_DEFAULT_CONFIG = (64, 32, 8, 2)
_INTERPRETER_BLOCKS = 16  # Triton's interpreter: small tiles keep several tiles (and masks) in CPU tests


def launch_config(
    *, kind: str, d: int, dv: int, qk: str | None, pv: str, interpreting: bool | None = None
) -> dict[str, int]:
    """block_m, block_n, num_warps, num_stages for a DIFF kind ("diff_v1" / "diff_v2") and variant; ``pv`` is
    the P @ V format the kernel runs (bf16 for unquantized bf16 inputs)."""
    if _interpreting() if interpreting is None else interpreting:
        return {
            "block_m": _INTERPRETER_BLOCKS,
            "block_n": _INTERPRETER_BLOCKS,
            "num_warps": 4,
            "num_stages": 1,
        }
    bm, bn, warps, stages = _CONFIGS.get((kind, dv, qk, pv), _DEFAULT_CONFIG)
    return {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}


def kernel_constants(
    *,
    d: int,
    dv: int,
    is_v1: bool,
    causal: bool,
    qk: str | None,
    pv: str,
    logits_qmax: float,
    has_weight: bool,
    two_pass: bool,
    upcast: bool,
    block_m: int,
    block_n: int,
    hw_cast: bool | None = None,
) -> dict:
    """The kernel's compile-time constants (one place: the launcher and analysis/kernels/compiled.py)."""
    return {
        "D": d,
        "DV": dv,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "K_PER_KV": 2 if is_v1 else 1,
        "IS_V1": is_v1,
        "CAUSAL": causal,
        "QK_MODE": _QK_MODES[qk],
        "PV_MODE": _PV_MODES[pv],
        "LOGITS_QMAX": int(logits_qmax),
        "HAS_WEIGHT": has_weight,
        "TWO_PASS": two_pass,
        "UPCAST": upcast,
        # the GPU's own fp32 -> bf16 / e4m3 conversions (RNE, saturating), not the interpreter's (see above)
        "HW_CAST": (not upcast) if hw_cast is None else hw_cast,
    }


def _pv_format(quant: CoreQuant, dtype: torch.dtype, exact: bool) -> str:
    """The P @ V operand format the kernel runs: ``quant.pv``, except that an unquantized P @ V of bf16
    inputs runs on bf16 tensor cores with P rounded to bf16 (RNE), as FlashAttention and torch SDPA do,
    unless ``exact``. Kept in fp32 (IEEE FMAs: no tensor cores, ~1 % of an H200's bf16 rate, issue 46)
    only for fp32 / fp16 inputs or when asked."""
    if quant.pv == "fp32" and dtype == torch.bfloat16 and not exact:
        return "bf16"
    return quant.pv


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise DiffquantError(
                f"{name}: expected (batch, heads, positions, channels), got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise DiffquantError(f"{name}: dtype {x.dtype} unsupported (float32, bfloat16, float16)")
        if x.device != q.device:
            raise DiffquantError(f"{name} is on {x.device}, q on {q.device}")
    if q.device.type != "cuda" and not _interpreting():
        raise DiffquantError(
            "triton diff attention needs CUDA tensors, or TRITON_INTERPRET=1 (set before importing the kernels)"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[2] != v.shape[2]:
        raise DiffquantError(
            f"batch / length mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if causal and q.shape[2] > k.shape[2]:
        raise DiffquantError(f"causal attention with more queries ({q.shape[2]}) than keys ({k.shape[2]})")


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_head: torch.Tensor,
    quant: CoreQuant,
) -> dict:
    """The kernel operands for ``quant``: codes and scales in torch (one place, shared with the reference)."""
    dev = q.device
    # what a variant does not read (its constexpr branches skip the loads): no fill kernel for it
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    ops = {"q": q, "k": k, "v": v, "qs": dummy, "ks": dummy, "qb": dummy, "vs": dummy, "ls": dummy}
    if quant.qk is not None:
        # one Triton kernel per tensor, bit-identical to reference.quantize_tokens (torch's ~20 small kernels
        # per tensor cost more than the attention itself at T = 4096 on an H200)
        ops["q"], ops["qs"], _ = quantize_tokens_triton(q, quant.qk, quant.block)
        ops["k"], ops["ks"], k_mean = quantize_tokens_triton(k, quant.qk, quant.block, smooth=True)
        if quant.logits_bits is not None:
            # the smoothing shift q . mean(K) / sqrt(d) of each row: softmax ignores it, logit rounding does not
            mean = k_mean.index_select(1, kv_head)  # (B, nq, 1, d); kv_head is on the device
            q_dequant = ops["q"].float() * ops["qs"][..., None]
            ops["qb"] = ((q_dequant * mean).sum(-1) * (1.0 / math.sqrt(q.shape[-1]))).contiguous()
    if quant.pv == "fp8_e4m3":
        # two Triton kernels, bit-identical to reference.quantize_values (~45 torch kernels); the interpreter
        # loads and upcasts the fp8 codes fine
        ops["v"], ops["vs"] = quantize_values_triton(v)
    if quant.logits_bits is not None:
        ops["ls"] = logits_scales(quant, q.shape[1], dev)
    ops["upcast"] = _interpreting()  # the interpreter runs CUDA tensors too, with the same dot limitations
    ops["hw_cast"] = not _interpreting()  # the interpreter's narrowing casts are not faithful
    return ops


def _launch(
    ops: dict,
    lam: torch.Tensor,
    lam_strides: tuple[int, int, int],
    out: torch.Tensor,
    *,
    n_heads: int,
    n_rep: int,
    d: int,
    dv: int,
    is_v1: bool,
    causal: bool,
    quant: CoreQuant,
    pv: str,
    config: dict[str, int],
    out_scale: float = 1.0,
    eps: float = 1e-5,
    norm_weight: torch.Tensor | None = None,
    two_pass: bool = False,
) -> None:
    q, k, v = ops["q"], ops["k"], ops["v"]
    bsz, n_q_heads, t, _ = q.shape
    s = k.shape[2]
    nw = norm_weight if norm_weight is not None else ops["qs"]
    consts = kernel_constants(
        d=d, dv=dv, is_v1=is_v1, causal=causal, qk=quant.qk, pv=pv, logits_qmax=quant.logits_qmax,
        has_weight=norm_weight is not None, two_pass=two_pass, upcast=ops["upcast"], hw_cast=ops["hw_cast"],
        block_m=config["block_m"], block_n=config["block_n"],
    )  # fmt: skip
    grid = (triton.cdiv(t, config["block_m"]), bsz * n_heads)
    _diff_attn_fwd[grid](
        q, k, v, lam, out,
        ops["qs"], ops["ks"], ops["qb"], ops["vs"], ops["ls"], nw,
        *q.stride(), *k.stride(), *v.stride(), *lam_strides, *out.stride(),
        n_heads, n_rep, n_q_heads, k.shape[1], t, s,
        1.0 / math.sqrt(d), _P_STEP, out_scale, eps,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **consts,
    )  # fmt: skip


def _config(kind: str, d: int, dv: int, quant: CoreQuant, pv: str, **given: int | None) -> dict[str, int]:
    """The table's launch configuration with the caller's non-None choices on top, checked. Tiles chosen by
    the caller get Triton's default warps and stages unless given too: the table's belong to its tiles."""
    config = launch_config(kind=kind, d=d, dv=dv, qk=quant.qk, pv=pv)
    if (given.get("block_m"), given.get("block_n")) != (None, None) and not _interpreting():
        config.update(num_warps=4, num_stages=3)
    config.update({key: value for key, value in given.items() if value is not None})
    _check_dims(d, config["block_m"], config["block_n"])
    return config


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A fresh torch.empty output in the inputs' dtype (the kernel writes every element), or the caller's
    ``out`` (any float dtype and strides; the kernel casts on store)."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.device != like.device:
        raise DiffquantError(
            f"out: expected shape {shape} on {like.device}, got {tuple(out.shape)} on {out.device}"
        )
    return out


def diff_v2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    *,
    quant: CoreQuant = CoreQuant(),  # noqa: B008 (frozen dataclass, immutable)
    causal: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    two_pass: bool = False,
    exact: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused DIFF V2 attention: q (B, 2H, T, d) interleaved pairs, k/v (B, Hkv, S, d), lam (B, H, T).

    Returns (B, H, T, d) in q's dtype (written into ``out`` when given): A[2i] V - lam_i A[2i+1] V, query head
    2i + c on kv head i // (H / Hkv). Same semantics as :func:`diffquant.kernels.reference.diff_v2_core`;
    ``quant`` selects the quantized variant. ``causal`` aligns the mask bottom-right (T == S for prefill).
    ``two_pass`` rounds the exactly normalized P for ``pv`` bf16 / fp8 (the model's semantics, equal to the
    reference up to fp32 summation order) at the price of computing Q K^T twice; the default single pass
    rounds the running-max-relative P as SageAttention does (within two roundings of the reference).
    Unquantized P @ V of bf16 inputs runs on bf16 tensor cores with P rounded to bf16, as FlashAttention and
    torch SDPA do (the reference with ``pv="bf16"``); ``exact=True`` keeps fp32 operands there (IEEE fp32
    FMAs, many times slower on a GPU; what the model's explicit path computes).
    ``block_m`` / ``block_n`` (query / key tile rows, powers of two >= 16), ``num_warps``, ``num_stages``:
    None takes :func:`launch_config`'s choice for the kind, head width and variant.
    """
    _check_inputs(q, k, v, causal)
    bsz, nq, t, d = q.shape
    if nq % 2:
        raise DiffquantError(f"diff_v2_attention: q must hold 2H interleaved heads, got {nq}")
    if v.shape[-1] != d or k.shape[-1] != d or v.shape[1] != k.shape[1]:
        raise DiffquantError(
            f"diff_v2_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}"
        )
    pv = _pv_format(quant, v.dtype, exact)
    config = _config(
        "diff_v2",
        d,
        d,
        quant,
        pv,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    heads = nq // 2
    kv_head = kv_heads_v2(nq, k.shape[1], q.device)
    lam = lam.to(device=q.device)
    if tuple(lam.shape) != (bsz, heads, t):
        raise DiffquantError(
            f"diff_v2_attention: lam must be (B, H, T) = {(bsz, heads, t)}, got {tuple(lam.shape)}"
        )
    ops = _prepare(q, k, v, kv_head, quant)
    result = _output(out, (bsz, heads, t, d), q)
    _launch(
        ops, lam, tuple(lam.stride()), result,
        n_heads=heads, n_rep=heads // k.shape[1], d=d, dv=d, is_v1=False, causal=causal,
        quant=quant, pv=pv, config=config, two_pass=two_pass,
    )  # fmt: skip
    return result


def diff_v1_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: float | torch.Tensor,
    lambda_init: float,
    norm_weight: torch.Tensor | None,
    *,
    eps: float = 1e-5,
    quant: CoreQuant = CoreQuant(),  # noqa: B008 (frozen dataclass, immutable)
    causal: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    two_pass: bool = False,
    exact: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused DIFF V1 attention: q (B, 2H, T, d), k (B, 2Hkv, S, d) interleaved components, v (B, Hkv, S, 2d).

    Returns (B, H, T, 2d) in q's dtype: (1 - lambda_init) * RMSNorm_2d(A1 V - lam A2 V) * norm_weight, pair i
    on kv pair i // (H / Hkv). ``lam`` is the layer's scalar lambda (a float or a one-element tensor, read on
    the device, so passing the model's tensor costs no host sync). Same semantics as
    :func:`diffquant.kernels.reference.diff_v1_core`; ``quant``, ``causal``, ``two_pass``, ``exact``, the
    launch configuration and ``out`` as in :func:`diff_v2_attention`.
    """
    _check_inputs(q, k, v, causal)
    bsz, nq, t, d = q.shape
    nk = k.shape[1]
    if nq % 2 or nk % 2:
        raise DiffquantError(
            f"diff_v1_attention: q and k must hold interleaved component pairs, got {nq}, {nk}"
        )
    if k.shape[-1] != d or v.shape[1] * 2 != nk or v.shape[-1] != 2 * d or v.shape[2] != k.shape[2]:
        raise DiffquantError(
            f"diff_v1_attention: need k (B, 2Hkv, S, {d}) and v (B, Hkv, S, {2 * d}); "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    pv = _pv_format(quant, v.dtype, exact)
    config = _config(
        "diff_v1", d, 2 * d, quant, pv, block_m=block_m, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    heads = nq // 2
    kv_head = kv_heads_v1(nq, nk, q.device)
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=q.device).reshape(-1)
    if lam_t.numel() != 1:
        raise DiffquantError(
            f"diff_v1_attention: lam must be one scalar per layer, got {lam_t.numel()} values"
        )
    if norm_weight is not None:
        if tuple(norm_weight.shape) != (2 * d,):
            raise DiffquantError(
                f"diff_v1_attention: norm_weight must be ({2 * d},), got {tuple(norm_weight.shape)}"
            )
        norm_weight = norm_weight.detach().float().contiguous()
    ops = _prepare(q, k, v, kv_head, quant)
    result = _output(out, (bsz, heads, t, 2 * d), q)
    _launch(
        ops, lam_t, (0, 0, 0), result,
        n_heads=heads, n_rep=heads // (nk // 2), d=d, dv=2 * d, is_v1=True, causal=causal,
        quant=quant, pv=pv, config=config, out_scale=1.0 - float(lambda_init), eps=float(eps),
        norm_weight=norm_weight, two_pass=two_pass,
    )  # fmt: skip
    return result
