"""HQQ (diffquant.quant.hqq) against optimum-quanto's HqqOptimizer, against round-to-nearest, and on its own
stopping rule.

optimum-quanto (``optimum.quanto.tensor.optimizers.HqqOptimizer``, an adaptation of mobiusml/hqq) is an
independent implementation of the same algorithm: min/max init, then the half-quadratic zero update with the
scale fixed, beta *= kappa after each accepted update, and a stop at the first update whose mean |W - W_r|
(over the whole weight) does not decrease, keeping the best shift. Its storage differs from ours:

    quanto:  q = clamp(round((W + shift) / s), 0, 2^b - 1),  W_r = q * s - shift   (a float shift)
    ours:    q = clamp(round(W / s + z), 0, 2^b - 1),        W_r = (q - z) * s

so z = shift / s and the scales are the same (quanto's MaxOptimizer: s = (max - min) / (2^b - 1),
shift = -min, i.e. z = -min / s, our init). Its zero update mean(q s - (W - W_e)) is s * ours. The only
difference left is float rounding (W / s + z versus (W + shift) / s), hence the tolerances below. Quanto's
bit-packed weights exist for 2 and 4 bits only, so 3 bits is not cross-checked.
"""

from __future__ import annotations

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.quant.hqq import hqq_codes
from diffquant.quant.weightcodes import GroupCodes, WeightGrid, rtn_codes


