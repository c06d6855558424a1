"""SiteStats against brute force on the full tensors: exact where the module says exact, within the documented
bounds where it approximates, and split / merge / serialisation invariant."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffquant.kernels import native
from diffquant.models.attention import _valid_mask
from diffquant.profile import stats as stats_mod
from diffquant.profile.sites import layer_of, layout_of, query_positions
from diffquant.profile.stats import N_BINS, QUANTILE_REL_ERROR, SiteStats

QUANTILES = (0.0, 0.001, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0)
COORDS = ("pos", "head", "channel", "key")
FLOAT_STATE = {("moments", "mean"), ("moments", "m2"), ("moments", "m3"), ("moments", "m4")}


# ------------------------------------------------------------------------------------------- inputs
def heavy(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    """Student-t with df 1, 2 or 3 per entry, plus some Cauchy: the heavy tails activations have."""
    rng = np.random.default_rng(seed)
    df = rng.choice([1.0, 2.0, 3.0], size=shape)
    x = rng.standard_t(df)
    cauchy = rng.random(shape) < 0.1
    x[cauchy] = rng.standard_cauchy(int(cauchy.sum()))
    return torch.from_numpy(x * scale).to(torch.float32)


def plant_nonfinite(x: torch.Tensor, seed: int) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:9]
    flat[idx[:4]] = math.nan
    flat[idx[4:7]] = math.inf
    flat[idx[7:]] = -math.inf
    return x


def tokens_for(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 50, (b, t), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------- brute force
def brute(x, kind, site, valid=None, tokens=None, sample_offset=0, positions=None):
    """Every valid finite entry with its location, sorted by (-|x|, site, sample, coordinates)."""
    layout = layout_of(kind, x)
    xn = x.detach().to(torch.float64).numpy()
    vm = np.ones(xn.shape, bool) if valid is None else np.broadcast_to(valid.numpy(), xn.shape)
    finite = np.isfinite(xn)
    ok = finite & vm
    coords = np.indices(xn.shape).reshape(len(layout), -1) if layout else np.zeros((0, 1), int)
    okf = ok.reshape(-1)
    vals = xn.reshape(-1)[okf]
    cols = {d: coords[i][okf] for i, d in enumerate(layout)}
    if "pos" in cols:
        cols["pos"] = np.asarray(positions)[cols["pos"]]
    sample = sample_offset + (cols["batch"] if "batch" in cols else np.zeros(len(vals), int))
    other = [cols[d] for d in layout if d != "batch"]
    order = np.lexsort(tuple(reversed([-np.abs(vals), sample, *other])))
    entries = []
    for i in order:
        loc = {"site": site, "layer": layer_of(site), "sample": int(sample[i])}
        for d in layout:
            if d != "batch":
                loc[d] = int(cols[d][i])
        tok = None
        if tokens is not None and "pos" in loc:
            b, p = int(cols["batch"][i]), loc["pos"]
            if b < tokens.shape[0] and p < tokens.shape[1]:
                tok = int(tokens[b, p])
        loc["token"] = tok
        entries.append({"abs": abs(float(vals[i])), "value": float(vals[i]), "loc": loc})
    out = {
        "vals": vals,
        "entries": entries,
        "nan": int((np.isnan(xn) & vm).sum()),
        "posinf": int((np.isposinf(xn) & vm).sum()),
        "neginf": int((np.isneginf(xn) & vm).sum()),
    }
    if layout:
        reduce = tuple(i for i, d in enumerate(layout) if d not in ("head", "channel"))
        out["absmax"] = np.where(ok, np.abs(xn), 0.0).max(axis=reduce).reshape(-1).tolist()
    if layout and layout[-1] == "channel":
        rows, rows_ok = xn.reshape(-1, xn.shape[-1]), ok.reshape(-1, xn.shape[-1]).all(-1)
        kurt = []
        for row, good in zip(rows, rows_ok, strict=True):
            if good and row.max() > row.min():
                d = row - row.mean()
                kurt.append(np.mean(d**4) / np.mean(d**2) ** 2)
        out["token_kurtosis"] = float(np.mean(kurt)) if kurt else None
        # the rotation papers' kurtosis: each (head,) channel's RMS over every other dim, then over channels
        keep = [i for i, d in enumerate(layout) if d in ("head", "channel")]
        moved = np.moveaxis(xn, keep, list(range(len(keep)))).reshape(
            int(np.prod([xn.shape[i] for i in keep])), -1
        )
        moved_ok = np.moveaxis(ok, keep, list(range(len(keep)))).reshape(moved.shape)
        rms = [
            math.sqrt(sum(v * v for v, g in zip(col, good, strict=True) if g) / good.sum())
            for col, good in zip(moved, moved_ok, strict=True)
            if good.any()
        ]
        out["channel_rms_kurtosis"] = None
        if len(rms) >= 2:
            r = np.array(rms)
            d = r - r.mean()
            if np.mean(d**2) > 0:
                out["channel_rms_kurtosis"] = float(np.mean(d**4) / np.mean(d**2) ** 2)
    return out


def rel_close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def exact_rank_value(abs_sorted: np.ndarray, q: float) -> float:
    return float(np.quantile(abs_sorted, q, method="inverted_cdf"))


def check_against(s: SiteStats, ref: dict, rel: float = 1e-6) -> None:
    """Everything summary() reports, against the brute-force reference (``rel``: the moments' tolerance,
    1e-6 for the torch path's float32 power sums, tighter for the native pass's float64 ones)."""
    vals = ref["vals"]
    sm = s.summary()
    assert sm["count"] == len(vals)
    assert (sm["nan_count"], sm["posinf_count"], sm["neginf_count"]) == (
        ref["nan"],
        ref["posinf"],
        ref["neginf"],
    )
    assert sm["min"] == float(vals.min()) and sm["max"] == float(vals.max())
    # moments (float64 two-pass brute force)
    mu, sd = float(np.mean(vals)), float(np.std(vals))
    assert rel_close(sm["mean"], mu, rel) or abs(sm["mean"] - mu) < 1e-12 * sd
    assert rel_close(sm["std"], sd, rel)
    kurt = float(np.mean((vals - mu) ** 4) / np.mean((vals - mu) ** 2) ** 2)
    assert rel_close(sm["kurtosis"], kurt, rel)
    # channel layouts only (None elsewhere); channel RMS from float32 squares (2^-24 relative) summed in float64
    for got, want in (
        ("channel_rms_kurtosis", "channel_rms_kurtosis"),
        ("token_kurtosis_mean", "token_kurtosis"),
    ):
        if ref.get(want) is None:
            assert sm[got] is None, got
        else:
            assert rel_close(sm[got], ref[want], max(rel, 1e-7) if got == "channel_rms_kurtosis" else rel), (
                got
            )
    # top-k: values and locations exactly
    assert sm["top"] == ref["entries"][: s.topk]
    for k in (1, 2, 3, 10, 100):
        want = ref["entries"][k - 1]["abs"] if k <= min(len(vals), s.topk) else None
        assert sm[f"top{k}"] == want
    # quantiles within the documented bound (0 below the smallest bin edge)
    abs_sorted = np.sort(np.abs(vals))
    for q in QUANTILES:
        exact, got = exact_rank_value(abs_sorted, q), s.quantile(q)
        if exact < stats_mod.bin_edges(stats_mod.I_LO)[0]:
            assert got == 0.0
        else:
            assert abs(got - exact) <= QUANTILE_REL_ERROR * exact * (1 + 1e-9), (q, got, exact)
    assert sm["median"] == s.quantile(0.5) and sm["p999"] == s.quantile(0.999)
    # thresholds
    assert sm["count_abs_ge_6"] == int((np.abs(vals) >= 6.0).sum())
    assert sm["count_abs_gt_100"] == int((np.abs(vals) > 100.0).sum())
    dev = np.abs(vals - mu)
    lo, hi = int((dev > 1.02 * 6 * sd).sum()), int((dev > 0.98 * 6 * sd).sum())
    assert lo <= sm["count_beyond_6sigma"] <= hi
    # massive: candidates = top entries above 100 (cap), massive = above max(100, 1000 x median)
    bar = max(100.0, 1000.0 * sm["median"])
    candidates = [e for e in ref["entries"] if e["abs"] > 100.0][: s.massive_cap]
    assert s._massive == candidates
    assert sm["massive"] == [e for e in candidates if e["abs"] > bar]
    assert sm["massive_truncated"] == (sm["count_abs_gt_100"] > s.massive_cap)
    if not sm["massive_truncated"]:
        assert sm["massive_count"] == int((np.abs(vals) > bar).sum()) and sm["massive_count_exact"]
    # SmoothQuant act_scales
    assert sm["channel_absmax"] == ref.get("absmax")


# -------------------------------------------------------------------------------------- exact cases
def _resid_heavy():
    x = plant_nonfinite(heavy((3, 12, 16), seed=1, scale=3.0), seed=1)
    tokens = tokens_for(3, 14, seed=1)  # positions 14, 15 have no token -> None
    return "layers.2.mlp.out", "resid", x, None, tokens, 5, 4


def _resid_ties():
    x = torch.round(heavy((2, 10, 8), seed=2, scale=2.0))  # integers: many ties and zeros
    x[0, 3] = 0.0  # an all-zero token (skipped by the token kurtosis)
    x[1, 4] = 7.0  # a constant token
    x[1, 5, 2] = math.nan  # a token with a NaN channel
    return "layers.0.resid", "resid", x, None, tokens_for(2, 10, seed=2), 0, 0


def _q_cauchy_bf16():
    x = heavy((2, 3, 7, 8), seed=3).to(torch.bfloat16)
    return "layers.1.attn.q", "q", x, None, tokens_for(2, 30, seed=3), 2, 20


def _head_out_f64():
    x = heavy((2, 5, 3, 4), seed=4).to(torch.float64) * 1e3
    return "layers.1.attn.head_out", "head_out", x, None, None, 0, 3


def _logits_chunk():
    t, s, pos0 = 6, 16, 10
    valid = _valid_mask(t, s, pos0, "cpu")
    x = heavy((2, 3, t, s), seed=5, scale=4.0)
    x = torch.where(valid, x, torch.full_like(x, 1e9))  # masked garbage must not count anywhere
    x[0, 0, 0, 15] = math.nan  # masked: not counted
    x[1, 2, 5, 1] = math.nan  # valid: counted
    x[1, 1, 3, 0] = -math.inf
    return "layers.3.attn.logits", "logits", x, valid, tokens_for(2, 16, seed=5), 7, 0


def _lambda_v2():
    x = heavy((2, 9, 3), seed=6)
    return "layers.0.attn.lambda", "lambda", x, None, tokens_for(2, 9, seed=6), 1, 0


CASES = {
    "resid_heavy": _resid_heavy,
    "resid_ties": _resid_ties,
    "q_cauchy_bf16": _q_cauchy_bf16,
    "head_out_f64": _head_out_f64,
    "logits_chunk": _logits_chunk,
    "lambda_v2": _lambda_v2,
}


def _positions(kind, x, valid, pos_offset):
    layout = layout_of(kind, x)
    if "pos" not in layout:
        return None
    n = x.shape[layout.index("pos")]
    if valid is not None and "key" in layout:  # causal chunk: query i sees keys 0 .. pos0 + i
        pos0 = int(valid.reshape(-1, valid.shape[-2], valid.shape[-1])[0, 0].sum()) - 1
        return np.arange(pos0, pos0 + n)
    return np.arange(pos_offset, pos_offset + n)


@pytest.fixture(params=["default", "tiny_chunks", "torch", "torch_tiny_chunks"])
def scan_sizes(request, monkeypatch):
    """Both update paths (the native pass, the torch one), each also with tiny scan chunks / subset sizes so
    the tie-scanning and subset paths are exercised."""
    if "tiny_chunks" in request.param:
        monkeypatch.setattr(stats_mod, "_SCAN_CHUNK", 7)
        monkeypatch.setattr(stats_mod, "_SUBSET_MIN", 4)
    if "torch" in request.param:
        monkeypatch.setattr(stats_mod, "NATIVE", False)
    return request.param


def _native_calls(monkeypatch) -> list[bool]:
    """Spy on SiteStats._update_native: the list of what each call returned (True: it did the update)."""
    calls: list[bool] = []
    original = SiteStats._update_native

    def spy(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        calls.append(done)
        return done

    monkeypatch.setattr(SiteStats, "_update_native", spy)
    return calls


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("topk", [1, 25, 5000])
def test_exact_against_brute_force(case, topk, scan_sizes, monkeypatch):
    """Every statistic against the brute force, on both paths. The native pass's moments are float64 sums
    (1e-12 of the float64 two-pass reference); the torch path's float32 power sums are held to 1e-6. The float32
    / bf16 cases must really take the native pass (a silent fallback would test the torch path twice)."""
    assert native.available(), "the native pass needs a C compiler on the test machine"
    site, kind, x, valid, tokens, sample_offset, pos_offset = CASES[case]()
    calls = _native_calls(monkeypatch)
    s = SiteStats(site, kind, topk=topk)
    s.update(x, valid=valid, tokens=tokens, sample_offset=sample_offset, pos_offset=pos_offset)
    positions = _positions(kind, x, valid, pos_offset)
    on_native = "torch" not in scan_sizes and x.dtype != torch.float64
    # the map chunk has a NaN / Inf among its visible entries: the masked torch path locates them
    assert any(calls) == (on_native and case != "logits_chunk")
    rel = 1e-12 if any(calls) else 1e-6
    check_against(s, brute(x, kind, site, valid, tokens, sample_offset, positions), rel=rel)


def test_large_tied_input_uses_fast_paths_exactly():
    """128k integer-valued entries: the histogram-bar subset search and the topk path give the brute-force
    top-k; an all-zero tensor (k-th value in the zero bin) goes through the chunked tie scan."""
    x = torch.round(heavy((4, 200, 160), seed=7, scale=0.5))
    s = SiteStats("layers.5.resid", "resid", topk=300)
    s.update(x, tokens=tokens_for(4, 200, seed=7))
    ref = brute(x, "resid", "layers.5.resid", tokens=tokens_for(4, 200, seed=7), positions=np.arange(200))
    assert s.summary()["top"] == ref["entries"][:300]
    z = SiteStats("layers.5.resid", "resid", topk=50)
    z.update(torch.zeros(2, 300, 128), sample_offset=3)
    top = z.summary()["top"]
    assert [(e["loc"]["sample"], e["loc"]["pos"], e["loc"]["channel"]) for e in top] == [
        (3, 0, c) for c in range(50)
    ]
    assert z.quantile(1.0) == 0.0 and z.summary()["token_kurtosis_mean"] is None


@pytest.mark.parametrize("path", ["native", "torch"])
def test_top_k_ties_at_a_bin_edge(monkeypatch, path):
    """The k-th largest magnitude sits exactly on a bin's lower edge (2.0) among ties: the histogram bar is
    that value, so the candidates must include entries equal to it (then the earliest of the ties win)."""
    monkeypatch.setattr(stats_mod, "NATIVE", path == "native")
    x = torch.ones(4, 50, 10)
    x.view(-1)[torch.arange(7, 2000, 97)] = -2.0  # 21 ties at the bar
    x.view(-1)[[300, 1300, 5, 1999, 640]] = 4.0
    s = SiteStats("layers.0.resid", "resid", topk=10)
    s.update(x, tokens=tokens_for(4, 50, seed=9))
    ref = brute(x, "resid", "layers.0.resid", tokens=tokens_for(4, 50, seed=9), positions=np.arange(50))
    assert s.summary()["top"] == ref["entries"][:10]
    assert [e["abs"] for e in s.summary()["top"]] == [4.0] * 5 + [2.0] * 5


def test_massive_activations_planted():
    x = torch.randn(2, 50, 64, generator=torch.Generator().manual_seed(8))
    planted = [(0, 0, 5, 1e4), (0, 17, 5, -1.2e4), (1, 0, 5, 1e4), (1, 30, 40, 2e4), (1, 31, 40, 1e4)]
    for b, p, c, v in planted:
        x[b, p, c] = v
    x[0, 9, 9] = 150.0  # above 100 but not 1000 x median: a candidate, not massive
    s = SiteStats("layers.1.resid", "resid", topk=10)
    s.update(x, sample_offset=10)
    sm = s.summary()
    assert sm["count_abs_gt_100"] == 6 and sm["massive_count"] == 5 and sm["massive_count_exact"]
    got = [(e["loc"]["sample"], e["loc"]["pos"], e["loc"]["channel"], e["value"]) for e in sm["massive"]]
    assert got == [
        (11, 30, 40, 2e4),
        (10, 17, 5, -1.2e4),
        (10, 0, 5, 1e4),
        (11, 0, 5, 1e4),
        (11, 31, 40, 1e4),
    ]
    assert not sm["massive_truncated"]
    capped = SiteStats("layers.1.resid", "resid", topk=10, massive_cap=3)
    capped.update(x, sample_offset=10)
    cm = capped.summary()
    assert cm["massive_truncated"] and not cm["massive_count_exact"] and cm["massive_count"] == 3
    assert cm["massive"] == sm["massive"][:3]


def test_lambda_scalar_stream():
    """DIFF V1's lambda is one scalar per layer and forward: no channel abs-max, locations by sample."""
    values = [0.8, -0.2, 0.8, math.nan, 0.5, math.inf, 0.8]
    s = SiteStats("layers.4.attn.lambda", "lambda", topk=3)
    for i, v in enumerate(values):
        s.update(torch.tensor(v), sample_offset=4 * i)
    sm = s.summary()
    assert (sm["count"], sm["nan_count"], sm["posinf_count"]) == (5, 1, 1)
    assert [(e["value"], e["loc"]) for e in sm["top"]] == [
        (
            float(np.float32(0.8)),
            {"site": "layers.4.attn.lambda", "layer": 4, "sample": sample, "token": None},
        )
        for sample in (0, 8, 24)
    ]
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float32).astype(np.float64)
    assert rel_close(sm["mean"], float(finite.mean()), 1e-12) and rel_close(
        sm["std"], float(finite.std()), 1e-9
    )
    assert sm["channel_absmax"] is None and sm["token_kurtosis_mean"] is None
    v2 = _stats_of("layers.5.attn.lambda", "lambda", torch.ones(1, 2, 3), topk=3, massive_cap=1000)
    with pytest.raises(ValueError, match="no channel abs-max, site 'layers.5.attn.lambda'"):
        s.merge(v2)
    with pytest.raises(ValueError, match="has a channel abs-max, site 'layers.4.attn.lambda'"):
        v2.merge(s)


