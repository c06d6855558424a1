"""Q / K quantization per block of tokens (and V's fp8 per channel) for the quantized DIFF attention kernels, as ONE
Triton kernel per tensor (two for V).

Why it exists: the kernels in :mod:`diffquant.kernels.triton_diff` with ``qk`` int8 / fp8_e4m3 (SageAttention,
Zhang et al. 2024, arXiv 2410.02367) take Q and K as codes plus a per-token copy of each block's scale. Computed
with :func:`diffquant.kernels.reference.quantize_tokens` in torch that is some 15-20 small torch kernels per
tensor (cast, mean, subtract, pad, abs, isfinite, where, amax, divide, where, divide, the format's rounding,
slices, expand, the cast to int8 / fp8), which on an H200 at T = 4096 costs more than the whole attention (torch
SDPA takes 0.12 ms there). :func:`quantize_tokens_triton` does it in one kernel pass per tensor, plus torch's own
``x.mean(dim=2, keepdim=True, dtype=torch.float32)`` for K's smoothing (one reduction, no float32 copy of a bf16
K; the reference and the model's FakeQuant take the same mean, so it is theirs bit for bit). V for fp8 P*V
(:func:`quantize_values_triton`: one absmax per batch and channel over every head and position, then the codes)
takes two kernels, the first an atomic max across programs, where ``reference.quantize_values`` takes ~45 torch
kernels (counted: most of them on the small scale tensor, each a launch).

It is BIT-IDENTICAL to ``quantize_tokens(x, fmt, block, smooth)``: codes equal ``TokenQuant.codes`` after the
cast the attention kernel's ``_prepare`` applies (``.to(torch.int8)`` / ``.to(torch.float8_e4m3fn)``), scales and
means equal (tests/test_triton_quant.py checks it with ``torch.equal``, and the codes byte for byte; the
compiled code divides with ``div.rn.f32`` only, checked on its sm_90 PTX, since the interpreter cannot tell). The
same arithmetic, element by element:

* v = float32(x) (- mean[channel] when ``smooth``); rows past T (a partial last block) count as 0, which never
  changes an absmax; non-finite |v| count as 0 in the absmax;
* scale = absmax / max_value (127 or 448) as an IEEE fp32 division (``tl.div_rn``: compiled Triton's ``/`` on
  fp32 is an approximate division), and 1 for an all-zero block;
* code = round(v / scale) (again ``tl.div_rn``): int8 round-half-even then clamp to +-127; e4m3 saturate to
  +-448 then RNE at 3 mantissa bits with subnormals (quantum 2^-9).
* Non-finite elements: +-inf saturates to +-127 / +-448 as in the reference; NaN stays NaN in the reference's
  fp32 codes, which torch's int8 cast turns into 0 (seen on CPU; PTX's cvt also maps NaN to 0) and its fp8
  cast into the e4m3 NaN 0x7F / 0xFF (the NaN's sign kept): the kernel writes the same, the sign being that of
  its own v / scale (a GPU's arithmetic may return the canonical +NaN where the CPU keeps -NaN). A block with
  no finite value gets scale 1, like an all-zero one. Note that the reference's smoothing mean of a K channel that
  holds a NaN or an inf is itself NaN / inf, so that whole channel becomes NaN codes (the absmax ignores them).

Rounding is integer / fp32 arithmetic (these helpers, ``_rne`` and ``_round_e4m3``, are the ones triton_diff
imports from here, as it imports ``_interpreting``): Triton's interpreter does not implement the narrowing
casts faithfully. The e4m3 byte is assembled from the rounded value's bits (sign, exponent, mantissa;
subnormals as m * 2^-9) and stored through a uint8 view, so the interpreter's fp32 -> e4m3 cast (which flushes
subnormals) is never used and -0.0 / NaN signs survive; int8 codes are exact integers in fp32, which every
backend casts exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from diffquant.errors import DiffquantError

__all__ = ["quantize_tokens_triton", "quantize_values_triton"]

_FORMATS = {"int8": (0, 127.0, torch.int8), "fp8_e4m3": (1, 448.0, torch.float8_e4m3fn)}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE_ELEMENTS = 8192  # rows x d of one register tile (64 x 128 fp32: 64 registers per thread at 4 warps)
_NUM_WARPS = 4


@triton.jit
def _rne(x):
    """Round half to even for |x| < 2^22: after adding 1.5 * 2^23 the fp32 ulp is 1, so the add rounds."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _round_e4m3(x):
    """Round fp32 ``x`` to the nearest OCP e4m3 value (RNE, saturating at +-448, with subnormals)."""
    y = tl.minimum(tl.maximum(x, -448.0), 448.0)
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |y|); 0 gives -127
    e = tl.minimum(tl.maximum(e, -6), 8)  # below 2^-6 the quantum stays the subnormal 2^-9
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): exact power-of-two scaling
    down = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    return _rne(y * up) * down


