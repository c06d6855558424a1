"""Figures drawn from a run folder's artifacts: pixel size, non-blank images, one series per model,
render_run's files and filters, and one-line errors naming the damaged file.

The artifacts come from the real profile and sweep stages on tiny random models (one module-scoped
fixture, a few seconds), so the figures are tested against the formats those stages actually write.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diffquant.errors import DiffquantError
from diffquant.plots import (
    FAMILIES,
    fig_act_scales,
    fig_attention_maps,
    fig_degradation,
    fig_histograms,
    fig_lambda,
    fig_layerwise,
    load_run,
    model_colors,
    render_run,
)
from diffquant.plots.figures import HIST_LOG_RATIO, HIST_LOW_QUANTILE, Pool, hist_xlimits, plan_point
from diffquant.plots.style import KIND_COLORS, MAX_WIDTH_IN, MIN_FONT_PT, save_figure

MODELS = ("baseline", "diff_v1", "diff_v2")
DPI = 40  # small images keep the suite fast; pixel size is checked against figsize * dpi all the same
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "differential", "attention"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder as `diffquant run` leaves it: manifest, profiles + maps of three tiny models, a sweep."""
    from diffquant.eval.sweep import SweepSpec, run_sweep
    from diffquant.eval.tasks import parse_task
    from diffquant.io import load_model
    from diffquant.io.artifacts import manifest, write_json_atomic
    from diffquant.profile.runner import profile_stage

    root = tmp_path_factory.mktemp("plots")
    text = root / "data.txt"
    rng = np.random.default_rng(0)
    text.write_text(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 900)))
    run = root / "run"
    specs = {k: f"init:{k}:tiny" for k in MODELS}
    write_json_atomic(run / "manifest.json", manifest("run", recipe={"models": specs}))
    models = {k: (s, load_model(s)) for k, s in specs.items()}
    profile_stage(
        models,
        data=str(text),
        tokens=512,
        seq_len=64,
        batch_size=4,
        sites="*",
        topk=20,
        attention=None,
        out=run,
    )
    spec = SweepSpec(
        models=specs,
        plans=[
            "attn-logits-int8",
            "attn-logits-int4",
            "attn-logits-int8-row",
            "attn-logits-int4-row",
            "w8a8",
        ],
        tasks=[parse_task(f"bpb:data={text},tokens=256,seq_len=64")],
        calib_data=str(text),
        calib_tokens=128,
        calib_seq_len=64,
    )
    run_sweep(spec, run / "sweep")
    return run


@pytest.fixture(scope="module")
def art(run_dir):
    return load_run(run_dir)


@pytest.fixture()
def fresh_run(run_dir, tmp_path) -> Path:
    """A private copy of the run folder (render_run writes into it)."""
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def _assert_png(fig, folder: Path, name: str = "fig", dpi: int = DPI) -> np.ndarray:
    """Save ``fig`` as PNG; check the pixel size is figsize x dpi and the image is not blank."""
    from matplotlib.image import imread

    (path,) = save_figure(fig, folder, name, ["png"], dpi)
    img = imread(path)
    width, height = fig.get_size_inches()
    assert img.shape[:2] == (round(height * dpi), round(width * dpi))
    assert float(np.var(img[..., :3])) > 1e-3, "image is blank"
    return img


def _labelled(ax, names=MODELS) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if line.get_label() in names]


def _assert_readable(fig) -> None:
    """Readable in the report at 100 % zoom: at most MAX_WIDTH_IN wide, no text below MIN_FONT_PT, and no
    text (title, label, legend, tick label) reaching past the figure's edge (nothing clipped)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    width, _ = fig.get_size_inches()
    assert width <= MAX_WIDTH_IN + 1e-9
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts
    for t in texts:
        assert t.get_fontsize() >= MIN_FONT_PT, (t.get_text(), t.get_fontsize())
    # what is drawn: each axes with its ticks, labels, title and legend; figure legends
    drawn = [(ax.get_title() or "axes", ax.get_tightbbox(renderer)) for ax in fig.axes]
    drawn += [("figure legend", leg.get_window_extent(renderer)) for leg in fig.legends]
    drawn += _drawn_texts(fig, renderer)
    for what, ext in drawn:
        inside = (
            ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1 and ext.y0 >= box.y0 - 1 and ext.y1 <= box.y1 + 1
        )
        assert inside, f"{what!r} is clipped: {ext} outside {box}"
    _assert_tick_labels_apart(fig, renderer)


def _assert_tick_labels_apart(fig, renderer) -> None:
    """No two drawn tick labels of one axis overlap (long plan names side by side, level or turned): their
    text boxes, as the renderer lays them out, share no area (half a pixel of slack)."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            shown = [
                t
                for tick in axis._update_ticks()
                for t in (tick.label1, tick.label2)
                if t.get_visible() and t.get_text().strip()
            ]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in shown]
            for i, (a, ea) in enumerate(boxes):
                for b, eb in boxes[i + 1 :]:
                    wide = min(ea.x1, eb.x1) - max(ea.x0, eb.x0)
                    high = min(ea.y1, eb.y1) - max(ea.y0, eb.y0)
                    assert wide <= 0.5 or high <= 0.5, f"tick labels {a!r} and {b!r} overlap: {ea} {eb}"