def test_empty_and_fully_masked_updates():
    s = SiteStats("layers.0.attn.probs", "probs", topk=5)
    s.update(torch.zeros(0, 2, 3, 4))
    s.update(torch.full((1, 2, 3, 4), math.nan), valid=torch.zeros(1, 1, 3, 4, dtype=torch.bool))
    sm = s.summary()
    assert sm["count"] == 0 and sm["nan_count"] == 0 and sm["top"] == [] and sm["top1"] is None
    assert sm["channel_absmax"] == [0.0, 0.0] and sm["median"] is None and sm["count_beyond_6sigma"] is None
    assert s.histogram("abs") == ([], []) and s.to_dict()["min"] is None
    t = SiteStats("layers.0.resid", "resid")
    t.update(torch.zeros(2, 0, 4))
    with pytest.raises(ValueError, match=r"layers.0.resid.*\(4,\) does not match \(0,\)"):
        t.update(torch.zeros(2, 3, 0))
    no_channels = SiteStats("layers.0.resid", "resid")
    no_channels.update(torch.zeros(2, 3, 0))
    assert no_channels.summary()["token_kurtosis_skipped"] == 6
    with pytest.raises(ValueError, match="no statistics"):
        SiteStats.merged([])
    with pytest.raises(ValueError, match="side"):
        t.histogram("both")
    with pytest.raises(ValueError, match="unexpected tensor"):
        t.update(torch.zeros(2, 3))