@triton.jit
def _e4m3_byte(y):
    """The OCP e4m3 byte (0..255, int32) of fp32 ``y`` rounded to e4m3: sign | exponent | mantissa.

    The sign is ``y``'s own bit (so -0.0 and the reference's -0.0 codes of small negatives keep it, and NaN
    keeps its sign as torch's cast does); NaN gives 0x7F | sign.
    """
    yb = y.to(tl.int32, bitcast=True)
    sign = (yb >> 24) & 0x80
    nan = y != y
    r = tl.abs(_round_e4m3(tl.where(nan, 0.0, y)))  # on the codebook, in [0, 448]
    rb = r.to(tl.int32, bitcast=True)
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 0x7)  # biased exponent (bias 7) and 3 mantissa bits
    sub = (r * 512.0).to(tl.int32)  # r = m * 2^-9 exactly, m in 0..7
    code = tl.where(r >= 0.015625, normal, sub)  # 2^-6: the smallest normal
    code = tl.where(nan, 0x7F, code)  # (a GPU's min / max would turn NaN into -448: handled first)
    return sign | code


@triton.jit
def _quantize(v, scale, FMT: tl.constexpr):
    """Codes of the fp32 tile ``v`` at ``scale``: int8 values (int32) or e4m3 bytes (int32)."""
    y = tl.div_rn(v, scale)
    if FMT == 0:
        # clamp then round = round then clamp (integer bounds); NaN -> 0 as torch's int8 cast of NaN
        y = tl.where(y != y, 0.0, y)
        return _rne(tl.minimum(tl.maximum(y, -127.0), 127.0)).to(tl.int32)
    return _e4m3_byte(y)


