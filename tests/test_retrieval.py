"""Needle retrieval (DIFF paper Tables 2-3): sample construction, scoring against test doubles with known
answers, and the attention-noise metric checked against an explicit computation from the model's maps."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from diffquant.data.tokenizer import ByteTokenizer
from diffquant.errors import DiffquantError
from diffquant.eval.retrieval import (
    CITIES,
    RetrievalConfig,
    evaluate_retrieval,
    make_samples,
    prompt_ids,
    score_samples,
)

TOK = ByteTokenizer()
NEEDLE = re.compile(r"The magic number of ([A-Za-z]+) is (\d+)\.")


def _context(sample) -> str:
    return sample.prompt[: sample.prompt.index("\nWhat is the magic number of")]


# ------------------------------------------------------------------------------------------ samples
def test_make_samples_deterministic_per_seed():
    cfg = RetrievalConfig(n_needles=3, n_queries=2, samples_per_depth=3, context_bytes=400)
    a, b = make_samples(cfg), make_samples(cfg)
    other = make_samples(
        RetrievalConfig(n_needles=3, n_queries=2, samples_per_depth=3, context_bytes=400, seed=1)
    )
    assert a == b
    assert [s.prompt for s in a] != [s.prompt for s in other]
    assert {s.answer for s in a} != {s.answer for s in other}


@pytest.mark.parametrize(("n", "r"), [(1, 1), (2, 2), (4, 2), (6, 2)])
def test_samples_structure(n, r):
    cfg = RetrievalConfig(
        n_needles=n, n_queries=r, depths=(0, 50, 100), samples_per_depth=4, context_bytes=500
    )
    samples = make_samples(cfg)
    assert len(samples) == 3 * 4 * r
    assert len(CITIES) >= 40 and len(set(CITIES)) == len(CITIES)
    for k, s in enumerate(samples):
        ids = prompt_ids(s)
        assert ids.dtype == torch.long and ids.dim() == 1 and int(ids[0]) == TOK.bos_id
        assert s.query_pos == len(ids) - 1
        start, end = s.answer_span
        assert TOK.decode(ids[start:end].tolist()) == s.answer.strip()
        assert s.answer == f" {s.answer.strip()}" and len(s.answer.strip()) == cfg.digits
        assert s.answer.strip()[0] != "0"
        assert s.prompt.endswith(f"\nWhat is the magic number of {s.city}? The magic number of {s.city} is")
        needles = NEEDLE.findall(_context(s))
        assert len(needles) == n
        numbers = [num for _, num in needles]
        assert len(set(numbers)) == n and len({c for c, _ in needles}) == n
        assert (s.city, s.answer.strip()) in needles
        # candidates: every needle number plus distractors, >= 4 distinct, sorted, label points at the answer
        assert len(s.candidates) == max(n, 4) == len(set(s.candidates))
        assert list(s.candidates) == sorted(s.candidates)
        assert s.candidates[s.label] == s.answer
        assert {f" {num}" for num in numbers} <= set(s.candidates)
        assert abs(len(_context(s).encode()) - cfg.context_bytes) < 120
        # the R queries of one context share it and ask about different cities
        group = samples[k - k % r : k - k % r + r]
        assert len({_context(g) for g in group}) == 1 and len({g.city for g in group}) == r


def test_depth_ordering():
    cfg = RetrievalConfig(n_needles=3, n_queries=2, samples_per_depth=5, context_bytes=800)
    samples = make_samples(cfg)
    per_depth = len(samples) // len(cfg.depths)
    for k in range(per_depth):
        cell = [samples[d * per_depth + k] for d in range(len(cfg.depths))]
        assert [s.depth for s in cell] == [float(d) for d in cfg.depths]
        starts = [s.answer_span[0] for s in cell]
        assert starts == sorted(starts) and len(set(starts)) == len(starts), starts
    # 0 %: the first queried needle is the first sentence; 100 %: the last queried one ends the context
    first_q, last_q = samples[0], samples[-1]
    assert first_q.depth == 0 and _context(first_q).startswith(f"The magic number of {first_q.city} is")
    assert last_q.depth == 100
    assert _context(last_q).endswith(f"The magic number of {last_q.city} is {last_q.answer.strip()}.")


def test_custom_filler_and_validation():
    filler = "Alpha beta gamma. Delta epsilon zeta! Eta theta iota? Kappa lambda mu.\nNu xi omicron pi."
    s = make_samples(RetrievalConfig(samples_per_depth=1, depths=(50,), context_bytes=200, filler=filler))[0]
    assert "gamma" in s.prompt or "epsilon" in s.prompt
    with pytest.raises(DiffquantError, match="magic number"):
        make_samples(RetrievalConfig(filler="The Magic Number is hidden here."))
    bad = [
        {"n_needles": 0},
        {"n_queries": 3, "n_needles": 2},
        {"depths": (120,)},
        {"depths": ()},
        {"samples_per_depth": 0},
        {"digits": 0},
        {"digits": 1, "n_needles": 10},
        {"n_needles": len(CITIES) + 1},
    ]
    for kwargs in bad:
        with pytest.raises(DiffquantError):
            RetrievalConfig(**kwargs)
    assert RetrievalConfig(depths=[0, 100]).depths == (0, 100)


def test_prompt_too_long_is_a_clear_error():
    model = tiny_model("baseline", vocab_size=259)  # max_seq_len 96
    with pytest.raises(DiffquantError, match=r"max_seq_len 96.*context_bytes"):
        evaluate_retrieval(model, RetrievalConfig(samples_per_depth=1, context_bytes=1024))
    with pytest.raises(DiffquantError, match="vocab_size 61 is not the byte vocabulary"):
        evaluate_retrieval(tiny_model("baseline"), RetrievalConfig(samples_per_depth=1, context_bytes=10))


# ------------------------------------------------------------------------------------ test doubles
class Copier:
    """Knows the task: after the question it copies the asked city's number from the context (then ".").

    Causal: position t's logits depend only on tokens 0..t (the question must lie in that prefix). No
    ``new_cache``, so the evaluator's recompute path runs.
    """

    def __init__(self, max_seq_len: int = 2048) -> None:
        self.config = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=259)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        bsz, t = ids.shape
        logits = torch.zeros(bsz, t, 259)
        for b in range(bsz):
            data = bytes(x if x < 256 else 0 for x in ids[b].tolist())
            q = re.search(rb"\nWhat is the magic number of ([A-Za-z]+)\? The magic number of \1 is", data)
            if q is None:
                continue
            needle = re.search(rb"The magic number of " + q.group(1) + rb" is (\d+)\.", data[: q.start()])
            target = b" " + needle.group(1) + b"."
            last = q.end() - 1  # the prompt's last token
            for pos in range(last, t):
                k = pos - last
                if k >= len(target) or data[last + 1 : pos + 1] != target[:k]:
                    break
                logits[b, pos] = -1e9
                logits[b, pos, target[k]] = 0.0
        return logits


class Uniform:
    """Equal logits everywhere: every candidate ties exactly."""

    config = SimpleNamespace(max_seq_len=4096, vocab_size=259)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, 259)


class NoCache:
    """A DecoderLM seen through the bare interface (no cache, no taps)."""

    def __init__(self, model) -> None:
        self.model, self.config = model, model.config

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def test_copier_scores_perfectly():
    cfg = RetrievalConfig(n_needles=4, n_queries=2, samples_per_depth=2, context_bytes=500)
    result = evaluate_retrieval(Copier(), cfg, batch_size=3)
    assert result["acc_greedy"] == 1.0 and result["acc_rank"] == 1.0
    assert result["n"] == 5 * 2 * 2 and result["chance_rank"] == 0.25
    assert result["answer_mass"] is None and result["rest_mass"] is None  # no taps: not measured
    assert set(result["by_depth"]) == {0.0, 25.0, 50.0, 75.0, 100.0}
    assert all(v == {"acc_greedy": 1.0, "acc_rank": 1.0, "n": 4} for v in result["by_depth"].values())


def test_uniform_model_scores_exactly_chance():
    # Every candidate ties; ties split the credit, so acc_rank is exactly the mean of 1/len(candidates)
    # (with "first candidate wins" it would instead be the share of labels equal to 0).
    cfg = RetrievalConfig(n_needles=6, n_queries=2, depths=(50,), samples_per_depth=5, context_bytes=400)
    samples = make_samples(cfg)
    assert len({len(s.candidates) for s in samples}) == 1
    result = evaluate_retrieval(Uniform(), samples)
    assert result["acc_rank"] == pytest.approx(result["chance_rank"], abs=1e-12)
    assert result["chance_rank"] == pytest.approx(1 / 6)
    assert result["acc_greedy"] == 0.0  # argmax of equal logits is byte 0, never a digit
    scores, _ = score_samples(Uniform(), samples[:2])
    assert all(len(set(sc.scores)) == 1 and sc.greedy == "\x00" * 5 for sc in scores)


def test_random_model_is_near_chance():
    # One depth and 60 samples: 60 independent haystacks (samples of one index share their numbers across
    # depths, so more depths would not add independent draws).
    model = tiny_model("baseline", vocab_size=259, max_seq_len=512)
    cfg = RetrievalConfig(depths=(50,), samples_per_depth=60, context_bytes=256, seed=3)
    result = evaluate_retrieval(model, cfg, batch_size=16, attention=False)
    n, p = result["n"], result["chance_rank"]
    sigma = math.sqrt(p * (1 - p) / n)
    assert n == 60 and p == 0.25
    assert result["acc_greedy"] == 0.0
    assert abs(result["acc_rank"] - p) <= 3 * sigma, result["acc_rank"]
    assert result["answer_mass"] is None


def test_candidate_scores_are_their_tokens_log_probabilities():
    """Each candidate's score against a loop in float64: the sum over its tokens of log p(token | prompt and
    the candidate's tokens before it), each from its own full forward of that prefix."""
    from diffquant.eval.retrieval import _answer_ids, encode_prompt

    model = tiny_model("diff_v2", vocab_size=259, max_seq_len=512, seed=2)
    samples = make_samples(
        RetrievalConfig(n_needles=3, n_queries=2, depths=(50,), samples_per_depth=2, context_bytes=150)
    )
    scores, _ = score_samples(model, samples, batch_size=3, attention=False)
    with torch.no_grad():
        for sample, got in zip(samples, scores, strict=True):
            prompt = encode_prompt(sample, TOK)[0]
            for cand, score in zip(sample.candidates, got.scores, strict=True):
                ids = _answer_ids(TOK, TOK.encode(sample.prompt), sample.prompt, cand)
                want = 0.0
                for k, token in enumerate(ids):
                    logits = model(torch.tensor([prompt + ids[:k]]))[0, -1].double()
                    want += float(torch.log_softmax(logits, -1)[token])
                assert score == pytest.approx(want, abs=1e-4), (cand, ids)
            assert len(set(got.scores)) > 1


