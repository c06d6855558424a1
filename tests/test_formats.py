"""Number formats (diffquant.quant.formats): codebooks against the specs, rounding against oracles.

Oracles: torch's float8_e4m3fn / float8_e5m2 casts (round-to-nearest-even) for FP8; codebooks written out by
hand from the OCP MX v1.0 tables for FP6 / FP4; the published QLoRA NF4 values; brute-force nearest-value
search (float64) for everything else.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from diffquant.errors import DiffquantError
from diffquant.quant.formats import (
    BLOCK_FORMATS,
    ELEMENT_FORMATS,
    NF4_VALUES,
    BlockFormat,
    absmax_scale,
    block_scales,
    e8m0_round,
    e8m0_round_up,
    get_block_format,
    get_format,
    int_format,
    minmax_scale_zero_point,
    nvfp4_tensor_scale,
    quantize_blocks,
    quantize_int,
)
from diffquant.quant.schemes import Scheme, quantize_dynamic, round_scale

SETTINGS = settings(max_examples=60, deadline=None)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MX_NAMES = [n for n, f in BLOCK_FORMATS.items() if f.scale == "e8m0"]

# ---- Literal codebooks (positive half, zero included), written out from the specs.
# OCP MX v1.0, FP4 E2M1: subnormal 0.5; normals 1, 1.5, 2, 3, 4, 6.
FP4_E2M1_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# OCP MX v1.0, FP6 E2M3 (bias 1): subnormals k/8; then steps of 1/8, 1/4, 1/2 per binade up to 7.5.
FP6_E2M3_POS = [
    0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875,
    1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
    2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75,
    4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5,
]  # fmt: skip
# OCP MX v1.0, FP6 E3M2 (bias 3): subnormals k/16; four values per binade up to 28.
FP6_E3M2_POS = [
    0.0, 0.0625, 0.125, 0.1875,
    0.25, 0.3125, 0.375, 0.4375,
    0.5, 0.625, 0.75, 0.875,
    1.0, 1.25, 1.5, 1.75,
    2.0, 2.5, 3.0, 3.5,
    4.0, 5.0, 6.0, 7.0,
    8.0, 10.0, 12.0, 14.0,
    16.0, 20.0, 24.0, 28.0,
]  # fmt: skip
SMALL_FLOATS = {"fp4_e2m1": FP4_E2M1_POS, "fp6_e2m3": FP6_E2M3_POS, "fp6_e3m2": FP6_E3M2_POS}
# QLoRA (Dettmers et al. 2023) NF4, as published / shipped by bitsandbytes.
NF4_PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def both_signs(pos: list[float]) -> torch.Tensor:
    return torch.tensor(sorted({-v for v in pos if v} | set(pos)), dtype=torch.float32)


def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 dtype, from all 256 bit patterns (both zeros included)."""
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return v[torch.isfinite(v)]


