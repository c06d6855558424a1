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
* channel-RMS kurtosis, the kurtosis the rotation papers report (QuaRot, SpinQuant): each channel's RMS over
  tokens (squares in float32 summed in float64 per channel, merged by addition), then the Pearson kurtosis of those RMS
  values over channels; only for layouts whose last dim is ``channel``. Three kurtoses, three questions: the
  stream's (heavy tails of all values), per token (a token's outlier channels), over channels' RMS (channels
  that are large for every token: what a rotation spreads).
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

import math
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from diffquant.kernels import native
from diffquant.options import DEFAULT_TOPK
from diffquant.profile.accumulators import (
    ACCUMULATORS,
    BINS_PER_OCTAVE,
    EDGES,
    FINE_BITS,
    I_HI,
    I_LO,
    INT8_THRESHOLD,
    LN_R,
    MASSIVE_FLOOR,
    MASSIVE_RATIO,
    N_BINS,
    QUANTILE_REL_ERROR,
    SIGMAS,
    SLOTS,
    STATE_VERSION,
    Accumulator,
    ChannelAbsMax,
    ChannelSquares,
    LogHistogram,
    Massive,
    Moments,
    MomentSums,
    NonFinite,
    R,
    ThresholdCounts,
    TokenKurtosis,
    TopK,
    bin_edges,
    bin_midpoint,
    copy_entries,
    copy_entry,
)
from diffquant.profile.sites import Layout, layer_of, layout_of, read_query_positions, view_place

__all__ = [
    "BINS_PER_OCTAVE",
    "FINE_BITS",
    "I_HI",
    "I_LO",
    "INT8_THRESHOLD",
    "LN_R",
    "MASSIVE_FLOOR",
    "MASSIVE_RATIO",
    "N_BINS",
    "QUANTILE_REL_ERROR",
    "R",
    "SIGMAS",
    "STATE_VERSION",
    "SiteStats",
    "bin_edges",
    "bin_midpoint",
]

# ------------------------------------------------------------------------------------- histogram binning
# The bins (edges E_j, I_LO .. I_HI, the zero bin) are defined in diffquant/profile/accumulators.py; here the
# fast bit-pattern binning of one update: fine codes, folded into bins by a fixed table.
_FINE = 1 << FINE_BITS
_M = [round(_FINE * 2.0 ** (k / BINS_PER_OCTAVE)) for k in range(BINS_PER_OCTAVE)] + [2 * _FINE]

_MAG_CODES = 1 << (8 + FINE_BITS)  # fine code of a magnitude: 8 exponent bits, FINE_BITS mantissa bits
_SHIFT32 = 23 - FINE_BITS


def _fold_table() -> torch.Tensor:
    """Dense slot (sign * SLOTS + slot) of every signed fine code (sign bit, exponent, FINE_BITS mantissa)."""
    k_of_m = torch.searchsorted(
        torch.tensor(_M[:BINS_PER_OCTAVE]), torch.arange(_FINE, 2 * _FINE), right=True
    ).sub_(1)  # bin within the octave of each fine mantissa
    exp = torch.arange(256).unsqueeze(1)
    slot = 1 + (exp - 127) * BINS_PER_OCTAVE + k_of_m.unsqueeze(0) - I_LO
    slot[0] = 0  # exponent field 0: zeros and subnormals
    slot[255] = N_BINS  # Inf / NaN never get here (excluded); clamp anyway
    slot = slot.reshape(-1)
    neg = torch.where(slot == 0, 0, slot + SLOTS)  # negative zero -> the one zero bin
    return torch.cat([slot, neg])


_FOLD = _fold_table()
_FOLDS: dict[torch.device, torch.Tensor] = {}  # _FOLD on each other device an update came from


def _fold_on(device: torch.device) -> torch.Tensor:
    """The fold table on ``device`` (copied once per device: index_add_ needs its index beside the counts)."""
    if device.type == "cpu":
        return _FOLD
    if device not in _FOLDS:
        _FOLDS[device] = _FOLD.to(device)
    return _FOLDS[device]


# The bin within its octave of each FINE_BITS-bit mantissa (the native pass computes a value's slot as
# 1 + (exponent - 1) * BINS_PER_OCTAVE + _K_OF_M[mantissa], the slots _FOLD holds).
_K_OF_M = (
    torch.searchsorted(torch.tensor(_M[:BINS_PER_OCTAVE]), torch.arange(_FINE, 2 * _FINE), right=True)
    .sub_(1)
    .to(torch.int32)
)
_CODE_6 = int(torch.tensor(INT8_THRESHOLD, dtype=torch.float32).view(torch.int32)) >> _SHIFT32
_CODE_100 = int(torch.tensor(MASSIVE_FLOOR, dtype=torch.float32).view(torch.int32)) >> _SHIFT32

_SCAN_CHUNK = 1 << 20
_SUBSET_MIN = 1 << 16
_BLOCK = 1 << 20  # elements per block of the blocked passes (moments: 4x; fewer, larger ops win on CPU)
# Fast paths that leave every statistic unchanged (masked map chunks gathered once); tests turn this off to
# compare with the general path.
FAST = True
# The fused pass (issue 27): the same arithmetic as the plain one in fewer, cache-sized traversals (row sums
# blocked, histogram states added densely on merge, the map metrics' cheaper equivalents in
# attention_metrics). Bit for bit the plain path's statistics (tests/test_stats.py compares to_dict);
# DIFFQUANT_PROFILE_FUSED=0 selects the plain path.
FUSED = os.environ.get("DIFFQUANT_PROFILE_FUSED", "1") != "0"
_SUM_BLOCK = 1 << 18  # elements per block of the fused float64 row sums (a 2 MiB float64 copy, cache-sized)
# The torch path's unmasked updates read their small results from the device in one transfer
# (SiteStats._update_bundled): the same statistics, bit for bit; tests turn it off to compare.
BUNDLED = True
# The native pass (diffquant/kernels/native.py: two C traversals instead of the torch passes) for unmasked
# finite float32 chunks, part of the fused path; DIFFQUANT_NATIVE=0 (or no C compiler) keeps torch.
NATIVE = native.ENABLED


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
    """(dense signed bin counts (2 * SLOTS, int64, on the host), #|x| >= 6, #|x| >= 100) of the entries of 1-D
    ``flat`` where ``ok`` (None: all; the counted entries must be finite): :func:`_histogram_on_device`, then
    the bins and both counts to the host at once."""
    dense, counts = _histogram_on_device(flat, ok)
    # the bins go to the host (the accumulator's state) with the counts, at once
    if dense.device.type != "cpu":
        both = torch.cat([dense, counts]).cpu()
        dense, counts = both[:-2], both[-2:]
    ge6, ge100 = counts.tolist()
    return dense, ge6, ge100


