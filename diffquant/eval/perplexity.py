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
from collections.abc import Callable
from typing import Any

import torch

from diffquant.data.corpus import token_stream
from diffquant.data.scoring import (  # noqa: F401 (the window schedule and scoring live in data.scoring)
    DEFAULT_SEQ_LEN,
    WINDOW_CONVENTIONS,
    StreamScorer,
    _check_int,
    _is_int,
    check_settings,
    default_windows,
    gather_logprobs,
    head_slice,
    keep_per_window,
    keep_scored,
    log,
    per_window_record,
    window_batches,
    window_plan,
)
from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.models.transformer import DecoderLM
from diffquant.progress import progress as show_progress
from diffquant.quant.state import kv_cache_spec

# Which windows of a perplexity evaluation start with BOS (:func:`evaluate_bpb`'s ``bos``; the task key).
BOS_CONVENTIONS = ("stream", "window", "none")
_check_settings = check_settings  # the old private names
_batches = window_batches


def _model_device(model: Any) -> torch.device:
    """Where the model's weights live (CPU for parameterless test doubles)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _can_slice_head(model: Any) -> bool:
    """True for a native DecoderLM whose forward is ``lm_head(hidden_states)`` with nothing observing the
    model's own forward or rewriting the head's input (a quantizer there may scale per tensor, which a slice
    of positions would change), so slicing the head's positions changes no value."""
    if not isinstance(model, DecoderLM) or type(model).forward is not DecoderLM.forward:
        return False
    return not (model._forward_hooks or model._forward_pre_hooks or model.lm_head.input.active)


