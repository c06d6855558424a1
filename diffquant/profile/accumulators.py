"""The per-statistic state of :class:`~diffquant.profile.stats.SiteStats`: one small accumulator class each.

Each accumulator holds one statistic's streaming state (sizes independent of the tokens seen), adds one
update's contribution (computed by SiteStats.update's single pass over the tensor, which feeds every
accumulator from the same flat / magnitude / histogram passes), merges with the state of disjoint data
(``merge``), and round-trips through the plain JSON fields of a SiteStats state (``to_dict`` gives exactly its
own fields of :meth:`SiteStats.to_dict`; ``from_dict`` reads them, and its parameters, from the whole state).
The definitions, references and error bounds are in the docstring of :mod:`diffquant.profile.stats`.

* :class:`Moments`: count, min, max and the float64 central sums (n, mean, M2, M3, M4).
* :class:`TokenKurtosis`: per-token kurtosis over channels, summed over tokens.
* :class:`TopK`: the largest magnitudes with locations, under the total order :func:`entry_key`.
* :class:`LogHistogram`: the signed log-spaced histogram (quantiles, the beyond-6-sigma count).
* :class:`ChannelAbsMax`: per head / channel abs-max (SmoothQuant act_scales).
* :class:`ThresholdCounts`: the exact count of |x| >= 6 (LLM.int8).
* :class:`Massive`: massive-activation candidates |x| > 100, counted exactly, kept with locations.
* :class:`NonFinite`: NaN / +Inf / -Inf counts and the earliest non-finite entry.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any, ClassVar

import torch

__all__ = [
    "ACCUMULATORS",
    "Accumulator",
    "ChannelAbsMax",
    "LogHistogram",
    "Massive",
    "Moments",
    "NonFinite",
    "ThresholdCounts",
    "TokenKurtosis",
    "TopK",
]

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
# The fused pass (see diffquant/profile/stats.py; DIFFQUANT_PROFILE_FUSED=0: the plain path): here, merging a
# histogram adds the other's pending dense counts instead of folding both into dicts first.
FUSED = os.environ.get("DIFFQUANT_PROFILE_FUSED", "1") != "0"

# In-octave edge mantissas M_k = round(2^FINE_BITS * 2^(k/64)), k = 0 .. 64 (M_64 = 2 * 2^FINE_BITS): E_(64e+k)
# = 2^e * M_k / 2^FINE_BITS, exact float32 numbers on the fine grid.
_FINE = 1 << FINE_BITS
_M = [round(_FINE * 2.0 ** (k / BINS_PER_OCTAVE)) for k in range(BINS_PER_OCTAVE)] + [2 * _FINE]
EDGES = [
    math.ldexp(_M[(j - I_LO) % BINS_PER_OCTAVE], (j - I_LO) // BINS_PER_OCTAVE - 126 - FINE_BITS)
    for j in range(I_LO, I_HI + 1)
] + [2.0**128]
# Bound on the relative error of a non-zero quantile: sqrt of the widest bin ratio, minus 1 (0.6187 %).
QUANTILE_REL_ERROR = max(math.sqrt(_M[k + 1] / _M[k]) for k in range(BINS_PER_OCTAVE)) - 1
SLOTS = N_BINS + 1  # dense per-sign histogram: slot 0 = zero bin, slot 1 + j - I_LO = bin j


def bin_edges(j: int) -> tuple[float, float]:
    """The magnitude range [E_j, E_(j+1)) of histogram bin j."""
    return EDGES[j - I_LO], EDGES[j - I_LO + 1]


def bin_midpoint(j: int) -> float:
    """Geometric midpoint sqrt(E_j E_(j+1)) of bin j: the value reported for every magnitude in the bin."""
    lo, hi = bin_edges(j)
    return math.sqrt(lo * hi)


def _add_counts(into: dict[int, int], other: dict[int, int]) -> None:
    for j, n in other.items():
        into[j] = into.get(j, 0) + n


# ------------------------------------------------------------------------------------------ moment sums
MomentSums = tuple[int, float, float, float, float]  # n, mean, M2, M3, M4 (central sums, not divided by n)


def combine_moments(a: MomentSums, b: MomentSums) -> MomentSums:
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


# ------------------------------------------------------------------------------------------ located entries
COORDS = ("pos", "head", "channel", "key")  # location keys that are layout coordinates


def entry_key(entry: dict[str, Any]) -> tuple:
    """The total order of top-k / massive entries: descending |x|, then (site, sample, layout coordinates in
    layout order, absolute positions), then the signed value (only to make exact duplicates deterministic)."""
    loc = entry["loc"]
    coords = tuple(v for k, v in loc.items() if k in COORDS)  # locations are built in layout order
    return (-entry["abs"], loc["site"], loc["sample"], *coords, entry["value"])


def _earlier_nonfinite(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The earlier of two first-non-finite records (sample, then coordinates, then site)."""
    if a is None or b is None:
        return a or b

    def key(entry: dict[str, Any]) -> tuple:
        loc = entry["loc"]
        return (loc["sample"], *(v for k, v in loc.items() if k in COORDS), loc["site"])

    return a if key(a) <= key(b) else b