def _drawn_texts(fig, renderer) -> list[tuple[str, Any]]:
    """Every text artist the figure draws, each on its own: the suptitle and figure texts, axes titles,
    axis labels, legend entries, annotations and the tick labels of the ticks in view (an axis keeps
    labels of ticks outside its view limits, which are not drawn). A text clipped to its axes counts as
    far as it is drawn, not beyond."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    ticks = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((tick.label1, tick.label2))
    shown = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis._update_ticks():
                shown.update(t for t in (tick.label1, tick.label2) if t.get_visible())
    out = []
    for t in fig.findobj(Text):
        if not (t.get_visible() and t.get_text().strip()) or (t in ticks and t not in shown):
            continue
        ext = t.get_window_extent(renderer)
        if t.get_clip_on() and t.get_clip_box() is not None and t not in shown:
            ext = Bbox.intersection(ext, t.get_clip_box())
            if ext is None:  # wholly outside its axes: not drawn
                continue
        out.append((t.get_text(), ext))
    assert out
    return out


def _pool_top(art, kind: str) -> float:
    """The largest |x| of any site of ``kind`` in any profile (what a histogram's x range must show)."""
    return max(
        s.kth_largest(1)
        for p in art.profiles.values()
        for s in p.sites.values()
        if s.kind == kind and s.count
    )


# ------------------------------------------------------------------------------------------ colours
def test_model_colors_fixed_per_kind_and_distinct():
    colors = model_colors([("b", "baseline"), ("d1", "diff_v1"), ("d2", "diff_v2")])
    assert colors == {n: KIND_COLORS[k] for n, k in (("b", "baseline"), ("d1", "diff_v1"), ("d2", "diff_v2"))}
    # order of listing does not change the colour of the first model of a kind
    assert model_colors([("d2", "diff_v2"), ("b", "baseline")]) == {"d2": colors["d2"], "b": colors["b"]}
    many = model_colors([(f"m{i}", ["baseline", "diff_v1", "diff_v2", "other"][i % 4]) for i in range(24)])
    assert len(set(many.values())) == 24
    assert many["m4"] != many["m0"]


def _hue(color: str) -> float:
    import colorsys

    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hsv(r, g, b)[0]


def test_models_of_one_kind_get_hues_of_their_own():
    """SmolLM2 and Gemma (both baseline) used to be two shades of one blue: now the second model of a kind
    takes a hue of its own, as far from every other model's as a kind's own colour is."""
    colors = model_colors([("smollm2", "baseline"), ("gemma3-270m", "baseline"), ("diff", "diff_v1")])
    assert colors["smollm2"] == KIND_COLORS["baseline"] and colors["diff"] == KIND_COLORS["diff_v1"]
    hues = [_hue(c) for c in colors.values()]
    gaps = [min(abs(a - b), 1 - abs(a - b)) for i, a in enumerate(hues) for b in hues[i + 1 :]]
    assert min(gaps) > 0.05, colors  # two shades of blue are ~0.02 apart in hue


def test_import_is_light():
    code = "import sys, diffquant, diffquant.plots; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ------------------------------------------------------------------------------------------ figures
@pytest.mark.parametrize("kind", ["logits", "resid"])
def test_histograms(art, tmp_path, kind):
    colors = art.colors()
    fig = fig_histograms(art.profiles, kind, colors=colors)
    (ax,) = fig.axes
    assert sorted(_labelled(ax)) == sorted(MODELS)
    for line in ax.get_lines():
        if line.get_label() in MODELS:
            assert line.get_color() == colors[line.get_label()]
    assert ax.get_yscale() == "log"
    xs = [line.get_xdata()[0] for line in ax.get_lines() if len(line.get_xdata()) == 2]  # axvlines
    assert 6.0 in xs  # the LLM.int8 threshold
    # the x range is where the data is: the largest |x| inside (with a margin), the bulk's start as low end
    low, high = ax.get_xlim()
    top = _pool_top(art, kind)
    assert low < top < high <= 2.5 * 1.3 * max(top, 6.0)
    assert top * 1.1 < high  # the tail's last bin and the top-1 marker are not on the frame
    medians = [s.quantile(0.5) for p in art.profiles.values() for s in p.sites.values() if s.kind == kind]
    # log x only when the data span decades above the median (a pool's median is at least its smallest
    # site median, so this ratio bounds the pool's from above)
    spans_decades = high / min(m for m in medians if m > 0) >= HIST_LOG_RATIO
    assert ax.get_xscale() == "linear" or spans_decades
    assert (low == 0.0) == (ax.get_xscale() == "linear")
    _assert_readable(fig)
    _assert_png(fig, tmp_path)


def test_histograms_per_layer(art, tmp_path):
    fig = fig_histograms(art.profiles, "q", per_layer=True)
    assert len(fig.axes) == 2  # two layers
    for ax in fig.axes:
        assert sorted(_labelled(ax)) == sorted(MODELS)
    limits = {ax.get_xlim() for ax in fig.axes}
    assert len(limits) == 1  # one x range for every layer
    (low, high), top = limits.pop(), _pool_top(art, "q")
    assert low < top < high
    _assert_readable(fig)
    _assert_png(fig, tmp_path)


def _pool(bins: dict[int, int], top1: float, mean: float = 0.0, std: float = 0.1) -> Pool:
    return Pool(count=sum(bins.values()), mean=mean, std=std, top1=top1, bins=bins, sites=1)


def test_histogram_x_range_follows_the_data():
    from diffquant.profile.stats import R

    def index(value: float) -> int:
        import math

        return math.floor(math.log(value) / math.log(R))

    # median |x| ~1 with a tail to 30: linear from 0, so the tail takes most of the width
    tail = {index(1e-6): 1, index(1e-2): 5_000, index(1.0): 100_000, index(10.0): 500, index(30.0): 1}
    low, high, log = hist_xlimits({"a": _pool(tail, 30.0, std=1.0)})
    assert not log and low == 0.0 and 30.0 < high <= 1.3 * 30.0 * 1.01
    # massive values (2,000, three decades above the median): log x, from the bulk's low end
    massive = tail | {index(2000.0): 2}
    low, high, log = hist_xlimits({"a": _pool(massive, 2000.0, std=1.0)})
    assert log and 2000.0 < high <= 1.3 * 2000.0 * 1.01
    assert 1e-6 < low <= 1e-2  # the 1e-6 straggler (one value in 105,503) is left out
    dropped = sum(c for j, c in massive.items() if R ** (j + 1) <= low)
    assert dropped <= HIST_LOW_QUANTILE * sum(massive.values())
    # the model with the largest |x| decides the high end
    _, high2, _ = hist_xlimits({"a": _pool(tail, 30.0, std=1.0), "b": _pool({index(50.0): 3}, 50.0)})
    assert high2 > 50.0
    # a narrow pool (no marker in reach): linear axis from 0 to just past the data
    narrow = {index(0.2): 10, index(0.5): 100, index(0.9): 5}
    low, high, log = hist_xlimits({"a": _pool(narrow, 0.95, std=0.01)})
    assert not log and low == 0.0 and 0.95 < high < 1.5
    # the LLM.int8 line is brought into view when the data reach within 2.5x of it
    low, high, _ = hist_xlimits({"a": _pool(narrow | {index(3.0): 1}, 3.0, std=0.01)})
    assert high > 6.0


def test_layerwise(art, tmp_path):
    fig = fig_layerwise(art.profiles, "resid", colors=art.colors())
    (ax,) = fig.axes
    assert sorted(_labelled(ax)) == sorted(MODELS)  # one legend entry (the top-1 line) per model
    assert len(ax.get_lines()) == 4 * len(MODELS)  # top-1/2/3 and median per model
    assert ax.get_yscale() == "log"
    _assert_readable(fig)
    _assert_png(fig, tmp_path)


def test_attention_maps(art, tmp_path):
    fig = fig_attention_maps(art.maps, layer=1, head=0, max_len=48)
    with_images = [ax for ax in fig.axes if ax.images]
    assert len(with_images) == 4 + 4 + 1  # two DIFF rows of four panels, one baseline panel
    assert all(len(ax.images) == 1 for ax in with_images)
    titles = [ax.get_title() for ax in with_images]
    assert sum(t.startswith("diff_v1:") for t in titles) == 4 and "baseline: softmax A" in titles
    assert all(ax.images[0].get_array().shape == (48, 48) for ax in with_images)
    for ax in with_images:  # diverging map centred at zero
        lo, hi = ax.images[0].get_clim()
        assert ax.images[0].get_cmap().name.startswith("RdBu_r") and lo == pytest.approx(-hi)
    # DIFF V2: lambda * A2 uses lambda at each query row; A1 - lambda*A2 equals the model's own diff_map
    maps = art.maps["diff_v2"][0]
    lam, a2 = maps["layers.1.lambda"][0, :48].double(), maps["layers.1.probs2"][0, :48, :48].double()
    by_title = {ax.get_title().split("\n")[0]: ax.images[0].get_array() for ax in with_images}
    shown = np.ma.filled(by_title["diff_v2: λ·A2"], 0.0)
    np.testing.assert_allclose(shown, np.tril((lam[:, None] * a2).numpy()), atol=1e-12)
    diff = np.ma.filled(by_title["diff_v2: A1 − λ·A2"], 0.0)
    np.testing.assert_allclose(
        diff, np.tril(maps["layers.1.diff_map"][0, :48, :48].double().numpy()), atol=1e-6
    )
    _assert_readable(fig)
    _assert_png(fig, tmp_path)
    with pytest.raises(DiffquantError, match="head 7"):
        fig_attention_maps(art.maps, layer=0, head=7)


def test_attention_maps_of_one_real_sized_model_fit_the_canvas(tmp_path):
    """SmolLM2's run: one baseline model, so one panel column and a narrow figure, under a suptitle as long
    as any run's (layer 15 of 30, 256 tokens) and a model named like its checkpoint folder. The suptitle
    (once 5.6 in wide on a 3.3 in canvas, cut on both sides) and the panel title stay inside."""
    import torch

    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(9, 256, 256, dtype=torch.float64), dim=-1).tril()  # SmolLM2: 9 heads
    fig = fig_attention_maps({"SmolLM2-135M-Instruct": {"layers.15.probs": probs}}, layer=15, head=0)
    assert "first 256 tokens" in fig.texts[0].get_text()
    _assert_readable(fig)
    _assert_png(fig, tmp_path)