# --------------------------------------------------------------------------------- split and merge
def _stats_of(site, kind, x, **kw):
    s = SiteStats(site, kind, topk=kw.pop("topk", 20), massive_cap=kw.pop("massive_cap", 5))
    s.update(x, **kw)
    return s


def assert_state_equal(a: dict, b: dict, rel: float = 1e-9) -> None:
    """to_dict equality: exact except the float64 moments, the token-kurtosis sum and the channel sums of
    squares (summation order)."""
    a, b = dict(a), dict(b)
    assert (a["channel_sumsq"] is None) == (b["channel_sumsq"] is None)
    if a["channel_sumsq"] is not None:
        for u, v in zip(a["channel_sumsq"], b["channel_sumsq"], strict=True):
            assert math.isclose(u, v, rel_tol=rel, abs_tol=1e-300), "channel_sumsq"
    a["channel_sumsq"] = b["channel_sumsq"] = None
    for key in ("mean", "m2", "m4"):
        assert math.isclose(a["moments"][key], b["moments"][key], rel_tol=rel, abs_tol=1e-9), key
    # M3 is a signed sum (cancels): its rounding error scales with sum |d|^3 <= sqrt(M2 M4) (Cauchy-Schwarz).
    scale3 = math.sqrt(abs(a["moments"]["m2"] * a["moments"]["m4"]))
    assert abs(a["moments"]["m3"] - b["moments"]["m3"]) <= rel * scale3 + 1e-9, "m3"
    assert math.isclose(a["token_kurtosis"]["sum"], b["token_kurtosis"]["sum"], rel_tol=rel)
    for d in (a, b):
        d["moments"] = {k: v for k, v in d["moments"].items() if k == "n"}
        d["token_kurtosis"] = {k: v for k, v in d["token_kurtosis"].items() if k != "sum"}
    assert a == b


def _cuts(draw_points, n):
    return [0, *sorted(set(p for p in draw_points if 0 < p < n)), n]


def _merge_in(parts, order, tree):
    """Merge ``parts`` (copies) in ``order``: left fold, or pairwise tree (associativity)."""
    parts = [SiteStats.from_dict(parts[i].to_dict()) for i in order]
    if not tree:
        out = SiteStats(
            "layers.2.mlp.out", parts[0].kind, topk=parts[0].topk, massive_cap=parts[0].massive_cap
        )
        for p in parts:
            out.merge(p)
        return out
    while len(parts) > 1:
        parts = [
            parts[i].merge(parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)
        ]
    return parts[0]


RESID = plant_nonfinite(heavy((5, 24, 12), seed=11, scale=40.0), seed=11)
RESID_TOKENS = tokens_for(5, 24, seed=11)


@settings(max_examples=30, deadline=None)
@given(
    bcuts=st.lists(st.integers(0, 5), max_size=3),
    pcuts=st.lists(st.integers(0, 24), max_size=3),
    perm=st.permutations(range(16)),
    tree=st.booleans(),
)
def test_split_merge_equals_one_pass_resid(bcuts, pcuts, perm, tree):
    site, offset = "layers.2.mlp.out", 100
    one = _stats_of(site, "resid", RESID, tokens=RESID_TOKENS, sample_offset=offset)
    parts = []
    bc, pc = _cuts(bcuts, 5), _cuts(pcuts, 24)
    for b0, b1 in zip(bc, bc[1:], strict=False):
        for p0, p1 in zip(pc, pc[1:], strict=False):
            x = RESID[b0:b1, p0:p1]
            parts.append(
                _stats_of(
                    site, "resid", x, tokens=RESID_TOKENS[b0:b1], sample_offset=offset + b0, pos_offset=p0
                )
            )
    order = [i for i in perm if i < len(parts)]
    assert_state_equal(_merge_in(parts, order, tree).to_dict(), one.to_dict())


LOGITS = heavy((3, 2, 12, 12), seed=12, scale=10.0)
LOGITS_VALID = _valid_mask(12, 12, 0, "cpu")


