"""Noise a reviewer accepts (issue 49): changes and model differences measured on the same windows get
standard errors paired over those windows; old results fall back to the unpaired rule and say so; retrieval
counts get Wilson / Newcombe score intervals; the degradation figure draws them as error bars and classifies
plans by what they quantize (a weights recipe's ``w4a8-rtn`` is a bar, not an 8-bit point)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from test_plots import _assert_readable
from test_report import _summary, _synthetic_run

from diffquant.plots.noise import (
    PAIRED,
    PAIRED_EACH,
    UNPAIRED,
    Measure,
    Tally,
    newcombe,
    paired_se,
    se_of_change,
    se_of_change_difference,
    se_of_difference,
    wilson,
)

LN2 = math.log(2)
N = 8


def _tally(nats, size=None, tokenizer="bytes") -> Tally:
    size = [200] * len(nats) if size is None else size
    return Tally(tokenizer, tuple(float(x) for x in nats), tuple(s - 1 for s in size), tuple(size))


def _bpb(tally: Tally) -> float:
    return sum(tally.nats) / LN2 / sum(tally.bytes)


def _own_se(tally: Tally) -> float:
    """A cell's own bits_per_byte_stderr: the ratio estimator over its windows (float64, written out)."""
    x, d = np.array(tally.nats, dtype=np.float64) / LN2, np.array(tally.bytes, dtype=np.float64)
    r = x.sum() / d.sum()
    return float(np.sqrt(len(x) / (len(x) - 1) * ((x - r * d) ** 2).sum()) / d.sum())


def _cell(tally: Tally) -> Measure:
    return Measure(_bpb(tally), _own_se(tally), None, tally)


def _windows(seed=0, shift=0.0, jitter=0.0, n=N, size=None):
    """Per-window nats: windows of very different difficulty (the spread an unpaired error sees), plus a
    common shift of ``shift`` bits per byte and per-window jitter of ``jitter`` bits per byte."""
    rng = np.random.default_rng(seed)
    size = np.array([200] * n if size is None else size, dtype=np.float64)
    base = rng.uniform(0.6, 2.4, n) * size * LN2  # 0.6 to 2.4 bits per byte
    return base, rng, size


def test_paired_standard_error_against_float64_formula_where_unpaired_says_noise():
    """A common shift of 0.05 bits per byte on every window: the unpaired rule (the two cells' own spreads
    in quadrature) calls it noise, the paired one (sd of the per-window differences / sqrt(n), n - 1
    degrees of freedom) does not. Equal windows: the plain formula; unequal ones: the ratio estimator."""
    base, rng, size = _windows()
    quant = base + (0.05 + rng.normal(0, 0.004, N)) * size * LN2
    u, q = _tally(base), _tally(quant)
    change = _bpb(q) - _bpb(u)
    per_window = (np.array(q.nats) - np.array(u.nats)) / LN2 / size  # bits per byte, window by window
    expected = per_window.std(ddof=1) / math.sqrt(N)
    got = paired_se("bits_per_byte", [(1.0, _bpb(q), q), (-1.0, _bpb(u), u)])
    assert got == pytest.approx(expected, rel=1e-12)
    spread = se_of_change("bits_per_byte", _cell(q), _cell(u))
    assert spread.basis == PAIRED and spread.windows == N and spread.se == pytest.approx(expected, rel=1e-12)
    unpaired = math.sqrt(_own_se(q) ** 2 + _own_se(u) ** 2)
    assert abs(change) < 2 * unpaired  # unpaired: "within noise"
    assert abs(change) > 2 * got  # paired: beyond
    # without tallies (results from before they were kept) the unpaired rule, named as such
    old = se_of_change("bits_per_byte", Measure(_bpb(q), _own_se(q)), Measure(_bpb(u), _own_se(u)))
    assert old.basis == UNPAIRED and old.se == pytest.approx(unpaired, rel=1e-12)
    # one cell alone: its own standard error (the scorer's bits_per_byte_stderr)
    assert paired_se("bits_per_byte", [(1.0, _bpb(u), u)]) == pytest.approx(_own_se(u), rel=1e-12)

    # windows of unequal size: the ratio estimator of the per-window differences, written out in float64
    sizes = [150, 220, 180, 260, 200, 240, 170, 210]
    base, rng, size = _windows(seed=1, size=sizes)
    quant = base + (0.05 + rng.normal(0, 0.004, N)) * size * LN2
    u, q = _tally(base, sizes), _tally(quant, sizes)
    x = (np.array(q.nats) - np.array(u.nats)) / LN2
    r = x.sum() / size.sum()
    expected = np.sqrt(N / (N - 1) * ((x - r * size) ** 2).sum()) / size.sum()
    assert paired_se("bits_per_byte", [(1.0, _bpb(q), q), (-1.0, _bpb(u), u)]) == pytest.approx(
        expected, rel=1e-12
    )
    # perplexity: the delta method, ppl_q * nats_q - ppl_u * nats_u per window over its targets
    targets = np.array(u.targets, dtype=np.float64)
    ppl_u, ppl_q = math.exp(sum(u.nats) / targets.sum()), math.exp(sum(q.nats) / targets.sum())
    x = ppl_q * np.array(q.nats) - ppl_u * np.array(u.nats)
    r = x.sum() / targets.sum()
    expected = np.sqrt(N / (N - 1) * ((x - r * targets) ** 2).sum()) / targets.sum()
    assert paired_se("perplexity", [(1.0, ppl_q, q), (-1.0, ppl_u, u)]) == pytest.approx(expected, rel=1e-12)
    assert paired_se("acc_norm", [(1.0, 0.5, q), (-1.0, 0.4, u)]) is None  # not a ratio over windows