def copy_entry(entry: dict[str, Any], loc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of an entry ({abs, value, loc} or a first-non-finite {value, loc}): its values are scalars and
    ``loc`` a flat dict of scalars, so two levels are a deep copy (copy.deepcopy was 10 % of a profile run).
    ``loc`` (optional) overrides location keys (another site seeing the same tensor)."""
    return {k: ({**v, **(loc or {})} if isinstance(v, dict) else v) for k, v in entry.items()}


def copy_entries(entries: list[dict[str, Any]], loc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [copy_entry(e, loc) for e in entries]


def _merge_entries(a: list[dict], b: list[dict], cap: int) -> list[dict]:
    return sorted(a + b, key=entry_key)[:cap]


# ------------------------------------------------------------------------------------------ accumulators
class Accumulator:
    """One statistic's mergeable state. ``FIELDS``: the keys of the SiteStats state it owns (its ``to_dict``).

    ``merge(other, loc)`` adds the state of disjoint data; ``loc`` (None, or location keys to override)
    relabels ``other``'s located entries as another site's (taps sharing one input). ``from_dict(d)`` reads
    the whole SiteStats state ``d`` (its own fields and parameters such as ``topk``).
    """

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def merge(self, other: Any, loc: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        raise NotImplementedError


class Moments(Accumulator):
    """count, min, max and float64 central sums (n, mean, M2, M3, M4) of the finite valid values, merged with
    :func:`combine_moments`."""

    FIELDS = ("count", "min", "max", "moments")

    def __init__(self) -> None:
        self.count = 0  # finite, valid values
        self.min: float | None = None
        self.max: float | None = None
        self.sums: MomentSums = (0, 0.0, 0.0, 0.0, 0.0)

    def add_extremes(self, n: int, lo: float, hi: float) -> None:
        """Count ``n`` more values whose extremes are ``lo`` / ``hi``."""
        self.count += n
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def add_sums(self, sums: MomentSums) -> None:
        """Fold in the central sums of an update's values (from the per-row sums, see stats._combine_rows)."""
        self.sums = combine_moments(self.sums, sums)

    def merge(self, other: Moments, loc: dict[str, Any] | None = None) -> None:
        self.count += other.count
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
            self.max = other.max if self.max is None else max(self.max, other.max)
        self.sums = combine_moments(self.sums, other.sums)

    def to_dict(self) -> dict[str, Any]:
        n, mean, m2, m3, m4 = self.sums
        return {
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "moments": {"n": n, "mean": mean, "m2": m2, "m3": m3, "m4": m4},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Moments:
        s = cls()
        s.count, s.min, s.max = d["count"], d["min"], d["max"]
        m = d["moments"]
        s.sums = (m["n"], m["mean"], m["m2"], m["m3"], m["m4"])
        return s

    @property
    def mean(self) -> float | None:
        return self.sums[1] if self.count else None

    @property
    def std(self) -> float | None:
        """Population standard deviation."""
        return math.sqrt(self.sums[2] / self.count) if self.count else None

    @property
    def kurtosis(self) -> float | None:
        """Pearson kurtosis n * M4 / M2^2 (3 for a Gaussian); None without variance."""
        n, _, m2, _, m4 = self.sums
        return n * m4 / (m2 * m2) if n and m2 > 0 else None


class TokenKurtosis(Accumulator):
    """Bondarenko et al. 2023: Pearson kurtosis of each token's vector over channels, summed over tokens."""

    FIELDS = ("token_kurtosis",)

    def __init__(self) -> None:
        self.sum = 0.0  # sum of per-token kurtosis
        self.tokens = 0
        self.skipped = 0  # tokens with a non-finite / invalid channel or zero variance

    def add_rows(self, n: torch.Tensor, m2: torch.Tensor, m4: torch.Tensor, width: int) -> None:
        """Add the tokens of per-row central sums (stats._row_moments; one row = one token's channels).

        A token is skipped when a channel is non-finite / masked (n < width) or all its channels are equal
        (M2 == 0: exact, a constant row is centred at its exact value).
        """
        self.add_sums(*self.row_sums(n, m2, m4, width).tolist(), n.numel())

    @staticmethod
    def row_sums(n: torch.Tensor, m2: torch.Tensor, m4: torch.Tensor, width: int) -> torch.Tensor:
        """[sum of the kept tokens' kurtosis, kept tokens] (float64) of :meth:`add_rows`' rows, on their
        device: the profile moves them to the host with its other small results (one wait on a GPU)."""
        keep = (n == width) & (m2 > 0)
        kurt = m4 * width / (m2 * m2)  # (m4 / c) / (m2 / c)^2
        return torch.stack([torch.where(keep, kurt, 0.0).sum(), keep.sum(dtype=torch.float64)])

    def add_sums(self, total: float, kept: float, rows: int) -> None:
        """Add :meth:`row_sums`' two numbers for ``rows`` tokens."""
        self.sum += total
        self.tokens += int(kept)
        self.skipped += rows - int(kept)

    def skip(self, tokens: int) -> None:
        """Tokens that have no valid finite channel at all."""
        self.skipped += tokens

    def merge(self, other: TokenKurtosis, loc: dict[str, Any] | None = None) -> None:
        self.sum += other.sum
        self.tokens += other.tokens
        self.skipped += other.skipped

    def to_dict(self) -> dict[str, Any]:
        return {"token_kurtosis": {"sum": self.sum, "tokens": self.tokens, "skipped": self.skipped}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenKurtosis:
        s = cls()
        tk = d["token_kurtosis"]
        s.sum, s.tokens, s.skipped = tk["sum"], tk["tokens"], tk["skipped"]
        return s

    @property
    def mean(self) -> float | None:
        return self.sum / self.tokens if self.tokens else None


class _Entries(Accumulator):
    """At most ``cap`` located entries {abs, value, loc}, the first ones under :func:`entry_key`."""

    def __init__(self, cap: int) -> None:
        self.cap = int(cap)
        self.entries: list[dict[str, Any]] = []

    def add(self, entries: list[dict[str, Any]]) -> None:
        """Keep the first ``cap`` of the kept entries and new ``entries`` (the update's own first ``cap``)."""
        self.entries = _merge_entries(self.entries, entries, self.cap)

    def merge(self, other: _Entries, loc: dict[str, Any] | None = None) -> None:
        self.entries = _merge_entries(self.entries, copy_entries(other.entries, loc), self.cap)


class TopK(_Entries):
    """The ``topk`` largest magnitudes with locations (exact, under the total order of :func:`entry_key`)."""

    FIELDS = ("top",)

    def to_dict(self) -> dict[str, Any]:
        return {"top": copy_entries(self.entries)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TopK:
        s = cls(d["topk"])
        s.entries = copy_entries(d["top"])
        return s

    def kth_largest(self, k: int) -> float | None:
        """k-th largest magnitude (1-based), None if fewer than k values were kept."""
        return self.entries[k - 1]["abs"] if 1 <= k <= len(self.entries) else None


class Massive(_Entries):
    """Massive-activation candidates (Sun et al. 2024): the exact count of |x| > 100 and the first
    ``massive_cap`` of them with locations."""

    FIELDS = ("count_abs_gt_100", "massive")

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.count = 0  # |x| > MASSIVE_FLOOR

    def add_count(self, n: int) -> None:
        self.count += n

    def merge(self, other: Massive, loc: dict[str, Any] | None = None) -> None:
        self.count += other.count
        super().merge(other, loc)

    def to_dict(self) -> dict[str, Any]:
        return {"count_abs_gt_100": self.count, "massive": copy_entries(self.entries)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Massive:
        s = cls(d["massive_cap"])
        s.count = d["count_abs_gt_100"]
        s.entries = copy_entries(d["massive"])
        return s

    @property
    def truncated(self) -> bool:
        """More candidates were seen than kept."""
        return self.count > len(self.entries)

    def select(self, median: float) -> tuple[list[dict[str, Any]], int, bool]:
        """(massive activations, their count, whether that count is exact): |x| > 100 and |x| > 1000 x
        ``median`` (the median magnitude).

        The count is exact when the 1000 x median bar is at most 100 (then every candidate counts) or when not
        every kept candidate passes the bar (kept candidates are the largest); otherwise it is a lower bound.
        """
        bar = max(MASSIVE_FLOOR, MASSIVE_RATIO * median)
        chosen = [copy_entry(e) for e in self.entries if e["abs"] > bar]
        if bar == MASSIVE_FLOOR:
            return chosen, self.count, True
        exact = not self.truncated or len(chosen) < len(self.entries)
        return chosen, len(chosen), exact


class LogHistogram(Accumulator):
    """Signed log-spaced histogram (bins of the module constants): sparse {bin: count} per sign plus the zero
    bin. Updates add dense slot counts (one tensor) that are folded into the dicts lazily."""

    FIELDS = ("hist",)

    def __init__(self) -> None:
        self._zero = 0  # |x| < 2^-126
        self._pos: dict[int, int] = {}
        self._neg: dict[int, int] = {}
        self._pending: torch.Tensor | None = None  # dense bin counts of updates not yet folded into the dicts

    def add_dense(self, dense: torch.Tensor) -> None:
        """Add dense signed slot counts (2 * (N_BINS + 1), int64; see stats._histogram). ``dense`` becomes the
        pending state when none is pending (later updates add into it in place)."""
        self._pending = dense if self._pending is None else self._pending.add_(dense)

    def _flush(self) -> None:
        """Fold the dense counts of recent updates into the sparse {bin: count} dicts (done lazily, so an
        update adds one dense tensor instead of building dicts)."""
        if self._pending is None:
            return
        dense, self._pending = self._pending, None
        nz = dense.nonzero().squeeze(1)
        for slot, n in zip(nz.tolist(), dense[nz].tolist(), strict=True):
            if slot == 0:
                self._zero += n
            elif slot < SLOTS:
                j = I_LO + slot - 1
                self._pos[j] = self._pos.get(j, 0) + n
            else:
                j = I_LO + slot - SLOTS - 1
                self._neg[j] = self._neg.get(j, 0) + n

    @property
    def zero(self) -> int:
        self._flush()
        return self._zero

    @property
    def pos(self) -> dict[int, int]:
        self._flush()
        return self._pos

    @property
    def neg(self) -> dict[int, int]:
        self._flush()
        return self._neg

    def merge(self, other: LogHistogram, loc: dict[str, Any] | None = None) -> None:
        if FUSED and other._pending is not None:
            # Dense counts add exactly; the fold into dicts happens once, when the state is read. (The
            # profiler merges a fresh per-forward state into every shared site: folding each was 3 % of a
            # profile run.)
            pending = other._pending
            self._pending = pending.clone() if self._pending is None else self._pending.add_(pending)
            self._zero += other._zero
            _add_counts(self._pos, other._pos)
            _add_counts(self._neg, other._neg)
            return
        self._zero = self.zero + other.zero  # the properties fold pending counts first
        _add_counts(self.pos, other.pos)
        _add_counts(self.neg, other.neg)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hist": {
                "base": R,
                "bins_per_octave": BINS_PER_OCTAVE,
                "fine_bits": FINE_BITS,
                "zero": self.zero,
                "pos": {str(j): self.pos[j] for j in sorted(self.pos)},
                "neg": {str(j): self.neg[j] for j in sorted(self.neg)},
            }
        }

    @staticmethod
    def supports(d: dict[str, Any]) -> bool:
        """Whether the state ``d`` was binned as this module bins (STATE_VERSION, base, fine bits)."""
        hist = d.get("hist", {})
        return (
            d.get("version") == STATE_VERSION
            and hist.get("base") == R
            and (hist.get("bins_per_octave"), hist.get("fine_bits")) == (BINS_PER_OCTAVE, FINE_BITS)
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogHistogram:
        s = cls()
        s._zero = d["hist"]["zero"]
        s._pos = {int(j): n for j, n in d["hist"]["pos"].items()}
        s._neg = {int(j): n for j, n in d["hist"]["neg"].items()}
        return s

    @property
    def n_bins(self) -> int:
        """Occupied bins (at most 2 * N_BINS + 1: the memory bound of the histogram)."""
        return len(self.pos) + len(self.neg) + (1 if self.zero else 0)

    def quantile(self, q: float, count: int) -> float:
        """Geometric midpoint of the bin holding rank ceil(q * count) of the magnitudes (0 in the zero bin)."""
        rank = max(1, math.ceil(q * count))  # float product, as numpy's method="inverted_cdf"
        seen = self.zero
        if seen >= rank:
            return 0.0
        pos, neg = self.pos, self.neg
        for j in sorted(set(pos) | set(neg)):
            seen += pos.get(j, 0) + neg.get(j, 0)
            if seen >= rank:
                return bin_midpoint(j)
        raise AssertionError("histogram counts do not add up to count")  # pragma: no cover

    def histogram(self, side: str = "abs") -> tuple[list[float], list[int]]:
        """(edges, counts) of ``side`` ('pos', 'neg', 'abs'), dense over the occupied range."""
        if side not in ("pos", "neg", "abs"):
            raise ValueError(f"histogram side must be 'pos', 'neg' or 'abs', got {side!r}")
        bins = {"pos": self.pos, "neg": self.neg}.get(side)
        if bins is None:
            bins = dict(self.pos)
            _add_counts(bins, self.neg)
        if not bins:
            return [], []
        lo, hi = min(bins), max(bins)
        edges = EDGES[lo - I_LO : hi - I_LO + 2]
        return edges, [bins.get(j, 0) for j in range(lo, hi + 1)]

    def count_beyond(self, mean: float, thr: float) -> int:
        """Values whose bin midpoint (with the bin's sign) lies beyond mean +/- thr (whole bins)."""
        n = self.zero if abs(mean) > thr else 0
        n += sum(c for j, c in self.pos.items() if abs(bin_midpoint(j) - mean) > thr)
        n += sum(c for j, c in self.neg.items() if abs(-bin_midpoint(j) - mean) > thr)
        return n


class ChannelAbsMax(Accumulator):
    """SmoothQuant act_scales: max |x| over every dim but head / channel, float64 on the CPU, flattened, with
    its shape; merged by elementwise max. ``site`` names the owner in error messages."""

    FIELDS = ("channel_absmax", "channel_absmax_shape")

    def __init__(self, site: str) -> None:
        self.site = site
        self.amax: torch.Tensor | None = None
        self.shape: tuple[int, ...] | None = None

    def add(self, amax: torch.Tensor | None, shape: tuple[int, ...] | None, other: str = "") -> None:
        """Max in a flattened float64 CPU ``amax`` of ``shape`` (``other``: the site it comes from, if another)."""
        if amax is None:
            return
        if self.amax is None:
            self.amax, self.shape = amax.clone(), shape
        elif self.shape != shape:
            raise ValueError(
                f"site {self.site!r}: channel abs-max shape {self.shape} does not match "
                f"{shape}{f' of site {other!r}' if other else ''}"
            )
        else:
            torch.maximum(self.amax, amax, out=self.amax)

    def merge(self, other: ChannelAbsMax, loc: dict[str, Any] | None = None) -> None:
        self.add(other.amax, other.shape, other.site)

    def to_dict(self) -> dict[str, Any]:
        return {
            "channel_absmax": None if self.amax is None else self.amax.tolist(),
            "channel_absmax_shape": None if self.shape is None else list(self.shape),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChannelAbsMax:
        s = cls(d["site"])
        if d["channel_absmax"] is not None:
            s.amax = torch.tensor(d["channel_absmax"], dtype=torch.float64)
            s.shape = tuple(d["channel_absmax_shape"])
        return s


class ChannelSquares(Accumulator):
    """Per-channel sum of squares and count of the finite valid values over every dim but head / channel
    (float64, CPU, flattened): the channel RMS that the rotation papers (QuaRot, Ashkboos et al. 2024;
    SpinQuant, Liu et al. 2024) take over tokens before the kurtosis over channels. Merged by addition."""

    FIELDS = ("channel_sumsq", "channel_count")

    def __init__(self, site: str) -> None:
        self.site = site
        self.sumsq: torch.Tensor | None = None
        self.n: torch.Tensor | None = None

    def add(self, sumsq: torch.Tensor | None, n: torch.Tensor | None, other: str = "") -> None:
        """Add flattened float64 CPU per-channel ``sumsq`` and counts ``n`` (``other``: their site)."""
        if sumsq is None or n is None:
            return
        if self.sumsq is None or self.n is None:
            self.sumsq, self.n = sumsq.clone(), n.clone()
        elif self.sumsq.shape != sumsq.shape:
            raise ValueError(
                f"site {self.site!r}: {self.sumsq.numel()} channels do not match {sumsq.numel()}"
                f"{f' of site {other!r}' if other else ''}"
            )
        else:
            self.sumsq += sumsq
            self.n += n

    def merge(self, other: ChannelSquares, loc: dict[str, Any] | None = None) -> None:
        self.add(other.sumsq, other.n, other.site)

    @property
    def rms(self) -> torch.Tensor | None:
        """sqrt(mean x^2) per channel (NaN for a channel that saw no value)."""
        if self.sumsq is None or self.n is None:
            return None
        return torch.where(self.n > 0, self.sumsq / self.n.clamp_min(1), math.nan).sqrt()

    @property
    def kurtosis(self) -> float | None:
        """Pearson kurtosis E[(r - mean r)^4] / Var(r)^2 of the channel RMS r over the channels that saw a
        value (3 for Gaussian r); None with fewer than 2 channels or equal RMS everywhere."""
        r = self.rms
        if r is None:
            return None
        r = r[~torch.isnan(r)]
        if r.numel() < 2:
            return None
        d = r - r.mean()
        var = float((d * d).mean())
        return None if var <= 0.0 else float((d**4).mean()) / var**2

    def to_dict(self) -> dict[str, Any]:
        return {
            "channel_sumsq": None if self.sumsq is None else self.sumsq.tolist(),
            "channel_count": None if self.n is None else self.n.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChannelSquares:
        s = cls(d["site"])
        if d.get("channel_sumsq") is not None:  # absent in older profiles
            s.sumsq = torch.tensor(d["channel_sumsq"], dtype=torch.float64)
            s.n = torch.tensor(d["channel_count"], dtype=torch.float64)
        return s


class ThresholdCounts(Accumulator):
    """The exact count of |x| >= 6 (LLM.int8's outlier threshold)."""

    FIELDS = ("count_abs_ge_6",)

    def __init__(self) -> None:
        self.ge6 = 0

    def add(self, ge6: int) -> None:
        self.ge6 += ge6

    def merge(self, other: ThresholdCounts, loc: dict[str, Any] | None = None) -> None:
        self.ge6 += other.ge6

    def to_dict(self) -> dict[str, Any]:
        return {"count_abs_ge_6": self.ge6}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ThresholdCounts:
        s = cls()
        s.ge6 = d["count_abs_ge_6"]
        return s


class NonFinite(Accumulator):
    """NaN / +Inf / -Inf counts (valid entries) and the earliest non-finite entry {value, loc} (by sample,
    then layout coordinates, then site)."""

    FIELDS = ("nan_count", "posinf_count", "neginf_count", "first_nonfinite")

    def __init__(self) -> None:
        self.nan = 0
        self.posinf = 0
        self.neginf = 0
        self.first: dict[str, Any] | None = None

    def add(self, nan: int, posinf: int, neginf: int) -> None:
        self.nan += nan
        self.posinf += posinf
        self.neginf += neginf

    def note(self, candidate: dict[str, Any]) -> None:
        """Keep ``candidate`` ({value: 'nan' / 'inf' / '-inf', loc}) if it comes first."""
        self.first = _earlier_nonfinite(self.first, candidate)

    def merge(self, other: NonFinite, loc: dict[str, Any] | None = None) -> None:
        self.add(other.nan, other.posinf, other.neginf)
        first = None if other.first is None else copy_entry(other.first, loc)
        self.first = _earlier_nonfinite(self.first, first)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nan_count": self.nan,
            "posinf_count": self.posinf,
            "neginf_count": self.neginf,
            "first_nonfinite": None if self.first is None else copy_entry(self.first),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NonFinite:
        s = cls()
        s.nan, s.posinf, s.neginf = d["nan_count"], d["posinf_count"], d["neginf_count"]
        s.first = copy.deepcopy(d.get("first_nonfinite"))  # absent in older profiles
        return s


# Every accumulator of a SiteStats, in merge order (abs-max first: its shape check raises before any change).
ACCUMULATORS: tuple[type[Accumulator], ...] = (
    ChannelAbsMax,
    Moments,
    NonFinite,
    TokenKurtosis,
    TopK,
    LogHistogram,
    ThresholdCounts,
    Massive,
    ChannelSquares,
)
