"""The noise of a sweep's results: standard errors of changes and of differences, paired over windows.

A sweep scores every (model, plan) cell of a text task (``bpb`` / ``ppl``) on the same windows of the same
text, so a change (quantized - unquantized) and a difference between two models are measured on the same
windows, and most of each window's difficulty cancels in them. Their standard error is *paired*: computed
from the per-window differences, matched by window index, not from the two cells' own spreads.

* **Paired** (:func:`paired_se`): the results keep each cell's per-window tally (``per_window`` in
  results.json: per window its NLL in nats, scored targets and bytes; :func:`diffquant.eval.perplexity.
  per_window_record`). For a combination sum_k c_k M_k of cells' metrics (a change: +1 quantized, -1
  unquantized; a difference of two models' changes: four terms) the per-window values are
  x_i = sum_k c_k s_k nats_k,i over the window's denominator d_i (bytes for bits per byte, with s_k = 1 / ln 2;
  scored targets for perplexity, with s_k = perplexity_k: the delta method), and the standard error is the
  ratio estimator's sqrt(n / (n - 1) * sum_i (x_i - R d_i)^2) / sum_i d_i with R = sum x_i / sum d_i, the
  same estimator as each cell's own ``bits_per_byte_stderr`` (diffquant.data.scoring), n - 1 degrees of
  freedom. With windows of equal size it is the sample standard deviation (n - 1) of the per-window
  differences over sqrt(n). Windows match when both cells used the same tokenizer and each window scored
  the same targets and bytes; cells that do not match (two tokenizers) are not paired.
* **Paired within each model**: two models whose windows do not match (two tokenizers): each model's change
  is paired, and the two changes are taken as independent (their standard errors add in quadrature).
* **Unpaired** (the fallback, named as such wherever it is used): results written before per-window tallies
  were kept, or from a layer-streamed run, have only each cell's own standard error; those add in
  quadrature, which counts the windows' difficulty twice and calls most real differences noise.
* **Binomial** (accuracies over n items without a reported standard error, e.g. retrieval): the Wilson
  score interval of each result (:func:`wilson`), and Newcombe's hybrid score interval for a change
  (:func:`newcombe`, built from the two Wilson intervals; unpaired: the per-item results are not kept).

"Within noise" means within Z = 2 standard errors (or inside the z = 2 score interval).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Z = 2.0  # "within 2 standard errors"
PAIRED = "paired"
PAIRED_EACH = "paired within each model"
UNPAIRED = "unpaired"
BINOMIAL = "binomial"
ACCURACY_TASKS = ("retrieval", "mc")  # primary metric is a mean of per-item scores in [0, 1]
LN2 = math.log(2)


@dataclass(frozen=True)
class Tally:
    """One cell's per-window tally: natural-log NLL, scored targets and bytes of each window, in order."""

    tokenizer: str | None
    nats: tuple[float, ...]
    targets: tuple[int, ...]
    bytes: tuple[int, ...]

    @classmethod
    def parse(cls, data: Any) -> Tally | None:
        """A tally from results.json (``windows[task][model][plan]``); None when absent or malformed."""
        if not isinstance(data, Mapping):
            return None
        try:
            nats = tuple(float(x) for x in data["nats"])
            targets = tuple(int(x) for x in data["targets"])
            size = tuple(int(x) for x in data["bytes"])
        except (KeyError, TypeError, ValueError):
            return None
        if not (len(nats) == len(targets) == len(size)) or not all(math.isfinite(x) for x in nats):
            return None
        tokenizer = data.get("tokenizer")
        return cls(str(tokenizer) if tokenizer is not None else None, nats, targets, size)

    def matches(self, other: Tally) -> bool:
        """Whether window i of both is the same text: same tokenizer, same targets and bytes per window."""
        return (
            self.tokenizer == other.tokenizer
            and self.targets == other.targets
            and self.bytes == other.bytes
            and len(self.nats) == len(other.nats)
        )


