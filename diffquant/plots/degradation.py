"""Degradation under quantization: a task's primary metric vs bits per model, other plans as bars."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from diffquant.errors import DiffquantError
from diffquant.plots.common import legend_proxy
from diffquant.plots.noise import BINOMIAL, PAIRED, UNPAIRED, Interval, Z, interval_of_change, measures
from diffquant.plots.style import MAX_WIDTH_IN, colors_for, new_figure, style_context
from diffquant.quant.plan import QuantPlan, upgrade_plan
from diffquant.quant.schemes import bits_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 2)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _granularity_label(scheme: Any) -> str:
    """The line a single-format plan belongs to: granularity plus anything else that changes the error."""
    if scheme.is_block_format:
        return f"{scheme.format} blocks"
    gran = "row" if scheme.granularity in ("row", "token") else scheme.granularity
    label = f"per-{gran}"
    if not scheme.format.startswith(("int", "uint")):
        label = f"{scheme.format} {label}"
    if scheme.asymmetric:
        label += " asym"
    if scheme.is_static:
        label += f" {scheme.calibration}"
    if scheme.smooth:
        label += " smooth"
    if scheme.scale is not None:
        label += " fixed-scale"
    if scheme.scale_format != "fp32":
        label += f" {scheme.scale_format}-scales"
    return label


def _read_plan(plan: Mapping[str, Any]) -> QuantPlan:
    # a sweep recorded before the plan keys were renamed reads in today's spelling
    return QuantPlan.from_dict(upgrade_plan(dict(plan)), source=f"plan {plan.get('name')!r}")


def not_a_point(plan: Mapping[str, Any] | None) -> str | None:
    """Why a plan is no point on a bit-width line (what else it quantizes or changes), from the plan itself;
    None for a plan whose rules are its whole effect. Raises DiffquantError on a malformed plan.

    A plan's ``weights`` section (RTN / GPTQ / HQQ / AWQ codes), ``backend``, ``kv_cache``, ``rotate`` and
    ``smooth`` quantize or change what its rules do not show: ``w4a8-rtn``'s only rule is int8 Linear
    inputs per token, yet it is a W4A8 plan with int4 weights."""
    if plan is None:
        return "the unquantized model"
    qp = _read_plan(plan)
    if qp.weights is not None:
        return f"{qp.weights.method} weights (its weights section)"
    for what, section in (
        ("a backend", qp.backend),
        ("a KV cache", qp.kv_cache),
        ("a rotation", qp.rotate),
        ("smoothing", qp.smooth),
    ):
        if section is not None:
            return what
    if not qp.rules:
        return "no rules"
    return None


def plan_point(plan: Mapping[str, Any] | None) -> tuple[float, str] | None:
    """(bits, line label) for a plan made of one number format at one granularity, else None.

    Such plans lie on a bits axis (int8 -> int6 -> int4 per-tensor is one curve); plans mixing formats or
    granularities (w4a8, w8a8 with per-channel weights and per-token inputs), and plans that quantize
    anything besides their rules (a weights section such as w4a8-rtn's int4 RTN weights, a backend, a KV
    cache) or rotate or smooth first (:func:`not_a_point`), do not, and are shown as bars instead. Raises
    DiffquantError on a malformed plan.
    """
    if not_a_point(plan) is not None:
        return None
    schemes = [rule.scheme for rule in _read_plan(plan).rules]  # type: ignore[arg-type]
    if len({s.format for s in schemes}) != 1:
        return None
    labels = {_granularity_label(s) for s in schemes}
    if len(labels) != 1:
        return None
    return bits_of(schemes[0]), labels.pop()


def plan_targets(plan: Mapping[str, Any]) -> str:
    """What a plan's rules quantize, in words: their site patterns and ``weights PATTERN`` (sorted), e.g.
    ``kind:logits`` or ``layers.*.input, weights layers.*``."""
    found: set[str] = set()
    for rule in _read_plan(plan).rules:
        found.update(rule.sites)
        found.update(f"weights {w}" for w in rule.modules)
    return ", ".join(sorted(found))


def chance_metric(metric: str) -> str:
    """Name of the metric a task reports as the chance level of ``metric`` (acc_rank -> chance_rank)."""
    return "chance_" + metric.split("_", 1)[1] if "_" in metric else "chance"


def chance_levels(results: Mapping[str, Any], task: str) -> dict[str, float]:
    """{model: chance level of the task's primary metric}, where the task reports one (retrieval's
    ``chance_rank``); taken from the unquantized cell, else any cell of the model."""
    primary = (results.get("primary") or {}).get(task) or {}
    metric = primary.get("metric")
    if not metric:
        return {}
    names = {chance_metric(metric), "chance"}
    out: dict[str, float] = {}
    for r in results.get("rows", []):
        value = r.get("value")
        if r.get("task") != task or r.get("metric") not in names:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if number and (r.get("plan") == "none" or r["model"] not in out):
            out[r["model"]] = float(value)
    return out


# The unquantized model on the bits axis: its dtype's short name and width.
DTYPE_BITS = {"float32": ("fp32", 32.0), "bfloat16": ("bf16", 16.0), "float16": ("fp16", 16.0)}


def unquantized_dtypes(results: Mapping[str, Any], sweep: Mapping[str, Any]) -> dict[str, str]:
    """{model: dtype name (``float32``)} of the unquantized cells: what the sweep recorded per model
    (results.json ``dtypes``), else the sweep's ``dtype`` setting for every model; {} when neither says."""
    spec = sweep.get("spec", sweep)
    recorded = results.get("dtypes")
    out = {str(m): str(d) for m, d in recorded.items()} if isinstance(recorded, Mapping) else {}
    if spec.get("dtype"):
        for model in spec.get("models") or {}:
            out.setdefault(str(model), str(spec["dtype"]))
    return out