def test_cache_batching_and_recompute_agree():
    model = tiny_model("diff_v2", vocab_size=259, max_seq_len=512, seed=1)
    samples = make_samples(
        RetrievalConfig(n_needles=2, n_queries=2, depths=(0, 100), samples_per_depth=2, context_bytes=200)
    )
    assert len({len(s.prompt) for s in samples}) < len(samples)  # some prompts share a length: real batches
    ref, _ = score_samples(model, samples, batch_size=1, attention=False)
    for other in (
        score_samples(model, samples, batch_size=8, attention=False)[0],
        score_samples(NoCache(model), samples, batch_size=3)[0],
    ):
        for a, b in zip(ref, other, strict=True):
            assert a.greedy == b.greedy and a.greedy_ok == b.greedy_ok
            assert a.scores == pytest.approx(b.scores, abs=1e-4)
    # batched prefill rows carry their own answer spans into the profiler
    one = evaluate_retrieval(model, samples, batch_size=1)
    many = evaluate_retrieval(model, samples, batch_size=8)
    assert many["answer_mass"] == pytest.approx(one["answer_mass"], abs=1e-6)
    assert many["rest_mass"] == pytest.approx(one["rest_mass"], abs=1e-6)


# -------------------------------------------------------------------------------------- attention
def _row_mass_expected(model, samples, kind: str) -> float:
    """Mean over samples, layers and heads of the applied map's row sum at the query: 1 - lambda for DIFF."""
    if kind == "baseline":
        return 1.0
    lams: list[torch.Tensor] = []
    taps = model.taps("kind:lambda")
    values = []
    handles = [t.register_forward_hook(lambda m, a, out: lams.append(out.detach())) for t in taps.values()]
    try:
        with torch.no_grad():
            for s in samples:
                lams.clear()
                model(prompt_ids(s)[None])
                for lam in lams:  # V1: 0-d per layer; V2: (B, T, H)
                    per_head = lam.expand(model.config.n_heads) if lam.dim() == 0 else lam[0, s.query_pos]
                    values.extend((1.0 - per_head.double()).tolist())
    finally:
        for h in handles:
            h.remove()
    return sum(values) / len(values)


