"""Per-layer views: the largest and median |x| per layer (massive activations) and λ per layer and head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.plots.common import KIND_TITLES, legend_proxy, profile_kinds, require_profiles
from diffquant.plots.style import colors_for, new_figure, style_context
from diffquant.profile.profiler import Profile
from diffquant.profile.sites import layer_of
from diffquant.profile.tables import layerwise

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MASSIVE_FLOOR = 100.0  # massive activations exceed 100 (Sun et al. 2024)


def fig_layerwise(
    profiles: Mapping[str, Profile], kind: str = "resid", colors: Mapping[str, str] | None = None
) -> Figure:
    """Top-1 / top-2 / top-3 and median |x| per layer, per model, log y (Sun et al. 2024, Fig. 1 view).

    Why: massive activations appear as top-k values orders of magnitude above the median from some layer
    on; a differential model that suppresses them shows flat, low top-k curves. Colour = model, line style
    = statistic.
    """
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (plots load matplotlib on first figure)

    require_profiles(profiles, "fig_layerwise")
    colors = colors_for(profiles, profile_kinds(profiles), colors)
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
            legend_proxy(color="0.3", linestyle=ls, marker=m, markersize=4, label=s.replace("top", "top-"))
            for s, ls, m in stats
        ]
        if peak >= MASSIVE_FLOOR / 2:
            stat_handles.append(legend_proxy(color="0.4", linestyle=(0, (1, 3)), label="|x| = 100 (massive)"))
        fig.legend(handles=stat_handles, loc="outside right lower", title="statistic")
    return fig


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
    require_profiles(profiles, "fig_lambda")
    data = {n: s for n, p in profiles.items() if (s := lambda_summaries(p))}
    if not data:
        raise DiffquantError("no lambda statistics in any profile (no DIFF model)")
    colors = colors_for(profiles, profile_kinds(profiles), colors)
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
