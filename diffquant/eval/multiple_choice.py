"""Zero-shot multiple choice by continuation log-likelihood, as lm-evaluation-harness scores HellaSwag.

Following lm-eval (EleutherAI/lm-evaluation-harness, ``tasks/hellaswag`` and the ``multiple_choice``
output type) keeps these accuracies comparable with published ones:

- the query is ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())`` when those raw
  HellaSwag fields are there (``ctx`` otherwise, and no label prefix without ``activity_label``); each
  choice is ``preprocess(ending)``;
- each choice is scored as the continuation ``" " + choice`` (lm-eval's ``target_delimiter``) of the
  query, through the model's own tokenizer and encoded as lm-eval's ``_encode_pair`` does: trailing spaces
  of the context move to the continuation, ``whole = encode(context + continuation)``, ``ctx =
  encode(context)`` and the continuation's tokens are ``whole[len(ctx):]`` (so a BPE merge across the
  boundary is tokenized as the model would see it); BOS goes in front only where the model expects it
  (byte models: yes; lm-eval's HFLM adds none unless the tokenizer does); the score is the sum of log p
  over the continuation's tokens;
- too long inputs lose context tokens on the left, never continuation tokens; like lm-eval the model sees
  ``(context + continuation)[-(max_seq_len + 1):][:-1]``, since the last token is only a target;
- ``acc`` takes the argmax of the log-likelihoods, ``acc_norm`` of the log-likelihoods divided by the
  character length of the choice string (``len(choice)``, without the delimiter: lm-eval's
  ``completion_len``); ties go to the first maximum (``np.argmax``);
- standard errors are lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n), which for 0/1
  scores is sqrt(p (1 - p) / (n - 1)).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import _check_int, _model_device, gather_logprobs
from diffquant.io.artifacts import jsonl_records
from diffquant.progress import progress as show_progress
from diffquant.textfiles import MAX_TEXT_BYTES, read_text_bounded

TARGET_DELIMITER = " "


@dataclass
class MCItem:
    """One question: the context, its candidate endings (preprocessed) and the index of the right one."""

    ctx: str
    endings: list[str]
    label: int


def preprocess(text: str) -> str:
    """lm-eval's HellaSwag ``preprocess``, verbatim in effect.

    WikiHow-derived items carry markup: `` [title]`` becomes ``". "``, other ``[header]``-style bracket
    tags are removed, then one pass replaces double spaces by single ones (one pass, as lm-eval does, so
    scores match its inputs byte for byte).
    """
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _item_from_record(record: Any, where: str) -> MCItem:
    if not isinstance(record, dict):
        raise DiffquantError(f"{where}: expected a JSON object, got {type(record).__name__}")

    def need(key: str, kind: type, what: str) -> Any:
        if key not in record:
            raise DiffquantError(f"{where}: missing key '{key}'")
        if not isinstance(record[key], kind):
            raise DiffquantError(f"{where}: '{key}' must be {what}, got {type(record[key]).__name__}")
        return record[key]

    if "ctx_a" in record:  # raw HellaSwag: lm-eval rebuilds the context from its two halves
        ctx = need("ctx_a", str, "a string") + " " + need("ctx_b", str, "a string").capitalize()
    elif "ctx" in record:
        ctx = need("ctx", str, "a string")
    else:
        raise DiffquantError(f"{where}: missing key 'ctx' (or 'ctx_a' and 'ctx_b')")
    label_prefix = record.get("activity_label")
    if label_prefix is not None:
        if not isinstance(label_prefix, str):
            raise DiffquantError(f"{where}: 'activity_label' must be a string")
        ctx = label_prefix + ": " + ctx
    endings = need("endings", list, "a list of strings")
    if len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise DiffquantError(f"{where}: 'endings' must be a list of at least 2 strings")
    label = need("label", (int, str), "an integer")
    if isinstance(label, bool) or (isinstance(label, str) and not label.strip().isdigit()):
        raise DiffquantError(f"{where}: 'label' must be an integer, got {label!r}")
    label = int(label)  # the HF copy of HellaSwag stores labels as strings ("0".."3")
    if not 0 <= label < len(endings):
        raise DiffquantError(f"{where}: label {label} out of range for {len(endings)} endings")
    choices = [preprocess(e) for e in endings]
    if not all(choices):
        raise DiffquantError(f"{where}: an ending is empty after preprocessing")
    return MCItem(preprocess(ctx), choices, label)


def load_mc_jsonl(path: str | Path) -> list[MCItem]:
    """Items of a HellaSwag-format JSONL file: one object per line with ctx (or ctx_a / ctx_b), endings and
    label; blank lines are skipped. Context and endings go through :func:`preprocess`. Any bad line is a
    one-line DiffquantError naming ``file:line`` and the problem."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DiffquantError(f"multiple-choice file {str(path)!r}: no such file")
    text = read_text_bounded(path, MAX_TEXT_BYTES, "multiple-choice file (JSONL)")  # no FIFO, no /dev/zero
    items = []
    for lineno, record in jsonl_records(text, str(path)):
        items.append(_item_from_record(record, f"{path}:{lineno}"))
    if not items:
        raise DiffquantError(f"multiple-choice file {str(path)!r}: no items")
    return items


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness's ``_encode_pair`` splits them."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    prefix = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    whole = prefix + tokenizer.encode(context + continuation)
    ctx = prefix + tokenizer.encode(context)
    return ctx, whole[len(ctx) :]


