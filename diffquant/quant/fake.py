"""FakeQuant: quantize-dequantize at a tap or on a Linear weight, with straight-through gradients.

Following torch.ao.quantization's split, observing (calibration) and fake-quantizing are separate modes of
one small module: ``calibrating = True`` records statistics and passes values through; ``finish_calibration``
fixes the static scales, which are buffers and so travel with the state dict. Dynamic schemes need no
calibration. NaN inputs propagate (and are counted in ``nan_count``) instead of crashing.
"""

from __future__ import annotations

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.sites import layout_of
from diffquant.quant.schemes import (
    Scheme,
    apply_scale,
    masked_absmax,
    quantize_dynamic,
    quantize_dynamic_finite,
    scale_from_absmax,
    static_dims,
)

WEIGHT_LAYOUT = ("out", "in")
# Fast path of dynamic symmetric schemes on CPU (quantize_dynamic_finite: same numbers); tests turn it off to
# compare with the general path.
FAST = True
# Log2-spaced calibration histogram: 64 bins per octave over [2^-40, 2^40) (relative bin width 1.1 %).
_HIST_LO, _HIST_HI, _HIST_PER_OCTAVE = -40, 40, 64
_HIST_BINS = (_HIST_HI - _HIST_LO) * _HIST_PER_OCTAVE


class FakeQuant(nn.Module):
    """Fake-quantizer for one site (``kind`` = the tap's kind) or one weight (``kind = "weight"``)."""

    def __init__(self, scheme: Scheme, site: str, kind: str) -> None:
        super().__init__()
        self.scheme = scheme
        self.site = site
        self.kind = kind
        self.register_buffer("scale", None)
        self.register_buffer("zero_point", None)
        self._nan_host = 0
        self._nan_device: torch.Tensor | None = None  # NaNs counted on the input's device, read lazily
        self.calibrating = False
        self._amax: torch.Tensor | None = None
        self._hist: torch.Tensor | None = None
        self._weight_cache: tuple[tuple, torch.Tensor] | None = None

    @property
    def nan_count(self) -> int:
        """NaN inputs seen so far (counted on the device without a host sync per call; read here)."""
        if self._nan_device is not None:
            self._nan_host += int(self._nan_device)
            self._nan_device = None
        return self._nan_host

    @nan_count.setter
    def nan_count(self, value: int) -> None:
        self._nan_host, self._nan_device = int(value), None

    def _count_nans(self, x: torch.Tensor) -> None:
        nans = torch.isnan(x.detach()).sum()
        if self._nan_device is None or self._nan_device.device != nans.device:
            if self._nan_device is not None:
                self._nan_host += int(self._nan_device)
            self._nan_device = nans
        else:
            self._nan_device = self._nan_device + nans

    @property
    def row_local(self) -> bool:
        """True when each query row of an attention map is quantized on its own (chunking is exact)."""
        if self.scheme.scale is not None or self.scheme.is_static or self.scheme.is_block_format:
            return True
        gran = self.scheme.granularity
        return gran in ("row", "token") or gran.startswith("block")

    def extra_repr(self) -> str:
        return f"site={self.site}, scheme={self.scheme.label()}, calibration={self.scheme.calibration}"

    # --------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        try:
            y = None
            if FAST and valid is None and not self.calibrating:
                # all-finite CPU tensors with a symmetric dynamic scale: fewer passes, same numbers, 0 NaNs
                y = quantize_dynamic_finite(x, self.scheme, self._layout(x), weight=self.kind == "weight")
            if y is not None:
                y = y.to(x.dtype)
            else:
                if x.is_floating_point():
                    self._count_nans(x)
                if self.calibrating:
                    self._observe(x, valid)
                    return x
                y = self.quantize(x, valid)
        except DiffquantError as err:
            raise DiffquantError(str(err) if self.site in str(err) else f"{self.site}: {err}") from None
        if x.requires_grad:
            return x + (y - x).detach()  # straight-through estimator (Bengio et al. 2013)
        return y

    def quantize(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        layout = self._layout(x)
        if self.scheme.smooth:
            if "pos" not in layout:
                raise DiffquantError(f"{self.site}: smooth needs a position dim (layout {layout})")
            mean = x.detach().float().mean(dim=layout.index("pos"), keepdim=True)
            return (self._quantize(x.float() - mean, layout, valid) + mean).to(x.dtype)
        return self._quantize(x, layout, valid).to(x.dtype)

    def _quantize(self, x: torch.Tensor, layout: tuple[str, ...], valid: torch.Tensor | None) -> torch.Tensor:
        if self.scheme.is_static:
            if self.scale is None:
                raise DiffquantError(
                    f"{self.site}: static scheme ({self.scheme.calibration}) used before calibration; "
                    "run a calibration pass first"
                )
            return apply_scale(x, self.scale, self.scheme.element, self.zero_point)
        return quantize_dynamic(
            x, self.scheme, layout, valid=valid, weight=self.kind == "weight", what=self.site
        )

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The fake-quantized weight, computed once and reused until the weight changes."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return self(weight)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = (key, self.quantize(weight.detach()))
        return self._weight_cache[1]

    def _layout(self, x: torch.Tensor) -> tuple[str, ...]:
        if self.kind == "weight":
            return WEIGHT_LAYOUT
        return layout_of(self.kind, x)

    # ----------------------------------------------------------------------------- calibration
    def start_calibration(self) -> None:
        self.calibrating = True
        self._amax = None
        self._hist = None

    def _observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        if not self.scheme.is_static:
            return
        layout = self._layout(x)
        keep = static_dims(layout, self.scheme.granularity, weight=self.kind == "weight")
        dims = tuple(i for i in range(x.dim()) if i not in keep)
        amax = masked_absmax(x, dims, valid)
        self._amax = amax if self._amax is None else torch.maximum(self._amax, amax)
        if self.scheme.calibration in ("percentile", "mse"):
            self._observe_histogram(x, keep, valid)

    def _observe_histogram(self, x: torch.Tensor, keep: tuple[int, ...], valid: torch.Tensor | None) -> None:
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
        self._hist = counts if self._hist is None else self._hist + counts

    def finish_calibration(self) -> None:
        """Fix the static scale from what was observed (absmax, percentile clip or MSE-optimal clip)."""
        self.calibrating = False
        if not self.scheme.is_static:
            return
        if self._amax is None:
            raise DiffquantError(
                f"{self.site}: calibration saw no data (did the forward pass reach this site?)"
            )
        amax = self._amax
        element = self.scheme.element
        if self.scheme.calibration == "percentile":
            amax = _percentile_clip(self._hist, self.scheme.percentile).to(amax.dtype).reshape(amax.shape)
        elif self.scheme.calibration == "mse":
            amax = _mse_clip(self._hist, amax.reshape(-1), element).to(amax.dtype).reshape(amax.shape)
        self.scale = scale_from_absmax(amax, element, self.scheme)  # never 0, even if amax / qmax underflows
        self._amax = self._hist = None


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