@settings(max_examples=30, deadline=None)
@given(
    bcuts=st.lists(st.integers(0, 3), max_size=2),
    qcuts=st.lists(st.integers(0, 12), max_size=3),
    perm=st.permutations(range(12)),
    tree=st.booleans(),
)
def test_split_merge_equals_one_pass_map_chunks(bcuts, qcuts, perm, tree):
    """Query chunks of a causal map carry their absolute positions in the valid mask."""
    site = "layers.2.mlp.out"
    one = _stats_of(site, "logits", LOGITS, valid=LOGITS_VALID)
    parts = []
    bc, qc = _cuts(bcuts, 3), _cuts(qcuts, 12)
    for b0, b1 in zip(bc, bc[1:], strict=False):
        for q0, q1 in zip(qc, qc[1:], strict=False):
            valid = _valid_mask(q1 - q0, 12, q0, "cpu")
            parts.append(_stats_of(site, "logits", LOGITS[b0:b1, :, q0:q1], valid=valid, sample_offset=b0))
    order = [i for i in perm if i < len(parts)]
    # Map chunks' moments are float32 power sums over each (batch, head) slice's visible entries (the gathered
    # fast path), so another split rounds differently: equal within the documented bound against float64
    # (1e-6; fourth powers of heavy tails carry ~4 float32 roundings), not to float64 rounding.
    assert_state_equal(_merge_in(parts, order, tree).to_dict(), one.to_dict(), rel=1e-6)


def test_merged_pools_sites_and_leaves_inputs_untouched():
    a = _stats_of("layers.0.resid", "resid", heavy((2, 8, 6), seed=13, scale=30.0))
    b = _stats_of("layers.1.resid", "resid", heavy((2, 8, 6), seed=14, scale=30.0))
    before = (a.to_dict(), b.to_dict())
    pooled = SiteStats.merged([a, b], site="kind:resid")
    assert (a.to_dict(), b.to_dict()) == before
    assert pooled.site == "kind:resid" and pooled.count == a.count + b.count
    assert {e["loc"]["site"] for e in pooled.summary()["top"]} == {"layers.0.resid", "layers.1.resid"}
    pooled.merge(a)  # mutating the pool does not reach back into its inputs
    assert (a.to_dict(), b.to_dict()) == before
    assert pooled.summary()["top"][0]["loc"]["site"] == pooled.summary()["top"][1]["loc"]["site"]


def test_merge_rejects_mismatched_channels_and_topk():
    a = _stats_of("layers.0.resid", "resid", torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="layers.0.resid"):
        a.merge(_stats_of("layers.0.mlp_act", "mlp_act", torch.randn(1, 4, 16)))
    with pytest.raises(ValueError, match="topk"):
        a.merge(_stats_of("layers.0.resid", "resid", torch.randn(1, 4, 8), topk=3))
    empty = SiteStats("layers.0.resid", "resid", topk=20, massive_cap=5)
    assert empty.merge(a).to_dict()["channel_absmax"] == a.to_dict()["channel_absmax"]


# ----------------------------------------------------------------------------- serialisation, memory
def test_json_round_trip_is_identical():
    site, kind, x, valid, tokens, so, po = _logits_chunk()
    s = SiteStats(site, kind, topk=30, massive_cap=50)
    s.update(x, valid=valid, tokens=tokens, sample_offset=so, pos_offset=po)
    s.update(x * 1e3, valid=valid, tokens=tokens, sample_offset=so + 2, pos_offset=po)
    d = s.to_dict()
    text = json.dumps(d)
    back = SiteStats.from_dict(json.loads(text))
    assert back.to_dict() == d and json.dumps(back.to_dict()) == text
    assert back.summary() == s.summary()
    assert json.dumps(SiteStats.from_dict(SiteStats("x", "resid").to_dict()).to_dict())


def test_memory_does_not_grow_with_tokens():
    s = SiteStats("layers.0.resid", "resid", topk=10, massive_cap=20)
    sizes = []
    for i in range(50):
        s.update(
            heavy((2, 16, 32), seed=100 + i, scale=50.0), tokens=tokens_for(2, 16, i), sample_offset=2 * i
        )
        d = s.to_dict()
        hist = d.pop("hist")
        sizes.append(len(json.dumps(d)))
        n_bins = len(hist["pos"]) + len(hist["neg"]) + 1
        assert n_bins <= 2 * N_BINS + 1 and s.n_bins <= n_bins
        assert len(json.dumps(hist)) <= 64 + 24 * n_bins  # '"-1234": 123456, ' per bin
    assert len(d["top"]) == 10 and len(d["massive"]) == 20 and len(d["channel_absmax"]) == 32
    assert max(sizes[10:]) <= 1.2 * sizes[9]  # only digits of sample indices / counts change
    state = [vars(s), *(vars(acc) for acc in s._accumulators())]  # SiteStats and its accumulators
    tensors = [v for part in state for v in part.values() if isinstance(v, torch.Tensor)]
    assert [t.numel() for t in tensors] == [32, 32, 32]  # abs-max, sum of squares and count per channel


# ----------------------------------------------------------------------------------- bins, edges
def test_bins_cover_float32_and_quantile_extremes():
    lo, _ = stats_mod.bin_edges(stats_mod.I_LO)
    _, hi = stats_mod.bin_edges(stats_mod.I_HI)
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    assert lo <= tiny < stats_mod.bin_edges(stats_mod.I_LO + 1)[0] and hi > big
    x = torch.tensor([[[0.0, -0.0, 1e-40, -tiny, tiny, big, -big, 1.0, 3.0]]])
    s = SiteStats("resid", "resid")
    s.update(x)
    assert s.zero_count == 3 and s.quantile(0.0) == 0.0 and s.quantile(3 / 9) == 0.0
    for q, exact in ((4 / 9, tiny), (1.0, big), (7 / 9, 3.0), (0.5, tiny), (0.6, 1.0)):
        assert abs(s.quantile(q) - exact) <= QUANTILE_REL_ERROR * exact * (1 + 1e-9)
    assert (
        math.isnan(SiteStats("a", "resid").quantile(0.5))
        and SiteStats("a", "resid").summary()["median"] is None
    )
    with pytest.raises(ValueError):
        s.quantile(1.5)


def test_histogram_edges_and_counts_exact_at_bin_edges():
    """Values exactly on (float32) bin edges land in the bin they open; one ulp below goes one bin down."""
    j = torch.arange(-3000, 3000, 37)
    edges = torch.tensor([stats_mod.bin_edges(int(i))[0] for i in j], dtype=torch.float32)
    below = torch.nextafter(edges, torch.zeros_like(edges))
    s = SiteStats("resid", "resid")
    s.update(torch.cat([edges, -below]).reshape(1, 1, -1))
    assert s._pos == {int(i): 1 for i in j} and s._neg == {int(i) - 1: 1 for i in j}
    (pe, pc), (ne, nc) = s.histogram("pos"), s.histogram("neg")
    assert len(pe) == len(pc) + 1 and sum(pc) == len(j) and sum(nc) == len(j)
    assert pe[0] == float(edges[0]) and ne[0] < float(below[0]) < ne[1]
    signed = s.signed_histogram()
    assert signed["pos"] == (pe, pc) and signed["zero"] == 0
    ae, ac = s.histogram("abs")
    assert sum(ac) == 2 * len(j) and ae[0] == ne[0]


# ------------------------------------------------------------------- fast paths (bit bins, float32 moments)
def test_bin_edges_are_64_per_octave_and_quantile_bound():
    """Edges E_j are float32 numbers within 0.1 % of 2^(j/64); the widest ratio 571/564 gives the bound."""
    assert stats_mod.R == 2 ** (1 / 64) and stats_mod.N_BINS == 254 * 64
    assert pytest.approx(math.sqrt(571 / 564) - 1, rel=1e-12) == QUANTILE_REL_ERROR
    assert QUANTILE_REL_ERROR < 0.00619
    js = range(stats_mod.I_LO, stats_mod.I_HI + 1)
    edges = [stats_mod.bin_edges(j)[0] for j in js] + [stats_mod.bin_edges(stats_mod.I_HI)[1]]
    assert all(float(np.float32(e)) == e for e in edges[:-1]) and edges[-1] == 2.0**128
    ratios = [b / a for a, b in zip(edges, edges[1:], strict=False)]
    assert max(ratios) == 571 / 564 and min(ratios) == 540 / 535
    for j, e in zip(js, edges, strict=False):
        assert abs(math.log2(e) * 64 - j) < 0.1  # figures recover j as round(log(E_j) / LN_R)
        assert round(math.log(e) / stats_mod.LN_R) == j


