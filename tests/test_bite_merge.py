"""Merging two halves equals one pass, for every accumulator, attention metric and calibration observer
(issue 47 item 4).

Statistics stream and merge (DESIGN principle 4): batches, torchrun ranks and files combine exactly. Each
class is enumerated from the code (every ``Accumulator`` subclass, every per-head metric, every observer), so
a new one without a check here fails ``test_every_class_has_a_merge_check``. The inputs are real: the zoo's
trained checkpoints on WikiText-2 bytes; the activations at their taps (with a few planted non-finite values
where the non-finite accumulator needs some). For each: the state of half A merged with the state of half B
(states merged as they are, with pending dense counts, and after a JSON round trip; the second half as
another site's, relabelled, as the profiler merges taps sharing one input) equals the one-pass state:
exact for counts, extremes, bins, located entries; float sums to rounding.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math

import pytest
import torch
from conftest import assert_close_tree

from diffquant.data.corpus import token_windows
from diffquant.io.load import load_model
from diffquant.models.taps import model_taps
from diffquant.profile import accumulators as acc_module
from diffquant.profile import attention_metrics as metrics_module
from diffquant.profile.accumulators import ACCUMULATORS, Accumulator
from diffquant.profile.profiler import Profiler, merge_profiles
from diffquant.profile.stats import SiteStats
from diffquant.quant import observers as observers_module
from diffquant.quant.observers import clip_observer
from diffquant.quant.schemes import Scheme
from tests.test_stats import assert_state_equal

SITE, OTHER = "layers.1.resid", "layers.1.attn.out"  # one layout (batch, pos, channel): mergeable


def _zoo(kind: str) -> torch.nn.Module:
    model = load_model(f"zoo:{kind}")
    model.layers = model.layers[:2]
    model.config = dataclasses.replace(model.config, n_layers=2)
    return model.eval()


def _windows() -> torch.Tensor:
    return token_windows("wikitext2:test", 4 * 32, 32, quiet=True)


def _activation(kind: str = "diff_v1") -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's output of a zoo model on four WikiText windows (B, T, C), and the token ids."""
    model, ids = _zoo(kind), _windows()
    seen = []
    handle = model.layers[1].resid.register_forward_hook(lambda _m, _a, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen[0], ids


def _planted(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN / +Inf / -Inf at a few places in both halves (so both halves hold a first one)."""
    x = x.clone()
    for (b, t, c), v in zip([(0, 7, 3), (1, 2, 9), (2, 30, 0), (3, 1, 5), (3, 4, 4)], [math.nan, math.inf, -math.inf, math.nan, math.inf], strict=True):  # fmt: skip
        x[b, t, c] = v
    return x


def _stats(site: str, x: torch.Tensor, ids: torch.Tensor, offset: int) -> SiteStats:
    s = SiteStats(site, "resid", topk=12, massive_cap=6)
    s.update(x, tokens=ids, sample_offset=offset)
    return s


# ------------------------------------------------------------------------------------------ enumeration
def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


ACCUMULATOR_CLASSES = {c for c in _subclasses(Accumulator) if not c.__name__.startswith("_")}
METRIC_CLASSES = {
    c
    for _, c in inspect.getmembers(metrics_module, inspect.isclass)
    if c.__module__ == metrics_module.__name__
    and callable(getattr(c, "merge", None))
    and callable(getattr(c, "update", None))
    and not c.__name__.startswith("_")
}
OBSERVER_CLASSES = {
    c
    for _, c in inspect.getmembers(observers_module, inspect.isclass)
    if c.__module__ == observers_module.__name__ and callable(getattr(c, "observe", None))
}
# The per-head metrics a profile of these models computes, and the one a span needs (set below).
PROFILED_METRICS = {"MapStats", "DiffMapStats", "SinkRateStats", "LambdaStats", "SpanMassStats"}


def test_every_class_has_a_merge_check():
    """A new accumulator, metric or observer needs a merge check here (and, for accumulators, a place in
    ACCUMULATORS, which SiteStats merges in order)."""
    assert set(ACCUMULATORS) == ACCUMULATOR_CLASSES
    assert all(c.__module__ == acc_module.__name__ for c in ACCUMULATOR_CLASSES)
    assert {c.__name__ for c in METRIC_CLASSES} == PROFILED_METRICS
    assert {c.__name__ for c in OBSERVER_CLASSES} == set(OBSERVERS)
    state = SiteStats(SITE, "resid").to_dict()
    for cls in ACCUMULATORS:  # every field of every accumulator is in the state the checks compare
        assert cls.FIELDS and set(cls.FIELDS) <= set(state), cls.__name__


# ------------------------------------------------------------------------------------------ accumulators
@pytest.mark.parametrize("round_trip", [False, True], ids=["live", "json"])
@pytest.mark.parametrize("relabel", [False, True], ids=["same-site", "relabelled"])
@pytest.mark.parametrize("later_first", [False, True], ids=["a-then-b", "b-then-a"])
def test_every_accumulator_merges_two_halves_into_the_one_pass_state(round_trip, relabel, later_first):
    """Half A (samples 0-1) and half B (2-3) merged, either into the other; the merged-in half as another
    site's, relabelled: then every entry it brings (top-k, massive, the first non-finite value, which
    comes from samples 0-1) must carry this site's name."""
    x, ids = _activation()
    x = _planted(x)
    one = _stats(SITE, x, ids, 0)
    halves = [(slice(0, 2), 0), (slice(2, 4), 2)]
    if later_first:
        halves.reverse()
    (rows_a, off_a), (rows_b, off_b) = halves
    a = _stats(SITE, x[rows_a], ids[rows_a], off_a)
    b = _stats(OTHER if relabel else SITE, x[rows_b], ids[rows_b], off_b)
    if round_trip:
        a, b = (SiteStats.from_dict(json.loads(json.dumps(s.to_dict()))) for s in (a, b))
    merged = a.merge(b, relabel=relabel)
    want, got = one.to_dict(), merged.to_dict()
    assert want["nan_count"] == 2 and want["posinf_count"] == 2 and want["neginf_count"] == 1
    assert want["first_nonfinite"]["loc"]["sample"] == 0
    assert_state_equal(want, got)
    # B's entries really are in the merged state (the largest magnitudes of the layer lie in both halves)
    samples = {e["loc"]["sample"] for e in got["top"]}
    assert samples & {0, 1} and samples & {2, 3}


def test_fused_histograms_merge_pending_and_folded_counts_alike():
    """States read (their dense counts folded into the sparse bins) and updated again (counts pending)
    merged either way: every count, the zero bin's included (exact zeros planted in both halves), is the
    one pass's."""
    x, ids = _activation("diff_v2")
    x = x.clone()
    x[0, 3, :10] = 0.0
    x[2, 5, :7] = 0.0
    x[3, 1, :4] = 0.0
    one = _stats(SITE, x, ids, 0)
    assert one.to_dict()["hist"]["zero"] == 21

    def half(rows: range, fold: bool) -> SiteStats:
        s = SiteStats(SITE, "resid", topk=12, massive_cap=6)
        for r in rows:
            s.update(x[r : r + 1], tokens=ids[r : r + 1], sample_offset=r)
            if fold and r == rows[0]:
                s.to_dict()  # reading the histogram folds its pending counts; the next update is pending
        return s

    for fold_a, fold_b in ((True, False), (False, True), (True, True), (False, False)):
        a, b = half(range(0, 2), fold_a), half(range(2, 4), fold_b)
        a.merge(b)
        assert_state_equal(one.to_dict(), a.to_dict())


def test_a_merge_of_a_third_site_keeps_the_entries_of_all_three():
    x, ids = _activation()
    one = _stats(SITE, x, ids, 0)
    parts = [_stats(SITE, x[i : i + 1], ids[i : i + 1], i) for i in range(4)]
    merged = SiteStats.merged([parts[0].merge(parts[1]), parts[2].merge(parts[3])], site=SITE)
    assert_state_equal(one.to_dict(), merged.to_dict())


# ------------------------------------------------------------------------------------------ per-head metrics
def _profile(model, ids: torch.Tensor, start: int):
    with Profiler(model, sites="*", topk=8, attention=True) as prof:
        prof.start_samples_at(start)
        prof.spans = [(3, 9, ids.shape[1] - 1)] * ids.shape[0]
        with torch.no_grad():
            model(ids)
        return prof.take()


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2", "sink"])
def test_profiles_of_two_halves_merge_into_the_one_pass_profile(kind):
    """Every site's statistics and every per-head metric (entropy and sink mass, DIFF cancellation, the
    sink rate, lambda, the answer-span mass) of a profile over windows 0-1 merged with one over 2-3 equal the
    profile over 0-3: what torchrun ranks and a resumed profile do."""
    model, ids = _zoo(kind), _windows()
    one = _profile(model, ids, 0)
    halves = [_profile(model, ids[:2], 0), _profile(model, ids[2:], 2)]
    before = json.dumps(halves[1].to_dict(), sort_keys=True)
    merged = merge_profiles(halves)
    assert json.dumps(halves[1].to_dict(), sort_keys=True) == before  # inputs untouched
    assert merged.sites.keys() == one.sites.keys()
    # DIFF V1's lambda and the sinks' logits are one value per forward, not per sample: two forwards see
    # them twice (once with the samples 0-1, once with 2-3)
    per_forward = {n for n, st in one.sites.items() if st.kind == "sink_logit" or st.kind == "lambda" and kind == "diff_v1"}  # fmt: skip
    assert len(per_forward) == (0 if kind == "diff_v2" else 2)
    taps = model_taps(model)
    for name in one.sites:
        want = one.sites[name]
        if name in per_forward:
            values = []
            handle = taps[name].register_forward_hook(
                lambda _m, _a, o, values=values: values.append(o.detach())
            )
            with torch.no_grad():
                model(ids[:1])
            handle.remove()
            want = SiteStats(name, want.kind, topk=8, massive_cap=100)
            want.update(values[0], sample_offset=0)
            want.update(values[0], sample_offset=2)
        assert_state_equal(want.to_dict(), merged.sites[name].to_dict())
    assert merged.attention.keys() == one.attention.keys()
    seen = set()
    for name, (_, state) in one.attention.items():
        if getattr(state, "mode", None) == "scalar":
            state = type(state).from_dict(state.to_dict()).merge(type(state).from_dict(state.to_dict()))
        assert_close_tree(state.to_dict(), merged.attention[name][1].to_dict(), name, 1e-6)
        assert_close_tree(state.summary(), merged.attention[name][1].summary(), name, 1e-6)
        seen.add(type(state).__name__)
    want = {"MapStats", "SpanMassStats"}
    want |= {"DiffMapStats", "LambdaStats"} if kind.startswith("diff") else set()
    assert seen == want
    assert merged.meta["samples"] == one.meta["samples"] == 4


@pytest.mark.parametrize("kind", ["baseline", "diff_v2"])
def test_sink_rates_of_two_halves_merge_into_the_one_pass_rate(kind):
    """Gu et al.'s sink rate (its own probe, not a profile metric): the maps of windows 0-1 and 2-3 (in
    query chunks, as the explicit path hands them over) merged equal the maps of 0-3."""
    model, ids = _zoo(kind), _windows()
    tap = model.layers[1].attn.probs if kind == "baseline" else model.layers[1].attn.diff_map
    maps: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = tap.register_forward_hook(lambda _m, args, out: maps.append((out.detach(), args[1])))
    with torch.no_grad():
        model(ids)
    handle.remove()
    ((whole, valid),) = maps
    cls = metrics_module.SinkRateStats
    one = cls(epsilon=0.2)
    one.update(whole, valid)
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):
        part = cls(epsilon=0.2)
        for q in (slice(0, 11), slice(11, 32)):  # two query chunks of one forward
            part.update(whole[rows, :, q], valid[..., q, :])
        halves.append(part)
    merged = cls.from_dict(json.loads(json.dumps(halves[0].to_dict()))).merge(halves[1])
    assert_close_tree(one.to_dict(), merged.to_dict(), rel=1e-12)
    assert_close_tree(one.summary(), merged.summary(), rel=1e-12)
    assert one.summary()["sequences"] == [4] * whole.shape[1]


