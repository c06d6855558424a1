"""Streaming, mergeable outlier statistics of one tap site: :class:`SiteStats`.

A profiling run sees millions of activations per site and may be sharded over processes, so nothing here
keeps an activation tensor: the state is O(topk + massive_cap + histogram bins + channels), independent of the
number of tokens seen, and two states over disjoint data merge into the state of the union. Every statistic
follows a published definition:

* moments: count, mean, population std and Pearson kurtosis E[(x-mu)^4] / sigma^4 of the whole stream, from
  float64 central moments (n, mean, M2, M3, M4) merged with the pairwise formulas of Chan, Golub & LeVeque
  (1979) and Pebay (2008, "Formulas for robust, one-pass parallel computation of covariances and arbitrary-order
  statistical moments"); exact up to float64 rounding, in any merge order.
* per-token kurtosis over the channel dim, averaged over tokens (Bondarenko et al. 2023, "Quantizable
  Transformers"); only for layouts whose last dim is ``channel``.
* top-k magnitudes with locations (DIFF paper, arXiv 2410.05258, Table 5: top-1/2/3/10/100), exact, under a
  total order (descending |x|, then location) so that sharded and one-pass runs agree entry for entry.
* quantiles of |x| (the Table 5 median, p90/p99/p999) from a log-spaced histogram -- approximate, see below.
* per-channel abs-max, SmoothQuant's ``act_scales`` (Xiao et al. 2023), merged by elementwise max.
* count of |x| >= 6 (the LLM.int8 outlier threshold, Dettmers et al. 2022), exact.
* count of values beyond 6 standard deviations (Bondarenko et al. 2023) -- approximate, see below.
* massive activations (Sun et al. 2024): |x| > 100 and > 1000 x the median magnitude, with locations.

Approximations (everything else is exact):

* Histogram: 64 bins per octave, binned by the float32 bit pattern. Bin j = 64 e + k (k = 0 .. 63) is
  [E_j, E_(j+1)) with E_j = 2^e * M_k / 512, M_k = round(512 * 2^(k/64)) (M_64 = 1024): the geometric edges
  r^j, r = 2^(1/64) ~ 1.0109, rounded to 9 mantissa bits, so every edge is a float32 number and E_j is within
  0.1 % of r^j. A float32 magnitude's exponent and top 9 mantissa bits (one shift of its bit pattern) name a
  "fine" interval that lies inside exactly one bin, so binning is exact: one bincount over the bit codes, then
  a fixed table folds fine intervals into bins. Float64 inputs are binned from their own bits the same way
  (exact too). Bins j = I_LO .. I_HI (2^-126 .. 2^128) cover every normal float32 magnitude; a value with
  |x| < 2^-126 (zeros, subnormals) goes in the zero bin and is reported as 0; float64 magnitudes >= 2^128
  clamp into the top bin. The widest bin has E_(j+1) / E_j = 571/564 = 1.01241 (the narrowest 540/535 = 1.00935).
  :meth:`SiteStats.quantile` finds the bin holding the exact rank and returns its geometric midpoint
  sqrt(E_j E_(j+1)), so the relative error of a non-zero quantile is at most sqrt(571/564) - 1 = 0.6187 %
  (``QUANTILE_REL_ERROR``; it was 0.995 % with the earlier r = 1.02 bins, STATE_VERSION 1).
* Beyond-6-sigma count: mean and std are only known at the end of the stream, so the count is read from the
  signed histogram in :meth:`SiteStats.summary`: a whole bin counts when its geometric midpoint (taken with the
  bin's sign) lies beyond mean +/- 6 std. Each value is within a factor 1 + QUANTILE_REL_ERROR of its bin's
  midpoint, so the threshold is resolved to within 0.62 %: the count lies between the exact counts of
  |x - mean| > 6.04 std and |x - mean| > 5.96 std whenever |mean| < 5.9 std (true of activations; else std is
  tiny next to the values).
* Moments are accumulated from float32 passes for float32 / bf16 / fp16 inputs (see
  :func:`_row_moments`): each row of the last dim is summed in float64 (exact row means), centred in float32
  at its rounded mean, its central power sums taken in float32, and rows are combined in float64 with the
  exact shift formulas. Rows whose float32 sums could over- or underflow are redone in float64. The
  result agrees with a float64 two-pass computation to ~1e-7 relative (tested to 1e-6). Masked map chunks
  take each (batch, head) slice's visible entries as one row (:meth:`SiteStats._update_map`), so splitting a
  map into other query chunks changes the float32 rounding: merged and one-pass moments of maps agree to that
  same bound, those of other sites (rows are whole tokens) to float64 rounding.

``valid`` masks (attention-map chunks) exclude entries from everything; NaN / +Inf / -Inf are counted
separately and excluded from all other statistics.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch

from diffquant.profile.sites import Layout, layer_of, layout_of, query_positions

# ------------------------------------------------------------------------------------------ histogram bins
BINS_PER_OCTAVE = 64
R = 2.0 ** (1.0 / BINS_PER_OCTAVE)  # nominal bin ratio; the edges are r^j rounded to FINE_BITS mantissa bits
LN_R = math.log(R)
FINE_BITS = 9  # mantissa bits of a fine interval: 512 per octave, each inside one bin
I_LO = -126 * BINS_PER_OCTAVE  # E_(I_LO) = 2^-126, the smallest normal float32
I_HI = 128 * BINS_PER_OCTAVE - 1  # E_(I_HI + 1) = 2^128 > largest float32
N_BINS = I_HI - I_LO + 1  # per sign; plus one zero bin
INT8_THRESHOLD = 6.0  # LLM.int8 (Dettmers et al. 2022)
MASSIVE_FLOOR = 100.0  # Sun et al. 2024: massive activations have |x| > 100 ...
MASSIVE_RATIO = 1000.0  # ... and |x| > ~1000 x the median magnitude
SIGMAS = 6.0  # Bondarenko et al. 2023: outliers lie beyond 6 standard deviations
STATE_VERSION = 2  # 2: 64 bins per octave (bit-pattern binning); 1: r = 1.02 bins

# In-octave edge mantissas M_k = round(2^FINE_BITS * 2^(k/64)), k = 0 .. 64 (M_64 = 2 * 2^FINE_BITS): E_(64e+k)
# = 2^e * M_k / 2^FINE_BITS, exact float32 numbers on the fine grid.
_FINE = 1 << FINE_BITS
_M = [round(_FINE * 2.0 ** (k / BINS_PER_OCTAVE)) for k in range(BINS_PER_OCTAVE)] + [2 * _FINE]
_EDGES = [
    math.ldexp(_M[(j - I_LO) % BINS_PER_OCTAVE], (j - I_LO) // BINS_PER_OCTAVE - 126 - FINE_BITS)
    for j in range(I_LO, I_HI + 1)
] + [2.0**128]
# Bound on the relative error of a non-zero quantile: sqrt of the widest bin ratio, minus 1 (0.6187 %).
QUANTILE_REL_ERROR = max(math.sqrt(_M[k + 1] / _M[k]) for k in range(BINS_PER_OCTAVE)) - 1

_MAG_CODES = 1 << (8 + FINE_BITS)  # fine code of a magnitude: 8 exponent bits, FINE_BITS mantissa bits
_SHIFT32 = 23 - FINE_BITS
_SLOTS = N_BINS + 1  # dense per-sign histogram: slot 0 = zero bin, slot 1 + j - I_LO = bin j


def _fold_table() -> torch.Tensor:
    """Dense slot (sign * _SLOTS + slot) of every signed fine code (sign bit, exponent, FINE_BITS mantissa)."""
    k_of_m = torch.searchsorted(
        torch.tensor(_M[:BINS_PER_OCTAVE]), torch.arange(_FINE, 2 * _FINE), right=True
    ).sub_(1)  # bin within the octave of each fine mantissa
    exp = torch.arange(256).unsqueeze(1)
    slot = 1 + (exp - 127) * BINS_PER_OCTAVE + k_of_m.unsqueeze(0) - I_LO
    slot[0] = 0  # exponent field 0: zeros and subnormals
    slot[255] = N_BINS  # Inf / NaN never get here (excluded); clamp anyway
    slot = slot.reshape(-1)
    neg = torch.where(slot == 0, 0, slot + _SLOTS)  # negative zero -> the one zero bin
    return torch.cat([slot, neg])


_FOLD = _fold_table()
_CODE_6 = int(torch.tensor(INT8_THRESHOLD, dtype=torch.float32).view(torch.int32)) >> _SHIFT32
_CODE_100 = int(torch.tensor(MASSIVE_FLOOR, dtype=torch.float32).view(torch.int32)) >> _SHIFT32

_COORDS = ("pos", "head", "channel", "key")  # location keys that are layout coordinates
_SCAN_CHUNK = 1 << 20
_SUBSET_MIN = 1 << 16
_BLOCK = 1 << 20  # elements per block of the blocked passes (moments: 4x; fewer, larger ops win on CPU)
# Fast paths that leave every statistic unchanged (masked map chunks gathered once); tests turn this off to
# compare with the general path.
FAST = True


def bin_edges(j: int) -> tuple[float, float]:
    """The magnitude range [E_j, E_(j+1)) of histogram bin j."""
    return _EDGES[j - I_LO], _EDGES[j - I_LO + 1]


def bin_midpoint(j: int) -> float:
    """Geometric midpoint sqrt(E_j E_(j+1)) of bin j: the value reported for every magnitude in the bin."""
    lo, hi = bin_edges(j)
    return math.sqrt(lo * hi)


def _fine_codes(vals: torch.Tensor) -> torch.Tensor:
    """Signed fine code (sign, 8-bit float32 exponent, top FINE_BITS mantissa bits) of each finite value of 1-D
    ``vals``; float64 values are mapped onto float32's exponent range (below 2^-126 -> exponent 0, at or beyond
    2^128 -> the top code), so binning is exact for both dtypes."""
    if vals.dtype == torch.float32:
        return torch.bitwise_right_shift(vals.view(torch.int32), _SHIFT32).bitwise_and_(2 * _MAG_CODES - 1)
    bits = vals.view(torch.int64)
    exp = ((bits >> 52) & 0x7FF) - (1023 - 127)
    mant = (bits >> (52 - FINE_BITS)) & (_FINE - 1)
    mag = torch.where(exp <= 0, 0, (exp.clamp_max(254) << FINE_BITS) | mant)
    mag = torch.where(exp >= 255, (254 << FINE_BITS) | (_FINE - 1), mag)  # top bin
    return mag | ((bits < 0).to(torch.int64) << (8 + FINE_BITS))


def _histogram(flat: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """(dense signed bin counts (2 * _SLOTS, int64), #|x| >= 6, #|x| >= 100) of the entries of 1-D ``flat``
    where ``ok`` (None: all; the counted entries must be finite).

    Per block, one bincount over the fine bit codes (exact: each fine interval lies in one bin, 6 and 100 are
    fine-interval edges; excluded entries go to a dump code); then the fixed table folds the 2^18 fine counts
    into bins.
    """
    dump = 2 * _MAG_CODES
    fine = None
    for i in range(0, flat.numel(), 4 * _BLOCK):
        codes = _fine_codes(flat[i : i + 4 * _BLOCK])
        if ok is not None:
            codes.masked_fill_(~ok[i : i + 4 * _BLOCK], dump)
        part = torch.bincount(codes, minlength=dump + 1)
        fine = part if fine is None else fine.add_(part)
    assert fine is not None
    fine = fine[:dump]
    dense = torch.zeros(2 * _SLOTS, dtype=torch.int64).index_add_(0, _FOLD, fine)
    fine = fine.view(2, _MAG_CODES)
    ge6, ge100 = torch.stack([fine[:, _CODE_6:].sum(), fine[:, _CODE_100:].sum()]).tolist()
    return dense, ge6, ge100


def _masked_extremes(flat: torch.Tensor, ok: torch.Tensor) -> tuple[float, float, int]:
    """(min, max, count) of the entries of 1-D ``flat`` where ``ok``, blockwise; NaN propagates, and with no
    entry min = inf, max = -inf."""
    out = []
    for i in range(0, flat.numel(), _BLOCK):
        blk, keep = flat[i : i + _BLOCK], ok[i : i + _BLOCK]
        drop = ~keep
        out.append(
            torch.stack(
                [
                    blk.masked_fill(drop, math.inf).amin().to(torch.float64),
                    blk.masked_fill(drop, -math.inf).amax().to(torch.float64),
                    keep.sum().to(torch.float64),
                ]
            )
        )
    if not out:
        return math.inf, -math.inf, 0
    t = torch.stack(out)
    lo, hi, n = torch.stack([t[:, 0].min(), t[:, 1].max(), t[:, 2].sum()]).tolist()
    return lo, hi, int(n)


def _add_counts(into: dict[int, int], other: dict[int, int]) -> None:
    for j, n in other.items():
        into[j] = into.get(j, 0) + n


# -------------------------------------------------------------------------------------------- moments
Moments = tuple[int, float, float, float, float]  # n, mean, M2, M3, M4 (central sums, not divided by n)


def _combine_moments(a: Moments, b: Moments) -> Moments:
    """Central moments of the union of two disjoint sets (Chan et al. 1979 for M2; Pebay 2008, eqs. 3.1 ff.)."""
    na, ma, m2a, m3a, m4a = a
    nb, mb, m2b, m3b, m4b = b
    if na == 0:
        return b
    if nb == 0:
        return a
    n = na + nb
    fa, fb, fn = float(na), float(nb), float(n)
    d = mb - ma
    mean = ma + d * fb / fn
    m2 = m2a + m2b + d * d * fa * fb / fn
    m3 = m3a + m3b + d**3 * fa * fb * (fa - fb) / fn**2 + 3.0 * d * (fa * m2b - fb * m2a) / fn
    m4 = (
        m4a
        + m4b
        + d**4 * fa * fb * (fa * fa - fa * fb + fb * fb) / fn**3
        + 6.0 * d * d * (fa * fa * m2b + fb * fb * m2a) / fn**2
        + 4.0 * d * (fa * m3b - fb * m3a) / fn
    )
    return n, mean, m2, m3, m4


_TINY_S2 = 2.0**-50  # rows with mean squared deviation below this are redone in float64 (float32 underflow)


def _row_moments(rows: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """:func:`_row_moments_block` over blocks of about 4 x _BLOCK elements (whole rows), so that the float32 /
    float64 temporaries stay bounded (memory flat in the tokens seen) while each op is large enough that its
    dispatch cost does not dominate (measured: 2^18-element blocks took 2-3x longer than 2^22)."""
    step = max(1, 4 * _BLOCK // max(rows.shape[1], 1))
    if rows.shape[0] <= step:
        return _row_moments_block(rows, ok)
    parts = [
        _row_moments_block(rows[i : i + step], None if ok is None else ok[i : i + step])
        for i in range(0, rows.shape[0], step)
    ]
    return tuple(torch.cat(cols) for cols in zip(*parts, strict=True))


def _row_moments_block(rows: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Per-row (n, sum, M2, M3, M4) in float64 (central sums about each row's own mean) of the entries of 2-D
    ``rows`` where ``ok`` (None: all).

    The row sums are float64 (exact means); for float32 rows the deviations d = x - c from the float32-rounded
    mean c and the power sums S_k = sum d^k are float32 (x - c is exact to half an ulp of d, the sums are
    pairwise), then shifted to the exact mean in float64: with delta = mean - c,
    M2 = S2 - n delta^2, M3 = S3 - 3 delta S2 + 2 n delta^3, M4 = S4 - 4 delta S3 + 6 delta^2 S2 - 3 n delta^4.
    Rows whose float32 sums are not finite or whose mean square deviation is below 2^-50 (underflow), or zero,
    are redone in float64 (constant rows then give M2 == 0 exactly).
    """
    width = rows.shape[1]
    if ok is None:
        n = torch.full((rows.shape[0],), float(width), dtype=torch.float64)
        s = rows.sum(-1, dtype=torch.float64)
    else:
        n = ok.sum(-1, dtype=torch.float64)
        s = torch.where(ok, rows, 0.0).sum(-1, dtype=torch.float64)
    mean = torch.where(n > 0, s / n.clamp_min(1.0), 0.0)
    c = mean.to(rows.dtype)
    d = rows - c.unsqueeze(1)
    if ok is not None:
        d.masked_fill_(~ok, 0.0)
    d2 = d * d
    sums = torch.stack([d2.sum(-1), d.mul_(d2).sum(-1), d2.mul_(d2).sum(-1)]).to(torch.float64)
    del d, d2
    s2, s3, s4 = sums
    delta = mean - c.to(torch.float64)
    m2 = s2 - n * delta**2
    m3 = s3 - 3.0 * delta * s2 + 2.0 * n * delta**3
    m4 = s4 - 4.0 * delta * s3 + 6.0 * delta**2 * s2 - 3.0 * n * delta**4
    if rows.dtype != torch.float64:
        redo = ~torch.isfinite(s4) | (s2 <= _TINY_S2 * n) | (m2 <= 0)
        redo &= n > 0
        idx = redo.nonzero().squeeze(1)
        if idx.numel():
            sub = _row_moments_block(rows[idx].to(torch.float64), None if ok is None else ok[idx])
            for dst, src in zip((m2, m3, m4), sub[2:], strict=True):
                dst[idx] = src
    return n, s, m2, m3, m4


def _combine_rows(n: torch.Tensor, s: torch.Tensor, m2, m3, m4) -> Moments:
    """Central moments of the union of rows from per-row (n, sum, M2, M3, M4): shift each row's sums from
    its mean to the overall mean (delta = row mean - mean; Sum (e + delta)^k with Sum e = 0), in float64."""
    total = float(n.sum())
    if total == 0:
        return 0, 0.0, 0.0, 0.0, 0.0
    mean = s.sum() / total
    delta = torch.where(n > 0, s / n.clamp_min(1.0), mean) - mean
    d2 = delta * delta
    out = torch.stack(
        [
            mean,
            (m2 + n * d2).sum(),
            (m3 + 3.0 * delta * m2 + n * d2 * delta).sum(),
            (m4 + 4.0 * delta * m3 + 6.0 * d2 * m2 + n * d2 * d2).sum(),
        ]
    ).tolist()
    return int(total), *out


def _histogram_bar(dense: torch.Tensor, k: int) -> tuple[float | None, int]:
    """(lower edge of the bin holding the k-th largest magnitude, number of magnitudes >= that edge), from one
    chunk's dense histogram; (None, 0) when the k-th largest magnitude lies in the zero bin (or k < 1)."""
    if k < 1:
        return None, 0
    mag = dense.view(2, _SLOTS).sum(0)
    from_top = mag[1:].flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, k))
    if i >= N_BINS:
        return None, 0
    slot = N_BINS - i  # 1-based slot of bin I_LO + slot - 1
    return _EDGES[slot - 1], int(from_top[i])


