"""codes_to_quanto: diffquant's RTN / GPTQ / HQQ codes as optimum-quanto QLinear modules, without re-quantization.

References are ours: ``GroupCodes.dequantize`` ((q - z) * s) and ``F.linear`` on it. Tolerances: the
dequantized weight is bit-identical for an integer shift with fp32 scales (quanto computes ``(q - z) * s``
term for term); with the float64 scales the methods return it differs by the fp32 rounding of the scale
(1 ulp, ``2^-24`` relative), and with a float shift ``s q - z s`` by two roundings of values up to ``15 s``
(a few ulp of the largest weight), all far under 1e-6 of ``max |w|``. The forward is an fp32 matmul of 256
terms either way (quanto: matmul then bias; ours: addmm): well under 1e-5 of ``max |y|``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("optimum.quanto")

from optimum.quanto import WeightQBitsTensor, WeightQBytesTensor  # noqa: E402

from diffquant.errors import DiffquantError  # noqa: E402
from diffquant.quant.backends.quanto_codes import codes_to_quanto  # noqa: E402
from diffquant.quant.gptq import gptq_codes  # noqa: E402
from diffquant.quant.hqq import hqq_codes  # noqa: E402
from diffquant.quant.weightcodes import GroupCodes, QuantizedWeight, WeightGrid, rtn_codes  # noqa: E402

IN, OUT = 256, 64
FORWARD_RTOL = 1e-5
WEIGHT_RTOL = 1e-6


def make_linear(bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        linear.weight[:, :3] *= 6.0  # a few heavy columns: groups with different ranges
        if bias:
            linear.bias.normal_(0.0, 0.1)
    return linear


def make_codes(linear: torch.nn.Linear, method: str, grid: WeightGrid) -> GroupCodes:
    if method == "rtn":
        return rtn_codes(linear.weight, grid)
    if method == "hqq":
        return hqq_codes(linear.weight, grid)
    x = torch.randn(512, IN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hessian = 2.0 * x.T @ x / x.shape[0]
    return gptq_codes(linear.weight, hessian, grid)


def fp32(codes: GroupCodes) -> GroupCodes:
    """The same codes with fp32 scale / zero: what the quanto module stores."""
    return GroupCodes(codes.codes, codes.scale.float(), codes.zero.float(), codes.grid)


def check_module(qlinear: torch.nn.Module, linear: torch.nn.Linear, codes: GroupCodes, exact: bool) -> None:
    """Output vs F.linear on our dequantized weight, and the stored weight's dequantize() vs ours."""
    ours = codes.dequantize(torch.float32)
    x = torch.randn(16, IN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = qlinear(x)
        ref = F.linear(x, ours, linear.bias)
        dq = qlinear.weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float((got - ref).abs().max()) <= FORWARD_RTOL * float(ref.abs().max())
    assert dq.shape == (OUT, IN) and dq.dtype == torch.float32
    wmax = float(ours.abs().max())
    assert float((dq - ours).abs().max()) <= WEIGHT_RTOL * wmax
    if exact:
        assert torch.equal(dq, fp32(codes).dequantize())


def check_frozen(qlinear: torch.nn.Module) -> None:
    from optimum.quanto import QLinear

    assert isinstance(qlinear, QLinear) and qlinear.frozen and not qlinear.training
    assert not any(p.requires_grad for p in qlinear.parameters())
    assert qlinear.activation_qtype is None


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_int4_codes_match(method: str, group: int, sym: bool, bias: bool) -> None:
    linear = make_linear(bias)
    codes = make_codes(linear, method, WeightGrid(4, group, sym))
    qlinear = codes_to_quanto(linear, codes)
    check_frozen(qlinear)
    weight = qlinear.weight
    assert type(weight) is WeightQBitsTensor and weight.qtype.name == "qint4"
    assert weight._group_size == group == qlinear.weight_group_size
    assert weight._shift.dtype == torch.uint8  # integer zero points: quanto's (data - shift) * scale
    # the codes themselves, not a re-quantization: unpacked data equals ours in quanto's grouped layout
    assert torch.equal(weight._data.unpack(), codes.codes.reshape(-1, group))
    assert torch.equal(weight._shift.reshape(OUT, -1), codes.zero.to(torch.uint8))
    check_module(qlinear, linear, codes, exact=True)


def test_float_shift_hqq() -> None:
    """HQQ's fractional zeros go to quanto's float shift z * s (scale * data - shift)."""
    linear = make_linear(True)
    codes = make_codes(linear, "hqq", WeightGrid(4, 64, False))
    assert not torch.equal(codes.zero, codes.zero.round())
    qlinear = codes_to_quanto(linear, codes)
    assert qlinear.weight._shift.dtype == torch.float32
    check_module(qlinear, linear, codes, exact=False)
    with pytest.raises(DiffquantError, match="integer shift"):
        codes_to_quanto(linear, codes, shift="int")


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_float_shift_forced(sym: bool) -> None:
    linear = make_linear(False)
    codes = make_codes(linear, "gptq", WeightGrid(4, 128, sym))
    qlinear = codes_to_quanto(linear, codes, shift="float")
    assert qlinear.weight._shift.dtype == torch.float32
    check_module(qlinear, linear, codes, exact=False)


def test_int2_and_per_channel() -> None:
    linear = make_linear(True)
    codes2 = make_codes(linear, "gptq", WeightGrid(2, 64, False))
    q2 = codes_to_quanto(linear, codes2)
    assert q2.weight.qtype.name == "qint2"
    check_module(q2, linear, codes2, exact=True)
    channel = make_codes(linear, "rtn", WeightGrid(4, None, True))
    qc = codes_to_quanto(linear, channel)
    assert qc.weight._group_size is None and qc.weight._scale.shape == (OUT, 1)
    check_module(qc, linear, channel, exact=True)


def test_int8_symmetric_per_channel() -> None:
    linear = make_linear(True)
    codes = make_codes(linear, "gptq", WeightGrid(8, None, True))
    qlinear = codes_to_quanto(linear, codes)
    check_frozen(qlinear)
    assert type(qlinear.weight) is WeightQBytesTensor and qlinear.weight.qtype.name == "qint8"
    assert torch.equal(qlinear.weight._data.to(torch.int16), codes.codes.to(torch.int16) - 128)
    check_module(qlinear, linear, codes, exact=True)


def test_quantized_weight_and_state_dict() -> None:
    """A QuantizedWeight is accepted; the module's state dict reloads into one built the same way."""
    linear = make_linear(True)
    grid = WeightGrid(4, 64, False)
    holder = QuantizedWeight("blk.up", SimpleNamespace(grid=grid, method="gptq"), (OUT, IN))
    holder.set_codes(make_codes(linear, "gptq", grid))
    qlinear = codes_to_quanto(linear, holder)
    check_module(qlinear, linear, holder.group_codes(), exact=True)
    other = codes_to_quanto(make_linear(True, seed=5), rtn_codes(make_linear(True, seed=5).weight, grid))
    other.load_state_dict(qlinear.state_dict())
    x = torch.randn(4, IN)
    with torch.no_grad():
        assert torch.equal(other(x), qlinear(x))


@pytest.mark.parametrize(
    ("bits", "group", "sym", "words"),
    [
        (3, 64, True, ["3-bit", "group_size 64", "[64, 256]", "qint4"]),
        (4, 48, False, ["4-bit", "group_size 48", "does not divide in_features 256", "[64, 256]"]),
        (8, None, False, ["8-bit", "group_size channel", "symmetric"]),
        (8, 64, True, ["8-bit", "group_size 64", "no groups"]),
    ],
    ids=["bits3", "group48", "int8-asym", "int8-grouped"],
)
def test_refusals(bits: int, group: int | None, sym: bool, words: list[str]) -> None:
    linear = make_linear(False)
    codes = rtn_codes(linear.weight, WeightGrid(bits, group, sym))
    with pytest.raises(DiffquantError) as info:
        codes_to_quanto(linear, codes)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_refuses_mismatched_codes() -> None:
    linear = make_linear(False)
    codes = rtn_codes(torch.randn(OUT, 128), WeightGrid(4, 64, True))
    with pytest.raises(DiffquantError, match="expected"):
        codes_to_quanto(linear, codes)
    with pytest.raises(DiffquantError, match="torch.nn.Linear"):
        codes_to_quanto(torch.nn.Conv1d(1, 1, 1), codes)  # type: ignore[arg-type]
