"""Calibration: SmoothQuant smoothing when the plan asks for it, then static scales observed on text.

Run after :func:`diffquant.quant.plan.apply_plan`; it reads the plan the model carries (``model.quant_plan``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from diffquant.progress import progress
from diffquant.quant import smoothquant  # called through the module, so tests can patch it
from diffquant.quant.backends.quanto import quanto_calibration
from diffquant.quant.caches import weight_caches_dropped
from diffquant.quant.modules import fake_quantizers
from diffquant.quant.weights import quantize_weights

if TYPE_CHECKING:
    from diffquant.quant.plan import QuantPlan


@torch.no_grad()
def calibrate(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> int:
    """Run calibration batches: SmoothQuant smoothing (when the plan has ``smooth``), then the weights
    section's codes (GPTQ sequentially over ``windows``; rtn / hqq of a smoothing plan), then static
    FakeQuant scales and quanto activation scales. Returns tokens seen (0: nothing to calibrate).

    Smoothing comes first and on the float model: act-scales of the Linear inputs with every fake-quantizer
    detached (:func:`diffquant.quant.smoothquant.collect_act_scales`), then the norm weights and Linear
    weights are rewritten in place (the weight quantizers quantize the smoothed weights; their caches are
    dropped), and only then are the static scales observed, on the smoothed activations. The model is
    smoothed once: a second ``calibrate`` recalibrates the static scales only.
    """
    plan: QuantPlan | None = getattr(model, "quant_plan", None)
    quantizers = [q for q in fake_quantizers(model).values() if q.scheme.is_static]
    uses_quanto = plan is not None and plan.backend is not None and plan.backend.activations is not None
    smooth = plan.smooth if plan is not None else None
    weights = plan.weights if plan is not None else None
    if not quantizers and not uses_quanto and smooth is None and weights is None:
        return 0
    if smooth is not None and getattr(model, "smooth_factors", None) is None:
        scales = smoothquant.collect_act_scales(model, windows, batch_size=batch_size)
        model.smooth_factors = smoothquant.smooth_model(model, scales, alpha=smooth.alpha)
    if weights is not None:
        stats = quantize_weights(model, windows, batch_size=batch_size)
        if stats is not None:
            model.gptq_stats = stats
    if not quantizers and not uses_quanto:  # smoothing / weights only: nothing static to observe
        return windows.numel() if smooth is not None or weights.needs_data else 0
    for q in quantizers:
        q.start_calibration()
    context = nullcontext()
    if uses_quanto and plan.backend.name == "quanto":
        context = quanto_calibration()
    device = next(model.parameters()).device

    with context, weight_caches_dropped(model):  # one weight's quantized copy held at a time
        starts = range(0, windows.shape[0], batch_size)
        for start in progress(starts, "static scales", "batch", leave=False, announce=True):
            model(windows[start : start + batch_size].to(device))
    for q in quantizers:
        q.finish_calibration()
    return windows.numel()