def test_windows_that_do_not_match_are_not_paired():
    """Another tokenizer (or other windows): model-vs-model differences are not paired; each model's change
    still is, and two models' changes add in quadrature (paired within each model)."""
    base, rng, size = _windows(seed=2)
    ua, qa = _tally(base), _tally(base + 0.3 * size * LN2 + rng.normal(0, 2, N))
    ub = _tally(base * 1.1, tokenizer="other")
    qb = _tally(base * 1.1 + 0.48 * size * LN2 + rng.normal(0, 2, N), tokenizer="other")
    a, b = (
        se_of_change("bits_per_byte", _cell(qa), _cell(ua)),
        se_of_change("bits_per_byte", _cell(qb), _cell(ub)),
    )
    assert a.basis == b.basis == PAIRED
    assert se_of_difference("bits_per_byte", _cell(ua), _cell(ub)).basis == UNPAIRED
    both = se_of_change_difference("bits_per_byte", _cell(qa), _cell(ua), _cell(qb), _cell(ub))
    assert both.basis == PAIRED_EACH and both.se == pytest.approx(math.hypot(a.se, b.se), rel=1e-12)
    # the same windows: all four paired at once
    ub2 = _tally(base * 1.1)
    qb2 = _tally(np.array(qb.nats))
    four = se_of_change_difference("bits_per_byte", _cell(qa), _cell(ua), _cell(qb2), _cell(ub2))
    per_window = (
        (np.array(qa.nats) - np.array(ua.nats) - np.array(qb2.nats) + np.array(ub2.nats)) / LN2 / size
    )
    assert four.basis == PAIRED and four.se == pytest.approx(per_window.std(ddof=1) / math.sqrt(N), rel=1e-12)
    # a window scored differently (bytes): no match
    moved = Tally(ua.tokenizer, ua.nats, ua.targets, (201, *ua.bytes[1:]))  # same targets, a byte more
    assert se_of_difference("bits_per_byte", _cell(ua), _cell(moved)).basis == UNPAIRED
    shifted = Tally(ua.tokenizer, ua.nats, (198, *ua.targets[1:]), ua.bytes)  # same bytes, a target fewer
    assert se_of_difference("bits_per_byte", _cell(ua), _cell(shifted)).basis == UNPAIRED
    assert se_of_change("bits_per_byte", Measure(1.0), Measure(0.9)) is None  # nothing known


def test_wilson_and_newcombe_score_intervals():
    """Wilson's score interval for a count, Newcombe's hybrid score interval (method 10) for a difference of
    two: the published examples, and the closed forms."""
    z = 1.959963984540054
    low, high = wilson(0.0, 10, z)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=5e-5)  # 0 of 10: [0, 0.2775]
    p, n = 0.24, 25
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson(p, n, z) == pytest.approx((center - half, center + half), rel=1e-12)
    # Newcombe (1998), example (a): 56/70 - 48/80, 95 %: 0.0524 to 0.3339
    assert newcombe(56 / 70, 70, 48 / 80, 80, z) == pytest.approx((0.0524, 0.3339), abs=5e-5)
    # the score interval holds chance exactly when the score test at chance does (the near-chance rule)
    for p, n, c in ((0.24, 25, 0.2), (0.96, 25, 0.2), (0.4, 25, 0.2), (0.41, 25, 0.2)):
        lo, hi = wilson(p, n)
        assert (lo <= c <= hi) == (abs(p - c) <= 2 * math.sqrt(c * (1 - c) / n))


