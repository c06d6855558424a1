"""Per-channel views: the abs-max of each channel of one site (SmoothQuant's act scales)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.plots.common import profile_kinds, require_profiles
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.profile.profiler import Profile

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def act_peaks(profiles: Mapping[str, Profile]) -> dict[str, float]:
    """{Linear-input (linear_in) site: its largest act scale, the largest |x| any profile saw there}, in
    the first profile's site order (sites of the other profiles after)."""
    peaks: dict[str, float] = {}
    for p in profiles.values():
        for name, s in p.sites.items():
            if s.kind != "linear_in" or not s.count:
                continue
            ends = [abs(v) for v in (s.min, s.max) if v is not None and math.isfinite(v)]
            if ends:
                peaks[name] = max(peaks.get(name, 0.0), *ends)
    return peaks


def default_act_site(profiles: Mapping[str, Profile]) -> str | None:
    """The Linear input with the largest act scale (per-channel abs-max) in any profile, among the sites
    every profile has (else among all); None without a linear_in site. SmoothQuant's hot spot is where
    the largest channel is, not a fixed layer (SmolLM2: layer 11's down_proj, 3,124; layer 0's: ~7)."""
    peaks = act_peaks(profiles)
    shared = {n: v for n, v in peaks.items() if all(n in p.sites for p in profiles.values())}
    pool = shared or peaks
    return max(pool, key=pool.__getitem__) if pool else None


def resolve_act_site(profiles: Mapping[str, Profile], linear: str | None) -> str | None:
    """The site of the act-scales figure: :func:`default_act_site` for None, else the Linear named
    ``linear`` (``layers.11.mlp.down``, its input site ``layers.11.mlp.down.input`` too); a name that is
    no profiled Linear is a one-line DiffquantError naming the choices."""
    if linear is None:
        return default_act_site(profiles)
    peaks = act_peaks(profiles)
    for site in (linear, f"{linear}.input"):
        if site in peaks:
            return site
    names = [n.removesuffix(".input") for n in peaks]
    raise DiffquantError(
        f"--linear {linear!r}: no profiled Linear of that name; "
        + (f"choices: {_name_choices(names)}" if names else "the profiles hold no Linear input")
    )


def _name_choices(names: list[str]) -> str:
    """Linear names, those in the blocks once per name with the layer range (``layers.N.mlp.down``)."""
    inside: dict[str, list[int]] = {}
    outside: list[str] = []
    for n in names:
        head, dot, rest = n.partition(".")
        layer, _, tail = rest.partition(".")
        if head == "layers" and dot and layer.isdigit() and tail:
            inside.setdefault(tail, []).append(int(layer))
        else:
            outside.append(n)
    layers = sorted({k for v in inside.values() for k in v})
    text = [f"layers.N.{tail}" for tail in inside] + outside
    span = f" (N = {layers[0]}..{layers[-1]})" if layers else ""
    return ", ".join(text) + span


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