def nearest_float(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Brute-force saturating round-to-nearest, ties to the even code (even index in the positive table).

    In a float format the positive values in ascending order are the codes 0, 1, 2, ... so the parity of the
    index is the parity of the mantissa's last bit.
    """
    pos = pos.double()
    ax = x.double().abs().clamp(max=pos[-1].item())
    d = (ax[:, None] - pos[None, :]).abs()
    cand = d == d.min(dim=1, keepdim=True).values
    first = cand.to(torch.int8).argmax(dim=1)
    tie = cand.sum(dim=1) == 2
    idx = torch.where(tie & (first % 2 == 1), first + 1, first)
    return (pos[idx] * torch.where(x < 0, -1.0, 1.0).double()).float()


def nearest_lut(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Brute-force nearest value; argmin returns the first minimum, i.e. a tie goes to the lower value."""
    d = (x.double()[:, None] - levels.double()[None, :]).abs()
    return levels[d.argmin(dim=1)]


def float32_lists(bound: float, max_size: int = 64) -> st.SearchStrategy[list[float]]:
    return st.lists(st.floats(-bound, bound, allow_nan=False, width=32), min_size=1, max_size=max_size)


def log_uniform(n: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    """n signed values with log2 |x| uniform in [lo, hi): many binades, subnormals of the target included."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=g) * (hi - lo) + lo)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


# ------------------------------------------------------------------------------------------ FP8 vs torch
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_codebook_is_every_finite_bit_pattern(name):
    fmt = get_format(name)
    expected = torch.unique(fp8_values(FP8[name]))  # unique merges +0 / -0
    assert torch.equal(fmt.codebook(), expected)
    assert fmt.max_value == expected.max().item()
    assert fmt.bits == 8 and fmt.kind == "float"


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_round_fixes_every_representable_value(name):
    v = fp8_values(FP8[name])
    out = get_format(name).round(v)
    assert torch.equal(out, v)
    assert torch.equal(out.signbit(), v.signbit())  # -0 stays -0, like the cast


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_round_midpoints_tie_to_even_like_torch(name):
    fmt = get_format(name)
    cb = fmt.codebook().double()
    mids64 = (cb[1:] + cb[:-1]) / 2
    mids = mids64.float()
    assert torch.equal(mids.double(), mids64)  # midpoints are exact in float32, so these are true ties
    assert torch.equal(fmt.round(mids), mids.to(FP8[name]).float())
    # One hand-checked tie each way: between 1 and the next value up, and the next pair.
    step = 2.0**-fmt.mbits
    got = fmt.round(torch.tensor([1 + step / 2, 1 + 1.5 * step]))
    assert got.tolist() == [1.0, 1 + 2 * step]  # ties go to the even mantissa


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_round_random_matches_torch_cast(name):
    fmt = get_format(name)
    lo = {"fp8_e4m3": -12.0, "fp8_e5m2": -19.0}[name]  # below half the smallest subnormal
    x = log_uniform(1_000_000, lo, math.log2(fmt.max_value) + 1.0, seed=1)  # also beyond the range
    inside = x.clamp(-fmt.max_value, fmt.max_value)
    expected = inside.to(FP8[name]).float()
    assert torch.equal(fmt.round(x), expected)  # beyond max compares to the cast of the saturated value


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_saturates_and_keeps_nan(name):
    fmt = get_format(name)
    m = fmt.max_value
    x = torch.tensor([m * 1.01, m * 1.2, 1e30, math.inf, -m * 1.01, -1e30, -math.inf, math.nan])
    out = fmt.round(x)
    assert out[:4].tolist() == [m] * 4
    assert out[4:7].tolist() == [-m] * 3
    assert math.isnan(out[7].item())
    # (torch's e4m3fn cast does not saturate -- beyond-range gives NaN -- which is why the oracle comparison
    # above casts the clamped value.)


# ------------------------------------------------------------------------------------------ FP6 / FP4 / NF4
@pytest.mark.parametrize("name", list(SMALL_FLOATS))
def test_small_float_codebooks_match_ocp_tables(name):
    fmt = get_format(name)
    assert torch.equal(fmt.codebook(), both_signs(SMALL_FLOATS[name]))
    assert fmt.max_value == max(SMALL_FLOATS[name])
    assert fmt.bits == {"fp4_e2m1": 4, "fp6_e2m3": 6, "fp6_e3m2": 6}[name]


@pytest.mark.parametrize("name", list(SMALL_FLOATS))
@SETTINGS
@given(data=st.data())
def test_small_float_round_is_nearest_even(name, data):
    fmt = get_format(name)
    xs = data.draw(float32_lists(fmt.max_value * 1.5))
    x = torch.tensor(xs, dtype=torch.float32)
    pos = torch.tensor(SMALL_FLOATS[name])
    assert torch.equal(fmt.round(x), nearest_float(x, pos))


@pytest.mark.parametrize("name", list(SMALL_FLOATS))
def test_small_float_midpoints_tie_to_even(name):
    fmt = get_format(name)
    pos = torch.tensor(SMALL_FLOATS[name])
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([mids, -mids])
    assert torch.equal(fmt.round(x), nearest_float(x, pos))
    if (
        name == "fp4_e2m1"
    ):  # spelled out: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
        assert fmt.round(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_nf4_codebook_is_the_published_qlora_table():
    fmt = get_format("nf4")
    assert fmt.kind == "lut" and fmt.bits == 4 and fmt.max_value == 1.0
    assert torch.equal(fmt.codebook(), torch.tensor(NF4_PUBLISHED, dtype=torch.float32))
    assert list(NF4_VALUES) == NF4_PUBLISHED


@SETTINGS
@given(xs=float32_lists(1.5))
def test_nf4_round_is_nearest_ties_down(xs):
    fmt = get_format("nf4")
    x = torch.tensor(xs, dtype=torch.float32)
    assert torch.equal(fmt.round(x), nearest_lut(x, fmt.codebook()))


def test_nf4_ties_go_to_the_lower_value():
    fmt = get_format("nf4")
    levels = torch.tensor(NF4_PUBLISHED[6:9])  # -0.091, 0, 0.0796
    ties = (levels[1:] + levels[:-1]) / 2  # float32 midpoints of these happen to be exact
    assert torch.equal((levels[1:].double() + levels[:-1].double()) / 2, ties.double())
    assert torch.equal(fmt.round(ties), levels[:-1])
    assert fmt.round(torch.tensor([5.0, -5.0, math.inf, -math.inf])).tolist() == [1.0, -1.0, 1.0, -1.0]
    assert math.isnan(fmt.round(torch.tensor([math.nan])).item())


# ------------------------------------------------------------------------------------------ integers
@pytest.mark.parametrize("bits", range(2, 9))
def test_int_formats_ranges(bits):
    sym, asym = int_format(bits), int_format(bits, symmetric=False)
    assert sym is get_format(f"int{bits}") and asym is get_format(f"uint{bits}")
    q = 2 ** (bits - 1) - 1
    assert sym.max_value == q and sym.min_value == -q
    assert torch.equal(sym.codebook(), torch.arange(-q, q + 1, dtype=torch.float32))
    assert asym.max_value == 2**bits - 1 and asym.min_value == 0
    assert torch.equal(asym.codebook(), torch.arange(0, 2**bits, dtype=torch.float32))
    big = torch.tensor([1e9, -1e9, math.inf, -math.inf])
    assert sym.round(big).tolist() == [q, -q, q, -q]
    assert asym.round(big).tolist() == [2**bits - 1, 0, 2**bits - 1, 0]


def test_int_round_half_to_even():
    fmt = get_format("int8")
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5])
    assert fmt.round(x).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 126.0, 127.0]
    assert math.isnan(fmt.round(torch.tensor([math.nan])).item())


@SETTINGS
@given(
    bits=st.integers(2, 8),
    xs=float32_lists(50.0),
    scale=st.floats(2.0**-10, 16.0, width=32),
)
def test_quantize_int_symmetric_error_and_idempotence(bits, xs, scale):
    x = torch.tensor(xs, dtype=torch.float32)
    q = quantize_int(x, scale, bits)
    qmax = 2 ** (bits - 1) - 1
    codes = q / scale
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= qmax + 1e-4
    inside = x.abs() <= qmax * scale
    err = (x - q).abs()[inside]
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-6 * x.abs()[inside]).all()
    assert torch.equal(quantize_int(q, scale, bits), q)


@SETTINGS
@given(bits=st.integers(2, 8), xs=float32_lists(50.0))
@example(bits=8, xs=[1.401298464324817e-45])  # a subnormal range: span / 255 underflowed to a 0 scale (NaN)
@example(bits=2, xs=[-1.401298464324817e-45, 0.0])
@example(bits=4, xs=[-1e-38, 2.8e-45])
@example(bits=6, xs=[2.942726775082116e-43])  # a subnormal step (4.2e-45 = 3 ulps) too coarse to cover it
def test_quantize_int_asymmetric_zero_point(bits, xs):
    x = torch.tensor(xs, dtype=torch.float32)
    scale, zp = minmax_scale_zero_point(x.min(), x.max(), bits)
    assert zp == zp.round() and 0 <= zp <= 2**bits - 1
    q = quantize_int(x, scale, bits, symmetric=False, zero_point=zp)
    codes = q / scale + zp
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert codes.min() >= -1e-3 and codes.max() <= 2**bits - 1 + 1e-3
    assert quantize_int(torch.zeros(1), scale, bits, symmetric=False, zero_point=zp).item() == 0.0
    # The range [min(x, 0), max(x, 0)] is covered: every value within half a step (+ the zero point's
    # rounding, at most half a step at the ends).
    assert ((x - q).abs() <= scale * (1 + 1e-4)).all()
    inside = (x >= (0 - zp) * scale) & (x <= (2**bits - 1 - zp) * scale)
    assert ((x - q).abs()[inside] <= scale / 2 * (1 + 1e-4)).all()
    assert torch.equal(quantize_int(q, scale, bits, symmetric=False, zero_point=zp), q)


@pytest.mark.parametrize(
    "xmin, xmax", [(0.0, 1.4e-45), (-1.4e-45, 0.0), (-3e-45, 3e-45), (0.0, 0.0), (0.0, 2.942726775082116e-43)]
)
def test_minmax_scale_of_a_subnormal_range_is_finite(xmin, xmax):
    """The bug behind a flaky property test: span / (2^b - 1) underflowed to 0 and the zero point became
    -xmin / 0 = NaN; such a range now gets scale 1 and quantizes to zeros."""
    for bits in (2, 4, 8):
        scale, zp = minmax_scale_zero_point(torch.tensor(xmin), torch.tensor(xmax), bits)
        assert scale.item() > 0 and math.isfinite(scale.item()) and math.isfinite(zp.item())
        x = torch.tensor([xmin, xmax])
        q = quantize_int(x, scale, bits, symmetric=False, zero_point=zp)
        assert torch.isfinite(q).all() and (q - x).abs().max() <= scale


def test_absmax_scale_of_a_subnormal_amax_is_one():
    assert absmax_scale(torch.tensor(1.4e-45), get_format("int8")).item() == 1.0


def test_quantize_int_asymmetric_example():
    x = torch.tensor([-1.0, 0.0, 0.5, 3.0])
    scale, zp = minmax_scale_zero_point(x.min(), x.max(), 2)  # 4 codes over [-1, 3]: step 4/3
    assert scale.item() == pytest.approx(4 / 3) and zp.item() == 1.0
    q = quantize_int(x, scale, 2, symmetric=False, zero_point=zp)
    assert torch.allclose(q, torch.tensor([-4 / 3, 0.0, 0.0, 8 / 3]))


def test_absmax_scale():
    fmt = get_format("int8")
    s = absmax_scale(torch.tensor([127.0, 0.0, 2.54]), fmt)
    assert s.tolist() == pytest.approx([1.0, 1.0, 0.02])
    assert absmax_scale(torch.tensor(6.0), "fp4_e2m1").item() == 1.0


# ------------------------------------------------------------------------------------------ all elements
@pytest.mark.parametrize("name", ELEMENT_FORMATS)
def test_every_element_format_is_idempotent_and_on_codebook(name):
    fmt = get_format(name)
    cb = fmt.codebook()
    assert torch.all(cb[1:] > cb[:-1]) and (cb == 0).sum() == 1 and cb.dtype == torch.float32
    assert cb.max().item() == fmt.max_value and cb.min().item() == fmt.min_value
    assert torch.equal(fmt.round(cb), cb)
    x = log_uniform(20_000, -14.0, math.log2(fmt.max_value) + 2, seed=3)
    y = fmt.round(x)
    assert y.dtype == torch.float32
    assert torch.isin(y, cb).all()
    assert torch.equal(fmt.round(y), y)


# ------------------------------------------------------------------------------------------ E8M0 and MX
def test_e8m0_round():
    x = torch.tensor([1.0, 1.5, 0.75, 3.0e-39, 1e-45, 0.0, -2.0, 3e38, math.inf])
    out = e8m0_round(x)
    assert out.tolist() == [1.0, 1.0, 0.5, 2.0**-127, 2.0**-127, 2.0**-127, 2.0**-127, 2.0**127, 2.0**127]
    assert math.isnan(e8m0_round(torch.tensor(math.nan)).item())
    # Agrees with the MX shared-exponent rule on random inputs: 2^floor(log2 x).
    y = log_uniform(10_000, -100, 100, seed=4).abs()
    assert torch.equal(e8m0_round(y), torch.exp2(torch.floor(torch.log2(y.double()))).float())


def test_e8m0_round_floors_float64_in_its_own_precision():
    # 8 (1 - 2^-40) is below 8; a cast to float32 first would round it to 8 and floor to 8 instead of 4.
    x = torch.tensor([8 * (1 - 2.0**-40), 8.0], dtype=torch.float64)
    assert e8m0_round(x).tolist() == [4.0, 8.0]


# ------------------------------------------------------------------------------------------ stored scales
def _ceil_pow2_exponent(x: float) -> int:
    """Reference for the E8M0 round-up: the least integer k with 2^k >= x, in exact rationals."""
    f = Fraction(x)
    k = f.numerator.bit_length() - f.denominator.bit_length()
    while Fraction(2) ** k < f:
        k += 1
    while Fraction(2) ** (k - 1) >= f:
        k -= 1
    return k


def _e8m0_up_reference(x: float) -> float:
    if math.isnan(x):
        return math.nan
    if x <= 0:
        return 2.0**-127
    if math.isinf(x):
        return 2.0**127
    return 2.0 ** min(127, max(-127, _ceil_pow2_exponent(x)))


def _e8m0_probe_values() -> tuple[list[float], list[float]]:
    """float32 and float64 inputs around every power of two, subnormals and both ends of the ranges."""
    f32, f64 = [], []
    for k in range(-149, 128):
        f32.append(math.ldexp(1.0, k))
        if k >= -126:  # 2^k (1 + 2^-23) and 2^k (1 - 2^-24): the float32 neighbours of a normal 2^k
            f32.append(math.ldexp(1 + 2.0**-23, k))
            if k > -126:
                f32.append(math.ldexp(1 - 2.0**-24, k))
        f64 += [math.ldexp(1 + 2.0**-52, k), math.ldexp(1 - 2.0**-53, k)]
    f32 += [math.ldexp(3.0, -149), math.ldexp(1.0, -127) + math.ldexp(1.0, -149), math.ldexp(1.5, -130)]
    f32 += [math.ldexp(2 - 2.0**-23, 127), math.ldexp(1 + 2.0**-23, 127), 0.0, -1.0, math.inf]
    f64 += [math.ldexp(1.0, 200), math.ldexp(1.0, -300), 5e-324, math.ldexp(1 + 2.0**-52, 127)]
    return f32, f64


def test_round_scale_e8m0_rounds_up_exactly():
    """A stored E8M0 scale is the least power of two >= amax / qmax: log2 in float32 rounds
    log2(2^k (1 + 2^-23)) to k and used to give 2^k, a scale that clips the tensor's max."""
    f32, f64 = _e8m0_probe_values()
    for dtype, values in ((torch.float32, f32), (torch.float64, f64)):
        x = torch.tensor(values, dtype=dtype)
        assert x.tolist() == values  # every probe is exact in its dtype
        got = round_scale(x, "e8m0")
        assert got.dtype == torch.float32
        assert got.tolist() == [_e8m0_up_reference(v) for v in values], dtype
    assert e8m0_round_up(torch.tensor(math.nan)).isnan()


def _e4m3_up_reference(x: float, grid: list[float]) -> float:
    """Least finite positive E4M3 value >= x (from torch's own float8_e4m3fn decoding), 448 above it."""
    if math.isnan(x):
        return math.nan
    return next((v for v in grid if v >= x), grid[-1])


def test_round_scale_fp8_e4m3_rounds_up_and_saturates():
    """Stored E4M3 scales: the least E4M3 value >= scale; above 448 (the largest finite value) they saturate
    to 448, never to the NaN code 0x7F; below the smallest subnormal 2^-9 they are 2^-9, never 0."""
    grid = sorted(v for v in fp8_values(torch.float8_e4m3fn).tolist() if v > 0)
    assert grid[0] == 2.0**-9 and grid[-1] == 448.0
    probes = [
        *grid,
        449.0,
        464.0,
        480.0,
        500.0,
        1e30,
        3.4e38,
        math.inf,
        2.0**-10,
        2.0**-10 * 1.5,
        1e-30,
        1e-45,
    ]
    for v in grid:  # both float32 neighbours of every value
        probes += [math.nextafter(v, 0.0), math.nextafter(v, math.inf)]
    probes = torch.tensor(probes, dtype=torch.float32).tolist()
    probes += log_uniform(5000, -14.0, 10.0, seed=9).abs().tolist()
    x = torch.tensor(probes, dtype=torch.float32)
    got = round_scale(x, "fp8_e4m3")
    assert torch.isfinite(got).all() and (got > 0).all()
    assert got.tolist() == [_e4m3_up_reference(v, grid) for v in x.tolist()]
    # the stored value is itself an E4M3 value: torch's round-to-nearest cast keeps it
    assert torch.equal(got.to(torch.float8_e4m3fn).float(), got)
    # end to end: huge and tiny tensors stay finite (the former clip at 448 * 127, as documented)
    scheme = Scheme(format="int8", scale_format="fp8_e4m3")
    big = torch.tensor([[1e5, -3e4, 10.0]])
    y = quantize_dynamic(big, scheme, ("batch", "channel"))
    assert torch.equal(y, torch.tensor([[448.0 * 127, -3e4 // 448 * 448, 0.0]]))
    tiny = torch.tensor([[1e-30, -1e-31, 0.0]])
    assert torch.equal(quantize_dynamic(tiny, scheme, ("batch", "channel")), torch.zeros(1, 3))


def test_block_format_table():
    bpe = {
        "mxfp8": 8.25, "mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6": 6.25, "mxfp6_e2m3": 6.25,
        "mxfp6_e3m2": 6.25, "mxfp4": 4.25, "mxint8": 8.25, "nvfp4": 4.5,
    }  # fmt: skip
    assert {n: f.bits_per_element for n, f in BLOCK_FORMATS.items()} == bpe
    assert BLOCK_FORMATS["mxfp8"] is BLOCK_FORMATS["mxfp8_e4m3"]
    assert BLOCK_FORMATS["mxfp6"] is BLOCK_FORMATS["mxfp6_e2m3"]
    elems = {n: f.element.name for n, f in BLOCK_FORMATS.items()}
    assert elems["mxfp4"] == "fp4_e2m1" and elems["nvfp4"] == "fp4_e2m1" and elems["mxfp8_e5m2"] == "fp8_e5m2"
    assert all(f.block == 32 and f.scale == "e8m0" for n, f in BLOCK_FORMATS.items() if n.startswith("mx"))
    assert BLOCK_FORMATS["nvfp4"].block == 16 and BLOCK_FORMATS["nvfp4"].scale == "e4m3"
    # emax_elem as tabulated in OCP MX v1.0.
    emax = {n: f.element.emax for n, f in BLOCK_FORMATS.items()}
    assert emax["mxfp8_e4m3"] == 8 and emax["mxfp8_e5m2"] == 15 and emax["mxfp6_e3m2"] == 4
    assert emax["mxfp6_e2m3"] == 2 and emax["mxfp4"] == 2 and emax["mxint8"] == 0
    assert isinstance(get_block_format("MXFP4"), BlockFormat)


def mx_input(seed: int, rows: int = 6, cols: int = 256) -> torch.Tensor:
    """Gaussian rows whose 32-blocks are scaled by 2^k, k in [-20, 20]: many shared exponents."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    k = torch.randint(-20, 21, (rows, cols // 32, 1), generator=g).float()
    return (x.view(rows, cols // 32, 32) * torch.exp2(k)).view(rows, cols)


@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_scales_elements_and_error(name):
    fmt = BLOCK_FORMATS[name]
    elem = fmt.element
    x = mx_input(seed=5)
    scales, elements = block_scales(x, fmt)
    assert scales.shape == (6, 8) and elements.shape == x.shape
    mant, _ = torch.frexp(scales)
    assert (mant == 0.5).all()  # powers of two
    assert ((scales >= 2.0**-127) & (scales <= 2.0**127)).all()
    assert torch.isin(elements, elem.codebook()).all()
    assert (elements.abs() <= elem.max_value).all()
    rep = scales.repeat_interleave(32, dim=-1)
    q = quantize_blocks(x, fmt)
    assert torch.equal(q, elements * rep)
    # Spec rule: amax / X lies in the element's top binade [2^emax, 2^(emax+1)).
    amax = x.abs().view(6, 8, 32).amax(-1)
    ratio = amax / scales
    assert ((ratio >= 2.0**elem.emax) & (ratio < 2.0 ** (elem.emax + 1))).all()
    # The block max loses at most half the top spacing, plus what saturation at max_value clips.
    cb = elem.codebook()
    half_top = (cb[-1] - cb[-2]).item() / 2
    qmax = q.abs().view(6, 8, 32).amax(-1)
    bound = scales * half_top + (amax - elem.max_value * scales).clamp(min=0)
    assert ((qmax - amax).abs() <= bound).all()
    # Every element: error at most half a step of the element format at its magnitude (coarsest: top).
    err = (x - q).abs()
    assert (err <= rep * half_top + (x.abs() - elem.max_value * rep).clamp(min=0)).all()


def test_mxfp4_values_on_codebook_times_scale_and_hand_example():
    x = mx_input(seed=6)
    scales, elements = block_scales(x, "mxfp4")
    q = quantize_blocks(x, "mxfp4")
    fp4 = both_signs(FP4_E2M1_POS)
    assert torch.isin(q / scales.repeat_interleave(32, -1), fp4).all()
    assert torch.isin(elements, fp4).all()
    # Hand example: amax 1.0 -> X = 2^(0 - 2) = 0.25; x / X = 4, 1.2, -2.6, 0.25 -> 4, 1, -3, 0 (tie to even).
    blk = torch.zeros(32)
    blk[:4] = torch.tensor([1.0, 0.3, -0.65, 0.0625])
    s, e = block_scales(blk, "mxfp4")
    assert s.tolist() == [0.25]
    assert e[:4].tolist() == [4.0, 1.0, -3.0, 0.0]
    # amax 1.9 -> X = 0.25, 1.9 / 0.25 = 7.6 saturates to 6: the spec's floor rule clips the top binade.
    blk[0] = 1.9
    assert quantize_blocks(blk, "mxfp4")[0].item() == 1.5


def test_mxint8_elements():
    fmt = BLOCK_FORMATS["mxint8"]
    assert fmt.element.max_value == 127 / 64 and fmt.element.step == 2.0**-6
    cb = fmt.element.codebook()
    assert torch.equal(cb, torch.arange(-127, 128, dtype=torch.float32) / 64)
    x = mx_input(seed=7)
    _, elements = block_scales(x, fmt)
    k = elements * 64
    assert torch.equal(k, k.round()) and k.abs().max() <= 127
    blk = torch.zeros(32)
    blk[:3] = torch.tensor([1.999, -1.999, 0.5])  # X = 2^0; 1.999 * 64 = 127.9 -> 128 -> saturates to 127
    s, e = block_scales(blk, fmt)
    assert s.item() == 1.0 and e[:3].tolist() == [127 / 64, -127 / 64, 0.5]


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.integers(0, 60), offset=st.integers(-140, 100))
def test_block_formats_idempotent(name, seed, spread, offset):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g)
    k = torch.randint(-spread, spread + 1, (4, 4, 1), generator=g).float().clamp(-120, 120)
    x = (x.view(4, 4, 16) * torch.exp2(k)).view(4, 64)
    if name != "nvfp4":
        x = x * 2.0 ** (offset / 2)  # reach E8M0's clamp at 2^-127 at the low end
        q = quantize_blocks(x, name)
        assert torch.equal(quantize_blocks(q, name), q)
    else:
        # NVFP4 is idempotent for a fixed tensor scale when the E4M3 block scales are normal numbers (the
        # block max then lands on 6 * s_b); blocks far below the tensor max get subnormal / zero scales.
        s_t = nvfp4_tensor_scale(x)
        q = quantize_blocks(x, name, tensor_scale=s_t)
        s_b, _ = block_scales(x, name, tensor_scale=s_t)
        normal = (s_b >= 2.0**-6).repeat_interleave(16, dim=-1)
        assert torch.equal(quantize_blocks(q, name, tensor_scale=s_t)[normal], q[normal])


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8_e5m2", "mxint8", "nvfp4"])
def test_block_dim_argument(name):
    x = torch.randn(64, 3, 32)
    ref = quantize_blocks(x.movedim(0, -1), name).movedim(-1, 0)
    assert torch.equal(quantize_blocks(x, name, dim=0), ref)
    assert torch.equal(quantize_blocks(x, name, dim=-3), ref)
    s, e = block_scales(x, name, dim=0)
    assert s.shape == (64 // BLOCK_FORMATS[name].block, 3, 32) and e.shape == x.shape


def test_block_zero_nan_inf():
    x = torch.zeros(2, 32)
    s, e = block_scales(x, "mxfp8")
    assert s.tolist() == [[1.0], [1.0]] and torch.equal(quantize_blocks(x, "mxfp8"), x)
    assert torch.equal(quantize_blocks(torch.zeros(2, 32), "nvfp4"), torch.zeros(2, 32))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(10))
    x[0, 3] = x[1, 5] = 0.0
    ref = quantize_blocks(x, "mxfp4")
    y = x.clone()
    y[0, 3] = math.nan
    y[1, 5] = math.inf
    out = quantize_blocks(y, "mxfp4")
    assert math.isnan(out[0, 3].item()) and torch.isfinite(out[1]).all()
    s, _ = block_scales(x, "mxfp4")
    assert out[1, 5].item() == 6.0 * s[1, 0].item()  # inf saturates to max * X; X from the finite values
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[0, 3] = keep[1, 5] = False
    assert torch.equal(out[keep], ref[keep])  # the neighbours are quantised as if the value were absent
    out = quantize_blocks(y.view(4, 16), "nvfp4")
    assert math.isnan(out[0, 3].item()) and torch.isfinite(out.view(2, 32)[1]).all()


def test_block_size_must_divide():
    msg = "block size 32 does not divide dimension 48 (size of dim -1)"
    with pytest.raises(DiffquantError, match=re.escape(msg)):
        quantize_blocks(torch.zeros(2, 48), "mxfp4")
    with pytest.raises(
        DiffquantError, match=re.escape("block size 16 does not divide dimension 40 (size of dim 1)")
    ):
        block_scales(torch.zeros(40, 40, 16), "nvfp4", dim=1)
    with pytest.raises(DiffquantError, match="dim 2 out of range"):
        quantize_blocks(torch.zeros(2, 32), "mxfp4", dim=2)
    with pytest.raises(DiffquantError, match="tensor_scale applies to nvfp4 only"):
        quantize_blocks(torch.zeros(2, 32), "mxfp4", tensor_scale=1.0)


# ------------------------------------------------------------------------------------------ NVFP4
def test_nvfp4_scales_are_e4m3_and_error_bounded():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(32, 128, generator=g) * torch.exp2(torch.randint(-4, 5, (32, 1), generator=g).float())
    s_t = nvfp4_tensor_scale(x)
    assert s_t.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    s_b, e = block_scales(x, "nvfp4")
    assert s_b.shape == (32, 8)
    assert torch.equal(s_b.to(torch.float8_e4m3fn).float(), s_b)  # E4M3-representable (torch oracle)
    assert s_b.max().item() == 448.0  # the block holding the tensor max uses the top block scale
    assert torch.isin(e, both_signs(FP4_E2M1_POS)).all()
    d = (s_b * s_t).repeat_interleave(16, dim=-1)
    q = quantize_blocks(x, "nvfp4")
    assert torch.equal(q, e * s_b.repeat_interleave(16, dim=-1) * s_t)
    # Per element: at most the top half-step of E2M1 (1.0) in units of the block's decode scale.
    assert ((x - q).abs() <= d * (1 + 1e-6)).all()
    # Relative to the block max (normal E4M3 scales round within 2^-4): error <= amax_b / 6 * (1 + 2^-4).
    amax_b = x.abs().view(32, 8, 16).amax(-1).repeat_interleave(16, dim=-1)
    assert ((x - q).abs() <= amax_b / 6 * (1 + 2.0**-4) * (1 + 1e-6)).all()
    rel = ((x - q).norm() / x.norm()).item()
    assert rel < 0.12


def test_nvfp4_tensor_scale_is_used():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    default = quantize_blocks(x, "nvfp4")
    assert torch.equal(quantize_blocks(x, "nvfp4", tensor_scale=nvfp4_tensor_scale(x)), default)
    # Hand example: tensor scale 1 and a block whose max is 6 -> block scale E4M3(6 / 6) = 1, elements = fp4(x).
    blk = torch.tensor([6.0, 2.2, -0.7, 0.2] + [0.0] * 12)
    s_b, e = block_scales(blk, "nvfp4", tensor_scale=1.0)
    assert s_b.tolist() == [1.0] and e[:4].tolist() == [6.0, 2.0, -0.5, 0.0]
    # A different tensor scale changes the stored block scale and the result.
    s_b2, _ = block_scales(blk, "nvfp4", tensor_scale=torch.tensor(0.01))
    assert s_b2.item() == get_format("fp8_e4m3").round(torch.tensor(6.0 / (6 * 0.01))).item()
    assert not torch.equal(quantize_blocks(x, "nvfp4", tensor_scale=nvfp4_tensor_scale(x) * 1.3), default)
    # Too small a tensor scale saturates the block scale at 448 and the elements at 6.
    s_b3, e3 = block_scales(blk, "nvfp4", tensor_scale=1e-4)
    assert s_b3.item() == 448.0 and e3[0].item() == 6.0
    assert quantize_blocks(blk, "nvfp4", tensor_scale=1e-4)[0].item() == pytest.approx(6 * 448 * 1e-4)
    for bad in (0.0, -1.0, math.nan, torch.ones(2)):
        with pytest.raises(DiffquantError, match="tensor_scale must be"):
            quantize_blocks(blk, "nvfp4", tensor_scale=bad)


# ------------------------------------------------------------------------------------------ bad input
def test_unknown_format_lists_valid_names():
    with pytest.raises(DiffquantError) as err:
        get_format("fp3")
    msg = str(err.value)
    assert "\n" not in msg and "'fp3'" in msg
    assert all(n in msg for n in ELEMENT_FORMATS)
    with pytest.raises(DiffquantError) as err:
        quantize_blocks(torch.zeros(32), "mxfp3")
    assert all(n in str(err.value) for n in BLOCK_FORMATS)


@pytest.mark.parametrize("bits", [1, 9, 0, 16])
def test_bits_out_of_range(bits):
    with pytest.raises(DiffquantError, match=re.escape(f"bits {bits} out of range 2..8")):
        int_format(bits)
    with pytest.raises(DiffquantError, match="out of range 2..8"):
        quantize_int(torch.zeros(3), 1.0, bits)


def test_quantize_int_zero_point_rules():
    with pytest.raises(DiffquantError, match="needs a zero_point"):
        quantize_int(torch.zeros(3), 1.0, 8, symmetric=False)
    with pytest.raises(DiffquantError, match="only applies to asymmetric"):
        quantize_int(torch.zeros(3), 1.0, 8, zero_point=3)