@triton.jit
def _load(x_base, m_base, rows, d_offs, ok, stride_t, stride_d, stride_md, SMOOTH: tl.constexpr):
    """The tile's fp32 values (minus the channel mean when SMOOTH); rows that are not ``ok`` read 0."""
    ptrs = x_base + rows.to(tl.int64)[:, None] * stride_t + d_offs[None, :] * stride_d
    v = tl.load(ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    if SMOOTH:
        mean = tl.load(m_base + d_offs * stride_md)
        v = tl.where(ok[:, None], v - mean[None, :], 0.0)
    return v


@triton.jit
def _store(c_base, s_base, rows, d_offs, ok, codes, scale, D: tl.constexpr):
    """The tile's codes (as the code tensor's element type) and its rows' copies of the block scale."""
    c_ptrs = c_base + rows[:, None] * D + d_offs[None, :]
    tl.store(c_ptrs, codes.to(c_base.dtype.element_ty), mask=ok[:, None])
    tl.store(s_base + rows, tl.zeros(rows.shape, dtype=tl.float32) + scale, mask=ok)


@triton.jit
def _finite_abs(v):
    """|v| with non-finite entries as 0 (NaN and inf both fail ``<= FLT_MAX``): what every absmax here reads."""
    mag = tl.abs(v)
    return tl.where(mag <= 3.4028234663852886e38, mag, 0.0)


@triton.jit
def _scale(amax, MAX_VALUE: tl.constexpr):
    """The absmax scale amax / MAX_VALUE as an IEEE fp32 division, and 1 where amax is 0 (nothing finite)."""
    scale = tl.div_rn(amax, MAX_VALUE)
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def _row_absmax(v):
    """Max |v| of each row of the tile, non-finite entries counted as 0."""
    return tl.max(_finite_abs(v), axis=1)


@triton.jit
def _absmax(v):
    """Max |v| over the tile, non-finite entries counted as 0."""
    return tl.max(_row_absmax(v), axis=0)


@triton.jit
def _quant_tokens_kernel(
    X,
    MEAN,
    CODES,
    SCALE,
    n_heads,
    n_blocks,
    T,
    block,
    n_chunks,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    stride_mb,
    stride_mh,
    stride_md,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    FMT: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    SMOOTH: tl.constexpr,
    SINGLE: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    """One program: one (batch, head) and one block of ``block`` tokens, in ``n_chunks`` tiles of ROWS rows;
    PER_ROW (``block`` 1): ROWS tokens, each its own block, with one absmax per row of the tile."""
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n_blocks
    blk = pid % n_blocks
    b = bh // n_heads
    h = bh % n_heads
    x_base = X + b * stride_xb + h * stride_xh
    m_base = MEAN + b * stride_mb + h * stride_mh
    first = blk * block  # first token of the block
    c_base = CODES + bh * T * D
    s_base = SCALE + bh * T
    r_offs = tl.arange(0, ROWS)
    d_offs = tl.arange(0, D)

    if PER_ROW:  # per-token scales: a tile of ROWS tokens, one absmax (and scale) per row
        first = blk * ROWS
        ok = first + r_offs < T
        v = _load(x_base, m_base, first + r_offs, d_offs, ok, stride_xt, stride_xd, stride_md, SMOOTH)
        scale = _scale(_row_absmax(v), MAX_VALUE)
        _store(c_base, s_base, first + r_offs, d_offs, ok, _quantize(v, scale[:, None], FMT), scale, D)
    elif SINGLE:  # the whole block in one register tile: load once
        ok = (r_offs < block) & (first + r_offs < T)
        v = _load(x_base, m_base, first + r_offs, d_offs, ok, stride_xt, stride_xd, stride_md, SMOOTH)
        scale = _scale(_absmax(v), MAX_VALUE)
        _store(c_base, s_base, first + r_offs, d_offs, ok, _quantize(v, scale, FMT), scale, D)
    else:  # a long block: absmax over its tiles, then a second pass that re-reads and quantizes them
        amax = tl.full([], 0.0, tl.float32)
        for c in range(0, n_chunks):
            r = c * ROWS + r_offs
            ok = (r < block) & (first + r < T)
            v = _load(x_base, m_base, first + r, d_offs, ok, stride_xt, stride_xd, stride_md, SMOOTH)
            amax = tl.maximum(amax, _absmax(v))
        scale = _scale(amax, MAX_VALUE)
        for c in range(0, n_chunks):
            r = c * ROWS + r_offs
            ok = (r < block) & (first + r < T)
            v = _load(x_base, m_base, first + r, d_offs, ok, stride_xt, stride_xd, stride_md, SMOOTH)
            _store(c_base, s_base, first + r, d_offs, ok, _quantize(v, scale, FMT), scale, D)


@triton.jit
def _values_tile(X, n_heads, n_tiles, T, stride_xb, stride_xh, stride_xt, stride_xd, D: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """This program's (batch, head, tile): b, its flat (batch, head) index, the tile's rows, their mask and
    fp32 values."""
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n_tiles
    b = bh // n_heads
    rows = (pid % n_tiles) * ROWS + tl.arange(0, ROWS)
    ok = rows < T
    x_base = X + b * stride_xb + (bh % n_heads) * stride_xh
    v = _load(x_base, x_base, rows, tl.arange(0, D), ok, stride_xt, stride_xd, 0, False)
    return b, bh, rows, ok, v


@triton.jit
def _values_absmax_kernel(X, AMAX, n_heads, n_tiles, T, stride_xb, stride_xh, stride_xt, stride_xd,
                          D: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """V's per-(batch, channel) absmax over every head and position: each program max'es its tile's column
    maxima into AMAX (fp32 bits as int32, zero-initialised: for values >= 0 the integer order is the float
    order, and a max does not depend on the order the programs arrive in)."""
    b, bh, rows, ok, v = _values_tile(
        X, n_heads, n_tiles, T, stride_xb, stride_xh, stride_xt, stride_xd, D, ROWS
    )
    amax = tl.max(_finite_abs(v), axis=0)
    tl.atomic_max(AMAX + b * D + tl.arange(0, D), amax.to(tl.int32, bitcast=True))


@triton.jit
def _values_quant_kernel(X, AMAX, CODES, SCALE, n_heads, n_tiles, T, stride_xb, stride_xh, stride_xt,
                         stride_xd, D: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """V's e4m3 codes at scale absmax / 448 per (batch, channel) (1 for an all-zero channel); the first
    program of each batch writes the scales."""
    b, bh, rows, ok, v = _values_tile(
        X, n_heads, n_tiles, T, stride_xb, stride_xh, stride_xt, stride_xd, D, ROWS
    )
    d_offs = tl.arange(0, D)
    scale = _scale(tl.load(AMAX + b * D + d_offs).to(tl.float32, bitcast=True), 448.0)
    codes = _quantize(v, scale[None, :], 1)
    c_ptrs = CODES + (bh * T + rows.to(tl.int64))[:, None] * D + d_offs[None, :]
    tl.store(c_ptrs, codes.to(CODES.dtype.element_ty), mask=ok[:, None])
    if tl.program_id(0) % (n_heads * n_tiles) == 0:  # the batch's first program
        tl.store(SCALE + b * D + d_offs, scale)


# ------------------------------------------------------------------------------------------ host side
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_tensor(x: torch.Tensor, who: str, width: str, max_width: int) -> None:
    """(B, h, T, width) in fp32 / bf16 / fp16, the width a power of two in 16..``max_width``, on CUDA unless
    Triton interprets."""
    if x.dim() != 4:
        raise DiffquantError(f"{who}: expected (batch, heads, positions, channels), got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise DiffquantError(f"{who}: dtype {x.dtype} unsupported (float32, bfloat16, float16)")
    d = x.shape[-1]
    if not (16 <= d <= max_width and d & (d - 1) == 0):
        raise DiffquantError(f"{who}: {width} {d} unsupported; expected a power of two in 16..{max_width}")
    if x.device.type != "cuda" and not _interpreting():
        raise DiffquantError(
            f"{who} needs CUDA tensors, or TRITON_INTERPRET=1 (set before importing the kernels)"
        )


def _check(x: torch.Tensor, fmt: str, block: int) -> None:
    if fmt not in _FORMATS:
        raise DiffquantError(f"quantize_tokens_triton: fmt {fmt!r}; expected one of {', '.join(_FORMATS)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise DiffquantError(f"quantize_tokens_triton: block={block!r}; expected an integer >= 1")
    _check_tensor(x, "quantize_tokens_triton", "head dim", 128)


def quantize_tokens_triton(
    x: torch.Tensor, fmt: str, block: int, smooth: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Absmax-quantize ``x`` (B, h, T, d) per (batch, head, block of ``block`` tokens) to ``fmt`` in one kernel.

    Returns (codes, scale, mean): codes (B, h, T, d) contiguous, torch.int8 for "int8" and
    torch.float8_e4m3fn for "fp8_e4m3"; scale (B, h, T) fp32 contiguous, the per-token copy of each block's
    scale; mean (B, h, 1, d) fp32 (``x.mean(dim=2, keepdim=True, dtype=torch.float32)``, subtracted) when
    ``smooth``, else None. Bit-identical to :func:`diffquant.kernels.reference.quantize_tokens` (codes after
    the cast to the code dtype). ``x`` may be float32 / bfloat16 / float16 with any strides (read in place).
    ``block`` 1 (per-token scales) quantizes a tile of tokens per program, one absmax per row: the attention
    kernels read a scale per token either way, so finer blocks cost them nothing.
    """
    _check(x, fmt, block)
    mode, max_value, code_dtype = _FORMATS[fmt]
    b, h, t, d = x.shape
    # one reduction reading x as float32 (x.float() first would add a cast kernel and a float32 copy of K)
    mean = x.mean(dim=2, keepdim=True, dtype=torch.float32) if smooth else None
    codes = torch.empty((b, h, t, d), dtype=code_dtype, device=x.device)
    scale = torch.empty((b, h, t), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return codes, scale, mean
    per_row = block == 1  # per-token scales: a program quantizes a tile of tokens, each with its own scale
    tile = max(1, _TILE_ELEMENTS // d)  # rows of one register tile
    rows = tile if per_row else min(triton.next_power_of_2(block), tile)
    n_chunks = 1 if per_row else triton.cdiv(block, rows)
    m = mean if mean is not None else scale  # a dummy pointer when not smoothing (never read)
    m_strides = (mean.stride(0), mean.stride(1), mean.stride(3)) if mean is not None else (0, 0, 0)
    # fp8 codes are written as their bytes (see the module docstring), int8 codes as int8
    out = codes.view(torch.uint8) if mode == 1 else codes
    n_blocks = triton.cdiv(t, rows if per_row else block)
    _quant_tokens_kernel[(b * h * n_blocks,)](
        x,
        m,
        out,
        scale,
        h,
        n_blocks,
        t,
        block,
        n_chunks,
        *x.stride(),
        *m_strides,
        D=d,
        ROWS=rows,
        FMT=mode,
        MAX_VALUE=max_value,
        SMOOTH=smooth,
        SINGLE=n_chunks == 1,
        PER_ROW=per_row,
        num_warps=_NUM_WARPS,
    )
    return codes, scale, mean


def quantize_values_triton(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, h, S, dv) in fp8_e4m3 with one absmax scale per (batch, channel) over every head and position,
    in two Triton kernels (an atomic max, then the codes) instead of ~45 torch kernels.

    Returns (codes, scale): codes (B, h, S, dv) torch.float8_e4m3fn contiguous, scale (B, dv) fp32.
    Bit-identical to :func:`diffquant.kernels.reference.quantize_values` with pv "fp8_e4m3" (codes after
    the cast to float8_e4m3fn, the scale reshaped to (B, dv)): the absmax ignores non-finite values, an
    all-zero channel gets scale 1, codes saturate at +-448 and keep NaN, as there.
    """
    _check_tensor(v, "quantize_values_triton", "value width", 256)
    b, h, t, d = v.shape
    codes = torch.empty((b, h, t, d), dtype=torch.float8_e4m3fn, device=v.device)
    if v.numel() == 0:  # no program runs: the reference's scale of an empty V (no fill kernel otherwise)
        return codes, torch.ones((b, d), dtype=torch.float32, device=v.device)
    scale = torch.empty((b, d), dtype=torch.float32, device=v.device)  # each batch's first program writes it
    amax = torch.zeros((b, d), dtype=torch.int32, device=v.device)  # fp32 bits of 0.0
    rows = max(1, _TILE_ELEMENTS // d)
    n_tiles = triton.cdiv(t, rows)
    args = (h, n_tiles, t, *v.stride())
    grid = (b * h * n_tiles,)
    _values_absmax_kernel[grid](v, amax, *args, D=d, ROWS=rows, num_warps=_NUM_WARPS)
    # e4m3 codes written as their bytes (see the module docstring)
    _values_quant_kernel[grid](
        v, amax, codes.view(torch.uint8), scale, *args, D=d, ROWS=rows, num_warps=_NUM_WARPS
    )
    return codes, scale