def _run_with_windows(tmp_path, shifts, jitter=0.01, keep_windows=True, offsets=None):
    """A synthetic run: models A and B on the same 8 windows (very different difficulty), unquantized (each
    model ``offsets`` bits per byte above the common base) and at attn-logits-int4 with the given common
    shift in bits per byte; results carry each cell's value, own standard error, n_windows and
    (``keep_windows``) the per-window tallies, as a sweep writes them now."""
    base, rng, size = _windows(seed=3)
    tallies = {}
    for model, shift in shifts.items():
        ref = base + (offsets or {}).get(model, 0.0) * size * LN2
        tallies[model] = {
            "none": _tally(ref),
            "attn-logits-int4": _tally(ref + (shift + rng.normal(0, jitter, N)) * size * LN2),
        }
    cells = {
        m: {
            p: {"bits_per_byte": _bpb(t), "bits_per_byte_stderr": _own_se(t), "n_windows": N}
            for p, t in by.items()
        }
        for m, by in tallies.items()
    }
    run = _synthetic_run(
        tmp_path,
        {"bpb": ({"type": "bpb"}, "bits_per_byte", False, cells)},
        plans=("none", "attn-logits-int4"),
    )
    if keep_windows:
        path = run / "sweep" / "results.json"
        results = json.loads(path.read_text())
        results["per_window"] = {
            "bpb": {
                m: {
                    p: {
                        "tokenizer": t.tokenizer,
                        "nats": list(t.nats),
                        "targets": list(t.targets),
                        "bytes": list(t.bytes),
                    }
                    for p, t in by.items()
                }
                for m, by in tallies.items()
            }
        }
        path.write_text(json.dumps(results))
    return run, tallies


def test_report_pairs_changes_and_model_differences_over_windows(tmp_path):
    """The issue's case: int4 costs A +0.30 and B +0.48 bits per byte on the same windows. Paired, the gap
    between the two losses is far beyond noise; the old unpaired rule (the cells' own spreads over very
    different windows) called it noise, and still does, marked unpaired, for results without per-window
    values."""
    run, tallies = _run_with_windows(tmp_path, {"A": 0.30, "B": 0.48})
    text = _summary(run)
    a = _bpb(tallies["A"]["attn-logits-int4"]) - _bpb(tallies["A"]["none"])
    b = _bpb(tallies["B"]["attn-logits-int4"]) - _bpb(tallies["B"]["none"])
    assert f"A loses least at attn-logits-int4 ({a:+.4f}; next B {b:+.4f})" in text
    assert "within noise" not in text.split("### Noise")[0]
    assert (
        "2 of 2 changes vs unquantized are larger than 2 standard errors (paired over the 8 windows" in text
    )
    assert "0 of 2 differences between models at the same plan are smaller than 2 standard errors" in text
    # the unpaired rule on the same cells: within noise, and said to be unpaired
    unpaired = math.sqrt(sum(_own_se(t) ** 2 for by in tallies.values() for t in by.values()))
    assert abs(a - b) < 2 * unpaired
    shutil.rmtree(run)
    run, _ = _run_with_windows(tmp_path, {"A": 0.30, "B": 0.48}, keep_windows=False)
    text = _summary(run)
    assert f"A loses least at attn-logits-int4 ({a:+.4f}; next B {b:+.4f}; within noise)" in text
    assert "unpaired: the results keep no per-window values" in text
    # B is 0.5 bits per byte worse unquantized, and int4 costs both models the same 0.30: at the quantized
    # plan the losses are compared (within noise), not the values (0.5 apart, far beyond it)
    shutil.rmtree(run)
    run, tallies = _run_with_windows(tmp_path, {"A": 0.30, "B": 0.30}, jitter=0.02, offsets={"B": 0.5})
    text = _summary(run)
    a = _bpb(tallies["A"]["attn-logits-int4"]) - _bpb(tallies["A"]["none"])
    b = _bpb(tallies["B"]["attn-logits-int4"]) - _bpb(tallies["B"]["none"])
    first, second = ("A", "B") if a < b else ("B", "A")
    detail = f"{first} loses least at attn-logits-int4 ({min(a, b):+.4f}; next {second} {max(a, b):+.4f}; within noise)"
    assert detail in text
    va, vb = _bpb(tallies["A"]["none"]), _bpb(tallies["B"]["none"])
    assert f"Unquantized, A is best ({va:.4f}; B {vb:.4f})." in text  # 0.5 apart: no "within noise"