def test_degradation(art, tmp_path):
    colors = art.colors()
    fig = fig_degradation(art.results, art.sweep, colors=colors)
    *curve_axes, bars_ax = fig.axes
    assert len(curve_axes) == len(MODELS)  # one panel per model
    assert len({ax.get_ylim() for ax in curve_axes}) == 1  # one y scale: a steeper curve is a larger loss
    values = [r["value"] for r in art.results["rows"] if r["metric"] == "bits_per_byte"]
    low, high = curve_axes[0].get_ylim()
    assert low <= min(values) and max(values) <= high
    lines = [ln for ax in curve_axes for ln in ax.get_lines()]
    labels = [ln.get_label() for ln in lines if not ln.get_label().startswith("_")]
    assert sorted(labels) == sorted(f"{m} · {g}" for m in MODELS for g in ("per-tensor", "per-row"))
    for line in lines:
        if not line.get_label().startswith("_"):
            assert list(line.get_xdata()) == [4.0, 8.0, 32.0]  # the unquantized fp32 model at 32 bits
            assert line.get_color() == colors[line.get_label().split(" · ")[0]]
    assert sum(ln.get_label() == "_ref" for ln in lines) == len(MODELS)  # unquantized levels
    # w8a8 mixes granularities: it is a bar per model in the second panel
    assert [c.get_label() for c in bars_ax.containers] == list(MODELS)
    assert [t.get_text() for t in bars_ax.get_xticklabels()] == ["w8a8"]
    # the unquantized point is labelled by the dtype the sweep ran the model in, not "16 (none)"
    assert art.results["dtypes"] == dict.fromkeys(MODELS, "float32")
    for ax in curve_axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8", "32\n(fp32)"]
    _assert_readable(fig)
    # the bar panel's legend sits beside the bars, on none of them
    renderer = fig.canvas.get_renderer()
    legend = bars_ax.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for c in bars_ax.containers for patch in c]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    _assert_png(fig, tmp_path)
    with pytest.raises(DiffquantError, match="no task 'nope'"):
        fig_degradation(art.results, art.sweep, task="nope")


