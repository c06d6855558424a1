"""The run report: markdown and one self-contained HTML file, from a run folder's artifacts only."""

import base64
import json
import re
import shutil
import subprocess

import pytest

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.eval.sweep import SweepSpec, run_sweep
from diffquant.eval.tasks import parse_task
from diffquant.io import load_model
from diffquant.io.artifacts import manifest, write_json_atomic
from diffquant.profile.runner import profile_stage
from diffquant.report import write_report

KINDS = ("baseline", "diff_v1", "diff_v2")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    text = run.parent / "text.txt"
    text.write_text("".join(f"value_{i} = compute({i}, scale={i % 7})\n" for i in range(300)))
    models = {k: (f"init:{k}:tiny", load_model(f"init:{k}:tiny")) for k in KINDS}
    profile_stage(
        models,
        data=str(text),
        tokens=256,
        seq_len=64,
        batch_size=4,
        sites="*",
        topk=10,
        attention=None,
        out=run,
    )
    spec = SweepSpec(
        models={k: f"init:{k}:tiny" for k in KINDS},
        plans=["attn-logits-int8", "attn-logits-int4"],
        tasks=[parse_task(f"bpb:data={text},tokens=128,seq_len=64")],
        calib_data=str(text),
        calib_tokens=64,
        calib_seq_len=64,
    )
    run_sweep(spec, run / "sweep")
    write_json_atomic(run / "manifest.json", manifest("run", recipe={"name": "t", "description": "test run"}))
    return run


def test_html_is_self_contained_and_lists_everything(run):
    md, page = write_report(run)
    doc = page.read_text()
    figures = sorted((run / "figures").glob("*.png"))
    assert figures
    # every image inline as a data URI; no other resource is referenced
    srcs = re.findall(r"src='([^']*)'", doc)
    assert len(srcs) == len(figures) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"(href|src)=['\"](?!data:|#)", doc)  # in-page anchors only
    inline = {base64.b64decode(s.split(",", 1)[1]) for s in srcs}
    assert inline == {f.read_bytes() for f in figures}
    for caption in (
        "Table 5 view",
        "Hidden states per layer",
        "bpb: bits_per_byte",
        "Models and their scale",
    ):
        assert caption in doc and caption in md.read_text()
    assert "3B parameters and were trained on 350B tokens" in doc
    for kind in KINDS:
        assert kind in doc


def test_cli_report_and_errors(run, tmp_path, capsys):
    assert main(["report", str(run)]) == 0
    assert "report.html" in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2
    assert "expected profile/NAME.json" in capsys.readouterr().err
    with pytest.raises(DiffquantError, match="run folder not found"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DiffquantError, match="no run artifacts found"):
        write_report(tmp_path / "empty", figures=[])


# ------------------------------------------------------------------------------- synthetic run folders
# Run folders written by hand (no model runs): each summary sentence is checked against the numbers it
# rests on, and changes when they change.
SWEEP_PLANS = ("none", "attn-logits-int8", "attn-logits-int4")


def _plans(names=SWEEP_PLANS) -> dict:
    from diffquant.quant.plan import preset

    return {p: None if p == "none" else preset(p).to_dict() for p in names}


