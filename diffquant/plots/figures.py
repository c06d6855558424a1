"""Figure functions: each draws one figure from loaded artifacts and returns the matplotlib Figure.

Inputs are what a run folder holds (profiles, attention maps of one sample, sweep results), never a model:
figures must be reproducible from the artifacts alone, long after the GPUs are gone. Every function takes
an optional ``colors`` map (model name -> colour, see :func:`diffquant.plots.style.model_colors`) so a
report shows each model in one colour throughout; without it colours are derived from the inputs.

Figures are plain ``matplotlib.figure.Figure`` objects (no pyplot state); tests inspect them directly:
every per-model series carries the model name as its label.

One module per family, re-exported here (the import path of every figure function):

* :mod:`~diffquant.plots.hist`: ``fig_histograms`` (|x| histograms, pooled or per layer), ``Pool``,
  ``hist_xlimits``;
* :mod:`~diffquant.plots.layers`: ``fig_layerwise`` (top-k and median |x| per layer), ``fig_lambda``;
* :mod:`~diffquant.plots.maps`: ``fig_attention_maps``;
* :mod:`~diffquant.plots.degradation`: ``fig_degradation``, ``plan_point``, ``chance_levels``;
* :mod:`~diffquant.plots.channels`: ``fig_act_scales`` (per-channel abs-max);
* :mod:`~diffquant.plots.common`: ``KIND_TITLES`` and helpers shared by the families.
"""

from diffquant.plots.channels import act_peaks, default_act_site, fig_act_scales, resolve_act_site
from diffquant.plots.common import KIND_TITLES
from diffquant.plots.degradation import chance_levels, chance_metric, fig_degradation, plan_point
from diffquant.plots.hist import (
    HIST_GROUP,
    HIST_KINDS,
    HIST_LOG_RATIO,
    HIST_LOW_QUANTILE,
    HIST_MARGIN,
    INT8_THRESHOLD,
    SIGMAS,
    Pool,
    fig_histograms,
    hist_bar_width,
    hist_xlimits,
)
from diffquant.plots.layers import MASSIVE_FLOOR, fig_lambda, fig_layerwise, lambda_summaries
from diffquant.plots.maps import MAP_PERCENTILE, fig_attention_maps

__all__ = [
    "HIST_GROUP",
    "HIST_KINDS",
    "HIST_LOG_RATIO",
    "HIST_LOW_QUANTILE",
    "HIST_MARGIN",
    "INT8_THRESHOLD",
    "KIND_TITLES",
    "MAP_PERCENTILE",
    "MASSIVE_FLOOR",
    "SIGMAS",
    "Pool",
    "act_peaks",
    "chance_levels",
    "chance_metric",
    "default_act_site",
    "fig_act_scales",
    "fig_attention_maps",
    "fig_degradation",
    "fig_histograms",
    "fig_lambda",
    "fig_layerwise",
    "hist_bar_width",
    "hist_xlimits",
    "lambda_summaries",
    "plan_point",
    "resolve_act_site",
]
