"""diffquant.formats.minmax_params, the one rule for asymmetric min-max scales and zero points, against the
formula written out here in float64 (Python floats), in each of its conventions."""

from __future__ import annotations

import math

import pytest
import torch

from diffquant.formats import minmax_params

MIN_NORMAL = 2.0**-126


def reference(lo: float, hi: float, qmax: int, include_zero: bool, zero: str, clamp: bool, flush: bool):
    """The formula, one group at a time in float64: (scale, zero point)."""
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / qmax
    if zero == "min":
        return scale, lo
    if not (scale >= MIN_NORMAL if flush else scale > 0):  # NaN too
        scale = 1.0
    if zero == "float":
        return scale, -lo / scale
    z = float(round(-lo / scale))  # half to even, as torch.round
    return scale, min(max(z, 0.0), float(qmax)) if clamp else z


def groups() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (lo, hi): random ranges across zero, all positive, all negative, constant, zero, tiny."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, generator=g, dtype=torch.float64) * 3
    b = torch.randn(64, generator=g, dtype=torch.float64) * 3
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    lo[:8], hi[:8] = lo[:8].abs() + 0.25, hi[:8].abs() + 4.0  # all positive
    lo[8:16], hi[8:16] = -hi[8:16].abs() - 4.0, -lo[8:16].abs() - 0.25  # all negative
    lo[16], hi[16] = 1.5, 1.5  # constant
    lo[17], hi[17] = 0.0, 0.0
    lo[18], hi[18] = -1e-44, 1e-44  # span / qmax subnormal in float32
    lo[19], hi[19] = -0.5, 2.5  # at qmax 3: s = 1, -lo / s = 0.5, a tie (half to even: 0)
    lo[20], hi[20] = -1.0, 14.0  # s = 1 at qmax 15
    return lo, hi


CONVENTIONS = [
    # (include_zero, zero, clamp_zero, flush_subnormal): who uses it
    (True, "int", False, False),  # the GPTQ grid, schemes' per-element case
    (False, "int", False, False),  # schemes' reduced groups
    (True, "int", True, True),  # formats.minmax_scale_zero_point
    (False, "float", False, False),  # HQQ's initial zero
    (False, "min", False, False),  # the KV cache (KIVI)
]


@pytest.mark.parametrize("convention", CONVENTIONS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("qmax", [3, 15, 255])
def test_minmax_params_is_the_float64_formula(convention, qmax):
    include_zero, zero, clamp, flush = convention
    lo, hi = groups()
    # float64 inputs: the helper's float64 arithmetic is the formula's, bit for bit
    scale, zp = minmax_params(
        lo, hi, qmax, include_zero=include_zero, zero=zero, clamp_zero=clamp, flush_subnormal=flush
    )
    assert scale.dtype == zp.dtype == torch.float64
    for i in range(lo.numel()):
        want = reference(float(lo[i]), float(hi[i]), qmax, include_zero, zero, clamp, flush)
        assert (float(scale[i]), float(zp[i])) == want, (i, float(lo[i]), float(hi[i]))
    # float32 inputs: the same numbers up to float32 rounding (and a zero point that may round the other
    # way only where -lo / s sits on a tie)
    lo32, hi32 = lo.float(), hi.float()
    scale, zp = minmax_params(
        lo32, hi32, qmax, include_zero=include_zero, zero=zero, clamp_zero=clamp, flush_subnormal=flush
    )
    assert scale.dtype == zp.dtype == torch.float32
    for i in range(lo.numel()):
        s64, z64 = reference(float(lo32[i]), float(hi32[i]), qmax, include_zero, zero, clamp, flush)
        if 0 < abs(s64) < MIN_NORMAL:  # a subnormal float32 step has too few bits to compare (exact above)
            continue
        assert float(scale[i]) == pytest.approx(s64, rel=1e-6, abs=1e-45), i
        if zero == "int":
            raw = -min(float(lo32[i]), 0.0 if include_zero else math.inf) / s64
            if abs(raw % 1 - 0.5) > 1e-4:
                assert float(zp[i]) == z64, i
        else:
            assert float(zp[i]) == pytest.approx(z64, rel=1e-6, abs=1e-6), i


def test_minmax_params_conventions_on_their_edge_cases():
    lo = torch.tensor([0.5, 1.5, -1e-44, -3.0, float("nan")])
    hi = torch.tensor([2.0, 1.5, 1e-44, 1.0, 1.0])
    # 0 kept in the range: [0, 2] at 3 levels, step 2/3, zero 0; a constant 1.5 group: [0, 1.5]
    s, z = minmax_params(lo, hi, 3)
    assert s[0] == pytest.approx(2 / 3) and z[0] == 0 and s[1] == pytest.approx(0.5) and z[1] == 0
    # without it the positive group's zero point is negative (round(-0.5 / 0.5) = -1), the constant one's
    # scale 1 (and its zero -round(1.5) = -2: half to even)
    s, z = minmax_params(lo, hi, 3, include_zero=False)
    assert s[0] == 0.5 and z[0] == -1 and s[1] == 1 and z[1] == -2
    # a subnormal step: kept by the default rule, scale 1 with flush_subnormal
    s, _ = minmax_params(lo, hi, 3)
    assert 0 < s[2] < MIN_NORMAL
    s, _ = minmax_params(lo, hi, 3, flush_subnormal=True)
    assert s[2] == 1
    # clamp_zero keeps the zero point a code even for a range that does not reach 0
    _, z = minmax_params(lo, hi, 3, include_zero=False, clamp_zero=True)
    assert z[0] == 0
    # NaN: scale 1 (the rule replaces what is not positive), zero NaN
    s, z = minmax_params(lo, hi, 3)
    assert s[4] == 1 and math.isnan(float(z[4]))
    # "min": the group's min itself, and the raw scale (0 for a constant group)
    s, z = minmax_params(lo, hi, 3, include_zero=False, zero="min")
    assert torch.equal(z[:4], lo[:4]) and s[1] == 0 and s[0] == 0.5
    # "float": -lo / s unrounded
    s, z = minmax_params(lo, hi, 3, include_zero=False, zero="float")
    assert z[3] == pytest.approx(3.0 / (4.0 / 3))
