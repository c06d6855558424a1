"""Export diffquant's integer weight codes (RTN / GPTQ / HQQ) to optimum-quanto modules, bit for bit.

:func:`codes_to_quanto` takes one ``nn.Linear`` and its :class:`~diffquant.quant.weightcodes.GroupCodes`
(codes ``q`` in ``0 .. 2^b - 1``, scale ``s`` and zero ``z`` per output row and group of ``group_size``
consecutive input columns; weight ``(q - z) * s``) and returns a frozen quanto ``QLinear`` whose quantized
weight holds *those* codes, scales and zeros. Nothing is re-quantized: quanto's own ``freeze()`` would redo
min/max rounding on the dequantized weight and throw GPTQ's error compensation away.

What maps to what (optimum-quanto 0.2.7, read from its source):

* bits 4 / 2 -> ``WeightQBitsTensor`` of qtype ``qint4`` / ``qint2``, ``axis=0``. quanto groups a weight
  [out, in] with ``axis=0`` as ``reshape(out * in / group_size, group_size)`` (tensor/grouped.py), i.e. row
  ``r * groups + g`` holds input columns ``g * group_size ..`` of output row ``r``: exactly our layout, so
  ``_data`` is ``codes.reshape(-1, group_size)`` (uint8, packed two / four per byte by ``PackedTensor.pack``
  along dim 0), and ``_scale`` / ``_shift`` are ``scale.reshape(-1, 1)`` / ``zero.reshape(-1, 1)``.
  ``group_size: channel`` (None) is quanto's ungrouped per-row layout (data [out, in], scale [out, 1]).
  quanto's dequantizer (tensor/qbits.py ``QBitsDequantizer``) has two conventions for the shift:

  - an *integer* shift (uint8, quanto's ``zeropoint=True``): ``(data - shift) * scale``, which is our
    ``(q - z) * s`` term for term (the same fp32 subtraction of small integers, then one product), so the
    dequantized weight is bit-identical to ``GroupCodes.dequantize`` with fp32 scales. Used when every zero
    is an integer in ``0 .. 2^b - 1``: always for RTN and GPTQ (``z = round(-lo / s)`` or ``2^(b-1)``);
  - a *float* shift (quanto's default, ``MaxOptimizer``: ``shift = -min``): ``scale * data - shift``, which
    is ours with ``shift = z * s``; used for HQQ's fractional zero points (or on request, ``shift="float"``).
    Two fp32 roundings instead of one: equal to ours within a few ulp of ``max(|q s|, |z s|)``.

* bits 8, symmetric, per row -> ``WeightQBytesTensor`` of qtype ``qint8`` (tensor/weights/qbytes.py): its
  dequantization is ``scale * data`` with int8 data and one scale per output row, so ``data = q - z``
  (``z = 128``: ``-128 .. 127``) and the forward (``quanto::qbytes_mm``: ``(scale * data)`` then a matmul) is
  ours exactly.

Refused, in one line naming the Linear's shape, the bits and the group size (a :class:`DiffquantError`):

* bits 3, 5, 6, 7: quanto's integer weights are qint2 / qint4 (packed) and qint8 only;
* a group size that does not divide ``in_features`` (a partial last group, e.g. 576 = 4 x 128 + 64):
  quanto's ``group()`` reshapes the whole weight into equal groups and raises otherwise;
* bits 8 asymmetric or grouped: ``WeightQBytesTensor`` has no shift and no groups (``q - z`` of an asymmetric
  grid spans up to ``-255 .. 255``, beyond int8).

Not expressible elsewhere: bitsandbytes' NF4 / FP4 are *codebooks* (16 fixed float levels: normal-distribution
quantiles, or a 1-2-1 float format) scaled by one absmax per block of 64 values, with no zero point, so the
integer grid ``(q - z) * s`` of GPTQ codes maps to none of their levels; a GPTQ checkpoint cannot be handed to
bitsandbytes without re-quantizing (and losing what GPTQ chose). quanto's grouped integer format is the one
that stores GPTQ's grid as it is.

The module is built in fp32 (scales fp32, bias an fp32 copy; the source Linear is never modified) on the
codes' device, weight-only (no activation quantization), frozen, in eval mode, ``requires_grad`` False, with
``weight_group_size`` set to the codes' group size so that its ``state_dict`` reloads into a module built the
same way. Caveats (quanto's, not handled here): quanto derives a fresh module's group size from
``in_features`` (128, else 96 / 64 / 32), so a state dict with another group size reloads only into a module
from :func:`codes_to_quanto`; a qint4 / qint2 module fails under ``torch.inference_mode()`` (use
``torch.no_grad()``); its dtype cannot be changed after the fact (quanto refuses ``.to(dtype)``).
"""

