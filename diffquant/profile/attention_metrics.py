"""Streaming per-layer, per-head statistics of attention maps, the lambda gate and the DIFF "attention noise".

Every accumulator here consumes the tensors its tap carries, one query chunk at a time, and keeps only
per-head float64 sums and int64 counts: a profile over many tokens never holds an attention map, chunks
and batches can be fed in any split, and two partial profiles combine exactly with ``merge`` (sums add,
counts add). ``to_dict`` / ``from_dict`` round-trip through plain JSON-serialisable Python, and
``summary`` turns the sums into per-head means plus their mean over heads.

Inputs, as the model's taps deliver them (see diffquant/models/attention.py):
- ``probs`` taps (probs, probs1, probs2): p (B, H, Tq, S), softmax rows, with ``valid`` (1, 1, Tq, S) bool,
  False where the causal mask hides a key (p is exactly 0 there). A chunk may start at any query offset;
  :func:`diffquant.profile.sites.query_positions` recovers its absolute query positions.
- ``diff_map`` taps: D = A1 - lambda * A2 (B, H, Tq, S) with the same ``valid``.
- ``lambda`` taps: a 0-d tensor (DIFF V1, one scalar per layer) or (B, T, H) (DIFF V2, per token and head).

Row quantities (entropy, row sums) are computed in the map's dtype promoted to at least fp32 (float64 maps
stay float64), then summed per head in float64.
"""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar

import torch

from diffquant.errors import DiffquantError
from diffquant.kernels import native
from diffquant.profile.sites import read_query_positions

__all__ = [
    "DiffMapStats",
    "LambdaStats",
    "MapStats",
    "SinkRateStats",
    "SpanMassStats",
    "accumulator_from_dict",
]

# Fast paths for maps whose visible entries are all finite (the usual case): the same sums from fewer passes
# over the (B, H, Tq, S) map. Tests turn this off to compare with the general path.
FAST = True
# The fused pass (see diffquant/profile/stats.py; DIFFQUANT_PROFILE_FUSED=0: the plain path): the fast paths'
# sums from cheaper ops with the same bits -- entropy by torch.special.entr (one pass: -x log x, as
# -xlogy(x, x)) and the negative mass as -sum(min(d, 0)) (negation is exact, sums of negated values are the
# negated sums).
FUSED = os.environ.get("DIFFQUANT_PROFILE_FUSED", "1") != "0"
# The native pass (diffquant/kernels/native.py) for float32 CPU maps: each row's entropy / sums in float64 in
# one traversal read in place (the torch paths' float32 sums agree to ~1e-6 relative).
NATIVE = native.ENABLED


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision maps (so entropy sums do not round at 3 digits), float64 kept as is."""
    return torch.promote_types(x.dtype, torch.float32)


def _native_rows(x: torch.Tensor, valid: torch.Tensor, differential: bool) -> torch.Tensor | None:
    """Per-row sums of a finite float32 CPU map from the native pass (native.map_rows), or None: fused
    path off (DIFFQUANT_PROFILE_FUSED=0 or DIFFQUANT_NATIVE=0), no C compiler, another dtype or
    device, a mask that differs per (batch, head) slice or is not one run of keys per row, or a visible
    NaN / Inf (the torch paths count those rows)."""
    if not (
        NATIVE
        and FUSED
        and FAST
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() > 0
        and all(n == 1 for n in valid.shape[:-2])
        and native.available()
    ):
        return None
    ranges = native.row_ranges(valid.reshape(valid.shape[-2:]).expand(x.shape[-2:]))
    return None if ranges is None else native.map_rows(x, ranges, differential)


def _check_map(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what}: expected a map (B, H, Tq, S), got shape {tuple(x.shape)}")


def _valid_or_all(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The tap's mask, or all-True when a caller has none (e.g. a map built outside the model)."""
    if valid is None:
        return torch.ones((1, 1, x.shape[2], x.shape[3]), dtype=torch.bool, device=x.device)
    return valid.to(device=x.device, dtype=torch.bool)


def _mean(total: float, count: float) -> float | None:
    """A mean that is None (JSON null) when nothing was counted, instead of NaN, which JSON lacks."""
    return total / count if count > 0 else None


