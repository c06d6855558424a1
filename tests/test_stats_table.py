"""SiteStats' accumulator table (diffquant/profile/stats.py, ``_TABLE``): one row per accumulator, and every
update path (torch, gathered map, native) feeds every row, so an accumulator a path forgets is an error at
that path's first update instead of a statistic left silently empty.

diffquant.profile (whose package imports stats) is imported inside the tests (the ``stats_mod`` fixture),
not at the top: a table that fails its import-time check then fails these tests instead of their collection.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from diffquant.kernels import native

PATHS = ("torch", "map", "native")


@pytest.fixture
def stats_mod():
    return importlib.import_module("diffquant.profile.stats")


def _chunk(path: str) -> tuple[str, str, torch.Tensor, torch.Tensor | None]:
    """(site, kind, x, valid) of an update every accumulator the path can feed has something from: a NaN
    and |x| > 100 in a channel layout (torch, native), |x| > 100 in a causal map chunk (map)."""
    gen = torch.Generator().manual_seed(5)
    if path == "map":
        x = torch.randn(2, 3, 6, 6, generator=gen)
        x[1, 2, 5, 4] = 300.0
        valid = (torch.arange(6)[None, :] <= torch.arange(6)[:, None]).view(1, 1, 6, 6)
        return "layers.0.attn.logits", "logits", x, valid
    x = torch.randn(2, 8, 16, generator=gen)
    x[0, 3, 7] = math.nan
    x[1, 2, 5] = -400.0
    return "layers.0.resid", "resid", x, None


def _on_path(monkeypatch, stats_mod, path: str) -> None:
    """Send the next updates down ``path``: the native pass on for 'native' (it needs a C compiler), off for
    the torch paths; the gathered map path needs FAST."""
    if path == "native":
        assert native.available(), "the native pass needs a C compiler on the test machine"
    monkeypatch.setattr(stats_mod, "NATIVE", path == "native")
    monkeypatch.setattr(stats_mod, "FAST", True)
    monkeypatch.setattr(stats_mod, "FUSED", True)


def _spy_feeds(monkeypatch, stats_mod) -> list[tuple[str, set[str]]]:
    """Spy on SiteStats._feed: (path, rows given a contribution) of each call."""
    calls: list[tuple[str, set[str]]] = []
    original = stats_mod.SiteStats._feed

    def spy(self, path, **contributions):
        calls.append((path, {name for name, c in contributions.items() if c is not None}))
        return original(self, path, **contributions)

    monkeypatch.setattr(stats_mod.SiteStats, "_feed", spy)
    return calls


def test_the_table_has_one_row_per_accumulator_in_merge_order(stats_mod):
    """_TABLE lists every accumulator class once, in ACCUMULATORS' order (merge order: abs-max first), and a
    SiteStats, fresh or read back from its state, holds one instance per row under the row's attribute."""
    accumulators = stats_mod.ACCUMULATORS  # diffquant.profile.accumulators.ACCUMULATORS
    assert tuple(slot.cls for slot in stats_mod._TABLE.values()) == accumulators
    assert len({slot.attr for slot in stats_mod._TABLE.values()}) == len(accumulators)
    s = stats_mod.SiteStats("layers.0.resid", "resid", topk=3, massive_cap=2)
    s.update(torch.randn(2, 4, 8))
    for stats in (s, stats_mod.SiteStats.from_dict(s.to_dict())):
        accs = stats._accumulators()
        assert [type(a) for a in accs] == list(accumulators)
        assert all(
            getattr(stats, slot.attr) is a for slot, a in zip(stats_mod._TABLE.values(), accs, strict=True)
        )
    assert s._top_acc.cap == 3 and s._massive_acc.cap == 2 and s._absmax_acc.site == "layers.0.resid"


@pytest.mark.parametrize("path", PATHS)
def test_each_path_feeds_every_accumulator_that_applies(monkeypatch, stats_mod, path):
    """The rows each path gives a contribution on an update where they apply: all nine on a channel-layout
    chunk with a NaN and a massive value (torch, native); on a causal map chunk all but the non-finite ones
    (a NaN sends a map to the general path) and the channel-only ones."""
    _on_path(monkeypatch, stats_mod, path)
    calls = _spy_feeds(monkeypatch, stats_mod)
    site, kind, x, valid = _chunk(path)
    stats_mod.SiteStats(site, kind).update(x, valid=valid)
    every = set(stats_mod._TABLE)
    want = every - {"nonfinite", "token_kurtosis", "squares"} if path == "map" else every
    assert calls == [(path, want)]


class _Unfed:
    """An accumulator (the interface of accumulators.Accumulator) added to the table that no update path
    feeds yet."""

    FIELDS = ()

    def __init__(self) -> None:
        self.n = 0

    def add(self, n: int) -> None:
        self.n += n

    def merge(self, other: _Unfed, loc: dict[str, Any] | None = None) -> None:
        self.n += other.n

    def to_dict(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("path", PATHS)
def test_an_accumulator_a_path_does_not_feed_is_an_error(monkeypatch, stats_mod, path):
    """A row added to the table that a path has no contribution for raises at that path's update, naming
    the path and the row, and no accumulator changes (the check runs before any is fed; the layout is
    set when an update starts, aside)."""
    _on_path(monkeypatch, stats_mod, path)
    row = stats_mod._Slot("_unfed", _Unfed, (), _Unfed.add)
    monkeypatch.setattr(stats_mod, "_TABLE", {**stats_mod._TABLE, "unfed": row})
    site, kind, x, valid = _chunk(path)
    s = stats_mod.SiteStats(site, kind)
    assert isinstance(s._unfed, _Unfed)
    before = {**s.to_dict(), "layout": None}
    with pytest.raises(RuntimeError, match=rf"the {path} update path .*\['unfed'\]"):
        s.update(x, valid=valid)
    assert {**s.to_dict(), "layout": None} == before and s.count == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dropped", ["moments", "squares"])
def test_a_feed_dropped_from_a_path_is_an_error(monkeypatch, stats_mod, path, dropped):
    """A path that stops naming a row (even one it has nothing for on this update, as a map has for the
    channel squares) raises instead of leaving that accumulator empty."""
    _on_path(monkeypatch, stats_mod, path)
    original = stats_mod.SiteStats._feed

    def forgetful(self, path_, **contributions):
        contributions.pop(dropped)
        return original(self, path_, **contributions)

    monkeypatch.setattr(stats_mod.SiteStats, "_feed", forgetful)
    site, kind, x, valid = _chunk(path)
    with pytest.raises(RuntimeError, match=rf"the {path} update path .*\['{dropped}'\]"):
        stats_mod.SiteStats(site, kind).update(x, valid=valid)