def target_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t = 1..T-1 from one forward over ``ids``: (B, T-1) on the CPU.
    Large-vocabulary batches apply the LM head a slice of positions at a time (:func:`~diffquant.data.scoring.head_slice`)."""
    ids = ids.to(_model_device(model))
    batch, length = ids.shape
    step = head_slice(batch, length, int(getattr(getattr(model, "config", None), "vocab_size", 0)))
    if step is None or not _can_slice_head(model):
        return gather_logprobs(model(ids)[:, :-1], ids[:, 1:])
    hidden = model.hidden_states(ids)
    parts = []
    for a in range(0, length - 1, step):
        b = min(a + step, length - 1)
        parts.append(gather_logprobs(model.lm_head(hidden[:, a:b]), ids[:, a + 1 : b + 1], host=False))
    return torch.cat(parts, dim=1).cpu()  # one move for the slices


def decode_logprobs(model: Any, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """:func:`target_logprobs` the way a model generates: the first ``prefill`` tokens in one forward into
    ``model.new_cache()``, then one token per forward through the cache (where a plan's quantized KV cache
    acts). Columns 0 .. prefill-1 come from the prefill; column t >= prefill is predicted by the decode step
    that feeds token t."""
    device = _model_device(model)
    ids = ids.to(device)
    prefill = min(prefill, ids.shape[1] - 1)  # a window shorter than the prefill is all prefill
    cache = model.new_cache()
    out = [gather_logprobs(model(ids[:, :prefill], cache), ids[:, 1 : prefill + 1], host=False)]
    for t in range(prefill, ids.shape[1] - 1):  # the targets are known: no step waits for the last one
        out.append(gather_logprobs(model(ids[:, t : t + 1], cache), ids[:, t + 1 : t + 2], host=False))
    return torch.cat(out, dim=1).cpu()  # one move for the window, not one per decode step


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
    decode: int | None = None,
) -> dict[str, Any]:
    """:func:`evaluate_bpb` on a token stream already in memory (1-D long), e.g. one reused across a sweep.

    ``decode`` (decode-mode perplexity): each window's first ``decode`` tokens are prefilled into the model's
    KV cache and the rest run one token per forward (:func:`decode_logprobs`); only the targets after the
    prefill that a decode step predicts (positions decode + 1 ..) are scored.

    ``tokenizer`` (default: the model's, see :func:`diffquant.data.model_tokenizer`) says how many bytes
    each target stands for; targets of 0 bytes (specials) are not scored. The schedule and the tally are
    :class:`diffquant.data.scoring.StreamScorer` (shared with the layer-streamed run of
    :func:`diffquant.stream.evaluate_streamed`).
    """
    scorer = StreamScorer(
        model,
        stream,
        tokenizer=tokenizer,
        seq_len=seq_len,
        stride=stride,
        windows=windows,
        batch_size=batch_size,
    )
    with (
        torch.no_grad(),
        show_progress(total=len(scorer.plan), desc="ppl", unit="win", bar=progress) as bar,
    ):
        for batch, ids in scorer.batches:
            if decode is None:
                scorer.add(batch, ids, target_logprobs(model, ids))
            else:
                scorer.add(batch, ids, decode_logprobs(model, ids, decode), first_scored=decode + 1)
            bar.update(len(batch))
    out = scorer.result()
    if decode is not None:
        out["decode"] = decode
    keep_scored(scorer)
    return out


def _warn_idle_kv_cache(model: Any, window: int) -> None:
    """One warning line when the model's quantized KV cache (a plan's ``kv_cache``) would quantize nothing
    in decode-mode windows of ``window`` tokens: a window the model decided (its max_seq_len), which the
    run's checks could not see before it started (a task's own seq_len is refused there:
    :func:`diffquant.eval.tasks.check_kv_cache_windows`)."""
    spec = kv_cache_spec(model)
    idle = spec.idle_within(window, "decode-mode perplexity") if spec is not None else None
    if idle is not None:
        logging.getLogger(__name__).warning("%s", idle)


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
    evaluate: Callable[..., dict[str, Any]] | None = None,
    decode: int | None = None,
    bos: str = "stream",
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
    ``tokenizer``. A source of fewer tokens than one window is refused (``max_tokens`` below seq_len
    scores that many tokens in one window). ``evaluate`` replaces :func:`evaluate_stream` (same
    arguments), e.g. with the layer-streamed run of a weightless skeleton
    (:func:`diffquant.stream.evaluate_streamed`). ``decode``: decode-mode perplexity (see
    :func:`evaluate_stream`); it needs a model with ``new_cache()`` and a window longer than decode + 1.

    ``bos`` says which windows start with BOS (for a tokenizer that adds one; :data:`BOS_CONVENTIONS`):
    ``stream`` (default) frames each document as its tokenizer does, so only the window holding a
    document's start begins with BOS (GPTQ's, llm-compressor's and HF's perplexity scripts: the joined text
    tokenized once); ``window`` puts BOS before every disjoint window, BOS + seq_len - 1 text tokens (what a
    model trained with BOS per document expects); ``none`` adds no BOS. The three score the same number of
    targets per window (seq_len - 1; a BOS is never a target). Recorded as ``bos`` in the result.
    """
    _check_int("max_tokens", max_tokens, 2)
    if bos not in BOS_CONVENTIONS:
        raise DiffquantError(f"bos {bos!r}: expected one of {', '.join(BOS_CONVENTIONS)}")
    if bos == "window":
        if stride is not None or windows == "chained":
            raise DiffquantError(
                "bos 'window' puts BOS before each disjoint window; it excludes "
                + ("a stride" if stride is not None else "windows 'chained'")
            )
        windows = "disjoint"
    window = _check_settings(model, seq_len, stride, batch_size, windows)  # fail before reading any data
    if decode is not None:
        _check_int("decode", decode, 1, min(window, max_tokens) - 2)
        if not callable(getattr(model, "new_cache", None)) or evaluate is not None:
            raise DiffquantError(
                "decode: decode-mode perplexity needs a whole model with a KV cache (new_cache)"
            )
        _warn_idle_kv_cache(model, min(window, max_tokens))
    tokenizer = tokenizer or model_tokenizer(model)
    stream = token_stream(source, max_tokens, tokenizer, bos=bos == "stream")
    if bos == "window":
        stream = bos_per_window(stream, min(window, max_tokens), tokenizer)
    if stream.numel() < min(window, max_tokens):
        # as profile and calibration refuse it (token_windows): scoring the whole text in one shorter
        # window would report a number for seq_len `window` that no window of that length produced
        raise DiffquantError(
            f"data source {source!r} has {stream.numel()} tokens, fewer than one window of seq_len {window}"
        )
    # decode mode runs the whole model here (a streamed ``evaluate`` was refused above)
    extra: dict[str, Any] = {} if decode is None else {"decode": decode}
    out = (evaluate or evaluate_stream)(
        model,
        stream,
        tokenizer=tokenizer,
        seq_len=seq_len,
        stride=stride,
        windows=windows,
        batch_size=batch_size,
        progress=progress,
        **extra,
    )
    return {**out, "bos": bos}


def bos_per_window(stream: torch.Tensor, length: int, tokenizer: Tokenizer) -> torch.Tensor:
    """``stream`` (framed without BOS) re-cut into whole windows of ``length``, each BOS + the next
    length - 1 tokens, concatenated: disjoint windows of ``length`` over the result each start with BOS."""
    if tokenizer.bos_id is None:
        raise DiffquantError(f"bos 'window': tokenizer {tokenizer.name} has no BOS token")
    body = length - 1
    n = stream.numel() // body
    rows = stream[: n * body].view(n, body)
    first = torch.full((n, 1), tokenizer.bos_id, dtype=stream.dtype, device=stream.device)
    return torch.cat([first, rows], dim=1).reshape(-1)
