"""Streaming attention metrics against brute-force float64 loops, exact merging, and the real model's taps."""

import json
import math

import pytest
import torch

from diffquant import DiffquantError
from diffquant.models import DecoderLM, ModelConfig, matched_config
from diffquant.profile.attention_metrics import (
    DiffMapStats,
    LambdaStats,
    MapStats,
    SinkRateStats,
    SpanMassStats,
    accumulator_from_dict,
)

B, H, S = 2, 3, 12
OFFSET, TQ = 7, 5  # the test chunk: query rows at absolute positions 7..11


def _valid(t0: int, t1: int, s: int = S) -> torch.Tensor:
    q = torch.arange(t0, t1)[:, None]
    return (torch.arange(s)[None, :] <= q)[None, None]


def _probs(seed: int, t0: int = 0, t1: int = S, dtype=torch.float64) -> torch.Tensor:
    """Causal softmax of random logits (B, H, t1 - t0, S) for query rows t0..t1-1; exactly 0 where masked."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, S, S, generator=g, dtype=torch.float64) * 2.0
    p = torch.softmax(logits.masked_fill(~_valid(0, S), -math.inf), dim=-1)
    return p[:, :, t0:t1].to(dtype)


def _diff(t0: int = 0, t1: int = S, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """D = A1 - lambda A2 with a per (b, t, h) lambda in (0, 1), and that lambda as (B, T, H)."""
    g = torch.Generator().manual_seed(99)
    lam = torch.rand(B, S, H, generator=g, dtype=torch.float64)
    d = _probs(1) - lam.transpose(1, 2).unsqueeze(-1) * _probs(2)
    return d[:, :, t0:t1].to(dtype), lam


def _close(a, b, rel: float) -> None:
    assert a == pytest.approx(b, rel=rel, abs=rel), (a, b)


# ------------------------------------------------------------------------------------- brute force
def _brute_map(p: torch.Tensor, valid: torch.Tensor) -> dict:
    """Per-head means by explicit loops over b, h, rows, keys in float64."""
    out = {"entropy": [], "norm_entropy": [], "sink": [], "rows": [], "single": []}
    for h in range(p.shape[1]):
        ent = norm = sink = 0.0
        rows = multi = single = 0
        for b in range(p.shape[0]):
            for r in range(p.shape[2]):
                keys = [k for k in range(p.shape[3]) if bool(valid[0, 0, r, k])]
                e = 0.0
                for k in keys:
                    x = float(p[b, h, r, k])
                    if x > 0:
                        e -= x * math.log(x)
                ent += e
                sink += float(p[b, h, r, 0])
                rows += 1
                if len(keys) > 1:
                    norm += e / math.log(len(keys))
                    multi += 1
                else:
                    single += 1
        out["entropy"].append(ent / rows)
        out["norm_entropy"].append(norm / multi if multi else None)
        out["sink"].append(sink / rows)
        out["rows"].append(rows)
        out["single"].append(single)
    return out


def _brute_diff(d: torch.Tensor, valid: torch.Tensor) -> dict:
    out = {"neg": [], "l1": [], "row_sum": [], "sink": []}
    for h in range(d.shape[1]):
        neg = tot = rs = sink = 0.0
        rows = 0
        for b in range(d.shape[0]):
            for r in range(d.shape[2]):
                rows += 1
                sink += float(d[b, h, r, 0])
                for k in range(d.shape[3]):
                    if bool(valid[0, 0, r, k]):
                        x = float(d[b, h, r, k])
                        neg += max(-x, 0.0)
                        tot += abs(x)
                        rs += x
        out["neg"].append(neg / tot)
        out["l1"].append(tot / rows)
        out["row_sum"].append(rs / rows)
        out["sink"].append(sink / rows)
    return out


# ----------------------------------------------------------------------------------------- MapStats
@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
def test_map_stats_match_brute_force(dtype, rel):
    p, valid = _probs(0, OFFSET, OFFSET + TQ, dtype), _valid(OFFSET, OFFSET + TQ)
    stats = MapStats(H)
    stats.update(p, valid)
    got, want = stats.summary(), _brute_map(p.double(), valid)
    for h in range(H):
        _close(got["entropy"]["per_head"][h], want["entropy"][h], rel)
        _close(got["norm_entropy"]["per_head"][h], want["norm_entropy"][h], rel)
        _close(got["sink_mass"]["per_head"][h], want["sink"][h], rel)
    assert got["rows"] == want["rows"] == [B * TQ] * H
    assert got["single_key_rows"] == [0] * H
    _close(got["entropy"]["mean"], sum(want["entropy"]) / H, rel)


def test_map_stats_single_key_rows_are_counted_apart():
    p, valid = _probs(0, 0, 4), _valid(0, 4)
    stats = MapStats(H)
    stats.update(p, valid)
    got, want = stats.summary(), _brute_map(p, valid)
    assert got["single_key_rows"] == want["single"] == [B] * H
    assert got["rows"] == [4 * B] * H
    for h in range(H):
        _close(got["norm_entropy"]["per_head"][h], want["norm_entropy"][h], 1e-9)
        _close(got["entropy"]["per_head"][h], want["entropy"][h], 1e-9)


def test_map_stats_uniform_rows_have_normalised_entropy_one():
    t = 6
    valid = _valid(0, t, t)
    p = valid.double().expand(1, 2, t, t) / valid.sum(-1, keepdim=True)
    stats = MapStats(2)
    stats.update(p, valid)
    summary = stats.summary()
    assert summary["norm_entropy"]["per_head"] == pytest.approx([1.0, 1.0], rel=1e-12)
    assert summary["sink_mass"]["mean"] == pytest.approx(sum(1 / (i + 1) for i in range(t)) / t, rel=1e-12)


# ------------------------------------------------------------------------------------- DiffMapStats
@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
def test_diff_map_stats_match_brute_force(dtype, rel):
    d, lam = _diff(OFFSET, OFFSET + TQ, dtype)
    valid = _valid(OFFSET, OFFSET + TQ)
    stats = DiffMapStats(H)
    stats.update(d, valid)
    got, want = stats.summary(), _brute_diff(d.double(), valid)
    for h in range(H):
        _close(got["negative_fraction"]["per_head"][h], want["neg"][h], rel)
        _close(got["l1_ratio"]["per_head"][h], want["l1"][h], rel)
        _close(got["row_sum"]["per_head"][h], want["row_sum"][h], rel)
        _close(got["sink_mass"]["per_head"][h], want["sink"][h], rel)
        # each A1, A2 row sums to 1, so the mean row sum of D is 1 - mean lambda over the same rows
        _close(got["row_sum"]["per_head"][h], 1 - lam[:, OFFSET : OFFSET + TQ, h].mean().item(), 1e-6)
    assert got["rows"] == [B * TQ] * H


# ------------------------------------------------------------------------------------ SpanMassStats
def _brute_span(m, valid, spans, positions):
    ans, rest, n = [0.0] * H, [0.0] * H, 0
    for b, span in enumerate(spans):
        if span is None or span[2] not in positions:
            continue
        start, end, q = span
        r = positions.index(q)
        n += 1
        for h in range(H):
            for k in range(m.shape[3]):
                if bool(valid[0, 0, r, k]):
                    if start <= k < end:
                        ans[h] += float(m[b, h, r, k])
                    else:
                        rest[h] += float(m[b, h, r, k])
    return [a / n for a in ans], [x / n for x in rest], n


@pytest.mark.parametrize("which", ["probs", "diff_map"])
def test_span_mass_matches_brute_force(which):
    m = _probs(3, OFFSET, OFFSET + TQ) if which == "probs" else _diff(OFFSET, OFFSET + TQ)[0]
    valid = _valid(OFFSET, OFFSET + TQ)
    spans = [(2, 5, 9), (0, 3, 11)]
    stats = SpanMassStats(H)
    stats.update(m, valid, spans)
    got = stats.summary()
    ans, rest, n = _brute_span(m, valid, spans, list(range(OFFSET, OFFSET + TQ)))
    assert got["samples"] == n == 2
    for h in range(H):
        _close(got["answer_mass"]["per_head"][h], ans[h], 1e-9)
        _close(got["rest_mass"]["per_head"][h], rest[h], 1e-9)
    _close(got["answer_mass"]["mean"], sum(ans) / H, 1e-9)


def test_span_mass_skips_queries_outside_the_chunk_and_none_rows():
    m, valid = _probs(3, OFFSET, OFFSET + TQ), _valid(OFFSET, OFFSET + TQ)
    stats = SpanMassStats(H)
    stats.update(m, valid, [(0, 2, 3), None])  # query 3 lies in an earlier chunk
    summary = stats.summary()
    assert summary["samples"] == 0
    assert summary["answer_mass"]["per_head"] == [None] * H
    assert summary["answer_mass"]["mean"] is None


def test_span_mass_all_on_span_gives_one_and_zero():
    m = torch.zeros(B, H, TQ, S, dtype=torch.float64)
    m[:, :, 2, 4:7] = 1 / 3  # row 2 = absolute position 9
    stats = SpanMassStats(H)
    stats.update(m, _valid(OFFSET, OFFSET + TQ), [(4, 7, 9), (4, 7, 9)])
    summary = stats.summary()
    assert summary["answer_mass"]["per_head"] == pytest.approx([1.0] * H, rel=1e-12)
    assert summary["rest_mass"]["per_head"] == pytest.approx([0.0] * H, abs=1e-15)
    assert summary["samples"] == 2


def test_span_mass_rejects_a_span_the_query_cannot_see():
    m, valid = _probs(3, OFFSET, OFFSET + TQ), _valid(OFFSET, OFFSET + TQ)
    for bad in [(5, 11, 9), (3, 3, 9), (-1, 2, 9)]:
        with pytest.raises(DiffquantError) as info:
            SpanMassStats(H).update(m, valid, [bad, None])
        assert "\n" not in str(info.value)


# -------------------------------------------------------------------------------------- LambdaStats
def test_lambda_per_head_matches_brute_force_and_merges():
    lam = torch.rand(B, S, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    whole = LambdaStats()
    whole.update(lam)
    parts = LambdaStats()
    parts.update(lam[:1])
    other = LambdaStats()
    other.update(lam[1:, :4])
    third = LambdaStats()
    third.update(lam[1:, 4:])
    parts.merge(other).merge(third)
    for stats in (whole, parts):
        got = stats.summary()
        assert got["mode"] == "per_head"
        for h in range(H):
            xs = [float(lam[b, t, h]) for b in range(B) for t in range(S)]
            mean = sum(xs) / len(xs)
            std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
            assert got["count"][h] == len(xs)
            _close(got["mean"]["per_head"][h], mean, 1e-9)
            _close(got["std"]["per_head"][h], std, 1e-9)
            assert got["min"]["per_head"][h] == min(xs)
            assert got["max"]["per_head"][h] == max(xs)
        assert got["min"]["min"] == float(lam.min())
        assert got["max"]["max"] == float(lam.max())


def test_lambda_scalar_keeps_last_value_and_rejects_mixing():
    stats = LambdaStats()
    stats.update(torch.tensor(0.25))
    later = LambdaStats()
    later.update(torch.tensor(0.5))
    stats.merge(later)
    summary = stats.summary()
    assert summary == {"mode": "scalar", "count": 2, "value": 0.5, "min": 0.25, "max": 0.5}
    assert LambdaStats.from_dict(json.loads(json.dumps(stats.to_dict()))).summary() == summary
    broken = LambdaStats()  # only a NaN seen there: counted, and nothing else taken
    broken.update(torch.tensor(math.nan))
    assert broken.summary() == {
        "mode": "scalar",
        "count": 0,
        "value": None,
        "min": None,
        "max": None,
        "nonfinite": 1,
    }
    again = LambdaStats.from_dict(json.loads(json.dumps(stats.to_dict()))).merge(broken)
    assert again.summary() == {**summary, "nonfinite": 1}
    assert LambdaStats().merge(broken).merge(later).summary() == {**broken.summary(), **later.summary()}
    with pytest.raises(DiffquantError):
        stats.update(torch.rand(1, 2, 3))
    assert LambdaStats().summary()["mode"] is None


# ----------------------------------------------------------------- merging, serialisation (all types)
def _feed(stats, t0, t1, b0, b1, which):
    valid = _valid(t0, t1)
    if isinstance(stats, MapStats):
        stats.update(_probs(0, t0, t1)[b0:b1], valid)
    elif isinstance(stats, DiffMapStats):
        stats.update(_diff(t0, t1)[0][b0:b1], valid)
    else:
        m = _probs(0, t0, t1) if which == "probs" else _diff(t0, t1)[0]
        stats.update(m[b0:b1], valid, [(2, 5, 9), (0, 3, 4)][b0:b1])
    return stats


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats, SpanMassStats])
def test_chunks_and_batches_merge_to_one_pass(cls):
    one = _feed(cls(H), 0, S, 0, B, "probs")
    merged = cls(H)
    for t0, t1 in [(0, 3), (3, OFFSET), (OFFSET, S)]:
        for b in range(B):
            merged.merge(_feed(cls(H), t0, t1, b, b + 1, "probs"))
    a, b = one.summary(), merged.summary()
    _assert_nested_close(a, b)
    if cls is SpanMassStats:
        assert b["samples"] == 2  # each sample counted once, in the chunk holding its query


def _assert_nested_close(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_nested_close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_nested_close(x, y)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15)
    else:
        assert a == b


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats, SpanMassStats, LambdaStats])
def test_to_dict_from_dict_round_trip(cls):
    if cls is LambdaStats:
        stats = LambdaStats()
        stats.update(torch.rand(B, S, H, generator=torch.Generator().manual_seed(1)))
    else:
        stats = _feed(cls(H), OFFSET, S, 0, B, "diff_map")
    data = json.loads(json.dumps(stats.to_dict(), allow_nan=False))
    again = cls.from_dict(data)
    assert again.to_dict() == stats.to_dict()
    assert again.summary() == stats.summary()
    assert accumulator_from_dict(data).summary() == stats.summary()
    json.dumps(stats.summary(), allow_nan=False)


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats, SpanMassStats, LambdaStats])
def test_dict_without_metric_tag_and_next_to_a_foreign_type_key(cls):
    """The profiler stores {"type": its kind, **to_dict()} and pops "type" again before from_dict."""
    stats = cls() if cls is LambdaStats else _feed(cls(H), 0, S, 0, B, "probs")
    if cls is LambdaStats:
        stats.update(torch.tensor(0.3))
    wrapped = {"type": "map", **stats.to_dict()}
    assert wrapped["type"] == "map"
    wrapped.pop("type")
    wrapped.pop("metric")
    assert cls.from_dict(wrapped).summary() == stats.summary()


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats, SpanMassStats])
def test_head_count_learned_from_the_first_map(cls):
    lazy, empty = cls(), cls()
    assert lazy.n_heads is None
    data = json.loads(json.dumps(empty.to_dict()))
    assert cls.from_dict(data).n_heads is None
    json.dumps(empty.summary(), allow_nan=False)
    _feed(lazy, 0, S, 0, B, "probs")
    assert lazy.n_heads == H
    _assert_nested_close(lazy.summary(), _feed(cls(H), 0, S, 0, B, "probs").summary())
    assert cls().merge(lazy).merge(cls()).summary() == lazy.summary()
    with pytest.raises(ValueError):
        _feed(cls(H + 1), 0, S, 0, B, "probs")


def test_bad_dicts_and_merges_are_one_line_errors():
    for call in (
        lambda: MapStats.from_dict({"metric": "DiffMapStats", "n_heads": 3}),
        lambda: MapStats.from_dict({"metric": "MapStats", "n_heads": 3, "rows": [1]}),
        lambda: MapStats.from_dict({**MapStats(1).to_dict(), "rows": ["x"]}),
        lambda: accumulator_from_dict({"metric": "Nope"}),
        lambda: MapStats(3).merge(MapStats(4)),
        lambda: MapStats(3).merge(DiffMapStats(3)),
        lambda: LambdaStats.from_dict({"metric": "LambdaStats", "mode": "per_head"}),
    ):
        with pytest.raises(DiffquantError) as info:
            call()
        assert "\n" not in str(info.value)


# -------------------------------------------------------------------------------- the real model
BASE = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=96
)


def _profile(model: DecoderLM, ids: torch.Tensor, spans) -> dict:
    """Run ``model`` with hooks feeding every accumulator of layer 0; summaries by site suffix."""
    heads = model.config.n_heads
    acc = {
        "probs1": MapStats(heads),
        "probs2": MapStats(heads),
        "diff_map": DiffMapStats(heads),
        "span": SpanMassStats(heads),
        "lambda": LambdaStats(),
    }

    def on_map(key):
        def hook(module, args, output):
            acc[key].update(*args)
            if key == "diff_map":
                acc["span"].update(args[0], args[1], spans)

        return hook

    def on_lambda(module, args, output):
        acc["lambda"].update(args[0])

    hooks = [
        tap.register_forward_hook(on_map(name.rsplit(".", 1)[1]))
        for name, tap in model.taps(["layers.0.attn.probs*", "layers.0.attn.diff_map"]).items()
    ]
    hooks.append(model.taps("layers.0.attn.lambda")["layers.0.attn.lambda"].register_forward_hook(on_lambda))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {k: v.summary() for k, v in acc.items()}


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_model_taps_feed_the_accumulators(kind):
    torch.manual_seed(0)
    model = DecoderLM(matched_config(BASE, kind)).eval()
    heads = model.config.n_heads
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    spans = [(3, 6, 15), (0, 4, 19)]
    model.set_attention_path("explicit", chunk_size=64)
    whole = _profile(model, ids, spans)
    model.set_attention_path("explicit", chunk_size=3)
    chunked = _profile(model, ids, spans)

    assert whole["probs1"]["rows"] == [2 * 20] * heads
    assert whole["diff_map"]["rows"] == [2 * 20] * heads
    assert whole["span"]["samples"] == chunked["span"]["samples"] == 2
    lam = whole["lambda"]
    for h in range(heads):
        mean_lambda = lam["value"] if kind == "diff_v1" else lam["mean"]["per_head"][h]
        assert whole["diff_map"]["row_sum"]["per_head"][h] == pytest.approx(1 - mean_lambda, abs=1e-5)
        ent = whole["probs1"]["entropy"]["per_head"][h]
        assert 0 < ent < math.log(20)
    if kind == "diff_v2":
        assert lam["count"] == [2 * 20] * heads
        assert all(0 < v < 1 for v in lam["min"]["per_head"] + lam["max"]["per_head"])
    else:
        assert lam["count"] == 1 and lam["min"] == lam["max"] == lam["value"]
    # chunking the explicit path does not change any statistic beyond fp32 rounding
    for key in ("probs1", "probs2", "diff_map", "span"):
        _assert_close_loose(whole[key], chunked[key])


def _assert_close_loose(a, b):
    if isinstance(a, dict):
        for k in a:
            _assert_close_loose(a[k], b[k])
    elif isinstance(a, list):
        for x, y in zip(a, b, strict=True):
            _assert_close_loose(x, y)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    else:
        assert a == b


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats])
def test_finite_fast_path_matches_general_path(cls, monkeypatch):
    from diffquant.profile import attention_metrics

    torch.manual_seed(0)
    valid = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None]
    maps = [torch.softmax(torch.randn(2, 3, 5, 7).masked_fill(~valid, -math.inf), -1)]
    bad = maps[0].clone()
    bad[0, 1, 2, 0], bad[1, 2, 4, 1] = math.nan, math.inf
    maps.append(bad)
    maps.append(torch.full((2, 3, 5, 7), 3e38))  # finite, but p log p overflows: the general path
    monkeypatch.setattr(attention_metrics, "NATIVE", False)  # the torch paths (the native one: below)
    out = []
    for fast in (True, False):
        monkeypatch.setattr(attention_metrics, "FAST", fast)
        acc = cls(3)
        for m in maps:
            acc.update(m, valid)
        out.append(json.dumps(acc.to_dict()))
    assert out[0] == out[1]


_F32_MAX = float(torch.finfo(torch.float32).max)


def _bad_rows_brute(m: torch.Tensor, valid: torch.Tensor, differential: bool) -> list[int]:
    """Per head, the rows left out by loops in float64: a visible entry that is not finite, or (a map of
    probabilities) a negative one, or a row whose sum of -p log p (|D| for a DIFF map) is beyond float32's
    range, where the float32 work of the metrics cannot hold it."""
    out = []
    for h in range(m.shape[1]):
        bad = 0
        for b in range(m.shape[0]):
            for r in range(m.shape[2]):
                xs = [float(m[b, h, r, k]) for k in range(m.shape[3]) if bool(valid[0, 0, r, k])]
                if not xs:
                    continue
                if not all(math.isfinite(x) for x in xs) or (not differential and min(xs) < 0):
                    bad += 1
                    continue
                total = sum(abs(x) for x in xs) if differential else sum(x * math.log(x) for x in xs if x)
                bad += abs(total) > _F32_MAX
        out.append(bad)
    return out


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats])
def test_rows_left_out_are_told_apart_per_row(cls, monkeypatch):
    """Rows with a NaN / Inf, a negative probability or a sum beyond float32 are left out one by one (the
    other rows of that map still count), on the fast path (decided from the row sums, no read of the map)
    and on the general one (each entry checked first): the counts against loops, and the means against the
    map with those rows taken out."""
    from diffquant.profile import attention_metrics

    monkeypatch.setattr(attention_metrics, "NATIVE", False)
    valid = _valid(0, S)
    good = _probs(7, dtype=torch.float32)
    if cls is DiffMapStats:
        good = good - 0.4 * _probs(8, dtype=torch.float32)
    bad = good.clone()
    bad[0, 0, 3, 1] = math.nan
    bad[1, 2, 9, 9] = math.inf
    bad[1, 1, 5, 0] = -0.25 if cls is MapStats else 3e38  # negative p; a |D| sum past float32
    bad[1, 1, 5, 2] = 0.5 if cls is MapStats else 3e38
    bad[0, 2, 0, 0] = 3e38  # one visible key: finite |D|; p log p past float32
    want = _bad_rows_brute(bad, valid, cls is DiffMapStats)
    assert sum(want) == (4 if cls is MapStats else 3)
    rows_bad = torch.zeros(B, H, S, dtype=torch.bool)
    for b, h, r in ((0, 0, 3), (1, 2, 9), (1, 1, 5), (0, 2, 0)):
        rows_bad[b, h, r] = cls is MapStats or (b, h, r) != (0, 2, 0)
    out = []
    for fast in (True, False):
        monkeypatch.setattr(attention_metrics, "FAST", fast)
        acc = cls(H)
        acc.update(bad, valid)
        got = acc.summary()
        assert got["nonfinite_rows"] == want
        assert got["rows"] == [B * S - w for w in want]
        out.append(json.dumps(acc.to_dict()))
        # the kept rows' means are those of the map with the left-out rows masked away
        ref = cls(H)
        ref.update(bad, valid & ~rows_bad[:, :, :, None])
        key = "entropy" if cls is MapStats else "l1_ratio"
        for a, e in zip(got[key]["per_head"], ref.summary()[key]["per_head"], strict=True):
            _close(a, e, 1e-6)
    assert out[0] == out[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [MapStats, DiffMapStats])
def test_fused_metrics_equal_the_plain_ones_bit_for_bit(cls, dtype, monkeypatch):
    """The fused pass's entropy (torch.special.entr) and negative mass (-sum min(d, 0)) give the plain path's
    sums bit for bit on real-shaped causal maps (2, 8, 256, 256), a map with a NaN (the general path) among
    them, and a diff map whose rows hold zeros, negatives and positives."""
    from diffquant.profile import attention_metrics

    gen = torch.Generator().manual_seed(3)
    valid = torch.ones(256, 256, dtype=torch.bool).tril()[None, None]
    maps = []
    for _ in range(2):
        logits = 3.0 * torch.randn(2, 8, 256, 256, generator=gen)
        p = torch.softmax(logits.masked_fill(~valid, -math.inf), -1)
        maps.append(p if cls is MapStats else p - 0.6 * torch.softmax(logits.flip(-1), -1) * valid)
    bad = maps[0].clone()
    bad[1, 3, 100, 2] = math.nan
    maps.insert(1, bad)
    monkeypatch.setattr(attention_metrics, "NATIVE", False)  # the torch paths (the native one: below)
    out = []
    for fused in (True, False):
        monkeypatch.setattr(attention_metrics, "FUSED", fused)
        acc = cls(8)
        for m in maps:
            acc.update(m.to(dtype), valid)
        out.append(json.dumps(acc.to_dict()))
    assert out[0] == out[1]


@pytest.mark.parametrize("cls", [MapStats, DiffMapStats])
def test_native_metrics_equal_the_torch_path(cls, monkeypatch):
    """The native pass (each row's entropy / sums in float64, the map read in place) gives the torch path's
    per-head sums within its float32 rounding on real-shaped causal maps with a sliding window (rows that do
    not start at key 0: no sink value there), a map with a NaN (both take the general path: equal bit for
    bit) and DIFF maps with negatives; counts are equal. It must really run on the float32 maps."""
    from diffquant.kernels import native
    from diffquant.models.attention import _valid_mask
    from diffquant.profile import attention_metrics

    gen = torch.Generator().manual_seed(4)
    maps = []
    for window in (None, 40):
        valid = _valid_mask(96, 160, 64, "cpu", window=window)
        logits = 3.0 * torch.randn(2, 8, 96, 160, generator=gen)
        p = torch.softmax(logits.masked_fill(~valid, -math.inf), -1)
        d = p - 0.6 * torch.softmax((logits.flip(-1)).masked_fill(~valid, -math.inf), -1)
        m = p if cls is MapStats else d
        maps.append((torch.where(valid, m, 0.25), valid))  # garbage where masked: must not be read
    bad = maps[0][0].clone()
    bad[1, 3, 10, 2] = math.nan
    maps.insert(1, (bad, maps[0][1]))
    calls = []
    monkeypatch.setattr(native, "map_rows", lambda *a, _f=native.map_rows: calls.append(1) or _f(*a))
    out = []
    for on in (True, False):
        monkeypatch.setattr(attention_metrics, "NATIVE", on)
        acc = cls(8)
        for m, valid in maps:
            acc.update(m, valid)
        out.append(acc.to_dict())
    assert len(calls) == 3  # the two finite maps natively; the NaN one tried, then the general path
    for name in cls.COUNTS:
        assert out[0][name] == out[1][name], name
    for name in cls.SUMS:
        assert out[0][name] == pytest.approx(out[1][name], rel=2e-6, abs=1e-6), name


# ------------------------------------------------------------------ the attention-sink rate (Gu et al.)
def _brute_sink(maps: list[torch.Tensor], epsilon: float) -> tuple[list[int], list[int], list[float]]:
    """Gu et al. 2024 by loops: per sequence b and head h, alpha = (1 / T) sum_i A[b, h, i, 0]; a sink head
    when alpha > epsilon. Per head: (sequences, sink sequences, sum of alpha), over the whole maps given."""
    seqs, sinks, total = [0] * H, [0] * H, [0.0] * H
    for m in maps:
        for b in range(m.shape[0]):
            for h in range(m.shape[1]):
                alpha = sum(float(m[b, h, i, 0]) for i in range(m.shape[2])) / m.shape[2]
                seqs[h] += 1
                sinks[h] += alpha > epsilon
                total[h] += alpha
    return seqs, sinks, total


def _alphas(maps: list[torch.Tensor]) -> list[float]:
    return [float(m[b, h, :, 0].mean()) for m in maps for b in range(m.shape[0]) for h in range(m.shape[1])]


@pytest.mark.parametrize("which", ["probs", "diff_map"])
def test_sink_rate_matches_gu_et_al_by_loops_over_chunked_forwards(which):
    """Two forwards (seeds), each fed in three query chunks as the explicit path does; epsilon at the median
    alpha, so some (sequence, head) pairs are sinks and some are not, and none sits on the threshold."""
    maps = [_probs(0), _probs(5)] if which == "probs" else [_diff()[0], _diff()[0] * 0.5 + _probs(7) * 0.5]
    alphas = sorted(_alphas(maps))
    epsilon = (alphas[len(alphas) // 2 - 1] + alphas[len(alphas) // 2]) / 2
    stats = SinkRateStats(H, epsilon)
    for m in maps:
        for t0, t1 in [(0, 3), (3, OFFSET), (OFFSET, S)]:
            stats.update(m[:, :, t0:t1], _valid(t0, t1))
    seqs, sinks, total = _brute_sink(maps, epsilon)
    out = stats.summary()
    assert out["sequences"] == seqs == [2 * B] * H
    assert out["sink_rate"]["per_head"] == [k / n for k, n in zip(sinks, seqs, strict=True)]
    assert 0 < sum(sinks) < sum(seqs)
    for h in range(H):
        _close(out["first_token_importance"]["per_head"][h], total[h] / seqs[h], 1e-12)
    assert out["mean_length"]["per_head"] == [S] * H


def test_sink_rate_counts_only_sequences_seen_from_their_first_row():
    """A decode step (one query at the end) or a chunk that does not continue the open sequence is not a
    sequence of Gu et al.'s probe; a bf16 map is summed in float64."""
    p = _probs(0)
    stats = SinkRateStats(H)
    stats.update(p[:, :, OFFSET:S], _valid(OFFSET, S))  # no first rows: nothing counted
    stats.update(p[:, :, 0:3], _valid(0, 3))
    stats.update(p[:, :, OFFSET:S], _valid(OFFSET, S))  # skips rows 3..6: the sequence is dropped
    assert stats.summary()["sequences"] == [0] * H
    stats.update(p.to(torch.bfloat16), _valid(0, S))  # a whole prefill ...
    stats.update(p[:, :, S - 1 :], _valid(S - 1, S))  # ... then a decode step: one sequence per row
    out = stats.summary()
    assert out["sequences"] == [B] * H
    want = [float(p.to(torch.bfloat16)[:, h, :, 0].double().sum()) / (B * S) for h in range(H)]
    for h in range(H):
        _close(out["first_token_importance"]["per_head"][h], want[h], 1e-12)


def test_sink_rate_merges_round_trips_and_refuses_mixed_epsilons():
    one = SinkRateStats(H, 0.2)
    parts = [SinkRateStats(H, 0.2) for _ in range(B)]
    one.update(_probs(0), _valid(0, S))
    for b, part in enumerate(parts):
        part.update(_probs(0)[b : b + 1], _valid(0, S))
    merged = parts[0].merge(parts[1])
    _assert_nested_close(one.summary(), merged.summary())
    data = json.loads(json.dumps(one.to_dict(), allow_nan=False))
    assert data["epsilon"] == 0.2
    assert accumulator_from_dict(data).summary() == one.summary()
    nan = _probs(0).clone()
    nan[0, 1, 4, 0] = math.nan
    one.update(nan, _valid(0, S))
    assert one.summary()["nonfinite_sequences"] == [0, 1, 0]
    assert one.summary()["sequences"] == [4, 3, 4]
    for call in (
        lambda: SinkRateStats(H, 0.2).merge(SinkRateStats(H, 0.3)),
        lambda: SinkRateStats.from_dict({**SinkRateStats(H).to_dict(), "epsilon": True}),
    ):
        with pytest.raises(DiffquantError) as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError):
        SinkRateStats(H, float("nan"))


