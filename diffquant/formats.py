"""Number formats: element codebooks (INT, FP8/FP6/FP4, NF4) and block formats (OCP MX, NVFP4).

Everything here is *fake* quantization: values are rounded onto a format's codebook and returned as float32,
so that the rest of the project can measure the error a format causes without packed storage or special
kernels. Rounding is exact to the codebook (checked against torch's own FP8 casts in the tests) and fully
vectorised in torch, on whatever device the input lives on.

Specifications followed:

* FP8 E4M3 / E5M2: OCP 8-bit Floating Point Specification (OFP8) rev. 1.0. E4M3 is the "fn" variant (bias 7,
  no infinities, the only NaN is S.1111.111, max 448); E5M2 is IEEE-like (bias 15, max normal 57344).
  Conversion is round-to-nearest-even in "saturating" mode: out-of-range values and +-inf go to +-max.
* FP6 E3M2 / E2M3 and FP4 E2M1: OCP Microscaling Formats (MX) Specification v1.0, section 5.3 (element
  types: no inf, no NaN, subnormals, biases 3 / 1 / 1, max 28 / 7.5 / 6).
* MX block formats: OCP MX v1.0, section 6.3 ("conversion from a vector of scalars"): 32 elements share an
  E8M0 scale X = 2^(floor(log2(max_i |V_i|)) - emax_elem); each element is V_i / X rounded to the element
  type, clamped to its max normal. E8M0 is an unsigned power of two 2^(e - 127), e in 0..254 (0xFF = NaN).
* MXINT8 elements (OCP MX v1.0, 5.3.3): 8-bit two's complement with an implicit scale 2^-6, i.e. k / 64.
  The encoding admits k = -128 (-2.0); we use the symmetric range k in [-127, 127] (max 1.984375, like
  Microsoft's ``microxcaling`` reference library), so the codebook is sign-symmetric and a block never
  quantises its negative maximum differently from its positive one. emax_elem = 0.
* NVFP4 (NVIDIA, Blackwell "NVFP4", as in TensorRT-ModelOpt / Transformer Engine): E2M1 elements, 16-element
  blocks with an E4M3 block scale, and an fp32 per-tensor scale; see :func:`quantize_blocks`.
* NF4: QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", appendix E), the 16
  NormalFloat quantiles normalised to [-1, 1], as shipped in bitsandbytes.

Naming: symmetric integers are ``int2`` .. ``int8`` (codes -(2^(b-1)-1) .. 2^(b-1)-1, the "restricted"
range, so absmax scaling is sign-symmetric); asymmetric integers are ``uint2`` .. ``uint8`` (codes 0 .. 2^b-1,
used with a zero point; see :func:`quantize_int` and :func:`minmax_scale_zero_point`).

Non-finite inputs: NaN stays NaN, +-inf saturates to +-max (of the element, times the block scale). Block
scales are computed from the finite values only, so one stray inf/NaN does not wipe out its block; the MX
spec would instead mark such a block NaN (X = NaN). This is a deliberate, documented deviation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from diffquant.errors import DiffquantError

__all__ = [
    "BLOCK_FORMATS",
    "ELEMENT_FORMATS",
    "NF4_VALUES",
    "BlockFormat",
    "ElementFormat",
    "absmax_scale",
    "block_scales",
    "e4m3_round_up",
    "e8m0_round",
    "e8m0_round_up",
    "get_block_format",
    "get_format",
    "int_format",
    "minmax_params",
    "minmax_scale_zero_point",
    "nvfp4_tensor_scale",
    "quantize_blocks",
    "quantize_int",
]

# QLoRA NF4 codebook (Dettmers et al. 2023; bitsandbytes ``get_4bit_type("nf4")``), ascending. These decimal
# strings are the float32 values bitsandbytes uses, written out exactly, so float32(v) reproduces them.
NF4_VALUES: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

E8M0_MIN_EXP = -127  # OCP MX v1.0: E8M0 encodes 2^-127 .. 2^127; 0xFF is NaN
E8M0_MAX_EXP = 127


# ------------------------------------------------------------------------------------------ bit helpers
def _exp2i(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^k for integer k in [-149, 127], built from the bit pattern.

    torch.pow / ldexp go through a float multiply that is exact on every backend we know, but building the
    bits leaves no doubt, and it covers float32 subnormals (E8M0's 2^-127 is one).
    """
    k = k.to(torch.int32).clamp(-149, 127)
    normal = (k + 127).clamp(min=1) << 23
    sub = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) as int32, exact for every finite non-zero float32 / float64 (subnormals included).

    frexp gives |x| = m * 2^e with m in [0.5, 1), so floor(log2 |x|) = e - 1; torch.log2 can round a value
    just below a power of two up to it. For 0, inf and NaN the result is meaningless: callers mask those.
    """
    return torch.frexp(x)[1].to(torch.int32) - 1


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with non-finite entries replaced by 0, so that amax ignores them (see the module docstring)."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise DiffquantError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not (x.is_floating_point() or x.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
        raise DiffquantError(f"expected a real-valued tensor, got dtype {x.dtype}")
    return x.to(torch.float32)


# ------------------------------------------------------------------------------------------ element formats
@dataclass(frozen=True)
class ElementFormat:
    """One scalar number format: a finite codebook plus the rounding rule onto it.

    ``round`` takes values already divided by the scale and returns float32 values on the codebook, so a
    scheme is always ``element.round(x / scale) * scale``; scale choice (per tensor, channel, block) lives
    elsewhere. Saturation instead of overflow keeps fake-quant finite, as real kernels do.

    Extra fields (defaults keep the four public ones first): ``signed`` (False for the unsigned ``uint*``
    codes used with a zero point), ``ebits``/``mbits`` (float formats), ``step`` (integer formats: the value
    of one code, 1 except MXINT8's 2^-6), ``levels`` (the LUT of ``kind == "lut"``).
    """

    name: str
    bits: int
    kind: str  # "int" | "float" | "lut"
    max_value: float
    signed: bool = True
    ebits: int = 0
    mbits: int = 0
    step: float = 1.0
    levels: tuple[float, ...] = ()

    # -- derived constants
    @property
    def min_value(self) -> float:
        """Most negative representable value: -max_value, or 0 for unsigned integer codes."""
        return -self.max_value if self.signed else 0.0

    @property
    def bias(self) -> int:
        """Exponent bias of a float format (2^(ebits-1) - 1: OCP e4m3 7, e5m2 15, e3m2 3, e2m3 1, e2m1 1)."""
        return (1 << (self.ebits - 1)) - 1 if self.kind == "float" else 0

    @property
    def emax(self) -> int:
        """Exponent of the largest normal, floor(log2 max_value): the MX spec's emax_elem.

        OCP MX v1.0 table: e4m3 8, e5m2 15, e3m2 4, e2m3 2, e2m1 2, int8 (k/64, max 1.98) 0.
        """
        return math.frexp(self.max_value)[1] - 1

    # -- rounding
    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Round ``x`` (in units of the scale) to the nearest codebook value, as float32.

        Floats: round-to-nearest-even at the element's mantissa precision, with subnormals. Ints: round half
        to even, then clamp to the code range. NF4: nearest value, an exact tie goes to the *lower* value
        (the one towards -inf), matching bitsandbytes' strict ``x > threshold`` decision tree. All kinds
        saturate (|x| beyond range, including +-inf, goes to the end of the range) and keep NaN.
        """
        x = _as_float32(x)
        if self.kind == "float":
            return self._round_float(x)
        if self.kind == "int":
            return self._round_int(x)
        return self._round_lut(x)

    def _round_float(self, x: torch.Tensor) -> torch.Tensor:
        # Saturate first (NaN passes through clamp); then |y| <= max_value, a codebook value, so rounding
        # (monotone) can never leave the range and no second clamp is needed.
        y = x.clamp(-self.max_value, self.max_value)
        # Quantum of |y|'s binade: 2^(e - mbits), with e at least the smallest normal exponent 1 - bias, which
        # is exactly the subnormal spacing. Scaling by a power of two is exact, and torch.round is RNE.
        e = _floor_log2(y).clamp(min=1 - self.bias, max=self.emax)
        return torch.round(y * _exp2i(self.mbits - e)) * _exp2i(e - self.mbits)

    def _round_int(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.min_value, self.max_value
        if self.step == 1.0:
            return torch.round(x).clamp(lo, hi)
        inv = 1.0 / self.step  # step is a power of two (MXINT8: 2^-6), so both products are exact
        return (torch.round(x * inv) * self.step).clamp(lo, hi)

    def _round_lut(self, x: torch.Tensor) -> torch.Tensor:
        levels = torch.tensor(self.levels, dtype=torch.float64, device=x.device)
        # Midpoints in float64 are exact for float32 levels, so "tie" means exactly half-way. bucketize with
        # right=False returns i with mids[i-1] < x <= mids[i]: a value equal to a midpoint goes down.
        mids = (levels[1:] + levels[:-1]) / 2
        idx = torch.bucketize(x.to(torch.float64), mids)
        out = levels.to(torch.float32)[idx]
        return torch.where(torch.isnan(x), x, out)

    # -- enumeration
    def codebook(self) -> torch.Tensor:
        """Every finite representable value, ascending, float32, with a single zero."""
        if self.kind == "lut":
            vals = set(self.levels)
        elif self.kind == "int":
            lo = round(self.min_value / self.step)
            hi = round(self.max_value / self.step)
            vals = {k * self.step for k in range(lo, hi + 1)}
        else:
            vals = set()
            for e in range(1 << self.ebits):
                for m in range(1 << self.mbits):
                    if e == 0:  # subnormal: 0.m * 2^(1 - bias)
                        v = math.ldexp(m, 1 - self.bias - self.mbits)
                    else:  # normal: 1.m * 2^(e - bias)
                        v = math.ldexp((1 << self.mbits) + m, e - self.bias - self.mbits)
                    if v <= self.max_value:  # drops e4m3's NaN code (480) and e5m2's inf/NaN exponent
                        vals.update((v, -v))
        # One zero, +0.0 (a set may keep either signed zero, since -0.0 == 0.0).
        vals = {v for v in vals if v != 0} | {0.0}
        return torch.tensor(sorted(vals), dtype=torch.float32)


def _float_format(name: str, ebits: int, mbits: int, max_value: float) -> ElementFormat:
    return ElementFormat(name, 1 + ebits + mbits, "float", max_value, ebits=ebits, mbits=mbits)


def _int(bits: int, symmetric: bool) -> ElementFormat:
    if symmetric:
        return ElementFormat(f"int{bits}", bits, "int", float((1 << (bits - 1)) - 1))
    return ElementFormat(f"uint{bits}", bits, "int", float((1 << bits) - 1), signed=False)


_ELEMENTS: dict[str, ElementFormat] = {}
for _b in range(2, 9):
    _ELEMENTS[f"int{_b}"] = _int(_b, True)
for _b in range(2, 9):
    _ELEMENTS[f"uint{_b}"] = _int(_b, False)
_ELEMENTS.update(
    {
        # OCP OFP8 rev 1.0: e4m3fn max 1.75 * 2^8 = 448 (S.1111.111 is NaN), e5m2 max 1.75 * 2^15 = 57344.
        "fp8_e4m3": _float_format("fp8_e4m3", 4, 3, 448.0),
        "fp8_e5m2": _float_format("fp8_e5m2", 5, 2, 57344.0),
        # OCP MX v1.0 sec. 5.3.1: e3m2 max 1.75 * 2^4 = 28, e2m3 max 1.875 * 2^2 = 7.5, e2m1 max 1.5 * 2^2 = 6.
        "fp6_e3m2": _float_format("fp6_e3m2", 3, 2, 28.0),
        "fp6_e2m3": _float_format("fp6_e2m3", 2, 3, 7.5),
        "fp4_e2m1": _float_format("fp4_e2m1", 2, 1, 6.0),
        "nf4": ElementFormat("nf4", 4, "lut", 1.0, levels=NF4_VALUES),
    }
)
del _b

ELEMENT_FORMATS: tuple[str, ...] = tuple(_ELEMENTS)

# MXINT8's element (OCP MX v1.0 5.3.3): two's complement k * 2^-6, symmetric k in [-127, 127] (see module
# docstring). Not a stand-alone element format (it only makes sense under an E8M0 block scale), so it is
# reachable as BLOCK_FORMATS["mxint8"].element rather than through get_format.
MXINT8_ELEMENT = ElementFormat("int8_mx", 8, "int", 127 / 64, step=2.0**-6)


def get_format(name: str | ElementFormat) -> ElementFormat:
    """The element format called ``name`` (an :class:`ElementFormat` passes through unchanged)."""
    if isinstance(name, ElementFormat):
        return name
    key = str(name).strip().lower()
    if key not in _ELEMENTS:
        raise DiffquantError(f"unknown number format {name!r}; valid formats: {', '.join(ELEMENT_FORMATS)}")
    return _ELEMENTS[key]


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise DiffquantError(f"bits {bits} out of range 2..8")
    return bits


def int_format(bits: int, symmetric: bool = True) -> ElementFormat:
    """``int{bits}`` (symmetric, codes +-(2^(b-1)-1)) or ``uint{bits}`` (asymmetric, codes 0..2^b-1)."""
    return _ELEMENTS[f"{'' if symmetric else 'u'}int{_check_bits(bits)}"]


# ------------------------------------------------------------------------------------------ scalar helpers
_MIN_NORMAL = float(torch.finfo(torch.float32).tiny)  # 2^-126: below it float32 steps lose precision


def absmax_scale(amax: torch.Tensor | float, fmt: ElementFormat | str) -> torch.Tensor:
    """Scale mapping ``amax`` onto the format's largest magnitude: amax / max_value.

    amax == 0 (an all-zero tensor / channel / block) gives scale 1 so that callers never divide by zero;
    the quantised values are zeros either way.
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = amax / fmt.max_value
    # 0, or a subnormal step (float32 keeps < 23 bits there, so scale * max_value may fall short of amax):
    # scale 1, and such values quantize to 0
    return torch.where(scale >= _MIN_NORMAL, scale, torch.ones_like(scale))


def minmax_params(
    lo: torch.Tensor,
    hi: torch.Tensor,
    qmax: float,
    *,
    include_zero: bool = True,
    zero: Literal["int", "float", "min"] = "int",
    clamp_zero: bool = False,
    flush_subnormal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization parameters: the scale ``s = (hi - lo) / qmax`` that maps each group's
    range onto the codes ``0 .. qmax`` (``2^b - 1`` for b bits), and its zero point. ``lo`` / ``hi`` are the
    min / max of each group, reduced by the caller over the group's dims (masked, split into views or over the
    whole tensor, as it needs); the arithmetic runs elementwise in their dtype. A scale that is not positive
    (a constant group, 0 / 0, NaN) becomes 1. The one rule of every asymmetric quantizer; where their
    conventions differ, a parameter names the difference:

    * ``include_zero``: widen the range to ``[min(lo, 0), max(hi, 0)]`` so that 0 is exactly a code (code ==
      zero point): the GPTQ grid (:meth:`diffquant.quant.weightcodes.WeightGrid.params`, as the reference
      GPTQ quantizer), :func:`minmax_scale_zero_point` (PyTorch observers, ONNX) and the per-element case of
      :func:`diffquant.quant.schemes.asymmetric_params`. False keeps ``[lo, hi]``: HQQ's initial zero (then
      optimised), the KV cache (KIVI stores the group's min), and the reduced groups of ``asymmetric_params``
      (invalid entries already masked to 0 by it).
    * ``zero``: ``"int"``, ``round(-lo / s)`` (half to even), an integer code: the GPTQ grid, the rule
      schemes' ``uint`` activations, :func:`minmax_scale_zero_point`. ``"float"``, ``-lo / s`` unrounded: HQQ,
      whose zero point is a float it optimises (0 need not be on its grid). ``"min"``, ``lo`` itself, in
      value units (``x_hat = code * s + lo``), with the scale as computed (0 for a constant group: the caller
      divides by a safe copy and stores the 0): the KV cache (KIVI / quanto's ``MaxOptimizer`` layout).
    * ``clamp_zero``: clamp the integer zero point to ``0 .. qmax`` (a zero point is a code):
      :func:`minmax_scale_zero_point`, the public helper whose callers may pass any range.
    * ``flush_subnormal``: scales below float32's smallest normal number (2^-126) become 1 too (too few bits
      for ``s * qmax`` to cover the span; the values quantize to 0): :func:`minmax_scale_zero_point`, as
      :func:`absmax_scale` does.
    """
    if include_zero:
        origin = torch.zeros((), dtype=lo.dtype, device=lo.device)
        lo, hi = torch.minimum(lo, origin), torch.maximum(hi, origin)
    scale = (hi - lo) / qmax
    if zero == "min":
        return scale, lo
    usable = scale >= _MIN_NORMAL if flush_subnormal else scale > 0
    scale = torch.where(usable, scale, torch.ones_like(scale))
    if zero == "float":
        return scale, -lo / scale
    zero_point = torch.round(-lo / scale)
    return scale, zero_point.clamp(0, qmax) if clamp_zero else zero_point


def minmax_scale_zero_point(
    xmin: torch.Tensor | float, xmax: torch.Tensor | float, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (``uint{bits}``) scale and integer zero point covering [xmin, xmax].

    The range is widened to include 0 so that zero is exactly representable (code == zero point), the usual
    convention (PyTorch observers, ONNX). scale = (xmax - xmin) / (2^b - 1), 1 for an empty range;
    zero_point = round(-xmin / scale) clamped to the codes, returned as an integer-valued float32 tensor.
    A range whose step span / (2^b - 1) is below float32's smallest normal number (subnormal: too few bits for
    scale * (2^b - 1) to cover the span, or 0) also gets scale 1; its values quantize to 0.
    """
    qmax = float((1 << _check_bits(bits)) - 1)
    lo = torch.as_tensor(xmin, dtype=torch.float32)
    hi = torch.as_tensor(xmax, dtype=torch.float32)
    # An empty range, or one so small that span / qmax is subnormal (imprecise: 3 ulps of 1.4e-45 cannot
    # cover the span) or underflows to 0 (the zero point -lo / 0 would be NaN), gets scale 1.
    return minmax_params(lo, hi, qmax, clamp_zero=True, flush_subnormal=True)


def quantize_int(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    bits: int,
    symmetric: bool = True,
    zero_point: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Fake-quantise ``x`` to ``bits``-bit integers with a given (broadcastable) scale; returns float32.

    Symmetric: q = clamp(round(x / s), +-(2^(b-1)-1)), out = q * s. Asymmetric: q = clamp(round(x / s) + z,
    0, 2^b - 1), out = (q - z) * s, where z (integer valued, broadcastable) is required -- see
    :func:`minmax_scale_zero_point`. A zero scale is treated as 1 (as :func:`absmax_scale` would give).
    Rounding is half-to-even.
    """
    fmt = int_format(bits, symmetric)
    x = _as_float32(x)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    s = torch.where(s == 0, torch.ones_like(s), s)
    if symmetric:
        if zero_point is not None:
            raise DiffquantError("a zero_point only applies to asymmetric quantization (symmetric=False)")
        return fmt.round(x / s) * s
    if zero_point is None:
        raise DiffquantError("asymmetric quantize_int needs a zero_point (see minmax_scale_zero_point)")
    z = torch.as_tensor(zero_point, dtype=torch.float32, device=x.device)
    return (fmt.round(torch.round(x / s) + z) - z) * s


def _scale_input(x: torch.Tensor | float) -> torch.Tensor:
    """``x`` as a float tensor that holds it exactly: float64 (and Python floats) in float64, else float32.

    The scale roundings below decide from the input's own exponent and mantissa bits, so a float64 value just
    above a power of two must not be rounded to float32 first (that could land on the power of two itself).
    """
    if not isinstance(x, torch.Tensor):
        return torch.tensor(x, dtype=torch.float64)
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def e8m0_round(x: torch.Tensor | float) -> torch.Tensor:
    """Power-of-two scale 2^floor(log2 x) clamped to E8M0's range [2^-127, 2^127], as float32.

    This is the MX rule (OCP MX v1.0 sec. 6.3): the shared exponent is the floor of log2 of its argument, so
    ``e8m0_round(amax / 2^emax_elem)`` is the block scale X. E8M0 has no zero and no sign: x <= 0 maps to the
    smallest scale 2^-127, +inf to 2^127, NaN to NaN (E8M0's 0xFF). The floor is exact (frexp of the input
    in its own precision, float64 kept), never log2.
    """
    x = _scale_input(x)
    k = _floor_log2(x).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    k = torch.where(x > 0, k, torch.full_like(k, E8M0_MIN_EXP))
    k = torch.where(x == math.inf, torch.full_like(k, E8M0_MAX_EXP), k)
    out = _exp2i(k)
    return torch.where(torch.isnan(x), x.to(out.dtype), out)


def e8m0_round_up(x: torch.Tensor | float) -> torch.Tensor:
    """Smallest power of two >= x, clamped to E8M0's range [2^-127, 2^127], as float32.

    The rule for a scale that must keep amax / scale inside the element range (a per-tensor / channel scale
    ``amax / qmax`` stored as E8M0), unlike the MX block rule of :func:`e8m0_round`, which floors on purpose.
    Exact for every float32 / float64 input: with frexp's x = m * 2^e, m in [0.5, 1), the answer is
    2^(e - 1) when m == 0.5 (x is a power of two) and 2^e otherwise. (exp2(ceil(log2 x)) is not: float32 log2
    rounds log2(2^k (1 + 2^-23)) to exactly k, giving 2^k < x.) Saturating ends: x > 2^127 (and +inf) give
    2^127, x <= 2^-127 (0 and negatives included) give 2^-127, never 0; NaN stays NaN.
    """
    x = _scale_input(x)
    mantissa, exponent = torch.frexp(x)
    k = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
    k = k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    k = torch.where(x > 0, k, torch.full_like(k, E8M0_MIN_EXP))
    k = torch.where(x == math.inf, torch.full_like(k, E8M0_MAX_EXP), k)
    out = _exp2i(k)
    return torch.where(torch.isnan(x), x.to(out.dtype), out)


def e4m3_round_up(x: torch.Tensor | float) -> torch.Tensor:
    """Smallest FP8 E4M3 value >= x (OCP OFP8 rev 1.0, e4m3fn), saturating to [2^-9, 448], as float32.

    For a scale stored in E4M3: rounding up keeps amax / scale inside the element range. Within a binade
    [2^e, 2^(e+1)), e in [-6, 8] (subnormals: e = -6), E4M3 values are spaced 2^(e-3), so the answer is
    ceil(x / 2^(e-3)) * 2^(e-3) (both products by powers of two are exact; a carry lands on 2^(e+1), itself a
    value). Ends: x > 448 (the largest finite value; 480 would be the NaN code S.1111.111) and +inf saturate
    to 448, as a saturating conversion does; x below the smallest subnormal 2^-9 (0 and negatives included)
    gives 2^-9, never 0. NaN stays NaN.
    """
    x = _scale_input(x)
    fmt = _ELEMENTS["fp8_e4m3"]
    e = _floor_log2(x).clamp(1 - fmt.bias, fmt.emax)
    up = torch.ceil(x * _exp2i(fmt.mbits - e).to(x.dtype)) * _exp2i(e - fmt.mbits).to(x.dtype)
    smallest = math.ldexp(1.0, 1 - fmt.bias - fmt.mbits)  # 2^-9
    return up.clamp(smallest, fmt.max_value).to(torch.float32)  # +inf -> 448; clamp keeps NaN


# ------------------------------------------------------------------------------------------ block formats
@dataclass(frozen=True)
class BlockFormat:
    """Elements sharing one scale per ``block`` consecutive values (OCP MX, NVIDIA NVFP4).

    ``scale`` names the scale's own format: "e8m0" (MX: a power of two) or "e4m3" (NVFP4: an FP8 value,
    times an fp32 per-tensor scale). ``bits_per_element`` counts the amortised scale bits (NVFP4's single
    fp32 tensor scale is negligible and not counted).
    """

    name: str
    element: ElementFormat
    block: int
    scale: str  # "e8m0" | "e4m3"
    bits_per_element: float


def _mx(name: str, element: ElementFormat) -> BlockFormat:
    return BlockFormat(name, element, 32, "e8m0", element.bits + 8 / 32)


_MXFP8_E4M3 = _mx("mxfp8_e4m3", _ELEMENTS["fp8_e4m3"])
_MXFP6_E2M3 = _mx("mxfp6_e2m3", _ELEMENTS["fp6_e2m3"])
# Aliases ("mxfp8", "mxfp6") map to the same object, so .name is always the canonical spelling.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    "mxfp8": _MXFP8_E4M3,
    "mxfp8_e4m3": _MXFP8_E4M3,
    "mxfp8_e5m2": _mx("mxfp8_e5m2", _ELEMENTS["fp8_e5m2"]),
    "mxfp6": _MXFP6_E2M3,
    "mxfp6_e2m3": _MXFP6_E2M3,
    "mxfp6_e3m2": _mx("mxfp6_e3m2", _ELEMENTS["fp6_e3m2"]),
    "mxfp4": _mx("mxfp4", _ELEMENTS["fp4_e2m1"]),
    "mxint8": _mx("mxint8", MXINT8_ELEMENT),
    "nvfp4": BlockFormat("nvfp4", _ELEMENTS["fp4_e2m1"], 16, "e4m3", 4 + 8 / 16),
}

_E4M3 = _ELEMENTS["fp8_e4m3"]
_NVFP4_DENOM = _E4M3.max_value * _ELEMENTS["fp4_e2m1"].max_value  # 448 * 6


def get_block_format(name: str | BlockFormat) -> BlockFormat:
    """The block format called ``name`` (a :class:`BlockFormat` passes through unchanged)."""
    if isinstance(name, BlockFormat):
        return name
    key = str(name).strip().lower()
    if key not in BLOCK_FORMATS:
        raise DiffquantError(f"unknown block format {name!r}; valid formats: {', '.join(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[key]


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's default fp32 tensor scale amax(|x|) / (448 * 6), 1 for an all-zero tensor (0-dim float32).

    It maps the tensor's largest magnitude onto the top of the two-level range: E4M3's max block scale times
    E2M1's max element (TensorRT-ModelOpt's "global scale"). Non-finite values are ignored.
    """
    amax = _finite_abs(_as_float32(x)).amax() if x.numel() else torch.zeros(())
    return torch.where(amax > 0, amax / _NVFP4_DENOM, torch.ones_like(amax))


def _to_blocks(x: torch.Tensor, block: int, dim: int) -> tuple[torch.Tensor, int]:
    """View ``x`` as (..., n_blocks, block) along ``dim``; returns the view and the normalised dim."""
    if x.dim() == 0:
        raise DiffquantError("cannot quantize a 0-dim tensor in blocks")
    if not -x.dim() <= dim < x.dim():
        raise DiffquantError(f"dim {dim} out of range for a tensor with {x.dim()} dims")
    d = dim % x.dim()
    size = x.shape[d]
    if size % block:
        raise DiffquantError(f"block size {block} does not divide dimension {size} (size of dim {dim})")
    moved = x.movedim(d, -1)
    return moved.reshape(*moved.shape[:-1], size // block, block), d


def _block_quant(
    x: torch.Tensor, fmt: BlockFormat | str, dim: int, tensor_scale: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Size]:
    """Core of the block formats: (scales (..., nb, 1), elements (..., nb, block), tensor scale, dim, shape)."""
    fmt = get_block_format(fmt)
    x = _as_float32(x)
    xb, d = _to_blocks(x, fmt.block, dim)
    amax = _finite_abs(xb).amax(dim=-1, keepdim=True)
    elem = fmt.element
    if fmt.scale == "e8m0":
        if tensor_scale is not None:
            raise DiffquantError(f"tensor_scale applies to nvfp4 only, not {fmt.name}")
        # OCP MX v1.0 sec. 6.3: X = 2^(floor(log2 amax) - emax_elem), clamped to E8M0's range. Computed from
        # the exponent directly (not e8m0_round(amax / 2^emax)) so that no division can round near 2^-127.
        k = (_floor_log2(amax) - elem.emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        scales = torch.where(amax > 0, _exp2i(k), torch.ones_like(amax))  # all-zero block: scale 1
        # X is a power of two and amax / X < 2^(emax+1), so x / X is exact; element.round saturates the part
        # of the top binade beyond max_value (e.g. fp4 values in (6, 8) * X go to 6 * X), as the spec does.
        elements = elem.round(xb / scales)
        return scales, elements, None, d, x.shape
    # NVFP4: s_t (fp32) = amax(tensor) / (448 * 6) unless given; s_b = E4M3(amax_block / (6 * s_t)), rounded
    # to nearest even and saturating at 448; elements = E2M1(x / (s_b * s_t)). Because s_b is rounded to
    # nearest (not up), a block max can exceed 6 * s_b * s_t by up to ~6 % and saturates to 6, the same
    # choice as TensorRT-ModelOpt's reference. A block whose scale rounds to 0 (its max is below 2^-10 of
    # 6 * s_t) quantises to zeros.
    if tensor_scale is None:
        s_t = nvfp4_tensor_scale(x).to(x.device)
    else:
        s_t = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device)
        if s_t.numel() != 1:
            raise DiffquantError(f"tensor_scale must be a single number, got shape {tuple(s_t.shape)}")
        s_t = s_t.reshape(())
        if not bool(torch.isfinite(s_t)) or float(s_t) <= 0:
            raise DiffquantError(f"tensor_scale must be a positive finite number, got {float(s_t)}")
    scales = _E4M3.round(amax / (elem.max_value * s_t))
    denom = scales * s_t
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom > 0, xb / safe, torch.where(torch.isnan(xb), xb, torch.zeros_like(xb)))
    return scales, elem.round(scaled), s_t, d, x.shape


def _from_blocks(y: torch.Tensor, d: int, shape: torch.Size) -> torch.Tensor:
    moved = y.reshape(*y.shape[:-2], -1)
    return moved.movedim(-1, d).reshape(shape)


def quantize_blocks(
    x: torch.Tensor,
    fmt: BlockFormat | str,
    dim: int = -1,
    tensor_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantise ``x`` in blocks of ``fmt.block`` consecutive elements along ``dim``; float32 out.

    MX: out = element.round(x / X) * X per block (exact: X is a power of two). NVFP4: out = (elements * s_b)
    * s_t, where ``tensor_scale`` overrides the default s_t = amax(x) / (448 * 6) (pass a calibrated value to
    quantise activations with a static tensor scale). Quantising the output again returns it unchanged.
    """
    scales, elements, s_t, d, shape = _block_quant(x, fmt, dim, tensor_scale)
    out = elements * scales  # exact: <= 4 significant bits times an E4M3 (4 bits) or a power of two
    if s_t is not None:
        out = out * s_t
    return _from_blocks(out, d, shape)


def block_scales(
    x: torch.Tensor,
    fmt: BlockFormat | str,
    dim: int = -1,
    tensor_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales, elements) of ``x`` in ``fmt``, for tests and inspection.

    ``scales`` is float32 with the shape of ``x`` except that ``dim`` has size n_blocks = size / block; it
    holds the *stored* scale: the E8M0 power of two for MX, the E4M3 block scale s_b for NVFP4 (without the
    tensor scale; get that from :func:`nvfp4_tensor_scale` or the value you passed). ``elements`` has the
    shape of ``x`` and holds codebook values, so
    ``quantize_blocks(x) == elements * scales.repeat_interleave(block, dim) [* s_t]``.
    """
    scales, elements, _, d, shape = _block_quant(x, fmt, dim, tensor_scale)
    return scales.squeeze(-1).movedim(-1, d), _from_blocks(elements, d, shape)
