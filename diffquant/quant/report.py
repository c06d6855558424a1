"""Quantization error per site: the quantized model against the unquantized one on the same batches.

For every site both models are observed at, and for the final logits: SQNR (dB), cosine similarity,
relative L1 (sum |q - r| / sum |r|, the thu-ml / SageAttention metric) and RMSE, over the valid, finite
entries. Sums stream in float64, so any number of batches can be compared without keeping activations
beyond one batch of the reference model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from diffquant.models.taps import select_taps


@dataclass
class ErrorStats:
    n: int = 0
    ref2: float = 0.0
    err2: float = 0.0
    dot: float = 0.0
    q2: float = 0.0
    abs_err: float = 0.0
    abs_ref: float = 0.0
    nonfinite: int = 0

    def update(self, ref: torch.Tensor, quant: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        r, q = ref.detach().double(), quant.detach().double()
        ok = torch.isfinite(r) & torch.isfinite(q)
        if valid is not None:
            ok = ok & valid.expand_as(ok)
        self.nonfinite += int((~(torch.isfinite(r) & torch.isfinite(q))).sum())
        r, q = r[ok], q[ok]
        e = q - r
        self.n += r.numel()
        self.ref2 += float((r * r).sum())
        self.err2 += float((e * e).sum())
        self.dot += float((r * q).sum())
        self.q2 += float((q * q).sum())
        self.abs_err += float(e.abs().sum())
        self.abs_ref += float(r.abs().sum())

    def summary(self) -> dict[str, float | int | None]:
        if self.n == 0:
            return {
                "n": 0,
                "sqnr_db": None,
                "cosine": None,
                "rel_l1": None,
                "rmse": None,
                "nonfinite": self.nonfinite,
            }
        sqnr = (
            math.inf if self.err2 == 0 else 10 * math.log10(self.ref2 / self.err2) if self.ref2 > 0 else None
        )
        denom = math.sqrt(self.ref2 * self.q2)
        return {
            "n": self.n,
            "sqnr_db": None if sqnr is None or math.isinf(sqnr) else sqnr,
            "cosine": self.dot / denom if denom > 0 else None,
            "rel_l1": self.abs_err / self.abs_ref if self.abs_ref > 0 else None,
            "rmse": math.sqrt(self.err2 / self.n),
            "nonfinite": self.nonfinite,
        }


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    quantized: nn.Module,
    windows: torch.Tensor,
    sites: str | Sequence[str] = "*",
    batch_size: int = 4,
) -> dict[str, dict]:
    """Per-site and final-logit error of ``quantized`` vs ``reference`` on ``windows`` (N, L).

    The site value compared is what flows on after the tap (the quantized value where a quantizer sits).
    Both models run their attention maps unchunked here so that map taps line up call for call.
    """
    ref_taps, q_taps = select_taps(reference, sites), select_taps(quantized, sites)
    names = [n for n in ref_taps if n in q_taps]
    stats = {name: ErrorStats() for name in names}
    logits = ErrorStats()
    for model in (reference, quantized):
        model.set_attention_path("auto", chunk_size=windows.shape[1])
    try:
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size]
            ref_logits, q_logits = _compare_batch(reference, quantized, batch, ref_taps, q_taps, stats)
            logits.update(ref_logits, q_logits)
    finally:
        for model in (reference, quantized):
            model.set_attention_path("auto")
    report = {name: s.summary() for name, s in stats.items()}
    report["logits"] = logits.summary()
    return report


def _compare_batch(reference, quantized, batch, ref_taps, q_taps, stats) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the reference with capture hooks, then the quantized model with hooks comparing call by call."""
    captured: dict[str, list[torch.Tensor]] = {n: [] for n in stats}
    calls = dict.fromkeys(stats, 0)

    def capture(name):
        return lambda module, args, out: captured[name].append(out.detach().clone())

    def compare(name):
        def hook(module, args, out):
            i = calls[name]
            calls[name] += 1
            if i < len(captured[name]) and captured[name][i].shape == out.shape:
                stats[name].update(captured[name][i], out, args[1] if len(args) > 1 else None)

        return hook

    handles = [ref_taps[n].register_forward_hook(capture(n)) for n in stats]
    try:
        ref_logits = reference(batch)
    finally:
        for h in handles:
            h.remove()
    handles = [q_taps[n].register_forward_hook(compare(n)) for n in stats]
    try:
        q_logits = quantized(batch)
    finally:
        for h in handles:
            h.remove()
    return ref_logits, q_logits


def format_report(report: dict[str, dict], limit: int = 12) -> str:
    """The final logits and the ``limit`` sites with the lowest SQNR, as a text table."""
    rows = [(n, s) for n, s in report.items() if n != "logits" and s["sqnr_db"] is not None]
    rows.sort(key=lambda r: r[1]["sqnr_db"])
    lines = [f"{'site':<32}{'SQNR dB':>9}{'cosine':>10}{'rel L1':>9}{'RMSE':>11}"]
    for name, s in [("(model output logits)", report["logits"]), *rows[:limit]]:
        if s["n"] == 0 or s["sqnr_db"] is None:
            lines.append(f"{name:<32}{'exact':>9}")
            continue
        lines.append(
            f"{name:<32}{s['sqnr_db']:>9.2f}{s['cosine']:>10.5f}{s['rel_l1']:>9.4f}{s['rmse']:>11.4g}"
        )
    return "\n".join(lines)