# ------------------------------------------------------------------------------------- top-k entries
def _entry_key(entry: dict[str, Any]) -> tuple:
    """The total order of top-k / massive entries: descending |x|, then (site, sample, layout coordinates in
    layout order, absolute positions), then the signed value (only to make exact duplicates deterministic)."""
    loc = entry["loc"]
    coords = tuple(v for k, v in loc.items() if k in _COORDS)  # locations are built in layout order
    return (-entry["abs"], loc["site"], loc["sample"], *coords, entry["value"])


def _earlier_nonfinite(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The earlier of two first-non-finite records (sample, then coordinates, then site)."""
    if a is None or b is None:
        return a or b

    def key(entry: dict[str, Any]) -> tuple:
        loc = entry["loc"]
        return (loc["sample"], *(v for k, v in loc.items() if k in _COORDS), loc["site"])

    return a if key(a) <= key(b) else b


def _copy_entry(entry: dict[str, Any], loc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of an entry ({abs, value, loc} or a first-non-finite {value, loc}): its values are scalars and
    ``loc`` a flat dict of scalars, so two levels are a deep copy (copy.deepcopy was 10 % of a profile run).
    ``loc`` (optional) overrides location keys (another site seeing the same tensor)."""
    return {k: ({**v, **(loc or {})} if isinstance(v, dict) else v) for k, v in entry.items()}


def _copy_entries(entries: list[dict[str, Any]], loc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [_copy_entry(e, loc) for e in entries]


def _merge_entries(a: list[dict], b: list[dict], cap: int) -> list[dict]:
    return sorted(a + b, key=_entry_key)[:cap]


def _first_true(mask: torch.Tensor, need: int) -> torch.Tensor:
    """Flat indices of the first ``need`` True entries of 1-D ``mask``, scanning in chunks so that a tensor full
    of ties (e.g. all zeros) does not materialise millions of indices."""
    found: list[torch.Tensor] = []
    for start in range(0, mask.numel(), _SCAN_CHUNK):
        idx = mask[start : start + _SCAN_CHUNK].nonzero().squeeze(1) + start
        found.append(idx[:need])
        need -= found[-1].numel()
        if need <= 0:
            break
    return torch.cat(found) if found else mask.new_zeros(0, dtype=torch.int64)


def _select(
    af: torch.Tensor, k: int, floor: float, n_above: int, bar: float | None = None, n_bar: int = 0
) -> torch.Tensor:
    """Flat indices of the first ``k`` entries of ``af`` (magnitudes; excluded entries hold -1) above ``floor``
    in the order (-|x|, flat index); ``n_above`` = number of entries > floor.

    With k-th value t: every entry > t, then the lowest-flat-index entries == t. Row-major flat order equals
    location order within one tensor, so this is the exact top-k of the total order. ``bar`` (optional) is a
    magnitude with k <= n_bar = #(af >= bar) (read off the histogram): when n_bar is small the search runs on
    those entries only, which is much cheaper than a top-k over the whole tensor.
    """
    if n_above == 0 or k <= 0:
        return af.new_zeros(0, dtype=torch.int64)
    if n_above <= k:
        return (af > floor).nonzero().squeeze(1)
    if bar is not None and bar > floor and k <= n_bar <= max(_SUBSET_MIN, 8 * k) < af.numel():
        cand = (af >= bar).nonzero().squeeze(1)  # flat order kept, so ties still resolve by location
        return cand[_select(af[cand], k, floor, cand.numel())]
    t = torch.topk(af, k, sorted=False).values.min()
    gt = (af > t).nonzero().squeeze(1)
    eq = _first_true(af == t, k - gt.numel())
    return torch.cat([gt, eq])


# ------------------------------------------------------------------------------------------- SiteStats
class SiteStats:
    """Streaming statistics of the activations seen at one site (see the module docstring for definitions).

    Args:
        site: site name (``layers.3.attn.logits``); locations report it and its layer.
        kind: site kind (``q``, ``logits``, ``resid``, ``lambda`` ...), which fixes the tensor layout.
        topk: how many largest magnitudes are kept with their locations.
        massive_cap: how many massive-activation candidates (|x| > 100) are kept with their locations; the
            number of candidates is always counted exactly.
    """

    def __init__(self, site: str, kind: str, topk: int = 100, massive_cap: int = 1000) -> None:
        if topk < 0 or massive_cap < 0:
            raise ValueError(f"site {site!r}: topk and massive_cap must be >= 0")
        self.site = site
        self.kind = kind
        self.topk = int(topk)
        self.massive_cap = int(massive_cap)
        self.layout: Layout | None = None  # known after the first update
        self.count = 0  # finite, valid values
        self.first_nonfinite: dict[str, Any] | None = None  # earliest NaN / Inf entry: {value, loc}
        self.nan_count = 0
        self.posinf_count = 0
        self.neginf_count = 0
        self.min: float | None = None
        self.max: float | None = None
        self._moments: Moments = (0, 0.0, 0.0, 0.0, 0.0)
        self._tk_sum = 0.0  # sum of per-token kurtosis
        self._tk_tokens = 0
        self._tk_skipped = 0  # tokens with a non-finite / invalid channel or zero variance
        self._top: list[dict[str, Any]] = []
        self._hist_zero = 0  # |x| < 2^-126
        self._hist_pos: dict[int, int] = {}
        self._hist_neg: dict[int, int] = {}
        self._pending: torch.Tensor | None = None  # dense bin counts of updates not yet folded into the dicts
        self._absmax: torch.Tensor | None = None  # float64, CPU, flattened
        self._absmax_shape: tuple[int, ...] | None = None
        self.count_abs_ge_6 = 0
        self.count_abs_gt_100 = 0
        self._massive: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------- update
    def update(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        sample_offset: int = 0,
        pos_offset: int = 0,
    ) -> None:
        """Add the values of ``x`` (layout from the site kind).

        Args:
            valid: bool, broadcastable to ``x``: entries where False are ignored entirely (masked-out map
                entries). For map layouts the absolute query positions are read from it (causal mask).
            tokens: (B, T) token ids; the token of (row b, absolute position p) is ``tokens[b, p]``.
            sample_offset: global sample index of batch row 0 (also the location of a 0-d lambda, which has
                no batch dim).
            pos_offset: absolute position of index 0 along ``pos`` (ignored for maps given ``valid``).
        """
        layout = layout_of(self.kind, x)
        if self.layout is None:
            self.layout = layout
        x = x.detach()
        if FAST and valid is not None and self._update_map(x, valid, layout, tokens, sample_offset):
            return
        if x.dtype != torch.float64:
            small_float = x.is_floating_point() and x.element_size() <= 4
            x = x.to(torch.float32 if small_float else torch.float64)  # exact for every float dtype
        shape = tuple(x.shape)
        flat = x.reshape(-1)
        x = flat.view(shape)  # contiguous
        vflat = None
        if valid is not None:
            vflat = valid.to(device=x.device, dtype=torch.bool).expand(shape).reshape(-1)
        # Fast path: min / max propagate NaN, so finite extremes of the valid entries mean all are finite.
        ok = vflat  # None: every entry counts
        if vflat is None:
            n_ok = flat.numel()
            lo, hi = torch.stack(list(torch.aminmax(flat))).to(torch.float64).tolist() if n_ok else (0.0, 0.0)
        else:
            lo, hi, n_ok = _masked_extremes(flat, vflat)
        if n_ok and not (math.isfinite(lo) and math.isfinite(hi)):
            finite = torch.isfinite(flat)
            ok = finite if vflat is None else finite & vflat
            special = [torch.isnan(flat), flat == math.inf, flat == -math.inf]
            if vflat is not None:
                special = [m & vflat for m in special]
            n_nan, n_pinf, n_ninf = torch.stack([torch.count_nonzero(m) for m in special]).tolist()
            self.nan_count += n_nan
            self.posinf_count += n_pinf
            self.neginf_count += n_ninf
            vmask = None if vflat is None else vflat.view(shape)
            self._note_nonfinite(
                x, finite.view(shape), vmask, valid, layout, tokens, sample_offset, pos_offset
            )
            lo, hi, n_ok = _masked_extremes(flat, ok)
        af_flat = flat.abs()  # magnitudes; excluded entries -> -1 (below every real magnitude)
        if ok is not None:
            af_flat.masked_fill_(~ok, -1.0)
        self._update_absmax(af_flat.view(shape), layout)
        per_token = bool(layout) and layout[-1] == "channel"
        if n_ok == 0:
            if per_token:  # every token has a non-finite / masked channel (or no channels)
                self._tk_skipped += math.prod(shape[:-1])
            return

        self.count += n_ok
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        dense, ge6, ge100 = _histogram(flat, ok)
        self._pending = dense if self._pending is None else self._pending.add_(dense)
        self.count_abs_ge_6 += ge6

        width = shape[-1] if shape else 1
        rows = flat.view(-1, width)
        row_ok = None if ok is None else ok.view(-1, width)
        n_r, s_r, m2_r, m3_r, m4_r = _row_moments(rows, row_ok)
        self._moments = _combine_moments(self._moments, _combine_rows(n_r, s_r, m2_r, m3_r, m4_r))
        if per_token:
            self._update_token_kurtosis(n_r, m2_r, m4_r, width)

        qpos = None
        if valid is not None and "key" in layout:
            qpos = query_positions(valid).tolist()
        where = (flat, shape, layout, qpos, tokens, sample_offset, pos_offset)
        bar, n_bar = _histogram_bar(dense, self.topk)
        top = self._entries(_select(af_flat, self.topk, -0.5, n_ok, bar, n_bar), *where)
        self._top = _merge_entries(self._top, top, self.topk)
        if ge100:  # |x| >= 100 seen: find the candidates |x| > 100 (exact count) in one pass
            cand = (af_flat > MASSIVE_FLOOR).nonzero().squeeze(1)
            gt100 = cand.numel()
            self.count_abs_gt_100 += gt100
            if gt100:
                pick = cand[_select(af_flat[cand], self.massive_cap, MASSIVE_FLOOR, gt100)]
                massive = self._entries(pick, *where)
                self._massive = _merge_entries(self._massive, massive, self.massive_cap)

    def _update_map(
        self,
        x: torch.Tensor,
        valid: torch.Tensor,
        layout: Layout,
        tokens: torch.Tensor | None,
        sample_offset: int,
    ) -> bool:
        """The fast path of a masked map chunk whose mask is shared by every (batch, head) slice (the causal
        mask): gather the visible entries once into a dense (slices, visible) tensor and run every statistic
        on it without masks. Returns False (nothing done) when it does not apply: a mask that differs across
        slices, nothing visible, or a non-finite visible entry (the general path locates and counts those).

        Same results as the general path: counts, extremes, histogram, top-k and massive entries are exact
        (gathered indices map back to flat indices in increasing order, so ties still resolve by location);
        moments are the same float64-combined sums over other row groupings (to ~1e-7 relative).
        """
        if x.dim() < 2 or valid.dim() != x.dim() or any(n != 1 for n in valid.shape[:-2]):
            return False
        if layout[-1] == "channel" or any(d in ("head", "channel") for d in layout[-2:]):
            return False
        t, s = x.shape[-2], x.shape[-1]
        if tuple(valid.shape[-2:]) != (t, s):
            return False
        visible = valid.to(device=x.device, dtype=torch.bool).reshape(-1).nonzero().squeeze(1)
        width = visible.numel()
        if width == 0:
            return False
        flat = x.reshape(-1)
        vals = flat.view(-1, t * s).index_select(1, visible)
        if vals.dtype != torch.float64:
            small_float = vals.is_floating_point() and vals.element_size() <= 4
            vals = vals.to(torch.float32 if small_float else torch.float64)
        lo, hi = torch.stack(list(torch.aminmax(vals))).to(torch.float64).tolist()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return False
        n_ok = vals.numel()
        af = vals.abs()
        lead = tuple(x.shape[:-2])
        reduce = [i for i, d in enumerate(layout[:-2]) if d != "head"] + [len(lead)]
        keep = tuple(n for n, d in zip(lead, layout, strict=False) if d == "head")
        amax = af.view(*lead, width).amax(dim=reduce) if reduce else af
        self._merge_absmax(amax.to("cpu", torch.float64).reshape(-1), keep)

        self.count += n_ok
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        vflat = vals.view(-1)
        dense, ge6, ge100 = _histogram(vflat, None)
        self._pending = dense if self._pending is None else self._pending.add_(dense)
        self.count_abs_ge_6 += ge6
        self._moments = _combine_moments(self._moments, _combine_rows(*_row_moments(vals, None)))

        def to_flat(ci: torch.Tensor) -> torch.Tensor:  # gathered flat index -> the chunk's flat index
            return torch.div(ci, width, rounding_mode="floor") * (t * s) + visible[ci % width]

        qpos = query_positions(valid).tolist() if "key" in layout else None
        where = (flat, tuple(x.shape), layout, qpos, tokens, sample_offset, 0)
        aflat = af.view(-1)
        bar, n_bar = _histogram_bar(dense, self.topk)
        top = self._entries(to_flat(_select(aflat, self.topk, -0.5, n_ok, bar, n_bar)), *where)
        self._top = _merge_entries(self._top, top, self.topk)
        if ge100:
            cand = (aflat > MASSIVE_FLOOR).nonzero().squeeze(1)
            gt100 = cand.numel()
            self.count_abs_gt_100 += gt100
            if gt100:
                pick = cand[_select(aflat[cand], self.massive_cap, MASSIVE_FLOOR, gt100)]
                massive = self._entries(to_flat(pick), *where)
                self._massive = _merge_entries(self._massive, massive, self.massive_cap)
        return True

    def _note_nonfinite(self, x, finite, vmask, valid, layout, tokens, sample_offset, pos_offset) -> None:
        """Keep the location of the earliest non-finite entry (by sample, then layout coordinates), so a
        profile of a broken model says where NaN / Inf first appear, not only how many there are."""
        bad = ~finite if vmask is None else ~finite & vmask
        idx = torch.nonzero(bad.reshape(-1))[:1].reshape(-1)
        qpos = query_positions(valid).tolist() if valid is not None and "key" in layout else None
        entry = self._entries(
            idx, x.reshape(-1), tuple(x.shape), layout, qpos, tokens, sample_offset, pos_offset
        )[0]
        value = entry["value"]
        candidate = {
            "value": "nan" if value != value else ("inf" if value > 0 else "-inf"),
            "loc": entry["loc"],
        }
        self.first_nonfinite = _earlier_nonfinite(self.first_nonfinite, candidate)

    def _update_absmax(self, af: torch.Tensor, layout: Layout) -> None:
        """SmoothQuant act_scales: max |x| over every dim but head / channel (excluded entries count as 0)."""
        if not layout:
            return
        reduce = [i for i, d in enumerate(layout) if d not in ("head", "channel")]
        keep = tuple(af.shape[i] for i, d in enumerate(layout) if d in ("head", "channel"))
        if af.numel() == 0:
            amax = torch.zeros(keep, dtype=torch.float64)
        else:
            amax = (af.amax(dim=reduce) if reduce else af).clamp_min(0.0).to("cpu", torch.float64)
        self._merge_absmax(amax.reshape(-1), keep)

    def _merge_absmax(
        self, amax: torch.Tensor | None, shape: tuple[int, ...] | None, other: str = ""
    ) -> None:
        if amax is None:
            return
        if self._absmax is None:
            self._absmax, self._absmax_shape = amax.clone(), shape
        elif self._absmax_shape != shape:
            raise ValueError(
                f"site {self.site!r}: channel abs-max shape {self._absmax_shape} does not match "
                f"{shape}{f' of site {other!r}' if other else ''}"
            )
        else:
            torch.maximum(self._absmax, amax, out=self._absmax)

    def _update_token_kurtosis(self, n: torch.Tensor, m2: torch.Tensor, m4: torch.Tensor, width: int) -> None:
        """Bondarenko et al. 2023: Pearson kurtosis of each token's vector over channels, summed over tokens,
        from the per-row central sums of :func:`_row_moments`.

        A token is skipped when a channel is non-finite / masked (n < width) or all its channels are equal
        (M2 == 0: exact, a constant row is centred at its exact value).
        """
        keep = (n == width) & (m2 > 0)
        kurt = m4 * width / (m2 * m2)  # (m4 / c) / (m2 / c)^2
        total, kept = torch.stack(
            [torch.where(keep, kurt, 0.0).sum(), keep.sum(dtype=torch.float64)]
        ).tolist()
        self._tk_sum += total
        self._tk_tokens += int(kept)
        self._tk_skipped += n.numel() - int(kept)

    def _entries(
        self,
        idx: torch.Tensor,
        flat: torch.Tensor,
        shape: tuple[int, ...],
        layout: Layout,
        qpos: list[int] | None,
        tokens: torch.Tensor | None,
        sample_offset: int,
        pos_offset: int,
    ) -> list[dict[str, Any]]:
        """Entries {abs, value, loc} for flat indices ``idx`` of one update tensor."""
        if idx.numel() == 0:
            return []
        values = flat[idx].to(torch.float64).tolist()
        coords = torch.stack(torch.unravel_index(idx, shape), 1).tolist() if layout else [[] for _ in values]
        layer = layer_of(self.site)
        bdim = layout.index("batch") if "batch" in layout else None
        pdim = layout.index("pos") if "pos" in layout else None
        entries = []
        for value, coord in zip(values, coords, strict=True):
            loc: dict[str, Any] = {"site": self.site, "layer": layer}
            loc["sample"] = sample_offset + (coord[bdim] if bdim is not None else 0)
            for dim, i in zip(layout, coord, strict=True):
                if dim == "pos":
                    loc["pos"] = qpos[i] if qpos is not None else pos_offset + i
                elif dim != "batch":
                    loc[dim] = i
            loc["token"] = None
            entries.append({"abs": abs(value), "value": value, "loc": loc})
        if tokens is not None and bdim is not None and pdim is not None:
            rows_, cols_, which = [], [], []
            for n, (entry, coord) in enumerate(zip(entries, coords, strict=True)):
                b, p = coord[bdim], entry["loc"]["pos"]
                if 0 <= b < tokens.shape[0] and 0 <= p < tokens.shape[1]:
                    rows_.append(b)
                    cols_.append(p)
                    which.append(n)
            if which:
                ids = tokens[
                    torch.tensor(rows_, device=tokens.device), torch.tensor(cols_, device=tokens.device)
                ]
                ids = ids.tolist()
                for n, tok in zip(which, ids, strict=True):
                    entries[n]["loc"]["token"] = int(tok)
        return entries

    # -------------------------------------------------------------------------------------- merge
    def merge(self, other: SiteStats, relabel: bool = False) -> SiteStats:
        """Add ``other``'s statistics (disjoint data, possibly another site: pooling) into self; returns self.

        Exact for counts, min/max, top-k, histograms and abs-max; moments to float64 rounding. ``relabel``:
        ``other`` holds statistics of a tensor this site saw too (taps sharing one input), so its entries'
        locations are renamed to this site and its layer.
        """
        loc = {"site": self.site, "layer": layer_of(self.site)} if relabel else None
        if other.topk != self.topk or other.massive_cap != self.massive_cap:
            raise ValueError(
                f"site {self.site!r}: cannot merge site {other.site!r} kept with different topk / massive_cap "
                f"({self.topk}/{self.massive_cap} vs {other.topk}/{other.massive_cap})"
            )
        if other._absmax is not None:
            if self.layout is not None and self._absmax is None:
                raise ValueError(f"site {self.site!r}: has no channel abs-max, site {other.site!r} has one")
            self._merge_absmax(other._absmax, other._absmax_shape, other.site)
        elif other.layout is not None and self._absmax is not None:
            raise ValueError(f"site {self.site!r}: has a channel abs-max, site {other.site!r} has none")
        if self.layout is None:
            self.layout = other.layout
        self.count += other.count
        self.nan_count += other.nan_count
        self.posinf_count += other.posinf_count
        self.neginf_count += other.neginf_count
        nonfinite = other.first_nonfinite
        nonfinite = None if nonfinite is None else _copy_entry(nonfinite, loc)
        self.first_nonfinite = _earlier_nonfinite(self.first_nonfinite, nonfinite)
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
            self.max = other.max if self.max is None else max(self.max, other.max)
        self._moments = _combine_moments(self._moments, other._moments)
        self._tk_sum += other._tk_sum
        self._tk_tokens += other._tk_tokens
        self._tk_skipped += other._tk_skipped
        self._top = _merge_entries(self._top, _copy_entries(other._top, loc), self.topk)
        self._hist_zero = self._zero + other._zero  # the properties fold pending counts first
        _add_counts(self._pos, other._pos)
        _add_counts(self._neg, other._neg)
        self.count_abs_ge_6 += other.count_abs_ge_6
        self.count_abs_gt_100 += other.count_abs_gt_100
        self._massive = _merge_entries(self._massive, _copy_entries(other._massive, loc), self.massive_cap)
        return self

    @classmethod
    def merged(cls, stats: Iterable[SiteStats], site: str = "pooled") -> SiteStats:
        """A new SiteStats pooling ``stats`` (inputs untouched), e.g. every logit tap for the Table 5 pool.

        Kind, topk and massive_cap come from the first input; locations keep their original sites.
        """
        stats = list(stats)
        if not stats:
            raise ValueError("merged: no statistics to pool")
        out = cls(site, stats[0].kind, topk=stats[0].topk, massive_cap=stats[0].massive_cap)
        for s in stats:
            out.merge(s)
        return out

    # ------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The whole state as plain JSON types (histogram bins as string keys, sparse)."""
        n, mean, m2, m3, m4 = self._moments
        return {
            "version": STATE_VERSION,
            "site": self.site,
            "kind": self.kind,
            "topk": self.topk,
            "massive_cap": self.massive_cap,
            "layout": None if self.layout is None else list(self.layout),
            "count": self.count,
            "nan_count": self.nan_count,
            "posinf_count": self.posinf_count,
            "neginf_count": self.neginf_count,
            "first_nonfinite": None if self.first_nonfinite is None else _copy_entry(self.first_nonfinite),
            "min": self.min,
            "max": self.max,
            "moments": {"n": n, "mean": mean, "m2": m2, "m3": m3, "m4": m4},
            "token_kurtosis": {"sum": self._tk_sum, "tokens": self._tk_tokens, "skipped": self._tk_skipped},
            "top": _copy_entries(self._top),
            "hist": {
                "base": R,
                "bins_per_octave": BINS_PER_OCTAVE,
                "fine_bits": FINE_BITS,
                "zero": self._zero,
                "pos": {str(j): self._pos[j] for j in sorted(self._pos)},
                "neg": {str(j): self._neg[j] for j in sorted(self._neg)},
            },
            "channel_absmax": None if self._absmax is None else self._absmax.tolist(),
            "channel_absmax_shape": None if self._absmax_shape is None else list(self._absmax_shape),
            "count_abs_ge_6": self.count_abs_ge_6,
            "count_abs_gt_100": self.count_abs_gt_100,
            "massive": _copy_entries(self._massive),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteStats:
        """Inverse of :meth:`to_dict` (also after a JSON round trip)."""
        hist = d.get("hist", {})
        if (
            d.get("version") != STATE_VERSION
            or hist.get("base") != R
            or (hist.get("bins_per_octave"), hist.get("fine_bits")) != (BINS_PER_OCTAVE, FINE_BITS)
        ):
            raise ValueError(
                f"site {d.get('site')!r}: unsupported statistics state (version / histogram base)"
            )
        s = cls(d["site"], d["kind"], topk=d["topk"], massive_cap=d["massive_cap"])
        s.layout = None if d["layout"] is None else tuple(d["layout"])
        s.count, s.nan_count = d["count"], d["nan_count"]
        s.posinf_count, s.neginf_count = d["posinf_count"], d["neginf_count"]
        s.first_nonfinite = copy.deepcopy(d.get("first_nonfinite"))  # absent in older profiles
        s.min, s.max = d["min"], d["max"]
        m = d["moments"]
        s._moments = (m["n"], m["mean"], m["m2"], m["m3"], m["m4"])
        tk = d["token_kurtosis"]
        s._tk_sum, s._tk_tokens, s._tk_skipped = tk["sum"], tk["tokens"], tk["skipped"]
        s._top = _copy_entries(d["top"])
        s._hist_zero = d["hist"]["zero"]
        s._hist_pos = {int(j): n for j, n in d["hist"]["pos"].items()}
        s._hist_neg = {int(j): n for j, n in d["hist"]["neg"].items()}
        if d["channel_absmax"] is not None:
            s._absmax = torch.tensor(d["channel_absmax"], dtype=torch.float64)
            s._absmax_shape = tuple(d["channel_absmax_shape"])
        s.count_abs_ge_6, s.count_abs_gt_100 = d["count_abs_ge_6"], d["count_abs_gt_100"]
        s._massive = _copy_entries(d["massive"])
        return s

    # ------------------------------------------------------------------------------- histogram state
    def _flush(self) -> None:
        """Fold the dense counts of recent updates into the sparse {bin: count} dicts (done lazily, so an
        update adds one dense tensor instead of building dicts)."""
        if self._pending is None:
            return
        dense, self._pending = self._pending, None
        nz = dense.nonzero().squeeze(1)
        for slot, n in zip(nz.tolist(), dense[nz].tolist(), strict=True):
            if slot == 0:
                self._hist_zero += n
            elif slot < _SLOTS:
                j = I_LO + slot - 1
                self._hist_pos[j] = self._hist_pos.get(j, 0) + n
            else:
                j = I_LO + slot - _SLOTS - 1
                self._hist_neg[j] = self._hist_neg.get(j, 0) + n

    @property
    def _zero(self) -> int:
        self._flush()
        return self._hist_zero

    @property
    def _pos(self) -> dict[int, int]:
        self._flush()
        return self._hist_pos

    @property
    def _neg(self) -> dict[int, int]:
        self._flush()
        return self._hist_neg

    # ---------------------------------------------------------------------------- derived numbers
    @property
    def n_bins(self) -> int:
        """Occupied histogram bins (at most 2 * N_BINS + 1: the memory bound of the histogram)."""
        return len(self._pos) + len(self._neg) + (1 if self._zero else 0)

    @property
    def mean(self) -> float | None:
        return self._moments[1] if self.count else None

    @property
    def std(self) -> float | None:
        """Population standard deviation."""
        return math.sqrt(self._moments[2] / self.count) if self.count else None

    @property
    def kurtosis(self) -> float | None:
        """Pearson kurtosis n * M4 / M2^2 (3 for a Gaussian); None without variance."""
        n, _, m2, _, m4 = self._moments
        return n * m4 / (m2 * m2) if n and m2 > 0 else None

    def quantile(self, q: float) -> float:
        """Quantile of |x| (inverted CDF: the value of rank ceil(q * count) among the sorted magnitudes).

        Returns the geometric midpoint of the bin holding that rank: within a factor sqrt(1.02) of the exact
        value (relative error <= 0.995 %), or 0 when the rank falls in the zero bin (|x| < r^I_LO).
        NaN when no value was seen.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile: q must be in [0, 1], got {q}")
        if self.count == 0:
            return math.nan
        rank = max(1, math.ceil(q * self.count))  # float product, as numpy's method="inverted_cdf"
        seen = self._zero
        if seen >= rank:
            return 0.0
        for j in sorted(set(self._pos) | set(self._neg)):
            seen += self._pos.get(j, 0) + self._neg.get(j, 0)
            if seen >= rank:
                return bin_midpoint(j)
        raise AssertionError("histogram counts do not add up to count")  # pragma: no cover

    def histogram(self, side: str = "abs") -> tuple[list[float], list[int]]:
        """(edges, counts) of the log bins of ``side`` ('pos', 'neg': magnitudes of negative values, 'abs'),
        dense over the occupied range: len(edges) == len(counts) + 1. The zero bin is :attr:`zero_count`."""
        if side not in ("pos", "neg", "abs"):
            raise ValueError(f"histogram side must be 'pos', 'neg' or 'abs', got {side!r}")
        bins = {"pos": self._pos, "neg": self._neg}.get(side)
        if bins is None:
            bins = dict(self._pos)
            _add_counts(bins, self._neg)
        if not bins:
            return [], []
        lo, hi = min(bins), max(bins)
        edges = _EDGES[lo - I_LO : hi - I_LO + 2]
        return edges, [bins.get(j, 0) for j in range(lo, hi + 1)]

    def signed_histogram(self) -> dict[str, Any]:
        """For plotting: {'pos': (edges, counts), 'neg': (edges, counts), 'zero': count}; negative-side
        edges are magnitudes (negate them to plot)."""
        return {"pos": self.histogram("pos"), "neg": self.histogram("neg"), "zero": self._zero}

    @property
    def zero_count(self) -> int:
        """Values with |x| below the smallest bin edge (zeros, subnormals)."""
        return self._zero

    def count_beyond_sigmas(self, sigmas: float = SIGMAS) -> int | None:
        """Approximate count of |x - mean| > sigmas * std from the signed histogram (whole bins by midpoint)."""
        if self.count == 0:
            return None
        mean, std = self.mean, self.std
        if std == 0:
            return 0
        thr = sigmas * std
        n = self._zero if abs(mean) > thr else 0
        n += sum(c for j, c in self._pos.items() if abs(bin_midpoint(j) - mean) > thr)
        n += sum(c for j, c in self._neg.items() if abs(-bin_midpoint(j) - mean) > thr)
        return n

    def kth_largest(self, k: int) -> float | None:
        """k-th largest magnitude (1-based), None if fewer than k values were kept."""
        return self._top[k - 1]["abs"] if 1 <= k <= len(self._top) else None

    def massive(self) -> tuple[list[dict[str, Any]], int, bool]:
        """(massive activations, their count, whether that count is exact) per Sun et al. 2024:
        |x| > 100 and |x| > 1000 x median |x|.

        The count is exact when the 1000 x median bar is at most 100 (then every candidate counts) or when not
        every kept candidate passes the bar (kept candidates are the largest); otherwise it is a lower bound.
        """
        median = self.quantile(0.5) if self.count else 0.0
        bar = max(MASSIVE_FLOOR, MASSIVE_RATIO * median)
        chosen = [_copy_entry(e) for e in self._massive if e["abs"] > bar]
        if bar == MASSIVE_FLOOR:
            return chosen, self.count_abs_gt_100, True
        truncated = self.count_abs_gt_100 > len(self._massive)
        exact = not truncated or len(chosen) < len(self._massive)
        return chosen, len(chosen), exact

    def summary(self) -> dict[str, Any]:
        """The derived numbers (plain Python types; None where undefined)."""
        massive, massive_count, massive_exact = self.massive()
        tk = self._tk_sum / self._tk_tokens if self._tk_tokens else None
        quant = {
            name: (self.quantile(q) if self.count else None)
            for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
        }
        return {
            "site": self.site,
            "kind": self.kind,
            "layer": layer_of(self.site),
            "count": self.count,
            "nan_count": self.nan_count,
            "posinf_count": self.posinf_count,
            "neginf_count": self.neginf_count,
            "first_nonfinite": None if self.first_nonfinite is None else _copy_entry(self.first_nonfinite),
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": self.std,
            "kurtosis": self.kurtosis,
            "token_kurtosis_mean": tk,
            "token_kurtosis_tokens": self._tk_tokens,
            "token_kurtosis_skipped": self._tk_skipped,
            "top": _copy_entries(self._top),
            **{f"top{k}": self.kth_largest(k) for k in (1, 2, 3, 10, 100)},
            **quant,
            "count_abs_ge_6": self.count_abs_ge_6,
            "count_beyond_6sigma": self.count_beyond_sigmas(SIGMAS),
            "count_abs_gt_100": self.count_abs_gt_100,
            "massive_count": massive_count,
            "massive_count_exact": massive_exact,
            "massive_truncated": self.count_abs_gt_100 > len(self._massive),
            "massive": massive,
            "channel_absmax": None if self._absmax is None else self._absmax.tolist(),
            "channel_absmax_shape": None if self._absmax_shape is None else list(self._absmax_shape),
        }
