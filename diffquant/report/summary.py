"""The report's summary: findings in sentences, each computed from the run's artifacts.

Nothing here is written by hand about models or methods: every sentence names the numbers it rests on, so
a run whose data say otherwise gets other sentences. Three topics:

* outliers: the largest |x| of each model and where it sits (site, layer, position, channel or head), the
  Table 5 comparison between models, massive activations (Sun et al. 2024) and non-finite values;
* quantization: per task, which model is best unquantized and which loses least at each plan (the change
  vs the same model unquantized, signed so that a loss is positive whichever direction is better);
* noise: what the numbers cannot tell apart. Results within 2 standard errors of the task's chance level
  are flagged (retrieval reports its chance level; multiple choice's is 1 / choices, read from the items
  file; for a binomial result this is chance inside its Wilson score interval at z = 2), and so are
  changes vs unquantized and differences between models smaller than 2 standard errors. Bits per byte and
  perplexity are scored on the same windows in every cell, so a change and a difference between models
  (at a quantized plan: between their changes) get a standard error *paired* over the windows
  (:mod:`diffquant.plots.noise`: from the per-window differences, windows matched by index, n - 1 degrees of
  freedom), where the results keep per-window tallies (``per_window`` in results.json) and the windows match;
  otherwise the unpaired rule, named as such: each cell's own standard error from the spread of its windows
  (``bits_per_byte_stderr``, data/scoring.py) added in quadrature. Other tasks use their own standard error
  (``METRIC_stderr``), else, for accuracies over ``n`` items, the binomial sqrt(p (1 - p) / n) (a change:
  Newcombe's score interval from the two Wilson intervals). A cell with none (written before they were
  kept) says that no spread is known rather than guessing one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.eval.multiple_choice import load_mc_jsonl
from diffquant.plots.figures import KIND_TITLES, chance_levels
from diffquant.plots.noise import (
    BINOMIAL,
    PAIRED,
    PAIRED_EACH,
    UNPAIRED,
    Interval,
    Measure,
    Spread,
    Tally,
    interval_of_change,
    se_of_change_difference,
    wilson,
)
from diffquant.plots.noise import se_of_difference as spread_of_difference
from diffquant.profile.tables import describe_location

Z = 2.0  # "within 2 standard errors"
ACCURACY_TASKS = ("retrieval", "mc")  # primary metric is a mean of per-item scores in [0, 1]
NONE_PLAN = "none"


# ------------------------------------------------------------------------------------------ helpers
def _number(value: Any) -> float | None:
    """A finite float, or None (missing, a string such as "nan" for a broken model, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _g(value: float) -> str:
    """A magnitude for prose: 3 significant digits, thousands separated."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:#.3g}".rstrip(".")


def _v(value: float) -> str:
    """A metric value, as the results grid prints it (4 decimals)."""
    return f"{value:.4f}"


def _d(value: float) -> str:
    return f"{value:+.4f}"


def _join(items: Sequence[str], last: str = "and") -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + f" {last} " + items[-1]


def _where(loc: Mapping[str, Any] | None, site: str | None = None) -> str:
    site = site or (loc or {}).get("site")
    place = describe_location(loc) if loc else ""
    place = "" if place == "-" else place
    if site and place:
        return f"`{site}`, {place}"
    return f"`{site}`" if site else place or "an unrecorded place"


# ------------------------------------------------------------------------------------------ outliers
def outlier_sentences(
    table5: Mapping[str, Any] | None, profiles: Mapping[str, Any] | None = None
) -> list[str]:
    """Where the largest values are and how the models compare (from table5.json and the profiles)."""
    out: list[str] = []
    profiles = profiles or {}
    largest: dict[str, tuple[float, str, Any]] = {}  # model -> (|x|, site, loc)
    for name, profile in profiles.items():
        best = None
        for site, stats in profile.sites.items():
            top = stats.kth_largest(1)
            if top is not None and (best is None or top > best[0]):
                best = (top, site, stats)
        if best is not None:
            entries = best[2].summary()["top"]
            largest[name] = (best[0], best[1], entries[0]["loc"] if entries else None)
    if largest:
        ranked = sorted(largest.items(), key=lambda kv: -kv[1][0])
        (top_name, (top_abs, top_site, top_loc)), rest = ranked[0], ranked[1:]

        kind = profiles[top_name].sites[top_site].kind
        sentence = (
            f"The largest |x| in any profiled site is {_g(top_abs)}, in {top_name}'s "
            f"{KIND_TITLES.get(kind, kind)} at {_where(top_loc, top_site)}."
        )
        if rest:
            sentence += (
                " Each other model's largest: "
                + "; ".join(f"{n} {_g(a)} at {_where(loc, s)}" for n, (a, s, loc) in rest)
                + "."
            )
        out.append(sentence)

    models = (table5 or {}).get("models") or {}
    activations = list(dict.fromkeys(a for m in models.values() for a in (m.get("table5") or {})))
    kinds = {n: str(p.meta.get("attention", "")) for n, p in profiles.items() if hasattr(p, "meta")}
    baseline = next((n for n in models if kinds.get(n) == "baseline"), None)
    if baseline is None and "baseline" in models:
        baseline = "baseline"
    for act in activations:
        tops = {
            n: (v, (m["table5"][act] or {}).get("top1_at"))
            for n, m in models.items()
            if act in (m.get("table5") or {}) and (v := _number(m["table5"][act].get("top1"))) is not None
        }
        if not tops:
            continue
        label = act[:1].upper() + act[1:]
        if len(tops) == 1:
            ((name, (value, loc)),) = tops.items()
            out.append(f"{label} (Table 5 view): top-1 |x| {_g(value)} in {name}, at {_where(loc)}.")
            continue
        lo = min(tops, key=lambda n: tops[n][0])
        hi = max(tops, key=lambda n: tops[n][0])
        sentence = f"{label} (Table 5 view): the top-1 |x| is smallest in {lo} ({_g(tops[lo][0])}) and "
        sentence += f"largest in {hi} ({_g(tops[hi][0])}"
        if tops[lo][0] > 0:
            sentence += f", {tops[hi][0] / tops[lo][0]:.2f}x {lo}'s"
        sentence += f"; at {_where(tops[hi][1])})"
        if baseline in tops and tops[baseline][0] > 0 and len(tops) > 2:
            ratios = [f"{n} {tops[n][0] / tops[baseline][0]:.2f}x" for n in tops if n != baseline]
            sentence += f"; relative to {baseline}: {', '.join(ratios)}"
        out.append(sentence + ".")

    if profiles:
        found = []
        for name, profile in profiles.items():
            count, exact, best = 0, True, None
            for site, stats in profile.sites.items():
                entries, n, is_exact = stats.massive()
                count += n
                exact = exact and is_exact
                for e in entries:
                    if best is None or e["abs"] > best[0]:
                        best = (e["abs"], site, e.get("loc"))
            if count:
                where = f", the largest {_g(best[0])} at {_where(best[2], best[1])}" if best else ""
                found.append(f"{name} {'' if exact else 'at least '}{count:,} values{where}")
        if found:
            out.append(
                "Massive activations (|x| > 100 and > 1000x the site's median |x|, Sun et al. 2024): "
                + "; ".join(found)
                + "."
            )
        else:
            out.append(
                "No model has a massive activation (|x| > 100 and > 1000x the site's median |x|, "
                "Sun et al. 2024) in any profiled site."
            )

    broken = []
    for name, m in models.items():
        for act, row in (m.get("table5") or {}).items():
            n = (row or {}).get("nonfinite") or {}
            total = sum(int(n.get(k, 0) or 0) for k in ("nan", "posinf", "neginf"))
            if total:
                first = (n.get("first") or {}).get("loc")
                broken.append(f"{name} has {total:,} NaN/Inf values in {act} (first at {_where(first)})")
    if broken:
        out.append(
            "; ".join(broken) + ": the statistics above leave them out, and that model's results are suspect."
        )
    elif models:
        out.append("No NaN or Inf in the profiled attention logits and hidden states.")
    return out


# ------------------------------------------------------------------------------------------ sweeps
@dataclass
class Cell:
    """One (model, plan) result of a task's primary metric."""

    model: str
    plan: str
    value: float | None  # None: missing or not finite (see ``raw``)
    delta: float | None
    raw: Any
    se: float | None = None  # the task's own standard error, if it reports one
    n: int | None = None  # items behind an accuracy
    windows: int | None = None  # windows a text task scored (bpb / ppl: its standard error is over them)
    tally: Tally | None = None  # per-window NLL / targets / bytes, where the results keep them (paired noise)


@dataclass
class TaskView:
    """A task's primary-metric results, with what is known about their noise."""

    label: str
    type: str
    metric: str
    higher: bool
    models: list[str]
    plans: list[str]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    chance: dict[str, float] = field(default_factory=dict)
    chance_note: str = ""  # where the chance level came from, or why it is unknown

    def loss(self, cell: Cell) -> float | None:
        """The change vs unquantized, signed so that a loss is positive."""
        if cell.delta is None:
            return None
        return -cell.delta if self.higher else cell.delta

    @property
    def spread(self) -> str:
        """'reported', 'binomial' or 'none': what the standard errors of this task rest on."""
        if any(c.se is not None for c in self.cells.values()):
            return "reported"
        if self.type in ACCURACY_TASKS and any(c.n for c in self.cells.values()):
            return "binomial"
        return "none"

    def se_of_difference(self, a: Cell, b: Cell) -> float | None:
        """Standard error of value(a) - value(b) (:meth:`spread_of_difference`), None when none is known."""
        spread = self.spread_of_difference(a, b)
        return None if spread is None else spread.se

    def spread_of_difference(self, a: Cell, b: Cell) -> Spread | None:
        """Standard error of value(a) - value(b), two models at one plan: paired over their windows where
        both keep a tally and the windows match, else the reported errors combined (unpaired), else the
        binomial error at the pooled accuracy (a two-proportion test); None when no spread is known."""
        spread = spread_of_difference(self.metric, a, b)
        if spread is not None:
            return spread
        if self.spread == "binomial" and a.n and b.n and a.value is not None and b.value is not None:
            p = (a.value * a.n + b.value * b.n) / (a.n + b.n)
            p = min(max(p, 0.0), 1.0)
            return Spread(math.sqrt(p * (1 - p) * (1 / a.n + 1 / b.n)), BINOMIAL)
        return None

    def _binomial(self, cell: Cell) -> Cell | Measure:
        """The cell, with the binomial standard error sqrt(p (1 - p) / n) where it reports none."""
        if cell.se is not None or self.spread != "binomial" or not cell.n or cell.value is None:
            return cell
        p = min(max(cell.value, 0.0), 1.0)
        return Measure(cell.value, math.sqrt(p * (1 - p) / cell.n), cell.n, cell.tally)

    def change_interval(self, cell: Cell) -> Interval | None:
        """The interval of ``cell``'s change vs the same model unquantized (± 2 standard errors, paired
        over windows where possible; Newcombe's score interval for a binomial accuracy), or None."""
        ref = self.cells.get((cell.model, NONE_PLAN))
        if ref is None or cell.plan == NONE_PLAN:
            return None
        return interval_of_change(self.metric, self.type, cell, ref)

    def spread_of_changes(self, a: Cell, b: Cell) -> Spread | None:
        """Standard error of change(a) - change(b), two models at one quantized plan (each change vs that
        model unquantized): paired over the four cells' windows, else each change paired, else unpaired or
        binomial (:func:`diffquant.plots.noise.se_of_change_difference`); None when none is known."""
        ua, ub = self.cells.get((a.model, NONE_PLAN)), self.cells.get((b.model, NONE_PLAN))
        if ua is None or ub is None:
            return None
        cells = [self._binomial(c) for c in (a, ua, b, ub)]
        spread = se_of_change_difference(self.metric, *cells)
        if (
            spread is not None
            and spread.basis == UNPAIRED
            and any(c is not o for c, o in zip(cells, (a, ua, b, ub), strict=True))
        ):
            return Spread(spread.se, BINOMIAL)
        return spread

    def se_at_chance(self, cell: Cell) -> float | None:
        """Standard error for testing ``cell`` against chance: the reported one (when positive), else the
        binomial error of a model at chance over the cell's n items."""
        if cell.se is not None and cell.se > 0:
            return cell.se
        c = self.chance.get(cell.model)
        if c is not None and cell.n:
            return math.sqrt(c * (1 - c) / cell.n)
        return None


def _mc_chance(params: Mapping[str, Any]) -> tuple[float | None, str]:
    """Mean 1 / (number of endings) over the items a multiple-choice task read (the file it names)."""
    path = params.get("path")
    try:
        items = load_mc_jsonl(path)
    except DiffquantError as err:
        return None, f"chance level unknown: the results do not record it and {err}"
    limit = params.get("limit")
    items = items[:limit] if isinstance(limit, int) else items
    chance = sum(1.0 / len(i.endings) for i in items) / len(items)
    sizes = sorted({len(i.endings) for i in items})
    choices = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
    return chance, f"1 / {choices} choices, from {path}"


def task_views(results: Mapping[str, Any], sweep: Mapping[str, Any] | None) -> list[TaskView]:
    """One TaskView per task of the sweep results (primary metric), in the sweep's order."""
    spec = (sweep or {}).get("spec", sweep or {})
    task_specs = {
        (t.get("name") or t.get("type")): t for t in spec.get("tasks", []) if isinstance(t, Mapping)
    }
    rows = [r for r in results.get("rows", []) if isinstance(r, Mapping)]
    views = []
    for label, info in (results.get("primary") or {}).items():
        metric, higher = info["metric"], bool(info["higher_is_better"])
        params = task_specs.get(label, {})
        ttype = str(params.get("type", label))
        mine = [r for r in rows if r.get("task") == label]
        tallies = (results.get("per_window") or {}).get(label) or {}
        by_metric = {(r["model"], r["plan"], r["metric"]): r for r in mine}
        models = [m for m in spec.get("models", {}) if any(r["model"] == m for r in mine)]
        models += [m for m in dict.fromkeys(r["model"] for r in mine) if m not in models]
        plans = [p for p in spec.get("plans", {}) if any(r["plan"] == p for r in mine)]
        plans += [p for p in dict.fromkeys(r["plan"] for r in mine) if p not in plans]
        view = TaskView(label, ttype, metric, higher, models, plans)
        for (model, plan, m), r in by_metric.items():
            if m != metric:
                continue
            se_row = by_metric.get((model, plan, f"{metric}_stderr"))
            n_row = by_metric.get((model, plan, "n"))
            n = _number(n_row["value"]) if n_row else None
            w_row = by_metric.get((model, plan, "n_windows"))
            windows = _number(w_row["value"]) if w_row else None
            tally = Tally.parse((tallies.get(model) or {}).get(plan))
            view.cells[(model, plan)] = Cell(
                model,
                plan,
                _number(r.get("value")),
                _number(r.get("delta")),
                r.get("value"),
                se=_number(se_row["value"]) if se_row else None,
                n=int(n) if n else None,
                windows=int(windows) if windows else None,
                tally=tally,
            )
        view.chance = chance_levels(results, label)
        if view.chance:
            view.chance_note = "as the task reports it"
        elif ttype == "mc" and params:
            chance, view.chance_note = _mc_chance(params)
            if chance is not None:
                view.chance = dict.fromkeys(models, chance)
        views.append(view)
    return views


def _ranked(view: TaskView, plan: str, key) -> list[tuple[Cell, float]]:
    """(cell, key(cell)) of every model with a number at ``plan``, best (smallest key) first."""
    pairs = [(c, k) for m in view.models if (c := view.cells.get((m, plan))) and (k := key(c)) is not None]
    return sorted(pairs, key=lambda ck: ck[1])


def _within_noise(view: TaskView, a: Cell, b: Cell) -> bool:
    """Whether two models' results of a task at one plan differ by less than 2 standard errors of their
    difference: unquantized, the values; at a quantized plan, the changes vs unquantized (the loss the
    ranking is by). False when no spread is known: then nothing is flagged, and the noise topic says so."""
    gap, spread = _model_gap(view, a, b)
    return gap is not None and spread is not None and abs(gap) < Z * spread.se


def _model_gap(view: TaskView, a: Cell, b: Cell) -> tuple[float | None, Spread | None]:
    """(the difference between two models at one plan, its standard error): unquantized the values, at a
    quantized plan the changes vs unquantized."""
    if a.plan == NONE_PLAN:
        gap = None if a.value is None or b.value is None else a.value - b.value
        return gap, view.spread_of_difference(a, b)
    gap = None if a.delta is None or b.delta is None else a.delta - b.delta
    return gap, view.spread_of_changes(a, b)


def _near_chance(view: TaskView, cells: Sequence[Cell]) -> tuple[list[Cell], list[Cell]]:
    """(results within 2 standard errors of the task's chance level, results beyond), of those testable."""
    near, far = [], []
    for c in cells:
        se, chance = view.se_at_chance(c), view.chance.get(c.model)
        if c.value is None or se is None or chance is None:
            continue
        (near if abs(c.value - chance) <= Z * se else far).append(c)
    return near, far


def _tied(ranked: list[tuple[Cell, float]]) -> tuple[list[Cell], list[tuple[Cell, float]]]:
    """(cells tied for first, the rest) of a ranking, best first."""
    first = ranked[0][1]
    tol = 1e-12 * max(1.0, abs(first))
    return [c for c, k in ranked if abs(k - first) <= tol], [
        (c, k) for c, k in ranked if abs(k - first) > tol
    ]


def quant_sentences(views: Sequence[TaskView]) -> list[str]:
    """Per task: the best model unquantized, and which model loses least at each quantized plan.

    A comparison whose gap is within 2 standard errors is marked "within noise" (only where a spread is
    known); a task most of whose results sit at chance says so first.
    """
    out = []
    for view in views:
        direction = "higher" if view.higher else "lower"
        head = f"**{view.label}** ({view.metric}, {direction} is better)"
        parts = []
        near, far = _near_chance(view, [c for c in view.cells.values() if c.value is not None])
        if near and len(near) >= len(far):
            parts.append(
                f"{len(near)} of {len(near) + len(far)} results are at chance level (see Noise): "
                "read what follows as noise"
            )
        sign = -1.0 if view.higher else 1.0
        ref = _ranked(view, NONE_PLAN, lambda c, s=sign: None if c.value is None else s * c.value)
        if len(ref) >= 2:
            tied, rest = _tied(ref)
            who = _join([c.model for c in tied])
            text = f"Unquantized, {who} {'tie for best' if len(tied) > 1 else 'is best'} ({_v(tied[0].value)}"
            if rest:
                text += "; " + ", ".join(f"{c.model} {_v(c.value)}" for c, _ in rest)
                if _within_noise(view, tied[0], rest[0][0]):
                    text += "; within noise"
            parts.append(text + ")")
        elif len(ref) == 1:
            parts.append(f"Unquantized, {ref[0][0].model} scores {_v(ref[0][0].value)}")
        quantized = [p for p in view.plans if p != NONE_PLAN]
        winners: dict[tuple[tuple[str, ...], str], list[str]] = {}
        alone: list[str] = []
        tally: dict[str, int] = {}
        for plan in quantized:
            ranked = _ranked(view, plan, view.loss)
            if not ranked:
                continue
            if len(ranked) == 1:  # one model (or only one with a result here): nothing to compare
                cell = ranked[0][0]
                alone.append(f"{cell.model} {_d(cell.delta)} at {plan}")
                continue
            tied, rest = _tied(ranked)
            detail = f"{plan} ({_d(tied[0].delta)}"
            if rest:
                nxt = rest[0][0]
                detail += f"; next {nxt.model} {_d(nxt.delta)}"
                if _within_noise(view, tied[0], nxt):
                    detail += "; within noise"
            detail += ")"
            verb = "loses least" if ranked[0][1] >= 0 else "gains most"
            if len(tied) > 1:
                verb = "tie for the least loss" if ranked[0][1] >= 0 else "tie for the largest gain"
            winners.setdefault((tuple(c.model for c in tied), verb), []).append(detail)
            if len(tied) == 1:
                tally[tied[0].model] = tally.get(tied[0].model, 0) + 1
        for (models, verb), details in winners.items():
            parts.append(f"{_join(list(models))} {verb} at {_join(details)}")
        if alone:
            parts.append(f"Change vs unquantized (no other model to compare): {', '.join(alone)}")
        if tally and len(quantized) > 1 and len(view.models) > 1:
            counted = sorted(tally.items(), key=lambda kv: -kv[1])
            parts.append(
                f"Of the {len(quantized)} quantized plans, "
                + ", ".join(f"{m} fares best at {k}" for m, k in counted)
                + (" (the others are ties)" if sum(tally.values()) < len(quantized) else "")
            )
        broken = [
            f"{c.model} at {c.plan} ({view.metric} = {c.raw})"
            for c in view.cells.values()
            if c.value is None and isinstance(c.raw, str)
        ]
        if broken:
            parts.append(f"Not finite, left out: {_join(broken)}")
        # one short sentence per finding (a sweep of twelve plans made one sentence of twelve clauses)
        out.append(f"{head}: " + ". ".join(parts) + "." if parts else f"{head}: no results.")
    return out


def _basis(view: TaskView, spreads: Sequence[Spread], cells: Sequence[Cell]) -> str:
    """In words, what the standard errors ``spreads`` rest on (how many of them on each rule when mixed)."""
    counts: dict[str, int] = {}
    for sp in spreads:
        counts[sp.basis] = counts.get(sp.basis, 0) + 1
    parts = []
    for basis, count in counts.items():
        if basis == PAIRED:
            windows = sorted({sp.windows for sp in spreads if sp.basis == PAIRED and sp.windows})
            over = f"the {windows[0]:,} windows" if len(windows) == 1 else "the windows"
            text = (
                f"paired over {over} both cells scored: the sample standard deviation (n - 1) of the "
                "per-window differences over sqrt(n)"
            )
        elif basis == PAIRED_EACH:
            text = (
                "each model's change paired over its windows, the two models' changes taken as independent "
                "(their windows differ: another tokenizer)"
            )
        elif basis == UNPAIRED:
            ses = sorted(c.se for c in cells if c.se is not None)
            median = f", median {ses[len(ses) // 2]:.4f}" if ses else ""
            windows = sorted({c.windows for c in cells if c.windows})
            if windows:  # bpb / ppl without per-window tallies
                w_text = f"{windows[0]:,}" if len(windows) == 1 else f"{windows[0]:,} to {windows[-1]:,}"
                tallied = [c for c in cells if c.tally is not None]
                why = (
                    "the cells' windows differ (another tokenizer)"
                    if tallied and len(tallied) == len(cells)
                    else "the results keep no per-window values (a sweep from before they were kept, or a "
                    "layer-streamed one)"
                )
                text = (
                    f"unpaired: {why}, so each cell's own standard error over its {w_text} windows "
                    f"({view.metric}_stderr{median}) is added in quadrature"
                )
            else:
                text = f"the task's own standard errors ({view.metric}_stderr{median}), unpaired"
        else:  # BINOMIAL
            ns = sorted({c.n for c in cells if c.n})
            n_text = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]} to {ns[-1]}"
            text = f"binomial standard errors sqrt(p(1-p)/n) over {n_text} items; the task reports none"
        parts.append(text if len(counts) == 1 else f"{text} (for {count} of them)")
    return "; ".join(parts)