from __future__ import annotations

from typing import Literal

import torch

from diffquant.errors import DiffquantError
from diffquant.quant.backends.quanto import register_pure_torch_unpack
from diffquant.quant.weightcodes import GroupCodes, QuantizedWeight

__all__ = ["QUANTO_CODE_BITS", "codes_to_quanto"]

#: Bit widths quanto can hold as integer codes (2 / 4: grouped or per row; 8: symmetric per row only).
QUANTO_CODE_BITS: tuple[int, ...] = (2, 4, 8)

_SUPPORTED = (
    "quanto holds qint2 / qint4 codes per row or in groups dividing in_features, "
    "and qint8 codes symmetric per row"
)


def _describe(linear: torch.nn.Linear, codes: GroupCodes) -> str:
    grid = codes.grid
    group = "channel" if grid.group_size is None else str(grid.group_size)
    return (
        f"Linear [{linear.out_features}, {linear.in_features}] with {grid.bits}-bit codes, group_size {group}, "
        f"sym={grid.sym}"
    )


def _refuse(linear: torch.nn.Linear, codes: GroupCodes, why: str) -> DiffquantError:
    return DiffquantError(f"cannot export {_describe(linear, codes)} to optimum-quanto: {why} ({_SUPPORTED})")


def _check(linear: torch.nn.Linear, codes: GroupCodes) -> None:
    """Shapes, code range and whether quanto's formats can represent the grid (see the module docstring)."""
    out, n = linear.out_features, linear.in_features
    grid = codes.grid
    if grid.bits not in QUANTO_CODE_BITS:
        raise _refuse(linear, codes, f"no quanto integer format has {grid.bits} bits")
    if grid.group_size is not None and (grid.group_size > n or n % grid.group_size):
        raise _refuse(linear, codes, f"group_size {grid.group_size} does not divide in_features {n}")
    groups = grid.groups(n)
    got = (tuple(codes.codes.shape), tuple(codes.scale.shape), tuple(codes.zero.shape))
    want = ((out, n), (out, groups), (out, groups))
    if got != want:
        raise _refuse(linear, codes, f"codes / scale / zero of shapes {got}, expected {want}")
    if codes.codes.is_floating_point() or codes.codes.dtype == torch.bool:
        raise _refuse(linear, codes, f"codes must be integers, got {codes.codes.dtype}")
    if codes.codes.numel() and (int(codes.codes.min()) < 0 or int(codes.codes.max()) > grid.maxq):
        raise _refuse(linear, codes, f"codes outside 0..{grid.maxq}")
    if not (bool(torch.isfinite(codes.scale).all()) and bool(torch.isfinite(codes.zero).all())):
        raise _refuse(linear, codes, "non-finite scale or zero")
    if grid.bits == 8:
        if grid.group_size is not None and grid.group_size != n:
            raise _refuse(linear, codes, "qint8 weights have one scale per output row, no groups")
        if not grid.sym or not _integral(codes.zero, 0, grid.maxq) or not _int8_range(codes):
            raise _refuse(linear, codes, "qint8 weights are symmetric: codes - zero must be int8")


def _integral(zero: torch.Tensor, lo: int, hi: int) -> bool:
    return bool(torch.equal(zero, torch.round(zero))) and (
        not zero.numel() or (float(zero.min()) >= lo and float(zero.max()) <= hi)
    )


def _int8_range(codes: GroupCodes) -> bool:
    centred = codes.codes.to(torch.int16) - codes.zero.to(torch.int16)  # [out, 1] broadcast over the row
    return not centred.numel() or (int(centred.min()) >= -128 and int(centred.max()) <= 127)