# ------------------------------------------------------------------------------------------ observers
OBSERVERS = {
    "AbsMaxObserver": lambda: observers_module.AbsMaxObserver(),
    "Log2HistogramObserver": lambda: observers_module.Log2HistogramObserver(),
    "PercentileObserver": lambda: clip_observer(
        Scheme.parse({"format": "int8", "granularity": "tensor", "calibration": "percentile"})
    ),
    "MSEObserver": lambda: clip_observer(
        Scheme.parse({"format": "int8", "granularity": "tensor", "calibration": "mse"})
    ),
}


@pytest.mark.parametrize("keep", [(), (2,)], ids=["tensor", "channel"])
@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_an_observer_of_two_batches_equals_one_of_both(name, keep):
    """Calibration observes batch after batch: two observe calls equal one over both batches (abs-max,
    histogram and the clip fixed from them), per tensor and per channel, on a real Linear input with its
    causal positions masked in the first half."""
    x, _ = _activation()
    valid = torch.ones(x.shape, dtype=torch.bool)
    valid[0, :5] = False
    one, two = OBSERVERS[name](), OBSERVERS[name]()
    assert type(one).__name__ == name
    one.observe(x, valid, keep)
    two.observe(x[:2], valid[:2], keep)
    two.observe(x[2:], valid[2:], keep)
    for attr in ("amax", "hist"):
        if hasattr(one, attr):
            assert torch.equal(getattr(one, attr), getattr(two, attr)), attr
    amax = torch.stack([x[valid].abs().max()]) if not keep else x.abs().where(valid, 0).amax((0, 1))
    if name == "AbsMaxObserver":
        assert torch.equal(one.clip().flatten(), amax.flatten())
    elif name != "Log2HistogramObserver":
        assert torch.equal(one.clip(amax), two.clip(amax))