def _unquantized_point(dtype: str | None) -> tuple[float, str]:
    """(x position, tick label) of the unquantized model: its dtype's width and name; a dtype the run
    does not record sits at 16 bits, labelled as unquantized only."""
    short, bits = DTYPE_BITS.get(dtype or "", (None, 16.0))
    return bits, f"{bits:g}\n({short})" if short else "unquantized"


def change_intervals(
    results: Mapping[str, Any], task: str, task_type: str | None = None
) -> dict[tuple[str, str], Interval]:
    """{(model, plan): interval of the change vs the model unquantized} of a task's primary metric
    (:func:`diffquant.plots.noise.interval_of_change`: ± 2 standard errors paired over windows where the
    results keep per-window tallies, else unpaired; Newcombe's score interval for accuracies over n items)."""
    metric = ((results.get("primary") or {}).get(task) or {}).get("metric")
    cells = measures(results, task)
    out = {}
    for (model, plan), cell in cells.items():
        ref = cells.get((model, "none"))
        if plan == "none" or ref is None:
            continue
        interval = interval_of_change(str(metric), task_type or task, cell, ref)
        if interval is not None:
            out[(model, plan)] = interval
    return out


def error_bar_note(intervals: Mapping[tuple[str, str], Interval]) -> str | None:
    """The figure's line saying what its error bars are (and which cells fell back to what), or None."""
    if not intervals:
        return None
    bases = {i.basis for i in intervals.values()}
    windows = sorted({i.windows for i in intervals.values() if i.windows})
    parts = []
    if PAIRED in bases:
        over = f" over {windows[0]:,} windows" if len(windows) == 1 else " over the windows"
        parts.append(f"paired{over} (sd of per-window differences / sqrt(n))")
    if UNPAIRED in bases:
        parts.append("unpaired where no per-window values are kept (each cell's own s.e.)")
    if BINOMIAL in bases:
        parts.append("Newcombe score interval (binomial)")
    return f"Error bars: change vs unquantized ± {Z:g} s.e., " + "; ".join(parts)


def _yerr(points: list[tuple[float, float, Interval | None]]) -> np.ndarray:
    """(2, N) lower / upper error-bar lengths around each point's value (0 where no interval is known)."""
    low, high = [], []
    for _, _, interval in points:
        if interval is None:
            low.append(0.0)
            high.append(0.0)
        else:
            low.append(max(0.0, interval.center - interval.low))
            high.append(max(0.0, interval.high - interval.center))
    return np.array([low, high])


def _error_bars(ax: Axes, xs: list[float], ys: list[float], yerr: np.ndarray, color: str, cap: float) -> None:
    """Vertical error bars (yerr: (2, N) below / above), drawn but kept out of ``ax.containers`` (which
    hold the bars, one container per model)."""
    drawn = ax.errorbar(xs, ys, yerr=yerr, fmt="none", ecolor=color, elinewidth=0.9, capsize=cap)
    drawn.set_label("_errorbar")
    ax.containers.remove(drawn)


