"""Baseline, DIFF V1 and DIFF V2 decoder LMs with named taps."""

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