def _synthetic_run(root, tasks, table5=None, argv=None, status=None, plans=SWEEP_PLANS):
    """A run folder from ``tasks``: {label: (task dict, metric, higher_is_better, {model: {plan: {metric:
    value}}})}; the delta of each metric is against the model's plan ``none``."""
    run = root / "run"
    rows, models = [], {}
    for label, (*_, cells) in tasks.items():
        for model, by_plan in cells.items():
            models[model] = "init:baseline:tiny"
            for plan, metrics in by_plan.items():
                for name, value in metrics.items():
                    ref = by_plan.get("none", {}).get(name)
                    delta = value - ref if isinstance(value, float) and isinstance(ref, float) else None
                    rows.append(
                        {"model": model, "attention": "baseline", "plan": plan, "task": label,
                         "metric": name, "value": value, "unquantized": ref, "delta": delta}
                    )  # fmt: skip
    results = {
        "fingerprint": "f",
        "complete": True,
        "primary": {label: {"metric": t[1], "higher_is_better": t[2]} for label, t in tasks.items()},
        "rows": rows,
    }
    spec = {"models": models, "plans": _plans(plans), "tasks": [t[0] for t in tasks.values()]}
    write_json_atomic(run / "sweep" / "results.json", results)
    write_json_atomic(run / "sweep" / "sweep.json", {"fingerprint": "f", "spec": spec})
    if table5 is not None:
        write_json_atomic(run / "table5.json", {"tokens": 100, "data": "synthetic", "models": table5})
    record = manifest("run", recipe={"name": "synthetic", "description": "hand-written numbers"})
    record["argv"] = argv or ["/x/.venv/bin/diffquant", "run", "recipes/synthetic.yaml"]
    if status is not None:
        record["status"] = status
    write_json_atomic(run / "manifest.json", record)
    return run


def _bpb(a: tuple[float, ...], b: tuple[float, ...]):
    """bpb results of models A and B at none / int8 / int4."""
    cells = {m: {p: {"bits_per_byte": v} for p, v in zip(SWEEP_PLANS, vals, strict=True)} for m, vals in
             (("A", a), ("B", b))}  # fmt: skip
    return {"bpb": ({"type": "bpb"}, "bits_per_byte", False, cells)}


def _mc(path, values: dict[str, tuple[float, float]], plans=("none",)):
    """mc results: {model: (acc_norm, stderr)} at every plan (the same numbers), 100 items."""
    cells = {
        m: {p: {"acc_norm": v, "acc_norm_stderr": se, "n": 100} for p in plans}
        for m, (v, se) in values.items()
    }
    return {"mc": ({"type": "mc", "path": str(path)}, "acc_norm", True, cells)}