def _fit_tick_labels(fig: Figure, ax: Axes) -> None:
    """Turn an axis's tick labels vertical when, laid out level, any two overlap (long plan names side by
    side: ``w4a8-quarot-rtnw4a8-quarot-gptq``); measured with the figure's own renderer after layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (matplotlib is lazy here)

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    pad = 4.0  # pixels of air between two labels
    crowded = any(a.x1 + pad > b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    if crowded:
        for label in ax.get_xticklabels():
            label.set_rotation(90)
            label.set_horizontalalignment("center")


def fig_degradation(
    results: Mapping[str, Any],
    sweep: Mapping[str, Any],
    task: str | None = None,
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """The task's primary metric vs bits, one panel per model (one line per granularity); other plans as bars.

    Why: the DIFF paper's Figure 8 claim is that DIFF degrades more gracefully as attention logits lose
    bits, and per-row scales shift where each architecture breaks. x is bits per element (log2 axis,
    the unquantized model at its dtype's width, labelled fp32 / bf16 / fp16 as the sweep recorded it, also
    drawn as a dotted horizontal line per model). The model panels share
    one y scale, so a steeper curve is a larger loss whichever panel it is in; where the task reports a
    chance level (retrieval), it is drawn as a grey dashed line. Plans that are not one format at one
    granularity (mixed weight/activation formats, weights sections such as RTN / GPTQ codes, backends, KV
    caches, rotation: :func:`plan_point`) get a panel of their own below: grouped bars of the change vs
    unquantized, per model. Error bars (curve points and bars alike) are ± 2 standard errors of the change
    vs unquantized, paired over the windows both cells scored where the results keep per-window tallies
    (:func:`change_intervals`; the figure's bottom line says which rule each bar rests on). ``results`` /
    ``sweep``: the contents of results.json / sweep.json (or the sweep's ``spec``). ``fig.axes``: the model
    panels in order, then the bar panel.
    """
    primary = results.get("primary") or {}
    if task is None:
        if not primary:
            raise DiffquantError("sweep results name no task")
        task = next(iter(primary))
    if task not in primary:
        raise DiffquantError(f"sweep results have no task {task!r}; tasks: {', '.join(primary)}")
    metric, higher = primary[task]["metric"], bool(primary[task]["higher_is_better"])
    spec = sweep.get("spec", sweep)
    plans: Mapping[str, Any] = spec.get("plans") or {}
    rows = [
        r
        for r in results.get("rows", [])
        if r.get("task") == task and r.get("metric") == metric and isinstance(r.get("value"), (int, float))
    ]
    if not rows:
        raise DiffquantError(f"sweep results hold no {metric!r} values for task {task!r}")
    models = [m for m in spec.get("models", {}) if any(r["model"] == m for r in rows)]
    models += [m for m in dict.fromkeys(r["model"] for r in rows) if m not in models]
    kinds = {r["model"]: str(r.get("attention", "")) for r in rows}
    colors = colors_for(models, kinds, colors)
    value = {(r["model"], r["plan"]): r for r in rows}
    chance = chance_levels(results, task)
    dtypes = unquantized_dtypes(results, sweep)
    task_type = next(
        (
            str(t.get("type"))
            for t in spec.get("tasks", [])
            if isinstance(t, Mapping) and (t.get("name") or t.get("type")) == task
        ),
        task,
    )
    intervals = change_intervals(results, task, task_type)

    points: dict[str, tuple[float, str]] = {}
    targets: dict[str, str] = {}
    other: list[str] = []
    taken: set[tuple[float, str, str]] = set()
    plan_names = list(plans) + [p for p in dict.fromkeys(r["plan"] for r in rows) if p not in plans]
    for plan in plan_names:
        if plan == "none" or not any((m, plan) in value for m in models):
            continue
        point = plan_point(plans.get(plan))
        where = plan_targets(plans[plan]) if point is not None else ""
        if point is None or (*point, where) in taken:  # two plans at one (bits, line): no single curve
            other.append(plan)
        else:
            taken.add((*point, where))
            points[plan] = point
            targets[plan] = where
    if len(set(targets.values())) > 1:  # lines of plans that quantize different things: say what each does
        points = {plan: (bits, f"{label} ({targets[plan]})") for plan, (bits, label) in points.items()}
    lines = list(dict.fromkeys(label for _, label in points.values()))
    if not points and not other:
        raise DiffquantError(f"sweep results for task {task!r} hold no quantized plan")

    direction = "higher" if higher else "lower"
    with style_context():
        # Model panels in rows of at most three (each wide enough to read in the report), the bar panel
        # below them across the whole width (wider with many plans, up to the report's column).
        curve_models = models if points else []
        ncols = max(1, min(3, len(curve_models)))
        curve_rows = math.ceil(len(curve_models) / ncols) if curve_models else 0
        nrows = curve_rows + int(bool(other))
        width = min(MAX_WIDTH_IN, max(6.4, 3.6 * ncols, 2.2 + 0.55 * len(other) * max(1, len(models)) ** 0.5))
        longest = max((len(p) for p in other), default=0)
        bar_height = 2.8 + (0.075 * longest if other else 0.0)  # room for plan names turned vertical
        note = error_bar_note(intervals)
        fig = new_figure(width, 3.4 * curve_rows + (bar_height if other else 0.0) + (0.3 if note else 0.0))
        grid = fig.add_gridspec(
            nrows, ncols, height_ratios=[3.4] * curve_rows + ([bar_height] if other else [])
        )
        first: Axes | None = None
        for k, name in enumerate(curve_models):
            ax = fig.add_subplot(grid[k // ncols, k % ncols], sharey=first)
            first = first or ax
            ticks: set[float] = set()
            ref = next(
                (r["unquantized"] for r in rows if r["model"] == name and r["unquantized"] is not None),
                None,
            )
            if ref is None and (name, "none") in value:
                ref = value[(name, "none")]["value"]
            ref_bits, ref_label = _unquantized_point(dtypes.get(name))
            for i, line in enumerate(lines):
                pts = sorted(
                    (bits, value[(name, plan)]["value"], intervals.get((name, plan)))
                    for plan, (bits, label) in points.items()
                    if label == line and (name, plan) in value
                )
                if not pts:
                    continue
                spread = [p for p in pts if p[2] is not None]
                if spread:
                    _error_bars(
                        ax, [p[0] for p in spread], [p[1] for p in spread], _yerr(spread), colors[name], 3
                    )
                if ref is not None:
                    pts.append((ref_bits, ref, None))
                ticks.update(p[0] for p in pts)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=colors[name],
                    linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                    marker=_MARKERS[i % len(_MARKERS)],
                    markersize=5,
                    label=f"{name} · {line}",
                )
            if ref is not None:
                ax.axhline(ref, color=colors[name], linestyle=":", linewidth=0.9, alpha=0.7, label="_ref")
            if name in chance:
                ax.axhline(chance[name], color="0.45", linestyle="--", linewidth=1.0, label="_chance")
            ax.set_xscale("log", base=2)
            ticks_sorted = sorted(ticks)
            ax.set_xticks(ticks_sorted, [(ref_label if t == ref_bits else f"{t:g}") for t in ticks_sorted])
            ax.minorticks_off()
            ax.set_xlabel("bits per element")
            if k % ncols == 0:
                ax.set_ylabel(f"{metric} ({direction} is better)")
            ax.set_title(f"{task}: {name}")
            ax.ticklabel_format(axis="y", useOffset=False)
            handles = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
            handles.append(
                legend_proxy(
                    color=colors[name],
                    linestyle=":",
                    label=f"unquantized ({ref:.4g})" if ref is not None else "unquantized",
                )
            )
            if name in chance:
                handles.append(
                    legend_proxy(color="0.45", linestyle="--", label=f"chance ({chance[name]:.3g})")
                )
            ax.legend(handles=handles, loc="best")
        if other:
            ax = fig.add_subplot(grid[nrows - 1, :])
            x = np.arange(len(other))
            bar = 0.8 / max(1, len(models))
            for i, name in enumerate(models):
                deltas, spread = [], []
                for plan in other:
                    r = value.get((name, plan))
                    delta = math.nan if r is None or r.get("delta") is None else r["delta"]
                    deltas.append(delta)
                    spread.append((0.0, delta, intervals.get((name, plan))))
                at = x + (i - (len(models) - 1) / 2) * bar
                ax.bar(at, deltas, bar, color=colors[name], label=name)
                if any(s[2] is not None for s in spread):
                    _error_bars(ax, list(at), deltas, _yerr(spread), "black", 2)
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_xticks(x, other)
            ax.set_xlabel("plan")
            ax.set_ylabel(f"Δ {metric}\nvs unquantized")
            ax.set_title(f"{task}: other plans, change vs unquantized ({direction} is better)")
            ax.grid(False, axis="x")
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside the bars
        if note:
            fig.supxlabel(note, fontsize=8.5, wrap=True)
        if other:
            _fit_tick_labels(fig, ax)
    return fig
