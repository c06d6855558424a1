"""Quantization: number formats, schemes, fake-quant at taps and weights, plans, real backends."""

from diffquant.quant.fake import FakeQuant
from diffquant.quant.formats import BLOCK_FORMATS, ELEMENT_FORMATS, get_format, quantize_blocks
from diffquant.quant.plan import PRESETS, QuantPlan, apply_plan, calibrate, preset
from diffquant.quant.report import compare_models
from diffquant.quant.schemes import Scheme

__all__ = [
    "BLOCK_FORMATS",
    "ELEMENT_FORMATS",
    "PRESETS",
    "FakeQuant",
    "QuantPlan",
    "Scheme",
    "apply_plan",
    "calibrate",
    "compare_models",
    "get_format",
    "preset",
    "quantize_blocks",
]