def test_degradation_shares_y_and_marks_chance():
    """Synthetic retrieval results: one y scale for models of very different levels, and the chance line."""
    from diffquant.quant.plan import preset

    plans = {"none": None, **{p: preset(p).to_dict() for p in ("attn-logits-int8", "attn-logits-int4")}}
    levels = {"a": 0.9, "b": 0.3}
    rows = []
    for model, level in levels.items():
        for k, plan in enumerate(plans):
            for metric, value in (("acc_rank", level - 0.1 * k), ("chance_rank", 0.25)):
                rows.append(
                    {"model": model, "attention": "baseline", "plan": plan, "task": "retrieval",
                     "metric": metric, "value": value, "unquantized": level if metric == "acc_rank" else 0.25,
                     "delta": -0.1 * k if metric == "acc_rank" else 0.0}
                )  # fmt: skip
    results = {"primary": {"retrieval": {"metric": "acc_rank", "higher_is_better": True}}, "rows": rows}
    fig = fig_degradation(results, {"models": {"a": "x", "b": "y"}, "plans": plans}, "retrieval")
    ax_a, ax_b = fig.axes
    assert ax_a.get_ylim() == ax_b.get_ylim()
    low, high = ax_a.get_ylim()
    assert low <= 0.3 - 0.2 and high >= 0.9  # both models' whole curves in the one range
    for ax in (ax_a, ax_b):
        (chance,) = [ln for ln in ax.get_lines() if ln.get_label() == "_chance"]
        assert list(chance.get_ydata()) == [0.25, 0.25]
        assert any(t.get_text() == "chance (0.25)" for t in ax.get_legend().get_texts())
    _assert_readable(fig)


