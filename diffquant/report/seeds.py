"""Seeds: the results of models trained alike but for the seed, as mean +- spread, and which differences
between kinds are larger than the seed noise (issue 30).

A difference between two trained models mixes the effect of their architecture with the luck of one
initialisation and one data order; at the zoo's scale the second is not small. A recipe's models form *seed
groups*: the recipe key ``seeds`` ({group: [model names]}), or, without it, models named ``NAME`` and
``NAME-sK`` (K an integer: the zoo's seed naming, ``zoo:baseline-s1``) group as ``NAME``. Each statistic is
then reported per group as its mean and sample standard deviation over the seeds (n - 1 in the denominator).

Which differences exceed seed noise: for group A against the reference group R (``baseline`` when there is
one), d = mean_A - mean_R and its standard error se = s_p sqrt(1 / n_A + 1 / n_R), where s_p is the seed
standard deviation pooled over every group with two or more seeds, sqrt(sum (n_g - 1) s_g^2 / sum (n_g - 1))
(the two-sample pooled-variance estimate: the seed noise of one recipe is taken to be alike across kinds, so a
kind with one seed can still be compared). A difference counts as beyond seed noise when |d| > 2 se. With
three seeds a group this is a coarse screen, not a significance test; the tables print every mean and
spread so a reader can judge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.schema import require_plain_name

Z = 2.0
SEED_NAME = re.compile(r"^(?P<group>.+)-s(?P<seed>\d+)$")
TABLE5_COLUMNS = ("top1", "top2", "top3", "top10", "top100", "median")
REFERENCE = "baseline"


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (None with one value) of one statistic over a group's seeds."""

    mean: float
    sd: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        n = len(values)
        mean = math.fsum(values) / n
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
        return cls(mean, sd, n)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "sd": self.sd, "n": self.n}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Spread:
        return cls(float(d["mean"]), None if d.get("sd") is None else float(d["sd"]), int(d["n"]))


def seed_groups(
    names: Iterable[str], explicit: Mapping[str, Sequence[str]] | None = None
) -> dict[str, list[str]]:
    """{group: [model names]} of a recipe's models: the explicit groups (every name a model of the recipe,
    none in two groups; models in no group stand alone), or those of the ``NAME`` / ``NAME-sK`` naming.
    Empty when no group has two models (nothing to pool: a plain run)."""
    names = list(names)
    if explicit:
        seen: dict[str, str] = {}
        groups: dict[str, list[str]] = {}
        for group, members in explicit.items():
            require_plain_name(group, "", "seeds")  # a group names rows and files, as a model does
            if not members:  # a group of no seeds would be a row of nothing (mean of an empty list)
                raise DiffquantError(
                    f"seeds.{group}: expected at least one of the recipe's models ({', '.join(names)}), "
                    "got an empty list"
                )
            for m in members:
                if m not in names:
                    raise DiffquantError(
                        f"seeds.{group}: {m!r} is not one of the recipe's models ({', '.join(names)})"
                    )
                if m in seen:
                    raise DiffquantError(f"seeds: model {m!r} is in two groups ({seen[m]!r} and {group!r})")
                seen[m] = group
            groups[group] = list(members)
        for m in names:
            if m not in seen:
                groups[m] = [m]
    else:
        groups = {}
        for m in names:
            match = SEED_NAME.match(m)
            groups.setdefault(match.group("group") if match else m, []).append(m)
    return groups if any(len(v) > 1 for v in groups.values()) else {}


def pooled_sd(spreads: Iterable[Spread]) -> float | None:
    """The seed standard deviation pooled over the spreads with two or more seeds (None without any)."""
    num = den = 0.0
    for s in spreads:
        if s.n > 1 and s.sd is not None:
            num += (s.n - 1) * s.sd**2
            den += s.n - 1
    return math.sqrt(num / den) if den else None


@dataclass(frozen=True)
class Comparison:
    group: str
    reference: str
    diff: float
    se: float | None  # None: no group has two seeds, so no noise estimate
    beyond: bool | None

    @classmethod
    def of(cls, group: str, a: Spread, reference: str, r: Spread, pooled: float | None) -> Comparison:
        diff = a.mean - r.mean
        se = None if pooled is None else pooled * math.sqrt(1 / a.n + 1 / r.n)
        beyond = None if se is None else abs(diff) > Z * se
        return cls(group, reference, diff, se, beyond)