def test_quantiles_within_bound_wide_range():
    rng = np.random.default_rng(21)
    x = torch.from_numpy(rng.lognormal(0.0, 6.0, size=(4, 100, 64)) * rng.choice([-1, 1], (4, 100, 64)))
    x = x.to(torch.float32)
    s = SiteStats("layers.0.resid", "resid")
    s.update(x)
    a = np.sort(np.abs(x.numpy().astype(np.float64)).reshape(-1))
    for q in np.linspace(0, 1, 101):
        exact = exact_rank_value(a, float(q))
        assert abs(s.quantile(float(q)) - exact) <= QUANTILE_REL_ERROR * exact * (1 + 1e-12)


def test_float64_bins_match_float32_and_resolve_below_edges():
    j = torch.arange(-8000, 8100, 97)
    edges = torch.tensor([stats_mod.bin_edges(int(i))[0] for i in j], dtype=torch.float64)
    below = torch.nextafter(edges, torch.zeros_like(edges))  # not a float32 number: exact in float64 only
    huge = torch.tensor([1e300, -1e300, 1e-300, 2.0**128], dtype=torch.float64)
    s = SiteStats("resid", "resid")
    s.update(torch.cat([edges, -below, huge]).reshape(1, 1, -1))
    top = stats_mod.I_HI
    assert s._neg == {**{int(i) - 1: 1 for i in j}, top: 1} and s.zero_count == 1
    assert s._pos == {**{int(i): 1 for i in j}, top: s._pos[top]} and s._pos[top] == 2
    f32 = SiteStats("resid", "resid")
    f32.update(edges.to(torch.float32).reshape(1, 1, -1))
    g64 = SiteStats("resid", "resid")
    g64.update(edges.reshape(1, 1, -1))
    assert f32.to_dict()["hist"] == g64.to_dict()["hist"]


