"""Bits per byte over non-overlapping and strided windows, checked against plain hand computations."""

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from diffquant import DiffquantError
from diffquant.eval.perplexity import evaluate_bpb, evaluate_stream, window_plan

BOS, EOS = 256, 257
TEXTS = {
    "a.txt": "Differential attention cancels common-mode noise. " * 5 + "é ü ✓\n",
    "b.md": "def f(x):\n    return x * 2  # bytes, not tokens\n" * 2,
}


def _corpus(tmp_path: Path) -> tuple[str, list[int]]:
    root = tmp_path / "corpus"
    root.mkdir()
    stream: list[int] = []
    for name, text in sorted(TEXTS.items()):
        (root / name).write_text(text, encoding="utf-8")
        stream += [BOS, *text.encode("utf-8"), EOS]
    return str(root), stream


def _window_of(t: int, n: int, L: int, stride: int | None) -> tuple[int, int]:
    """The (start, end) of the window that scores target t, straight from the definitions."""
    if stride is None:  # windows start at k(L-1); window k scores k(L-1)+1 .. k(L-1)+L-1
        start = (t - 1) // (L - 1) * (L - 1)
        return start, min(start + L, n)
    end = min(L, n)  # window k ends at min(L + k*stride, n) and scores the targets before that end
    while t >= end:
        end = min(end + stride, n)
    return max(0, end - L), end


def _hand_nll(model, stream: list[int], L: int, stride: int | None) -> tuple[float, int]:
    """Natural-log NLL of every byte target t >= 1, one forward per window (cached), and the count."""
    n = len(stream)
    cache: dict[tuple[int, int], torch.Tensor] = {}
    nats, n_bytes = 0.0, 0
    for t in range(1, n):
        if stream[t] >= 256:
            continue
        start, end = _window_of(t, n, L, stride)
        assert start < t < end and end - start <= L
        if (start, end) not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([stream[start:end]]))[0]
            cache[(start, end)] = torch.log_softmax(logits.double(), dim=-1)
        nats -= cache[(start, end)][t - 1 - start, stream[t]].item()
        n_bytes += 1
    return nats, n_bytes


@pytest.mark.parametrize(
    ("model_kind", "stride"),
    [(k, s) for k in ("baseline", "diff_v1", "diff_v2") for s in (None, 16, 63)] + [("diff_v2", 1)],
)
def test_bpb_equals_hand_computation(tmp_path, model_kind, stride):
    source, stream = _corpus(tmp_path)
    max_tokens = 300
    assert len(stream) > max_tokens and EOS in stream[:max_tokens]  # cut, after a document boundary
    stream = stream[:max_tokens]
    model = tiny_model(model_kind, vocab_size=259, max_seq_len=64)
    nats, n_bytes = _hand_nll(model, stream, 64, stride)
    for batch_size in (1, 3, 8):
        r = evaluate_bpb(model, source, max_tokens=max_tokens, stride=stride, batch_size=batch_size)
        assert r["n_bytes"] == n_bytes == sum(1 for x in stream[1:] if x < 256)
        assert r["tokens"] == max_tokens and r["seq_len"] == 64 and r["stride"] == stride
        assert r["n_windows"] == len(window_plan(max_tokens, 64, stride))
        assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)
        assert r["nll_bits"] == pytest.approx(nats / math.log(2), rel=1e-6)
        assert r["perplexity"] == pytest.approx(math.exp(nats / n_bytes), rel=1e-6)


def test_shorter_seq_len_and_stream_shorter_than_window(tmp_path):
    source, stream = _corpus(tmp_path)
    model = tiny_model("diff_v1", vocab_size=259, max_seq_len=64)
    for max_tokens, L, stride in [(300, 10, None), (300, 10, 3), (40, 64, None), (40, 64, 8), (2, 64, None)]:
        nats, n_bytes = _hand_nll(model, stream[:max_tokens], L, stride)
        r = evaluate_bpb(model, source, max_tokens=max_tokens, seq_len=L, stride=stride, batch_size=4)
        assert r["n_bytes"] == n_bytes
        assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)