def _over_heads(values: list[float | None]) -> float | None:
    """Unweighted mean over the heads that have a value (each head saw the same rows in a causal map)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _per_head(values: list[float | None]) -> dict[str, Any]:
    return {"per_head": values, "mean": _over_heads(values)}


def _check_metric(name: str, data: Any) -> None:
    """from_dict input must be a dict whose optional ``metric`` tag names this class.

    The tag is ``metric``, not ``type``: the profiler stores its own ``type`` (map / diff_map / span /
    lambda) next to these fields and strips it before calling ``from_dict``.
    """
    if not isinstance(data, dict):
        raise DiffquantError(f"{name}.from_dict: expected a dict, got {type(data).__name__}")
    if data.get("metric", name) != name:
        raise DiffquantError(f"{name}.from_dict: data is a {data.get('metric')!r}, not a {name}")


class _HeadSums:
    """Named per-head float64 sums and int64 counts with exact merge and a plain-dict form.

    State lives on the device of the first update (so a GPU profile does not copy every chunk's sums to
    the host); ``to_dict`` and ``summary`` bring it back as Python numbers. ``n_heads=None`` defers the head
    count to the first map seen (for models without a config to read it from).
    """

    SUMS: ClassVar[tuple[str, ...]] = ()
    COUNTS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, n_heads: int | None = None) -> None:
        self.n_heads: int | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._host: dict[str, list] | None = None  # every field as read by _get, until the state changes
        self._fresh = False  # the sums are the zeros they started as (nothing added or read in)
        if n_heads is not None:
            self._ensure_heads(n_heads)

    def _ensure_heads(self, n_heads: int, device: torch.device | None = None) -> None:
        """Allocate the sums on first sight of the head count (None at construction = learn it from data),
        on ``device`` (the first map's). Zeros made on the host before any map was seen are made again on
        the map's device: copying each to a GPU would be a host wait per sum and metric."""
        if self.n_heads is None:
            if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
                raise ValueError(f"n_heads: expected an integer >= 1, got {n_heads!r}")
            self.n_heads = n_heads
            for name in self.SUMS:
                self._state[name] = torch.zeros(n_heads, dtype=torch.float64, device=device)
            for name in self.COUNTS:
                self._state[name] = torch.zeros(n_heads, dtype=torch.int64, device=device)
            self._fresh = True
            self._host = None
        elif n_heads != self.n_heads:
            raise ValueError(
                f"{type(self).__name__}: expected {self.n_heads} heads, got a map with {n_heads}"
            )
        elif device is not None and self._fresh:
            self._state = {k: torch.zeros_like(v, device=device) for k, v in self._state.items()}
            self._host = None

    def _add(self, name: str, value: torch.Tensor) -> None:
        current = self._state[name]
        if current.device != value.device:
            current = current.to(value.device)
        self._state[name] = current + value.to(current.dtype)
        self._fresh = False
        self._host = None

    def _get(self, name: str) -> list:
        """One field as Python numbers. The first call reads every field in one transfer (each alone was a
        wait for a GPU: a profile's ``to_dict`` read a metric seven times) and keeps them until the next
        change."""
        if self._host is None:
            names = list(self._state)
            host: dict[str, list] = {}
            if names:
                first = self._state[names[0]]
                # float64 holds the counts exactly (below 2^53)
                rows = torch.stack([self._state[n].to(first.device, torch.float64) for n in names]).cpu()
                for n, row in zip(names, rows, strict=True):
                    host[n] = row.to(torch.int64).tolist() if n in self.COUNTS else row.tolist()
            self._host = host
        return list(self._host.get(name, []))

    def merge(self, other: _HeadSums) -> _HeadSums:
        """Add ``other``'s sums and counts into this one (in place); returns self."""
        if type(other) is not type(self):
            raise DiffquantError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other.n_heads is None:
            return self
        if self.n_heads is not None and other.n_heads != self.n_heads:
            raise DiffquantError(
                f"cannot merge {type(self).__name__} with {other.n_heads} heads into one with {self.n_heads}"
            )
        self._ensure_heads(other.n_heads)
        for name, value in other._state.items():
            self._add(name, value.to(self._state[name].device))
        return self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": type(self).__name__, "n_heads": self.n_heads}
        for name in self.SUMS + self.COUNTS:
            out[name] = self._get(name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Rebuild from :meth:`to_dict` output; a malformed dict is a user error (a damaged profile file)."""
        _check_metric(cls.__name__, data)
        n_heads = data.get("n_heads")
        if n_heads is not None and (not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1):
            raise DiffquantError(f"{cls.__name__}.from_dict: bad n_heads {n_heads!r}")
        obj = cls(n_heads)
        for name in cls.SUMS + cls.COUNTS:
            values = data.get(name)
            if values is None and name == "nonfinite_rows":  # profiles written before it was counted
                values = [0] * (n_heads or 0)
            if not isinstance(values, list) or len(values) != (n_heads or 0):
                raise DiffquantError(
                    f"{cls.__name__}.from_dict: field {name!r} must be a list of {n_heads or 0} numbers"
                )
            if n_heads is not None:
                dtype = torch.int64 if name in cls.COUNTS else torch.float64
                try:
                    obj._state[name] = torch.tensor(values, dtype=dtype)
                except (TypeError, ValueError, RuntimeError):
                    raise DiffquantError(
                        f"{cls.__name__}.from_dict: field {name!r} holds non-numbers"
                    ) from None
        obj._fresh = False  # the sums read in, not zeros
        return obj


class MapStats(_HeadSums):
    """Entropy and attention-sink mass of one softmax map tap (probs, probs1, probs2), per head.

    - entropy: -sum_k p log p over the visible keys (natural log, 0 log 0 = 0), averaged over query rows.
      Low entropy = focused heads; the DIFF paper argues that differential attention sharpens A1 - lambda A2
      while each component softmax can stay diffuse, so the components' entropy is the thing to compare.
    - normalised entropy: entropy / log(number of visible keys), in [0, 1], so rows of different causal
      length compare; rows that see a single key have entropy 0 / log 1 and are left out of this mean
      (counted in ``single_key_rows``).
    - sink mass: p on key 0, the attention-sink position (Xiao et al. 2023, StreamingLLM; Sun et al. 2024,
      massive activations act as sinks on the first token). DIFF V2 claims its maps need no sink.
    """

    SUMS = ("entropy_sum", "norm_entropy_sum", "sink_sum")
    COUNTS = ("rows", "multi_key_rows", "single_key_rows", "nonfinite_rows")

    def update(self, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add one chunk: probs (B, H, Tq, S) and the tap's causal ``valid`` mask.

        A row with a NaN / Inf among its visible entries (a model with non-finite weights), or whose
        entropy is not finite (a negative entry, whose -p log p is undefined), is counted in
        ``nonfinite_rows`` and left out of every mean, so the means stay numbers and the event is visible.
        The rows are told apart on the device (their entropies), so an update reads nothing: on a GPU a
        check of the whole map was a wait per map and batch.
        """
        _check_map(probs, "MapStats")
        self._ensure_heads(probs.shape[1], probs.device)
        valid = _valid_or_all(probs, valid)
        rows = _native_rows(probs, valid, differential=False)
        if rows is not None:  # entropy and key-0 value per row in one native pass (finite, p >= 0)
            self._add_rows(rows[..., 0], rows[..., 1], valid, None)
            return
        p = torch.where(valid, probs.to(_work_dtype(probs)), 0.0)
        if FAST:
            # (B, H, Tq); entr(p) = -p log p for p > 0, 0 at 0, -inf below 0. A NaN / Inf visible entry makes
            # its row's entropy NaN / -Inf, so a finite entropy means a finite row: no pass of its own.
            entropy = torch.special.entr(p).sum(-1) if FUSED else -torch.special.xlogy(p, p).sum(-1)
            ok = torch.isfinite(entropy)
        else:  # the reference: each row's entries checked first, then its entropy
            finite = torch.isfinite(p).all(-1)  # (B, H, Tq)
            p = torch.where(finite[..., None], p, 0.0)
            entropy = -torch.special.xlogy(p, p).sum(-1)  # p = 0 contributes 0
            ok = finite & torch.isfinite(entropy)
        self._add_rows(entropy, p[..., 0], valid, ok)

    def _add_rows(
        self, entropy: torch.Tensor, first: torch.Tensor, valid: torch.Tensor, ok: torch.Tensor | None
    ) -> None:
        """The sums from each row's entropy and key-0 value (B, H, Tq); rows where ``ok`` is False (None: all
        are ok) count as non-finite. The per-row key counts come from the (1, 1, Tq, S) mask."""
        n_visible = torch.broadcast_to(valid.sum(-1), entropy.shape)  # (B, H, Tq)
        rows = n_visible > 0
        if ok is None:
            self._add(
                "nonfinite_rows", torch.zeros(entropy.shape[1], dtype=torch.int64, device=entropy.device)
            )
        else:
            self._add("nonfinite_rows", (rows & ~ok).sum((0, 2)))
            rows = rows & ok
        multi = rows & (n_visible > 1)
        log_n = torch.log(n_visible.clamp(min=2).to(entropy.dtype))
        self._add("entropy_sum", torch.where(rows, entropy, 0.0).sum((0, 2)))
        self._add("norm_entropy_sum", torch.where(multi, entropy / log_n, 0.0).sum((0, 2)))
        self._add("sink_sum", torch.where(rows, first, 0.0).sum((0, 2)))
        self._add("rows", rows.sum((0, 2)))
        self._add("multi_key_rows", multi.sum((0, 2)))
        self._add("single_key_rows", (rows & (n_visible == 1)).sum((0, 2)))

    def summary(self) -> dict[str, Any]:
        rows, multi = self._get("rows"), self._get("multi_key_rows")
        ent, norm, sink = self._get("entropy_sum"), self._get("norm_entropy_sum"), self._get("sink_sum")
        return {
            "rows": rows,
            "nonfinite_rows": self._get("nonfinite_rows"),
            "single_key_rows": self._get("single_key_rows"),
            "entropy": _per_head([_mean(e, n) for e, n in zip(ent, rows, strict=True)]),
            "norm_entropy": _per_head([_mean(e, n) for e, n in zip(norm, multi, strict=True)]),
            "sink_mass": _per_head([_mean(s, n) for s, n in zip(sink, rows, strict=True)]),
        }


class DiffMapStats(_HeadSums):
    """How much a differential map D = A1 - lambda A2 cancels, per head (DIFF paper, arXiv 2410.05258).

    - negative fraction: sum max(-D, 0) / sum |D| over visible entries, the share of the map's mass that is
      negative (a plain softmax has 0; the DIFF paper's claim is that subtraction cancels common-mode noise,
      which shows up as negative entries where A2 exceeds lambda-scaled A1).
    - l1_ratio: mean over rows of sum_k |D|. Each A1 row sums to 1, so this is ||D||_1 / ||A1||_1 row-wise;
      below 1 means mass was cancelled. Reported as the ratio itself, not 1 - ratio.
    - row_sum: mean over rows of sum_k D, which equals 1 - lambda on average (each A1, A2 row sums to 1).
    - sink_mass: mean over rows of D on key 0 (signed), the differential counterpart of MapStats' sink mass.
    """

    SUMS = ("neg_sum", "abs_sum", "row_sum", "sink_sum")
    COUNTS = ("rows", "nonfinite_rows")

    def update(self, diff_map: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add one chunk: D (B, H, Tq, S) and the tap's causal ``valid`` mask (rows with NaN / Inf, or whose
        sum of |D| overflows, are counted in ``nonfinite_rows`` and left out, as in :class:`MapStats`; told
        apart on the device, so an update reads nothing)."""
        _check_map(diff_map, "DiffMapStats")
        self._ensure_heads(diff_map.shape[1], diff_map.device)
        valid = _valid_or_all(diff_map, valid)
        rows = _native_rows(diff_map, valid, differential=True)
        if rows is not None:  # the four row sums in one native pass (finite)
            any_visible = torch.broadcast_to(valid.any(-1), rows.shape[:-1])
            self._add("nonfinite_rows", torch.zeros(rows.shape[1], dtype=torch.int64))
            self._add("neg_sum", rows[..., 3].sum((0, 2)).neg_())
            self._add("abs_sum", rows[..., 2].sum((0, 2)))
            self._add("row_sum", rows[..., 0].sum((0, 2)))
            self._add("sink_sum", rows[..., 1].sum((0, 2)))
            self._add("rows", any_visible.sum((0, 2)))
            return
        d = torch.where(valid, diff_map.to(_work_dtype(diff_map)), 0.0)
        if FAST:
            abs_rows = d.abs().sum(-1)  # (B, H, Tq); a NaN / Inf in a row shows here: no pass of its own
            ok = torch.isfinite(abs_rows)
            if FUSED:  # -sum(min(d, 0)): the negation after the sums, as the native pass
                neg_rows = d.clamp(max=0).sum(-1)
                negate = True
            else:
                neg_rows, negate = (-d).clamp(min=0).sum(-1), False
        else:  # the reference: each row's entries checked first
            finite = torch.isfinite(d).all(-1)
            d = torch.where(finite[..., None], d, 0.0)
            abs_rows = d.abs().sum(-1)
            ok = finite & torch.isfinite(abs_rows)
            neg_rows, negate = (-d).clamp(min=0).sum(-1), False
        any_visible = torch.broadcast_to(valid.any(-1), ok.shape)  # (B, H, Tq)
        rows = any_visible & ok
        self._add("nonfinite_rows", (any_visible & ~ok).sum((0, 2)))
        neg = torch.where(rows, neg_rows, 0.0).sum((0, 2))
        self._add("neg_sum", neg.neg_() if negate else neg)
        self._add("abs_sum", torch.where(rows, abs_rows, 0.0).sum((0, 2)))
        self._add("row_sum", torch.where(rows, d.sum(-1), 0.0).sum((0, 2)))
        self._add("sink_sum", torch.where(rows, d[..., 0], 0.0).sum((0, 2)))
        self._add("rows", rows.sum((0, 2)))

    def summary(self) -> dict[str, Any]:
        rows = self._get("rows")
        neg, total = self._get("neg_sum"), self._get("abs_sum")
        return {
            "rows": rows,
            "nonfinite_rows": self._get("nonfinite_rows"),
            "negative_fraction": _per_head([_mean(n, a) for n, a in zip(neg, total, strict=True)]),
            "l1_ratio": _per_head([_mean(a, n) for a, n in zip(total, rows, strict=True)]),
            "row_sum": _per_head([_mean(s, n) for s, n in zip(self._get("row_sum"), rows, strict=True)]),
            "sink_mass": _per_head([_mean(s, n) for s, n in zip(self._get("sink_sum"), rows, strict=True)]),
        }


class SpanMassStats(_HeadSums):
    """The DIFF paper's "attention noise" metric (Table 3): attention mass on the answer span vs the rest.

    For each sample the caller gives the answer span [start, end) of key positions and the query position q
    where the answer is produced; the row of q in the map is read (only when q lies in the current query
    chunk, so a chunked forward counts each sample once). Per head the sums over samples of
    - answer mass: sum over k in [start, end) of map[b, h, row(q), k];
    - rest mass: sum over the other visible keys (0..q outside the span).
    The paper reports Transformer 0.03-0.09 answer / 0.49-0.54 noise vs DIFF 0.27-0.40 / 0.01-0.02.

    Works for ``probs`` (baseline, or one DIFF component) and for ``diff_map``: for DIFF the entries are the
    raw A1 - lambda A2, NOT renormalised, so answer + rest = 1 - lambda rather than 1 and single entries may
    be negative (the paper's numbers are on the differential map as well).
    """

    SUMS = ("answer_sum", "rest_sum")
    COUNTS = ("samples",)

    def update(
        self,
        attn_map: torch.Tensor,
        valid: torch.Tensor,
        spans: list[tuple[int, int, int] | None],
    ) -> None:
        """Add one chunk: map (B, H, Tq, S), its ``valid`` mask and per batch row (start, end, q) or None."""
        _check_map(attn_map, "SpanMassStats")
        self._ensure_heads(attn_map.shape[1], attn_map.device)
        bsz, _, _, s = attn_map.shape
        if len(spans) != bsz:
            raise ValueError(f"SpanMassStats: {len(spans)} spans for a batch of {bsz}")
        valid = valid.to(device=attn_map.device, dtype=torch.bool)
        positions = read_query_positions(valid)
        row_of = {int(p): i for i, p in enumerate(positions)}
        valid_full = torch.broadcast_to(valid, attn_map.shape)
        keys = torch.arange(s, device=attn_map.device)
        for b, span in enumerate(spans):
            if span is None:
                continue
            start, end, q = (int(v) for v in span)
            if not 0 <= start < end <= q + 1:
                raise DiffquantError(
                    f"answer span [{start}, {end}) with query position {q} (batch row {b}): expected "
                    f"0 <= start < end <= q + 1, so the query sees the whole span"
                )
            r = row_of.get(q)
            if r is None:
                continue
            row = torch.where(valid_full[b, :, r], attn_map[b, :, r].to(torch.float64), 0.0)  # (H, S)
            in_span = (keys >= start) & (keys < end)
            self._add("answer_sum", torch.where(in_span, row, 0.0).sum(-1))
            self._add("rest_sum", torch.where(in_span, 0.0, row).sum(-1))
            self._add("samples", torch.ones(row.shape[0], dtype=torch.int64, device=row.device))

    def summary(self) -> dict[str, Any]:
        samples = self._get("samples")
        n = samples[0] if samples else 0
        return {
            "samples": n,
            "answer_mass": _per_head([_mean(a, n) for a in self._get("answer_sum")]),
            "rest_mass": _per_head([_mean(r, n) for r in self._get("rest_sum")]),
        }


class SinkRateStats(_HeadSums):
    """The attention-sink rate of Gu et al. 2024 ("When Attention Sink Emerges in Language Models"), per head.

    For one sequence of T tokens, head h's importance of the first token is alpha = (1 / T) sum_i A[i, 0]
    over all T query rows (their Eq. for Sink_k with k = 1; row 0 sees only key 0, so it adds 1). A head is a
    sink head on that sequence when alpha > epsilon (their epsilon = 0.3). Per head this keeps the number of
    whole sequences seen, how many of them made it a sink head, and the sum of alpha; the model's
    Sink_1^epsilon is the share of (sequence, layer, head) triples over epsilon (:func:`sink_rate_of`).

    alpha needs every row of a sequence: chunks of one forward are summed per (batch row, head) until the
    chunk holding the last key's row arrives. A chunk that does not continue a sequence from position 0 (a
    cached decode step, a prefill over a cache) is not counted: its first rows were never seen here. A
    sequence whose alpha is NaN / Inf is counted in ``nonfinite_sequences`` and left out. Works on softmax
    maps (probs) and on DIFF's A1 - lambda A2 (diff_map), where alpha is the signed mass on key 0.
    """

    SUMS = ("importance_sum",)
    COUNTS = ("sequences", "sink_sequences", "nonfinite_sequences", "tokens")
    EPSILON = 0.3

    def __init__(self, n_heads: int | None = None, epsilon: float = EPSILON) -> None:
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon):
            raise ValueError(f"SinkRateStats: epsilon must be a finite number, got {epsilon!r}")
        super().__init__(n_heads)
        self.epsilon = float(epsilon)
        self._open: torch.Tensor | None = None  # (B, H) float64 sums of A[i, 0] of the sequences in flight
        self._next = 0  # the absolute position the next chunk of those sequences must start at

    def update(self, attn_map: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add one chunk: a map (B, H, Tq, S) and its ``valid`` mask (query positions are read off it)."""
        _check_map(attn_map, "SinkRateStats")
        self._ensure_heads(attn_map.shape[1], attn_map.device)
        valid = _valid_or_all(attn_map, valid)
        s = attn_map.shape[-1]
        # the absolute position of a query row is its last visible key (causal or windowed)
        positions = read_query_positions(valid)
        first, last = int(positions[0]), int(positions[-1])
        if first == 0:
            self._open = torch.zeros(attn_map.shape[:2], dtype=torch.float64, device=attn_map.device)
        elif self._open is None or first != self._next or self._open.shape != attn_map.shape[:2]:
            self._open = None  # not the continuation of a sequence seen from its start
            return
        column = torch.where(valid[..., 0], attn_map[..., 0].to(torch.float64), 0.0)  # (B, H, Tq)
        self._open = self._open + column.sum(-1)
        self._next = last + 1
        if last == s - 1:
            alpha = self._open / s
            self._open = None
            finite = torch.isfinite(alpha)
            self._add("sequences", finite.sum(0))
            self._add("nonfinite_sequences", (~finite).sum(0))
            self._add("sink_sequences", (finite & (alpha > self.epsilon)).sum(0))
            self._add("importance_sum", torch.where(finite, alpha, 0.0).sum(0))
            self._add("tokens", finite.sum(0) * s)

    def merge(self, other: _HeadSums) -> SinkRateStats:
        if isinstance(other, SinkRateStats) and other.epsilon != self.epsilon:
            raise DiffquantError(
                f"cannot merge sink rates at epsilon {other.epsilon} into one at epsilon {self.epsilon}"
            )
        super().merge(other)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "epsilon": self.epsilon}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SinkRateStats:
        obj = super().from_dict(data)
        epsilon = data.get("epsilon")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon):
            raise DiffquantError(f"SinkRateStats.from_dict: epsilon must be a finite number, got {epsilon!r}")
        obj.epsilon = float(epsilon)
        return obj

    def summary(self) -> dict[str, Any]:
        seqs = self._get("sequences")
        return {
            "epsilon": self.epsilon,
            "sequences": seqs,
            "nonfinite_sequences": self._get("nonfinite_sequences"),
            "mean_length": _per_head([_mean(t, n) for t, n in zip(self._get("tokens"), seqs, strict=True)]),
            "sink_rate": _per_head(
                [_mean(k, n) for k, n in zip(self._get("sink_sequences"), seqs, strict=True)]
            ),
            "first_token_importance": _per_head(
                [_mean(a, n) for a, n in zip(self._get("importance_sum"), seqs, strict=True)]
            ),
        }


