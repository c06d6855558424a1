"""Histograms of |x| per site kind, pooled per model (one figure, or one panel per layer)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.plots.common import KIND_TITLES, legend_proxy, profile_kinds, require_profiles
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.profile.profiler import Profile
from diffquant.profile.sites import layer_of
from diffquant.profile.stats import LN_R, R, SiteStats

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


HIST_KINDS = ("logits", "resid", "q", "k", "v", "mlp_act", "linear_in")
INT8_THRESHOLD = 6.0  # LLM.int8 outlier threshold (Dettmers et al. 2022)
SIGMAS = 6.0  # outliers beyond 6 standard deviations (Bondarenko et al. 2023)
# The profile's log bins (64 per octave, ~1.1 % wide) are far too fine to read at a few thousand tokens:
# plot groups of HIST_GROUP neighbouring bins (2^(11/64) = x1.126, ~19 bins per decade). Groups are aligned
# on the global bin index, so every model and site is rebinned onto the same grid.
HIST_GROUP = 11
# Histogram x range: up to HIST_MARGIN x the largest |x|, so the tail, where quantization error is decided,
# ends inside the frame. Linear from 0 (the outlier view: the tail gets most of the width) unless the largest
# |x| is HIST_LOG_RATIO x the median or more (three decades: massive activations); then logarithmic from the
# HIST_LOW_QUANTILE quantile of |x| (the smallest values, invisible on any useful scale, are left out).
HIST_LOW_QUANTILE = 0.005
HIST_MARGIN = 1.3
HIST_LOG_RATIO = 1000.0


def _sites_of(profile: Profile, kind: str, layer: int | None = None) -> list[SiteStats]:
    return [
        s
        for name, s in profile.sites.items()
        if s.kind == kind and (layer is None or layer_of(name) == layer)
    ]


@dataclass
class Pool:
    """|x| histogram, top-1 and moments of several sites together.

    Built from each site's public statistics rather than ``SiteStats.merged``, which also merges
    per-channel abs-max and so refuses sites of different widths (e.g. all Linear inputs of a layer).
    Histogram bins are the profile's global log bins, keyed by index, so adding them is exact.
    """

    count: int = 0
    mean: float | None = None
    std: float | None = None
    top1: float | None = None
    zero: int = 0
    bins: dict[int, int] = field(default_factory=dict)
    sites: int = 0

    def quantile(self, q: float) -> float | None:
        """Lower edge of the log bin holding the q-quantile of the non-zero |x| (None without data)."""
        total = sum(self.bins.values())
        if not total:
            return None
        rank, seen = max(1, math.ceil(q * total)), 0
        for j in sorted(self.bins):
            seen += self.bins[j]
            if seen >= rank:
                return R**j
        return R ** max(self.bins)

    def add(self, stats: SiteStats) -> None:
        n = stats.count
        if n == 0 or stats.mean is None or stats.std is None:
            return
        total = self.count + n
        if self.count == 0:
            mean, var = stats.mean, stats.std**2
        else:
            assert self.mean is not None and self.std is not None
            mean = (self.count * self.mean + n * stats.mean) / total
            var = (
                self.count * (self.std**2 + (self.mean - mean) ** 2)
                + n * (stats.std**2 + (stats.mean - mean) ** 2)
            ) / total
        self.count, self.mean, self.std = total, mean, math.sqrt(max(var, 0.0))
        top1 = stats.kth_largest(1)
        if top1 is not None:
            self.top1 = top1 if self.top1 is None else max(self.top1, top1)
        self.zero += stats.zero_count
        edges, counts = stats.histogram("abs")
        if counts:
            j0 = round(math.log(edges[0]) / LN_R)  # global index of the first occupied bin
            for i, c in enumerate(counts):
                if c:
                    self.bins[j0 + i] = self.bins.get(j0 + i, 0) + c
        self.sites += 1


def _pooled(profile: Profile, kind: str, layer: int | None = None) -> Pool | None:
    pool = Pool()
    for stats in _sites_of(profile, kind, layer):
        pool.add(stats)
    return pool if pool.count else None


def hist_bar_width() -> float:
    """How wide (as a ratio) one plotted histogram bar is: HIST_GROUP profile bins."""
    return R**HIST_GROUP


def _rebinned(pool: Pool, group: int = HIST_GROUP) -> tuple[list[float], list[float]]:
    """(edges, counts) of |x| on groups of ``group`` log bins; empty groups are NaN (gaps on a log axis)."""
    if not pool.bins:
        return [], []
    acc: dict[int, int] = {}
    for j, c in pool.bins.items():
        acc[j // group] = acc.get(j // group, 0) + c
    lo, hi = min(acc), max(acc)
    out_edges = [R ** (g * group) for g in range(lo, hi + 2)]
    out_counts = [float(acc[g]) if g in acc else math.nan for g in range(lo, hi + 1)]
    return out_edges, out_counts


def _step(ax: Axes, edges: Sequence[float], counts: Sequence[float], **kw: Any):
    """One histogram as a Line2D step series (a line, so legends and tests see one artist per model)."""
    (line,) = ax.plot(list(edges), [*counts, counts[-1]], drawstyle="steps-post", **kw)
    return line


def _sigma_level(pool: Pool) -> float | None:
    """|mean| + 6 std: the magnitude beyond which a value is a 6-sigma outlier (for a near-zero mean)."""
    mean, std = pool.mean, pool.std
    if mean is None or std is None or not std > 0:
        return None
    return abs(mean) + SIGMAS * std


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _draw_hist_panel(
    ax: Axes, pooled: Mapping[str, Pool], colors: Mapping[str, str], xlim: tuple[float, float, bool]
) -> None:
    """Step histograms per model plus their top-1 (dashed) and 6-sigma (dash-dot) levels, and |x| = 6,
    on the x range ``xlim`` (see :func:`hist_xlimits`)."""
    for name, pool in pooled.items():
        edges, counts = _rebinned(pool)
        if not counts:
            continue
        color = colors[name]
        _step(ax, edges, counts, color=color, label=name)
        if pool.top1 is not None and pool.top1 > 0:
            ax.axvline(pool.top1, color=color, linestyle="--", linewidth=1.0, label=f"_top1 {name}")
        level = _sigma_level(pool)
        if level is not None:
            ax.axvline(level, color=color, linestyle="-.", linewidth=0.9, alpha=0.8, label=f"_6sigma {name}")
    ax.axvline(INT8_THRESHOLD, color="black", linestyle=":", linewidth=1.1, label="_int8")
    low, high, log = xlim
    if log:
        ax.set_xscale("log")
    ax.set_yscale("log")  # after plotting: a log scale set first would mis-place empty bins
    ax.set_xlim(low, high)


def hist_xlimits(pooled: Mapping[str, Pool]) -> tuple[float, float, bool]:
    """(low, high, log) of a histogram's x axis: where the data is, with the tail in view.

    high is HIST_MARGIN x the largest |x| of any model, extended to a marker (a model's 6-sigma level, the
    LLM.int8 threshold) that lies within 2.5 x of it. The axis is linear from 0 unless high is
    HIST_LOG_RATIO x a model's median |x| or more (the data span decades); then it is logarithmic from the
    smallest model's HIST_LOW_QUANTILE quantile of |x|.
    """
    # a pool without kept top values (topk 0) ends at its last occupied bin
    tops = [p.top1 if p.top1 else R ** (max(p.bins) + 1) for p in pooled.values() if p.top1 or p.bins]
    tops = [t for t in tops if t > 0]
    lows = [q for p in pooled.values() if (q := p.quantile(HIST_LOW_QUANTILE)) is not None and q > 0]
    medians = [q for p in pooled.values() if (q := p.quantile(0.5)) is not None and q > 0]
    if not tops or not lows:
        raise DiffquantError("histogram: no non-zero |x| to plot")
    peak = max(tops)
    markers = [lvl for p in pooled.values() if (lvl := _sigma_level(p)) is not None] + [INT8_THRESHOLD]
    high = HIST_MARGIN * max([peak, *(m for m in markers if m <= 2.5 * peak)])
    if high / min(medians) >= HIST_LOG_RATIO:
        return min(lows), high, True
    return 0.0, high, False


def _legend_text(name: str, pool: Pool) -> str:
    """Legend entry of a model: its name with the marked levels as numbers (the lines alone overlap)."""
    parts = []
    if pool.top1 is not None:
        parts.append(f"top-1 {_fmt(pool.top1)}")
    level = _sigma_level(pool)
    if level is not None:
        parts.append(f"6σ {_fmt(level)}")
    return f"{name} ({', '.join(parts)})" if parts else name


def _marker_legend_handles() -> list:
    return [
        legend_proxy(color="0.35", linestyle="--", linewidth=1.0, label="top-1 |x| (per model)"),
        legend_proxy(color="0.35", linestyle="-.", linewidth=0.9, label=f"|mean| + {SIGMAS:g}σ (per model)"),
        legend_proxy(
            color="black", linestyle=":", linewidth=1.1, label=f"|x| = {INT8_THRESHOLD:g} (LLM.int8)"
        ),
    ]


def fig_histograms(
    profiles: Mapping[str, Profile],
    kind: str,
    per_layer: bool = False,
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """Histogram of |x| over every site of ``kind``, pooled per model, models overlaid (log-log).

    Why pooled: the DIFF paper's Table 5 pools all logit / hidden-state taps, and quantization error is
    set by the tails of that pool. Each model's top-1 |x| (dashed, value annotated) and its
    |mean| + 6 std level (dash-dot) are marked, with the LLM.int8 threshold |x| = 6 (dotted black): mass to
    the right of the threshold is what an int8 scheme with outlier decomposition would keep in fp16.
    ``per_layer``: one panel per layer instead (sites of ``kind`` in that layer pooled), all panels on one
    x range. The x axis runs from the 0.5 % quantile of |x| to past the largest |x| (:func:`hist_xlimits`),
    logarithmic when that spans two decades or more; ``fig.axes[0].get_xlim()`` reads it back.
    """
    require_profiles(profiles, "fig_histograms")
    colors = colors_for(profiles, profile_kinds(profiles), colors)
    title = KIND_TITLES.get(kind, kind)
    pooled = {n: s for n, p in profiles.items() if (s := _pooled(p, kind)) is not None}
    if not pooled:
        raise DiffquantError(f"no sites of kind {kind!r} with data in any profile")
    xlim = hist_xlimits(pooled)
    scale = "log scale" if xlim[2] else "linear scale"
    if not per_layer:
        with style_context():
            fig = new_figure(9.0, 4.4)
            ax = fig.add_subplot()
            _draw_hist_panel(ax, pooled, colors, xlim)
            ax.set_xlabel(f"|x|  (activation magnitude, {scale})")
            ax.set_ylabel(f"count per bin (bins ×{hist_bar_width():.3f} wide)")
            ax.set_title(f"|x| histogram of {title} [{kind}], all layers pooled")
            model_handles = [line for line in ax.get_lines() if line.get_label() in pooled]
            handles = model_handles + _marker_legend_handles()
            texts = [_legend_text(h.get_label(), pooled[h.get_label()]) for h in model_handles]
            texts += [h.get_label() for h in handles[len(model_handles) :]]
            fig.legend(handles, texts, loc="outside right upper")
        return fig

    layers = sorted(
        {
            layer
            for p in profiles.values()
            for name, s in p.sites.items()
            if s.kind == kind and (layer := layer_of(name)) is not None
        }
    )
    if not layers:
        raise DiffquantError(f"no per-layer sites of kind {kind!r} in any profile")
    ncols = min(4, len(layers))
    nrows = math.ceil(len(layers) / ncols)
    with style_context():
        # Legend below (not to the right) so the panels get the whole width of the report column.
        fig = new_figure(min(MAX_WIDTH_IN, 2.75 * ncols + 0.4), 2.5 * nrows + 1.3)
        axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
        for ax, layer in zip(axes, layers, strict=False):
            in_layer = {n: s for n, p in profiles.items() if (s := _pooled(p, kind, layer)) is not None}
            _draw_hist_panel(ax, in_layer, colors, xlim)
            ax.set_title(f"layer {layer}")
        for ax in axes[len(layers) :]:
            ax.remove()
        for k, ax in enumerate(axes[: len(layers)]):
            if k + ncols >= len(layers):  # no panel below this one
                ax.set_xlabel("|x|")
                ax.tick_params(labelbottom=True)
            if k % ncols == 0:
                ax.set_ylabel("count per bin")
        names = [n for n in profiles if n in colors]
        handles = [legend_proxy(color=colors[n], label=n) for n in names] + _marker_legend_handles()
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3))
        fig.suptitle(f"|x| histograms of {title} [{kind}] per layer")
    return fig
