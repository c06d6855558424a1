"""Per-channel views: the abs-max of each channel of one site (SmoothQuant's act scales)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.plots.common import profile_kinds, require_profiles
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.profile.profiler import Profile

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
    require_profiles(profiles, "fig_act_scales")
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
    colors = colors_for(profiles, profile_kinds(profiles), colors)
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
