"""Seed groups (issue 30): mean +- spread over seeds and the pooled-noise comparison, against the statistics
module and hand computation; a run of a recipe with seed groups writes and prints them."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
import yaml

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.report import seeds
from diffquant.report.seeds import Spread, seed_groups


@pytest.fixture()
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}  # comment {i * i}\n" for i in range(400)))
    return str(path)


def test_groups_from_names_and_explicit():
    names = ["baseline", "baseline-s1", "baseline-s2", "diff_v2", "diff_v2-s1", "gated", "sink-zero"]
    assert seed_groups(names) == {
        "baseline": ["baseline", "baseline-s1", "baseline-s2"],
        "diff_v2": ["diff_v2", "diff_v2-s1"],
        "gated": ["gated"],
        "sink-zero": ["sink-zero"],
    }
    assert seed_groups(["a", "b", "c-s1"]) == {}  # no group of two: a plain run
    explicit = seed_groups(["x1", "x2", "y"], {"x": ["x1", "x2"]})
    assert explicit == {"x": ["x1", "x2"], "y": ["y"]}
    with pytest.raises(DiffquantError, match=r"seeds.x: 'z' is not one of the recipe's models"):
        seed_groups(["x1", "x2"], {"x": ["x1", "z"]})
    with pytest.raises(DiffquantError, match=r"model 'x1' is in two groups"):
        seed_groups(["x1", "x2"], {"x": ["x1", "x2"], "y": ["x1"]})


def test_spread_and_pooled_noise_equal_the_textbook_formulas():
    a, b, c = [47.9, 44.1, 51.2], [17.9, 19.5, 16.0], [30.0]
    sa, sb, sc = Spread.of(a), Spread.of(b), Spread.of(c)
    assert sa.mean == pytest.approx(statistics.mean(a), rel=1e-15)
    assert sa.sd == pytest.approx(statistics.stdev(a), rel=1e-14) and sc.sd is None
    pooled = math.sqrt(((len(a) - 1) * statistics.variance(a) + (len(b) - 1) * statistics.variance(b)) / 4)
    assert seeds.pooled_sd([sa, sb, sc]) == pytest.approx(pooled, rel=1e-14)
    cmp = seeds.Comparison.of("diff_v2", sb, "baseline", sa, pooled)
    se = pooled * math.sqrt(1 / 3 + 1 / 3)
    assert cmp.diff == pytest.approx(statistics.mean(b) - statistics.mean(a)) and cmp.se == pytest.approx(se)
    assert cmp.beyond is (abs(cmp.diff) > 2 * se) is True
    one = seeds.Comparison.of("gated", sc, "baseline", sa, pooled)  # one seed: judged by the pooled noise
    assert one.se == pytest.approx(pooled * math.sqrt(1 + 1 / 3))
    assert one.beyond is (abs(30.0 - statistics.mean(a)) > 2 * one.se)
    close = seeds.Comparison.of("x", Spread.of([47.0, 48.0, 46.5]), "baseline", sa, pooled)
    assert close.beyond is False
    assert seeds.Comparison.of("x", sc, "baseline", Spread.of([1.0]), None).beyond is None
    # 1.5 standard errors apart: within the 2-s.e. screen
    ref = Spread(10.0, 1.0, 4)
    mid = seeds.Comparison.of("x", Spread(10.0 + 1.5 * math.sqrt(1 / 4 + 1 / 4), 1.0, 4), "r", ref, 1.0)
    assert mid.se == pytest.approx(math.sqrt(0.5)) and mid.beyond is False
    # groups of unequal size weigh by their degrees of freedom
    d, e = [1.0, 2.0], [5.0, 9.0, 4.0, 11.0, 6.0]
    want = math.sqrt((1 * statistics.variance(d) + 4 * statistics.variance(e)) / 5)
    assert seeds.pooled_sd([Spread.of(d), Spread.of(e)]) == pytest.approx(want, rel=1e-14)


def _t5(top1: float, median: float) -> dict:
    row = {
        "top1": top1,
        "top2": top1 - 1,
        "top3": top1 - 2,
        "top10": top1 - 3,
        "top100": top1 - 4,
        "median": median,
    }
    return {"table5": {"attention logits": dict(row), "hidden states": {**row, "top1": top1 * 2}}}


def test_table5_and_sweep_over_seeds_by_hand():
    models = {
        "baseline": _t5(40, 2.0),
        "baseline-s1": _t5(44, 2.2),
        "diff_v2": _t5(20, 1.0),
        "diff_v2-s1": _t5(21, 1.1),
    }
    groups = seed_groups(models)
    agg = seeds.table5_seeds(models, groups)
    top1 = agg["diff_v2"]["attention logits"]["top1"]
    assert top1["mean"] == 20.5 and top1["sd"] == pytest.approx(statistics.stdev([20, 21])) and top1["n"] == 2
    assert agg["baseline"]["hidden states"]["top1"]["mean"] == 84.0
    comps = seeds.table5_comparisons(agg)
    logits_top1 = next(c for c in comps if c["activation"] == "attention logits" and c["column"] == "top1")
    pooled = math.sqrt((statistics.variance([40, 44]) + statistics.variance([20, 21])) / 2)
    assert logits_top1["diff"] == -21.5 and logits_top1["se"] == pytest.approx(pooled * math.sqrt(1.0))
    assert logits_top1["beyond"] is True
    text = seeds.format_table5_seeds(agg)
    assert "baseline (n=2)" in text and "20.5±0.7" in text and "42.0±2.8" in text

    rows = []
    for model, (none, int4) in {
        "baseline": (1.40, 1.70),
        "baseline-s1": (1.42, 1.74),
        "diff_v2": (1.38, 1.80),
        "diff_v2-s1": (1.37, 1.79),
    }.items():
        rows += [
            {
                "model": model,
                "plan": "none",
                "task": "bpb",
                "metric": "bits_per_byte",
                "value": none,
                "delta": 0.0,
            },
            {
                "model": model,
                "plan": "int4",
                "task": "bpb",
                "metric": "bits_per_byte",
                "value": int4,
                "delta": int4 - none,
            },
            {
                "model": model,
                "plan": "int4",
                "task": "bpb",
                "metric": "bits_per_byte_stderr",
                "value": 0.01,
                "delta": 0.0,
            },
        ]
    results = {"primary": {"bpb": {"metric": "bits_per_byte", "higher_is_better": False}}, "rows": rows}
    srows = seeds.sweep_seeds(results, groups)
    cell = next(r for r in srows if r["group"] == "diff_v2" and r["plan"] == "int4")
    assert cell["delta"]["mean"] == pytest.approx(statistics.mean([1.80 - 1.38, 1.79 - 1.37]))
    assert all(r["metric"] == "bits_per_byte" for r in srows)  # the primary metric only
    comps = seeds.sweep_comparisons(srows)
    loss = next(c for c in comps if c["plan"] == "int4")
    d_b, d_v = [1.70 - 1.40, 1.74 - 1.42], [1.80 - 1.38, 1.79 - 1.37]
    pooled = math.sqrt((statistics.variance(d_b) + statistics.variance(d_v)) / 2)
    assert loss["statistic"] == "delta" and loss["diff"] == pytest.approx(
        statistics.mean(d_v) - statistics.mean(d_b)
    )
    assert loss["se"] == pytest.approx(pooled) and loss["beyond"] is (abs(loss["diff"]) > 2 * pooled)
    assert loss["pooled_sd"] == pytest.approx(pooled)  # sqrt(1/2 + 1/2) = 1: the same number
    table = seeds.format_sweep_seeds(srows).splitlines()
    assert "diff_v2 (n=2)" in table[1]
    # every cell of a row is its own whitespace-separated field: none runs into the next column
    head = table[1].split()
    for line in table[2:]:
        fields = re.split(r"\s{2,}", line.strip())
        assert len(fields) == len(head) - head.count("(n=2)") - head.count("(n=1)"), line
    lines = seeds.seed_sentences([], comps)
    assert any(line.startswith("bpb bits_per_byte, change under int4: diff_v2") for line in lines)


def test_sink_rate_over_seeds_by_hand():
    """The sink rate as table5.json holds it (a share of heads) -> percent, mean and sample sd per group, each
    group against the baseline on the pooled spread; a group with a member that was not probed is left out.
    The rates are the zoo's (2,048-token rivals run: baseline 2.4 / 14.1 %, DIFF V2 0.8 / 1.7 %)."""
    rates = {"baseline": 0.024, "baseline-s1": 0.141, "diff_v2": 0.008, "diff_v2-s1": 0.017, "gated": 0.074}
    models = {m: {"sink_rate": {"rate": r, "heads": 24}} for m, r in rates.items()}
    models["sink"] = {"table5": {}}  # profiled without the probe
    models["gated-s1"] = {"table5": {}}  # one seed of a group without it: the group has no rate
    rates["clipped"] = 0.034
    models["clipped"] = {"sink_rate": {"rate": 0.034, "heads": 24}}
    groups = seed_groups([*models])
    agg = seeds.sink_rate_seeds(models, groups)
    assert set(agg) == {"baseline", "diff_v2", "clipped"}
    base, v2 = [2.4, 14.1], [0.8, 1.7]
    assert agg["baseline"]["mean"] == pytest.approx(statistics.mean(base), rel=1e-12)
    assert agg["baseline"]["sd"] == pytest.approx(statistics.stdev(base), rel=1e-12)
    assert agg["clipped"] == {"mean": pytest.approx(3.4), "sd": None, "n": 1}
    comps = {c["group"]: c for c in seeds.scalar_comparisons(agg, "attention-sink rate", "% of heads")}
    pooled = math.sqrt((statistics.variance(base) + statistics.variance(v2)) / 2)
    assert comps["diff_v2"]["diff"] == pytest.approx(statistics.mean(v2) - statistics.mean(base))
    assert comps["diff_v2"]["se"] == pytest.approx(pooled)  # pooled x sqrt(1/2 + 1/2)
    assert comps["clipped"]["se"] == pytest.approx(pooled * math.sqrt(1 + 1 / 2))
    assert comps["clipped"]["beyond"] is (abs(3.4 - statistics.mean(base)) > 2 * comps["clipped"]["se"])
    assert "baseline (n=2) 8.2±8.3 %" in seeds.format_sink_rate_seeds(agg)