# metric -> (denominator column of the ratio, scale of a cell's nats: d metric = scale * d(nats / denominator))
def _scale(metric: str, value: float) -> float | None:
    if metric == "bits_per_byte":
        return 1.0 / LN2
    if metric == "perplexity":
        return value  # delta method: d exp(m) = exp(m) dm
    return None


DENOMINATOR = {"bits_per_byte": "bytes", "perplexity": "targets"}


class Measured(Protocol):
    """What the noise rules read of a cell: its value, its own standard error, items, per-window tally."""

    value: float | None
    se: float | None
    n: int | None
    tally: Tally | None


@dataclass
class Measure:
    """A cell of a task's primary metric as results.json holds it (:func:`measures`)."""

    value: float | None
    se: float | None = None
    n: int | None = None
    tally: Tally | None = None


@dataclass(frozen=True)
class Spread:
    """A standard error and what it rests on (PAIRED, PAIRED_EACH, UNPAIRED or BINOMIAL); ``windows``: how
    many windows a paired one is over."""

    se: float
    basis: str
    windows: int | None = None


@dataclass(frozen=True)
class Interval:
    """An interval for a change (low, high) around ``center`` and its basis."""

    center: float
    low: float
    high: float
    basis: str
    windows: int | None = None

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_se(metric: str, terms: Sequence[tuple[float, float, Tally]]) -> float | None:
    """Standard error of sum_k c_k metric_k over windows matched by index (see the module docstring);
    ``terms``: (c_k, the cell's metric value, its tally). None when the metric cannot be paired (not bits
    per byte or perplexity), the tallies do not match, or fewer than two windows scored anything."""
    if metric not in DENOMINATOR or not terms:
        return None
    first = terms[0][2]
    if any(not first.matches(t) for _, _, t in terms[1:]):
        return None
    scales = [_scale(metric, v) for _, v, _ in terms]
    if any(s is None or not math.isfinite(s) for s in scales):
        return None
    den = getattr(first, DENOMINATOR[metric])
    rows = []
    for i, d in enumerate(den):
        if d > 0:
            rows.append((sum(c * s * t.nats[i] for (c, _, t), s in zip(terms, scales, strict=True)), d))
    total = float(sum(d for _, d in rows))
    if len(rows) < 2 or total <= 0:
        return None
    ratio = sum(x for x, _ in rows) / total
    squares = math.fsum((x - ratio * d) ** 2 for x, d in rows)
    return math.sqrt(len(rows) / (len(rows) - 1) * squares) / total


def _windows(tally: Tally | None) -> int | None:
    return None if tally is None else len(tally.nats)


def _paired(metric: str, terms: Sequence[tuple[float, Measured]]) -> Spread | None:
    if any(m.tally is None or m.value is None for _, m in terms):
        return None
    se = paired_se(metric, [(c, m.value, m.tally) for c, m in terms])  # type: ignore[misc]
    return None if se is None else Spread(se, PAIRED, _windows(terms[0][1].tally))


def _unpaired(terms: Sequence[tuple[float, Measured]]) -> Spread | None:
    if any(m.se is None for _, m in terms):
        return None
    return Spread(math.sqrt(math.fsum((c * m.se) ** 2 for c, m in terms)), UNPAIRED)  # type: ignore[operator]


def se_of_change(metric: str, quantized: Measured, unquantized: Measured) -> Spread | None:
    """Standard error of value(quantized) - value(unquantized) of one model: paired over the windows where
    both keep their tally, else unpaired (each cell's own standard error); None when neither is known."""
    terms = [(1.0, quantized), (-1.0, unquantized)]
    return _paired(metric, terms) or _unpaired(terms)


def se_of_difference(metric: str, a: Measured, b: Measured) -> Spread | None:
    """Standard error of value(a) - value(b), two models at one plan: paired where their windows match (one
    tokenizer), else unpaired."""
    terms = [(1.0, a), (-1.0, b)]
    return _paired(metric, terms) or _unpaired(terms)


