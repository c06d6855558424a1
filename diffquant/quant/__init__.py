"""Quantization: number formats, schemes, fake-quant at taps and weights, plans, real backends.

``QuantPlan`` (the schema, :mod:`~diffquant.quant.plan`) is data; :func:`apply_plan` and :func:`calibrate`
(:mod:`~diffquant.quant.pipeline`) run it."""

from diffquant.quant.fake import FakeQuant
from diffquant.quant.formats import BLOCK_FORMATS, ELEMENT_FORMATS, get_format, quantize_blocks
from diffquant.quant.modules import BackendLinear, fake_quantizers, linear_modules, nan_counts, quantized_taps
from diffquant.quant.pipeline import apply_plan, calibrate
from diffquant.quant.plan import PRESETS, QuantPlan, preset
from diffquant.quant.report import compare_models
from diffquant.quant.schemes import Scheme

__all__ = [
    "BLOCK_FORMATS",
    "ELEMENT_FORMATS",
    "PRESETS",
    "BackendLinear",
    "FakeQuant",
    "QuantPlan",
    "Scheme",
    "apply_plan",
    "calibrate",
    "compare_models",
    "fake_quantizers",
    "get_format",
    "linear_modules",
    "nan_counts",
    "preset",
    "quantize_blocks",
    "quantized_taps",
]