class LambdaStats:
    """The lambda of one DIFF layer (DIFF paper Eq. 2 for V1; DIFF V2 post for V2).

    DIFF V1 has one scalar per layer, constant during inference: kept as the last value seen, with a count
    and its min/max (so a changing lambda, e.g. during training, is visible). DIFF V2 has sigmoid(W x) per
    token and head, in (0, 1): per head count, mean, population std, min and max, from float64 sums of
    x and x^2 (exact to merge; values in (0, 1) make the cancellation in E[x^2] - E[x]^2 harmless).

    A NaN / Inf lambda (a model with non-finite weights) is counted in ``nonfinite`` (per head for V2) and
    left out of every other field, as the map statistics count ``nonfinite_rows``: the sums stay numbers
    (the profile stays JSON) and the event stays visible.
    """

    def __init__(self) -> None:
        self.mode: str | None = None  # None (nothing seen), "scalar" or "per_head"
        # scalar mode: 0-d tensors on the first value's device (count and nonfinite int64; value, min, max
        # float64, value NaN and min / max +-inf until a finite value comes), so that an update reads
        # nothing (float(lam) was a wait for the GPU per layer and batch); per-head state: _heads
        self._scalar: dict[str, torch.Tensor] | None = None
        self._heads: dict[str, torch.Tensor] | None = None

    @property
    def n_heads(self) -> int | None:
        return None if self._heads is None else int(self._heads["count"].numel())

    def _set_mode(self, mode: str, n_heads: int | None = None, device: torch.device | None = None) -> None:
        """Fix the mode on the first value; its state starts on ``device`` (the first value's: made on the
        host and copied to a GPU, each tensor would be a host wait)."""
        if self.mode is None:
            self.mode = mode
            if mode == "scalar":
                self._scalar = {
                    "count": torch.zeros((), dtype=torch.int64, device=device),
                    "nonfinite": torch.zeros((), dtype=torch.int64, device=device),
                    "value": torch.full((), math.nan, dtype=torch.float64, device=device),
                    "min": torch.full((), math.inf, dtype=torch.float64, device=device),
                    "max": torch.full((), -math.inf, dtype=torch.float64, device=device),
                }
            elif mode == "per_head":
                self._heads = {
                    "count": torch.zeros(n_heads, dtype=torch.int64, device=device),
                    "nonfinite": torch.zeros(n_heads, dtype=torch.int64, device=device),
                    "sum": torch.zeros(n_heads, dtype=torch.float64, device=device),
                    "sumsq": torch.zeros(n_heads, dtype=torch.float64, device=device),
                    "min": torch.full((n_heads,), math.inf, dtype=torch.float64, device=device),
                    "max": torch.full((n_heads,), -math.inf, dtype=torch.float64, device=device),
                }
        elif self.mode != mode:
            raise DiffquantError(f"LambdaStats: cannot mix a {mode} lambda into {self.mode} statistics")
        elif mode == "per_head" and n_heads != self.n_heads:
            raise DiffquantError(f"LambdaStats: lambda with {n_heads} heads, expected {self.n_heads}")

    def update(self, lam: torch.Tensor) -> None:
        """Add a lambda tap's value: 0-d (DIFF V1) or (B, T, H) (DIFF V2)."""
        if lam.dim() == 0:
            self._set_mode("scalar", device=lam.device)
            x = lam.detach().to(torch.float64)
            state = self._scalar
            assert state is not None
            if state["value"].device != x.device:
                state = self._scalar = {k: v.to(x.device) for k, v in state.items()}
            finite = torch.isfinite(x)
            state["count"] += finite
            state["nonfinite"] += ~finite
            state["value"] = torch.where(finite, x, state["value"])
            state["min"] = torch.where(finite, torch.minimum(state["min"], x), state["min"])
            state["max"] = torch.where(finite, torch.maximum(state["max"], x), state["max"])
        elif lam.dim() == 3:
            self._set_mode("per_head", lam.shape[-1], lam.device)
            x = lam.detach().to(torch.float64).reshape(-1, lam.shape[-1])
            state = self._heads
            assert state is not None
            if state["sum"].device != x.device:
                state = self._heads = {k: v.to(x.device) for k, v in state.items()}
            finite = torch.isfinite(x)
            n_finite = finite.sum(0)
            state["count"] += n_finite
            state["nonfinite"] += x.shape[0] - n_finite
            xs = torch.where(finite, x, 0.0)
            state["sum"] += xs.sum(0)
            state["sumsq"] += (xs * xs).sum(0)
            if x.shape[0]:
                state["min"] = torch.minimum(state["min"], torch.where(finite, x, math.inf).amin(0))
                state["max"] = torch.maximum(state["max"], torch.where(finite, x, -math.inf).amax(0))
        else:
            raise ValueError(f"LambdaStats: expected a 0-d or (B, T, H) lambda, got shape {tuple(lam.shape)}")

    def merge(self, other: LambdaStats) -> LambdaStats:
        """Add ``other`` into this one (in place); ``other`` counts as later, so its scalar value wins."""
        if not isinstance(other, LambdaStats):
            raise DiffquantError(f"cannot merge {type(other).__name__} into LambdaStats")
        if other.mode is None:
            return self
        if other.mode == "scalar":
            assert other._scalar is not None
            self._set_mode("scalar", device=other._scalar["value"].device)
            assert self._scalar is not None
            mine = self._scalar
            theirs = {k: v.to(mine["value"].device) for k, v in other._scalar.items()}
            mine["count"] = mine["count"] + theirs["count"]
            mine["nonfinite"] = mine["nonfinite"] + theirs["nonfinite"]
            # the later value wins, where one was seen there (not only non-finite ones)
            mine["value"] = torch.where(theirs["count"] > 0, theirs["value"], mine["value"])
            mine["min"] = torch.minimum(mine["min"], theirs["min"])
            mine["max"] = torch.maximum(mine["max"], theirs["max"])
            return self
        self._set_mode("per_head", other.n_heads)
        assert self._heads is not None and other._heads is not None
        device = self._heads["sum"].device
        theirs = {k: v.to(device) for k, v in other._heads.items()}
        for key in ("count", "nonfinite", "sum", "sumsq"):
            self._heads[key] = self._heads[key] + theirs[key]
        self._heads["min"] = torch.minimum(self._heads["min"], theirs["min"])
        self._heads["max"] = torch.maximum(self._heads["max"], theirs["max"])
        return self

    def _scalar_fields(self) -> dict[str, Any]:
        """Scalar mode's count, nonfinite, value, min and max as Python numbers, read in one transfer (None
        for value / min / max while no finite value was seen)."""
        assert self._scalar is not None
        keys = ("count", "nonfinite", "value", "min", "max")
        count, nonfinite, *values = torch.stack([self._scalar[k].to(torch.float64) for k in keys]).tolist()
        out: dict[str, Any] = {"count": int(count), "nonfinite": int(nonfinite)}
        out.update((k, v if count else None) for k, v in zip(keys[2:], values, strict=True))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": "LambdaStats", "mode": self.mode}
        if self.mode == "scalar":
            out.update(self._scalar_fields())
        elif self.mode == "per_head":
            assert self._heads is not None
            heads = {k: v.tolist() for k, v in self._heads.items()}
            # +-inf (a head that saw nothing, only possible with an empty batch) is not JSON: store null.
            for key in ("min", "max"):
                heads[key] = [v if math.isfinite(v) else None for v in heads[key]]
            out.update(heads)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LambdaStats:
        _check_metric("LambdaStats", data)
        obj = cls()
        mode = data.get("mode")
        try:
            if mode == "scalar":
                obj._set_mode("scalar")
                assert obj._scalar is not None
                obj._scalar["count"] = torch.tensor(int(data["count"]))
                # absent in profiles written before non-finite lambdas were counted
                obj._scalar["nonfinite"] = torch.tensor(int(data.get("nonfinite", 0)))
                for key, missing in (("value", math.nan), ("min", math.inf), ("max", -math.inf)):
                    value = missing if data[key] is None else float(data[key])
                    obj._scalar[key] = torch.tensor(value, dtype=torch.float64)
            elif mode == "per_head":
                n = len(data["sum"])
                obj._set_mode("per_head", n)
                assert obj._heads is not None
                obj._heads["count"] = torch.tensor(data["count"], dtype=torch.int64)
                # absent in profiles written before non-finite lambdas were counted
                nonfinite = data.get("nonfinite", [0] * n)
                obj._heads["nonfinite"] = torch.tensor(nonfinite, dtype=torch.int64)
                for key, missing in (("sum", 0.0), ("sumsq", 0.0), ("min", math.inf), ("max", -math.inf)):
                    values = [missing if v is None else v for v in data[key]]
                    obj._heads[key] = torch.tensor(values, dtype=torch.float64)
                if any(v.numel() != n for v in obj._heads.values()):
                    raise ValueError("per-head fields of different lengths")
            elif mode is not None:
                raise ValueError(f"unknown mode {mode!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise DiffquantError(f"LambdaStats.from_dict: malformed data ({exc})") from None
        return obj

    def summary(self) -> dict[str, Any]:
        if self.mode != "per_head":
            fields = self._scalar_fields() if self.mode == "scalar" else {}
            out: dict[str, Any] = {
                "mode": self.mode,
                "count": fields.get("count", 0),
                "value": fields.get("value"),
                "min": fields.get("min"),
                "max": fields.get("max"),
            }
            nonfinite = fields.get("nonfinite", 0)
            return out | ({"nonfinite": nonfinite} if nonfinite else {})  # the usual case: none
        assert self._heads is not None
        counts = self._heads["count"].tolist()
        sums, sumsq = self._heads["sum"].tolist(), self._heads["sumsq"].tolist()
        means = [_mean(s, n) for s, n in zip(sums, counts, strict=True)]
        stds: list[float | None] = []
        for s2, m, n in zip(sumsq, means, counts, strict=True):
            stds.append(None if m is None else math.sqrt(max(s2 / n - m * m, 0.0)))
        mins = [v if math.isfinite(v) else None for v in self._heads["min"].tolist()]
        maxs = [v if math.isfinite(v) else None for v in self._heads["max"].tolist()]
        return {
            "mode": "per_head",
            "count": counts,
            "nonfinite": self._heads["nonfinite"].tolist(),
            "mean": _per_head(means),
            "std": _per_head(stds),
            # min / max also carry the extreme over heads, which a mean over heads would hide
            "min": {**_per_head(mins), "min": min((v for v in mins if v is not None), default=None)},
            "max": {**_per_head(maxs), "max": max((v for v in maxs if v is not None), default=None)},
        }


_TYPES: dict[str, Any] = {
    cls.__name__: cls for cls in (MapStats, DiffMapStats, SpanMassStats, SinkRateStats, LambdaStats)
}


def accumulator_from_dict(
    data: dict[str, Any],
) -> MapStats | DiffMapStats | SpanMassStats | SinkRateStats | LambdaStats:
    """Rebuild any accumulator of this module from its ``to_dict`` output, dispatching on ``metric``."""
    cls = _TYPES.get(data.get("metric")) if isinstance(data, dict) else None
    if cls is None:
        found = data.get("metric") if isinstance(data, dict) else type(data).__name__
        raise DiffquantError(
            f"attention metric of unknown type {found!r}; expected one of {', '.join(sorted(_TYPES))}"
        )
    return cls.from_dict(data)