@pytest.fixture()
def mc_file(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text(
        "".join(
            json.dumps({"ctx": f"question {i}", "endings": ["a", "b", "c", "d"], "label": i % 4}) + "\n"
            for i in range(8)
        )
    )
    return path


def _summary(run) -> str:
    md, _ = write_report(run, figures=[])
    text = md.read_text()
    return text.split("## Summary", 1)[1].split("\n## ", 1)[0]


def test_summary_names_the_model_that_loses_least(tmp_path):
    run = _synthetic_run(tmp_path, _bpb((1.0, 1.01, 1.2), (1.1, 1.13, 1.5)))
    text = _summary(run)
    assert "Unquantized, A is best (1.0000; B 1.1000)" in text
    assert (
        "A loses least at attn-logits-int8 (+0.0100; next B +0.0300) and attn-logits-int4 (+0.2000; next B +0.4000)"
        in text
    )
    assert "Of the 2 quantized plans, A fares best at 2" in text
    assert "no spread is known for bits_per_byte" not in text  # these cells are not a text task's totals
    assert "no run-to-run spread is known for bits_per_byte" in text and "within noise" not in text
    # swap the models' numbers: the sentences name the other model
    shutil.rmtree(run)
    text = _summary(_synthetic_run(tmp_path, _bpb((1.1, 1.13, 1.5), (1.0, 1.01, 1.2))))
    assert "Unquantized, B is best (1.0000; A 1.1000)" in text
    assert "B loses least at attn-logits-int8 (+0.0100; next A +0.0300)" in text
    # the winner differs per plan: one clause per winner
    shutil.rmtree(tmp_path / "run")
    text = _summary(_synthetic_run(tmp_path, _bpb((1.0, 1.01, 1.5), (1.1, 1.13, 1.3))))
    assert "A loses least at attn-logits-int8 (+0.0100; next B +0.0300)" in text
    assert "B loses least at attn-logits-int4 (+0.2000; next A +0.5000)" in text


def test_summary_direction_higher_is_better(tmp_path, mc_file):
    tasks = _mc(mc_file, {"A": (0.80, 0.001), "B": (0.70, 0.001)}, plans=SWEEP_PLANS)
    # A loses 0.01 at int8, B loses 0.05: with higher-is-better metrics a loss is a drop
    tasks["mc"][3]["A"]["attn-logits-int8"]["acc_norm"] = 0.79
    tasks["mc"][3]["B"]["attn-logits-int8"]["acc_norm"] = 0.65
    text = _summary(_synthetic_run(tmp_path, tasks))
    assert "**mc** (acc_norm, higher is better): Unquantized, A is best (0.8000; B 0.7000)" in text
    assert "A loses least at attn-logits-int8 (-0.0100; next B -0.0500)" in text


def test_summary_uses_the_spread_of_the_windows_for_bits_per_byte(tmp_path):
    """bpb cells carry the standard error over their windows (bits_per_byte_stderr, from the scorer):
    the noise topic names it, and a gap within 2 of them is marked; cells with totals alone say so."""
    tasks = _bpb((1.0, 1.01, 1.2), (1.02, 1.13, 1.5))
    for by_plan in tasks["bpb"][3].values():
        for metrics in by_plan.values():
            metrics |= {"bits_per_byte_stderr": 0.02, "n_windows": 8}
    text = _summary(_synthetic_run(tmp_path, tasks))
    assert "Unquantized, A is best (1.0000; B 1.0200; within noise)" in text
    # no per-window values in these results: the unpaired rule, said so
    assert (
        "3 of 4 changes vs unquantized are larger than 2 standard errors (unpaired: the results keep no "
        "per-window values (a sweep from before they were kept, or a layer-streamed one), so each cell's own "
        "standard error over its 8 windows (bits_per_byte_stderr, median 0.0200) is added in quadrature)"
        in text
    )
    assert (
        "1 of 3 differences between models at the same plan are smaller than 2 standard errors (as above; "
        "at a quantized plan, of the changes vs unquantized)" in text
    )
    assert "not tested against noise" not in text
    shutil.rmtree(tmp_path / "run")
    tasks = _bpb((1.0, 1.01, 1.2), (1.02, 1.13, 1.5))
    for by_plan in tasks["bpb"][3].values():
        for metrics in by_plan.values():
            metrics["n_windows"] = 8
    text = _summary(_synthetic_run(tmp_path, tasks))
    assert "no spread is known for bits_per_byte. This run's cells store only totals" in text


def test_scorer_standard_error_is_the_spread_of_the_windows():
    """The ratio estimator over windows: with equal-sized windows it is the plain standard error of the
    per-window means."""
    import math

    import numpy as np

    from diffquant.data.scoring import _ratio_stderr

    nats = [10.0, 12.0, 8.0, 11.0]
    windows = [(x, 5, 20) for x in nats]
    per_byte = np.array(nats) / 20
    expected = per_byte.std(ddof=1) / math.sqrt(len(nats))
    assert _ratio_stderr(windows, 2) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(_ratio_stderr(windows[:1], 2))  # one window: no spread


def test_plans_explained_from_the_plans_themselves(tmp_path):
    from diffquant.quant.plan import preset

    run = _synthetic_run(tmp_path, _bpb((1.0, 1.01, 1.2), (1.1, 1.13, 1.5)))
    md, _ = write_report(run, figures=[])
    text = md.read_text()
    assert "**The plans: what each one quantizes**" in text
    described = preset("attn-logits-int4").to_dict()["description"]
    assert (
        f"| attn-logits-int4 | {described}. In detail: attention logits (kind:logits) to int4 per-tensor dynamic. |"
        in text
    )
    assert "| none | the unquantized model" in text
    from diffquant.report import describe_plan

    w8a8 = describe_plan("w8a8", preset("w8a8").to_dict())
    assert w8a8.endswith(
        "In detail: weights of layers.* to int8 per-channel dynamic; layers.*.input to int8 per-token dynamic."
    )
    kv2 = describe_plan("kv2", preset("kv2").to_dict())
    assert kv2.endswith(
        "In detail: a quantized KV cache when the model decodes (format int2, keys channel, values token, "
        "group 32, window 128, sinks 0, pre_rope False)."
    )


def test_the_report_states_each_tasks_settings_bos_included(tmp_path):
    """Which windows start with BOS (and the other settings of a task) change what a number means: the report
    lists every task's settings as sweep.json records them."""
    task = {
        "type": "ppl",
        "name": "ppl-w",
        "tokens": 4096,
        "seq_len": 1024,
        "windows": "disjoint",
        "bos": "window",
    }
    run = _synthetic_run(
        tmp_path, {"ppl-w": (task, "perplexity", False, {"A": {p: {"perplexity": 2.0} for p in SWEEP_PLANS}})}
    )
    text = write_report(run, figures=[])[0].read_text()
    assert "**The tasks: what each one reads**" in text
    assert "| ppl-w | ppl | tokens 4096, seq_len 1024, windows disjoint, bos window |" in text


def test_summary_flags_results_near_chance(tmp_path, mc_file):
    # chance = 1/4 (from the items file); A is 0.27 +- 0.03 (within 2 standard errors), B 0.70
    text = _summary(_synthetic_run(tmp_path, _mc(mc_file, {"A": (0.27, 0.03), "B": (0.70, 0.03)})))
    assert (
        f"1 of 2 acc_norm results are within 2 standard errors of chance (0.25, 1 / 4 choices, from {mc_file})"
        in text
    )
    assert "only B at none (0.7000) differs from chance" in text
    shutil.rmtree(tmp_path / "run")
    text = _summary(_synthetic_run(tmp_path, _mc(mc_file, {"A": (0.50, 0.03), "B": (0.70, 0.03)})))
    assert "every acc_norm result is more than 2 standard errors from chance (0.25)" in text
    assert "within 2 standard errors of chance" not in text
    # retrieval reports its own chance level; without a stderr the binomial one at chance is used
    shutil.rmtree(tmp_path / "run")
    cells = {m: {"none": {"acc_rank": v, "chance_rank": 0.2, "n": 25}} for m, v in (("A", 0.24), ("B", 0.96))}
    text = _summary(_synthetic_run(tmp_path, {"retrieval": ({"type": "retrieval"}, "acc_rank", True, cells)}))
    assert (
        "1 of 2 acc_rank results are within 2 standard errors of chance (0.2, as the task reports it)" in text
    )
    assert "only B at none (0.9600) differs from chance" in text


def test_summary_flags_differences_within_the_spread(tmp_path, mc_file):
    # 0.60 vs 0.62 with standard errors 0.05: the difference is noise
    text = _summary(_synthetic_run(tmp_path, _mc(mc_file, {"A": (0.60, 0.05), "B": (0.62, 0.05)})))
    assert "Unquantized, B is best (0.6200; A 0.6000; within noise)" in text
    assert "1 of 1 differences between models at the same plan are smaller than 2 standard errors" in text
    assert "no model is distinguishable from another" in text
    shutil.rmtree(tmp_path / "run")
    text = _summary(_synthetic_run(tmp_path, _mc(mc_file, {"A": (0.60, 0.001), "B": (0.62, 0.001)})))
    assert "Unquantized, B is best (0.6200; A 0.6000)" in text and "within noise" not in text
    assert "0 of 1 differences" in text


def _t5_row(top1: float, loc: dict, nan: int = 0) -> dict:
    return {
        "top1": top1, "top2": top1 / 2, "top3": top1 / 3, "top10": 1.0, "top100": 0.5, "median": 0.1,
        "top1_at": loc, "nonfinite": {"nan": nan, "posinf": 0, "neginf": 0, "first": None},
    }  # fmt: skip


def test_summary_outliers_from_table5(tmp_path):
    where = {"site": "layers.3.resid", "layer": 3, "pos": 7, "channel": 2}
    t5 = {
        "A": {"table5": {"hidden states": _t5_row(120.0, where)}},
        "B": {"table5": {"hidden states": _t5_row(30.0, {"site": "layers.1.resid", "layer": 1, "pos": 0, "channel": 9})}},
    }  # fmt: skip
    text = _summary(_synthetic_run(tmp_path, _bpb((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)), table5=t5))
    assert (
        "Hidden states (Table 5 view): the top-1 |x| is smallest in B (30.0) and largest in A (120, 4.00x B's; "
        "at `layers.3.resid`, layer 3, position 7, channel 2)" in text
    )
    assert "No NaN or Inf" in text
    shutil.rmtree(tmp_path / "run")
    t5["A"]["table5"]["hidden states"]["top1"] = 10.0
    t5["B"]["table5"]["hidden states"]["nonfinite"]["nan"] = 5
    text = _summary(_synthetic_run(tmp_path, _bpb((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)), table5=t5))
    assert "smallest in A (10.0) and largest in B (30.0, 3.00x A's; at `layers.1.resid`" in text
    assert "B has 5 NaN/Inf values in hidden states" in text and "No NaN or Inf" not in text


def test_report_header_grid_and_figure_index(tmp_path):
    from matplotlib.figure import Figure

    from diffquant.plots.run import FigureRecord

    run = _synthetic_run(
        tmp_path,
        _bpb((1.0, 1.01, 1.2), (1.1, 1.13, 1.5)),
        argv=["/venv/bin/diffquant", "demo", "--out", "r d"],
    )
    fig = Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1], [1, 0])
    png = run / "figures" / "one.png"
    png.parent.mkdir()
    fig.savefig(png)
    record = FigureRecord("one", (png,), "A line going down.", "hist", "One line")
    md, page = write_report(run, figures=[record])
    doc, text = page.read_text(), md.read_text()
    # the command that ran, from the manifest's argv (quoted as a shell would need it)
    assert "Command: <code>diffquant demo --out &#x27;r d&#x27;</code>" in doc
    assert "Command: `diffquant demo --out 'r d'`" in text
    # the figure index near the top links to the figure
    assert doc.index("<nav>") < doc.index("id='summary'") < doc.index("<figure id='fig-one'>")
    assert "<li><a href='#fig-one'>One line</a></li>" in doc and "1. [One line](#fig-one)" in text
    assert "Figure 1. A line going down." in doc
    # the quantization results are the CLI's model x plan grid, not a list of rows
    grid = doc.split("<pre>", 1)[1].split("</pre>", 1)[0]
    assert grid.splitlines()[0] == "bpb: bits_per_byte (lower is better; change vs unquantized)"
    assert re.search(r"attn-logits-int4\s+1\.2000 \(\+0\.2000\)\s+1\.5000 \(\+0\.4000\)", grid)
    assert "<th>plan</th>" not in doc
    # other ways a run was started
    for argv, expected in (
        (["/usr/lib/python3/site-packages/diffquant/__main__.py", "run", "r.yaml"], "diffquant run r.yaml"),
        (["/usr/bin/pytest", "-x"], "stage `run` called from Python (process `pytest -x`)"),
    ):
        shutil.rmtree(run)
        run = _synthetic_run(tmp_path, _bpb((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)), argv=argv)
        md, _ = write_report(run, figures=[])
        assert f"Command: `{expected}`" in md.read_text()