# ------------------------------------------------------------------------------------------ window plan
def test_window_plan_examples():
    assert window_plan(10, 4) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert window_plan(11, 4) == [(0, 4, 1), (3, 7, 4), (6, 10, 7), (9, 11, 10)]  # last one shorter
    assert window_plan(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert window_plan(11, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7), (7, 11, 10)]  # last one anchored
    assert window_plan(3, 8) == [(0, 3, 1)] == window_plan(3, 8, 5)
    assert window_plan(1, 8) == [] == window_plan(0, 8, 2)
    for args in [(10, 1, None), (10, 4, 0), (10, 4, 4), (-1, 4, None), (10, 4.0, None), (10, True, None)]:
        with pytest.raises(DiffquantError):
            window_plan(*args)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 400),
    L=st.integers(2, 70),
    stride_frac=st.one_of(st.none(), st.floats(0, 1)),
)
def test_window_plan_scores_every_token_after_the_first_once(n, L, stride_frac):
    stride = None if stride_frac is None else 1 + int(stride_frac * (L - 2))
    plan = window_plan(n, L, stride)
    scored = []
    for start, end, score_from in plan:
        assert 0 <= start < score_from < end <= n  # every window scores something, never its first input
        assert end - start <= L
        scored.extend(range(score_from, end))
        for t in range(score_from, end):  # context of each target
            context = t - start
            if stride is not None:
                assert context >= min(t, L - stride)
    assert scored == list(range(1, n))  # in order, each exactly once
    if stride is None:
        assert [w[0] for w in plan] == [k * (L - 1) for k in range(len(plan))]
        assert all(score_from == start + 1 for start, _, score_from in plan)
    else:
        assert all(end - start == min(L, n) for start, end, _ in plan)
        ends = [w[1] for w in plan]
        steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        assert all(step == stride for step in steps[:-1])  # windows end `stride` apart ...
        assert all(0 < step <= stride for step in steps)  # ... the last at the stream's end


# -------------------------------------------------------------------------------------- test doubles
class CycleOracle:
    """Predicts the successor in the cycle a -> b -> c -> a (and BOS -> a) with probability 1 - eps.

    The rest of the mass is spread over the other 258 ids, so every EOS / BOS target, which the oracle
    never expects, costs ~log2(258 / eps) bits: counted as bytes they would move bpb far from the target.
    """

    def __init__(self, eps: float, max_seq_len: int = 16) -> None:
        self.config = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=259)
        self.eps = eps
        self.successor = torch.full((259,), ord("a"), dtype=torch.long)
        for cur, nxt in ("ab", "bc", "ca"):
            self.successor[ord(cur)] = ord(nxt)
        self.calls = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dim() == 2 and ids.shape[1] <= self.config.max_seq_len
        assert not torch.is_grad_enabled()
        self.calls += 1
        logits = torch.full((*ids.shape, 259), math.log(self.eps / 258), dtype=torch.float64)
        logits.scatter_(-1, self.successor[ids].unsqueeze(-1), math.log(1 - self.eps))
        return logits


@pytest.mark.parametrize("eps", [0.5, 0.1, 1e-3])
@pytest.mark.parametrize("stride", [None, 5])
def test_oracle_bpb_counts_only_bytes(tmp_path, eps, stride):
    root = tmp_path / "cycles"
    root.mkdir()
    texts = ["abcab", "abcabcabca", "a", "abc" * 20]
    for i, text in enumerate(texts):
        (root / f"{i}.txt").write_text(text)
    n_bytes = sum(len(t) for t in texts)
    n_tokens = n_bytes + 2 * len(texts)
    model = CycleOracle(eps)
    r = evaluate_bpb(model, str(root), max_tokens=10_000, stride=stride, batch_size=4)
    assert r["tokens"] == n_tokens
    assert r["n_bytes"] == n_bytes  # BOS and EOS targets (3 BOS after the first, 4 EOS) are not bytes
    assert r["bits_per_byte"] == pytest.approx(-math.log2(1 - eps), rel=1e-9)
    assert r["perplexity"] == pytest.approx(1 / (1 - eps), rel=1e-9)
    lengths = Counter(end - start for start, end, _ in window_plan(n_tokens, 16, stride))
    assert model.calls == sum(math.ceil(count / 4) for count in lengths.values())  # no padded batches


def test_special_targets_do_not_count_in_a_handmade_stream():
    a, b, c = (ord(x) for x in "abc")
    stream = torch.tensor([BOS, a, b, EOS, BOS, EOS, BOS, a, b, c, EOS])
    r = evaluate_stream(CycleOracle(0.25), stream, seq_len=4)
    assert r["n_bytes"] == 5
    assert r["bits_per_byte"] == pytest.approx(-math.log2(0.75))
    with pytest.raises(DiffquantError, match="no text tokens"):
        evaluate_stream(CycleOracle(0.25), torch.tensor([BOS, EOS, BOS, EOS]), seq_len=4)