def test_degradation_bars_legend_beside_the_bars_and_dtype_label():
    """SmolLM2's sweep shape: one model, and plans that are no single curve (W8A8 two ways, LLM.int8) as
    bars tall enough to fill their panel: the legend goes beside them, on none of them. The model ran in
    bfloat16 (the sweep's dtype): its unquantized point is labelled bf16 at 16 bits."""
    from diffquant.quant.plan import preset

    names = ("none", "attn-logits-int8", "w8a8-tensor", "w8a8", "bnb-int8")
    plans = {p: None if p == "none" else preset(p).to_dict() for p in names}
    values = dict(zip(names, (17.0, 17.2, 60.0, 58.0, 59.0), strict=True))
    rows = [
        {"model": "smollm2", "attention": "baseline", "plan": p, "task": "ppl", "metric": "perplexity",
         "value": v, "unquantized": 17.0, "delta": v - 17.0}
        for p, v in values.items()
    ]  # fmt: skip
    results = {"primary": {"ppl": {"metric": "perplexity", "higher_is_better": False}}, "rows": rows}
    fig = fig_degradation(results, {"models": {"smollm2": "x"}, "plans": plans, "dtype": "bfloat16"})
    curve_ax, bars_ax = fig.axes
    assert [t.get_text() for t in curve_ax.get_xticklabels()] == ["8", "16\n(bf16)"]
    _assert_readable(fig)
    renderer = fig.canvas.get_renderer()
    legend = bars_ax.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for c in bars_ax.containers for patch in c]
    assert len(bars) == 3 and not any(legend.overlaps(bar) for bar in bars)


def test_plan_point_classifies_plans():
    from diffquant.quant.plan import preset

    assert plan_point(None) is None
    assert plan_point(preset("attn-logits-int4-row").to_dict()) == (4.0, "per-row")
    assert plan_point(preset("attn-logits-int6").to_dict()) == (6.0, "per-tensor")
    assert plan_point(preset("w8a8").to_dict()) is None  # per-channel weights + per-token inputs
    assert plan_point(preset("w4a8").to_dict()) is None  # two formats
    assert plan_point(preset("bnb-int8").to_dict()) is None  # a backend, no rules
    bits, label = plan_point(preset("mxfp4").to_dict())
    assert label == "mxfp4 blocks" and bits > 4
    # what a plan quantizes besides its rules: w4a8-rtn's one rule is int8 inputs per token, but its weights
    # section makes it W4A8 (int4 RTN weights), no 8-bit per-row point; so for the other sections
    from diffquant.plots.degradation import not_a_point

    for name, why in (
        ("w4a8-rtn", "rtn weights"),
        ("w4a4-rtn", "rtn weights"),
        ("w4a8-quarot-gptq", "gptq weights"),
        ("w4a16-hqq-g128", "hqq weights"),
        ("kv4", "a KV cache"),
        ("bnb-nf4", "a backend"),
    ):
        assert plan_point(preset(name).to_dict()) is None, name
        assert why in not_a_point(preset(name).to_dict()), name
    rotated = {**preset("attn-logits-int4-row").to_dict(), "rotate": preset("quarot").to_dict()["rotate"]}
    assert plan_point(rotated) is None and not_a_point(rotated) == "a rotation"
    smoothed = {**preset("attn-logits-int4-row").to_dict(), "smooth": {"alpha": 0.5}}
    assert plan_point(smoothed) is None and not_a_point(smoothed) == "smoothing"


