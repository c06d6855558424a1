"""Quantization error per site: the quantized model against the unquantized one on the same batches.

For every site both models are observed at, and for the final logits: SQNR (dB), cosine similarity,
relative L1 (sum |q - r| / sum |r|, the thu-ml / SageAttention metric) and RMSE, over the valid, finite
entries. Sums stream in float64, so any number of batches can be compared without keeping activations
beyond one batch of the reference model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from diffquant.models.taps import select_taps
from diffquant.models.transformer import DecoderLM
from diffquant.progress import progress
from diffquant.quant.caches import weight_caches_dropped


@dataclass
class ErrorStats:
    """Streaming error statistics of one site. ``n`` counts the compared (valid, finite in both models)
    values; ``nonfinite`` the valid positions where either model has NaN / +-inf, which no metric can
    describe: they are reported as such, never folded into "exact"."""

    n: int = 0
    ref2: float = 0.0
    err2: float = 0.0
    dot: float = 0.0
    q2: float = 0.0
    abs_err: float = 0.0
    abs_ref: float = 0.0
    nonfinite: int = 0

    def update(self, ref: torch.Tensor, quant: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add the (valid, finite) values of one batch. The products are formed in float64 one at a time in a
        single buffer of the compared values (a float32 value is exact in float64, so ``buf.copy_(q)``,
        ``buf.mul_(r)`` is the float64 product ``q * r``), and each sum reduces a 1-D float64 tensor as long
        as the compared values: the same sums as forming every float64 temporary at once, with one
        float64 copy of a batch's logits alive instead of eight (the float32 operand of a mixed op is
        converted a chunk at a time: :func:`_chunked`). On a GPU the six sums (and the non-finite count)
        stay on the device and reach the host in one transfer: one wait per site and batch, not seven. There
        the values left out (masked, or not finite in either model) are zeroed rather than selected, which
        adds nothing to any sum: a selection's size, and the check whether one is needed, would each be a
        wait. A CPU, where a wait costs nothing, selects them (a causal map's float64 passes over half)."""
        ref, quant = ref.detach(), quant.detach()
        finite = torch.isfinite(ref) & torch.isfinite(quant)
        bad = count = None
        on_cpu = ref.device.type == "cpu"
        if on_cpu and valid is None and bool(finite.all()):
            r, q = ref.reshape(-1), quant.reshape(-1)  # every value compared: no selection to copy
        else:
            considered = torch.ones_like(finite) if valid is None else valid.expand_as(finite)
            bad = (considered & ~finite).sum()
            ok = considered & finite
            if on_cpu:
                r, q = ref[ok], quant[ok]
            else:
                count = ok.sum()
                r, q = torch.where(ok, ref, 0.0).reshape(-1), torch.where(ok, quant, 0.0).reshape(-1)
        del finite
        buf = torch.empty(r.shape, dtype=torch.float64, device=r.device)
        sums = [
            buf.copy_(r).mul_(buf).sum(),
            buf.copy_(r).abs_().sum(),
            buf.copy_(q).mul_(buf).sum(),
            _chunked(buf.copy_(r), "mul_", q).sum(),
            _chunked(buf.copy_(q), "sub_", r).abs_().sum(),  # |q - r|
            buf.mul_(buf).sum(),  # |e| * |e|: e * e exactly
        ]
        sums += [c.to(torch.float64) for c in (bad, count) if c is not None]  # counts < 2^53: exact
        ref2, abs_ref, q2, dot, abs_err, err2, *counts = torch.stack(sums).tolist()
        self.n += int(counts[1]) if count is not None else r.numel()
        self.ref2 += ref2
        self.abs_ref += abs_ref
        self.q2 += q2
        self.dot += dot
        self.abs_err += abs_err
        self.err2 += err2
        self.nonfinite += int(counts[0]) if counts else 0

    def summary(self) -> dict[str, float | int | bool | None]:
        """JSON-ready metrics: numbers or null, never NaN / inf literals.

        ``exact`` is true only when values were compared, all of them equal, and none was non-finite.
        ``sqnr_db`` is null when it is not a finite number: exact (+inf), a zero reference with a non-zero
        error (-inf), or nothing finite to compare (see ``nonfinite``).
        """
        exact = self.n > 0 and self.err2 == 0 and self.nonfinite == 0
        if self.n == 0:
            return {
                "n": 0,
                "sqnr_db": None,
                "cosine": None,
                "rel_l1": None,
                "rmse": None,
                "nonfinite": self.nonfinite,
                "exact": False,
            }
        sqnr = 10 * math.log10(self.ref2 / self.err2) if self.err2 > 0 and self.ref2 > 0 else None
        denom = math.sqrt(self.ref2 * self.q2)
        return {
            "n": self.n,
            "sqnr_db": _finite(sqnr),
            "cosine": _finite(self.dot / denom) if denom > 0 else None,
            "rel_l1": _finite(self.abs_err / self.abs_ref) if self.abs_ref > 0 else None,
            "rmse": _finite(math.sqrt(self.err2 / self.n)),
            "nonfinite": self.nonfinite,
            "exact": exact,
        }