def _request(
    tokenizer: Tokenizer, item: MCItem, ending: str, max_seq_len: int, where: str
) -> tuple[list[int], list[int], int]:
    """(model input, its targets, number of continuation tokens) for one choice, truncated as lm-eval does.

    The targets are the input shifted by one (its last one is the final continuation token, which is only
    ever a target); the continuation's targets are the last ``n_cont`` of them.
    """
    context, continuation = encode_pair(tokenizer, item.ctx, TARGET_DELIMITER + ending)
    if not continuation:
        raise DiffquantError(f"{where}: the continuation encodes to no tokens")
    if len(continuation) > max_seq_len:
        raise DiffquantError(
            f"{where}: the continuation has {len(continuation)} tokens; with at least one context token it "
            f"cannot fit max_seq_len {max_seq_len}"
        )
    window = (context + continuation)[-(max_seq_len + 1) :]
    return window[:-1], window[1:], len(continuation)


def mc_logliks(
    model: Any,
    items: list[MCItem],
    *,
    batch_size: int = 8,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
) -> list[list[float]]:
    """log p(" " + ending | ctx) summed over the continuation tokens, per item and ending.

    Requests are sorted longest first (lm-eval's order, so batches are tight) and right-padded to the
    longest in their batch; a causal LM's logits at a position do not depend on later tokens, so padding
    never changes a scored position. ``model`` is anything with ``model(ids) -> logits`` and
    ``model.config.max_seq_len``; it is only called under ``torch.no_grad()``.
    """
    _check_int("batch_size", batch_size, 1)
    tokenizer = tokenizer or model_tokenizer(model)
    max_seq_len = model.config.max_seq_len
    requests = []  # (item index, ending index, input ids, target ids, continuation length)
    for i, item in enumerate(items):
        for j, ending in enumerate(item.endings):
            requests.append((i, j, *_request(tokenizer, item, ending, max_seq_len, f"item {i} ending {j}")))
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r][2]))  # stable: ties keep order
    result = [[0.0] * len(item.endings) for item in items]
    device = _model_device(model)
    with torch.no_grad(), show_progress(total=len(requests), desc="mc", unit="req", bar=progress) as bar:
        for b in range(0, len(order), batch_size):
            batch = [requests[r] for r in order[b : b + batch_size]]
            width = max(len(inp) for _, _, inp, _, _ in batch)
            inputs = torch.zeros((len(batch), width), dtype=torch.long)  # pad id 0: any id the model has
            targets = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, _, inp, tgt, _) in enumerate(batch):
                inputs[row, : len(inp)] = torch.tensor(inp)
                targets[row, : len(tgt)] = torch.tensor(tgt)
            logp = gather_logprobs(model(inputs.to(device)), targets).double()
            for row, (i, j, inp, _, n_cont) in enumerate(batch):
                result[i][j] = float(logp[row, len(inp) - n_cont : len(inp)].sum())
            bar.update(len(batch))
    return result


def _stderr(scores: list[float]) -> float:
    """lm-eval's mean_stderr: sample standard deviation (n - 1) over sqrt(n); NaN below two samples."""
    n = len(scores)
    if n < 2:
        return float("nan")
    p = sum(scores) / n
    return math.sqrt(sum((s - p) ** 2 for s in scores) / (n - 1) / n)


def evaluate_mc(
    model: Any,
    items: list[MCItem],
    *,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """acc / acc_norm (and their standard errors) of ``model`` on the first ``limit`` items (all if None).

    The prediction is the first ending of highest summed log-likelihood (``acc``) or of highest
    log-likelihood per character of the ending (``acc_norm``), exactly as lm-eval's multiple-choice
    scoring; see the module docstring for the conventions.
    """
    if limit is not None:
        _check_int("limit", limit, 1)
        items = items[:limit]
    if not items:
        raise DiffquantError("multiple choice: no items to evaluate")
    for i, item in enumerate(items):
        if not 0 <= item.label < len(item.endings):
            raise DiffquantError(f"item {i}: label {item.label} out of range for {len(item.endings)} endings")
        if not all(item.endings):
            raise DiffquantError(f"item {i}: an ending is empty (acc_norm divides by its length)")
    logliks = mc_logliks(model, items, batch_size=batch_size, progress=progress, tokenizer=tokenizer)
    acc, acc_norm = [], []
    for item, lls in zip(items, logliks, strict=True):
        lls_arr = np.asarray(lls, dtype=np.float64)
        lengths = np.asarray([float(len(e)) for e in item.endings])
        acc.append(1.0 if int(np.argmax(lls_arr)) == item.label else 0.0)
        acc_norm.append(1.0 if int(np.argmax(lls_arr / lengths)) == item.label else 0.0)
    n = len(items)
    return {
        "acc": sum(acc) / n,
        "acc_norm": sum(acc_norm) / n,
        "n": n,
        "acc_stderr": _stderr(acc),
        "acc_norm_stderr": _stderr(acc_norm),
    }
