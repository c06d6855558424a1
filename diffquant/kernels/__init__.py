"""Attention-core kernels: an fp32 torch reference (every kind) and fused Triton kernels for DIFF V1 / V2.

The reference (:mod:`diffquant.kernels.reference`) is plain torch and imported eagerly; the Triton kernels
(:mod:`diffquant.kernels.triton_diff`) are imported on first use, because importing Triton is slow, needs the
``TRITON_INTERPRET`` choice to be made before it, and is absent on machines without the ``gpu``/``test`` extra.
"""

from __future__ import annotations

import importlib
from typing import Any

from diffquant.kernels.reference import (
    CoreQuant,
    baseline_core,
    clipped_core,
    diff_v1_core,
    diff_v2_core,
    gated_core,
    sink_core,
)

__all__ = [
    "CoreQuant",
    "baseline_core",
    "clipped_core",
    "diff_v1_attention",
    "diff_v1_core",
    "diff_v2_attention",
    "diff_v2_core",
    "gated_core",
    "sink_core",
    "triton_available",
]

_LAZY = {"diff_v1_attention", "diff_v2_attention"}


def triton_available() -> bool:
    """True when Triton can be imported (the kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module("diffquant.kernels.triton_diff")
        return getattr(module, name)
    raise AttributeError(f"module 'diffquant.kernels' has no attribute {name!r}")