def _with_profile(run):
    """Add a small profile (Linear inputs of two layers) to a synthetic run folder: 3 figures beside the
    degradation one."""
    import torch

    from diffquant.profile.profiler import Profile
    from diffquant.profile.stats import SiteStats

    sites = {}
    for layer in range(2):
        stats = SiteStats(f"layers.{layer}.mlp.down.input", "linear_in", topk=4)
        stats.update(torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(layer)))
        sites[stats.site] = stats
    profile = Profile(sites=sites, meta={"model": "A", "attention": "baseline", "tokens": 8})
    write_json_atomic(run / "profile" / "A.json", profile.to_dict())
    record = json.loads((run / "manifest.json").read_text())
    write_json_atomic(run / "manifest.json", {**record, "streamed": ["A"]})  # so: no attention maps
    return run


def test_report_reuses_current_figures_and_redraws_changed_ones(tmp_path, monkeypatch, capsys):
    """`plot` draws, saying so as each family starts; a report after it draws nothing (the same artifacts
    at the same dpi); a changed artifact or another dpi has the figures drawn again. Renders are counted
    through the one save function."""
    import os

    import diffquant.plots.run as plots_run

    folder = _with_profile(_synthetic_run(tmp_path, _bpb((1.0, 1.01, 1.2), (1.1, 1.13, 1.5))))
    saved: list[str] = []
    real_save = plots_run.save_figure

    def counting_save(fig, out, name, formats, dpi):
        saved.append(name)
        return real_save(fig, out, name, formats, dpi)

    monkeypatch.setattr(plots_run, "save_figure", counting_save)
    monkeypatch.setenv("DIFFQUANT_QUIET", "0")
    assert main(["plot", str(folder), "--dpi", "20"]) == 0
    drawn = sorted(saved)
    assert drawn == ["act-scales", "degradation-bpb", "hist-layers-linear_in", "hist-linear_in"]
    err = capsys.readouterr().err
    assert (
        "plot: hist: drawing (family 1 of 7)" in err and "plot: degradation: drawing (family 5 of 7)" in err
    )
    assert main(["report", str(folder), "--dpi", "20"]) == 0
    assert len(saved) == len(drawn)  # nothing drawn again
    assert (
        "report: 4 figures current (drawn from these artifacts at 20 dpi), reused" in capsys.readouterr().err
    )
    assert (folder / "report.html").read_text().count("<figure id=") == len(drawn)
    # a changed artifact: drawn again (the colours hang on every artifact, so every family)
    results = folder / "sweep" / "results.json"
    st = results.stat()
    os.utime(results, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    write_report(folder, dpi=20)
    assert sorted(saved[len(drawn) :]) == drawn
    write_report(folder, dpi=20)
    assert len(saved) == 2 * len(drawn)  # current again
    write_report(folder, dpi=25)  # another dpi
    assert len(saved) == 3 * len(drawn)


def test_numbers_in_one_format_per_column():
    from diffquant.report import format_column

    assert format_column([47.89, 56.09, 17.89]) == ["47.9", "56.1", "17.9"]
    assert format_column([2.969, 0.8828, 0.6518]) == ["2.969", "0.883", "0.652"]
    assert format_column([1234.5, 20.25, None]) == ["1,234.5", "20.2", "-"]
    assert format_column([1e-6, 3.0, 2e3]) == ["1.000e-06", "3.000e+00", "2.000e+03"]
    assert format_column([0, 12, 1200]) == ["0", "12", "1,200"]


# What a reader's browser sees, measured in the page once it has loaded (every image decoded): the figures
# (decoded, drawn at a readable width, inside the window), the page's own width against the window's (no
# horizontal scrolling), and every link (an in-page anchor whose target exists).
_READER_CHECK = """<script>
window.addEventListener("load", () => {
  const root = document.documentElement, imgs = [...document.images];
  const name = (i) => (i.closest("figure") || i).id || i.alt.slice(0, 40);
  const hrefs = [...document.querySelectorAll("a[href]")].map((a) => a.getAttribute("href"));
  document.body.dataset.reader = JSON.stringify({
    images: imgs.length,
    undecoded: imgs.filter((i) => !(i.complete && i.naturalWidth > 0)).map(name),
    narrow: imgs.filter((i) => i.getBoundingClientRect().width < 300).map(name),
    outside: imgs.filter((i) => i.getBoundingClientRect().right > root.clientWidth + 1).map(name),
    page: root.scrollWidth, window: root.clientWidth,
    links: hrefs.length,
    dead: hrefs.filter((h) => !h.startsWith("#") || !document.getElementById(decodeURIComponent(h.slice(1)))),
  });
});
</script>"""


def _chromium(page, tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'ud'}",
        "--window-size=1000,1400",
        *args,
        page.as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed")
def test_report_renders_headless(run, tmp_path):
    """The report of a real (tiny) run, opened by headless Chromium in a 1000 px window, as a reader sees it:
    every figure decodes and is drawn at least 300 px wide inside the window, the page needs no horizontal
    scrolling, every link is an in-page anchor that lands on an element; the screenshot is a light page with
    text and figures (not blank, not an error page). .ci/run installs Chromium, so this runs in CI."""
    import html

    import matplotlib.image as mpimg

    _, page = write_report(run)
    figures = len(json.loads((run / "figures" / "figures.json").read_text())["figures"])
    assert figures >= 5  # histograms, per-layer views, maps, degradation, lambda
    checked = tmp_path / "report.html"
    checked.write_text(page.read_text().replace("</body>", _READER_CHECK + "</body>"))
    dom = _chromium(checked, tmp_path, "--virtual-time-budget=20000", "--dump-dom")
    found = re.search(r'data-reader="([^"]*)"', dom.stdout)
    assert found, f"the check did not run: {dom.stderr[-2000:]}"
    seen = json.loads(html.unescape(found[1]))
    assert seen["images"] == figures and seen["undecoded"] == []
    assert seen["narrow"] == [] and seen["outside"] == []
    assert seen["page"] <= seen["window"], seen  # no horizontal scrolling
    assert seen["links"] >= figures and seen["dead"] == []  # the contents and the figure index

    shot = tmp_path / "shot.png"
    _chromium(page, tmp_path, "--virtual-time-budget=20000", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1400, 1000)
    assert pixels.std() > 0.05  # not a blank page
    dark = (pixels.mean(axis=-1) < 0.5).mean()
    assert 0.005 < dark < 0.5  # text on a light page
    # the figures as drawn on screen (a copy showing only them: headless Chromium does not scroll to an
    # anchor before its screenshot): the models' coloured curves are there, not empty frames
    only = tmp_path / "figures.html"
    only.write_text(
        page.read_text().replace("<body>", "<body><style>body>*:not(figure){display:none}</style>", 1)
    )
    _chromium(only, tmp_path, "--virtual-time-budget=20000", f"--screenshot={shot}")
    pixels = mpimg.imread(shot)[..., :3]
    coloured = (pixels.max(axis=-1) - pixels.min(axis=-1) > 0.3).mean()
    assert coloured > 0.002, coloured  # the blue / orange / green of the three models


def test_noise_between_results_of_different_sample_sizes_pools_by_items(tmp_path):
    """Two accuracies over different numbers of items, A 3/4 and B 392/400, with no reported standard error:
    the two-proportion test pools the correct answers, p = (3 + 392) / (4 + 400), not the mean of the two
    accuracies. Pooled, the gap 0.23 is beyond 2 standard errors (0.148); an unweighted mean (0.865) would
    make it 0.354 and call the models indistinguishable."""
    import math

    from diffquant.report.summary import task_views

    cells = {
        "A": {"none": {"acc_rank": 0.75, "chance_rank": 0.01, "n": 4}},
        "B": {"none": {"acc_rank": 0.98, "chance_rank": 0.01, "n": 400}},
    }
    run = _synthetic_run(tmp_path, {"retrieval": ({"type": "retrieval"}, "acc_rank", True, cells)})
    results = json.loads((run / "sweep" / "results.json").read_text())
    (view,) = task_views(results, json.loads((run / "sweep" / "sweep.json").read_text()))
    a, b = view.cells[("A", "none")], view.cells[("B", "none")]
    assert (a.n, b.n, view.spread) == (4, 400, "binomial")
    p = (3 + 392) / (4 + 400)  # correct answers over items, from the counts
    expected = math.sqrt(p * (1 - p) * (1 / 4 + 1 / 400))
    assert view.se_of_difference(a, b) == pytest.approx(expected, rel=1e-12)
    unweighted = math.sqrt(0.865 * 0.135 * (1 / 4 + 1 / 400))
    assert 2 * expected < 0.23 < 2 * unweighted  # the case tells the two means apart
    text = _summary(run)
    assert "Unquantized, B is best (0.9800; A 0.7500)" in text and "within noise" not in text
    assert "0 of 1 differences between models at the same plan are smaller than 2 standard errors" in text
    assert "binomial standard errors sqrt(p(1-p)/n) over 4 to 400 items" in text
