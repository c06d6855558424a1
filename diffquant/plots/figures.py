"""Figure functions: each draws one figure from loaded artifacts and returns the matplotlib Figure.

Inputs are what a run folder holds (profiles, attention maps of one sample, sweep results), never a model:
figures must be reproducible from the artifacts alone, long after the GPUs are gone. Every function takes
an optional ``colors`` map (model name -> colour, see :func:`diffquant.plots.style.model_colors`) so a
report shows each model in one colour throughout; without it colours are derived from the inputs.

Figures are plain ``matplotlib.figure.Figure`` objects (no pyplot state); tests inspect them directly:
every per-model series carries the model name as its label.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from diffquant.errors import DiffquantError
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.profile.profiler import Profile
from diffquant.profile.sites import layer_of
from diffquant.profile.stats import LN_R, R, SiteStats
from diffquant.profile.tables import layerwise
from diffquant.quant.schemes import Scheme, bits_of

if TYPE_CHECKING:
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


HIST_KINDS = ("logits", "resid", "q", "k", "v", "mlp_act", "linear_in")
KIND_TITLES = {
    "logits": "attention logits",
    "resid": "hidden states (layer outputs)",
    "q": "queries (after RoPE)",
    "k": "keys (after RoPE)",
    "v": "values",
    "mlp_act": "MLP activations",
    "linear_in": "Linear-layer inputs",
    "probs": "attention probabilities",
    "diff_map": "differential attention maps",
    "head_out": "per-head attention outputs",
    "attn_out": "attention-block outputs",
}
INT8_THRESHOLD = 6.0  # LLM.int8 outlier threshold (Dettmers et al. 2022)
SIGMAS = 6.0  # outliers beyond 6 standard deviations (Bondarenko et al. 2023)
MASSIVE_FLOOR = 100.0  # massive activations exceed 100 (Sun et al. 2024)
# The profile's log bins (64 per octave, ~1.1 % wide) are far too fine to read at a few thousand tokens:
# plot groups of HIST_GROUP neighbouring bins (2^(11/64) = x1.126, ~19 bins per decade). Groups are aligned
# on the global bin index, so every model and site is rebinned onto the same grid.
HIST_GROUP = 11
MAP_PERCENTILE = 99.0  # colour limit of attention maps, as a percentile of |entry| (see _show_map)
# Histogram x range: up to HIST_MARGIN x the largest |x|, so the tail, where quantization error is decided,
# ends inside the frame. Linear from 0 (the outlier view: the tail gets most of the width) unless the largest
# |x| is HIST_LOG_RATIO x the median or more (three decades: massive activations); then logarithmic from the
# HIST_LOW_QUANTILE quantile of |x| (the smallest values, invisible on any useful scale, are left out).
HIST_LOW_QUANTILE = 0.005
HIST_MARGIN = 1.3
HIST_LOG_RATIO = 1000.0
_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 2)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


# ------------------------------------------------------------------------------------------- helpers
def _kinds(profiles: Mapping[str, Profile]) -> dict[str, str]:
    return {name: str(p.meta.get("attention", "")) for name, p in profiles.items()}


def _require(profiles: Mapping[str, Any], what: str) -> None:
    if not profiles:
        raise DiffquantError(f"{what}: no profiles given")


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


def _hist_bar_width() -> float:
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


def _proxy(**kw: Any):
    """A legend entry not drawn on any axes (explains a line style shared by all models)."""
    from matplotlib.lines import Line2D  # noqa: PLC0415 (plots load matplotlib on first figure)

    return Line2D([], [], **kw)


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
        _proxy(color="0.35", linestyle="--", linewidth=1.0, label="top-1 |x| (per model)"),
        _proxy(color="0.35", linestyle="-.", linewidth=0.9, label=f"|mean| + {SIGMAS:g}σ (per model)"),
        _proxy(color="black", linestyle=":", linewidth=1.1, label=f"|x| = {INT8_THRESHOLD:g} (LLM.int8)"),
    ]


# ------------------------------------------------------------------------------------- histograms
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
    _require(profiles, "fig_histograms")
    colors = colors_for(profiles, _kinds(profiles), colors)
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
            ax.set_ylabel(f"count per bin (bins ×{_hist_bar_width():.3f} wide)")
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
        handles = [_proxy(color=colors[n], label=n) for n in names] + _marker_legend_handles()
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3))
        fig.suptitle(f"|x| histograms of {title} [{kind}] per layer")
    return fig


# --------------------------------------------------------------------------------------- layerwise
def fig_layerwise(
    profiles: Mapping[str, Profile], kind: str = "resid", colors: Mapping[str, str] | None = None
) -> Figure:
    """Top-1 / top-2 / top-3 and median |x| per layer, per model, log y (Sun et al. 2024, Fig. 1 view).

    Why: massive activations appear as top-k values orders of magnitude above the median from some layer
    on; a differential model that suppresses them shows flat, low top-k curves. Colour = model, line style
    = statistic.
    """
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (plots load matplotlib on first figure)

    _require(profiles, "fig_layerwise")
    colors = colors_for(profiles, _kinds(profiles), colors)
    stats = (("top1", "-", "o"), ("top2", "--", "s"), ("top3", ":", "^"), ("median", "-.", None))
    curves = {n: rows for n, p in profiles.items() if (rows := layerwise(p, kind))}
    if not curves:
        raise DiffquantError(f"no per-layer sites of kind {kind!r} in any profile")
    peak = 0.0
    with style_context():
        fig = new_figure(7.4, 4.2)
        ax = fig.add_subplot()
        for name, rows in curves.items():
            for stat, ls, marker in stats:
                pts = [(r["layer"], r[stat]) for r in rows if r[stat] is not None and r[stat] > 0]
                if not pts:
                    continue
                peak = max(peak, *(v for _, v in pts))
                label = name if stat == "top1" else f"_{name} {stat}"
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, color=colors[name], linestyle=ls, marker=marker, markersize=4, label=label)
        if peak >= MASSIVE_FLOOR / 2:
            ax.axhline(MASSIVE_FLOOR, color="0.4", linestyle=(0, (1, 3)), linewidth=1.0, label="_massive")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("|x|  (log scale)")
        ax.set_title(f"Largest and median |x| of {KIND_TITLES.get(kind, kind)} per layer")
        model_handles = [line for line in ax.get_lines() if line.get_label() in curves]
        fig.legend(handles=model_handles, loc="outside right upper", title="model")
        stat_handles = [
            _proxy(color="0.3", linestyle=ls, marker=m, markersize=4, label=s.replace("top", "top-"))
            for s, ls, m in stats
        ]
        if peak >= MASSIVE_FLOOR / 2:
            stat_handles.append(_proxy(color="0.4", linestyle=(0, (1, 3)), label="|x| = 100 (massive)"))
        fig.legend(handles=stat_handles, loc="outside right lower", title="statistic")
    return fig


# ---------------------------------------------------------------------------------- attention maps
def _map_layers(maps: Mapping[str, torch.Tensor]) -> set[int]:
    return {layer for key in maps if (layer := layer_of(key)) is not None}


def _map_kind(maps: Mapping[str, torch.Tensor], layer: int) -> str:
    """'baseline' (one softmax map), 'diff_v1' (scalar lambda), 'diff_v2' (per-token lambda) or ''."""
    if f"layers.{layer}.probs" in maps:
        return "baseline"
    lam = maps.get(f"layers.{layer}.lambda")
    if f"layers.{layer}.probs1" in maps and f"layers.{layer}.probs2" in maps and lam is not None:
        return "diff_v1" if lam.dim() == 0 else "diff_v2"
    return ""


def _visible(a: Any) -> Any:
    """Mask the causally hidden upper triangle (key > query), shown in light grey, not as zeros."""
    a = np.asarray(a, dtype=float)
    t, s = a.shape
    hidden = np.arange(s)[None, :] > (np.arange(t)[:, None] + (s - t))
    return np.ma.masked_array(a, mask=hidden)


def _show_map(fig: Figure, ax: Axes, data: Any, title: str) -> None:
    """One map on RdBu_r with limits symmetric about zero (white = 0), with its own colour bar.

    The limit is the 99th percentile of |entry| over the visible entries, not the maximum: the first
    query rows (one or two visible keys) hold entries near 1 that would otherwise wash out the rest of
    the map. Clipped entries saturate, and the colour bar's arrows say so.
    """
    import matplotlib  # noqa: PLC0415 (plots load matplotlib on first figure)

    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#E8E8E8")
    visible = np.abs(data.compressed())
    vmax = float(np.percentile(visible, MAP_PERCENTILE)) if visible.size else 0.0
    peak = float(visible.max()) if visible.size else 0.0
    vmax = vmax if vmax > 0 else (peak if peak > 0 else 1e-6)
    im = ax.imshow(data, cmap=cmap, vmin=-vmax, vmax=vmax, interpolation="nearest", aspect="equal")
    ax.set_title(title, fontsize=9)
    ax.grid(False)
    fig.colorbar(im, ax=ax, shrink=0.75, pad=0.03, extend="both" if peak > vmax else "neither")


def fig_attention_maps(
    maps_by_model: Mapping[str, Any],
    layer: int,
    head: int = 0,
    max_len: int | None = None,
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """Attention maps of one sample: per DIFF model a row A1, A2, lambda*A2, A1 - lambda*A2; the
    baseline's softmax map in its own column to the right.

    Why: the DIFF claim is that subtracting lambda*A2 cancels common-mode "attention noise"; seeing the
    components next to their difference (and next to a plain softmax map) shows where the cancellation
    happens and that the difference has negative entries. All panels use RdBu_r with limits symmetric
    about zero, so white is exactly 0 and sign is visible. DIFF V2's lambda is per query token: row i of
    lambda*A2 is scaled by lambda[head, i]. ``maps_by_model`` values are ``load_maps`` results
    ((maps, meta) pairs) or plain {key: tensor} dicts.
    """
    if not maps_by_model:
        raise DiffquantError("fig_attention_maps: no attention maps given")
    entries: dict[str, tuple[str, Mapping[str, torch.Tensor]]] = {}
    for name, value in maps_by_model.items():
        maps = value[0] if isinstance(value, tuple) else value
        if layer not in _map_layers(maps):
            have = sorted(_map_layers(maps))
            raise DiffquantError(f"attention maps of {name}: no layer {layer} (layers {have})")
        kind = _map_kind(maps, layer)
        if not kind:
            raise DiffquantError(
                f"attention maps of {name}: layer {layer} has no probs / probs1+probs2+lambda"
            )
        first = maps[f"layers.{layer}.probs" if kind == "baseline" else f"layers.{layer}.probs1"]
        if first.dim() != 3:
            raise DiffquantError(
                f"attention maps of {name}: expected (heads, T, T) maps, got {tuple(first.shape)}"
            )
        if not 0 <= head < first.shape[0]:
            raise DiffquantError(
                f"attention maps of {name}: head {head} out of range ({first.shape[0]} heads)"
            )
        entries[name] = (kind, maps)
    colors = colors_for(entries, {n: k for n, (k, _) in entries.items()}, colors)
    diff = [n for n, (k, _) in entries.items() if k != "baseline"]
    base = [n for n, (k, _) in entries.items() if k == "baseline"]
    ncols = (4 if diff else 0) + (1 if base else 0)
    nrows = max(len(diff), len(base))
    crop = slice(None) if max_len is None else slice(0, max_len)
    length = None
    with style_context():
        panel = min(3.0, (MAX_WIDTH_IN - 0.3) / ncols)  # the whole figure fits the report column
        fig = new_figure(panel * ncols + 0.3, (panel - 0.2) * nrows + 0.9)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        used: set[tuple[int, int]] = set()
        for row, name in enumerate(diff):
            kind, maps = entries[name]
            a1 = maps[f"layers.{layer}.probs1"][head][crop, crop].double()
            a2 = maps[f"layers.{layer}.probs2"][head][crop, crop].double()
            lam = maps[f"layers.{layer}.lambda"]
            if lam.dim() == 0:
                lam_rows = float(lam)
                lam_text = f"λ = {float(lam):.3g}"
            else:
                lam_rows = lam[head][crop].double()[: a2.shape[0], None]
                lam_text = f"mean λ {float(lam_rows.mean()):.3g}"
            scaled = a2 * lam_rows
            panels = [
                (a1, f"{name}: A1"),
                (a2, f"{name}: A2"),
                (scaled, f"{name}: λ·A2\n{lam_text}"),
                (a1 - scaled, f"{name}: A1 − λ·A2"),
            ]
            for col, (data, title) in enumerate(panels):
                ax = axes[row, col]
                _show_map(fig, ax, _visible(data.numpy()), title)
                used.add((row, col))
                if col == 0:
                    ax.set_ylabel("query position", color=colors[name])
                if row == nrows - 1 or row == len(diff) - 1:
                    ax.set_xlabel("key position")
            length = a1.shape[0]
        for row, name in enumerate(base):
            _, maps = entries[name]
            a = maps[f"layers.{layer}.probs"][head][crop, crop].double()
            ax = axes[row, ncols - 1]
            _show_map(fig, ax, _visible(a.numpy()), f"{name}: softmax A")
            ax.set_ylabel("query position", color=colors[name])
            ax.set_xlabel("key position")
            used.add((row, ncols - 1))
            length = a.shape[0]
        for r in range(nrows):
            for c in range(ncols):
                if (r, c) not in used:
                    axes[r, c].remove()
        fig.suptitle(f"Attention maps, layer {layer}, head {head} (first {length} tokens of one sample)")
    return fig


# ------------------------------------------------------------------------------------- degradation
def _granularity_label(scheme: Any) -> str:
    """The line a single-format plan belongs to: granularity plus anything else that changes the error."""
    if scheme.is_block_format:
        return f"{scheme.format} blocks"
    gran = "row" if scheme.granularity in ("row", "token") else scheme.granularity
    label = f"per-{gran}"
    if not scheme.format.startswith(("int", "uint")):
        label = f"{scheme.format} {label}"
    if scheme.asymmetric:
        label += " asym"
    if scheme.is_static:
        label += f" {scheme.calibration}"
    if scheme.smooth:
        label += " smooth"
    if scheme.scale is not None:
        label += " fixed-scale"
    if scheme.scale_format != "fp32":
        label += f" {scheme.scale_format}-scales"
    return label


def plan_point(plan: Mapping[str, Any] | None) -> tuple[float, str] | None:
    """(bits, line label) for a plan made of one number format at one granularity, else None.

    Such plans lie on a bits axis (int8 -> int6 -> int4 per-tensor is one curve); plans mixing formats or
    granularities (w4a8, w8a8 with per-channel weights and per-token inputs) or using a backend do not,
    and are shown as bars instead. Raises DiffquantError on a malformed plan.
    """
    if plan is None or plan.get("backend") or not plan.get("rules"):
        return None
    schemes = [Scheme.parse(rule.get("scheme"), where=f"plan {plan.get('name')!r}") for rule in plan["rules"]]
    if len({s.format for s in schemes}) != 1:
        return None
    labels = {_granularity_label(s) for s in schemes}
    if len(labels) != 1:
        return None
    return bits_of(schemes[0]), labels.pop()


def chance_metric(metric: str) -> str:
    """Name of the metric a task reports as the chance level of ``metric`` (acc_rank -> chance_rank)."""
    return "chance_" + metric.split("_", 1)[1] if "_" in metric else "chance"


def chance_levels(results: Mapping[str, Any], task: str) -> dict[str, float]:
    """{model: chance level of the task's primary metric}, where the task reports one (retrieval's
    ``chance_rank``); taken from the unquantized cell, else any cell of the model."""
    primary = (results.get("primary") or {}).get(task) or {}
    metric = primary.get("metric")
    if not metric:
        return {}
    names = {chance_metric(metric), "chance"}
    out: dict[str, float] = {}
    for r in results.get("rows", []):
        value = r.get("value")
        if r.get("task") != task or r.get("metric") not in names:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if number and (r.get("plan") == "none" or r["model"] not in out):
            out[r["model"]] = float(value)
    return out


def fig_degradation(
    results: Mapping[str, Any],
    sweep: Mapping[str, Any],
    task: str | None = None,
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """The task's primary metric vs bits, one panel per model (one line per granularity); other plans as bars.

    Why: the DIFF paper's Figure 8 claim is that DIFF degrades more gracefully as attention logits lose
    bits, and per-row scales shift where each architecture breaks. x is bits per element (log2 axis,
    16 = the unquantized model, also drawn as a dotted horizontal line per model). The model panels share
    one y scale, so a steeper curve is a larger loss whichever panel it is in; where the task reports a
    chance level (retrieval), it is drawn as a grey dashed line. Plans that are not one format at one
    granularity (mixed weight/activation formats, backends) get a panel of their own below: grouped bars
    of the change vs unquantized, per model. ``results`` / ``sweep``: the contents of results.json /
    sweep.json (or the sweep's ``spec``). ``fig.axes``: the model panels in order, then the bar panel.
    """
    primary = results.get("primary") or {}
    if task is None:
        if not primary:
            raise DiffquantError("sweep results name no task")
        task = next(iter(primary))
    if task not in primary:
        raise DiffquantError(f"sweep results have no task {task!r}; tasks: {', '.join(primary)}")
    metric, higher = primary[task]["metric"], bool(primary[task]["higher_is_better"])
    spec = sweep.get("spec", sweep)
    plans: Mapping[str, Any] = spec.get("plans") or {}
    rows = [
        r
        for r in results.get("rows", [])
        if r.get("task") == task and r.get("metric") == metric and isinstance(r.get("value"), (int, float))
    ]
    if not rows:
        raise DiffquantError(f"sweep results hold no {metric!r} values for task {task!r}")
    models = [m for m in spec.get("models", {}) if any(r["model"] == m for r in rows)]
    models += [m for m in dict.fromkeys(r["model"] for r in rows) if m not in models]
    kinds = {r["model"]: str(r.get("attention", "")) for r in rows}
    colors = colors_for(models, kinds, colors)
    value = {(r["model"], r["plan"]): r for r in rows}
    chance = chance_levels(results, task)

    points: dict[str, tuple[float, str]] = {}
    other: list[str] = []
    taken: set[tuple[float, str]] = set()
    plan_names = list(plans) + [p for p in dict.fromkeys(r["plan"] for r in rows) if p not in plans]
    for plan in plan_names:
        if plan == "none" or not any((m, plan) in value for m in models):
            continue
        point = plan_point(plans.get(plan))
        if point is None or point in taken:  # two plans at one (bits, line): no single curve, use bars
            other.append(plan)
        else:
            taken.add(point)
            points[plan] = point
    lines = list(dict.fromkeys(label for _, label in points.values()))
    if not points and not other:
        raise DiffquantError(f"sweep results for task {task!r} hold no quantized plan")

    direction = "higher" if higher else "lower"
    with style_context():
        # Model panels in rows of at most three (each wide enough to read in the report), the bar panel
        # below them across the whole width.
        curve_models = models if points else []
        ncols = max(1, min(3, len(curve_models)))
        curve_rows = math.ceil(len(curve_models) / ncols) if curve_models else 0
        nrows = curve_rows + int(bool(other))
        width = min(MAX_WIDTH_IN, max(6.4, 3.6 * ncols))
        fig = new_figure(width, 3.4 * curve_rows + (2.8 if other else 0.0))
        grid = fig.add_gridspec(nrows, ncols)
        first: Axes | None = None
        for k, name in enumerate(curve_models):
            ax = fig.add_subplot(grid[k // ncols, k % ncols], sharey=first)
            first = first or ax
            ticks: set[float] = set()
            ref = next(
                (r["unquantized"] for r in rows if r["model"] == name and r["unquantized"] is not None),
                None,
            )
            if ref is None and (name, "none") in value:
                ref = value[(name, "none")]["value"]
            for i, line in enumerate(lines):
                pts = sorted(
                    (bits, value[(name, plan)]["value"])
                    for plan, (bits, label) in points.items()
                    if label == line and (name, plan) in value
                )
                if not pts:
                    continue
                if ref is not None:
                    pts.append((16.0, ref))
                ticks.update(b for b, _ in pts)
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    color=colors[name],
                    linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                    marker=_MARKERS[i % len(_MARKERS)],
                    markersize=5,
                    label=f"{name} · {line}",
                )
            if ref is not None:
                ax.axhline(ref, color=colors[name], linestyle=":", linewidth=0.9, alpha=0.7, label="_ref")
            if name in chance:
                ax.axhline(chance[name], color="0.45", linestyle="--", linewidth=1.0, label="_chance")
            ax.set_xscale("log", base=2)
            ticks_sorted = sorted(ticks)
            ax.set_xticks(ticks_sorted, [("16\n(none)" if t == 16 else f"{t:g}") for t in ticks_sorted])
            ax.minorticks_off()
            ax.set_xlabel("bits per element")
            if k % ncols == 0:
                ax.set_ylabel(f"{metric} ({direction} is better)")
            ax.set_title(f"{task}: {name}")
            ax.ticklabel_format(axis="y", useOffset=False)
            handles = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
            handles.append(
                _proxy(
                    color=colors[name],
                    linestyle=":",
                    label=f"unquantized ({ref:.4g})" if ref is not None else "unquantized",
                )
            )
            if name in chance:
                handles.append(_proxy(color="0.45", linestyle="--", label=f"chance ({chance[name]:.3g})"))
            ax.legend(handles=handles, loc="best")
        if other:
            ax = fig.add_subplot(grid[nrows - 1, :])
            x = np.arange(len(other))
            bar = 0.8 / max(1, len(models))
            for i, name in enumerate(models):
                deltas = []
                for plan in other:
                    r = value.get((name, plan))
                    deltas.append(math.nan if r is None or r.get("delta") is None else r["delta"])
                ax.bar(x + (i - (len(models) - 1) / 2) * bar, deltas, bar, color=colors[name], label=name)
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_xticks(x, other)
            ax.set_xlabel("plan")
            ax.set_ylabel(f"Δ {metric}\nvs unquantized")
            ax.set_title(f"{task}: other plans, change vs unquantized ({direction} is better)")
            ax.grid(False, axis="x")
            ax.legend(loc="best")
    return fig


# ------------------------------------------------------------------------------------- act scales
def default_act_site(profiles: Mapping[str, Profile]) -> str | None:
    """The first layer's MLP down-projection input if every profile has it (the SmoothQuant hot spot),
    else the first linear_in site of the first profile, else None."""
    preferred = "layers.0.mlp.down.input"
    if profiles and all(preferred in p.sites for p in profiles.values()):
        return preferred
    for p in profiles.values():
        for name, s in p.sites.items():
            if s.kind == "linear_in":
                return name
    return None


def fig_act_scales(
    profiles: Mapping[str, Profile], site: str | None = None, colors: Mapping[str, str] | None = None
) -> Figure:
    """Per-channel abs-max of one site per model (SmoothQuant's act_scales, Xiao et al. 2023).

    Why: per-tensor activation quantization is limited by the few channels with huge abs-max; a flat
    profile means easy quantization. Left: by channel index (where the outlier channels are); right:
    sorted descending (how heavy the tail is, comparable across models of different width).
    """
    _require(profiles, "fig_act_scales")
    site = site or default_act_site(profiles)
    if site is None:
        raise DiffquantError("no Linear-input (linear_in) site in any profile")
    found: dict[str, list[float]] = {}
    for name, p in profiles.items():
        stats = p.sites.get(site)
        if stats is None:
            continue
        absmax = stats.summary()["channel_absmax"]
        if absmax:
            flat = _flatten(absmax)
            if flat:
                found[name] = flat
    if not found:
        raise DiffquantError(f"site {site!r}: no per-channel abs-max in any profile")
    colors = colors_for(profiles, _kinds(profiles), colors)
    with style_context():
        fig = new_figure(MAX_WIDTH_IN, 4.0)
        ax_idx, ax_sorted = fig.subplots(1, 2)
        for name, values in found.items():
            pos = [max(v, 1e-12) for v in values]
            ax_idx.plot(range(len(pos)), pos, color=colors[name], linewidth=0.9, alpha=0.9, label=name)
            ax_sorted.plot(range(1, len(pos) + 1), sorted(pos, reverse=True), color=colors[name], label=name)
        ax_idx.set_yscale("log")
        ax_idx.set_xlabel("channel index")
        ax_idx.set_ylabel("max |x| over tokens  (log scale)")
        ax_idx.set_title(f"Per-channel abs-max: {site}")
        ax_idx.legend()
        ax_sorted.set_xscale("log")
        ax_sorted.set_yscale("log")
        ax_sorted.set_xlabel("channel rank (largest first, log scale)")
        ax_sorted.set_ylabel("max |x| over tokens  (log scale)")
        ax_sorted.set_title("Sorted (SmoothQuant act scales)")
        ax_sorted.legend()
    return fig


def _flatten(values: Any) -> list[float]:
    if isinstance(values, (int, float)):
        return [float(values)]
    out: list[float] = []
    for v in values:
        out.extend(_flatten(v))
    return out


# ----------------------------------------------------------------------------------------- lambda
def lambda_summaries(profile: Profile) -> dict[int, dict[str, Any]]:
    """{layer: LambdaStats summary} of one profile (empty for a baseline)."""
    out = {}
    for name, (kind, acc) in profile.attention.items():
        layer = layer_of(name)
        if kind == "lambda" and layer is not None:
            summary = acc.summary()
            if summary.get("mode") is not None:
                out[layer] = summary
    return dict(sorted(out.items()))


def fig_lambda(profiles: Mapping[str, Profile], colors: Mapping[str, str] | None = None) -> Figure:
    """lambda per layer for every DIFF model, and per head for DIFF V2.

    Why: lambda sets how much of A2 is subtracted; DIFF V1 learns one scalar per layer (re-parameterised
    around lambda_init), DIFF V2 predicts sigmoid(W x) per token and head. Left: per layer (V1 the scalar,
    V2 the mean over tokens and heads, band = min..max over tokens and heads). Right (DIFF V2 only): per
    head, mean +- std over tokens (thick) and min..max (thin).
    """
    _require(profiles, "fig_lambda")
    data = {n: s for n, p in profiles.items() if (s := lambda_summaries(p))}
    if not data:
        raise DiffquantError("no lambda statistics in any profile (no DIFF model)")
    colors = colors_for(profiles, _kinds(profiles), colors)
    per_head = {n: s for n, s in data.items() if any(v["mode"] == "per_head" for v in s.values())}
    with style_context():
        ncols = 2 if per_head else 1
        fig = new_figure(5.5 * ncols, 4.0)
        axes = fig.subplots(1, ncols, squeeze=False)[0]
        ax = axes[0]
        for name, layers in data.items():
            xs, ys, lo, hi = [], [], [], []
            for layer, s in layers.items():
                if s["mode"] == "scalar":
                    xs.append(layer)
                    ys.append(s["value"])
                    lo.append(s["min"])
                    hi.append(s["max"])
                elif s["mean"]["mean"] is not None:
                    xs.append(layer)
                    ys.append(s["mean"]["mean"])
                    lo.append(s["min"]["min"])
                    hi.append(s["max"]["max"])
            if not xs:
                continue
            ax.plot(xs, ys, color=colors[name], marker="o", markersize=4, label=name)
            if any(a is not None and b is not None and b > a for a, b in zip(lo, hi, strict=True)):
                ax.fill_between(xs, lo, hi, color=colors[name], alpha=0.15, linewidth=0)
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (plots load matplotlib on first figure)

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("λ")
        ax.set_title("λ per layer (V1: scalar; V2: mean, band = min..max)")
        ax.legend()
        if per_head:
            ax = axes[1]
            n_models = len(per_head)
            for m, (name, layers) in enumerate(per_head.items()):
                xs, means, stds, mins, maxs = [], [], [], [], []
                for layer, s in layers.items():
                    if s["mode"] != "per_head":
                        continue
                    heads = len(s["mean"]["per_head"])
                    width = 0.8 / (heads * n_models)
                    for h in range(heads):
                        mean = s["mean"]["per_head"][h]
                        if mean is None:
                            continue
                        slot = m * heads + h - (heads * n_models - 1) / 2
                        xs.append(layer + slot * width)
                        means.append(mean)
                        stds.append(s["std"]["per_head"][h] or 0.0)
                        mins.append(s["min"]["per_head"][h])
                        maxs.append(s["max"]["per_head"][h])
                color = colors[name]
                ax.vlines(
                    xs,
                    [v if v is not None else mu for v, mu in zip(mins, means, strict=True)],
                    [v if v is not None else mu for v, mu in zip(maxs, means, strict=True)],
                    color=color,
                    linewidth=0.8,
                    alpha=0.6,
                    label="_range",
                )
                ax.errorbar(
                    xs, means, yerr=stds, fmt="o", color=color, markersize=3, elinewidth=2.2, label=name
                )
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("layer (heads side by side)")
            ax.set_ylabel("λ")
            ax.set_title("DIFF V2 λ per head: mean ± std (thick), min..max (thin)")
            ax.legend()
    return fig
