"""The attention-sink rate of Gu et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025) on
their probe, so a model's number can be set beside the paper's.

Sink_1^epsilon = (1 / L) sum_l (1 / H) sum_h 1[alpha_h^l > epsilon], averaged over probe sequences, where
alpha_h^l = (1 / T) sum_i A_h^l[i, 0] is the mean attention head h of layer l pays to the first token of a
T-token sequence. Their probe: epsilon = 0.3 and sequences of T = 64 tokens (100 of them) from the model's
text; here the first 100 disjoint windows of the profile's text, 64 tokens each as the model reads text: for a
tokenizer that adds a BOS (``add_bos``: Gemma, Llama 2 / 3) the BOS and 63 text tokens, otherwise (SmolLM2,
Qwen) 64 text tokens whose first is whatever token the text has there. The difference is large: Gemma-3-270M
puts 79.9 % of its heads on a leading BOS and 0.8 % on a leading text token. The per-head accumulator is
:class:`~diffquant.profile.attention_metrics.SinkRateStats`.

For DIFF models the effective map is A1 - lambda A2 (``diff_map``: the map that weights the values), and the
two component softmaxes are reported beside it; for the baseline it is the softmax map (``probs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.models.sites import layer_of
from diffquant.models.taps import model_taps
from diffquant.profile.attention_metrics import SinkRateStats
from diffquant.progress import progress

SINK_EPSILON = 0.3
SINK_PROBE_SEQUENCES = 100
SINK_PROBE_LEN = 64
# the tap of each layer whose map is reported first (DIFF: the differential map), then the components
_EFFECTIVE = ("diff_map", "probs")
_COMPONENTS = ("probs1", "probs2")


def sink_rates(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    epsilon: float = SINK_EPSILON,
    batch_size: int = 8,
    forward: Callable[[torch.Tensor], Any] | None = None,
    desc: str = "sink probe",
) -> dict[str, SinkRateStats]:
    """Run ``model`` (or ``forward``) over ``windows`` (N, T), one :class:`SinkRateStats` per attention-map
    tap (probs, probs1, probs2, diff_map), keyed by tap name. Hooks on the map taps make the attention
    materialise its maps (the explicit path); they are removed afterwards. The batches are a progress step
    named ``desc`` (a line every interval once it runs past one: ~17 s per real model on a busy CPU)."""
    stats: dict[str, SinkRateStats] = {}
    handles = []
    heads = getattr(getattr(model, "config", None), "n_heads", None)
    for name, tap in model_taps(model).items():
        if tap.kind in ("probs", "diff_map"):
            acc = stats[name] = SinkRateStats(heads, epsilon)
            handles.append(
                tap.register_forward_hook(lambda _m, args, out, acc=acc: acc.update(out.detach(), args[1]))
            )
    if not stats:
        raise DiffquantError("sink rate: the model has no attention-map taps (probs / diff_map)")
    try:
        with torch.no_grad():
            for start in progress(range(0, windows.shape[0], batch_size), desc, "batch", leave=False):
                (forward or model)(windows[start : start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return stats


def sink_rate_summary(stats: Mapping[str, SinkRateStats]) -> dict[str, Any] | None:
    """The model's Sink_1^epsilon from :func:`sink_rates`' accumulators: ``rate`` (mean over layers of the
    share of heads over epsilon, per sequence, averaged over sequences), ``per_layer``, the mean first-token
    importance, and for DIFF the components' rates; None when no whole sequence was seen."""
    by_kind: dict[str, dict[int, dict[str, Any]]] = {}
    for name, acc in stats.items():
        layer, kind = layer_of(name), name.rsplit(".", 1)[-1]
        if layer is not None:
            by_kind.setdefault(kind, {})[layer] = acc.summary()
    effective = next((k for k in _EFFECTIVE if k in by_kind), None)
    if effective is None:
        return None
    layers = by_kind[effective]
    first = next(iter(layers.values()))
    sequences = first["sequences"][0] if first["sequences"] else 0
    if not sequences:
        return None

    def rate(kind: str) -> float | None:
        values = [s["sink_rate"]["mean"] for _, s in sorted(by_kind[kind].items())]
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    importance = [s["first_token_importance"]["mean"] for _, s in sorted(layers.items())]
    return {
        "definition": "Gu et al. 2024 Sink_1^epsilon: share of heads whose mean attention to the first token "
        "exceeds epsilon",
        "epsilon": first["epsilon"],
        "sequences": sequences,
        "seq_len": first["mean_length"]["mean"],
        "map": effective,
        "heads": sum(len(s["sink_rate"]["per_head"]) for s in layers.values()),
        "rate": rate(effective),
        "per_layer": [s["sink_rate"]["mean"] for _, s in sorted(layers.items())],
        "first_token_importance": sum(v for v in importance if v is not None) / len(importance),
        "components": {kind: rate(kind) for kind in _COMPONENTS if kind in by_kind},
    }


def format_sink_rates(summaries: Mapping[str, dict[str, Any] | None]) -> list[str]:
    """A heading and one line per model with a sink rate (none: no lines)::

    attention-sink rate (Gu et al. 2024: heads whose mean attention to the first token > 0.3; 100 x 64 tokens)
    baseline  0.0 % of 24 heads
    diff_v1   0.0 % of 12 heads (A1 - lambda A2; components A1 0.0 %, A2 0.0 %)
    """
    rows = {name: s for name, s in summaries.items() if s and s["rate"] is not None}
    if not rows:
        return []
    shapes = {(s["epsilon"], s["sequences"], s["seq_len"]) for s in rows.values()}
    probe = (
        f"> {next(iter(shapes))[0]:g}; {next(iter(shapes))[1]} x {next(iter(shapes))[2]:.0f} tokens"
        if len(shapes) == 1
        else "> epsilon; probes differ per model"
    )
    lines = [f"attention-sink rate (Gu et al. 2024: heads whose mean attention to the first token {probe})"]
    width = max(len(n) for n in rows)
    for name, s in rows.items():
        line = f"{name:<{width}}  {100 * s['rate']:.1f} % of {s['heads']} heads"
        if s.get("first_token") == "bos":
            line += ", BOS first"
        if s["components"]:
            parts = ", ".join(
                f"A{kind[-1]} {100 * r:.1f} %" for kind, r in s["components"].items() if r is not None
            )
            line += f" (A1 - lambda A2; components {parts})"
        if len(shapes) > 1:
            line += f" (eps {s['epsilon']:g}, {s['sequences']} x {s['seq_len']:.0f} tokens)"
        lines.append(line)
    return lines
