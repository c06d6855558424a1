"""Calibration observers of :class:`~diffquant.quant.fake.FakeQuant`, in the torch.ao.quantization style.

An observer watches the values a static quantizer sees during calibration (``observe(x, valid, keep)``: ``keep``
are the dims the static scale keeps, e.g. the head dim, or () for one scale per tensor; entries where
``valid`` is False, NaN and +-Inf are ignored) and, at the end, gives the clip the scale is fixed from
(``clip``: amax = clip, scale = clip / qmax):

* :class:`AbsMaxObserver`: the running max |x| per kept index (the ``absmax`` calibration, and the range the
  other two search below).
* :class:`PercentileObserver`: the upper edge of the log2-histogram bin holding a percentile of |x|.
* :class:`MSEObserver`: the clip on a grid in (0, amax] minimising the histogram's expected squared
  quantization error against the actual codebook.

The last two share :class:`Log2HistogramObserver`: 64 bins per octave over [2^-40, 2^40) (relative bin width
1.1 %), one histogram per kept index. Observers are plain objects (not modules): their state never enters a
state dict; the scale FakeQuant fixes from them does.
"""

from __future__ import annotations

from typing import Any

import torch

from diffquant.quant.schemes import Scheme, masked_absmax

__all__ = [
    "AbsMaxObserver",
    "Log2HistogramObserver",
    "MSEObserver",
    "PercentileObserver",
    "clip_observer",
]

# Log2-spaced calibration histogram: 64 bins per octave over [2^-40, 2^40) (relative bin width 1.1 %).
_HIST_LO, _HIST_HI, _HIST_PER_OCTAVE = -40, 40, 64
_HIST_BINS = (_HIST_HI - _HIST_LO) * _HIST_PER_OCTAVE


class AbsMaxObserver:
    """Running max |x| over every dim but ``keep`` (keepdim), ignoring NaN, +-Inf and masked entries."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None = None, keep: tuple[int, ...] = ()) -> None:
        dims = tuple(i for i in range(x.dim()) if i not in keep)
        amax = masked_absmax(x, dims, valid)
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)

    def clip(self) -> torch.Tensor | None:
        """The observed abs-max (None when nothing was observed)."""
        return self.amax


class Log2HistogramObserver:
    """Counts of the non-zero finite valid |x| in log2 bins, one histogram per index of the first kept dim
    (``hist``: (groups, bins) int64; groups = 1 without a kept dim)."""

    def __init__(self) -> None:
        self.hist: torch.Tensor | None = None

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None = None, keep: tuple[int, ...] = ()) -> None:
        mag = x.detach().abs().float()
        ok = torch.isfinite(mag) & (mag > 0)
        if valid is not None:
            ok = ok & valid
        groups = 1 if not keep else x.shape[keep[0]]
        if keep:  # one histogram per head: move the kept dim first
            mag, ok = mag.movedim(keep[0], 0).reshape(groups, -1), ok.movedim(keep[0], 0).reshape(groups, -1)
        else:
            mag, ok = mag.reshape(1, -1), ok.reshape(1, -1)
        bins = torch.floor((torch.log2(mag.clamp_min(2.0**_HIST_LO)) - _HIST_LO) * _HIST_PER_OCTAVE)
        bins = (
            bins.clamp(0, _HIST_BINS - 1).long() + torch.arange(groups, device=x.device)[:, None] * _HIST_BINS
        )
        counts = torch.bincount(bins[ok], minlength=groups * _HIST_BINS).reshape(groups, _HIST_BINS)
        self.hist = counts if self.hist is None else self.hist + counts


class PercentileObserver(Log2HistogramObserver):
    """Clip at the ``percentile`` of |x| (in (0, 100]): the upper edge of the bin holding its rank."""

    def __init__(self, percentile: float) -> None:
        super().__init__()
        self.percentile = percentile

    def clip(self, amax: torch.Tensor) -> torch.Tensor:
        """The clip per kept index, shaped and typed as the abs-max ``amax``."""
        return _percentile_clip(self.hist, self.percentile).to(amax.dtype).reshape(amax.shape)


class MSEObserver(Log2HistogramObserver):
    """Clip minimising the expected squared quantization error of ``element`` (a codebook with ``round`` and
    ``max_value``) over a grid of ``n_grid`` clips in (0, amax]."""

    def __init__(self, element: Any, n_grid: int = 100) -> None:
        super().__init__()
        self.element = element
        self.n_grid = n_grid

    def clip(self, amax: torch.Tensor) -> torch.Tensor:
        """The clip per kept index, shaped and typed as the abs-max ``amax``."""
        best = _mse_clip(self.hist, amax.reshape(-1), self.element, self.n_grid)
        return best.to(amax.dtype).reshape(amax.shape)


def clip_observer(scheme: Scheme) -> PercentileObserver | MSEObserver | None:
    """The histogram observer a static ``scheme`` clips with (None: absmax, or a dynamic scheme)."""
    if scheme.calibration == "percentile":
        return PercentileObserver(scheme.percentile)
    if scheme.calibration == "mse":
        return MSEObserver(scheme.element)
    return None


def _bin_upper_edges(device: torch.device) -> torch.Tensor:
    j = torch.arange(1, _HIST_BINS + 1, dtype=torch.float64, device=device)
    return torch.exp2(_HIST_LO + j / _HIST_PER_OCTAVE)


def _bin_midpoints(device: torch.device) -> torch.Tensor:
    j = torch.arange(_HIST_BINS, dtype=torch.float64, device=device) + 0.5
    return torch.exp2(_HIST_LO + j / _HIST_PER_OCTAVE)


def _percentile_clip(hist: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per group: the upper edge of the bin holding the percentile rank of |x| (so the clip covers it)."""
    cum = hist.cumsum(dim=1).double()
    total = cum[:, -1:].clamp_min(1)
    rank = torch.ceil(total * percentile / 100.0)
    idx = torch.searchsorted(cum.contiguous(), rank.contiguous()).clamp_max(_HIST_BINS - 1)
    return _bin_upper_edges(hist.device)[idx.squeeze(1)]


def _mse_clip(hist: torch.Tensor, amax: torch.Tensor, element, n_grid: int = 100) -> torch.Tensor:
    """Per group: the clip c = amax * r (r on a grid in (0, 1]) minimising the histogram's expected
    squared quantization error, each bin represented by its midpoint (MSE-optimal clipping, as in
    Banner et al. 2019 / Sung et al. 2015, searched numerically against the actual codebook)."""
    mids = _bin_midpoints(hist.device).float()
    ratios = torch.linspace(1.0 / n_grid, 1.0, n_grid, device=hist.device)
    best = []
    for g in range(hist.shape[0]):
        if amax[g] <= 0:
            best.append(amax[g])
            continue
        used = hist[g] > 0
        m, w = mids[used], hist[g][used].float()
        clips = amax[g].float() * ratios  # (n_grid,)
        scales = (clips / element.max_value)[:, None]
        err = (element.round(m[None, :] / scales) * scales - m[None, :]).pow(2) @ w
        best.append(clips[int(torch.argmin(err))])
    return torch.stack(best)
