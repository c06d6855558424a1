"""Figures of a run folder, drawn from its artifacts only (never by re-running a model).

``render_run(RUN)`` draws every applicable figure into RUN/figures/; the ``fig_*`` functions draw one figure
each and return the matplotlib Figure. matplotlib is imported only when a figure is drawn.
"""

from diffquant.plots.figures import (
    fig_act_scales,
    fig_attention_maps,
    fig_degradation,
    fig_histograms,
    fig_lambda,
    fig_layerwise,
)
from diffquant.plots.run import FAMILIES, FigureRecord, load_run, render_run
from diffquant.plots.style import model_colors

__all__ = [
    "FAMILIES",
    "FigureRecord",
    "fig_act_scales",
    "fig_attention_maps",
    "fig_degradation",
    "fig_histograms",
    "fig_lambda",
    "fig_layerwise",
    "load_run",
    "model_colors",
    "render_run",
]
