"""Baseline, DIFF V1 and DIFF V2 decoder LMs with named taps.

The package imports nothing heavy itself (PEP 562 lazy attributes, as :mod:`diffquant.io`): the CLI's parser
reads the vocabularies of :mod:`diffquant.models.config` (attention kinds, size presets) without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffquant.models.attention import BaselineAttention, DiffV1Attention, DiffV2Attention, RMSNorm
    from diffquant.models.config import (
        ATTENTION_KINDS,
        PRESETS,
        ModelConfig,
        matched_config,
        matched_configs,
        preset_config,
    )
    from diffquant.models.taps import SITE_KINDS, Tap, model_taps, select_taps
    from diffquant.models.transformer import DecoderLM, KVCache

_LAZY = {
    "BaselineAttention": "diffquant.models.attention",
    "DiffV1Attention": "diffquant.models.attention",
    "DiffV2Attention": "diffquant.models.attention",
    "RMSNorm": "diffquant.models.attention",
    "ATTENTION_KINDS": "diffquant.models.config",
    "PRESETS": "diffquant.models.config",
    "ModelConfig": "diffquant.models.config",
    "matched_config": "diffquant.models.config",
    "matched_configs": "diffquant.models.config",
    "preset_config": "diffquant.models.config",
    "SITE_KINDS": "diffquant.models.taps",
    "Tap": "diffquant.models.taps",
    "model_taps": "diffquant.models.taps",
    "select_taps": "diffquant.models.taps",
    "DecoderLM": "diffquant.models.transformer",
    "KVCache": "diffquant.models.transformer",
}

__all__ = [
    "ATTENTION_KINDS",
    "PRESETS",
    "SITE_KINDS",
    "BaselineAttention",
    "DecoderLM",
    "DiffV1Attention",
    "DiffV2Attention",
    "KVCache",
    "ModelConfig",
    "RMSNorm",
    "Tap",
    "matched_config",
    "matched_configs",
    "model_taps",
    "preset_config",
    "select_taps",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diffquant.models' has no attribute {name!r}")