def se_of_change_difference(
    metric: str, qa: Measured, ua: Measured, qb: Measured, ub: Measured
) -> Spread | None:
    """Standard error of (qa - ua) - (qb - ub): two models' changes at one plan. Paired over all four
    cells' windows when they match; else each model's change paired and the two added in quadrature
    (PAIRED_EACH); else unpaired (four cells' own standard errors)."""
    both = _paired(metric, [(1.0, qa), (-1.0, ua), (-1.0, qb), (1.0, ub)])
    if both is not None:
        return both
    a, b = _paired(metric, [(1.0, qa), (-1.0, ua)]), _paired(metric, [(1.0, qb), (-1.0, ub)])
    if a is not None and b is not None:
        return Spread(math.hypot(a.se, b.se), PAIRED_EACH, a.windows)
    return _unpaired([(1.0, qa), (-1.0, ua), (-1.0, qb), (1.0, ub)])


def wilson(p: float, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson score interval (low, high) of a proportion ``p`` of ``n`` items at ``z`` standard errors: the
    proportions a score test at ``z`` does not reject (never outside [0, 1], sensible at 0 and 1)."""
    if n <= 0:
        raise ValueError("wilson: n must be positive")
    p = min(max(p, 0.0), 1.0)
    z2n = z * z / n
    center = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def newcombe(p1: float, n1: int, p2: float, n2: int, z: float = Z) -> tuple[float, float]:
    """Newcombe's hybrid score interval (1998, method 10) of p1 - p2 for two independent proportions, from
    their Wilson intervals: (d - sqrt((p1 - l1)^2 + (u2 - p2)^2), d + sqrt((u1 - p1)^2 + (p2 - l2)^2))."""
    l1, u1 = wilson(p1, n1, z)
    l2, u2 = wilson(p2, n2, z)
    d = p1 - p2
    return d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def interval_of_change(
    metric: str, task_type: str, quantized: Measured, unquantized: Measured
) -> Interval | None:
    """The interval of a change vs unquantized: ± Z standard errors (paired where possible, see
    :func:`se_of_change`), or for an accuracy over n items with no standard error reported, Newcombe's
    interval at z = Z (BINOMIAL). None when no spread is known or a value is missing."""
    q, u = quantized.value, unquantized.value
    if q is None or u is None:
        return None
    spread = se_of_change(metric, quantized, unquantized)
    if spread is not None:
        d = q - u
        return Interval(d, d - Z * spread.se, d + Z * spread.se, spread.basis, spread.windows)
    if task_type in ACCURACY_TASKS and quantized.n and unquantized.n:
        low, high = newcombe(q, quantized.n, u, unquantized.n)
        return Interval(q - u, low, high, BINOMIAL)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def measures(results: Mapping[str, Any], task: str) -> dict[tuple[str, str], Measure]:
    """{(model, plan): Measure} of a task's primary metric from results.json: the value, the cell's own
    ``METRIC_stderr``, its items ``n`` and its per-window tally (``per_window``), where recorded."""
    metric = ((results.get("primary") or {}).get(task) or {}).get("metric")
    rows = [r for r in results.get("rows", []) if isinstance(r, Mapping) and r.get("task") == task]
    by = {(r.get("model"), r.get("plan"), r.get("metric")): r.get("value") for r in rows}
    tallies = ((results.get("per_window") or {}).get(task)) or {}
    out: dict[tuple[str, str], Measure] = {}
    for (model, plan, m), value in by.items():
        if m != metric:
            continue
        n = _number(by.get((model, plan, "n")))
        out[(model, plan)] = Measure(
            _number(value),
            se=_number(by.get((model, plan, f"{metric}_stderr"))),
            n=int(n) if n else None,
            tally=Tally.parse((tallies.get(model) or {}).get(plan)),
        )
    return out
