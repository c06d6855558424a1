"""Needle retrieval: the DIFF paper's multi-needle test and its attention-noise metric (arXiv 2410.05258).

Protocol (DIFF paper, key information retrieval, Tables 2-3): a context of filler text holds N "needles",
sentences that give a city a magic number ("The magic number of Paris is 4721."); the model is asked for the
number of one of R queried cities, whose needle sits at a given depth of the context (0/25/50/75/100 %).
The paper reports accuracy for N/R = 1/1, 2/2, 4/2, 6/2 at 4K context, and (Table 3) the attention mass that
the answer position puts on the answer span versus the rest of the context: Transformer 0.03-0.09 / 0.49-0.54,
DIFF 0.27-0.40 / 0.01-0.02, the paper's evidence that differential attention cancels "attention noise".

Three scores per prompt, because byte-level models small enough to profile rarely retrieve perfectly and a
single exact-match number would sit at 0 for most of them:

- greedy: the answer bytes decoded greedily match exactly (the paper's accuracy);
- rank: the true number has the highest log-likelihood among the numbers of all needles in the context plus
  random distractors (at least 4 candidates), a graded signal with a known chance level;
- attention: answer / rest mass of the answer position's attention row (Table 3), measured with the
  Profiler's span metric on the map the layer actually applies (softmax for the baseline, the differential
  map A1 - lambda A2 for DIFF, not renormalised).

The prompts are generated, seeded, by :mod:`diffquant.data.needles` (re-exported here), so two models (or a
model before and after quantization) see identical prompts. Samples are text; each model reads them through
its own tokenizer (:func:`encode_prompt` finds the tokens of the needle's digits from character offsets),
and the answers are scored as token sequences encoded as lm-evaluation-harness encodes a continuation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffquant.data.needles import (  # noqa: F401 (BYTES, CITIES, FILLER_SENTENCES: public here too)
    BYTES,
    CITIES,
    FILLER_SENTENCES,
    NeedleSample,
    RetrievalConfig,
    encode_prompt,
    make_samples,
    prompt_ids,
)
from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.models.taps import model_taps
from diffquant.profile.profiler import Profile, Profiler, merge_profiles
from diffquant.progress import progress as show_progress

# The prompts (RetrievalConfig, NeedleSample, make_samples, ...) are generated in diffquant.data.needles and
# re-exported here, their old import path; this module scores them.
__all__ = [
    "CITIES",
    "FILLER_SENTENCES",
    "NeedleSample",
    "RetrievalConfig",
    "SampleScore",
    "encode_prompt",
    "evaluate_retrieval",
    "make_samples",
    "prompt_ids",
    "score_samples",
]


@dataclass(frozen=True)
class SampleScore:
    """Per-sample outcome, kept so callers can inspect failures, not only the averages."""

    greedy: str  # the greedily decoded continuation (as many tokens as the answer has)
    greedy_ok: bool
    scores: tuple[float, ...]  # summed log-probabilities of the candidates' tokens, in candidate order
    rank_credit: float  # 1 when the label alone is the best candidate, 1/k when tied with k-1 others, else 0


def _answer_ids(tokenizer: Tokenizer, prompt_tokens: list[int], prompt: str, answer: str) -> list[int]:
    """The answer's tokens after the prompt, split as lm-eval splits a continuation (``encode(prompt +
    answer)[len(encode(prompt)):]``); encoded on its own when the prompt's tokens would not stay a prefix
    (the cached prompt must be exactly what precedes the answer)."""
    whole = tokenizer.encode(prompt + answer)
    if whole[: len(prompt_tokens)] == prompt_tokens and len(whole) > len(prompt_tokens):
        return whole[len(prompt_tokens) :]
    return tokenizer.encode(answer)


# ------------------------------------------------------------------------------------------- scoring
def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _check_samples(model: Any, samples: Sequence[NeedleSample], tokenizer: Tokenizer) -> None:
    """Fail before any compute: bad labels, or a prompt the model cannot hold."""
    config = getattr(model, "config", None)
    for s in samples:
        if not 0 <= s.label < len(s.candidates) or s.candidates[s.label] != s.answer:
            raise DiffquantError(
                f"needle sample for {s.city!r}: candidates[label] is not the answer {s.answer!r}"
            )
        if any(not c for c in s.candidates) or not s.answer:
            raise DiffquantError(f"needle sample for {s.city!r}: empty answer or candidate")
    max_len = getattr(config, "max_seq_len", None)
    if max_len is None:
        return
    # The last candidate token is never fed, so prompt + (answer - 1) tokens must fit.
    worst = max(samples, key=lambda s: len(s.prompt))
    p = len(encode_prompt(worst, tokenizer)[0])
    a = max(len(tokenizer.encode(c)) for c in worst.candidates) + 1
    if p + a - 1 > max_len:
        raise DiffquantError(
            f"needle prompt of {p} tokens + answer of up to {a} tokens exceeds the model's max_seq_len "
            f"{max_len} (the last answer token is not fed); lower context_bytes"
        )


def _span_kind(model: Any) -> str | None:
    """The map the layers apply: diff_map for DIFF, probs for the baseline; None without taps."""
    if not hasattr(model, "named_modules"):
        return None
    kinds = {tap.kind for tap in model_taps(model).values()}
    return "diff_map" if "diff_map" in kinds else "probs" if "probs" in kinds else None


def _branch_cache(model: Any, cache: Any, rows: torch.Tensor) -> Any | None:
    """A new cache holding batch rows ``rows`` of ``cache`` (each layer's ``select_rows``: a quantized cache
    branches its codes too), or None when the cache is empty or of an unknown layout (then the candidates are
    scored by recomputation).

    DecoderLM's cache rebinds (torch.cat) rather than mutates its tensors, so branches are independent.
    """
    layers = getattr(cache, "layers", None)
    if layers is None or not all(callable(getattr(x, "select_rows", None)) and x.length for x in layers):
        return None
    branch = model.new_cache()
    branch.layers = [x.select_rows(rows) for x in layers]
    return branch


def _greedy(model: Any, ids: torch.Tensor, last: torch.Tensor, cache: Any, steps: int) -> torch.Tensor:
    """Greedy continuation (B, steps): with the KV cache when there is one, else by full recomputation."""
    out = [last.argmax(-1)]
    seq = ids
    for _ in range(steps - 1):
        tok = out[-1][:, None]
        if cache is not None:
            logits = model(tok, cache)
        else:
            seq = torch.cat([seq, tok], dim=1)
            logits = model(seq)
        out.append(logits[:, -1].float().argmax(-1))
    return torch.stack(out, dim=1)


def _candidate_scores(
    model: Any,
    ids: torch.Tensor,
    last_logp: torch.Tensor,
    cache: Any,
    candidates: list[list[list[int]]],
    batch_size: int,
) -> list[list[float]]:
    """Summed log-probabilities of each row's candidate token sequences after its prompt.

    The first token is read from the prompt's last position; the rest come from one more forward over the
    candidate tokens (all but the last), branching the prompt's KV cache when possible and otherwise
    recomputing prompt + candidate. Candidates of unequal length are right-padded: under the causal mask
    nothing after a position changes its logits, so padding cannot change a score.

    On a GPU the first tokens' scores come back in one read, and each chunk's token ids go over in one copy
    and its sums come back in one read: a copy and a read per candidate were a wait each.
    """
    where = [(b, c[0]) for b, cands in enumerate(candidates) for c in cands]  # (row, first token)
    at = torch.tensor(where, dtype=torch.long).reshape(-1, 2).T.to(last_logp.device)
    flat = iter(last_logp[at[0], at[1]].tolist())
    scores = [[next(flat) for _ in cands] for cands in candidates]
    pairs = [(b, j) for b, cands in enumerate(candidates) for j, c in enumerate(cands) if len(c) > 1]
    for k in range(0, len(pairs), batch_size):
        chunk = pairs[k : k + batch_size]
        width = max(len(candidates[b][j]) - 1 for b, j in chunk)
        # inputs (pad: id 0, unread) and targets of the chunk, made on the host and moved in one copy
        tokens = torch.zeros((2, len(chunk), width), dtype=torch.long)
        for i, (b, j) in enumerate(chunk):
            c = candidates[b][j]
            tokens[0, i, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
            tokens[1, i, : len(c) - 1] = torch.tensor(c[1:], dtype=torch.long)
        cont, targets = tokens.to(ids.device)
        rows = torch.tensor([b for b, _ in chunk], dtype=torch.long, device=ids.device)
        branch = _branch_cache(model, cache, rows) if cache is not None else None
        if branch is not None:
            logits = model(cont, branch)
        else:
            logits = model(torch.cat([ids.index_select(0, rows), cont], dim=1))[:, -width:]
        logp = torch.log_softmax(logits.float(), dim=-1)
        sums = []
        for i, (b, j) in enumerate(chunk):
            n = len(candidates[b][j]) - 1
            picked = logp[i, :n].gather(-1, targets[i, :n, None]).squeeze(-1)
            sums.append(picked.double().sum())
        for (b, j), total in zip(chunk, torch.stack(sums).tolist(), strict=True):
            scores[b][j] += total
    return scores


def _rank_credit(scores: Sequence[float], label: int) -> float:
    """1/k when the label is among the k candidates with the best score, else 0.

    Ties split the credit (the expected accuracy of a uniformly random tie-break) instead of going to the
    first candidate: a model that cannot tell the candidates apart then scores exactly chance. NaN scores
    never win.
    """
    finite = [s for s in scores if not math.isnan(s)]
    if math.isnan(scores[label]) or not finite:
        return 0.0
    best = max(finite)
    ties = [i for i, s in enumerate(scores) if s == best]
    return 1.0 / len(ties) if label in ties else 0.0


def score_samples(
    model: Any,
    samples: Sequence[NeedleSample],
    *,
    batch_size: int = 8,
    attention: bool = True,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
) -> tuple[list[SampleScore], Profile | None]:
    """Score every sample; returns per-sample scores and the merged span Profile (None if not measured).

    ``model(ids (B, T)) -> logits (B, T, V)`` is all that is required; a ``new_cache()`` method enables
    cached decoding, and taps (a DecoderLM) enable the attention metric. Prompts are batched only with
    prompts of the same length, so no padding enters a prompt and batching cannot change a result; the
    attention pass is the prompt's own forward, run under a Profiler with the answer span set.
    """
    samples = list(samples)
    if not samples:
        raise DiffquantError("retrieval: no samples to score")
    if batch_size < 1:
        raise DiffquantError(f"batch_size: expected an integer >= 1, got {batch_size}")
    tokenizer = tokenizer or model_tokenizer(model)
    _check_samples(model, samples, tokenizer)
    encoded = [encode_prompt(s, tokenizer) for s in samples]
    device = _device(model)
    has_cache = callable(getattr(model, "new_cache", None))
    span_kind = _span_kind(model) if attention else None

    by_len: dict[int, list[int]] = {}
    for idx, (prompt, _, _) in enumerate(encoded):
        by_len.setdefault(len(prompt), []).append(idx)
    batches = [g[k : k + batch_size] for g in by_len.values() for k in range(0, len(g), batch_size)]

    results: list[SampleScore | None] = [None] * len(samples)
    profiles = []
    with torch.no_grad():
        for batch in show_progress(batches, "retrieval", "batch", bar=progress, leave=False):
            chosen = [samples[i] for i in batch]
            ids = torch.tensor([encoded[i][0] for i in batch], dtype=torch.long, device=device)
            cache = model.new_cache() if has_cache else None
            args = (ids,) if cache is None else (ids, cache)
            if span_kind is not None:
                # topk=1: the per-site statistics are a by-product here; only the span metric is read.
                with Profiler(model, sites=f"kind:{span_kind}", topk=1, attention=True) as prof:
                    prof.spans = [(*encoded[i][1], encoded[i][2]) for i in batch]
                    logits = model(*args)
                profiles.append(prof.result())
            else:
                logits = model(*args)
            last = logits[:, -1].float()
            plain = {i: tokenizer.encode(samples[i].prompt) for i in batch}
            candidates = [
                [_answer_ids(tokenizer, plain[i], s.prompt, c) for c in s.candidates]
                for i, s in zip(batch, chosen, strict=True)
            ]
            # Ranking first: it branches the prompt's cache, which greedy decoding then extends in place.
            scores = _candidate_scores(
                model, ids, torch.log_softmax(last, dim=-1), cache, candidates, batch_size
            )
            answers = [cands[s.label] for s, cands in zip(chosen, candidates, strict=True)]
            steps = max(len(a) for a in answers)
            generated = _greedy(model, ids, last, cache, steps).tolist()
            for i, s, sc, gen, answer in zip(batch, chosen, scores, generated, answers, strict=True):
                gen = gen[: len(answer)]
                results[i] = SampleScore(
                    greedy=tokenizer.decode(gen),
                    greedy_ok=gen == answer,
                    scores=tuple(sc),
                    rank_credit=_rank_credit(sc, s.label),
                )
    profile = merge_profiles(profiles) if profiles else None
    return [r for r in results if r is not None], profile


def _span_means(profile: Profile | None) -> tuple[float | None, float | None]:
    """Answer / rest mass averaged over layers of the per-layer mean over heads (DIFF paper, Table 3)."""
    if profile is None:
        return None, None
    answer, rest = [], []
    for kind, acc in profile.attention.values():
        if kind != "span":
            continue
        summary = acc.summary()
        if summary["answer_mass"]["mean"] is not None:
            answer.append(summary["answer_mass"]["mean"])
            rest.append(summary["rest_mass"]["mean"])
    if not answer:
        return None, None
    return sum(answer) / len(answer), sum(rest) / len(rest)


def evaluate_retrieval(
    model: Any,
    cfg: RetrievalConfig | Sequence[NeedleSample],
    *,
    batch_size: int = 8,
    attention: bool = True,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Needle-retrieval accuracy (greedy exact match and candidate ranking) and attention span mass.

    Returns ``acc_greedy``, ``acc_rank`` (ties split the credit, see :func:`_rank_credit`), ``chance_rank``
    (mean 1/len(candidates): what acc_rank a model that cannot tell the numbers apart gets), ``n``,
    ``answer_mass`` / ``rest_mass`` (None when not measured: attention off, or a model without taps) and
    ``by_depth``: {depth: {acc_greedy, acc_rank, n}}.
    """
    samples = make_samples(cfg) if isinstance(cfg, RetrievalConfig) else list(cfg)
    scores, profile = score_samples(
        model, samples, batch_size=batch_size, attention=attention, progress=progress, tokenizer=tokenizer
    )
    answer_mass, rest_mass = _span_means(profile)

    def accs(pairs: list[tuple[NeedleSample, SampleScore]]) -> dict[str, Any]:
        n = len(pairs)
        return {
            "acc_greedy": sum(sc.greedy_ok for _, sc in pairs) / n,
            "acc_rank": sum(sc.rank_credit for _, sc in pairs) / n,
            "n": n,
        }

    pairs = list(zip(samples, scores, strict=True))
    by_depth: dict[float, list[tuple[NeedleSample, SampleScore]]] = {}
    for s, sc in pairs:
        by_depth.setdefault(s.depth, []).append((s, sc))
    return {
        **accs(pairs),
        "chance_rank": sum(1.0 / len(s.candidates) for s in samples) / len(samples),
        "answer_mass": answer_mass,
        "rest_mass": rest_mass,
        "by_depth": {d: accs(v) for d, v in sorted(by_depth.items())},
    }
