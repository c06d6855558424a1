"""Perplexity and bits per byte of a decoder LM on a text source, read through the model's own tokenizer.

Two numbers, because the field reports both: per-token perplexity (exp of the mean NLL per scored token,
what GPTQ / SmoothQuant / AWQ tables give for WikiText-2) and bits per byte (NLL in bits over the UTF-8
bytes those tokens stand for), which stays comparable across tokenizers: a byte-level zoo model and a
49k-BPE Llama reading the same text can be ranked by bpb, not by token perplexity. Only text tokens are
scored: BOS / EOS are framing that the stream adds (0 bytes each), and counting them would make both
numbers depend on how a corpus is split into documents. For the byte tokenizer, token perplexity is byte
perplexity.

Window conventions (``windows`` / ``stride``), each stated in the results with seq_len, windows and
tokens scored:

- ``disjoint`` (the GPTQ / SmoothQuant convention for WikiText-2): the stream is cut into
  ``n_tokens // seq_len`` non-overlapping windows of seq_len tokens, the remainder dropped; every target
  of a window is scored from the tokens before it in the same window (the first token is context only),
  as ``transformers`` computes the loss with ``labels=input_ids``. (GPTQ's script divides the summed NLL by
  windows x seq_len rather than by the seq_len - 1 targets per window; the mean here is per scored token.)
- ``chained``: windows of seq_len tokens that overlap by one token (starts 0, L-1, 2(L-1), ...), so every
  token after the first is predicted exactly once and none is dropped (the last window may be shorter).
  The default for byte-level models, whose published zoo numbers use it.
- ``stride`` s (1 <= s <= L-1), the Hugging Face perplexity guide ("Perplexity of fixed-length models"):
  consecutive windows end s tokens apart and only the last s targets of each window are scored (the first
  window scores all of its targets): the same targets, each with at least L-s tokens of context, at about
  L/s times the cost. Unlike the guide's loop, the last window is anchored at the stream's end so it keeps
  the full L tokens; the scored targets are identical and they only gain context.

:func:`window_plan` is that schedule as data so that tests (and readers) can check the coverage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from diffquant.data.corpus import token_stream
from diffquant.data.tokenizer import ByteTokenizer, Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.progress import progress as show_progress

WINDOW_CONVENTIONS = ("disjoint", "chained")
log = logging.getLogger("diffquant")
DEFAULT_SEQ_LEN = 2048  # GPTQ's WikiText-2 window; a model with a shorter context uses its max_seq_len


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise DiffquantError(f"{name} must be an integer {bound}, got {value!r}")


def window_plan(
    n_tokens: int, seq_len: int, stride: int | None = None, windows: str = "chained"
) -> list[tuple[int, int, int]]:
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
    plan: list[tuple[int, int, int]] = []
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


def _model_device(model: Any) -> torch.device:
    """Where the model's weights live (CPU for parameterless test doubles)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log-softmax(logits)[..., target] on the CPU; ``logits`` (B, T, V), ``targets`` (B, T).

    Computed as logit - logsumexp, which avoids materialising the whole log-softmax, in at least float32
    so half-precision models are scored stably (float64 logits stay float64).
    """
    if logits.dtype != torch.float64:
        logits = logits.float()
    picked = logits.gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)).cpu()


def target_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t = 1..T-1 from one forward over ``ids``: (B, T-1) on the CPU."""
    logits = model(ids.to(_model_device(model)))
    return gather_logprobs(logits[:, :-1], ids[:, 1:])