@pytest.mark.parametrize("kind", ["baseline", "diff_v2"])
def test_sink_probe_on_a_model_equals_the_definition_on_its_captured_maps(kind):
    """sink_rates / sink_rate_summary on a 10-layer model (chunked explicit path) against Gu et al.'s
    formula computed here from maps captured whole by a plain hook: per layer the share of (sequence, head)
    pairs over epsilon, the mean over layers, and the DIFF components."""
    from diffquant.profile.sinks import sink_rate_summary, sink_rates

    torch.manual_seed(1)
    cfg = matched_config(BASE, kind) if kind != "baseline" else BASE
    cfg = ModelConfig(**{**cfg.to_dict(), "n_layers": 10})
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 61, (5, 16), generator=torch.Generator().manual_seed(4))
    captured: dict[str, list[torch.Tensor]] = {}
    handles = [
        tap.register_forward_hook(lambda _m, a, o, n=name: captured.setdefault(n, []).append(o.double()))
        for name, tap in model.taps("*").items()
        if tap.kind in ("probs", "diff_map")
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    # epsilon in the widest gap between the middle half of the alphas: no pair within rounding of it
    alphas = sorted(_alphas([torch.cat(v) for v in captured.values()]))
    mid = alphas[len(alphas) // 4 : 3 * len(alphas) // 4]
    gap, i = max((b - a, i) for i, (a, b) in enumerate(zip(mid, mid[1:], strict=False)))
    epsilon = (mid[i] + mid[i + 1]) / 2
    assert gap > 1e-5
    model.set_attention_path("explicit", chunk_size=5)
    summary = sink_rate_summary(sink_rates(model, ids, epsilon=epsilon, batch_size=2))

    def rate(suffix: str) -> tuple[float, list[float]]:
        per_layer = []
        for layer in range(10):
            m = torch.cat(captured[f"layers.{layer}.attn.{suffix}"])
            per_layer.append(float((m[:, :, :, 0].mean(-1) > epsilon).double().mean()))
        return sum(per_layer) / 10, per_layer

    effective = "probs" if kind == "baseline" else "diff_map"
    want, want_layers = rate(effective)
    assert summary["map"] == effective and summary["sequences"] == 5 and summary["seq_len"] == 16
    assert summary["per_layer"] == pytest.approx(want_layers, abs=1e-12)
    assert summary["rate"] == pytest.approx(want, abs=1e-12)
    assert summary["heads"] == 10 * cfg.n_heads
    if kind == "diff_v2":
        assert set(summary["components"]) == {"probs1", "probs2"}
        assert summary["components"]["probs1"] == pytest.approx(rate("probs1")[0], abs=1e-12)
    else:
        assert summary["components"] == {}


def test_sink_rate_lines_name_the_probe_once_or_per_model():
    from diffquant.profile.sinks import format_sink_rates

    base = {"epsilon": 0.3, "sequences": 100, "seq_len": 64.0, "rate": 0.716, "heads": 270, "components": {}}
    diff = {**base, "rate": 0.05, "heads": 12, "components": {"probs1": 0.25, "probs2": None}}
    lines = format_sink_rates({"smollm2": base, "zoo-v1": diff, "none": None})
    assert lines == [
        "attention-sink rate (Gu et al. 2024: heads whose mean attention to the first token > 0.3; 100 x 64 tokens)",
        "smollm2  71.6 % of 270 heads",
        "zoo-v1   5.0 % of 12 heads (A1 - lambda A2; components A1 25.0 %)",
    ]
    short = format_sink_rates({"a": base, "b": {**base, "seq_len": 32.0}})
    assert short[0].endswith("> epsilon; probes differ per model)") and short[2].endswith(
        "(eps 0.3, 100 x 32 tokens)"
    )
    assert format_sink_rates({"a": None}) == []


@pytest.mark.parametrize("add_bos", [True, False])
def test_sink_probe_reads_text_as_the_model_does_bos_first_when_its_tokenizer_adds_one(add_bos):
    """Gemma-3-270M: 79.9 % of heads sink on a leading BOS, 0.8 % on a leading text token, so the probe feeds
    64-token sequences as the model reads text: BOS + 63 text tokens when the tokenizer adds a BOS (the byte
    tokenizer, Gemma, Llama), 64 text tokens otherwise (SmolLM2); the rate is the definition's on exactly
    those sequences, and the summary and the printed line say which."""
    import dataclasses

    from diffquant.data import token_windows
    from diffquant.data.tokenizer import ByteTokenizer
    from diffquant.profile.runner import sink_probe
    from diffquant.profile.sinks import format_sink_rates, sink_rate_summary, sink_rates

    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**{**BASE.to_dict(), "vocab_size": 259, "n_layers": 10})).eval()
    tok = dataclasses.replace(ByteTokenizer(), add_bos=add_bos)
    fed = []
    handle = model.embed.register_forward_pre_hook(lambda _m, a: fed.append(a[0].clone()))
    summary = sink_probe(model, "stdlib:validation", tok, batch_size=16)
    handle.remove()
    ids = torch.cat(fed)
    body = token_windows(
        "stdlib:validation", 100 * (63 if add_bos else 64), 63 if add_bos else 64, tok, quiet=True
    )
    want = torch.cat([torch.full((100, 1), 256), body], 1) if add_bos else body
    assert torch.equal(ids, want) and ids.shape == (100, 64)
    assert bool((ids[:, 0] == 256).all()) == add_bos and (add_bos or bool((ids != 256).all()))
    assert summary == {
        **sink_rate_summary(sink_rates(model, want, batch_size=16)),
        "first_token": summary["first_token"],
    }
    assert summary["first_token"] == ("bos" if add_bos else "text") and summary["seq_len"] == 64
    assert format_sink_rates({"m": summary})[1].endswith(", BOS first") == add_bos
