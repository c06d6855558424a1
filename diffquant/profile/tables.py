"""Tables read from profiles: the DIFF paper's Table 5 view and per-layer outlier curves.

Table 5 (DIFF paper, arXiv 2410.05258) pools every attention-logit tap ("attention logits") and every
layer output ("hidden states") and reports the k-th largest magnitude for k = 1, 2, 3, 10, 100 and the
median magnitude.
"""

from __future__ import annotations

from typing import Any

from diffquant.profile.profiler import Profile
from diffquant.profile.sites import layer_of

TABLE5_COLUMNS = ("top1", "top2", "top3", "top10", "top100", "median")
TABLE5_ACTIVATIONS = {"attention logits": "logits", "hidden states": "resid"}


def table5(profile: Profile) -> dict[str, dict[str, Any]]:
    """{activation: {top1, top2, top3, top10, top100, median, top1_at}} for the activations observed.

    ``top1_at`` is where the largest magnitude sits (site, layer, sample, position, channel or head, token
    id): a massive activation (Sun et al. 2024) is identified by its layer, position and channel.
    """
    rows: dict[str, dict[str, Any]] = {}
    for label, kind in TABLE5_ACTIVATIONS.items():
        pooled = profile.pooled(kind)
        if pooled is not None:
            summary = pooled.summary()
            rows[label] = {col: summary[col] for col in TABLE5_COLUMNS}
            rows[label]["top1_at"] = summary["top"][0]["loc"] if summary["top"] else None
            rows[label]["nonfinite"] = {
                "nan": summary["nan_count"],
                "posinf": summary["posinf_count"],
                "neginf": summary["neginf_count"],
                "first": summary["first_nonfinite"],
            }
    return rows


def describe_location(loc: dict[str, Any] | None) -> str:
    """'layer 20, position 0, channel 507' (the coordinates a location has, in a reader's words)."""
    if not loc:
        return "-"
    words = {"layer": "layer", "pos": "position", "head": "head", "key": "key", "channel": "channel"}
    return ", ".join(f"{word} {loc[key]}" for key, word in words.items() if loc.get(key) is not None)


def layerwise(profile: Profile, kind: str = "resid") -> list[dict[str, Any]]:
    """Per layer: top-1/2/3 and median magnitude over the sites of ``kind`` (massive-activations view) and the
    three kurtoses: of all values (``kurtosis``), per token over channels (``token_kurtosis``, Bondarenko et
    al. 2023) and of the channels' RMS over tokens (``channel_rms_kurtosis``, as QuaRot / SpinQuant report)."""
    by_layer: dict[int, list] = {}
    for name, stats in profile.sites.items():
        layer = layer_of(name)
        if stats.kind == kind and layer is not None:
            by_layer.setdefault(layer, []).append(stats)
    rows = []
    for layer in sorted(by_layer):
        s = type(by_layer[layer][0]).merged(by_layer[layer], site=f"layers.{layer}:{kind}").summary()
        row = {"layer": layer, **{k: s[k] for k in ("top1", "top2", "top3", "median", "kurtosis")}}
        row["token_kurtosis"] = s["token_kurtosis_mean"]
        row["channel_rms_kurtosis"] = s["channel_rms_kurtosis"]
        rows.append(row)
    return rows


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"


def format_table5(tables: dict[str, dict[str, dict[str, float | None]]]) -> str:
    """Side-by-side text table: one row per (model, activation)."""
    name_w = max([5, *(len(n) for n in tables)])
    header = f"{'model':<{name_w}}  {'activation':<16}" + "".join(f"{c:>9}" for c in TABLE5_COLUMNS)
    lines = [header, "-" * len(header)]
    for label in TABLE5_ACTIVATIONS:
        for name, rows in tables.items():
            if label in rows:
                cells = "".join(f"{fmt(rows[label][c]):>9}" for c in TABLE5_COLUMNS)
                lines.append(f"{name:<{name_w}}  {label:<16}{cells}")
    where = [
        f"top1 of {label} in {name}: {describe_location(rows[label].get('top1_at'))}"
        for label in TABLE5_ACTIVATIONS
        for name, rows in tables.items()
        if label in rows and rows[label].get("top1_at")
    ]
    broken = [
        f"NON-FINITE {label} in {name}: {n['nan']:,} NaN, {n['posinf']:,} +Inf, {n['neginf']:,} -Inf "
        f"(left out of the statistics above); first {n['first']['value']} at {describe_location(n['first']['loc'])}"
        for label in TABLE5_ACTIVATIONS
        for name, rows in tables.items()
        if label in rows and (n := rows[label].get("nonfinite")) and n["first"]
    ]
    return "\n".join(lines + where + broken)