@pytest.mark.parametrize("kind", ["baseline", "diff_v1", "diff_v2"])
def test_span_mass_finite_and_sums_to_row_mass(kind):
    model = tiny_model(kind, vocab_size=259, max_seq_len=512)
    samples = make_samples(
        RetrievalConfig(n_needles=2, depths=(0, 50, 100), samples_per_depth=2, context_bytes=250)
    )
    result = evaluate_retrieval(model, samples, batch_size=4)
    a, r = result["answer_mass"], result["rest_mass"]
    assert math.isfinite(a) and math.isfinite(r)
    assert a + r == pytest.approx(_row_mass_expected(model, samples, kind), abs=1e-5)
    if kind != "baseline":
        assert a + r < 0.99  # the differential map is not renormalised
    assert evaluate_retrieval(model, samples, attention=False)["answer_mass"] is None


@pytest.mark.parametrize("kind", ["baseline", "diff_v2"])
def test_span_mass_matches_explicit_loop(kind):
    model = tiny_model(kind, vocab_size=259, max_seq_len=512, seed=2)
    sample = make_samples(RetrievalConfig(n_needles=3, depths=(50,), samples_per_depth=1, context_bytes=200))[
        0
    ]
    ids = prompt_ids(sample)[None]
    t = ids.shape[1]
    captured: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            captured[name] = out.detach().double()

        return hook

    names = ["probs"] if kind == "baseline" else ["probs1", "probs2", "lambda"]
    handles = [
        getattr(block.attn, name).register_forward_hook(keep(f"{i}.{name}"))
        for i, block in enumerate(model.layers)
        for name in names
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()

    start, end = sample.answer_span
    q = sample.query_pos
    answers, rests = [], []
    for i in range(model.config.n_layers):
        for h in range(model.config.n_heads):
            if kind == "baseline":
                row = captured[f"{i}.probs"][0, h, q]
            else:
                assert captured[f"{i}.probs1"].shape[2] == t  # one chunk: the whole prompt
                lam = captured[f"{i}.lambda"][0, q, h]
                row = captured[f"{i}.probs1"][0, h, q] - lam * captured[f"{i}.probs2"][0, h, q]
            answer = rest = 0.0
            for k in range(q + 1):
                if start <= k < end:
                    answer += float(row[k])
                else:
                    rest += float(row[k])
            answers.append(answer)
            rests.append(rest)
    result = evaluate_retrieval(model, [sample])
    assert result["answer_mass"] == pytest.approx(sum(answers) / len(answers), abs=1e-6)
    assert result["rest_mass"] == pytest.approx(sum(rests) / len(rests), abs=1e-6)
