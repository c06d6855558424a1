"""Integer weight codes on the GPTQ grid, and the module that serves them to a Linear.

Every weight method of a plan's ``weights:`` section (round-to-nearest, GPTQ, HQQ) produces the same thing:
per output channel and per group of ``group`` consecutive input channels, a float scale ``s`` and a zero
point ``z``, and codes ``q`` in ``0 .. 2^b - 1`` (``format: intB``); the weight the model computes with is
``(q - z) * s``. This is the storage layout of GPTQ checkpoints (Frantar et al. 2022, and GPTQModel /
AutoGPTQ after it), of compressed-tensors' pack-quantized weights and of optimum-quanto's grouped int
weights, so the three methods differ only in how they choose the codes and the scales, never in the grid
they choose them on.

The grid (the reference GPTQ code's quantizer, written here from its formula):

- asymmetric (``sym: false``): over a group, ``lo = min(min w, 0)`` and ``hi = max(max w, 0)`` (so 0 is
  representable), ``s = (hi - lo) / (2^b - 1)``, ``z = round(-lo / s)``;
- symmetric (``sym: true``): ``m = max |w|``, ``s = 2 m / (2^b - 1)``, ``z = 2^(b-1)``: the levels are
  ``-2^(b-1) .. 2^(b-1) - 1`` times ``s``, 16 levels at 4 bits with the largest magnitude ``m = 7.5 s``
  (so the positive extreme clips by half a step). This is the GPTQ convention, not the 15-level
  ``int4`` format of the rule schemes (``m / 7``), which a plan's ``rules`` still offer;
- a group whose values are all 0 gets ``s = 1`` (its codes are ``z``: the values stay 0).

Codes are rounded half to even (``torch.round``) and clamped to ``0 .. 2^b - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.formats import minmax_params
from diffquant.quant.methods import WeightMethod, register


@dataclass(frozen=True)
class WeightGrid:
    """``bits`` (2..8), ``group_size`` (input channels per scale; None: one scale per output channel) and
    ``sym`` (see the module docstring)."""

    bits: int
    group_size: int | None
    sym: bool

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def groups(self, in_features: int) -> int:
        """Groups per output row: ceil(in / group_size), the last one partial when it does not divide."""
        return 1 if self.group_size is None else -(-in_features // self.group_size)

    def size(self, in_features: int) -> int:
        """Input channels per (full) group in a weight with ``in_features`` columns."""
        return in_features if self.group_size is None else self.group_size

    def check(self, shape: tuple[int, ...], what: str) -> None:
        """A 2-D weight at least one group wide. A group size that does not divide the input width leaves
        a partial last group (SmolLM2's 576 = 4 x 128 + 64), as GPTQ's reference code, AutoGPTQ and
        compressed-tensors do; a group wider than the weight is refused (say ``channel``)."""
        if len(shape) != 2:
            raise DiffquantError(f"{what}: expected a 2-D weight [out, in], got shape {tuple(shape)}")
        if self.group_size is not None and self.group_size > shape[1]:
            raise DiffquantError(
                f"{what}: group {self.group_size} is wider than the {shape[1]} input channels "
                "(use group: channel for one scale per output channel)"
            )

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point ([rows, 1] each) for the values ``w`` [rows, n] of one group per row
        (asymmetric: :func:`~diffquant.formats.minmax_params`, 0 in the range, an integer zero)."""
        if self.sym:
            amax = w.abs().amax(dim=1, keepdim=True)
            scale = 2 * amax / self.maxq
            zero = torch.full_like(scale, float((self.maxq + 1) // 2))
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            return scale, zero
        return minmax_params(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), self.maxq)

    def codes(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """round(w / s) + z, clamped to the grid (as floats of w's dtype)."""
        return torch.clamp(torch.round(w / scale) + zero, 0, self.maxq)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """(q - z) * s with ``scale`` / ``zero`` [out, groups] each over ``group`` consecutive columns (the
    last group partial when ``group`` does not divide the width)."""
    n = codes.shape[1]
    s = scale.repeat_interleave(group, dim=1)[:, :n]
    z = zero.repeat_interleave(group, dim=1)[:, :n]
    return (codes.to(scale.dtype) - z) * s


def by_groups(
    weight: torch.Tensor, grid: WeightGrid, fn: Callable[[torch.Tensor, WeightGrid], GroupCodes]
) -> GroupCodes:
    """``fn`` (a method that needs whole groups) on the full groups of ``weight`` and, when the group size
    does not divide the width, once more on the partial last group alone; the pieces joined."""
    n = weight.shape[1]
    size = grid.size(n)
    full = n - n % size
    if full == n:
        return fn(weight, grid)
    tail = fn(weight[:, full:], WeightGrid(grid.bits, n - full, grid.sym))
    if not full:
        return GroupCodes(tail.codes, tail.scale, tail.zero, grid)
    head = fn(weight[:, :full], grid)
    return GroupCodes(
        torch.cat([head.codes, tail.codes], 1),
        torch.cat([head.scale, tail.scale], 1),
        torch.cat([head.zero, tail.zero], 1),
        grid,
    )


@dataclass
class GroupCodes:
    """One weight's codes [out, in] (uint8), scale and zero [out, groups] and the grid they are on."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    grid: WeightGrid

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        group = self.grid.size(self.codes.shape[1])
        w = dequantize(self.codes, self.scale, self.zero, group)
        return w if dtype is None else w.to(dtype)


def rtn_codes(weight: torch.Tensor, grid: WeightGrid, dtype: torch.dtype = torch.float64) -> GroupCodes:
    """Round-to-nearest on the grid: each group's scale from its own values, every value rounded alone."""
    grid.check(tuple(weight.shape), "weight")
    if weight.shape[1] % grid.size(weight.shape[1]):
        return by_groups(weight, grid, lambda w, g: rtn_codes(w, g, dtype))
    w = weight.detach().to(dtype)
    out, n = w.shape
    size = grid.size(n)
    view = w.reshape(out * (n // size), size)
    scale, zero = grid.params(view)
    q = grid.codes(view, scale, zero)
    return GroupCodes(
        q.reshape(out, n).to(torch.uint8),
        scale.reshape(out, n // size),
        zero.reshape(out, n // size),
        grid,
    )


class QuantizedWeight(nn.Module):
    """A Linear's ``weight_quantizer`` that holds the weight's codes (buffers ``codes``, ``scale``, ``zero``:
    what a quantized checkpoint stores) and serves ``(q - z) * s`` in place of the float weight.

    ``spec`` is the plan's weights section (its method chose the codes). The buffers exist once the codes
    are set (:meth:`set_codes`), so a streamed skeleton holds nothing for layers not yet read. The
    dequantized weight is computed once per dtype / device and cached; the float weight passed in is used
    for its dtype and device only, so the model computes with exactly the stored codes.
    """

    def __init__(self, name: str, spec: Any, shape: tuple[int, int]) -> None:
        super().__init__()
        self.site = f"{name}.weight"
        self.spec = spec
        self.grid: WeightGrid = spec.grid
        self.shape = (int(shape[0]), int(shape[1]))
        self.register_buffer("codes", None)
        self.register_buffer("scale", None)
        self.register_buffer("zero", None)
        self._cache: tuple[tuple, torch.Tensor] | None = None

    @property
    def filled(self) -> bool:
        return self.codes is not None

    @property
    def method(self) -> str:
        return str(self.spec.method)

    def set_codes(self, codes: GroupCodes) -> None:
        """Take ``codes`` (checked against the weight's shape and the grid's group count)."""
        out, n = self.shape
        groups = self.grid.groups(n)
        got = (tuple(codes.codes.shape), tuple(codes.scale.shape), tuple(codes.zero.shape))
        want = ((out, n), (out, groups), (out, groups))
        if got != want:
            raise DiffquantError(f"{self.site}: codes / scale / zero of shapes {got}, expected {want}")
        if codes.codes.is_floating_point() or (
            codes.codes.numel() and int(codes.codes.max()) > self.grid.maxq
        ):
            raise DiffquantError(f"{self.site}: codes must be integers in 0..{self.grid.maxq}")
        self.codes = codes.codes.to(torch.uint8).contiguous()
        self.scale = codes.scale.to(torch.float32).contiguous()
        self.zero = codes.zero.to(torch.float32).contiguous()
        self._cache = None

    def group_codes(self) -> GroupCodes:
        return GroupCodes(self.codes, self.scale, self.zero, self.grid)

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The dequantized codes, in ``weight``'s dtype and on its device."""
        if not self.filled:
            raise DiffquantError(
                f"{self.site}: {self.method} weights used before they were computed (run the calibration)"
            )
        key = (
            weight.dtype,
            weight.device,
            self.codes.data_ptr(),
            self.scale.data_ptr(),
            self.zero.data_ptr(),
        )
        if self._cache is None or self._cache[0] != key:
            w = dequantize(self.codes, self.scale, self.zero, self.grid.size(self.shape[1]))
            self._cache = (key, w.to(device=weight.device, dtype=weight.dtype))
        return self._cache[1]

    def extra_repr(self) -> str:
        size = "channel" if self.grid.group_size is None else f"g{self.grid.group_size}"
        return f"site={self.site}, {self.method} int{self.grid.bits} {size} sym={self.grid.sym}"


register(
    WeightMethod(
        "rtn",
        "round-to-nearest: each value rounded alone on its group's min-max grid",
        codes=lambda weight, spec, what: rtn_codes(weight, spec.grid),
    )
)