def _histogram_on_device(flat: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense signed bin counts (2 * SLOTS, int64), [#|x| >= 6, #|x| >= 100] (int64)) of the entries of 1-D
    ``flat`` where ``ok``, on ``flat``'s device.

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
    dense = torch.zeros(2 * SLOTS, dtype=torch.int64, device=fine.device).index_add_(
        0, _fold_on(fine.device), fine
    )
    fine = fine.view(2, _MAG_CODES)
    return dense, torch.stack([fine[:, _CODE_6:].sum(), fine[:, _CODE_100:].sum()])


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


# -------------------------------------------------------------------------------------------- moments
_SQUARE_LO, _SQUARE_HI = 2.0**-50, 2.0**60  # float32 squares of magnitudes in this range neither overflow
# nor (at the largest one) underflow; a channel far below the largest counts as 0, which moves no kurtosis
_TINY_S2 = 2.0**-50  # rows with mean squared deviation below this are redone in float64 (float32 underflow)


def _row_moments(rows: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """:func:`_row_moments_block` over blocks of about 4 x _BLOCK elements (whole rows), so that the float32 /
    float64 temporaries stay bounded (memory flat in the tokens seen) while each op is large enough that its
    dispatch cost does not dominate (measured: 2^18-element blocks took 2-3x longer than 2^22)."""
    return _in_row_blocks(_row_moments_block, rows, ok)


def _in_row_blocks(block: Callable[..., tuple[torch.Tensor, ...]], rows: torch.Tensor, ok) -> tuple:
    """``block(rows, ok)`` over blocks of about 4 x _BLOCK elements (whole rows), its per-row outputs
    concatenated (:func:`_row_moments`; an output that is None stays None)."""
    step = max(1, 4 * _BLOCK // max(rows.shape[1], 1))
    if rows.shape[0] <= step:
        return block(rows, ok)
    parts = [
        block(rows[i : i + step], None if ok is None else ok[i : i + step])
        for i in range(0, rows.shape[0], step)
    ]
    return tuple(None if cols[0] is None else torch.cat(cols) for cols in zip(*parts, strict=True))


def _row_moments_block(rows: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Per-row (n, sum, M2, M3, M4) in float64 (central sums about each row's own mean) of the entries of 2-D
    ``rows`` where ``ok`` (None: all).

    The row sums are float64 (exact means); for float32 rows the deviations d = x - c from the float32-rounded
    mean c and the power sums S_k = sum d^k are float32 (x - c is exact to half an ulp of d, the sums are
    pairwise), then shifted to the exact mean in float64: with delta = mean - c,
    M2 = S2 - n delta^2, M3 = S3 - 3 delta S2 + 2 n delta^3, M4 = S4 - 4 delta S3 + 6 delta^2 S2 - 3 n delta^4.
    Rows whose float32 sums are not finite or whose mean square deviation is below 2^-50 (underflow), or zero,
    are redone in float64 (constant rows then give M2 == 0 exactly); a row of one entry only when not finite.
    """
    n, s, m2, m3, m4, again = _row_moments_parts(rows, ok)
    if again is not None:
        idx = again.nonzero().squeeze(1)
        if idx.numel():
            sub = _row_moments_block(rows[idx].to(torch.float64), None if ok is None else ok[idx])
            for dst, src in zip((m2, m3, m4), sub[2:], strict=True):
                dst[idx] = src
    return n, s, m2, m3, m4


def _row_moments_parts(rows: torch.Tensor, ok: torch.Tensor | None) -> tuple[Any, ...]:
    """:func:`_row_moments_block` before its float64 redo: (n, sum, M2, M3, M4, the rows to redo as a bool
    mask, or None for float64 rows), every one on ``rows``' device (no wait for it)."""
    width = rows.shape[1]
    if ok is None:
        n = torch.full((rows.shape[0],), float(width), dtype=torch.float64, device=rows.device)
        s = _row_sums64(rows, None)
    else:
        n = ok.sum(-1, dtype=torch.float64)
        s = _row_sums64(rows, ok)
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
    again = None
    if rows.dtype != torch.float64:
        # A row of one counted entry is exact here (its mean is the value, every deviation 0, M2 = M3 = M4
        # = 0: the float64 redo's bits), so only its non-finite sums send it there: DIFF V1's 0-d lambda
        # and other one-wide rows would otherwise be redone, and read again, on every update.
        again = ~torch.isfinite(s4) | (((s2 <= _TINY_S2 * n) | (m2 <= 0)) & (n > 1))
        again &= n > 0
    return n, s, m2, m3, m4, again


def _row_blocks(n_rows: int, width: int) -> list[tuple[int, int]]:
    """Row ranges of the fused row sums: about _SUM_BLOCK elements each, never a one-row block among
    several (a reduction with one output splits its row across threads, which rounds differently; with two
    or more outputs each row is reduced whole, as in one call over every row)."""
    step = max(2, _SUM_BLOCK // max(width, 1))
    if n_rows <= step:
        return [(0, n_rows)]
    starts = list(range(0, n_rows, step))
    if n_rows - starts[-1] == 1:
        starts.pop()  # fold a one-row tail into the block before it
    return [(a, b) for a, b in zip(starts, [*starts[1:], n_rows], strict=True)]


def _row_sums64(rows: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """Float64 sums of the rows of 2-D ``rows`` (entries where ``ok`` is False count as 0). The plain path
    casts the whole tensor to float64 at once (``sum(dtype=float64)`` copies it first); the fused one casts
    cache-sized row blocks: the same per-row reductions, so the same bits, without a tensor-sized copy."""
    if not FUSED:
        src = rows if ok is None else torch.where(ok, rows, 0.0)
        return src.sum(-1, dtype=torch.float64)
    blocks = _row_blocks(rows.shape[0], rows.shape[1])
    out = []
    for a, b in blocks:
        blk = rows[a:b] if ok is None else torch.where(ok[a:b], rows[a:b], 0.0)
        out.append(blk.sum(-1, dtype=torch.float64))
    return out[0] if len(out) == 1 else torch.cat(out)


def _combine_rows(n: torch.Tensor, s: torch.Tensor, m2, m3, m4) -> MomentSums:
    """Central moments of the union of rows from per-row (n, sum, M2, M3, M4): shift each row's sums from
    its mean to the overall mean (delta = row mean - mean; Sum (e + delta)^k with Sum e = 0), in float64.
    The count comes back with the sums, in one transfer (on a GPU each is a wait for the device)."""
    return _moment_sums(_combine_rows_on_device(n, s, m2, m3, m4).tolist())


def _moment_sums(out: list[float]) -> MomentSums:
    """:data:`MomentSums` from :func:`_combine_rows_on_device`'s five numbers."""
    if out[0] == 0:
        return 0, 0.0, 0.0, 0.0, 0.0
    return int(out[0]), *out[1:]


def _combine_rows_on_device(n: torch.Tensor, s: torch.Tensor, m2, m3, m4) -> torch.Tensor:
    """[count, mean, M2, M3, M4] (float64) of the union of rows, on their device (:func:`_combine_rows`)."""
    total = n.sum()
    mean = s.sum() / total.clamp_min(1.0)  # what the count's own division gives for any count > 0
    delta = torch.where(n > 0, s / n.clamp_min(1.0), mean) - mean
    d2 = delta * delta
    return torch.stack(
        [
            total,
            mean,
            (m2 + n * d2).sum(),
            (m3 + 3.0 * delta * m2 + n * d2 * delta).sum(),
            (m4 + 4.0 * delta * m3 + 6.0 * d2 * m2 + n * d2 * d2).sum(),
        ]
    )


class _Small(NamedTuple):
    """An unmasked update's small results, on the host (:func:`_read_small`)."""

    lo: float
    hi: float
    sums: MomentSums
    kurtosis: Any  # KurtosisSums; the rows' (n, M2, M4, width) after a float64 redo; None: not token rows
    dense: torch.Tensor  # the histogram's dense slot counts (int64)
    ge6: int
    ge100: int
    absmax: torch.Tensor | None  # float64, flattened
    sumsq: torch.Tensor | None  # float64, flattened
    located: list[float] | None  # the count above 100, the first entries' values and indices (_top_read)


def _read_small(
    rows: torch.Tensor,
    absmax: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    per_token: bool,
    located: torch.Tensor | None = None,
) -> _Small | None:
    """The small results of an unmasked update of the 2-D contiguous ``rows`` (every entry counted): extremes,
    the rows' combined moments and (``per_token``) token kurtosis, the histogram and its two counts, and the
    given per-channel ``absmax`` / ``sumsq`` (device tensors the caller computed), all computed on the device
    first and then moved in one transfer: on a GPU each read is a wait for the device, and the statistics
    one at a time waited about ten times per site and update. The same arithmetic as reading each one where
    the general path does. None when a value is not finite (the general path counts and locates it). Rows
    whose float32 moments need float64 (:func:`_row_moments_block`) are redone after the transfer, which
    reads again (rare: constant or tiny-variance rows). ``located`` (float64, from :func:`_top_read`)
    rides in the same transfer: the top-k and massive entries, found on the device."""
    flat = rows.reshape(-1)
    width = rows.shape[1]
    n_r, s_r, m2_r, m3_r, m4_r, again = _in_row_blocks(_row_moments_parts, rows, None)
    dense, counts = _histogram_on_device(flat, None)
    zeros = flat.new_zeros(2, dtype=torch.float64)
    parts = [
        torch.stack(list(torch.aminmax(flat))).to(torch.float64),
        _combine_rows_on_device(n_r, s_r, m2_r, m3_r, m4_r),
        TokenKurtosis.row_sums(n_r, m2_r, m4_r, width) if per_token else zeros,
        (again.sum() if again is not None else zeros[0]).to(torch.float64).reshape(1),
        counts.to(torch.float64),  # counts below 2^53: exact in float64
        dense.to(torch.float64),
        *(t.to(torch.float64).reshape(-1) for t in (absmax, sumsq, located) if t is not None),
    ]
    host = torch.cat(parts).cpu()  # the one transfer
    lo, hi, n, mean, m2, m3, m4, k_total, k_kept, n_again, ge6, ge100 = host[:12].tolist()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    sums = _moment_sums([n, mean, m2, m3, m4])
    kurtosis: Any = KurtosisSums(k_total, k_kept, rows.shape[0]) if per_token else None
    if n_again:  # what _row_moments gives: the flagged rows in float64
        n_r, s_r, m2_r, m3_r, m4_r = _row_moments(rows, None)
        sums = _combine_rows(n_r, s_r, m2_r, m3_r, m4_r)
        kurtosis = (n_r, m2_r, m4_r, width) if per_token else None
    at = 12 + 2 * SLOTS
    dense_host = host[12:at].to(torch.int64)
    cut = []
    for t in (absmax, sumsq):
        cut.append(None if t is None else host[at : at + t.numel()])
        at += 0 if t is None else t.numel()
    read = None if located is None else host[at : at + located.numel()].tolist()
    return _Small(lo, hi, sums, kurtosis, dense_host, int(ge6), int(ge100), *cut, read)


def _histogram_bar(dense: torch.Tensor, k: int) -> tuple[float | None, int]:
    """(lower edge of the bin holding the k-th largest magnitude, number of magnitudes >= that edge), from one
    chunk's dense histogram; (None, 0) when the k-th largest magnitude lies in the zero bin (or k < 1)."""
    if k < 1:
        return None, 0
    mag = dense.view(2, SLOTS).sum(0)
    from_top = mag[1:].flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, k))
    if i >= N_BINS:
        return None, 0
    slot = N_BINS - i  # 1-based slot of bin I_LO + slot - 1
    return EDGES[slot - 1], int(from_top[i])


# ------------------------------------------------------------------------------------- top-k entries
def _unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    """The coordinates of flat (row-major) index ``i`` in ``shape``, on the host (torch.unravel_index's)."""
    coords = []
    for size in reversed(shape):
        i, c = divmod(i, size)
        coords.append(c)
    return coords[::-1]


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


class _MaskPositions(NamedTuple):
    """What a gathered map update reads off its causal mask on the host: the flat indices of the visible
    (query, key) entries (on the map's device) and each query row's absolute position."""

    visible: torch.Tensor
    qpos: list[int]


# The last mask seen by a gathered map update, with what was read off it: a layer's map taps (logits,
# probs, their DIFF components, the difference) share one mask, and so do a forward's layers (the model keeps
# one mask per shape: diffquant.models.attention._valid_mask), while reading its positions is a host wait
# each time on a GPU. Keyed by the tensor the mask views (a weak reference), the view's place in it (offset,
# shape, strides: each layer slices its own view of the shared mask), its version counter (an in-place
# change) and the device; dropped when that tensor is freed (the visible indices of a 4,096-token map are
# 64 MiB).
_last_mask: tuple[weakref.ref, tuple, _MaskPositions] | None = None


def _forget_mask(ref: weakref.ref) -> None:
    global _last_mask
    if _last_mask is not None and _last_mask[0] is ref:
        _last_mask = None


def forget_mask_positions() -> None:
    """Drop what was read off the last mask (the model keeps its masks, so the read would stay with them:
    the profiler calls this when it is removed)."""
    global _last_mask
    _last_mask = None


def _mask_positions(valid: torch.Tensor, mask: torch.Tensor) -> _MaskPositions:
    """:class:`_MaskPositions` of ``valid`` (the map's mask; ``mask`` is it as a (T, S) bool on the map's
    device), read once per mask: views of one tensor at one place share what was read."""
    global _last_mask
    root, where = view_place(valid)
    where = (*where, mask.device)
    if _last_mask is not None:
        ref, known_where, known = _last_mask
        if ref() is root and known_where == where:
            return known
    known = _MaskPositions(mask.reshape(-1).nonzero().squeeze(1), read_query_positions(valid))
    _last_mask = (weakref.ref(root, _forget_mask), where, known)
    return known


_KEY_CHUNK = 1 << 22  # entries per packed-key top-k (their int64 keys: 32 MiB)
_LOW32 = (1 << 32) - 1
# The largest update (entries) whose top-k runs as one packed-key top-k on the device (no wait); larger ones
# take the host-guided search (:func:`_select`: the histogram's bar narrows it to a few thousand candidates
# in one pass, two waits). The packed search reads and writes about 115 bytes per entry (building the int64
# keys, then a radix select over them) against the ~40 of the update's other passes, so on a large tensor
# it may cost more than the two waits it saves. A provisional bound, not yet measured on a GPU:
# analysis/profile/device_topk.py times both (the GPU kit's cli stage runs it).
DEVICE_TOPK_MAX = 1 << 24


def _packable(af: torch.Tensor) -> bool:
    """Whether :func:`_top_by_key` serves ``af``: magnitudes on a device (a CPU's search is
    :func:`_select`, cheaper there: it narrows to the histogram's bar first, and a wait costs a CPU
    nothing) that float32 holds exactly, at most :data:`DEVICE_TOPK_MAX` of them."""
    return (
        af.device.type != "cpu"
        and af.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and af.numel() <= min(DEVICE_TOPK_MAX, _LOW32)
    )


def _top_by_key(af: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of the first ``k`` entries of 1-D magnitudes ``af`` (excluded entries hold -1; ``k`` at
    most the number of the others) in the order (-|x|, flat index), without a host wait: what
    :func:`_select` returns (in that order), by one top-k over unique int64 keys.

    A non-negative float32's bit pattern orders as the number does, so key = bits << 32 | (2^32 - 1 - index)
    orders by magnitude, then by the lower index on ties; an excluded -1 has negative bits, so its key is
    below every other. :func:`_select` needs the k-th value and the count of entries above it on the host
    (two data-sized selections, each a wait on a GPU); this needs none. Chunks of :data:`_KEY_CHUNK` keep
    the keys' memory bounded: the top k of each chunk, then the top k of those."""
    if k <= 0:
        return af.new_zeros(0, dtype=torch.int64)
    bits = af.to(torch.float32).contiguous().view(torch.int32)
    best = []
    for start in range(0, bits.numel(), _KEY_CHUNK):
        part = bits[start : start + _KEY_CHUNK].to(torch.int64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=af.device)
        keys = torch.bitwise_or(torch.bitwise_left_shift(part, 32), _LOW32 - index)
        best.append(torch.topk(keys, min(k, keys.numel())).values)
    keys = best[0] if len(best) == 1 else torch.topk(torch.cat(best), k).values
    return _LOW32 - torch.bitwise_and(keys[:k], _LOW32)


def _top_read(
    flat: torch.Tensor, af: torch.Tensor, k: int, to_flat: Callable[[torch.Tensor], torch.Tensor] | None
) -> torch.Tensor | None:
    """The count of magnitudes above :data:`MASSIVE_FLOOR`, then the top ``k`` entries of ``af`` (magnitudes
    of ``flat``'s entries, or of a gathered map's visible ones: ``to_flat`` maps those indices to
    ``flat``'s) in the order (-|x|, flat index), as one float64 device tensor: the count, their signed
    values, then their flat indices (exact below 2^53), for :func:`_read_small` to carry in its one
    transfer. With ``k`` at least the massive cap, the massive candidates are the first of those entries
    (the count says how many), so they need no search of their own: on a GPU that was a data-sized
    selection, a search and a read, three waits or more. None where :func:`_top_by_key` does not serve
    ``af`` (the host search runs after the transfer)."""
    if not _packable(af):
        return None
    idx = _top_by_key(af, k)
    idx = to_flat(idx) if to_flat is not None else idx
    count = (af > MASSIVE_FLOOR).sum().to(torch.float64).reshape(1)
    return torch.cat([count, _values_and_indices(flat, idx)])


def _first_entries(both: list[float], n: int) -> list[float]:
    """The first ``n`` of entries read as their values, then their flat indices: the same layout."""
    half = len(both) // 2
    return both[:n] + both[half : half + n]


def _values_and_indices(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat``'s values at ``idx``, then ``idx`` itself, as one float64 tensor (one transfer reads both;
    flat indices below 2^53 are exact in float64)."""
    return torch.cat([flat[idx].to(torch.float64), idx.to(torch.float64)])


def _kept_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """The sizes of ``shape``'s head / channel dims: what the per-channel statistics (abs-max, sums of
    squares) keep of an update tensor."""
    return tuple(n for n, d in zip(shape, layout, strict=False) if d in ("head", "channel"))


def _native_keep(
    layout: Layout, shape: tuple[int, ...]
) -> tuple[tuple[int, int, int, int], tuple[int, ...]] | None:
    """The native pass's kept index of ``layout`` / ``shape`` (the head / channel dims the abs-max and the
    sums of squares keep, as :meth:`SiteStats._absmax_of` reduces): ((inner, groups, percol, n_keep), the
    kept shape). Rows are every dim but the last; at most one kept dim among them (``groups`` its size,
    ``inner`` the rows below it); ``percol``: the last dim is kept too. None for a layout with no dims."""
    if not layout:
        return None
    kept = [i for i, d in enumerate(layout[:-1]) if d in ("head", "channel")]
    assert len(kept) <= 1, f"layout {layout}: two kept dims before the last"
    percol = int(layout[-1] in ("head", "channel"))
    groups = shape[kept[0]] if kept else 1
    inner = math.prod(shape[kept[0] + 1 : -1]) if kept else 1
    keep_shape = _kept_shape(shape, layout)
    n_keep = groups * (shape[-1] if percol else 1)
    return (max(inner, 1), groups, percol, n_keep), keep_shape


# ---------------------------------------------------------------------------------- the accumulator table
def _feed_moments(acc: Moments, c: tuple[int, float, float, MomentSums]) -> None:
    n, lo, hi, sums = c
    acc.add_extremes(n, lo, hi)
    acc.add_sums(sums)


def _feed_nonfinite(acc: NonFinite, c: tuple[list[int], dict[str, Any]]) -> None:
    counts, first = c
    acc.add(*counts)
    acc.note(first)


class KurtosisSums(NamedTuple):
    """A token-kurtosis contribution already summed (:meth:`TokenKurtosis.row_sums`, read on the host)."""

    total: float
    kept: float
    rows: int


def _feed_token_kurtosis(
    acc: TokenKurtosis, c: int | KurtosisSums | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
) -> None:
    if isinstance(c, int):
        acc.skip(c)
    elif isinstance(c, KurtosisSums):
        acc.add_sums(*c)
    else:
        acc.add_rows(*c)


def _feed_massive(acc: Massive, c: tuple[int, list[dict[str, Any]]]) -> None:
    count, entries = c
    acc.add_count(count)
    if count:
        acc.add(entries)


def _star(method: Callable[..., None]) -> Callable[[Any, tuple], None]:
    return lambda acc, c: method(acc, *c)


class _Slot(NamedTuple):
    """One accumulator of a SiteStats: a row of :data:`_TABLE`."""

    attr: str  # the SiteStats attribute that holds it
    cls: type[Accumulator]
    params: tuple[str, ...]  # the SiteStats parameters its constructor takes
    feed: Callable[[Any, Any], None]  # feed(accumulator, one update's contribution)


# Every accumulator of a SiteStats, declared once, in the order of ACCUMULATORS (merge order). __init__,
# merge, to_dict and from_dict loop over it. Each update path (torch, gathered map, native) computes one
# contribution per row (the comments say what) and hands all of them to SiteStats._feed, None meaning
# "nothing from this update"; _feed refuses a set that misses a row, so an accumulator added here that a path
# does not feed is an error on that path's first update, not a statistic silently left empty.
_TABLE: dict[str, _Slot] = {
    # (flattened float64 CPU abs-max, kept shape)
    "absmax": _Slot("_absmax_acc", ChannelAbsMax, ("site",), _star(ChannelAbsMax.add)),
    # (count, min, max, central sums (n, mean, M2, M3, M4)) of the counted values
    "moments": _Slot("_moments_acc", Moments, (), _feed_moments),
    # ([#NaN, #+Inf, #-Inf], the update's first non-finite entry {value, loc})
    "nonfinite": _Slot("_nonfinite", NonFinite, (), _feed_nonfinite),
    # per-row (n, M2, M4, width) of token rows (channel layouts), their KurtosisSums, or the number of tokens
    # skipped whole
    "token_kurtosis": _Slot("_tk", TokenKurtosis, (), _feed_token_kurtosis),
    # the update's own top-k entries
    "top": _Slot("_top_acc", TopK, ("topk",), TopK.add),
    # dense signed slot counts (_histogram)
    "hist": _Slot("_hist", LogHistogram, (), LogHistogram.add_dense),
    # the count of |x| >= 6
    "thresholds": _Slot("_thresholds", ThresholdCounts, (), ThresholdCounts.add),
    # (the count of |x| > 100, the first massive_cap of them as entries)
    "massive": _Slot("_massive_acc", Massive, ("massive_cap",), _feed_massive),
    # (per-channel float64 sums of squares, counts) (channel layouts)
    "squares": _Slot("_squares", ChannelSquares, ("site",), _star(ChannelSquares.add)),
}
assert tuple(slot.cls for slot in _TABLE.values()) == ACCUMULATORS, "_TABLE: one row per accumulator"


# ------------------------------------------------------------------------------------------- SiteStats
class SiteStats:
    """Streaming statistics of the activations seen at one site (see the module docstring for definitions).

    The state is one accumulator per statistic (diffquant/profile/accumulators.py), one per row of
    :data:`_TABLE`. :meth:`update` makes one pass over the tensor (flat values, magnitudes, histogram computed
    once) on one of three paths (torch, a gathered attention map, the native C pass), each of which computes
    every accumulator's contribution and then feeds them all at once through :meth:`_feed`, which checks that
    none is missing; :meth:`merge`, :meth:`to_dict` and :meth:`from_dict` loop over the table.

    Args:
        site: site name (``layers.3.attn.logits``); locations report it and its layer.
        kind: site kind (``q``, ``logits``, ``resid``, ``lambda`` ...), which fixes the tensor layout.
        topk: how many largest magnitudes are kept with their locations.
        massive_cap: how many massive-activation candidates (|x| > 100) are kept with their locations; the
            number of candidates is always counted exactly.
    """

    # The accumulators, set from _TABLE's attribute column (the annotations name their types for readers).
    _absmax_acc: ChannelAbsMax
    _moments_acc: Moments
    _nonfinite: NonFinite
    _tk: TokenKurtosis
    _top_acc: TopK
    _hist: LogHistogram
    _thresholds: ThresholdCounts
    _massive_acc: Massive
    _squares: ChannelSquares

    def __init__(self, site: str, kind: str, topk: int = DEFAULT_TOPK, massive_cap: int = 1000) -> None:
        if topk < 0 or massive_cap < 0:
            raise ValueError(f"site {site!r}: topk and massive_cap must be >= 0")
        self.site = site
        self.kind = kind
        self.topk = int(topk)
        self.massive_cap = int(massive_cap)
        self.layout: Layout | None = None  # known after the first update
        for slot in _TABLE.values():
            setattr(self, slot.attr, slot.cls(*(getattr(self, p) for p in slot.params)))

    def _accumulators(self) -> tuple[Accumulator, ...]:
        """Every accumulator, in the order of :data:`_TABLE` (that of
        :data:`~diffquant.profile.accumulators.ACCUMULATORS`)."""
        return tuple(getattr(self, slot.attr) for slot in _TABLE.values())

    def _feed(self, path: str, **contributions: Any) -> None:
        """Add one update's ``contributions``, one per row of :data:`_TABLE` by name (None: nothing from this
        update), in table order.

        Every path computes all of them first and calls this once, so a path that declines part way (the
        native pass) has changed nothing, and an abs-max shape mismatch raises before any change. A path
        must name every row: an accumulator added to the table that some path does not feed raises here,
        on that path's first update, instead of staying empty (the bug this check exists for).
        """
        if contributions.keys() != _TABLE.keys():
            missing = [name for name in _TABLE if name not in contributions]
            unknown = [name for name in contributions if name not in _TABLE]
            raise RuntimeError(
                f"site {self.site!r}: the {path} update path feeds no contribution to accumulator(s) "
                f"{missing}{f' and feeds unknown {unknown}' if unknown else ''}: each path must give every "
                "row of stats._TABLE a contribution (None when the update adds nothing to it)"
            )
        for name, slot in _TABLE.items():
            if contributions[name] is not None:
                slot.feed(getattr(self, slot.attr), contributions[name])

    # ------------------------------------------------------------------------- state, by statistic
    @property
    def count(self) -> int:
        """Finite, valid values seen."""
        return self._moments_acc.count

    @property
    def min(self) -> float | None:
        return self._moments_acc.min

    @property
    def max(self) -> float | None:
        return self._moments_acc.max

    @property
    def _moments(self) -> MomentSums:
        return self._moments_acc.sums

    @property
    def nan_count(self) -> int:
        return self._nonfinite.nan

    @property
    def posinf_count(self) -> int:
        return self._nonfinite.posinf

    @property
    def neginf_count(self) -> int:
        return self._nonfinite.neginf

    @property
    def first_nonfinite(self) -> dict[str, Any] | None:
        """The earliest NaN / Inf entry: {value, loc}."""
        return self._nonfinite.first

    @property
    def count_abs_ge_6(self) -> int:
        return self._thresholds.ge6

    @property
    def count_abs_gt_100(self) -> int:
        return self._massive_acc.count

    @property
    def _top(self) -> list[dict[str, Any]]:
        return self._top_acc.entries

    @property
    def _massive(self) -> list[dict[str, Any]]:
        return self._massive_acc.entries

    @property
    def _absmax(self) -> torch.Tensor | None:
        """Channel abs-max, float64, CPU, flattened."""
        return self._absmax_acc.amax

    @property
    def _absmax_shape(self) -> tuple[int, ...] | None:
        return self._absmax_acc.shape

    @property
    def _zero(self) -> int:
        return self._hist.zero

    @property
    def _pos(self) -> dict[int, int]:
        return self._hist.pos

    @property
    def _neg(self) -> dict[int, int]:
        return self._hist.neg

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
        if valid is None:
            where = (flat, shape, layout, None, tokens, sample_offset, pos_offset)
            if self._native_ready(x, layout):
                keep = _native_keep(layout, shape)
                if self._update_native(x.view(-1, shape[-1]), layout, keep, where):
                    return
            if BUNDLED and flat.numel() and self._update_bundled(x, layout, where):
                return
        vflat = None
        if valid is not None:
            vflat = valid.to(device=x.device, dtype=torch.bool).expand(shape).reshape(-1)
        # Fast path: min / max propagate NaN, so finite extremes of the valid entries mean all are finite.
        ok = vflat  # None: every entry counts
        nonfinite = None
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
            vmask = None if vflat is None else vflat.view(shape)
            nonfinite = (
                torch.stack([torch.count_nonzero(m) for m in special]).tolist(),
                self._first_nonfinite(
                    x, finite.view(shape), vmask, valid, layout, tokens, sample_offset, pos_offset
                ),
            )
            lo, hi, n_ok = _masked_extremes(flat, ok)
        af_flat = flat.abs()  # magnitudes; excluded entries -> -1 (below every real magnitude)
        if ok is not None:
            af_flat.masked_fill_(~ok, -1.0)
        absmax = self._absmax_of(af_flat.view(shape), layout)
        per_token = bool(layout) and layout[-1] == "channel"
        if n_ok == 0:  # nothing counted: every token has a non-finite / masked channel (or no channels)
            self._feed(
                "torch",
                absmax=absmax,
                moments=None,
                nonfinite=nonfinite,
                token_kurtosis=math.prod(shape[:-1]) if per_token else None,
                top=None,
                hist=None,
                thresholds=None,
                massive=None,
                squares=None,
            )
            return

        squares = self._squares_of(x, ok, layout, max(abs(lo), abs(hi)))
        dense, ge6, ge100 = _histogram(flat, ok)
        width = shape[-1] if shape else 1
        rows = flat.view(-1, width)
        row_ok = None if ok is None else ok.view(-1, width)
        n_r, s_r, m2_r, m3_r, m4_r = _row_moments(rows, row_ok)
        qpos = None
        if valid is not None and "key" in layout:
            qpos = read_query_positions(valid)
        where = (flat, shape, layout, qpos, tokens, sample_offset, pos_offset)
        top, massive = self._largest(af_flat, n_ok, dense, ge100, where)
        self._feed(
            "torch",
            absmax=absmax,
            moments=(n_ok, lo, hi, _combine_rows(n_r, s_r, m2_r, m3_r, m4_r)),
            nonfinite=nonfinite,
            token_kurtosis=(n_r, m2_r, m4_r, width) if per_token else None,
            top=top,
            hist=dense,
            thresholds=ge6,
            massive=massive,
            squares=squares,
        )

    def _update_bundled(self, x: torch.Tensor, layout: Layout, where: tuple) -> bool:
        """The torch path of an unmasked update, its small results read from the device in one transfer
        (:func:`_read_small`: the general path below waits once per statistic). The same arithmetic as that
        path, so the same bits. Returns False (nothing done) when a value is not finite: the general path
        counts and locates it. The top-k and massive entries ride in the same transfer where the device
        search serves (:func:`_top_read`); otherwise data-sized selections follow, then reads of the
        entries."""
        flat, shape = where[0], where[1]
        width = shape[-1] if shape else 1
        per_token = bool(layout) and layout[-1] == "channel"
        af_flat = flat.abs()
        squares = per_token and x.numel() > 0
        small = _read_small(
            flat.view(-1, width),
            self._absmax_on_device(af_flat.view(shape), layout) if layout else None,
            self._sumsq_on_device(x, layout, wide=False) if squares else None,
            per_token,
            _top_read(flat, af_flat, self._read_k(flat.numel()), None),
        )
        if small is None:
            return False
        absmax = None
        if layout:
            absmax = (small.absmax, _kept_shape(shape, layout))
        squares_c = None
        if squares:
            amax = max(abs(small.lo), abs(small.hi))
            if x.dtype == torch.float32 and not _SQUARE_LO <= amax < _SQUARE_HI:
                squares_c = self._squares_of(x, None, layout, amax)  # float64 squares after all (reads again)
            else:
                squares_c = (small.sumsq, self._squares_count(x, layout).reshape(-1))
        top, massive = self._largest(
            af_flat, flat.numel(), small.dense, small.ge100, where, located=small.located
        )
        self._feed(
            "torch",
            absmax=absmax,
            moments=(flat.numel(), small.lo, small.hi, small.sums),
            nonfinite=None,
            token_kurtosis=small.kurtosis,
            top=top,
            hist=small.dense,
            thresholds=small.ge6,
            massive=massive,
            squares=squares_c,
        )
        return True

    def _read_k(self, n_ok: int) -> int:
        """How many of an update's first entries :func:`_top_read` reads: the top-k and the massive cap
        (the massive candidates are the first entries above the floor), at most the counted entries."""
        return min(max(self.topk, self.massive_cap), n_ok)

    def _largest(
        self,
        aflat: torch.Tensor,
        n_ok: int,
        dense: torch.Tensor,
        ge100: int,
        where: tuple,
        to_flat: Callable[[torch.Tensor], torch.Tensor] | None = None,
        located: list[float] | None = None,
    ) -> tuple[list[dict[str, Any]], tuple[int, list[dict[str, Any]]] | None]:
        """The top-k and massive contributions of one update: ``aflat`` holds the magnitudes (excluded
        entries -1), ``dense`` its histogram (a bar for the top-k search), ``where`` locates entries of the
        update tensor; ``to_flat`` maps indices of ``aflat`` to that tensor's flat indices (gathered maps).
        ``located``: the count above the massive floor and the first entries, already read
        (:func:`_top_read`, in :func:`_read_small`'s transfer)."""
        if located is None:  # not read yet: the device search where it serves, in one read
            read = _top_read(where[0], aflat, self._read_k(n_ok), to_flat)
            located = None if read is None else read.tolist()
        to_flat = to_flat or (lambda idx: idx)
        if located is not None:
            count, first = int(located[0]), located[1:]
            top = self._located(_first_entries(first, min(self.topk, n_ok)), *where[1:])
            if not ge100:
                return top, None
            massive = _first_entries(first, min(self.massive_cap, count))
            return top, (count, self._located(massive, *where[1:]))
        # the host search: the top-k from the histogram's bar, then (|x| >= 100 seen) the candidates
        # |x| > 100 (exact count) in one pass
        bar, n_bar = _histogram_bar(dense, self.topk)
        top = self._entries(to_flat(_select(aflat, self.topk, -0.5, n_ok, bar, n_bar)), *where)
        if not ge100:
            return top, None
        cand = (aflat > MASSIVE_FLOOR).nonzero().squeeze(1)
        pick = cand[_select(aflat[cand], self.massive_cap, MASSIVE_FLOOR, cand.numel())]
        return top, (cand.numel(), self._entries(to_flat(pick), *where))

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
        mask = valid.to(device=x.device, dtype=torch.bool).reshape(t, s)
        if self._native_ready(x, layout) and x.is_contiguous():
            ranges = native.row_ranges(mask)
            if ranges is not None and int((ranges[:, 1] - ranges[:, 0]).sum()) > 0:
                qpos = read_query_positions(valid) if "key" in layout else None
                where = (x.reshape(-1), tuple(x.shape), layout, qpos, tokens, sample_offset, 0)
                keep = _native_keep(layout, tuple(x.shape))
                if self._update_native(x.view(-1, s), layout, keep, where, ranges=ranges):
                    return True
        positions = _mask_positions(valid, mask)
        visible = positions.visible
        width = visible.numel()
        if width == 0:
            return False
        flat = x.reshape(-1)
        vals = flat.view(-1, t * s).index_select(1, visible)
        if vals.dtype != torch.float64:
            small_float = vals.is_floating_point() and vals.element_size() <= 4
            vals = vals.to(torch.float32 if small_float else torch.float64)
        n_ok = vals.numel()
        lead = tuple(x.shape[:-2])
        qpos = positions.qpos if "key" in layout else None
        where = (flat, tuple(x.shape), layout, qpos, tokens, sample_offset, 0)

        def to_flat(ci: torch.Tensor) -> torch.Tensor:  # gathered flat index -> the chunk's flat index
            return torch.div(ci, width, rounding_mode="floor") * (t * s) + visible[ci % width]

        reduce = [i for i, d in enumerate(layout[:-2]) if d != "head"] + [len(lead)]
        keep = tuple(n for n, d in zip(lead, layout, strict=False) if d == "head")
        if BUNDLED and not self._native_ready(vals, layout):  # the small results in one transfer
            af = vals.abs()
            amax = af.view(*lead, width).amax(dim=reduce) if reduce else af
            located = _top_read(flat, af.view(-1), self._read_k(n_ok), to_flat)
            small = _read_small(vals, amax, None, False, located)
            if small is None:
                return False
            top, massive = self._largest(
                af.view(-1), n_ok, small.dense, small.ge100, where, to_flat, small.located
            )
            self._feed(
                "map",
                absmax=(small.absmax, keep),
                moments=(n_ok, small.lo, small.hi, small.sums),
                nonfinite=None,  # every visible entry is finite (else the general path runs)
                token_kurtosis=None,  # a map's last dim is a key, not a channel
                top=top,
                hist=small.dense,
                thresholds=small.ge6,
                massive=massive,
                squares=None,  # likewise
            )
            return True
        lo, hi = torch.stack(list(torch.aminmax(vals))).to(torch.float64).tolist()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return False
        if self._native_ready(vals, layout):
            keep = _native_keep(layout[:-2] + ("key",), (*lead, width))
            if self._update_native(vals, layout, keep, where, to_flat):
                return True
        af = vals.abs()
        amax = af.view(*lead, width).amax(dim=reduce) if reduce else af
        dense, ge6, ge100 = _histogram(vals.view(-1), None)
        top, massive = self._largest(af.view(-1), n_ok, dense, ge100, where, to_flat)
        self._feed(
            "map",
            absmax=(amax.to("cpu", torch.float64).reshape(-1), keep),
            moments=(n_ok, lo, hi, _combine_rows(*_row_moments(vals, None))),
            nonfinite=None,  # every visible entry is finite (else the general path runs)
            token_kurtosis=None,  # a map's last dim is a key, not a channel
            top=top,
            hist=dense,
            thresholds=ge6,
            massive=massive,
            squares=None,  # likewise
        )
        return True

    def _native_ready(self, x: torch.Tensor, layout: Layout) -> bool:
        """Whether the native pass takes this chunk: fused path on, a C compiler found, a non-empty
        float32 tensor with a last dim (0-d lambdas and float64 inputs keep the torch path)."""
        return (
            NATIVE
            and FUSED
            and x.dtype == torch.float32
            and x.dim() >= 1
            and x.numel() > 0
            and x.shape[-1] > 0
            and x.device.type == "cpu"
            and native.available()
        )

    def _update_native(
        self,
        rows: torch.Tensor,
        layout: Layout,
        keep: tuple[tuple[int, int, int, int], tuple[int, ...]] | None,
        where: tuple,
        to_flat: Callable[[torch.Tensor], torch.Tensor] | None = None,
        ranges: torch.Tensor | None = None,
    ) -> bool:
        """Every statistic of the float32 ``rows`` (2-D, contiguous: the chunk's values row by row) from the
        two native traversals (diffquant/kernels/native.py); returns False, having added nothing, when it
        cannot (the torch path then runs). ``keep``: the kept (head / channel) index of each value and the
        abs-max shape, None for a layout with no dims; ``where`` / ``to_flat`` locate entries as in
        :meth:`_largest`. Same state as the torch path: counts, extremes, histogram, abs-max, top-k,
        massive and non-finite entries bit for bit; moments and channel sums of squares are float64 sums in
        another order (see native.py).

        ``ranges`` (T, 2): row r holds values only in columns ranges[r % T, 0] .. ranges[r % T, 1] - 1 (a
        causal map chunk read in place, every row one query). Such a chunk declines a NaN / Inf among its
        visible entries and a top-k the histogram's bar does not bound (the gathered path takes those)."""
        width = rows.shape[1]
        spec = keep[0] if keep is not None else None
        k = self.topk
        try:
            dense, row_sum, n_r, amax, lo, hi, ge6, ge100, n_bad = native.pass1(
                rows, width, spec, _K_OF_M, SLOTS, ranges
            )
        except native.NativeError:
            return False
        n_ok = int(n_r.sum())
        if n_ok == 0 or (ranges is not None and (n_bad or n_ok <= k)):
            return False
        squares = None
        if layout[-1] == "channel" and ranges is None:
            squares = "float32" if _SQUARE_LO <= max(abs(lo), abs(hi)) < _SQUARE_HI else "float64"
        bar, n_bar = _histogram_bar(dense, k)
        use_bar = bar is not None and k < n_ok and n_bar <= max(_SUBSET_MIN, 8 * k)
        if ranges is not None and k > 0 and not use_bar:
            return False
        try:
            m2, m3, m4, sumsq, cand, massive_idx = native.pass2(
                rows,
                width,
                spec,
                row_sum,
                n_r,
                squares,
                bar if use_bar else None,
                n_bar,
                ge100 or None,
                ranges,
            )
        except native.NativeError:
            return False
        if ranges is not None and k > 0 and cand is None:
            return False

        vals = rows.view(-1)
        finite = None
        nonfinite = None
        if n_bad:  # counted and located as the torch path does (a broken model's profile says where)
            finite = torch.isfinite(vals)
            special = [torch.isnan(vals), vals == math.inf, vals == -math.inf]
            flat, shape, _, _, tokens, sample_offset, pos_offset = where
            x = flat.view(shape)
            nonfinite = (
                torch.stack([torch.count_nonzero(m) for m in special]).tolist(),
                self._first_nonfinite(
                    x, finite.view(shape), None, None, layout, tokens, sample_offset, pos_offset
                ),
            )
        absmax = squares = None
        if keep is not None:
            assert amax is not None
            absmax = (amax.to(torch.float64), keep[1])
            if sumsq is not None:
                if finite is None:
                    count = torch.full_like(sumsq, float(n_ok // max(math.prod(keep[1]), 1)))
                else:
                    shape = where[1]
                    reduce = [i for i, d in enumerate(layout) if d not in ("head", "channel")]
                    okv = finite.view(shape).to(torch.float64)
                    count = (okv.sum(dim=reduce) if reduce else okv).reshape(-1)
                squares = (sumsq, count)

        to_flat = to_flat or (lambda idx: idx)
        if k <= 0:
            top = vals.new_zeros(0, dtype=torch.int64)
        elif n_ok <= k:  # every counted value (flat order)
            top = torch.arange(vals.numel()) if finite is None else finite.nonzero().squeeze(1)
        elif cand is not None:
            top = cand[_select(vals[cand].abs(), k, -0.5, cand.numel())]
        else:
            mags = vals.abs()
            if finite is not None:
                mags.masked_fill_(~finite, -1.0)
            top = _select(mags, k, -0.5, n_ok)
        massive = None
        if ge100:  # |x| >= 100 seen: the candidates |x| > 100 were searched (exact count)
            gt100 = massive_idx.numel()
            pick = _select(vals[massive_idx].abs(), self.massive_cap, MASSIVE_FLOOR, gt100)
            massive = (gt100, self._entries(to_flat(massive_idx[pick]), *where))
        self._feed(
            "native",
            absmax=absmax,
            moments=(n_ok, lo, hi, _combine_rows(n_r, row_sum, m2, m3, m4)),
            nonfinite=nonfinite,
            token_kurtosis=(n_r, m2, m4, width) if layout[-1] == "channel" else None,
            top=self._entries(to_flat(top), *where),
            hist=dense,
            thresholds=ge6,
            massive=massive,
            squares=squares,
        )
        return True

    def _first_nonfinite(
        self, x, finite, vmask, valid, layout, tokens, sample_offset, pos_offset
    ) -> dict[str, Any]:
        """The earliest non-finite entry {value: 'nan' / 'inf' / '-inf', loc} of one update (by sample, then
        layout coordinates), so a profile of a broken model says where NaN / Inf first appear, not only how
        many there are."""
        bad = ~finite if vmask is None else ~finite & vmask
        idx = torch.nonzero(bad.reshape(-1))[:1].reshape(-1)
        qpos = read_query_positions(valid) if valid is not None and "key" in layout else None
        entry = self._entries(
            idx, x.reshape(-1), tuple(x.shape), layout, qpos, tokens, sample_offset, pos_offset
        )[0]
        value = entry["value"]
        return {"value": "nan" if value != value else ("inf" if value > 0 else "-inf"), "loc": entry["loc"]}

    @staticmethod
    def _absmax_of(af: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """The abs-max contribution (SmoothQuant act_scales): max |x| over every dim but head / channel
        (excluded entries count as 0), flattened, with its shape; None for a layout with no dims."""
        if not layout:
            return None
        keep = _kept_shape(tuple(af.shape), layout)
        if af.numel() == 0:
            amax = torch.zeros(keep, dtype=torch.float64)
        else:
            amax = SiteStats._absmax_on_device(af, layout).to("cpu", torch.float64)
        return amax.reshape(-1), keep

    @staticmethod
    def _absmax_on_device(af: torch.Tensor, layout: Layout) -> torch.Tensor:
        """:meth:`_absmax_of`'s maxima (non-empty ``af``, a layout with dims), in ``af``'s dtype and device."""
        reduce = [i for i, d in enumerate(layout) if d not in ("head", "channel")]
        return (af.amax(dim=reduce) if reduce else af).clamp_min(0.0)

    @staticmethod
    def _squares_of(
        x: torch.Tensor, ok: torch.Tensor | None, layout: Layout, amax: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The channel-squares contribution: per-channel float64 sum of squares and count over every dim but
        head / channel (layouts whose last dim is ``channel``, else None; entries where flat ``ok`` is False
        are left out; ``amax``: the largest magnitude counted)."""
        if not layout or layout[-1] != "channel" or x.numel() == 0:
            return None
        if ok is not None:  # masked only here: other layouts pay no copy
            x = torch.where(ok.view(x.shape), x, 0.0)
        reduce = [i for i, d in enumerate(layout) if d not in ("head", "channel")]
        # float32 squares would overflow, or all underflow: square in float64
        sumsq = SiteStats._sumsq_on_device(x, layout, wide=not _SQUARE_LO <= amax < _SQUARE_HI)
        if ok is None:
            n = SiteStats._squares_count(x, layout)
        else:
            okv = ok.view(x.shape).to(torch.float64)
            n = okv.sum(dim=reduce) if reduce else okv
        return sumsq.to("cpu").reshape(-1), n.to("cpu").reshape(-1)

    @staticmethod
    def _sumsq_on_device(x: torch.Tensor, layout: Layout, wide: bool) -> torch.Tensor:
        """Per-channel float64 sums of squares of ``x`` on its device (:meth:`_squares_of`); ``wide``: square a
        float32 ``x`` in float64."""
        reduce = [i for i, d in enumerate(layout) if d not in ("head", "channel")]
        # squares in x's dtype (float32: each rounded by at most 2^-24 relative), summed in float64: a fifth of
        # the time of squaring in float64 (0.95 vs 4.6 ms on 8 x 256 x 576), and the RMS within 1e-7 relative
        if x.dtype == torch.float32 and wide:
            x = x.to(torch.float64)
        sq = x * x
        return sq.sum(dim=reduce, dtype=torch.float64) if reduce else sq.to(torch.float64)

    @staticmethod
    def _squares_count(x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The count per channel of an unmasked ``x`` (every entry counts), on the host."""
        keep = _kept_shape(tuple(x.shape), layout)
        return torch.full(keep, float(x.numel() // max(math.prod(keep), 1)), dtype=torch.float64)

    def _entries(self, idx: torch.Tensor, flat: torch.Tensor, *where: Any) -> list[dict[str, Any]]:
        """Entries {abs, value, loc} for flat indices ``idx`` of one update tensor ``flat``; ``where`` is the
        rest of its locator (:meth:`_located`'s arguments after ``both``)."""
        if idx.numel() == 0:
            return []
        return self._located(_values_and_indices(flat, idx).tolist(), *where)  # one transfer

    def _located(
        self,
        both: list[float],
        shape: tuple[int, ...],
        layout: Layout,
        qpos: list[int] | None,
        tokens: torch.Tensor | None,
        sample_offset: int,
        pos_offset: int,
    ) -> list[dict[str, Any]]:
        """Entries {abs, value, loc} from ``both``: n values of one update tensor, then their n flat indices
        (read from the device: :meth:`_entries`, or :func:`_top_read` in the one transfer)."""
        n = len(both) // 2
        values = both[:n]
        coords = [_unravel(int(i), shape) for i in both[n:]] if layout else [[] for _ in values]
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
        elif other.layout is not None and self._absmax is not None:
            raise ValueError(f"site {self.site!r}: has a channel abs-max, site {other.site!r} has none")
        self._absmax_acc.merge(other._absmax_acc)  # first: its shape check raises before any change
        if self.layout is None:
            self.layout = other.layout
        for mine, theirs in zip(self._accumulators()[1:], other._accumulators()[1:], strict=True):
            mine.merge(theirs, loc)
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
        """The whole state as plain JSON types (histogram bins as string keys, sparse): the header, then each
        accumulator's fields, in the order of ``_FIELDS``."""
        fields: dict[str, Any] = {}
        for acc in self._accumulators():
            fields.update(acc.to_dict())
        return {
            "version": STATE_VERSION,
            "site": self.site,
            "kind": self.kind,
            "topk": self.topk,
            "massive_cap": self.massive_cap,
            "layout": None if self.layout is None else list(self.layout),
            **{name: fields[name] for name in _FIELDS},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteStats:
        """Inverse of :meth:`to_dict` (also after a JSON round trip)."""
        if not LogHistogram.supports(d):
            raise ValueError(
                f"site {d.get('site')!r}: unsupported statistics state (version / histogram base)"
            )
        s = cls(d["site"], d["kind"], topk=d["topk"], massive_cap=d["massive_cap"])
        s.layout = None if d["layout"] is None else tuple(d["layout"])
        for slot in _TABLE.values():
            setattr(s, slot.attr, slot.cls.from_dict(d))
        return s

    # ---------------------------------------------------------------------------- derived numbers
    @property
    def n_bins(self) -> int:
        """Occupied histogram bins (at most 2 * N_BINS + 1: the memory bound of the histogram)."""
        return self._hist.n_bins

    @property
    def mean(self) -> float | None:
        return self._moments_acc.mean

    @property
    def std(self) -> float | None:
        """Population standard deviation."""
        return self._moments_acc.std

    @property
    def kurtosis(self) -> float | None:
        """Pearson kurtosis n * M4 / M2^2 (3 for a Gaussian); None without variance."""
        return self._moments_acc.kurtosis

    @property
    def channel_rms_kurtosis(self) -> float | None:
        """The rotation papers' kurtosis (QuaRot / SpinQuant): each channel's RMS over tokens, then the
        Pearson kurtosis of those RMS values over channels (channel layouts only; None otherwise)."""
        return self._squares.kurtosis

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
        return self._hist.quantile(q, self.count)

    def histogram(self, side: str = "abs") -> tuple[list[float], list[int]]:
        """(edges, counts) of the log bins of ``side`` ('pos', 'neg': magnitudes of negative values, 'abs'),
        dense over the occupied range: len(edges) == len(counts) + 1. The zero bin is :attr:`zero_count`."""
        return self._hist.histogram(side)

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
        return self._hist.count_beyond(mean, sigmas * std)

    def kth_largest(self, k: int) -> float | None:
        """k-th largest magnitude (1-based), None if fewer than k values were kept."""
        return self._top_acc.kth_largest(k)

    def massive(self) -> tuple[list[dict[str, Any]], int, bool]:
        """(massive activations, their count, whether that count is exact) per Sun et al. 2024:
        |x| > 100 and |x| > 1000 x median |x|.

        The count is exact when the 1000 x median bar is at most 100 (then every candidate counts) or when not
        every kept candidate passes the bar (kept candidates are the largest); otherwise it is a lower bound.
        """
        return self._massive_acc.select(self.quantile(0.5) if self.count else 0.0)

    def summary(self) -> dict[str, Any]:
        """The derived numbers (plain Python types; None where undefined)."""
        massive, massive_count, massive_exact = self.massive()
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
            "first_nonfinite": None if self.first_nonfinite is None else copy_entry(self.first_nonfinite),
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": self.std,
            "kurtosis": self.kurtosis,
            "token_kurtosis_mean": self._tk.mean,
            "token_kurtosis_tokens": self._tk.tokens,
            "token_kurtosis_skipped": self._tk.skipped,
            "channel_rms_kurtosis": self.channel_rms_kurtosis,
            "top": copy_entries(self._top),
            **{f"top{k}": self.kth_largest(k) for k in (1, 2, 3, 10, 100)},
            **quant,
            "count_abs_ge_6": self.count_abs_ge_6,
            "count_beyond_6sigma": self.count_beyond_sigmas(SIGMAS),
            "count_abs_gt_100": self.count_abs_gt_100,
            "massive_count": massive_count,
            "massive_count_exact": massive_exact,
            "massive_truncated": self._massive_acc.truncated,
            "massive": massive,
            "channel_absmax": None if self._absmax is None else self._absmax.tolist(),
            "channel_absmax_shape": None if self._absmax_shape is None else list(self._absmax_shape),
        }


# The accumulators' fields in the order of a SiteStats state (to_dict), after its header.
_FIELDS = (
    "count",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "first_nonfinite",
    "min",
    "max",
    "moments",
    "token_kurtosis",
    "top",
    "hist",
    "channel_absmax",
    "channel_absmax_shape",
    "count_abs_ge_6",
    "count_abs_gt_100",
    "massive",
    "channel_sumsq",
    "channel_count",
)
assert sorted(_FIELDS) == sorted(f for acc in ACCUMULATORS for f in acc.FIELDS)