def test_a_recipe_with_seed_groups_reports_them(tmp_path, text, capsys):
    """A run of tiny random models, two seeds of two kinds (init:KIND:tiny:SEED named KIND and KIND-s1):
    table5_seeds.json holds the mean and spread of table5.json's numbers, results_seeds.json those of
    results.json, both are printed, and the report's summary has a Seeds topic."""
    recipe = {
        "name": "seeds",
        "models": {
            "baseline": "init:baseline:tiny:0",
            "baseline-s1": "init:baseline:tiny:1",
            "diff_v2": "init:diff_v2:tiny:0",
            "diff_v2-s1": "init:diff_v2:tiny:1",
        },
        "data": {"calib": {"source": text, "tokens": 128, "seq_len": 64}},
        "profile": {"data": text, "tokens": 256, "seq_len": 64, "sink_rate": True},
        "eval": {"tasks": [{"type": "bpb", "data": text, "tokens": 256, "seq_len": 64}]},
        "sweep": {"plans": ["attn-logits-int4"]},
        "plots": {"enabled": False},
    }
    path = tmp_path / "seeds.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["--quiet", "run", str(path), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    t5 = json.loads((run / "table5.json").read_text())["models"]
    agg = json.loads((run / "table5_seeds.json").read_text())["table5"]
    for group in ("baseline", "diff_v2"):
        values = [t5[m]["table5"]["attention logits"]["top1"] for m in (group, f"{group}-s1")]
        got = agg[group]["attention logits"]["top1"]
        assert got["mean"] == pytest.approx(statistics.mean(values), rel=1e-15)
        assert got["sd"] == pytest.approx(statistics.stdev(values), rel=1e-12)
    # the sink rate (percent of heads) over seeds, and DIFF V2's against the baseline's on the pooled spread
    doc = json.loads((run / "table5_seeds.json").read_text())
    rates = {g: [100 * t5[m]["sink_rate"]["rate"] for m in (g, f"{g}-s1")] for g in ("baseline", "diff_v2")}
    for group, values in rates.items():
        assert doc["sink_rate"][group]["mean"] == pytest.approx(statistics.mean(values), rel=1e-12, abs=1e-12)
        assert doc["sink_rate"][group]["sd"] == pytest.approx(statistics.stdev(values), rel=1e-12, abs=1e-12)
    sink = next(c for c in doc["comparisons"] if c["activation"] == "attention-sink rate")
    pooled = math.sqrt((statistics.variance(rates["baseline"]) + statistics.variance(rates["diff_v2"])) / 2)
    assert (sink["group"], sink["reference"]) == ("diff_v2", "baseline")
    assert sink["diff"] == pytest.approx(
        statistics.mean(rates["diff_v2"]) - statistics.mean(rates["baseline"]), abs=1e-12
    )
    assert sink["se"] == pytest.approx(pooled, rel=1e-12, abs=1e-12)  # pooled x sqrt(1/2 + 1/2)
    assert "attention-sink rate over seeds" in out and "attention-sink rate % of heads: diff_v2" in out
    res = json.loads((run / "sweep" / "results.json").read_text())
    srows = json.loads((run / "sweep" / "results_seeds.json").read_text())["rows"]
    by = {(r["model"], r["plan"]): r for r in res["rows"] if r["metric"] == "bits_per_byte"}
    cell = next(r for r in srows if r["group"] == "diff_v2" and r["plan"] == "attn-logits-int4")
    deltas = [by[(m, "attn-logits-int4")]["delta"] for m in ("diff_v2", "diff_v2-s1")]
    assert cell["delta"]["mean"] == pytest.approx(statistics.mean(deltas), rel=1e-12)
    assert "Table 5 view over seeds" in out and "bits_per_byte over seeds" in out
    assert "attention logits top1: diff_v2" in out
    report = (run / "report.md").read_text()
    assert "Seeds" in report and "change under attn-logits-int4: diff_v2" in report