# -------------------------------------------------------------------------------------------- errors
def test_bad_settings_raise_one_line_errors(tmp_path):
    source, _ = _corpus(tmp_path)
    model = CycleOracle(0.1, max_seq_len=16)
    cases = [
        ({"max_tokens": 100, "seq_len": 17}, "exceeds the model's max_seq_len 16"),
        ({"max_tokens": 100, "seq_len": 1}, "seq_len"),
        ({"max_tokens": 100, "stride": 16}, "stride"),
        ({"max_tokens": 100, "stride": 0}, "stride"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"max_tokens": 100, "batch_size": 0}, "batch_size"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(DiffquantError) as info:
            evaluate_bpb(model, source, **kwargs)
        assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DiffquantError, match="vocab_size 61"):
        evaluate_bpb(tiny_model("baseline"), source, max_tokens=100)
    with pytest.raises(DiffquantError, match="no such file"):
        evaluate_bpb(model, str(tmp_path / "missing"), max_tokens=100)


def test_default_seq_len_is_the_trained_context_and_reproduces_the_card(caplog):
    """A zoo model trained at 256 tokens (max_seq_len 512): the default window is 256, and the default bpb
    task reproduces the validation number on its card exactly (same text, tokens and windows); a longer
    window is allowed but warned about, since it measures extrapolation."""
    import logging

    from diffquant.eval.tasks import parse_task, run_task
    from diffquant.io import load_model
    from diffquant.zoo import card

    model = load_model("zoo:diff_v2")
    assert model.trained_seq_len == card("diff_v2")["seq_len"] == 256 < model.config.max_seq_len
    with caplog.at_level(logging.WARNING, logger="diffquant"):
        got = run_task(model, parse_task("bpb:data=stdlib:validation"), batch_size=8)
    assert got["seq_len"] == 256 and not caplog.records
    # to float32 rounding: the card was measured on another CPU, whose reductions round differently
    assert got["bits_per_byte"] == pytest.approx(card("diff_v2")["val_bpb"], rel=1e-6)
    with caplog.at_level(logging.WARNING, logger="diffquant"):
        longer = run_task(
            model, parse_task("bpb:data=stdlib:validation,tokens=2048,seq_len=512"), batch_size=8
        )
    assert longer["seq_len"] == 512
    assert any("trained at (256" in r.getMessage() for r in caplog.records)


def test_bits_per_byte_divides_by_the_bytes_of_a_multibyte_tokenizer(tmp_path):
    """With a BPE tokenizer a token stands for several bytes: bits per byte = total NLL / ln 2 / the UTF-8
    bytes of the scored targets, computed here independently (one forward per window, torch's log_softmax,
    the bytes of each target's decoded text); dividing by the token count instead is a different number."""
    from conftest import train_byte_bpe

    from diffquant.data.tokenizer import load_tokenizer
    from diffquant.eval.perplexity import evaluate_stream

    sentences = ["The quick brown fox jumps over the lazy dog near the riverbank.", "Pack my box with jugs."]
    tok = load_tokenizer(train_byte_bpe(tmp_path / "tok", sentences))
    model = tiny_model("baseline", vocab_size=320)
    stream = torch.tensor(tok.encode(" ".join(sentences * 6)), dtype=torch.long)
    got = evaluate_stream(model, stream, tokenizer=tok, seq_len=16, windows="disjoint", batch_size=2)
    nats, n_bytes, n_targets = 0.0, 0, 0
    with torch.no_grad():
        for w in range(stream.numel() // 16):
            ids = stream[w * 16 : (w + 1) * 16]
            logp = torch.log_softmax(model(ids[None]).double()[0, :-1], dim=-1)
            for t in range(1, 16):
                nats -= float(logp[t - 1, ids[t]])
                n_bytes += len(tok.decode([int(ids[t])]).encode("utf-8"))
                n_targets += 1
    assert n_bytes > 1.5 * n_targets  # multi-byte tokens: the two divisors differ
    assert got["n_tokens_scored"] == n_targets and got["n_bytes"] == n_bytes
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)