def test_act_scales(art, tmp_path):
    fig = fig_act_scales(art.profiles, colors=art.colors())
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert sorted(_labelled(ax)) == sorted(MODELS)
    from diffquant.plots.figures import act_peaks, default_act_site

    site = default_act_site(art.profiles)
    assert site in fig.axes[0].get_title() and act_peaks(art.profiles)[site] == max(
        act_peaks(art.profiles).values()
    )
    width = art.profiles["baseline"].sites[site].summary()["channel_absmax_shape"][0]
    assert len(fig.axes[0].get_lines()[0].get_xdata()) == width
    _assert_readable(fig)
    _assert_png(fig, tmp_path)
    with pytest.raises(DiffquantError, match="no per-channel"):
        fig_act_scales(art.profiles, site="no.such.site")


# SmolLM2-135M's Linears: per layer (name, input width); d_model 576, MLP 1536.
SMOLLM2_LINEARS = (("attn.q", 576), ("attn.k", 576), ("attn.v", 576), ("attn.o", 576),
                   ("mlp.gate", 576), ("mlp.up", 576), ("mlp.down", 1536))  # fmt: skip


def _act_scales_run(root: Path, peak_site: str, peak: float = 3124.0) -> Path:
    """A run folder holding one synthetic profile of SmolLM2's Linear inputs (three layers of its widths),
    |x| ~ N(0, 1) everywhere but one channel of ``peak_site``, which reaches ``peak``."""
    import torch

    from diffquant.io.artifacts import write_json_atomic
    from diffquant.profile.profiler import Profile
    from diffquant.profile.stats import SiteStats

    gen = torch.Generator().manual_seed(0)
    sites = {}
    for layer in range(3):
        for name, width in SMOLLM2_LINEARS:
            site = f"layers.{layer}.{name}.input"
            x = torch.randn(1, 8, width, generator=gen)
            if site == peak_site:
                x[0, 3, 17] = peak
            stats = SiteStats(site, "linear_in", topk=4)
            stats.update(x)
            sites[site] = stats
    profile = Profile(sites=sites, meta={"model": "smollm2", "attention": "baseline", "tokens": 8})
    write_json_atomic(root / "run" / "profile" / "smollm2.json", profile.to_dict())
    return root / "run"


