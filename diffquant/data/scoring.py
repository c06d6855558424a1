"""Scoring a token stream window by window: the window schedule (:func:`window_plan`), its batches, the
log-probabilities of the targets, and the tally of scored targets into perplexity and bits per byte.

Moved down from :mod:`diffquant.eval.perplexity` (which re-exports every name and documents the window
conventions) so that a model run other than one forward per batch, e.g. the layer-streamed run of
:mod:`diffquant.stream`, scores exactly the same targets with exactly the same arithmetic.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from diffquant.data.tokenizer import ByteTokenizer, Tokenizer, model_tokenizer, text_bytes
from diffquant.errors import DiffquantError

WINDOW_CONVENTIONS = ("disjoint", "chained")
log = logging.getLogger("diffquant")
DEFAULT_SEQ_LEN = 2048  # GPTQ's WikiText-2 window; a model with a shorter context uses its max_seq_len

Window = tuple[int, int, int]  # (start, end, score_from)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise DiffquantError(f"{name} must be an integer {bound}, got {value!r}")


def window_plan(
    n_tokens: int, seq_len: int, stride: int | None = None, windows: str = "chained"
) -> list[Window]:
    """The windows (start, end, score_from) of a stream of ``n_tokens`` tokens under a convention.

    A window feeds ``stream[start:end]`` to the model and scores the targets ``t`` with
    ``score_from <= t < end``, each predicted from the logits at ``t - 1`` (so ``score_from > start``).
    ``stride=None, windows='chained'``: windows of ``seq_len`` tokens sharing one boundary token (the last
    may be shorter), scoring every token 1..n_tokens-1 once. ``windows='disjoint'``: ``n_tokens //
    seq_len`` non-overlapping windows of exactly ``seq_len`` tokens, the remainder dropped. ``stride=s``:
    windows of ``min(seq_len, n_tokens)`` tokens whose ends advance by ``s`` (the last one ends at the
    stream's end), scoring the targets after the previous window's end. A stream of fewer than two tokens
    has no targets and no windows.
    """
    _check_int("n_tokens", n_tokens, 0)
    _check_int("seq_len", seq_len, 2)
    if windows not in WINDOW_CONVENTIONS:
        raise DiffquantError(f"windows {windows!r}: expected one of {', '.join(WINDOW_CONVENTIONS)}")
    if stride is not None:
        _check_int("stride", stride, 1, seq_len - 1)
        if windows == "disjoint":
            raise DiffquantError(
                "stride and windows 'disjoint' exclude each other (a stride overlaps windows)"
            )
    plan: list[Window] = []
    if n_tokens < 2:
        return plan
    if windows == "disjoint":
        return [(i * seq_len, (i + 1) * seq_len, i * seq_len + 1) for i in range(n_tokens // seq_len)]
    if stride is None:
        start = 0
        while True:
            end = min(start + seq_len, n_tokens)
            plan.append((start, end, start + 1))
            if end == n_tokens:
                return plan
            start += seq_len - 1  # the last input token of this window is the first of the next
    prev_end, end = 1, min(seq_len, n_tokens)  # token 0 is never a target
    while True:
        plan.append((max(0, end - seq_len), end, prev_end))
        if end == n_tokens:
            return plan
        prev_end, end = end, min(end + stride, n_tokens)


def window_batches(plan: Sequence[Window], batch_size: int) -> list[list[Window]]:
    """Windows grouped by length (so no batch needs padding), in plan order within a length, cut to size.

    Every window but the last (or the only one) has length ``seq_len``, so this is plain batching with
    the odd window run on its own; a padded batch could never change a scored target, but avoiding
    padding entirely also keeps the arithmetic identical to one forward per window.
    """
    by_len: dict[int, list[Window]] = {}
    for window in plan:
        by_len.setdefault(window[1] - window[0], []).append(window)
    return [group[i : i + batch_size] for group in by_len.values() for i in range(0, len(group), batch_size)]


# A batch whose float32 logits would exceed LOGITS_WHOLE_BYTES is scored from the final hidden states, the LM
# head applied LOGITS_SLICE_BYTES' worth of positions at a time: Gemma 3's 262,144-token vocabulary makes
# 8 x 1,024 tokens' logits 8.6 GB. Below it (SmolLM2's 8 x 1,024 x 49,152 logits are 1.6 GB) one head call,
# as before, so earlier numbers stay bit for bit. The whole-model scorer
# (:func:`diffquant.eval.perplexity.target_logprobs`) and the layer-streamed one (:mod:`diffquant.stream`)
# slice alike, so their numbers agree.
LOGITS_WHOLE_BYTES = 2 << 30
LOGITS_SLICE_BYTES = 256 << 20


def head_slice(batch: int, length: int, vocab_size: int) -> int | None:
    """Positions per LM-head call for a (batch, length) batch of a ``vocab_size`` model: None when its float32
    logits fit LOGITS_WHOLE_BYTES (one call), else as many as fit LOGITS_SLICE_BYTES (at least one)."""
    row_bytes = batch * 4 * vocab_size
    if row_bytes * length <= LOGITS_WHOLE_BYTES:
        return None
    return max(1, LOGITS_SLICE_BYTES // row_bytes)


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, host: bool = True) -> torch.Tensor:
    """log-softmax(logits)[..., target] on the CPU (``host``; else on the logits' device, for a caller that
    gathers several and moves them at once: each move is a wait for a GPU); ``logits`` (B, T, V),
    ``targets`` (B, T).

    Computed as logit - logsumexp, which avoids materialising the whole log-softmax, in at least float32
    so half-precision models are scored stably (float64 logits stay float64).
    """
    if logits.dtype != torch.float64:
        logits = logits.float()
    picked = logits.gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
    out = picked - torch.logsumexp(logits, dim=-1)
    return out.cpu() if host else out


def default_windows(tokenizer: Tokenizer) -> str:
    """'chained' for byte-level models (their published numbers), 'disjoint' (GPTQ) for the rest."""
    return "chained" if isinstance(tokenizer, ByteTokenizer) else "disjoint"


def check_settings(
    model: Any, seq_len: int | None, stride: int | None, batch_size: int, windows: str | None
) -> int:
    """Validate the settings before any data is read; the effective seq_len. ``model`` needs ``config``
    (``max_seq_len``) and may carry ``trained_seq_len`` (from a training card)."""
    max_seq_len = model.config.max_seq_len
    trained = getattr(model, "trained_seq_len", None)  # from a training card, when the model has one
    if seq_len is None:
        seq_len = min(max_seq_len, DEFAULT_SEQ_LEN, trained or max_seq_len)
    _check_int("seq_len", seq_len, 2)
    if seq_len > max_seq_len:
        raise DiffquantError(f"seq_len {seq_len} exceeds the model's max_seq_len {max_seq_len}")
    if trained is not None and seq_len > trained:
        log.warning(
            "seq_len %d exceeds the context this model was trained at (%d, from its card): the numbers "
            "measure length extrapolation",
            seq_len,
            trained,
        )
    if windows is not None and windows not in WINDOW_CONVENTIONS:
        raise DiffquantError(f"windows {windows!r}: expected one of {', '.join(WINDOW_CONVENTIONS)}")
    if stride is not None:
        _check_int("stride", stride, 1, seq_len - 1)
        if windows == "disjoint":
            raise DiffquantError(
                "stride and windows 'disjoint' exclude each other (a stride overlaps windows)"
            )
    _check_int("batch_size", batch_size, 1)
    return seq_len


def _ratio_stderr(per_window: Sequence[tuple[float, int, int]], denominator: int) -> float:
    """Standard error of sum(nats) / sum(column ``denominator``) over windows (the ratio estimator's
    sqrt(n / (n - 1) * sum((nats_i - R d_i)^2)) / sum(d_i)); NaN below two windows (no spread to measure)."""
    rows = [(w[0], w[denominator]) for w in per_window if w[denominator] > 0]
    total = sum(d for _, d in rows)
    if len(rows) < 2 or total <= 0:
        return math.nan
    ratio = sum(x for x, _ in rows) / total
    squares = sum((x - ratio * d) ** 2 for x, d in rows)
    return math.sqrt(len(rows) / (len(rows) - 1) * squares) / total


class StreamScorer:
    """The scoring of one token stream: validated settings, the window batches to run (``batches``: per
    batch its windows and ids (B, T)), and the tally of each batch's target log-probabilities (``add``)
    into the numbers :func:`diffquant.eval.perplexity.evaluate_stream` returns (``result``)."""

    def __init__(
        self,
        model: Any,
        stream: torch.Tensor,
        *,
        tokenizer: Tokenizer | None = None,
        seq_len: int | None = None,
        stride: int | None = None,
        windows: str | None = None,
        batch_size: int = 8,
    ) -> None:
        self.seq_len = check_settings(model, seq_len, stride, batch_size, windows)
        self.tokenizer = tokenizer or model_tokenizer(model)
        self.stride = stride
        self.windows = windows or ("chained" if stride is not None else default_windows(self.tokenizer))
        stream = torch.as_tensor(stream, dtype=torch.long).flatten()
        n = self.tokens = stream.numel()
        if n < 2:
            raise DiffquantError(f"the token stream has {n} token(s); scoring needs at least 2")
        if self.windows == "disjoint" and n < self.seq_len:
            raise DiffquantError(
                f"the token stream has {n} tokens, fewer than one window of seq_len {self.seq_len} (windows "
                "'disjoint' drops the remainder)"
            )
        self.plan = window_plan(n, self.seq_len, stride, self.windows)
        self.byte_len = self.tokenizer.byte_lengths()
        if int(stream.max()) >= self.byte_len.numel():
            raise DiffquantError(
                f"the token stream holds id {int(stream.max())}, outside tokenizer {self.tokenizer.describe()}"
            )
        # Per position, not per id: a document's first token does not count the tokenizer's dummy prefix.
        self.position_bytes = text_bytes(stream, self.tokenizer)
        self.batches = [
            (batch, torch.stack([stream[start:end] for start, end, _ in batch]))
            for batch in window_batches(self.plan, batch_size)
        ]
        self.nats = 0.0  # natural-log NLL of the scored targets, accumulated in float64
        self.n_scored = self.n_bytes = 0
        self.per_window: list[tuple[float, int, int]] = []  # (nats, targets, bytes) of each window scored

    def add(
        self, batch: Sequence[Window], ids: torch.Tensor, logp: torch.Tensor, first_scored: int = 0
    ) -> None:
        """Tally one batch: ``logp`` (B, T-1), column j the log-probability of target start + j + 1.
        ``first_scored``: no target before this position of a window is scored (decode mode: the prefill)."""
        logp = logp.double()
        positions = torch.arange(1, ids.shape[1])
        first = torch.tensor([max(score_from - start, first_scored) for start, _, score_from in batch])
        target_bytes = torch.stack([self.position_bytes[start + 1 : end] for start, end, _ in batch])
        # text tokens are scored (a lone dummy-prefix piece too, though it stands for no byte of the text)
        keep = (positions[None, :] >= first[:, None]) & (self.byte_len[ids[:, 1:]] > 0)
        kept = torch.where(keep, logp, torch.zeros((), dtype=logp.dtype))
        self.nats -= kept.sum().item()
        self.n_scored += int(keep.sum())
        self.n_bytes += int(target_bytes[keep].sum())
        row_bytes = torch.where(keep, target_bytes, torch.zeros((), dtype=target_bytes.dtype)).sum(1)
        self.per_window += zip((-kept.sum(1)).tolist(), keep.sum(1).tolist(), row_bytes.tolist(), strict=True)

    def result(self) -> dict[str, Any]:
        if self.n_scored == 0:
            raise DiffquantError("the token stream holds no text tokens to score")
        nats, mean = self.nats, self.nats / self.n_scored
        ppl = math.exp(mean) if mean < 700 else math.inf  # exp overflows near 709
        return {
            "bits_per_byte": nats / math.log(2) / self.n_bytes,
            "perplexity": ppl,
            "nll_bits": nats / math.log(2),
            "n_tokens_scored": self.n_scored,
            "n_bytes": self.n_bytes,
            "n_windows": len(self.plan),
            "tokens": self.tokens,
            "seq_len": self.seq_len,
            "stride": self.stride,
            "windows": self.windows,
            "tokenizer": self.tokenizer.name,
            **self.spread(ppl),
        }

    def spread(self, ppl: float) -> dict[str, float]:
        """The spread over windows: standard errors of bits per byte and perplexity (delta method:
        ppl x the standard error of the mean NLL per token), each a ratio mean over the windows scored;
        left out below two windows or where not finite (nothing is measured then)."""
        out = {
            "bits_per_byte_stderr": _ratio_stderr(self.per_window, 2) / math.log(2),
            "perplexity_stderr": ppl * _ratio_stderr(self.per_window, 1),
        }
        return {k: v for k, v in out.items() if math.isfinite(v)}


# Where a scored stream (:func:`keep_scored`) leaves each evaluation's per-window tally while :func:`keep_per_window` is open
# (a sweep keeps them beside its cell records, for paired standard errors); None: nowhere.
_PER_WINDOW: ContextVar[list[dict[str, Any] | None] | None] = ContextVar("per_window", default=None)


@contextmanager
def keep_per_window() -> Iterator[list[dict[str, Any] | None]]:
    """A list that collects, in order, the per-window tally (:func:`per_window_record`) of every scored
    stream inside the ``with`` block (whole-model :func:`diffquant.eval.perplexity.evaluate_stream` and the
    layer-streamed :func:`diffquant.stream.api.evaluate_streamed` alike: :func:`keep_scored`)."""
    kept: list[dict[str, Any] | None] = []
    token = _PER_WINDOW.set(kept)
    try:
        yield kept
    finally:
        _PER_WINDOW.reset(token)


def per_window_record(scorer: StreamScorer) -> dict[str, Any] | None:
    """Each scored window's tally, in window order: ``nats`` (natural-log NLL of its scored targets),
    ``targets`` and ``bytes`` (what it scored), with the ``tokenizer``; None when a window's NLL is not finite
    (nothing to pair). Windows of two evaluations match by index when their tokenizer, targets and bytes do."""
    nats = [float(w[0]) for w in scorer.per_window]
    if not all(math.isfinite(x) for x in nats):
        return None
    return {
        "tokenizer": scorer.tokenizer.name,
        "nats": nats,
        "targets": [int(w[1]) for w in scorer.per_window],
        "bytes": [int(w[2]) for w in scorer.per_window],
    }


def keep_scored(scorer: StreamScorer) -> None:
    """Hand ``scorer``'s per-window tally to the :func:`keep_per_window` block around this call, if any."""
    kept = _PER_WINDOW.get()
    if kept is not None:
        kept.append(per_window_record(scorer))