def against_reference(
    spreads: Mapping[str, Spread], ref: str, where: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each group's Spread of one statistic against the reference group's, on the seed noise pooled over
    them all: rows {**where[group], group, reference, diff, se, beyond, mean, ref_mean, n, ref_n, pooled_sd}
    (``where[group]`` names the statistic: activation and column, or task, plan and the group's metric)."""
    pooled = pooled_sd(spreads.values())
    r = spreads[ref]
    return [
        {
            **where[group],
            **Comparison.of(group, s, ref, r, pooled).__dict__,
            "mean": s.mean,
            "ref_mean": r.mean,
            "n": s.n,
            "ref_n": r.n,
            "pooled_sd": pooled,
        }
        for group, s in spreads.items()
        if group != ref
    ]


def _reference(groups: Iterable[str]) -> str | None:
    groups = list(groups)
    return REFERENCE if REFERENCE in groups else (groups[0] if groups else None)


# ------------------------------------------------------------------------------------------ Table 5
def table5_seeds(models: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """{group: {activation: {column: Spread dict}}} from table5.json's ``models`` ({name: {"table5": ...}})."""
    out: dict[str, Any] = {}
    for group, members in groups.items():
        tables = [models[m]["table5"] for m in members if m in models]
        if not tables:
            continue
        out[group] = {}
        for activation in tables[0]:
            rows = [t[activation] for t in tables if activation in t]
            if len(rows) != len(tables):
                continue
            cols = {}
            for col in TABLE5_COLUMNS:
                values = [r[col] for r in rows if isinstance(r.get(col), (int, float))]
                if len(values) == len(rows):
                    cols[col] = Spread.of(values).to_dict()
            out[group][activation] = cols
    return out


def _pm(s: Mapping[str, Any] | Spread, digits: int = 1) -> str:
    s = s if isinstance(s, Spread) else Spread.from_dict(s)
    if s.sd is None:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f}±{s.sd:.{digits}f}"


def format_table5_seeds(agg: Mapping[str, Any]) -> str:
    """Text table: one row per (group, activation), mean±sd over seeds per column (n in the group column)."""
    labels = {g: f"{g} (n={next(iter(next(iter(a.values())).values()))['n']})" for g, a in agg.items() if a}
    width = max([5, *(len(v) for v in labels.values())])
    header = f"{'group':<{width}}  {'activation':<16}" + "".join(f"{c:>13}" for c in TABLE5_COLUMNS)
    lines = ["Table 5 view over seeds: mean±sd", header, "-" * len(header)]
    activations = list(dict.fromkeys(a for g in agg.values() for a in g))
    for activation in activations:
        for group, acts in agg.items():
            if activation in acts:
                cells = "".join(
                    f"{_pm(acts[activation][c], 3 if c == 'median' else 1):>13}"
                    if c in acts[activation]
                    else f"{'-':>13}"
                    for c in TABLE5_COLUMNS
                )
                lines.append(f"{labels[group]:<{width}}  {activation:<16}{cells}")
    return "\n".join(lines)


def sink_rate_seeds(models: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """{group: Spread dict} of the attention-sink rate (Gu et al. 2024, in percent of heads) over each group's
    seeds, from table5.json's ``models`` (a profile run with ``sink_rate``); groups where a member lacks it
    are left out (a rate from some seeds only would not be the group's)."""
    out: dict[str, Any] = {}
    for group, members in groups.items():
        rates = [models.get(m, {}).get("sink_rate", {}).get("rate") for m in members]
        if rates and all(isinstance(r, (int, float)) for r in rates):
            out[group] = Spread.of([100.0 * r for r in rates]).to_dict()
    return out


def format_sink_rate_seeds(agg: Mapping[str, Any]) -> str:
    """One line: each group's sink rate as mean±sd over its seeds."""
    cells = [f"{g} (n={d['n']}) {_pm(d)} %" for g, d in agg.items()]
    return "attention-sink rate over seeds (heads, mean±sd): " + ", ".join(cells)


def scalar_comparisons(agg: Mapping[str, Any], activation: str, column: str) -> list[dict[str, Any]]:
    """Each group's Spread of one scalar ({group: Spread dict}) against the reference's, in the schema of
    ``table5_comparisons`` (so ``seed_sentences`` reads both)."""
    spreads = {g: Spread.from_dict(d) for g, d in agg.items()}
    ref = _reference(spreads)
    if ref is None:
        return []
    return against_reference(spreads, ref, {g: {"activation": activation, "column": column} for g in spreads})


def table5_comparisons(
    agg: Mapping[str, Any], columns: Sequence[str] = ("top1", "median")
) -> list[dict[str, Any]]:
    """Each group against the reference, per activation and column: {activation, column, group, reference,
    diff, se, beyond, mean, ref_mean, n, ref_n, pooled_sd}."""
    ref = _reference(agg)
    out: list[dict[str, Any]] = []
    if ref is None:
        return out
    for activation in agg.get(ref, {}):
        for col in columns:
            spreads = {g: a[activation][col] for g, a in agg.items() if col in a.get(activation, {})}
            if ref in spreads:
                out += scalar_comparisons(spreads, activation, col)
    return out


# ------------------------------------------------------------------------------------------ the sweep
def sweep_seeds(results: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """Per (task, primary metric, plan, group): the value's and the change's (vs the same model
    unquantized) Spread dicts over the group's seeds, from results.json."""
    primary = {task: p["metric"] for task, p in results.get("primary", {}).items()}
    by: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in results.get("rows", []):
        if primary.get(row["task"]) != row["metric"]:
            continue
        by[(row["model"], row["plan"], row["task"])] = row
    plans = list(dict.fromkeys(r["plan"] for r in results.get("rows", [])))
    out = []
    for task, metric in primary.items():
        for plan in plans:
            for group, members in groups.items():
                rows = [by.get((m, plan, task)) for m in members]
                if any(r is None for r in rows):
                    continue
                values = [r["value"] for r in rows]
                deltas = [r["delta"] for r in rows]
                if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                    continue
                entry = {
                    "task": task,
                    "metric": metric,
                    "plan": plan,
                    "group": group,
                    "value": Spread.of(values).to_dict(),
                }
                if all(isinstance(d, (int, float)) and math.isfinite(d) for d in deltas):
                    entry["delta"] = Spread.of(deltas).to_dict()
                out.append(entry)
    return out


def format_sweep_seeds(rows: Sequence[Mapping[str, Any]]) -> str:
    """One table per task: plans as rows, groups as columns, mean±sd of the primary metric (and of its
    change vs unquantized)."""
    blocks = []
    for task in dict.fromkeys(r["task"] for r in rows):
        trows = [r for r in rows if r["task"] == task]
        groups = list(dict.fromkeys(r["group"] for r in trows))
        plans = list(dict.fromkeys(r["plan"] for r in trows))
        by = {(r["plan"], r["group"]): r for r in trows}
        n = {g: next(r["value"]["n"] for r in trows if r["group"] == g) for g in groups}
        table: dict[str, list[str]] = {}
        for plan in plans:
            cells = []
            for g in groups:
                r = by.get((plan, g))
                if r is None:
                    cells.append("-")
                elif plan == "none" or "delta" not in r:
                    cells.append(_pm(r["value"], 4))
                else:
                    d = Spread.from_dict(r["delta"])
                    sign = f"{d.mean:+.4f}" + (f"±{d.sd:.4f}" if d.sd is not None else "")
                    cells.append(f"{_pm(r['value'], 4)} ({sign})")
            table[plan] = cells
        heads = [f"{g} (n={n[g]})" for g in groups]
        # each column as wide as its widest cell, two spaces apart (a cell never runs into the next)
        widths = [max(len(heads[i]), *(len(c[i]) for c in table.values())) + 2 for i in range(len(groups))]
        lead = max(24, *(len(p) + 2 for p in plans))
        lines = [
            f"{task}: {trows[0]['metric']} over seeds, mean±sd (change vs unquantized)",
            f"{'plan':<{lead}}" + "".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)),
        ]
        for plan, cells in table.items():
            lines.append(f"{plan:<{lead}}" + "".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def sweep_comparisons(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each group against the reference per (task, plan): the unquantized value, and for quantized plans the
    change (the loss from quantizing), with the pooled seed noise of that statistic."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        for plan in dict.fromkeys(r["plan"] for r in rows if r["task"] == task):
            cells = {r["group"]: r for r in rows if r["task"] == task and r["plan"] == plan}
            ref = _reference(cells)
            field = "value" if plan == "none" else "delta"
            spreads = {g: Spread.from_dict(r[field]) for g, r in cells.items() if field in r}
            if ref not in spreads:
                continue
            where = {
                g: {"task": task, "plan": plan, "statistic": field, "metric": cells[g]["metric"]}
                for g in spreads
            }
            out += against_reference(spreads, ref, where)
    return out


# ------------------------------------------------------------------------------------------ sentences
def _verdict(c: Mapping[str, Any]) -> str:
    if c["beyond"] is None:
        return "no seed spread to judge it by (one seed per group)"
    word = "beyond" if c["beyond"] else "within"
    return f"{word} seed noise (2 s.e. = {Z * c['se']:.3g})"


def seed_sentences(t5: Sequence[Mapping[str, Any]], sweep: Sequence[Mapping[str, Any]]) -> list[str]:
    """The comparisons as sentences: each group's difference from the reference and whether it exceeds the
    seed noise; first the outliers (Table 5 top-1 / median), then the quantization losses."""
    out = []
    for c in t5:
        out.append(
            f"{c['activation']} {c['column']}: {c['group']} {c['mean']:.4g} (n={c['n']}) vs {c['reference']} "
            f"{c['ref_mean']:.4g} (n={c['ref_n']}), difference {c['diff']:+.4g}: {_verdict(c)}."
        )
    for c in sweep:
        what = "unquantized" if c["plan"] == "none" else f"change under {c['plan']}"
        out.append(
            f"{c['task']} {c['metric']}, {what}: {c['group']} {c['mean']:+.4f} (n={c['n']}) vs {c['reference']} "
            f"{c['ref_mean']:+.4f} (n={c['ref_n']}), difference {c['diff']:+.4f}: {_verdict(c)}."
        )
    return out