def student_t(shape: tuple[int, int], df: int, seed: int) -> torch.Tensor:
    """Student-t(df) samples: a normal over the root of a chi-square(df) / df (seeded generator only)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((df, *shape), generator=g).pow(2).sum(0)
    return z / (chi2 / df).sqrt()


def heavy(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Student-t(3) with a few large outliers (as in LLM weights: a few columns far outside the bulk)."""
    w = student_t(shape, 3, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    rows = torch.randint(0, shape[0], (4,), generator=g)
    cols = torch.randint(0, shape[1], (4,), generator=g)
    w[rows, cols] = torch.tensor([25.0, -30.0, 40.0, -20.0])
    return w


def gaussian(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def mean_abs(w: torch.Tensor, c: GroupCodes) -> float:
    return float((w - c.dequantize(w.dtype)).abs().mean())


def lp_obj(w: torch.Tensor, c: GroupCodes, p: float = 0.7) -> float:
    """The l_p^p error HQQ's splitting minimises (per element mean)."""
    return float((w - c.dequantize(w.dtype)).abs().pow(p).mean())


# ----------------------------------------------------------------------------------- optimum-quanto


def quanto_hqq(
    w: torch.Tensor, bits: int, group: int | None, **kw: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quanto's (scale, shift) [rows, 1], codes [out, in] and dequantized weight for ``w``."""
    from optimum.quanto import qint2, qint4
    from optimum.quanto.tensor.optimizers import HqqOptimizer
    from optimum.quanto.tensor.weights import quantize_weight

    qtype = {2: qint2, 4: qint4}[bits]
    scale, shift = HqqOptimizer(**kw)(w, qtype, axis=0, group_size=group)
    qw = quantize_weight(w, qtype, axis=0, scale=scale, shift=shift, group_size=group, optimized=False)
    codes = qw._data.reshape(w.shape)
    return scale, shift, codes, qw.dequantize()


CASES = {
    # name: (weight, bits, group, settings); settings use the same names in both implementations
    "gauss-4b-g64": (lambda: gaussian((64, 256), 0), 4, 64, {}),
    "heavy-4b-g64": (lambda: heavy((64, 256), 1), 4, 64, {}),
    "heavy-2b-g64": (lambda: heavy((64, 256), 2), 2, 64, {}),
    "heavy-4b-channel": (lambda: heavy((32, 128), 3), 4, None, {}),
    "heavy-4b-l1": (
        lambda: heavy((64, 256), 4),
        4,
        64,
        {"lp_norm": 1.0, "beta": 3.0, "kappa": 1.05, "iters": 10},
    ),
    "heavy-2b-kappa": (lambda: heavy((64, 256), 5), 2, 64, {"lp_norm": 0.5, "beta": 20.0, "kappa": 1.2}),
    # groups all of one sign: HQQ's init is the plain min/max (0 need not be in the range), unlike the GPTQ grid
    "positive-4b-g64": (lambda: gaussian((64, 256), 6).abs() + 0.5, 4, 64, {}),
    # a small weight on which the stop fires after a few updates (checked below), so the stopping rules
    # are compared too
    "t3-4b-stops": (lambda: student_t((4, 64), 3, 6), 4, 64, {"iters": 30}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_quanto_hqq_optimizer(name: str) -> None:
    make, bits, group, kw = CASES[name]
    w = make()
    ours = hqq_codes(w, WeightGrid(bits, group, False), **kw)
    scale, shift, qcodes, qdeq = quanto_hqq(w, bits, group, **kw)
    # same scales (both min/max), zero = shift / scale
    torch.testing.assert_close(ours.scale.reshape(-1, 1), scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.zero.reshape(-1, 1), shift / scale, rtol=0, atol=1e-4)
    # identical codes (allow 0.1% flips from float rounding at .5 ties) and dequantized weights within 1e-5
    same = (ours.codes == qcodes).float().mean().item()
    assert same >= 0.999, f"{name}: only {same:.4%} of the codes agree with quanto's"
    rel = float((ours.dequantize() - qdeq).norm() / qdeq.norm())
    assert rel < 1e-5, f"{name}: relative Frobenius difference {rel:.2e} from quanto"
    # HQQ moved the zero points away from the min/max init in every case
    init = hqq_codes(w, WeightGrid(bits, group, False), iters=0)
    assert float((ours.zero - init.zero).abs().max()) > 1e-3


def test_stop_case_stops() -> None:
    """The "t3-4b-stops" case ends early: running all 30 updates gives other zero points."""
    make, bits, group, kw = CASES["t3-4b-stops"]
    w = make()
    grid = WeightGrid(bits, group, False)
    stopped = hqq_codes(w, grid, **kw)
    full = hqq_codes(w, grid, early_stop=False, **kw)
    assert not torch.equal(stopped.zero, full.zero)


# ----------------------------------------------------------------------------------- the stopping rule


@pytest.mark.parametrize("cols", [64, 96])
def test_early_stop_keeps_best(cols: int) -> None:
    """With early_stop, the result is the run of k - 1 updates where update k is the first not to lower the
    mean |W - W_r|: the best zero points, not those of the failed update. At 96 columns (group 64 and a
    partial 32) the rule is over the whole weight: on this one the full groups alone would never stop."""
    w = student_t((4, cols), 3, {64: 6, 96: 2}[cols])
    grid = WeightGrid(4, 64, False)
    runs = [hqq_codes(w, grid, iters=k, early_stop=False) for k in range(31)]
    errs = [mean_abs(w, c) for c in runs]
    k = next(i for i in range(1, 31) if not errs[i] < errs[i - 1])
    assert 2 <= k < 30
    assert errs[k] > errs[k - 1] * (1 + 1e-4)  # a real increase, not float noise
    stopped = hqq_codes(w, grid, iters=30)
    assert torch.equal(stopped.zero, runs[k - 1].zero)
    assert torch.equal(stopped.codes, runs[k - 1].codes)
    assert mean_abs(w, stopped) == errs[k - 1] < errs[0]


# ----------------------------------------------------------------------------------- against round-to-nearest


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_improves_on_minmax_init(bits: int, seed: int) -> None:
    """HQQ lowers mean |W - W_r| and the l_p objective from its own min/max start (iters=0) at every width."""
    w = heavy((64, 256), seed)
    grid = WeightGrid(bits, 64, False)
    init, c = hqq_codes(w, grid, iters=0), hqq_codes(w, grid)
    assert mean_abs(w, c) < 0.99 * mean_abs(w, init)
    assert lp_obj(w, c) < 0.99 * lp_obj(w, init)


RTN_CASES = [
    # HQQ against round-to-nearest on the same asymmetric grid (rtn_codes, sym false: integer zero point,
    # so 0 is a level). Measured ratios HQQ / RTN of mean |W - W_r| over 10 seeds of 64 x 256, group 64:
    #   Student-t(3) (with or without outliers): 4 bits 0.92 - 0.98, 3 bits 0.95 - 1.03, 2 bits 1.08 - 1.17;
    #   Student-t(5): 3 bits 0.92 - 0.93, 2 bits 0.99 - 1.01;   Gaussian: 0.90 - 0.94 at 2, 3 and 4 bits.
    # So HQQ wins only where the bulk of the group fills the range. With few levels across an
    # outlier-stretched range, RTN's integer zero puts a level exactly on 0, where most of the group is,
    # while HQQ starts from the float min/max zero (levels straddling 0) and its small half-quadratic steps
    # do not close that gap in 20 iterations. The cases below are those with a clear margin; on heavy tails
    # at 2 and 3 bits, test_improves_on_minmax_init checks HQQ against its own start instead.
    (heavy, 4),
    (lambda shape, seed: student_t(shape, 3, seed), 4),
    (lambda shape, seed: student_t(shape, 5, seed), 3),
    (gaussian, 2),
    (gaussian, 3),
]


@pytest.mark.parametrize("case", range(len(RTN_CASES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beats_rtn(case: int, seed: int) -> None:
    make, bits = RTN_CASES[case]
    w = make((64, 256), seed + 10)
    grid = WeightGrid(bits, 64, False)
    rtn = rtn_codes(w, grid, dtype=torch.float32)
    c = hqq_codes(w, grid)
    assert mean_abs(w, c) < mean_abs(w, rtn)
    assert lp_obj(w, c) < lp_obj(w, rtn)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [16, 64, None])
def test_codes_well_formed(bits: int, group: int | None) -> None:
    w = heavy((24, 128), bits)
    w[0, :16] = 0.0  # an all-zero group at group 16
    w[1, :16] = 0.37  # a constant one
    grid = WeightGrid(bits, group, False)
    c = hqq_codes(w, grid)
    groups = 1 if group is None else 128 // group
    assert c.codes.dtype == torch.uint8 and c.codes.shape == (24, 128)
    assert c.scale.shape == (24, groups) and c.zero.shape == (24, groups)
    assert int(c.codes.max()) <= 2**bits - 1
    assert bool(torch.isfinite(c.zero).all()) and bool((c.scale > 0).all())
    assert c.grid == grid
    if group == 16:
        torch.testing.assert_close(c.dequantize()[:2, :16], w[:2, :16], rtol=0, atol=1e-6)
    c64 = hqq_codes(w.double(), grid, dtype=torch.float64)
    assert c64.scale.dtype == torch.float64
    assert float((c64.dequantize() - c.dequantize().double()).abs().max()) < 1e-3 * float(w.abs().max())


# ----------------------------------------------------------------------------------- errors


def test_sym_refused() -> None:
    with pytest.raises(DiffquantError, match="hqq optimises the zero point: sym must be false") as info:
        hqq_codes(gaussian((8, 64), 0), WeightGrid(4, 64, True))
    assert "\n" not in str(info.value)


def test_group_wider_than_weight_refused() -> None:
    with pytest.raises(DiffquantError, match="group 128 is wider than the 64 input channels"):
        hqq_codes(gaussian((8, 64), 0), WeightGrid(4, 128, False))
    with pytest.raises(DiffquantError, match="2-D"):
        hqq_codes(torch.zeros(4, 8, 64), WeightGrid(4, 64, False))


# ----------------------------------------------------------------------------------- partial last group


def test_partial_last_group() -> None:
    """group_size 32 on 80 columns: groups 32, 32 and a partial 16. Without the (weight-wide) stopping rule
    the groups are independent, so the codes are those of the full part and of the last 16 columns alone;
    with it, one rule over all groups still improves on the start."""
    w = heavy((8, 80), 7)
    grid = WeightGrid(4, 32, False)
    c = hqq_codes(w, grid, early_stop=False)
    assert c.codes.shape == (8, 80) and c.scale.shape == (8, 3) and c.zero.shape == (8, 3)
    head = hqq_codes(w[:, :64], grid, early_stop=False)
    tail = hqq_codes(w[:, 64:], WeightGrid(4, None, False), early_stop=False)
    assert torch.equal(c.codes, torch.cat([head.codes, tail.codes], 1))
    assert torch.equal(c.scale, torch.cat([head.scale, tail.scale], 1))
    assert torch.equal(c.zero, torch.cat([head.zero, tail.zero], 1))
    stopped, init = hqq_codes(w, grid), hqq_codes(w, grid, iters=0)
    assert mean_abs(w, stopped) < mean_abs(w, init)
    assert float((stopped.zero[:, 2] - init.zero[:, 2]).abs().max()) > 1e-3  # the partial group moved too