def test_thresholds_exact_at_6_and_100():
    v = torch.tensor([6.0, -6.0, 100.0, -100.0], dtype=torch.float32)
    lo = torch.nextafter(v, torch.zeros_like(v))
    hi = torch.nextafter(v, v * 2)
    s = SiteStats("layers.0.resid", "resid", topk=3)
    s.update(torch.cat([v, lo, hi]).reshape(1, 3, 4))
    # >= 6: 6, -6, 100, -100 (x3 versions) minus the two just below 6 -> 10; > 100: the two just above 100
    assert s.count_abs_ge_6 == 10 and s.count_abs_gt_100 == 2
    assert [e["value"] for e in s._massive] == [float(hi[2]), float(hi[3])]


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_float32_moments_match_float64_with_outliers(offset):
    """Row-wise float32 centred passes merged in float64 agree with numpy float64 to 1e-6 relative, with
    24,000-magnitude outliers, a large common offset, masks, NaN and zero / constant rows."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(6, 128, 576, generator=g) * 0.5 + offset
    x[:, :, 17] *= 400.0
    x[0, 3, 5], x[2, 9, 100], x[5, 127, 0] = 24000.0, -24000.0, 18000.0
    x[1, 4] = 0.0
    x[1, 5] = 3.25
    x[3, 7, 9] = math.nan
    s = SiteStats("layers.3.resid", "resid", topk=50)
    s.update(x, tokens=tokens_for(6, 128, 22))
    ref = brute(x, "resid", "layers.3.resid", tokens=tokens_for(6, 128, 22), positions=np.arange(128))
    check_against(s, ref)


def test_tiny_and_huge_scales_fall_back_exactly():
    """Rows whose float32 powers would underflow / overflow are redone in float64."""
    g = torch.Generator().manual_seed(23)
    for scale in (1e-18, 1e-30, 1e9, 1e15):
        x = torch.randn(2, 8, 64, generator=g) * scale
        s = SiteStats("layers.0.resid", "resid")
        s.update(x)
        check_against(s, brute(x, "resid", "layers.0.resid", positions=np.arange(8)))


def test_blocked_passes_equal_one_block(monkeypatch):
    """Tiny blocks (rows, histogram, extremes split into many blocks) give the same state as one block."""
    site, kind, x, valid, tokens, so, po = _logits_chunk()
    one = SiteStats(site, kind, topk=30)
    one.update(x, valid=valid, tokens=tokens, sample_offset=so, pos_offset=po)
    monkeypatch.setattr(stats_mod, "_BLOCK", 5)
    many = SiteStats(site, kind, topk=30)
    many.update(x, valid=valid, tokens=tokens, sample_offset=so, pos_offset=po)
    assert_state_equal(many.to_dict(), one.to_dict(), rel=0.0)
    check_against(many, brute(x, kind, site, valid, tokens, so, _positions(kind, x, valid, po)))


def test_large_map_chunks_merge_equals_one_pass():
    """A causal map split into query chunks (each with its own mask) merges into the one-pass state."""
    g = torch.Generator().manual_seed(24)
    t = 96
    x = torch.randn(2, 3, t, t, generator=g) * 4.0
    x[1, 2, 50, 10] = 500.0
    x[0, 1, 70, 3] = math.inf
    one = _stats_of("layers.1.attn.logits", "logits", x, valid=_valid_mask(t, t, 0, "cpu"), topk=40)
    parts = [
        _stats_of(
            "layers.1.attn.logits",
            "logits",
            x[:, :, q0 : q0 + 32],
            valid=_valid_mask(32, t, q0, "cpu"),
            topk=40,
        )
        for q0 in range(0, t, 32)
    ]
    merged = SiteStats.merged(parts, site="layers.1.attn.logits")
    assert_state_equal(merged.to_dict(), one.to_dict(), rel=1e-6)  # float32 map moments, see the map test
    ref = brute(x, "logits", "layers.1.attn.logits", _valid_mask(t, t, 0, "cpu"), positions=np.arange(t))
    check_against(one, ref)


def _finite_map(dtype=torch.float32, t=24, s=40, pos0=16, seed=25):
    """A finite causal map chunk whose masked entries hold garbage (NaN, Inf, huge): the gathered fast path
    must ignore them exactly like the masked general path."""
    valid = _valid_mask(t, s, pos0, "cpu")
    x = heavy((3, 4, t, s), seed=seed, scale=30.0)
    x[2, 1, 7, 3] = 2500.0  # massive candidates
    x[0, 3, 20, 35] = -180.0
    x[1, 2, 4, 9] = x[0, 0, 11, 2] = 77.0  # a tie
    garbage = torch.tensor([math.nan, math.inf, -math.inf, 1e30])[torch.arange(x.numel()) % 4].view(x.shape)
    x = torch.where(valid, x, garbage).to(dtype)
    return x, valid, tokens_for(3, s + 4, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("topk", [1, 30, 4000])
def test_map_fast_path_equals_general_path_and_brute_force(monkeypatch, dtype, topk):
    x, valid, tokens = _finite_map(dtype)
    fast = SiteStats("layers.2.attn.logits1", "logits", topk=topk, massive_cap=3)
    fast.update(x, valid=valid, tokens=tokens, sample_offset=9)
    monkeypatch.setattr(stats_mod, "FAST", False)
    slow = SiteStats("layers.2.attn.logits1", "logits", topk=topk, massive_cap=3)
    slow.update(x, valid=valid, tokens=tokens, sample_offset=9)
    assert_state_equal(fast.to_dict(), slow.to_dict(), rel=1e-6)
    positions = _positions("logits", x, valid, 0)
    check_against(fast, brute(x, "logits", "layers.2.attn.logits1", valid, tokens, 9, positions))


def test_map_fast_path_declines_what_it_cannot_do(monkeypatch):
    """A visible NaN, a mask that differs per head, or nothing visible: the general path runs (same state)."""
    x, valid, tokens = _finite_map()
    per_head = valid.expand(3, 4, -1, -1).clone()
    per_head[:, 1, 5, 0] = False
    nan_visible = x.clone()
    nan_visible[1, 1, 20, 0] = math.nan
    nothing = torch.zeros_like(valid)
    for data, mask in ((nan_visible, valid), (x, per_head), (x, nothing)):
        calls = []
        original = SiteStats._update_map

        def spy(self, *args, _orig=original, _calls=calls):
            done = _orig(self, *args)
            _calls.append(done)
            return done

        monkeypatch.setattr(SiteStats, "_update_map", spy)
        fast = _stats_of("layers.0.attn.logits", "logits", data, valid=mask, tokens=tokens)
        monkeypatch.setattr(SiteStats, "_update_map", original)
        assert calls == [False]
        monkeypatch.setattr(stats_mod, "FAST", False)
        slow = _stats_of("layers.0.attn.logits", "logits", data, valid=mask, tokens=tokens)
        monkeypatch.setattr(stats_mod, "FAST", True)
        assert_state_equal(fast.to_dict(), slow.to_dict(), rel=0.0)
        if mask.any():
            positions = _positions("logits", data, mask, 0)
            check_against(fast, brute(data, "logits", "layers.0.attn.logits", mask, tokens, 0, positions))


def test_state_version_refused():
    d = _stats_of("layers.0.resid", "resid", torch.randn(1, 4, 8)).to_dict()
    assert d["version"] == stats_mod.STATE_VERSION == 2
    old = dict(d, version=1, hist=dict(d["hist"], base=1.02))
    with pytest.raises(ValueError, match="unsupported statistics state"):
        SiteStats.from_dict(old)


# ------------------------------------------------------------------------ the extreme in the first batch
def test_every_statistic_keeps_an_extreme_of_the_first_batch():
    """A resid site fed three batches whose outliers (one massive 500 at channel 3, a -250, values >= 6, a
    NaN) come in the FIRST (the last adds one 120): every statistic equals numpy's over the three batches together. An
    accumulator that kept only the last batch (or replaced instead of adding) loses them and fails."""
    rng = np.random.default_rng(5)
    batches = [torch.from_numpy(rng.standard_normal((2, 6, 8))).float() for _ in range(3)]
    first = batches[0]
    first[0, 1, 3], first[1, 4, 5], first[1, 0, 0] = 500.0, -250.0, math.nan
    first[0, 2, :] = torch.tensor([7.0, -8.0, 6.5, 9.0, -6.0, 6.0, 11.0, -12.0])
    batches[2][1, 5, 7] = 120.0  # one more |x| > 100 later: counts must add, not restart
    s = SiteStats("layers.0.resid", "resid", topk=5, massive_cap=10)
    for i, b in enumerate(batches):
        s.update(b, sample_offset=2 * i)
    got = s.summary()

    xs = torch.cat(batches).double().numpy()
    finite = xs[np.isfinite(xs)]
    mags = np.sort(np.abs(finite))[::-1]
    assert got["count"] == finite.size and got["nan_count"] == 1
    assert got["first_nonfinite"]["loc"]["sample"] == 1
    assert got["max"] == finite.max() == 500.0 and got["min"] == finite.min() == -250.0
    # moments: float32 passes combined in float64, within the module's documented ~1e-7 (tested to 1e-6)
    assert got["mean"] == pytest.approx(finite.mean(), rel=1e-6)
    assert got["std"] == pytest.approx(finite.std(), rel=1e-6)
    assert [e["abs"] for e in got["top"]] == pytest.approx(mags[:5].tolist())
    assert got["top"][0]["loc"]["sample"] == 0 and got["top"][0]["loc"]["channel"] == 3
    chan = np.nanmax(np.abs(np.where(np.isfinite(xs), xs, 0.0)), axis=(0, 1))
    assert got["channel_absmax"] == pytest.approx(chan.tolist())
    assert got["count_abs_ge_6"] == int((np.abs(finite) >= 6).sum())
    assert got["count_abs_gt_100"] == int((np.abs(finite) > 100).sum()) == 3
    assert got["median"] == pytest.approx(
        float(np.quantile(mags, 0.5, method="inverted_cdf")), rel=QUANTILE_REL_ERROR
    )
    assert s.quantile(1.0) == pytest.approx(500.0, rel=QUANTILE_REL_ERROR)


# ------------------------------------------------------------------------ fused pass vs the plain path
def _set_fused(monkeypatch, on: bool) -> None:
    """The torch path, fused or plain (the native pass off: it has its own tests below)."""
    from diffquant.profile import accumulators

    monkeypatch.setattr(stats_mod, "NATIVE", False)
    monkeypatch.setattr(stats_mod, "FUSED", on)
    monkeypatch.setattr(accumulators, "FUSED", on)


def _fused_cases(dtype: torch.dtype) -> list[tuple[str, str, list[tuple[torch.Tensor, torch.Tensor | None]]]]:
    """Real-shaped chunks of the small preset (resid (B, 256, 256), mlp_act (B, 256, 672), q heads, a causal
    logits map (B, 8, 256, 256) with garbage under the mask), three batches each: the extremes (a 900, a
    -700, the top-k) in the FIRST batch, a NaN / Inf in the second (the masked general path), then a plain
    one."""
    cases = []
    valid = _valid_mask(256, 256, 0, "cpu")
    shapes = {
        "resid": (2, 256, 256),
        "mlp_act": (2, 256, 672),
        "q": (2, 8, 256, 32),
        "logits": (2, 8, 256, 256),
    }
    for n, (kind, shape) in enumerate(shapes.items()):
        batches = []
        for b in range(3):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(40 + 3 * n + b))
            x[..., 3] *= 40.0  # an outlier channel (key 3 of the map)
            if b == 0:
                x.view(-1)[[5, 77, 1000]] = torch.tensor([900.0, -700.0, 150.0])
            if b == 1:
                x.view(-1)[[3, 9, 4000]] = torch.tensor([math.nan, math.inf, -math.inf])
            m = None
            if kind == "logits":
                m = valid
                x = torch.where(valid, x, torch.tensor(math.nan))  # garbage where masked
            batches.append((x.to(dtype), m))
        site = {"resid": "layers.1.resid", "mlp_act": "layers.1.mlp.act", "q": "layers.1.attn.q"}
        cases.append((site.get(kind, "layers.1.attn.logits1"), kind, batches))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_pass_equals_the_plain_path_bit_for_bit(monkeypatch, dtype):
    """Every statistic of the fused pass (blocked float64 row sums, dense histogram merges) is the plain
    path's, bit for bit: the to_dict states of updates and of per-batch states merged are equal as JSON, on
    real-shaped chunks with the maximum in the first batch, NaN / Inf and a masked map; and with blocks small
    enough that a map's rows split into several (one a folded one-row tail)."""
    tokens = tokens_for(2, 256, seed=1)

    cases = _fused_cases(dtype)

    def run(cases=cases) -> str:
        out = [[d.to_dict(), m.to_dict(), d.summary()] for d, m in _direct_and_merged(cases, tokens)]
        return json.dumps(out, sort_keys=True)

    _set_fused(monkeypatch, True)
    fused = run()
    monkeypatch.setattr(stats_mod, "_SUM_BLOCK", 7 * 32896 + 5)  # 16 map rows -> blocks of 7, 7 and 2
    fused_small_blocks = run(cases[-1:])
    monkeypatch.setattr(stats_mod, "_SUM_BLOCK", 5 * 32896)  # blocks of 5, 5, 6 (a one-row tail folded)
    fused_tail = run(cases[-1:])
    _set_fused(monkeypatch, False)
    plain = run()
    assert fused == plain
    assert fused_small_blocks == fused_tail == run(cases[-1:])
    state = json.loads(fused)[0][0]  # the first batch's extremes survived the later ones
    assert state["max"] == 900.0 and state["min"] == -700.0 and state["nan_count"] == 1


def test_row_blocks_never_leave_a_one_row_block():
    assert stats_mod._row_blocks(3, 1 << 20) == [(0, 3)]
    for n_rows in range(1, 40):
        blocks = stats_mod._row_blocks(n_rows, stats_mod._SUM_BLOCK // 5)
        assert blocks[0][0] == 0 and blocks[-1][1] == n_rows
        assert all(a == prev_b for (a, _), (_, prev_b) in zip(blocks[1:], blocks[:-1], strict=True))
        assert len(blocks) == 1 or all(b - a >= 2 for a, b in blocks)


def test_fused_histogram_merge_adds_pending_and_folded_counts(monkeypatch):
    """A merge of states that hold both folded (read) and pending (dense) counts: the fused merge gives the
    plain merge's histogram, and leaves the merged-in state untouched when the target is updated again."""
    from diffquant.profile import accumulators

    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(4, 64, 32, generator=gen) * (1 + 3 * i) for i in range(5)]

    def state(parts):
        s = SiteStats("layers.0.resid", "resid")
        for x in parts:
            s.update(x)
            if x is parts[0]:
                s.to_dict()  # fold the first update's counts into the dicts; later ones stay pending
        return s

    out = []
    for fused in (True, False):
        monkeypatch.setattr(accumulators, "FUSED", fused)
        a, b, c = state(xs[:2]), state(xs[2:4]), SiteStats("layers.0.resid", "resid")
        c.merge(b)  # target without a pending histogram
        a.merge(b)
        pending = b._hist._pending  # the plain merge folded it (None); the fused one must not alias it
        before = None if pending is None else pending.clone()
        a.update(xs[4])
        c.update(xs[4])
        assert (pending is None) == (not fused)
        assert pending is None or torch.equal(pending, before)
        out.append(json.dumps([a.to_dict()["hist"], c.to_dict()["hist"]]))
    assert out[0] == out[1]