def _interval(interval: Interval) -> str:
    """'± 2 s.e. 0.0012' for a symmetric interval, 'interval -0.031 to +0.12' for a score interval."""
    half = (interval.high - interval.low) / 2
    if abs(interval.center - (interval.low + half)) <= 1e-12 * max(1.0, abs(half)):
        return f"2 s.e. {half:.2g}"
    return f"interval {interval.low:+.3g} to {interval.high:+.3g}"


def noise_sentences(views: Sequence[TaskView]) -> list[str]:
    """Per task: what the spread is, how many changes vs unquantized it can tell from zero, how many model
    differences it swallows, which results are chance."""
    out = []
    for view in views:
        cells = [c for c in view.cells.values() if c.value is not None]
        if not cells:
            continue
        head = f"**{view.label}**"
        changes: list[tuple[Cell, Interval]] = []
        for c in cells:
            interval = view.change_interval(c)
            if interval is not None:
                changes.append((c, interval))
        gaps: list[tuple[float, Spread]] = []
        for plan in view.plans:
            at = [view.cells[(m, plan)] for m in view.models if (m, plan) in view.cells]
            at = [c for c in at if c.value is not None]
            for i, a in enumerate(at):
                for b in at[i + 1 :]:
                    gap, sp = _model_gap(view, a, b)
                    if gap is not None and sp is not None:
                        gaps.append((gap, sp))
        if not changes and not gaps and view.spread == "none":
            if any(c.windows for c in cells):  # a text task whose cells predate per-window errors
                out.append(
                    f"{head}: no spread is known for {view.metric}. This run's cells store only totals "
                    f"over their windows (nll_bits, n_tokens_scored, n_windows), not each window's loss. "
                    f"Run the sweep again for per-window standard errors."
                )
            else:
                out.append(
                    f"{head}: no run-to-run spread is known for {view.metric} (the task reports no standard "
                    f"error and the run has no repeats), so differences between models are not tested "
                    f"against noise."
                )
        if changes:
            beyond = [(c, i) for c, i in changes if i.excludes_zero]
            within = [(c, i) for c, i in changes if not i.excludes_zero]
            rule = _basis(
                view,
                [Spread((i.high - i.low) / (2 * Z), i.basis, i.windows) for _, i in changes],
                cells,
            )
            if any(i.basis == BINOMIAL for _, i in changes):
                rule = rule.replace(
                    "binomial standard errors sqrt(p(1-p)/n)",
                    "Newcombe's score interval from the two Wilson intervals at z = 2",
                )
            sentence = (
                f"{head}: {len(beyond)} of {len(changes)} changes vs unquantized are larger than 2 standard "
                f"errors ({rule})"
            )
            if within and len(within) <= 6:
                sentence += "; within noise: " + ", ".join(
                    f"{c.model} at {c.plan} ({_d(i.center)}, {_interval(i)})" for c, i in within
                )
            out.append(sentence + ".")
        if gaps:
            small = sum(abs(g) < Z * sp.se for g, sp in gaps)
            verdict = ": no model is distinguishable from another on this task" if small == len(gaps) else ""
            quantized = len(view.plans) > 1 and any(p != NONE_PLAN for p in view.plans)
            what = "; at a quantized plan, of the changes vs unquantized" if quantized else ""
            rule = _basis(view, [sp for _, sp in gaps], cells)
            if changes and rule in out[-1]:
                rule = "as above"
            out.append(
                f"{head}: {small} of {len(gaps)} differences between models at the same plan are smaller "
                f"than 2 standard errors ({rule}{what}){verdict}."
            )
        if view.spread == "binomial" and view.type == "retrieval":
            counted = [c for c in cells if c.n]
            if counted and len(counted) <= 12:
                out.append(
                    f"{head}: Wilson score intervals (z = 2) of each {view.metric}: "
                    + ", ".join(
                        f"{c.model} at {c.plan} {_v(c.value)} [{lo:.3f}, {hi:.3f}]"
                        for c in counted
                        for lo, hi in [wilson(c.value, c.n)]
                    )
                    + "."
                )
        if view.type in ACCURACY_TASKS or view.chance:
            if not view.chance:
                note = view.chance_note or "the results do not record it"
                out.append(f"{head}: the chance level of {view.metric} is unknown ({note}).")
                continue
            near, far = _near_chance(view, cells)
            levels = sorted({round(v, 4) for v in view.chance.values()})
            level = _join([f"{v:g}" for v in levels], "or")
            checked = len(near) + len(far)
            if not checked:
                continue
            if near:
                sentence = (
                    f"{head}: {len(near)} of {checked} {view.metric} results are within 2 standard errors "
                    f"of chance ({level}, {view.chance_note}): they measure noise, not {view.label}"
                )
                if far and len(far) <= 4:
                    sentence += "; only " + _join([f"{c.model} at {c.plan} ({_v(c.value)})" for c in far])
                    sentence += " differ" + ("s" if len(far) == 1 else "") + " from chance"
                elif not far:
                    sentence += "; no result differs from chance"
                out.append(sentence + ".")
            else:
                out.append(
                    f"{head}: every {view.metric} result is more than 2 standard errors from chance ({level})."
                )
    return out


def summarize(
    table5: Mapping[str, Any] | None,
    results: Mapping[str, Any] | None,
    sweep: Mapping[str, Any] | None,
    profiles: Mapping[str, Any] | None = None,
    status: str | None = None,
    seed_lines: Sequence[str] | None = None,
) -> list[tuple[str, list[str]]]:
    """(topic, sentences) for the report's summary; topics without data are left out. ``seed_lines``: the
    seed groups' comparisons (diffquant/report/seeds.py), when the run has groups of seeds."""
    topics: list[tuple[str, list[str]]] = []
    if status is not None:
        topics.append(("Run", [f"The run is incomplete ({status}): every finding below is partial."]))
    outliers = outlier_sentences(table5, profiles)
    if outliers:
        topics.append(("Outliers", outliers))
    if results:
        views = task_views(results, sweep)
        quant = quant_sentences(views)
        if quant:
            topics.append(("Quantization", quant))
        noise = noise_sentences(views)
        if noise:
            topics.append(("Noise", noise))
    if seed_lines:
        topics.append(("Seeds", list(seed_lines)))
    return topics
