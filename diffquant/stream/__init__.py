"""Models larger than memory, run one decoder layer at a time from their safetensors files, with the
whole-model run's numbers: profiles, logits, perplexity / bits per byte, quantization plans with static
calibration, quantized checkpoints and their error report. See :mod:`diffquant.stream.executor` for the
design."""

from diffquant.stream.api import (
    STREAM_MODES,
    choose_stream,
    evaluate_streamed,
    logits_streamed,
    profile_streamed,
    stream_mode,
    stream_skeleton,
)
from diffquant.stream.executor import (
    HiddenStore,
    StreamedModel,
    available_bytes,
    open_streamed,
    resolve_stream_spec,
    weights_bytes,
    would_stream,
)
from diffquant.stream.quantize import quantize_streamed

__all__ = [
    "STREAM_MODES",
    "HiddenStore",
    "StreamedModel",
    "available_bytes",
    "choose_stream",
    "evaluate_streamed",
    "logits_streamed",
    "open_streamed",
    "profile_streamed",
    "quantize_streamed",
    "resolve_stream_spec",
    "stream_mode",
    "stream_skeleton",
    "weights_bytes",
    "would_stream",
]
