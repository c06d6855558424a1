"""Models larger than memory, run one decoder layer at a time from their safetensors files, with the
whole-model run's numbers: profiles, logits, perplexity / bits per byte, quantization plans with static
calibration. See :mod:`diffquant.stream.executor` for the design."""

from diffquant.stream.api import evaluate_streamed, logits_streamed, profile_streamed
from diffquant.stream.executor import (
    HiddenStore,
    StreamedModel,
    available_bytes,
    open_streamed,
    resolve_stream_spec,
    weights_bytes,
    would_stream,
)

__all__ = [
    "HiddenStore",
    "StreamedModel",
    "available_bytes",
    "evaluate_streamed",
    "logits_streamed",
    "open_streamed",
    "profile_streamed",
    "resolve_stream_spec",
    "weights_bytes",
    "would_stream",
]