# ------------------------------------------------------------------------ the native pass
def _native_cases() -> list[tuple[str, str, list[tuple[torch.Tensor, torch.Tensor | None]]]]:
    """_fused_cases (float32 and bf16) plus a head_out chunk (heads before channels) and a causal map
    chunk of later queries whose masked entries hold NaN garbage."""
    cases = _fused_cases(torch.float32) + _fused_cases(torch.bfloat16)[:1]
    gen = torch.Generator().manual_seed(77)
    head_out = [(torch.randn(2, 64, 8, 32, generator=gen) * (1 + 20 * b), None) for b in range(2)]
    cases.append(("layers.0.attn.head_out", "head_out", head_out))
    valid = _valid_mask(40, 100, 60, "cpu")
    late = torch.randn(2, 8, 40, 100, generator=gen) * 8.0
    late[1, 3, 39, 0] = 400.0  # massive, on key 0
    cases.append(("layers.2.attn.probs", "probs", [(torch.where(valid, late, math.nan), valid)]))
    window = _valid_mask(40, 100, 60, "cpu", window=16)  # sliding window: rows start past key 0
    local = torch.randn(2, 4, 40, 100, generator=gen) * 5.0
    local[0, 2, 10, 60] = -300.0  # visible (query 70 sees keys 55 .. 70); a masked 900 must not count
    local[1, 1, 5, 3] = 900.0
    cases.append(
        ("layers.3.attn.logits", "logits", [(torch.where(window, local, local * 0 + 900.0), window)])
    )
    return cases


def _direct_and_merged(cases, tokens) -> list[tuple[SiteStats, SiteStats]]:
    """Each case's batches folded into one SiteStats directly, and into fresh ones merged (merge = update)."""
    out = []
    for site, kind, batches in cases:
        direct = SiteStats(site, kind, topk=30, massive_cap=5)
        merged = SiteStats(site, kind, topk=30, massive_cap=5)
        for b, (x, valid) in enumerate(batches):
            direct.update(x, valid=valid, tokens=tokens, sample_offset=2 * b)
            fresh = SiteStats(site, kind, topk=30, massive_cap=5)
            fresh.update(x, valid=valid, tokens=tokens, sample_offset=2 * b)
            merged.merge(fresh)
        out.append((direct, merged))
    return out


def _states(cases, tokens) -> list:
    return [(d.to_dict(), m.to_dict()) for d, m in _direct_and_merged(cases, tokens)]


def test_native_pass_equals_the_torch_path(monkeypatch):
    """On real-shaped chunks (the maximum in the first batch, NaN / Inf in the second, heads before
    channels, masked causal maps read in place) the native pass's state is the torch path's: every count,
    extreme, histogram bin, abs-max and located entry (top-k, massive, first non-finite) bit for bit; the
    moments, token kurtosis and channel sums of squares within the torch path's float32 bound."""
    tokens = tokens_for(2, 256, seed=1)
    cases = _native_cases()
    calls = _native_calls(monkeypatch)
    got = _states(cases, tokens)
    assert sum(calls) >= 16  # every chunk but the NaN ones of the map (general path) went native
    monkeypatch.setattr(stats_mod, "NATIVE", False)
    want = _states(cases, tokens)
    for (site, _, _), (g_direct, g_merged), (w_direct, w_merged) in zip(cases, got, want, strict=True):
        assert_state_equal(g_direct, w_direct, rel=1e-6), site
        assert_state_equal(g_merged, w_merged, rel=1e-6), site


def _float64_moments(x: torch.Tensor, valid: torch.Tensor | None) -> tuple[float, float, float, float]:
    v = x.double()
    keep = torch.isfinite(v) if valid is None else torch.isfinite(v) & valid
    vals = v[keep.expand(v.shape)].numpy()
    d = vals - vals.mean()
    return vals.mean(), (d**2).sum(), (d**3).sum(), (d**4).sum()


def test_native_moments_are_float64_sums():
    """The native pass's central sums are float64 (only summation order differs from a float64 two-pass
    computation): 1e-12 relative on heavy-tailed real-shaped chunks, where the torch path's float32 power
    sums are off by ~1e-8 (so a native pass that silently fell back would fail here)."""
    for site, kind, batches in _native_cases():
        x, valid = batches[0]
        s = SiteStats(site, kind)
        s.update(x, valid=valid)
        mean, m2, m3, m4 = _float64_moments(x, valid)
        got = s.to_dict()["moments"]
        assert rel_close(got["mean"], mean, 1e-12) or abs(got["mean"] - mean) < 1e-14 * math.sqrt(m2), site
        assert rel_close(got["m2"], m2, 1e-12), site
        assert abs(got["m3"] - m3) <= 1e-12 * math.sqrt(m2 * m4), site
        assert rel_close(got["m4"], m4, 1e-12), site


def test_native_pass_does_not_depend_on_the_thread_count():
    """1, 2 and 3 threads give the same state bit for bit (row sums in a fixed lane order, per-channel sums
    over fixed row segments), so a profile does not change with the machine's core count."""
    tokens = tokens_for(2, 256, seed=1)
    cases = _native_cases()
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(json.dumps(_states(cases, tokens), sort_keys=True))
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1] == runs[2]


def test_native_map_chunks_merge_to_the_one_pass_state():
    """A causal map read in place has one row per query, so query chunks give the one-pass chunk's rows:
    merged moments equal the one-pass ones to float64 rounding (the gathered torch path groups rows by
    (batch, head) slice and only agrees to 1e-6)."""
    x = heavy((2, 3, 24, 24), seed=21, scale=6.0)
    one = _stats_of("layers.0.attn.logits", "logits", x, valid=_valid_mask(24, 24, 0, "cpu"))
    merged = SiteStats("layers.0.attn.logits", "logits", topk=one.topk, massive_cap=one.massive_cap)
    for q0, q1 in ((0, 5), (5, 17), (17, 24)):
        valid = _valid_mask(q1 - q0, 24, q0, "cpu")
        merged.merge(_stats_of("layers.0.attn.logits", "logits", x[:, :, q0:q1], valid=valid))
    assert_state_equal(merged.to_dict(), one.to_dict(), rel=1e-12)


def test_native_pass_without_a_compiler_leaves_the_torch_path(monkeypatch, tmp_path):
    """No working C compiler (CC=false): the library is None, nothing is cached, and SiteStats gives the torch
    path's state."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DIFFQUANT_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_TRIED", False)
    monkeypatch.setattr(native, "_LIB", None)
    assert native.library() is None and not native.available()
    assert not list(tmp_path.rglob("*.so"))
    x = heavy((2, 16, 24), seed=3, scale=5.0)
    got = _stats_of("layers.0.resid", "resid", x).to_dict()
    monkeypatch.setattr(stats_mod, "NATIVE", False)
    assert json.dumps(got) == json.dumps(_stats_of("layers.0.resid", "resid", x).to_dict())


def test_unravel_on_the_host_is_torch_unravel_index():
    """The located entries' coordinates are unravelled on the host (one transfer from a GPU): torch's own
    unravel_index's, for 1- to 4-dim shapes with ones among the sizes."""
    from diffquant.profile.stats import _unravel

    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 5), (1, 4, 6), (2, 1, 3, 9), (5, 7, 1, 1)]:
        n = math.prod(shape)
        idx = torch.randint(0, n, (20,), generator=g)
        want = torch.stack(torch.unravel_index(idx, shape), 1).tolist()
        assert [_unravel(int(i), shape) for i in idx] == want, shape