def _qbits_weight(codes: GroupCodes, shift: Literal["auto", "int", "float"], linear: torch.nn.Linear):
    """A ``WeightQBitsTensor`` (qint4 / qint2, axis 0) holding ``codes`` as they are."""
    from optimum.quanto import WeightQBitsTensor, qtypes  # noqa: PLC0415 (optional heavy library)

    grid = codes.grid
    out, n = codes.codes.shape
    size = grid.size(n)
    rows = out * (n // size)
    data = codes.codes.to(torch.uint8).reshape(rows, size).contiguous()
    scale = codes.scale.reshape(rows, 1).to(torch.float32).contiguous()
    zero = codes.zero.reshape(rows, 1)
    integral = _integral(zero, 0, grid.maxq)
    if shift == "int" and not integral:
        raise _refuse(linear, codes, "an integer shift needs integer zero points in the code range")
    if shift == "float" or not integral:
        # quanto: scale * data - shift, ours: (q - z) * s = s * q - z * s (zero times scale, in the zero's
        # precision, then rounded once to fp32)
        offset = (zero * codes.scale.reshape(rows, 1).to(zero.dtype)).to(torch.float32).contiguous()
    else:
        # quanto: (data - shift) * scale with an integer shift: ours term for term
        offset = zero.to(torch.uint8).contiguous()
    return WeightQBitsTensor(
        qtypes[f"qint{grid.bits}"],
        0,
        grid.group_size,
        torch.Size((out, n)),
        (n, 1),
        data,
        scale,
        offset,
    )


def _qbytes_weight(codes: GroupCodes):
    """A ``WeightQBytesTensor`` (qint8, axis 0) with data ``q - z`` and one scale per output row."""
    from optimum.quanto import WeightQBytesTensor, qtypes  # noqa: PLC0415 (optional heavy library)

    out, n = codes.codes.shape
    data = (codes.codes.to(torch.int16) - codes.zero.to(torch.int16)).to(torch.int8).contiguous()
    scale = codes.scale.reshape(out, 1).to(torch.float32).contiguous()
    return WeightQBytesTensor(qtypes["qint8"], 0, torch.Size((out, n)), (n, 1), data, scale, None)


def codes_to_quanto(
    linear: torch.nn.Linear,
    codes: GroupCodes | QuantizedWeight,
    *,
    shift: Literal["auto", "int", "float"] = "auto",
) -> torch.nn.Module:
    """A frozen optimum-quanto ``QLinear`` computing ``F.linear(x, (q - z) * s, linear.bias)`` from ``codes``.

    ``codes``: the Linear's :class:`GroupCodes` (or the :class:`QuantizedWeight` holding them); its weight
    is only read for its shape, the bias is copied (fp32). ``shift`` (bits 2 / 4 only): "auto" stores an
    integer zero point when every zero is an integer on the grid (RTN, GPTQ: bit-exact) and a float shift
    ``z * s`` otherwise (HQQ); "int" refuses fractional zeros; "float" always stores ``z * s`` (quanto's
    default layout). Refuses what quanto cannot represent (module docstring) with a one-line
    :class:`DiffquantError`. The module lives on the codes' device, in fp32, weight-only, in eval mode.
    """
    if not isinstance(linear, torch.nn.Linear):
        raise DiffquantError(f"codes_to_quanto expects a torch.nn.Linear, got {type(linear).__name__}")
    if isinstance(codes, QuantizedWeight):
        if not codes.filled:
            raise DiffquantError(f"{codes.site}: no codes to export (run the calibration first)")
        codes = codes.group_codes()
    if shift not in ("auto", "int", "float"):
        raise DiffquantError(f"codes_to_quanto: shift must be 'auto', 'int' or 'float', got {shift!r}")
    _check(linear, codes)
    register_pure_torch_unpack()  # before the first qint4 / qint2 unpack (else a ~50 s JIT build)
    from optimum.quanto import QLinear, qtypes  # noqa: PLC0415 (optional heavy library)

    grid = codes.grid
    device = codes.codes.device
    scale, zero = codes.scale.to(device), codes.zero.to(device)
    codes = GroupCodes(codes.codes, scale, zero, grid)
    if grid.bits == 8:
        weight = _qbytes_weight(codes)
        group_size = None
    else:
        weight = _qbits_weight(codes, shift, linear)
        group_size = grid.group_size
    # QLinear.from_module + freeze(), without the float weight and the re-quantization
    qlinear = QLinear(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        dtype=torch.float32,
        device="meta",
        weights=qtypes[f"qint{grid.bits}"],
    ).to_empty(device=device)
    qlinear.input_scale = torch.ones((), dtype=torch.float32, device=device)
    qlinear.output_scale = torch.ones((), dtype=torch.float32, device=device)
    qlinear.weight_group_size = group_size
    qlinear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        bias = linear.bias.detach().to(device=device, dtype=torch.float32, copy=True)
        qlinear.bias = torch.nn.Parameter(bias, requires_grad=False)
    qlinear.requires_grad_(False)
    return qlinear.eval()