def test_sweep_keeps_each_windows_tally_and_old_records_stay_readable(tmp_path):
    """A sweep's text cells keep their per-window tally (cell record and results.json ``per_window``); paired over
    one cell it is the cell's own bits_per_byte_stderr. Records without one (older sweeps) still make
    results, with no ``per_window`` for them."""
    from diffquant.eval.sweep import SweepSpec, read_cells, run_sweep, write_results
    from diffquant.eval.tasks import parse_task

    text = tmp_path / "text.txt"
    text.write_text("".join(f"value_{i} = compute({i}, scale={i % 7})\n" for i in range(200)))
    spec = SweepSpec(
        models={"a": "init:baseline:tiny"},
        plans=["attn-logits-int4"],
        tasks=[parse_task(f"bpb:data={text},tokens=320,seq_len=64")],
    )
    results = run_sweep(spec, tmp_path / "sweep")
    kept = results["per_window"]["bpb"]["a"]
    assert set(kept) == {"none", "attn-logits-int4"}
    rows = {(r["plan"], r["metric"]): r["value"] for r in results["rows"]}
    for plan, raw in kept.items():
        tally = Tally.parse(raw)
        assert len(tally.nats) == rows[(plan, "n_windows")] >= 5
        assert sum(tally.nats) / LN2 == pytest.approx(rows[(plan, "nll_bits")], rel=1e-12)
        assert (
            sum(tally.bytes) == rows[(plan, "n_bytes")]
            and sum(tally.targets) == rows[(plan, "n_tokens_scored")]
        )
        own = paired_se("bits_per_byte", [(1.0, rows[(plan, "bits_per_byte")], tally)])
        assert own == pytest.approx(rows[(plan, "bits_per_byte_stderr")], rel=1e-9)
    records = read_cells(tmp_path / "sweep")
    assert all("per_window" in r for r in records.values())
    for record in records.values():
        del record["per_window"]
    old = write_results(spec, tmp_path / "old", records)
    assert "per_window" not in old and [r["value"] for r in old["rows"]] == [
        r["value"] for r in results["rows"]
    ]


def _weights_results(plans, models=("baseline", "diff_v1"), seed=4):
    """bpb results of ``plans`` (none first) on the same 8 windows per model, with tallies."""
    base, rng, size = _windows(seed=seed)
    rows, windows = [], {}
    for model in models:
        ref = None
        for k, plan in enumerate(plans):
            t = _tally(base + (0.02 * k + rng.normal(0, 0.01, N)) * size * LN2)
            windows.setdefault(model, {})[plan] = {
                "tokenizer": t.tokenizer, "nats": list(t.nats), "targets": list(t.targets), "bytes": list(t.bytes)
            }  # fmt: skip
            value = _bpb(t)
            ref = value if plan == "none" else ref
            for metric, v in (("bits_per_byte", value), ("bits_per_byte_stderr", _own_se(t))):
                rows.append(
                    {"model": model, "attention": model, "plan": plan, "task": "bpb", "metric": metric,
                     "value": v, "unquantized": None, "delta": None}
                )  # fmt: skip
    refs = {r["model"]: r["value"] for r in rows if r["plan"] == "none" and r["metric"] == "bits_per_byte"}
    for r in rows:
        if r["metric"] == "bits_per_byte":
            r["unquantized"], r["delta"] = refs[r["model"]], r["value"] - refs[r["model"]]
    primary = {"bpb": {"metric": "bits_per_byte", "higher_is_better": False}}
    return {"primary": primary, "rows": rows, "per_window": {"bpb": windows}}