def test_act_scales_default_is_the_largest_linear(tmp_path, capsys):
    """The default Linear is the one with the largest act scale (SmolLM2: layer 11's down_proj, not the
    first layer's); here the peak sits in a middle Linear, neither the first nor the last profiled."""
    from diffquant.cli import main
    from diffquant.plots.figures import default_act_site

    peak_site = "layers.1.mlp.down.input"
    run = _act_scales_run(tmp_path, peak_site)
    (profile,) = load_run(run, maps=False).profiles.values()
    names = list(profile.sites)
    assert names.index(peak_site) not in (0, len(names) - 1)
    assert default_act_site({"smollm2": profile}) == peak_site
    (record,) = render_run(run, what="act-scales", dpi=DPI)
    assert record.title == f"Per-channel abs-max: {peak_site}" and "largest act scale" in record.caption
    # --linear picks another, by the Linear's name (or its input site's); a bad name lists the choices
    assert main(["plot", str(run), "--what", "act-scales", "--linear", "layers.2.attn.q", "--dpi", "20"]) == 0
    index = json.loads((run / "figures" / "figures.json").read_text())
    assert index["figures"][0]["title"] == "Per-channel abs-max: layers.2.attn.q.input"
    capsys.readouterr()
    assert main(["plot", str(run), "--what", "hist", "act-scales", "--linear", "layers.9.mlp.down"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'layers.9.mlp.down'" in err
    assert "choices: layers.N.attn.q, layers.N.attn.k" in err and "layers.N.mlp.down (N = 0..2)" in err
    assert not (run / "figures" / "hist-linear_in.png").exists()  # refused before drawing anything


def test_lambda(art, tmp_path):
    fig = fig_lambda(art.profiles, colors=art.colors())
    per_layer, per_head = fig.axes
    assert sorted(_labelled(per_layer)) == ["diff_v1", "diff_v2"]  # the baseline has no lambda
    v1 = next(ln for ln in per_layer.get_lines() if ln.get_label() == "diff_v1")
    scalar = art.maps["diff_v1"][0]["layers.0.lambda"].item()
    assert v1.get_ydata()[0] == pytest.approx(scalar, rel=1e-6)
    assert [c.get_label() for c in per_head.containers if c.get_label() in MODELS] == ["diff_v2"]
    heads = art.maps["diff_v2"][0]["layers.0.lambda"].shape[0]
    assert len(per_head.containers[0].lines[0].get_xdata()) == 2 * heads  # layers x heads points
    _assert_readable(fig)
    _assert_png(fig, tmp_path)
    with pytest.raises(DiffquantError, match="no DIFF model"):
        fig_lambda({"baseline": art.profiles["baseline"]})


# --------------------------------------------------------------------------------------- render_run
def test_render_run_writes_every_figure(fresh_run):
    records = render_run(fresh_run, dpi=DPI)
    names = {r.name for r in records}
    kinds = ("logits", "resid", "q", "k", "v", "mlp_act", "linear_in")
    expected = {f"hist-{k}" for k in kinds} | {f"hist-layers-{k}" for k in kinds}
    expected |= {
        "layerwise-resid",
        "layerwise-logits",
        "maps-L1-H0",
        "degradation-bpb",
        "act-scales",
        "lambda",
    }
    assert names == expected
    assert {r.kind for r in records} == set(FAMILIES)
    on_disk = {p.name for p in (fresh_run / "figures").iterdir()}
    assert on_disk == {f"{n}.png" for n in expected} | {"figures.json"}  # no temporary files left
    for r in records:
        assert r.paths == (fresh_run / "figures" / f"{r.name}.png",) and r.caption
    index = json.loads((fresh_run / "figures" / "figures.json").read_text())
    assert {e["name"] for e in index["figures"]} == expected
    assert index["figures"][0]["files"][0].startswith("figures/")


def test_render_run_filter_formats_and_layer(fresh_run):
    from matplotlib.image import imread

    records = render_run(fresh_run, what=["maps", "lambda"], formats=("png", "svg"), dpi=60, layer=0, head=1)
    assert [r.name for r in records] == ["maps-L0-H1", "lambda"]
    files = sorted(p.name for p in (fresh_run / "figures").iterdir())
    assert files == ["figures.json", "lambda.png", "lambda.svg", "maps-L0-H1.png", "maps-L0-H1.svg"]
    assert "<svg" in (fresh_run / "figures" / "lambda.svg").read_text()[:2000]
    assert imread(fresh_run / "figures" / "lambda.png").shape[:2] == (4 * 60, 11 * 60)  # figsize 11 x 4 in
    with pytest.raises(DiffquantError, match="unknown figure 'histo'"):
        render_run(fresh_run, what=["histo"])
    with pytest.raises(DiffquantError, match="attention maps hold layers"):
        render_run(fresh_run, what="maps", layer=5)


def test_render_run_skips_missing_optional_parts(fresh_run):
    shutil.rmtree(fresh_run / "sweep")
    for name in ("diff_v1", "diff_v2"):
        (fresh_run / "profile" / f"{name}.json").unlink()
        (fresh_run / "profile" / f"{name}.maps.safetensors").unlink()
    records = render_run(fresh_run, dpi=DPI)
    assert {r.kind for r in records} == set(FAMILIES) - {"lambda", "degradation"}
    with pytest.raises(DiffquantError, match="cannot draw 'degradation'"):
        render_run(fresh_run, what=["degradation"])
    with pytest.raises(DiffquantError, match="cannot draw 'lambda'"):
        render_run(fresh_run, what=["lambda"])


def test_render_run_eval_layout(tmp_path, run_dir):
    """`diffquant eval --out RUN` puts results.json and sweep.json at the top of the folder."""
    run = tmp_path / "eval"
    run.mkdir()
    for name in ("results.json", "sweep.json"):
        shutil.copy(run_dir / "sweep" / name, run / name)
    records = render_run(run, dpi=DPI)
    assert [r.name for r in records] == ["degradation-bpb"]
    (run / "sweep.json").unlink()
    with pytest.raises(DiffquantError, match="sweep.json: sweep description not found"):
        render_run(run)


# ------------------------------------------------------------------------------------------- errors
def _one_line_error(run: Path, match: str, **kwargs) -> str:
    with pytest.raises(DiffquantError) as info:
        render_run(run, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and match in msg, msg
    return msg


def test_error_empty_run_folder(tmp_path):
    _one_line_error(tmp_path, str(tmp_path))
    _one_line_error(tmp_path / "missing", "run folder not found")


def test_error_corrupt_profile(fresh_run):
    path = fresh_run / "profile" / "diff_v1.json"
    path.write_text(path.read_text()[:5000])
    assert "not valid JSON" in _one_line_error(fresh_run, str(path))


def test_error_profile_of_another_version(fresh_run):
    path = fresh_run / "profile" / "baseline.json"
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    assert "99" in _one_line_error(fresh_run, str(path))


def test_error_malformed_profile_structure(fresh_run):
    path = fresh_run / "profile" / "diff_v2.json"
    data = json.loads(path.read_text())
    del data["sites"]["layers.0.resid"]["hist"]
    path.write_text(json.dumps(data))
    _one_line_error(fresh_run, str(path))


def test_error_corrupt_or_missing_maps(fresh_run):
    path = fresh_run / "profile" / "diff_v2.maps.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header!!}")
    _one_line_error(fresh_run, str(path))
    path.unlink()
    _one_line_error(fresh_run, str(path))
    # figures that do not need the maps still render
    assert [r.name for r in render_run(fresh_run, what="lambda", dpi=DPI)] == ["lambda"]


def test_error_corrupt_sweep_results(fresh_run):
    path = fresh_run / "sweep" / "results.json"
    path.write_text("{")
    _one_line_error(fresh_run, str(path), what="degradation")


# ------------------------------------------------------------------- plotted values against the data
def test_layerwise_plots_the_profile_values(art):
    """Every point of every curve equals tables.layerwise of that model's profile (top-1/2/3, median)."""
    from diffquant.profile.tables import layerwise

    fig = fig_layerwise(art.profiles, "resid", colors=art.colors())
    (ax,) = fig.axes
    seen = 0
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith("_massive"):
            continue
        name, _, stat = label.lstrip("_").partition(" ")
        stat = stat or "top1"
        rows = layerwise(art.profiles[name], "resid")
        assert list(line.get_xdata()) == [r["layer"] for r in rows]
        assert list(line.get_ydata()) == [r[stat] for r in rows], (name, stat)
        seen += 1
    assert seen == 4 * len(MODELS)


def test_histogram_plots_the_profile_counts(art):
    """The step curve of each model holds the profile's own |x| histogram: its counts add up to every
    non-zero finite value of the pooled sites, and its last bin holds the top-1 magnitude."""
    fig = fig_histograms(art.profiles, "resid", colors=art.colors())
    ax = fig.axes[0]
    for name in MODELS:
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == name]
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        counts = [c for c in ys[:-1] if c == c]  # the last y repeats the last bin (steps-post); NaN = gap
        sites = [s for s in art.profiles[name].sites.values() if s.kind == "resid" and s.count]
        assert sum(counts) == sum(s.count - s.zero_count for s in sites)
        top1 = max(s.kth_largest(1) for s in sites)
        assert xs[-2] <= top1 < xs[-1]


def test_degradation_plots_the_results(art):
    """Each curve point (bits, value) is the result row of that model and plan: 32 bits = unquantized fp32."""
    fig = fig_degradation(art.results, art.sweep, colors=art.colors())
    rows = {
        (r["model"], r["plan"]): r["value"] for r in art.results["rows"] if r["metric"] == "bits_per_byte"
    }
    *curve_axes, _ = fig.axes
    checked = 0
    for line in (ln for ax in curve_axes for ln in ax.get_lines()):
        label = line.get_label()
        if label.startswith("_"):
            continue
        model, gran = label.split(" · ")
        suffix = "" if gran == "per-tensor" else "-row"
        want = [rows[(model, f"attn-logits-int4{suffix}")], rows[(model, f"attn-logits-int8{suffix}")]]
        want.append(rows[(model, "none")])
        assert list(line.get_ydata()) == pytest.approx(want, rel=0, abs=0), label
        checked += 1
    assert checked == 2 * len(MODELS)


def test_act_scales_plot_the_channel_absmax(art):
    fig = fig_act_scales(art.profiles, colors=art.colors())
    from diffquant.plots.figures import default_act_site

    by_index, by_rank = fig.axes
    site = default_act_site(art.profiles)
    for name in MODELS:
        absmax = art.profiles[name].sites[site].summary()["channel_absmax"]
        (line,) = [ln for ln in by_index.get_lines() if ln.get_label() == name]
        assert list(line.get_ydata()) == [max(v, 1e-12) for v in absmax]
        (ranked,) = [ln for ln in by_rank.get_lines() if ln.get_label() == name]
        assert list(ranked.get_ydata()) == sorted((max(v, 1e-12) for v in absmax), reverse=True)