# ------------------------------------------------------------------ small results in one transfer (GPU)
def _bundled_cases():
    """Unmasked updates for the one-transfer path, with the cases that make it decide after its read:
    magnitudes beyond float32's squaring range (squares again in float64), constant and tiny-variance rows
    (float32 moments redone in float64), a NaN (the general path takes over), float64 rows in several
    blocks (no rows to redo), and the gathered causal map."""
    g = torch.Generator().manual_seed(31)
    huge = torch.randn(2, 9, 24, generator=g)
    huge[1, 4, 7] = 2.0**62
    flat_rows = torch.randn(2, 9, 24, generator=g)
    flat_rows[0, 3] = 3.0  # a constant row: M2 == 0
    flat_rows[1, 5] = 1e6 + torch.arange(24) * 1e-12  # variance below float32's reach
    nan = torch.randn(2, 9, 24, generator=g)
    nan[0, 2, 5] = math.nan
    cases = {name: CASES[name]() for name in sorted(CASES)}
    return {
        **{name: (c[0], c[1], c[2], c[3], c[4]) for name, c in cases.items() if c[3] is None},
        "huge": ("layers.1.resid", "resid", huge, None, tokens_for(2, 9, seed=1)),
        "flat_rows": ("layers.1.mlp.act", "mlp_act", flat_rows, None, tokens_for(2, 9, seed=2)),
        "nan": ("layers.1.resid", "resid", nan, None, None),
        "f64_blocks": ("layers.0.q", "q", heavy((2, 4, 30, 16), seed=5).double(), None, None),
        "map": ("layers.2.attn.logits1", "logits", *_finite_map()),
    }


def test_a_row_of_one_entry_needs_no_float64_redo():
    """A row with one counted entry (DIFF V1's 0-d lambda, a one-wide row, a masked row with one kept key)
    gets the float64 redo's moments bit for bit from the float32 pass (mean = the value, M2 = M3 = M4 = 0),
    so it is not flagged for the redo, which on a GPU reads twice more; a non-finite one and a constant
    row of two entries still are."""
    one_wide = torch.tensor([[0.3], [-7.25e-30], [3.0e38], [0.0], [-2.5]])
    n, s, m2, m3, m4, again = stats_mod._row_moments_parts(one_wide, None)
    assert not again.any()
    want = stats_mod._row_moments_block(one_wide.double(), None)
    for got, ref in zip((n, s, m2, m3, m4), want, strict=True):
        assert torch.equal(got, ref)
    rows = torch.tensor([[1.5, 9.0, -4.0], [2.0, 2.0, 7.0], [math.inf, 1.0, 1.0], [5.0, 6.0, 7.0]])
    ok = torch.tensor([[True, False, False], [True, True, False], [True, False, False], [False] * 3])
    *parts, again = stats_mod._row_moments_parts(rows, ok)
    assert again.tolist() == [False, True, True, False]  # one key; a constant pair; inf; no key
    want = stats_mod._row_moments_block(rows.double(), ok)
    for got, ref in zip(parts, want, strict=True):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[3], ref[3])


@pytest.mark.parametrize("case", sorted(_bundled_cases()))
def test_one_transfer_path_is_the_general_torch_path(case, monkeypatch):
    """The torch path's update that reads its small results in one transfer (stats.BUNDLED, what a GPU runs)
    gives the state of the path that reads each where it is needed, bit for bit, in every case that makes it
    decide after its read; it declines only a non-finite value (the shared cases that hold one, "nan")."""
    monkeypatch.setattr(stats_mod, "NATIVE", False)
    monkeypatch.setattr(stats_mod, "_BLOCK", 64)  # rows in several blocks
    site, kind, x, valid, tokens = _bundled_cases()[case]
    ran = []
    read = stats_mod._read_small
    monkeypatch.setattr(stats_mod, "_read_small", lambda *a: ran.append(r := read(*a)) or r)
    one = _stats_of(site, kind, x, valid=valid, tokens=tokens, topk=7, massive_cap=3)
    finite = bool(torch.isfinite(x if valid is None else torch.where(valid, x, 0)).all())
    assert len(ran) == 1 and (ran[0] is None) == (not finite)
    monkeypatch.setattr(stats_mod, "BUNDLED", False)
    each = _stats_of(site, kind, x, valid=valid, tokens=tokens, topk=7, massive_cap=3)
    assert_state_equal(one.to_dict(), each.to_dict(), rel=0.0)
    if case == "huge":
        assert one.summary()["max"] == 2.0**62 and one.to_dict()["channel_sumsq"] is not None


@pytest.mark.parametrize(
    "case", ["normal", "ties", "zeros", "excluded", "bf16", "chunks", "one", "huge_and_tiny"]
)
def test_top_by_key_is_the_exact_top_k_of_the_total_order(case, monkeypatch):
    """The device top-k (packed keys, no host wait) returns the entries the total order (-|x|, flat index)
    ranks first: against a brute-force sort in Python and against the host search (_select)."""
    g = torch.Generator().manual_seed(3)
    n, k = 5000, 20
    af = torch.randn(n, generator=g).abs()
    if case == "ties":
        af = (af * 4).round() / 4  # a few distinct values, each held by hundreds of entries
    elif case == "zeros":
        af = torch.zeros(n)
    elif case == "excluded":  # only 7 entries count; the -1s are masked out
        af = torch.full((n,), -1.0)
        af[torch.randperm(n, generator=g)[:7]] = torch.tensor([0.0, 0.0, 2.0, 1.0, 2.0, 0.5, 3.0])
    elif case == "bf16":
        af = af.to(torch.bfloat16)
    elif case == "chunks":  # ties across chunk boundaries
        monkeypatch.setattr(stats_mod, "_KEY_CHUNK", 64)
        af = (af * 2).round()
    elif case == "one":
        k = 1
    elif case == "huge_and_tiny":
        af = af * torch.logspace(-40, 37, n)  # subnormals to 1e37
    n_ok = int((af > -0.5).sum())
    want = sorted((i for i in range(n) if float(af[i]) > -0.5), key=lambda i: (-float(af[i]), i))[:k]
    got = stats_mod._top_by_key(af, min(k, n_ok))
    assert got.tolist() == want
    host = stats_mod._select(af.float(), k, -0.5, n_ok)
    assert sorted(host.tolist(), key=lambda i: (-float(af[i]), i)) == want


def test_views_of_one_mask_share_its_positions_only_at_one_place(monkeypatch):
    """Each layer slices its own view of the model's one mask: a view at the same place in it (offset, shape,
    strides) reuses what was read, a view of other rows (a later query chunk: same shape, another offset)
    reads its own, and both are the positions read off that view directly."""
    monkeypatch.setattr(stats_mod, "_last_mask", None)
    whole = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    first = stats_mod._mask_positions(whole[:, :, 0:4], whole[0, 0, 0:4])
    assert stats_mod._mask_positions(whole[:, :, 0:4], whole[0, 0, 0:4]) is first
    later = stats_mod._mask_positions(whole[:, :, 4:8], whole[0, 0, 4:8])
    assert later is not first
    for got, rows in ((first, slice(0, 4)), (later, slice(4, 8))):
        assert torch.equal(got.visible, whole[0, 0, rows].reshape(-1).nonzero().squeeze(1))
        assert got.qpos == query_positions(whole[:, :, rows]).tolist()
    assert later.qpos == [4, 5, 6, 7] and first.qpos == [0, 1, 2, 3]


def test_a_gathered_map_reads_its_mask_again_after_an_in_place_change(monkeypatch):
    """A layer's map taps share one mask object, so its visible and query positions are read once per
    object; an in-place change to the mask (its version counter) reads them again."""
    monkeypatch.setattr(stats_mod, "NATIVE", False)  # the gathered torch path (what CUDA maps take)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]

    def state(mask: torch.Tensor) -> str:
        site = SiteStats("layers.0.attn.logits", "logits", topk=5)
        site.update(x, mask)
        return json.dumps(site.to_dict())

    causal = state(valid)
    assert state(valid) == causal
    valid[..., 5, 0] = False  # a sliding window of 5 for the last query
    windowed = state(valid)
    assert windowed == state(valid.clone()) != causal