def test_degradation_figure_with_a_weights_recipe(monkeypatch):
    """The shipped `weights` recipe's plans (and two attention-logit plans for the bit-width line):
    w4a8-rtn / w4a4-rtn quantize int4 weights through their weights section, so they are bars, never an
    8-bit or 4-bit per-row point; every weights plan has its bar; the long plan names stand apart (turned);
    each bar's error bar is ± 2 paired standard errors of its change."""
    from diffquant.plots import degradation
    from diffquant.plots.degradation import change_intervals, fig_degradation
    from diffquant.quant.plan import preset
    from diffquant.recipes import load_recipe

    weights_plans = load_recipe("weights")["sweep"]["plans"]
    assert "w4a8-rtn" in weights_plans
    names = ["none", "attn-logits-int8", "attn-logits-int4", *weights_plans]
    plans = {p: None if p == "none" else preset(p).to_dict() for p in names}
    results = _weights_results(names)
    sweep = {"models": {"baseline": "x", "diff_v1": "y"}, "plans": plans, "tasks": [{"type": "bpb"}]}
    fig = fig_degradation(results, sweep)
    *curves, bars_ax = fig.axes
    assert [t.get_text() for t in bars_ax.get_xticklabels()] == weights_plans  # w4a8-rtn included
    for ax in curves:  # the bit-width line holds the attention-logit plans only: 4 and 8 bits, then fp
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert [ln.get_label().split(" · ")[1] for ln in lines] == ["per-tensor"]
        (line,) = lines
        assert list(line.get_xdata())[:2] == [4.0, 8.0]
        w4a8 = [
            r["value"] for r in results["rows"] if r["plan"] == "w4a8-rtn" and r["metric"] == "bits_per_byte"
        ]
        assert not set(line.get_ydata()) & set(w4a8)
    assert {t.get_rotation() for t in bars_ax.get_xticklabels()} == {90.0}
    _assert_readable(fig)  # no tick label over another, nothing clipped
    # error bars: ± 2 paired standard errors of each change (float64, from the windows), around each bar's top
    intervals = change_intervals(results, "bpb", "bpb")
    segments = [seg for coll in bars_ax.collections for seg in coll.get_segments()]
    size = np.array([200.0] * N)
    for model in ("baseline", "diff_v1"):
        i = intervals[(model, "w4a8-rtn")]
        assert i.basis == PAIRED and i.windows == N
        q, u = (np.array(results["per_window"]["bpb"][model][p]["nats"]) for p in ("w4a8-rtn", "none"))
        diffs = (q - u) / LN2 / size
        change, two_se = diffs.mean(), 2 * diffs.std(ddof=1) / math.sqrt(N)
        assert any(
            seg[0][1] == pytest.approx(change - two_se, rel=1e-9)
            and seg[1][1] == pytest.approx(change + two_se, rel=1e-9)
            for seg in segments
        ), model
    assert "paired over 8 windows" in fig.get_supxlabel()
    # the readability check sees overlapping labels: the same figure with its labels left level fails it
    monkeypatch.setattr(degradation, "_fit_tick_labels", lambda fig, ax: None)
    with pytest.raises(AssertionError, match="tick labels .* overlap"):
        _assert_readable(fig_degradation(results, sweep))


def test_retrieval_changes_get_score_intervals():
    """Retrieval accuracies over n items with no reported standard error: each change's interval is
    Newcombe's score interval (from the Wilson intervals, z = 2), asymmetric, in the figure and the report."""
    from diffquant.plots.degradation import change_intervals
    from diffquant.report.summary import noise_sentences, task_views

    plans = {"none": None, "attn-logits-int4": None}
    rows = []
    for model, (u, q) in {"a": (0.9, 0.5), "b": (0.3, 0.25)}.items():
        for plan, v in (("none", u), ("attn-logits-int4", q)):
            for metric, value in (("acc_rank", v), ("chance_rank", 0.2), ("n", 40)):
                rows.append(
                    {"model": model, "attention": "baseline", "plan": plan, "task": "retrieval", "metric": metric,
                     "value": value, "unquantized": None, "delta": (q - u) if metric == "acc_rank" and plan != "none" else None}
                )  # fmt: skip
    results = {"primary": {"retrieval": {"metric": "acc_rank", "higher_is_better": True}}, "rows": rows}
    sweep = {"models": {"a": "x", "b": "y"}, "plans": plans, "tasks": [{"type": "retrieval"}]}
    i = change_intervals(results, "retrieval", "retrieval")[("a", "attn-logits-int4")]
    assert (i.low, i.high) == pytest.approx(newcombe(0.5, 40, 0.9, 40), rel=1e-12)
    assert i.excludes_zero and i.center - i.low != pytest.approx(i.high - i.center)
    text = " ".join(noise_sentences(task_views(results, sweep)))
    assert (
        "1 of 2 changes vs unquantized are larger than 2 standard errors (Newcombe's score interval" in text
    )
    lo, hi = wilson(0.9, 40)
    assert f"a at none 0.9000 [{lo:.3f}, {hi:.3f}]" in text
