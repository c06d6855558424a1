"""Bits per byte and byte perplexity of a decoder LM on a text source, over non-overlapping or strided windows.

Why bits per byte: the models here read raw UTF-8 bytes, and bpb is the tokenizer-free unit that the
byte-level literature reports, so numbers compare across models and with published byte-level results.
Only targets that are bytes (ids < 256) are scored: BOS / EOS are framing that the stream adds, not text,
and counting them would make bpb depend on how a corpus is split into documents.

Windows follow the Hugging Face perplexity guide ("Perplexity of fixed-length models",
https://huggingface.co/docs/transformers/perplexity):

- without a stride the stream is cut into windows of L tokens that overlap by one token (starts 0, L-1,
  2(L-1), ...), so every token after the first is predicted exactly once, from 0..L-2 tokens of context;
- with a stride s (1 <= s <= L-1) consecutive windows end s tokens apart and only the last s targets of
  each window are scored (the first window scores all of its targets): the same targets, each with at
  least L-s tokens of context, at about L/s times the cost. Unlike the guide's loop, the last window is
  anchored at the stream's end so it keeps the full L tokens (the guide lets it shrink); the scored
  targets are identical and they only gain context.

:func:`window_plan` is that schedule as data so that tests (and readers) can check the coverage.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from diffquant.data.corpus import token_stream
from diffquant.data.tokenizer import ByteTokenizer
from diffquant.errors import DiffquantError

N_BYTE_IDS = 256  # ids 0..255 are bytes in ByteTokenizer; everything above is a special


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise DiffquantError(f"{name} must be an integer {bound}, got {value!r}")


def window_plan(n_tokens: int, seq_len: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows (start, end, score_from) that score every token 1..n_tokens-1 of a stream exactly once.

    A window feeds ``stream[start:end]`` to the model and scores the targets ``t`` with
    ``score_from <= t < end``, each predicted from the logits at ``t - 1`` (so ``score_from > start``).
    ``stride=None``: non-overlapping windows of ``seq_len`` tokens sharing one boundary token (the last
    may be shorter). ``stride=s``: windows of ``min(seq_len, n_tokens)`` tokens whose ends advance by ``s``
    (the last one ends at the stream's end), scoring the targets after the previous window's end.
    A stream of fewer than two tokens has no targets and no windows.
    """
    _check_int("n_tokens", n_tokens, 0)
    _check_int("seq_len", seq_len, 2)
    if stride is not None:
        _check_int("stride", stride, 1, seq_len - 1)
    plan: list[tuple[int, int, int]] = []
    if n_tokens < 2:
        return plan
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


def _check_byte_vocab(model: Any) -> None:
    """A model whose vocabulary cannot hold the byte tokenizer's ids would fail deep in an embedding."""
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and vocab < ByteTokenizer.vocab_size:
        raise DiffquantError(
            f"model vocab_size {vocab} cannot hold the byte tokenizer's {ByteTokenizer.vocab_size} ids"
        )


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


def _check_settings(model: Any, seq_len: int | None, stride: int | None, batch_size: int) -> int:
    """Validate the settings before any data is read; the effective seq_len."""
    max_seq_len = model.config.max_seq_len
    seq_len = max_seq_len if seq_len is None else seq_len
    _check_int("seq_len", seq_len, 2)
    if seq_len > max_seq_len:
        raise DiffquantError(f"seq_len {seq_len} exceeds the model's max_seq_len {max_seq_len}")
    if stride is not None:
        _check_int("stride", stride, 1, seq_len - 1)
    _check_int("batch_size", batch_size, 1)
    _check_byte_vocab(model)
    return seq_len


def evaluate_stream(
    model: Any,
    stream: torch.Tensor,
    *,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`evaluate_bpb` on a token stream already in memory (1-D long), e.g. one reused across a sweep."""
    seq_len = _check_settings(model, seq_len, stride, batch_size)
    stream = torch.as_tensor(stream, dtype=torch.long).flatten()
    n = stream.numel()
    if n < 2:
        raise DiffquantError(f"the token stream has {n} token(s); scoring needs at least 2")
    plan = window_plan(n, seq_len, stride)
    nats = 0.0  # natural-log NLL of the scored byte targets, accumulated in float64
    n_bytes = 0
    with (
        torch.no_grad(),
        tqdm(total=len(plan), desc="bpb", unit="win", file=sys.stderr, disable=not progress) as bar,
    ):
        for batch in _batches(plan, batch_size):
            ids = torch.stack([stream[start:end] for start, end, _ in batch])
            logp = target_logprobs(model, ids).double()  # (B, T-1): column j scores target start + j + 1
            positions = torch.arange(1, ids.shape[1])
            first = torch.tensor([score_from - start for start, _, score_from in batch])
            keep = (positions[None, :] >= first[:, None]) & (ids[:, 1:] < N_BYTE_IDS)
            nats -= torch.where(keep, logp, torch.zeros((), dtype=logp.dtype)).sum().item()
            n_bytes += int(keep.sum())
            bar.update(len(batch))
    if n_bytes == 0:
        raise DiffquantError("the token stream holds no byte tokens to score")
    return {
        "bits_per_byte": nats / math.log(2) / n_bytes,
        "perplexity": math.exp(nats / n_bytes) if nats / n_bytes < 700 else math.inf,  # exp overflows ~709
        "nll_bits": nats / math.log(2),
        "n_bytes": n_bytes,
        "n_windows": len(plan),
        "tokens": n,
        "seq_len": seq_len,
        "stride": stride,
    }


def evaluate_bpb(
    model: Any,
    source: str,
    *,
    max_tokens: int,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """Bits per byte and byte perplexity of ``model`` on the first ``max_tokens`` tokens of ``source``.

    ``source`` is any data source (``stdlib:validation``, a file, a folder, a .jsonl file); its stream is
    :func:`diffquant.data.token_stream` ([BOS] + bytes + [EOS] per document), the same one calibration
    windows are cut from. ``seq_len`` defaults to the model's ``max_seq_len``; ``stride`` None means
    non-overlapping windows, an integer 1..seq_len-1 the strided evaluation described in the module
    docstring. ``model`` is anything with ``model(ids (B, T) long) -> logits (B, T, V)`` and
    ``model.config.max_seq_len``; it is only called under ``torch.no_grad()`` and its mode is left as is
    (put it in eval mode first).

    Returns a flat dict: ``bits_per_byte`` (nll_bits / n_bytes), ``perplexity`` (exp of the mean natural
    NLL per scored byte), ``nll_bits``, ``n_bytes`` (scored byte targets), ``n_windows``, ``tokens``
    (stream length actually read), ``seq_len`` and ``stride`` (None for non-overlapping).
    """
    _check_int("max_tokens", max_tokens, 2)
    _check_settings(model, seq_len, stride, batch_size)  # fail before reading any data
    stream = token_stream(source, max_tokens)
    return evaluate_stream(
        model, stream, seq_len=seq_len, stride=stride, batch_size=batch_size, progress=progress
    )
