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

* Histogram: bins [r^j, r^(j+1)) with r = 1.02 for j = I_LO .. I_HI (edges r^j rounded to float32, so that
  binning is exact for float32 and float64 inputs alike), which covers every normal float32 magnitude
  (2^-126 .. 2^128). A value with |x| below the smallest edge r^I_LO ~ 1.16e-38 (zeros and most subnormals)
  goes in a zero bin and is reported as 0; float64 magnitudes beyond float32's range clamp into the top bin.
  :meth:`SiteStats.quantile` finds the bin holding the exact rank and returns its geometric midpoint
  r^(j+1/2), so the relative error of a non-zero quantile is at most sqrt(1.02) - 1 = 0.995 % < 1 %
  (``QUANTILE_REL_ERROR``, 0.99506 % with the rounded edges).
* Beyond-6-sigma count: mean and std are only known at the end of the stream, so the count is read from the
  signed histogram in :meth:`SiteStats.summary`: a whole bin counts when its geometric midpoint (taken with the
  bin's sign) lies beyond mean +/- 6 std. Each value is within a factor sqrt(1.02) of its bin's midpoint, so
  the threshold is resolved to within 2 %: the count lies between the exact counts of |x - mean| > 6.12 std and
  |x - mean| > 5.88 std whenever |mean| < 5.8 std (true of activations; else std is tiny next to the values).

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
R = 1.02
LN_R = math.log(R)
I_LO = math.floor(-126 * math.log(2) / LN_R)  # r^I_LO <= 2^-126 (smallest normal float32) < r^(I_LO+1)
I_HI = math.floor(128 * math.log(2) / LN_R)  # r^(I_HI+1) > 2^128 > largest float32
N_BINS = I_HI - I_LO + 1  # per sign; plus one zero bin
INT8_THRESHOLD = 6.0  # LLM.int8 (Dettmers et al. 2022)
MASSIVE_FLOOR = 100.0  # Sun et al. 2024: massive activations have |x| > 100 ...
MASSIVE_RATIO = 1000.0  # ... and |x| > ~1000 x the median magnitude
SIGMAS = 6.0  # Bondarenko et al. 2023: outliers lie beyond 6 standard deviations
STATE_VERSION = 1

# _POW[j - I_LO] = r^j for j = I_LO .. I_HI + 1, rounded to float32 (except the last, beyond float32's range):
# the bin edges. They *define* the bins: a value's bin is found with the float log, then corrected by exact
# comparisons against these edges. Rounding them to float32 keeps those comparisons exact in float32 (no
# float64 promotion of 10^7-element tensors) and in float64 alike; it moves each edge by < 1.2e-7 relative,
# which leaves the quantile error bound at sqrt(1.02) - 1 to 7 significant digits.
_POW = torch.exp(torch.arange(I_LO, I_HI + 2, dtype=torch.float64) * LN_R)
_POW[:N_BINS] = _POW[:N_BINS].to(torch.float32).to(torch.float64)
# Bound on the relative error of a non-zero quantile: sqrt of the widest bin ratio, minus 1 (0.995 %).
QUANTILE_REL_ERROR = float(torch.sqrt(_POW[1:] / _POW[:-1]).max()) - 1
_EDGE_CACHE: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

_COORDS = ("pos", "head", "channel", "key")  # location keys that are layout coordinates
_SCAN_CHUNK = 1 << 20
_SUBSET_MIN = 1 << 16


def _edges(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) edge of slot k = 0 .. N_BINS: slot 0 is the zero bin, slot k >= 1 is bin I_LO + k - 1.

    The top slot's upper edge is +inf so float64 magnitudes beyond float32's range clamp into it. Exact in
    float32 and float64 (the edges are float32 numbers).
    """
    key = (device, dtype)
    if key not in _EDGE_CACHE:
        zero = torch.zeros(1, dtype=torch.float64)
        inf = torch.full((1,), math.inf, dtype=torch.float64)
        lower = torch.cat([zero, _POW[:N_BINS]])
        upper = torch.cat([_POW[:N_BINS], inf])
        _EDGE_CACHE[key] = (lower.to(device, dtype), upper.to(device, dtype))
    return _EDGE_CACHE[key]


def bin_edges(j: int) -> tuple[float, float]:
    """The magnitude range [r^j, r^(j+1)) of histogram bin j."""
    return float(_POW[j - I_LO]), float(_POW[j - I_LO + 1])


def bin_midpoint(j: int) -> float:
    """Geometric midpoint r^(j+1/2) of bin j: the value reported for every magnitude in the bin."""
    lo, hi = bin_edges(j)
    return math.sqrt(lo * hi)


def _histogram(vals: torch.Tensor, a: torch.Tensor) -> tuple[int, dict[int, int], dict[int, int]]:
    """(zero count, {bin: count} of positive values, {bin: count} of negative values) of finite ``vals``
    (1-D, float32 or float64) with magnitudes ``a``.

    Vectorised for ~10^7 elements: log / floor gives the bin to within a fraction of a bin (the float32 log is
    accurate to ~1e-3 bins), one exact comparison step on each side against the edges fixes it, and a single
    bincount over (sign, slot) codes does the counting (slot N_BINS + 1 is a negative value in the zero bin).
    """
    lower, upper = _edges(vals.device, vals.dtype)
    f = torch.log(a).div_(LN_R).floor_().clamp_(I_LO - 1, I_HI)  # log(0) = -inf clamps to the zero slot
    k = f.to(torch.int64).sub_(I_LO - 1)
    k.sub_((a < lower[k]).to(torch.int64))
    k.add_((a >= upper[k]).to(torch.int64))
    k.add_((vals < 0).to(torch.int64), alpha=N_BINS + 1)
    counts = torch.bincount(k, minlength=2 * (N_BINS + 1))
    nonzero = counts.nonzero().squeeze(1)
    zero, pos, neg = 0, {}, {}
    for slot, n in zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True):
        if slot == 0 or slot == N_BINS + 1:
            zero += n
        elif slot <= N_BINS:
            pos[I_LO + slot - 1] = n
        else:
            neg[I_LO + slot - N_BINS - 2] = n
    return zero, pos, neg


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


def _chunk_moments(v64: torch.Tensor | None, vals: torch.Tensor) -> Moments:
    """Two-pass float64 central moments of one chunk (the chunk is in memory, so no streaming error).

    ``v64``: ``vals`` already in float64 (or None to convert here).
    """
    n = vals.numel()
    if n == 0:
        return 0, 0.0, 0.0, 0.0, 0.0
    v = vals.to(torch.float64) if v64 is None else v64
    mean = v.sum() / n
    d = v - mean
    d2 = d * d
    sums = torch.stack([mean, torch.dot(d, d), torch.dot(d2, d), torch.dot(d2, d2)]).tolist()
    return n, *sums


def _histogram_bar(pos: dict[int, int], neg: dict[int, int], k: int) -> tuple[float | None, int]:
    """(lower edge of the bin holding the k-th largest magnitude, number of magnitudes >= that edge), from one
    chunk's histogram; (None, 0) when the k-th largest magnitude lies in the zero bin."""
    seen = 0
    for j in sorted(set(pos) | set(neg), reverse=True):
        seen += pos.get(j, 0) + neg.get(j, 0)
        if seen >= k:
            return float(_POW[j - I_LO]), seen
    return None, 0


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
        self._zero = 0  # |x| < r^I_LO
        self._pos: dict[int, int] = {}
        self._neg: dict[int, int] = {}
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
        if x.dtype != torch.float64:
            small_float = x.is_floating_point() and x.element_size() <= 4
            x = x.to(torch.float32 if small_float else torch.float64)  # exact for every float dtype
        shape = tuple(x.shape)
        flat = x.reshape(-1)
        finite = torch.isfinite(x)
        vmask = None if valid is None else valid.to(device=x.device, dtype=torch.bool).expand(shape)
        ok = finite if vmask is None else finite & vmask
        n_ok = int(torch.count_nonzero(ok))
        all_ok = n_ok == x.numel()
        if not all_ok:
            special = [torch.isnan(x), x == math.inf, x == -math.inf]
            if vmask is not None:
                special = [m & vmask for m in special]
            n_nan, n_pinf, n_ninf = torch.stack([torch.count_nonzero(m) for m in special]).tolist()
            self.nan_count += n_nan
            self.posinf_count += n_pinf
            self.neginf_count += n_ninf
            if n_nan + n_pinf + n_ninf:
                self._note_nonfinite(x, finite, vmask, valid, layout, tokens, sample_offset, pos_offset)
        af = x.abs()  # magnitudes; excluded entries -> -1 (below every real magnitude)
        if not all_ok:
            af.masked_fill_(~ok, -1.0)
        af_flat = af.reshape(-1)
        self._update_absmax(af, layout)
        per_token = bool(layout) and layout[-1] == "channel"
        if n_ok == 0:
            if per_token:  # every token has a non-finite / masked channel (or no channels)
                self._tk_skipped += math.prod(shape[:-1])
            return
        vals, a = (flat, af_flat) if all_ok else (flat[ok.reshape(-1)], af_flat[ok.reshape(-1)])

        self.count += n_ok
        lo, hi = torch.aminmax(vals)
        lo, hi = torch.stack([lo, hi]).to(torch.float64).tolist()
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        ge6, gt100 = torch.stack(
            [torch.count_nonzero(a >= INT8_THRESHOLD), torch.count_nonzero(a > MASSIVE_FLOOR)]
        ).tolist()
        self.count_abs_ge_6 += ge6
        self.count_abs_gt_100 += gt100
        x64 = x.to(torch.float64) if all_ok or per_token else None  # shared by both moment passes
        v64 = x64.reshape(-1) if all_ok and x64 is not None else None
        self._moments = _combine_moments(self._moments, _chunk_moments(v64, vals))
        if per_token:
            self._update_token_kurtosis(x, x64, None if all_ok else ok)
        del x64, v64
        zero, pos, neg = _histogram(vals, a)
        self._zero += zero
        _add_counts(self._pos, pos)
        _add_counts(self._neg, neg)

        qpos = None
        if valid is not None and "key" in layout:
            qpos = query_positions(valid).tolist()
        where = (flat, shape, layout, qpos, tokens, sample_offset, pos_offset)
        bar, n_bar = _histogram_bar(pos, neg, self.topk)
        top = self._entries(_select(af_flat, self.topk, -0.5, n_ok, bar, n_bar), *where)
        self._top = _merge_entries(self._top, top, self.topk)
        if gt100:
            massive = self._entries(_select(af_flat, self.massive_cap, MASSIVE_FLOOR, gt100), *where)
            self._massive = _merge_entries(self._massive, massive, self.massive_cap)

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

    def _update_token_kurtosis(self, x: torch.Tensor, x64: torch.Tensor, ok: torch.Tensor | None) -> None:
        """Bondarenko et al. 2023: Pearson kurtosis of each token's vector over channels, summed over tokens.

        A token is skipped when a channel is non-finite / masked or all its channels are equal (exactly:
        max == min, so float rounding of the mean cannot fake a non-zero variance). ``ok`` None = all valid.
        """
        c = x.shape[-1]
        n_rows = x.numel() // c  # called with at least one finite value, so c > 0
        lo, hi = torch.aminmax(x.reshape(-1, c), dim=-1)
        keep = hi > lo  # False for NaN rows too
        if ok is not None:
            keep &= ok.reshape(-1, c).all(-1)
        rows = x64.reshape(-1, c)
        d = rows - rows.mean(-1, keepdim=True)
        d2 = d.mul_(d)
        m2 = d2.sum(-1)
        m4 = torch.bmm(d2.unsqueeze(1), d2.unsqueeze(2)).reshape(-1)  # row-wise dot: sum of d^4
        kurt = m4 * c / (m2 * m2)  # (m4 / c) / (m2 / c)^2
        total, n = torch.stack([torch.where(keep, kurt, 0.0).sum(), keep.sum(dtype=torch.float64)]).tolist()
        self._tk_sum += total
        self._tk_tokens += int(n)
        self._tk_skipped += n_rows - int(n)

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
    def merge(self, other: SiteStats) -> SiteStats:
        """Add ``other``'s statistics (disjoint data, possibly another site: pooling) into self; returns self.

        Exact for counts, min/max, top-k, histograms and abs-max; moments to float64 rounding.
        """
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
        self.first_nonfinite = _earlier_nonfinite(self.first_nonfinite, copy.deepcopy(other.first_nonfinite))
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
            self.max = other.max if self.max is None else max(self.max, other.max)
        self._moments = _combine_moments(self._moments, other._moments)
        self._tk_sum += other._tk_sum
        self._tk_tokens += other._tk_tokens
        self._tk_skipped += other._tk_skipped
        self._top = _merge_entries(self._top, copy.deepcopy(other._top), self.topk)
        self._zero += other._zero
        _add_counts(self._pos, other._pos)
        _add_counts(self._neg, other._neg)
        self.count_abs_ge_6 += other.count_abs_ge_6
        self.count_abs_gt_100 += other.count_abs_gt_100
        self._massive = _merge_entries(self._massive, copy.deepcopy(other._massive), self.massive_cap)
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
            "first_nonfinite": copy.deepcopy(self.first_nonfinite),
            "min": self.min,
            "max": self.max,
            "moments": {"n": n, "mean": mean, "m2": m2, "m3": m3, "m4": m4},
            "token_kurtosis": {"sum": self._tk_sum, "tokens": self._tk_tokens, "skipped": self._tk_skipped},
            "top": copy.deepcopy(self._top),
            "hist": {
                "base": R,
                "zero": self._zero,
                "pos": {str(j): self._pos[j] for j in sorted(self._pos)},
                "neg": {str(j): self._neg[j] for j in sorted(self._neg)},
            },
            "channel_absmax": None if self._absmax is None else self._absmax.tolist(),
            "channel_absmax_shape": None if self._absmax_shape is None else list(self._absmax_shape),
            "count_abs_ge_6": self.count_abs_ge_6,
            "count_abs_gt_100": self.count_abs_gt_100,
            "massive": copy.deepcopy(self._massive),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteStats:
        """Inverse of :meth:`to_dict` (also after a JSON round trip)."""
        if d.get("version") != STATE_VERSION or d.get("hist", {}).get("base") != R:
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
        s._top = copy.deepcopy(d["top"])
        s._zero = d["hist"]["zero"]
        s._pos = {int(j): n for j, n in d["hist"]["pos"].items()}
        s._neg = {int(j): n for j, n in d["hist"]["neg"].items()}
        if d["channel_absmax"] is not None:
            s._absmax = torch.tensor(d["channel_absmax"], dtype=torch.float64)
            s._absmax_shape = tuple(d["channel_absmax_shape"])
        s.count_abs_ge_6, s.count_abs_gt_100 = d["count_abs_ge_6"], d["count_abs_gt_100"]
        s._massive = copy.deepcopy(d["massive"])
        return s

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
        edges = [float(e) for e in _POW[lo - I_LO : hi - I_LO + 2]]
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
        chosen = [copy.deepcopy(e) for e in self._massive if e["abs"] > bar]
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
            "first_nonfinite": copy.deepcopy(self.first_nonfinite),
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": self.std,
            "kurtosis": self.kurtosis,
            "token_kurtosis_mean": tk,
            "token_kurtosis_tokens": self._tk_tokens,
            "token_kurtosis_skipped": self._tk_skipped,
            "top": copy.deepcopy(self._top),
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