def _batches(plan: Sequence[tuple[int, int, int]], batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Windows grouped by length (so no batch needs padding), in plan order within a length, cut to size.

    Every window but the last (or the only one) has length ``seq_len``, so this is plain batching with
    the odd window run on its own; a padded batch could never change a scored target, but avoiding
    padding entirely also keeps the arithmetic identical to one forward per window.
    """
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for window in plan:
        by_len.setdefault(window[1] - window[0], []).append(window)
    return [group[i : i + batch_size] for group in by_len.values() for i in range(0, len(group), batch_size)]


def default_windows(tokenizer: Tokenizer) -> str:
    """'chained' for byte-level models (their published numbers), 'disjoint' (GPTQ) for the rest."""
    return "chained" if isinstance(tokenizer, ByteTokenizer) else "disjoint"


def _check_settings(
    model: Any, seq_len: int | None, stride: int | None, batch_size: int, windows: str | None
) -> int:
    """Validate the settings before any data is read; the effective seq_len."""
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


def evaluate_stream(
    model: Any,
    stream: torch.Tensor,
    *,
    tokenizer: Tokenizer | None = None,
    seq_len: int | None = None,
    stride: int | None = None,
    windows: str | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`evaluate_bpb` on a token stream already in memory (1-D long), e.g. one reused across a sweep.

    ``tokenizer`` (default: the model's, see :func:`diffquant.data.model_tokenizer`) says how many bytes
    each target stands for; targets of 0 bytes (specials) are not scored.
    """
    seq_len = _check_settings(model, seq_len, stride, batch_size, windows)
    tokenizer = tokenizer or model_tokenizer(model)
    windows = windows or ("chained" if stride is not None else default_windows(tokenizer))
    stream = torch.as_tensor(stream, dtype=torch.long).flatten()
    n = stream.numel()
    if n < 2:
        raise DiffquantError(f"the token stream has {n} token(s); scoring needs at least 2")
    if windows == "disjoint" and n < seq_len:
        raise DiffquantError(
            f"the token stream has {n} tokens, fewer than one window of seq_len {seq_len} (windows 'disjoint' "
            "drops the remainder)"
        )
    plan = window_plan(n, seq_len, stride, windows)
    byte_len = tokenizer.byte_lengths()
    if int(stream.max()) >= byte_len.numel():
        raise DiffquantError(
            f"the token stream holds id {int(stream.max())}, outside tokenizer {tokenizer.describe()}"
        )
    nats = 0.0  # natural-log NLL of the scored targets, accumulated in float64
    n_scored = n_bytes = 0
    with (
        torch.no_grad(),
        show_progress(total=len(plan), desc="ppl", unit="win", bar=progress) as bar,
    ):
        for batch in _batches(plan, batch_size):
            ids = torch.stack([stream[start:end] for start, end, _ in batch])
            logp = target_logprobs(model, ids).double()  # (B, T-1): column j scores target start + j + 1
            positions = torch.arange(1, ids.shape[1])
            first = torch.tensor([score_from - start for start, _, score_from in batch])
            target_bytes = byte_len[ids[:, 1:]]
            keep = (positions[None, :] >= first[:, None]) & (target_bytes > 0)
            nats -= torch.where(keep, logp, torch.zeros((), dtype=logp.dtype)).sum().item()
            n_scored += int(keep.sum())
            n_bytes += int(target_bytes[keep].sum())
            bar.update(len(batch))
    if n_scored == 0:
        raise DiffquantError("the token stream holds no text tokens to score")
    mean = nats / n_scored
    return {
        "bits_per_byte": nats / math.log(2) / n_bytes,
        "perplexity": math.exp(mean) if mean < 700 else math.inf,  # exp overflows near 709
        "nll_bits": nats / math.log(2),
        "n_tokens_scored": n_scored,
        "n_bytes": n_bytes,
        "n_windows": len(plan),
        "tokens": n,
        "seq_len": seq_len,
        "stride": stride,
        "windows": windows,
        "tokenizer": tokenizer.name,
    }


def evaluate_bpb(
    model: Any,
    source: str,
    *,
    max_tokens: int,
    seq_len: int | None = None,
    stride: int | None = None,
    windows: str | None = None,
    batch_size: int = 8,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Token perplexity and bits per byte of ``model`` on the first ``max_tokens`` tokens of ``source``.

    ``source`` is any data source (``wikitext2:test``, ``stdlib:validation``, a file, a folder, a .jsonl
    file), read through ``tokenizer`` (default: the model's own); its stream is
    :func:`diffquant.data.token_stream`, the same one calibration windows are cut from. ``seq_len``
    defaults to min(the model's ``max_seq_len``, 2048); ``windows`` is 'disjoint' or 'chained' (default:
    chained for byte-level models, disjoint otherwise) and ``stride`` an integer 1..seq_len-1 for the
    strided evaluation, as described in the module docstring. ``model`` is anything with
    ``model(ids (B, T) long) -> logits (B, T, V)`` and ``model.config`` (``max_seq_len``, ``vocab_size``);
    it is only called under ``torch.no_grad()`` and its mode is left as is (put it in eval mode first).

    Returns a flat dict: ``bits_per_byte`` (nll_bits / n_bytes), ``perplexity`` (exp of the mean natural
    NLL per scored token), ``nll_bits``, ``n_tokens_scored``, ``n_bytes`` (UTF-8 bytes of the scored
    tokens), ``n_windows``, ``tokens`` (stream length read), ``seq_len``, ``stride``, ``windows`` and
    ``tokenizer``.
    """
    _check_int("max_tokens", max_tokens, 2)
    _check_settings(model, seq_len, stride, batch_size, windows)  # fail before reading any data
    tokenizer = tokenizer or model_tokenizer(model)
    stream = token_stream(source, max_tokens, tokenizer)
    return evaluate_stream(
        model,
        stream,
        tokenizer=tokenizer,
        seq_len=seq_len,
        stride=stride,
        windows=windows,
        batch_size=batch_size,
        progress=progress,
    )
