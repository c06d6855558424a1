"""Attention maps of one sample: DIFF components next to their difference, and the baseline's softmax map."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from diffquant.errors import DiffquantError
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.profile.sites import layer_of

if TYPE_CHECKING:
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAP_PERCENTILE = 99.0  # colour limit of attention maps, as a percentile of |entry| (see _show_map)


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
    ax.set_title(title, fontsize=9, wrap=True)  # a long model name wraps at the figure's edge
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
        # wrapped to the figure's width: one model is one narrow column of panels (SmolLM2's 3.3 in)
        fig.suptitle(
            f"Attention maps, layer {layer}, head {head} (first {length} tokens of one sample)", wrap=True
        )
    return fig