def test_text_shorter_than_one_window_is_refused_as_profile_refuses_it(tmp_path, capsys):
    """A source of fewer tokens than one window: profile and calibration refuse it (token_windows), and so
    does eval, in the same words; asking for fewer tokens than a window of a longer text still scores them."""
    from diffquant.cli import main
    from diffquant.data import token_windows

    short = tmp_path / "short.txt"
    short.write_text("thirty bytes of text, no more\n")  # 30 bytes: 32 byte tokens with BOS / EOS
    model = tiny_model("baseline", vocab_size=259, max_seq_len=64)
    with pytest.raises(DiffquantError) as profile_error:
        token_windows(str(short), 1000, 64)
    for windows in ("chained", None):
        with pytest.raises(DiffquantError) as info:
            evaluate_bpb(model, str(short), max_tokens=1000, windows=windows)
        assert str(info.value) == str(profile_error.value)
        assert "has 32 tokens, fewer than one window of seq_len 64" in str(info.value)
    with pytest.raises(DiffquantError, match="fewer than one window of seq_len 40"):
        evaluate_bpb(model, str(short), max_tokens=1000, seq_len=40, stride=8)
    assert evaluate_bpb(model, str(short), max_tokens=1000, seq_len=32)["tokens"] == 32
    out = tmp_path / "run"
    assert main(["eval", "init:baseline:tiny", "--task", f"bpb:data={short}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "fewer than one window" in err and str(short) in err
    assert [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]


class LowPrecisionLogits(torch.nn.Module):
    """A tiny model whose logits come out in ``dtype`` (a bf16 / fp16 model's), sharpened so that
    log-softmax in that dtype would be visibly wrong (bf16 keeps 8 bits of mantissa)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = tiny_model("baseline", vocab_size=259, max_seq_len=64)
        self.config = self.inner.config
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.inner(ids) * 40).to(self.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_scored_in_float32(tmp_path, dtype):
    """bf16 / fp16 logits through scoring: the NLL equals a float64 log-softmax of the same logits (to
    float32 rounding), which a log-softmax in the logits' own dtype misses by orders of magnitude more."""
    source, stream = _corpus(tmp_path)
    model = LowPrecisionLogits(dtype)
    got = evaluate_bpb(model, source, max_tokens=128, seq_len=64, windows="disjoint", batch_size=2)
    ids = torch.tensor(stream[:128]).view(2, 64)
    with torch.no_grad():
        logits = model(ids)
    assert logits.dtype == dtype
    ref = torch.log_softmax(logits.double()[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    low = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0].double()
    text = ids[:, 1:] < 256
    want, naive = -ref[text].sum().item(), -low[text].sum().item()
    assert got["nll_bits"] * math.log(2) == pytest.approx(want, rel=1e-6)
    assert abs(naive - want) > 100 * abs(got["nll_bits"] * math.log(2) - want)  # the test can tell


class _PassThrough(torch.nn.Module):
    def forward(self, x, valid=None):
        return x


def test_large_vocabulary_batches_score_the_head_a_slice_at_a_time(monkeypatch):
    """Above LOGITS_WHOLE_BYTES the LM head runs on slices of positions (a 262k vocabulary's 8 x 1,024
    logits are never all held): the same log-probabilities as one whole forward, each slice within
    LOGITS_SLICE_BYTES; a quantizer on the head's input keeps the whole forward (it may scale per tensor)."""
    from diffquant.data import scoring
    from diffquant.eval import perplexity

    model = tiny_model("baseline")
    ids = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = perplexity.target_logprobs(model, ids)
        row = 3 * 4 * model.config.vocab_size
        monkeypatch.setattr(scoring, "LOGITS_WHOLE_BYTES", row * 36 - 1)
        monkeypatch.setattr(scoring, "LOGITS_SLICE_BYTES", row * 5)
        widths = []
        handle = model.lm_head.register_forward_pre_hook(lambda m, a: widths.append(a[0].shape[1]))
        sliced = perplexity.target_logprobs(model, ids)
        handle.remove()
        assert widths == [5] * 7 + [1] and sliced.shape == whole.shape == (3, 36)
        torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-5)
        model.lm_head.input.quantizer = _PassThrough()  # any rewrite of the head's input
        widths.clear()
        handle = model.lm_head.register_forward_pre_hook(lambda m, a: widths.append(a[0].shape[1]))
        assert torch.equal(perplexity.target_logprobs(model, ids), whole) and widths == [37]
        handle.remove()