CHUNK = 1 << 20  # elements of the other operand converted to float64 at a time


def _chunked(buf: torch.Tensor, op: str, other: torch.Tensor) -> torch.Tensor:
    """``buf.op(other)`` in place, a chunk at a time: an in-place op on a float64 ``buf`` converts a float32
    ``other`` into a float64 temporary as large as itself on the CPU; chunked, the temporary is one chunk.
    Elementwise, so the values are those of the whole op. Returns ``buf``."""
    for start in range(0, buf.numel(), CHUNK):
        getattr(buf[start : start + CHUNK], op)(other[start : start + CHUNK])
    return buf


def _finite(value: float | None) -> float | None:
    """``value``, or None when it is not a finite number (sums of huge float64 values can overflow)."""
    return value if value is not None and math.isfinite(value) else None


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

    Two DecoderLMs run in lockstep, stage by stage (the embedding, each decoder layer, the final norm and
    head: :func:`model_stages`): each stage of the reference with its sites captured, then the same stage
    of the quantized model compared against them, so only one layer's captured activations are alive at a
    time, not every site's of the whole model. The numbers are those of running each whole model
    once (the same calls in the same order; each site's sums add up in the same order). The quantized
    weights the quantizers cache live only while their Linear runs
    (:func:`~diffquant.quant.caches.weight_caches_dropped`).
    """
    ref_taps, q_taps = select_taps(reference, sites), select_taps(quantized, sites)
    names = [n for n in ref_taps if n in q_taps]
    stats = {name: ErrorStats() for name in names}
    logits = ErrorStats()
    ref_stages, q_stages = model_stages(reference, names), model_stages(quantized, names)
    if ref_stages is None or q_stages is None or len(ref_stages) != len(q_stages):
        ref_stages = q_stages = None
    for model in (reference, quantized):
        model.set_attention_path("auto", chunk_size=windows.shape[1])
    try:
        with weight_caches_dropped(quantized):
            starts = range(0, windows.shape[0], batch_size)
            for start in progress(starts, "error report", "batch", leave=False, announce=True):
                batch = windows[start : start + batch_size]
                if ref_stages is None:
                    ref_logits, q_logits = compare_batch(reference, quantized, batch, ref_taps, q_taps, stats)
                else:
                    ref_logits, q_logits = _compare_lockstep(
                        ref_stages, q_stages, batch, ref_taps, q_taps, stats
                    )
                logits.update(ref_logits, q_logits)
                del ref_logits, q_logits
    finally:
        for model in (reference, quantized):
            model.set_attention_path("auto")
    report = {name: s.summary() for name, s in stats.items()}
    report["logits"] = logits.summary()
    return report


class Stage(NamedTuple):
    """One stage of a model's forward: ``run`` maps the hidden states (the token ids for the first stage) on,
    ``prefixes`` name where its sites live."""

    run: Callable[[torch.Tensor], torch.Tensor]
    prefixes: tuple[str, ...]


def model_stages(model: nn.Module, sites: Sequence[str]) -> list[Stage] | None:
    """The forward of a :class:`~diffquant.models.transformer.DecoderLM` as its stages: the embedding, every
    decoder layer, the final norm and LM head (what ``DecoderLM.forward`` calls, in its order). None when
    ``model`` is not a plain DecoderLM (another class, or hooks on the model itself) or a site in ``sites``
    lies in no stage: :func:`compare_models` then runs the whole models."""
    if type(model).forward is not DecoderLM.forward or model._forward_hooks or model._forward_pre_hooks:
        return None

    def head(x: torch.Tensor) -> torch.Tensor:
        return model.lm_head(model.norm(x))

    stages = [Stage(model.embed, ("embed.",))]
    for i, block in enumerate(model.layers):
        stages.append(Stage(lambda x, block=block: block(x, None), (f"layers.{i}.",)))
    stages.append(Stage(head, ("norm.", "lm_head.")))
    prefixes = tuple(p for stage in stages for p in stage.prefixes)
    if any(not site.startswith(prefixes) for site in sites):
        return None
    return stages


def _compare_lockstep(
    ref_stages, q_stages, batch, ref_taps, q_taps, stats
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of :func:`compare_models` through both models stage by stage (:func:`compare_batch` per
    stage, on that stage's sites); returns both models' logits."""
    x_ref = x_q = batch
    for ref_stage, q_stage in zip(ref_stages, q_stages, strict=True):
        names = [n for n in stats if n.startswith(ref_stage.prefixes)]
        x_ref, x_q = compare_batch(
            lambda _, fn=ref_stage.run, x=x_ref: fn(x),
            lambda _, fn=q_stage.run, x=x_q: fn(x),
            None,
            {n: ref_taps[n] for n in names},
            {n: q_taps[n] for n in names},
            {n: stats[n] for n in names},
        )
    return x_ref, x_q


def compare_batch(reference, quantized, batch, ref_taps, q_taps, stats) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of :func:`compare_models`: run ``reference`` on ``batch`` with capture hooks on ``ref_taps``,
    then ``quantized`` with hooks on ``q_taps`` comparing call by call into ``stats`` (site -> ErrorStats).
    Returns both outputs (the logits)."""
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
    """The final logits and the ``limit`` worst sites, as a text table.

    Worst first: sites with non-finite values (most first), then the lowest SQNR. Exact sites are left out
    of the list; the logits row always shows. A row says "exact" only for a comparison with values, no
    difference and nothing non-finite; non-finite values are counted on their row ("non-finite: N of M
    values"), with the metrics of the finite part, or dashes when nothing finite was left to compare.
    """
    rows = [(n, s) for n, s in report.items() if n != "logits" and not _is_exact(s)]
    rows.sort(key=lambda r: (-r[1].get("nonfinite", 0), _sort_sqnr(r[1])))
    lines = [f"{'site':<32}{'SQNR dB':>9}{'cosine':>10}{'rel L1':>9}{'RMSE':>11}"]
    for name, s in [("(model output logits)", report["logits"]), *rows[:limit]]:
        lines.append(_format_row(name, s))
    return "\n".join(lines)


def _is_exact(s: dict) -> bool:
    if "exact" in s:
        return bool(s["exact"])
    return s["n"] > 0 and s.get("nonfinite", 0) == 0 and s.get("rmse") == 0  # reports from older versions


def _sort_sqnr(s: dict) -> float:
    if s["sqnr_db"] is not None:
        return s["sqnr_db"]
    return -math.inf if s["n"] > 0 else math.inf  # -inf dB (zero reference) first, nothing compared last


def _sqnr_text(s: dict) -> str:
    if s["sqnr_db"] is not None:
        return f"{s['sqnr_db']:.2f}"
    if s["rmse"] == 0:
        return "inf"  # no error on the finite part (the row also says what was non-finite)
    if s["rmse"] is not None and s.get("rel_l1") is None:
        return "-inf"  # an all-zero reference with an error
    return "-"


def _format_row(name: str, s: dict) -> str:
    if _is_exact(s):
        return f"{name:<32}{'exact':>9}"
    nonfinite = s.get("nonfinite", 0)
    if s["n"] == 0:
        line = f"{name:<32}{'-':>9}{'-':>10}{'-':>9}{'-':>11}"
    else:
        sqnr = _sqnr_text(s)
        cosine = "-" if s["cosine"] is None else f"{s['cosine']:.5f}"
        rel_l1 = "-" if s["rel_l1"] is None else f"{s['rel_l1']:.4f}"
        rmse = "-" if s["rmse"] is None else f"{s['rmse']:.4g}"
        line = f"{name:<32}{sqnr:>9}{cosine:>10}{rel_l1:>9}{rmse:>11}"
    if nonfinite:
        line += f"  non-finite: {nonfinite} of {s['n'] + nonfinite} values"
    elif s["n"] == 0:
        line += "  nothing compared"
    return line
