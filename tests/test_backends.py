"""Real quantization backends (optimum-quanto, bitsandbytes) against references written here from the formats.

Every reference below is computed in float64 from the format's formulas (scales, rounding, codebooks), not by
calling the library. Tolerances are derived, never fitted:

* fp32 rounding: a length-n dot product computed in fp32 is within ``gamma_n * sum|a_i b_i|`` of the exact
  value, ``gamma_n ~= n * u``, ``u = 2**-24`` (Higham, Accuracy and Stability of Numerical Algorithms, 3.1);
  a few extra ``u`` cover the scale multiplications.
* Round-to-nearest ties: the library rounds ``w / s`` computed in fp32 while the reference rounds it in
  float64, so an element whose scaled value lies within ``TIE`` of a rounding boundary may legitimately land on
  either neighbour; such elements are listed and their worst case (one grid step times the other operand) is
  added to the bound. There are usually none.
* Format error: rounding to a grid of step ``s`` moves a value by at most ``s / 2``; a product then moves by
  at most ``|x| e_w + |w| e_x + e_x e_w``.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear
from diffquant.quant.backends import (
    load_quanto_state,
    quanto_calibration,
    quanto_state,
    to_bnb,
    to_quanto,
)

U = 2.0**-24  # fp32 unit roundoff
TIE = 1e-4  # |scaled value - rounding boundary| below which either neighbour is a correct rounding
#: QLoRA NF4 code (Dettmers et al. 2023, appendix E; the values bitsandbytes ships).
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
#: bitsandbytes FP4 (1 sign, 2 exponent, 1 mantissa bits, no inf/nan): magnitudes {0, 0.0625, 2, 3, 4, 6, 8, 12}
#: normalized by 12 (bitsandbytes.functional.get_4bit_type("fp4")).
FP4 = sorted({s * v / 12.0 for v in (0.0, 0.0625, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0) for s in (1.0, -1.0)})


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def linear_layer(in_features: int, out_features: int, seed: int, bias: bool = False) -> Linear:
    """diffquant's own Linear (the class the lead wraps), random weights with a few large ones per row."""
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.05)
        layer.weight[:, :3] *= 8.0  # heavier columns: absmax differs visibly from the typical weight
        if bias:
            layer.bias.normal_(0.0, 0.1)
    return layer


def round_with_ties(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round half to even (torch.round, like the libraries) and flag values within TIE of a .5 boundary."""
    frac = v - torch.floor(v)
    return torch.round(v), (frac - 0.5).abs() < TIE


def dot_bound(abs_products: torch.Tensor, n: int, extra_roundings: int = 4) -> torch.Tensor:
    """fp32 error bound of sum over the last dim of products whose absolute values are ``abs_products``."""
    return (n + extra_roundings) * U * abs_products.sum(-1)


def quanto_dequantized(module: torch.nn.Module) -> torch.Tensor:
    return f64(module.weight.dequantize())


# ------------------------------------------------------------------------------------------ optimum-quanto


def test_quanto_qint8_weights_match_the_int8_grid() -> None:
    layer = linear_layer(256, 64, seed=1)
    module = to_quanto(layer, "qint8")
    w = f64(layer.weight)
    # quanto qint8 weights: symmetric per output row, scale = absmax(row) / 127, q = clamp(round(w/s), -128, 127)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    q, tie = round_with_ties(w / scale)
    q = q.clamp(-128, 127)
    w_ref = scale * q
    w_mod = quanto_dequantized(module)
    grid_steps = w_mod / scale
    # the module's weights lie on the int8 grid of the per-row scale (scale itself is fp32: relative 2u)
    assert (grid_steps - grid_steps.round()).abs().max() < 1e-4
    assert grid_steps.round().abs().max() <= 127
    step_diff = (grid_steps.round() - q).abs()
    assert step_diff[~tie].max() == 0 and step_diff.max() <= 1
    # format bound: |w - w_q| <= s/2 = absmax_row/254 (times 1 + 4u for the fp32 scale)
    assert ((w - w_mod).abs() <= scale / 2 * (1 + 4 * U)).all()

    torch.manual_seed(2)
    x = torch.randn(3, 7, 256)
    with torch.no_grad():
        y = module(x)
    assert type(y) is torch.Tensor and y.dtype == torch.float32 and y.shape == (3, 7, 64)
    x64 = f64(x)
    y_ref = x64 @ w_ref.T
    # same dequantized weights -> only fp32 rounding (+ one grid step for the rare fp32/f64 tie flips)
    bound = dot_bound(x64.abs()[..., None, :] * w_ref.abs(), 256) + x64.abs() @ (tie * scale).T
    err = (f64(y) - y_ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    # and the format bound against the unquantized layer: sum_i |x_i| * absmax_row / 254
    format_bound = x64.abs().sum(-1, keepdim=True) * scale.T / 2 + bound
    assert ((f64(y) - x64 @ w.T).abs() <= format_bound).all()


def quanto_qint4_group_size(in_features: int) -> int | None:
    """quanto 0.2.7's rule (QModuleMixin.__init__): 128, else 96/64/32 if it divides and in_features > 128."""
    if in_features <= 128:
        return None
    for size in (128, 96, 64, 32):
        if in_features % size == 0:
            return size
    return None


@pytest.mark.parametrize("in_features", [256, 320, 96])
def test_quanto_qint4_groupwise_affine_without_cpp_build(in_features: int) -> None:
    from optimum.quanto.library.extensions import get_extension

    layer = linear_layer(in_features, 48, seed=3)
    torch.manual_seed(4)
    x = torch.randn(5, in_features)
    module = to_quanto(layer, "qint4")
    with torch.no_grad():
        y = module(x)
    # quanto's C++ unpack extension JIT-builds in ~50 s on first use; the pure-torch kernel avoids it entirely
    # (checked by the extension never being loaded, not by a wall time that depends on the machine's load)
    assert get_extension("quanto_cpp")._lib is None

    group = quanto_qint4_group_size(in_features)
    assert module.weight_group_size == group
    w = f64(layer.weight)
    groups = w.reshape(-1, group or in_features)  # groups of consecutive input features within a row
    # quanto qint4 is affine per group: scale = (max - min)/15, shift = -min, q = clamp(round((w+shift)/s), 0, 15)
    lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scale = (hi - lo) / 15.0
    q, tie = round_with_ties((groups - lo) / scale)
    w_ref = (scale * q.clamp(0, 15) + lo).reshape(w.shape)
    tie = tie.reshape(w.shape)
    step = scale.expand_as(groups).reshape(w.shape)
    w_mod = quanto_dequantized(module)
    # per element: within s/2 of the original (format), and equal to the reference up to the fp32 roundings of
    # (max - min)/15, scale*q and - shift (a few u of |scale*q| + |shift| <= range + |min|), or one step at a tie
    mag = ((hi - lo) + lo.abs()).expand_as(groups).reshape(w.shape)
    assert ((w - w_mod).abs() <= step / 2 + 8 * U * mag).all()
    diff = (w_mod - w_ref).abs()
    assert (diff[~tie] <= 8 * U * mag[~tie]).all()
    assert (diff[tie] <= step[tie] * (1 + 1e-6)).all()

    x64 = f64(x)
    err = (f64(y) - x64 @ w_ref.T).abs()
    bound = (
        dot_bound(x64.abs()[:, None, :] * w_ref.abs(), in_features)
        + x64.abs() @ (8 * U * mag).T
        + x64.abs() @ (step * tie).T
    )
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


_REFUSED = "This is not allowed since there's already a kernel registered from python overriding unpack"


def _torch_2_11_impl(real):
    """Library.impl as torch 2.8 - 2.11 have it: a key that already has a Python kernel (quanto's) is refused
    unless ``allow_override=True`` (the GPU machine's torch 2.11 refused diffquant's override, issue 45)."""

    def impl(self, op_name, fn, dispatch_key="", *, with_keyset=False, allow_override=False):
        if not allow_override and f"{self.ns}/{op_name}/{dispatch_key}" in torch.library._impls:
            raise RuntimeError(
                f"{_REFUSED}'s behavior for {dispatch_key} dispatch key and {self.ns} namespace."
            )
        return real(self, op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=True)

    return impl


def _torch_2_7_impl(real):
    """Library.impl before torch 2.8: no allow_override, a key with a Python kernel is always refused."""

    def impl(self, op_name, fn, dispatch_key="", *, with_keyset=False):
        if f"{self.ns}/{op_name}/{dispatch_key}" in torch.library._impls:
            raise RuntimeError(
                f"{_REFUSED}'s behavior for {dispatch_key} dispatch key and {self.ns} namespace."
            )
        return real(self, op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=True)

    return impl


@pytest.mark.parametrize(("api", "ours"), [(_torch_2_11_impl, ["CPU", "CUDA"]), (_torch_2_7_impl, [])])
def test_quanto_unpack_override_on_each_torch_library_api(monkeypatch, api, ours) -> None:
    """The pure-torch unpack replaces quanto's Python-registered kernel where torch allows it (2.8 on, asked
    with allow_override), keeps quanto's where torch cannot (before 2.8), and registers once per process
    (the second call changes nothing). Either way qint4 weights unpack to quanto's reference."""
    import optimum.quanto  # noqa: F401 (registers quanto's kernels, as the first to_quanto does)

    from diffquant.quant.backends import quanto

    monkeypatch.setattr(quanto, "_UNPACK_LIBRARY", None)
    monkeypatch.setattr(quanto, "UNPACK_KEYS", [], raising=False)
    for key in ("CPU", "CUDA"):  # quanto registers CUDA only on a CUDA machine: as if it had
        torch.library._impls.add(f"quanto/unpack/{key}")
    monkeypatch.setattr(torch.library.Library, "impl", api(torch.library.Library.impl))
    quanto.register_pure_torch_unpack()
    library = quanto._UNPACK_LIBRARY
    try:
        assert library is not None and list(quanto.UNPACK_KEYS) == ours
        quanto.register_pure_torch_unpack()  # once per process
        assert quanto._UNPACK_LIBRARY is library and list(quanto.UNPACK_KEYS) == ours
        packed = torch.tensor([[0x21, 0xF0], [0x7E, 0x03]], dtype=torch.uint8)
        expected = torch.tensor([[1, 0], [14, 3], [2, 15], [7, 0]], dtype=torch.uint8)  # low nibbles first
        if ours:
            assert torch.equal(torch.ops.quanto.unpack(packed, 4), expected)
        assert torch.equal(quanto._pure_torch_unpack(packed, 4), expected)
    finally:
        library._destroy()


def test_quanto_unpack_override_raises_other_errors(monkeypatch) -> None:
    import optimum.quanto  # noqa: F401 (imported first: its own registrations must not meet the broken impl)

    from diffquant.quant.backends import quanto

    def broken(self, *args, **kwargs):
        raise RuntimeError("some other registration failure")

    monkeypatch.setattr(quanto, "_UNPACK_LIBRARY", None)
    monkeypatch.setattr(torch.library.Library, "impl", broken)
    with pytest.raises(RuntimeError, match="some other registration failure"):
        quanto.register_pure_torch_unpack()


def e4m3_round(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to float8 e4m3fn (3 mantissa bits, min normal 2**-6, subnormal step 2**-9, max 448), RNE.

    Returns the rounded values, the local grid step and the tie flags (see round_with_ties)."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    step = 2.0 ** (exponent - 3)
    steps, tie = round_with_ties(v / step)
    return (steps * step).clamp(-448, 448), step, tie


def test_quanto_qfloat8_weights_on_the_e4m3_grid() -> None:
    layer = linear_layer(128, 32, seed=5)
    module = to_quanto(layer, "qfloat8")
    w = f64(layer.weight)
    # quanto qfloat8 weights: per output row, scale = absmax / 448, stored as e4m3fn(w / scale)
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    codes_ref, step, tie = e4m3_round(w / scale)
    w_mod = quanto_dequantized(module)
    # format: e4m3 moves a value by at most half a step (2**-4 relative for normals, 2**-10 for subnormals)
    assert ((w - w_mod).abs() <= scale * step / 2 * (1 + 8 * U)).all()
    # on the grid: the module's codes (w_mod / scale, up to the fp32 scale and product: 4u relative) are the
    # reference codes, or a neighbour at a tie
    codes_mod = w_mod / scale
    diff = (codes_mod - codes_ref).abs()
    assert (diff[~tie] <= 4 * U * codes_ref.abs()[~tie]).all()
    assert (diff[tie] <= step[tie] * (1 + 8 * U)).all()


def test_quanto_w8a8_calibrated_static_activations() -> None:
    layer = linear_layer(256, 64, seed=6, bias=True)
    module = to_quanto(layer, "qint8", "qint8")
    torch.manual_seed(7)
    batches = [torch.randn(4, 6, 256) * 2.0, torch.randn(4, 6, 256)]
    with quanto_calibration():
        for batch in batches:
            module(batch)
    # quanto: the first batch sets absmax/127, the next ones an EMA with momentum 0.9
    expected = 0.9 * (f64(batches[0]).abs().max() / 127) + 0.1 * (f64(batches[1]).abs().max() / 127)
    s_x = f64(module.input_scale)
    assert abs(s_x - expected) <= 4 * U * expected

    x = batches[0] * 0.5  # inside the calibrated range: no clipping
    with torch.no_grad():
        y = module(x)
    assert type(y) is torch.Tensor and y.dtype == torch.float32  # output not re-quantized
    w = f64(layer.weight)
    s_w = w.abs().amax(dim=1) / 127.0
    qw, tie_w = round_with_ties(w / s_w[:, None])
    qx, tie_x = round_with_ties(f64(x) / s_x)
    qx = qx.clamp(-128, 127)
    # reference: per-tensor int8 x (calibrated scale) times per-row int8 w, exact integer accumulation
    acc = qx @ qw.T
    y_ref = acc * s_x * s_w + f64(layer.bias)
    # module: torch._int_mm exact in int32 (|acc| <= 128*127*256 < 2**24, so exact in fp32 too), then
    # * (s_x * s_w) in fp32: 3 roundings + the fp32 weight scale (2u) + the bias add; ties as documented above
    x_mag = qx.abs() * s_x
    w_mag = qw.abs() * s_w[:, None]
    bound = (
        8 * U * (acc.abs() * s_x * s_w + f64(layer.bias).abs())
        + (s_x * tie_x.double()) @ w_mag.T
        + x_mag @ (s_w[:, None] * tie_w).T
    )
    err = (f64(y) - y_ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    # format bound vs the fp32 layer: e_x = s_x/2, e_w = s_w/2 per element
    x64 = f64(x)
    y_true = x64 @ w.T + f64(layer.bias)
    e_w = (s_w / 2).expand(256, 64)
    format_bound = x64.abs() @ e_w + (s_x / 2) * w.abs().sum(1) + 256 * (s_x / 2) * s_w / 2 + bound
    assert ((f64(y) - y_true).abs() <= format_bound).all()


def test_quanto_state_round_trip_and_determinism() -> None:
    layer = linear_layer(256, 32, seed=8, bias=True)
    torch.manual_seed(9)
    calib, probe = torch.randn(2, 8, 256), torch.randn(3, 256)
    first = to_quanto(layer, "qint4", "qint8")
    with quanto_calibration():
        first(calib)
    state = quanto_state(first)
    assert set(state) == {"input_scale", "output_scale"}
    assert all(type(v) is torch.Tensor and not v.requires_grad for v in state.values())

    from safetensors.torch import load, save

    fresh = to_quanto(layer, "qint4", "qint8")
    load_quanto_state(fresh, load(save(state)))
    with torch.no_grad():
        assert torch.equal(first(probe), fresh(probe))
    # weight-only: converting twice gives identical modules, and there is no state to carry
    with torch.no_grad():
        for weights in ("qint8", "qint4", "qfloat8"):
            assert torch.equal(to_quanto(layer, weights)(probe), to_quanto(layer, weights)(probe))
    assert quanto_state(to_quanto(layer, "qint8")) == {}
    # the source layer is untouched
    assert type(layer.weight) is torch.nn.Parameter and layer.weight.dtype == torch.float32
    with pytest.raises(DiffquantError):
        load_quanto_state(fresh, {"input_scale": state["input_scale"]})


# ------------------------------------------------------------------------------------------- bitsandbytes


def llm_int8_reference(x: torch.Tensor, w: torch.Tensor, threshold: float) -> dict[str, torch.Tensor]:
    """LLM.int8 as bitsandbytes specifies it, in float64 (x: (tokens, K), w: (N, K), both fp32 values).

    Weights and activations are first rounded to fp16 (bnb quantizes fp16 tensors); columns with any
    |x| >= threshold are outliers: taken from x unquantized; the rest is int8 per token (absmax over the
    non-outlier elements) times int8 per output row.
    """
    x16, w16 = f64(x.half()), f64(w.half())
    outlier = x16.abs() >= threshold if threshold > 0 else torch.zeros_like(x16, dtype=torch.bool)
    cols = outlier.any(dim=0)
    row_max = torch.where(outlier, 0.0, x16).abs().amax(dim=1)
    qx, tie_x = round_with_ties(x16 * 127 / row_max[:, None])
    qx[:, cols] = 0
    tie_x[:, cols] = False
    scb = w16.abs().amax(dim=1)
    qw, tie_w = round_with_ties(w16 * 127 / scb[:, None])
    w_deq = qw * scb[:, None] / 127
    y_int = (qx @ qw.T) * row_max[:, None] * scb / 127**2
    y_out = f64(x)[:, cols] @ w_deq[:, cols].T
    return dict(
        y=y_int + y_out, y_int=y_int, y_out_abs=f64(x).abs()[:, cols] @ w_deq[:, cols].abs().T,
        cols=cols, row_max=row_max, scb=scb, qx=qx, tie_x=tie_x, tie_w=tie_w, w_deq=w_deq, x16=x16, w16=w16,
    )  # fmt: skip


def outlier_input(
    tokens_shape: tuple[int, ...], in_features: int, cols: list[int], seed: int
) -> torch.Tensor:
    """N(0, 1) clipped to +-5 (below the 6.0 threshold) with planted outlier columns |x| in [15, 25]."""
    torch.manual_seed(seed)
    x = torch.randn(*tokens_shape, in_features).clamp(-5, 5)
    sign = torch.randint(0, 2, (*tokens_shape, len(cols))) * 2 - 1
    x[..., cols] = sign * (15 + 10 * torch.rand(*tokens_shape, len(cols)))
    return x


def test_bnb_llm_int8_matches_vectorwise_int8_with_outlier_decomposition() -> None:
    layer = linear_layer(256, 64, seed=10, bias=True)
    planted = [5, 77, 200]
    x = outlier_input((2, 8), 256, planted, seed=11)
    module = to_bnb(layer, "int8", threshold=6.0)
    with torch.no_grad():
        y = module(x)
    assert y.dtype == torch.float32 and y.shape == (2, 8, 64)
    assert module.state.idx.tolist() == planted  # the decomposition path ran, on exactly the planted columns

    xt, w, b = x.reshape(-1, 256), layer.weight.detach(), f64(layer.bias)
    ref = llm_int8_reference(xt, w, 6.0)
    # module vs reference:
    # * int8 part: exact int32 accumulation (|acc| <= 127*127*256 < 2**24), dequantized in fp32 with 3 roundings
    #   and bnb's literal 6.200124e-05 for 1/127**2, which is (1 + 1.8e-5)/127**2: relative 4u + 1.81e-5;
    # * outlier part: fp32 addmm over len(cols) terms (+ CB*SCB/127 in fp32: 2u) + the bias add;
    # * ties: one step of x (row_max/127) times |w_deq|, or one step of w (scb/127) times |x_deq|.
    x_used = torch.where(ref["cols"], f64(xt), ref["qx"] * ref["row_max"][:, None] / 127).abs()
    bound = (
        (4 * U + 1.81e-5) * ref["y_int"].abs()
        + (len(planted) + 6) * U * (ref["y_out_abs"] + ref["y_int"].abs() + b.abs())
        + (ref["tie_x"].double() * ref["row_max"][:, None] / 127) @ ref["w_deq"].abs().T
        + x_used @ (ref["tie_w"] * ref["scb"][:, None] / 127).T
    )
    err = (f64(y).reshape(-1, 64) - (ref["y"] + b)).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"

    # format bound vs the fp32 layer: x off by fp16 rounding (2**-11 relative, 2**-25 absolute below fp16's
    # normal range) + half an int8 step (row_max/254) outside the outlier columns, exact inside them;
    # w off by the same fp16 rounding + scb/254 everywhere
    x64, w64 = f64(xt), f64(w)
    e_x = torch.where(ref["cols"], 0.0, x64.abs() * 2.0**-11 + 2.0**-25 + ref["row_max"][:, None] / 254)
    e_w = w64.abs() * 2.0**-11 + 2.0**-25 + ref["scb"][:, None] / 254
    format_bound = x64.abs() @ e_w.T + e_x @ w64.abs().T + e_x @ e_w.T + bound
    y_true = x64 @ w64.T + b
    assert ((f64(y).reshape(-1, 64) - y_true).abs() <= format_bound).all()

    # the outlier columns' contribution is exact in x: removing them changes neither the int8 codes nor the
    # token scales (every element of a planted column is an outlier, zeroed before the absmax), so the
    # difference is x[:, cols] @ w_deq[:, cols].T up to fp32 rounding of the add
    x_without = x.clone()
    x_without[..., planted] = 0
    with torch.no_grad():
        delta = f64(module(x) - module(x_without)).reshape(-1, 64)
    contribution = x64[:, planted] @ ref["w_deq"][:, planted].T
    delta_bound = (len(planted) + 6) * U * (ref["y_out_abs"] + ref["y_int"].abs() + b.abs()) * 2
    assert ((delta - contribution).abs() <= delta_bound).all()

    # threshold 0 (no decomposition) puts the outliers into every token's int8 scale. Both modules share the
    # same int8 weights, so compare against x @ w_deq.T to isolate the activation error: each token's step
    # grows by row_max_with / row_max_without >= 15/5 = 3 (and the outlier columns are rounded too), so the
    # mean activation error must be clearly (> 2x; 1024 outputs average out the sampling noise) larger
    plain = to_bnb(layer, "int8", threshold=0.0)
    y_wq = x64 @ ref["w_deq"].T + b
    with torch.no_grad():
        err_plain = (f64(plain(x)).reshape(-1, 64) - y_wq).abs().mean()
    err_decomposed = (f64(y).reshape(-1, 64) - y_wq).abs().mean()
    assert err_decomposed * 2 < err_plain


def test_bnb_int8_stays_eval_and_is_deterministic() -> None:
    layer = linear_layer(128, 32, seed=12)
    x = outlier_input((6,), 128, [3], seed=13)
    first, second = to_bnb(layer, "int8"), to_bnb(layer, "int8")
    first.train()
    with torch.no_grad():
        y1, y2 = first(x), second(x)
    assert not first.training  # pinned to eval: bnb's CPU train mode would skip LLM.int8 entirely
    assert torch.equal(y1, y2)


def blockwise_4bit_reference(w: torch.Tensor, code: list[float], blocksize: int) -> dict[str, torch.Tensor]:
    """bnb 4-bit: flatten row-major, blocks of ``blocksize`` (last one may be short), fp32 absmax per block,
    nearest code value of w/absmax. ``tie`` flags elements within 1e-6 of a midpoint between two codes."""
    flat = f64(w).reshape(-1)
    n = flat.numel()
    block = torch.arange(n) // blocksize
    absmax = torch.zeros(int(block[-1]) + 1, dtype=torch.float64).scatter_reduce(
        0, block, flat.abs(), reduce="amax"
    )[block]
    values = torch.tensor(code, dtype=torch.float64)
    scaled = flat / absmax
    distance = (scaled[:, None] - values[None, :]).abs()
    nearest = distance.argmin(dim=1)
    ordered = distance.sort(dim=1).values
    tie = (ordered[:, 1] - ordered[:, 0]) < 1e-6
    gap = torch.diff(values).max()
    return dict(
        w_ref=(values[nearest] * absmax).reshape(w.shape), tie=tie.reshape(w.shape),
        absmax=absmax.reshape(w.shape), max_gap=gap,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["nf4", "fp4"])
@pytest.mark.parametrize("shape, blocksize", [((64, 256), 64), ((30, 96), 32), ((16, 256), 128)])
def test_bnb_4bit_matches_blockwise_codebook(mode: str, shape: tuple[int, int], blocksize: int) -> None:
    import bitsandbytes.functional as bnbf

    out_features, in_features = shape
    layer = linear_layer(in_features, out_features, seed=14)
    module = to_bnb(layer, mode, blocksize=blocksize)
    ref = blockwise_4bit_reference(layer.weight, NF4 if mode == "nf4" else FP4, blocksize)
    w = f64(layer.weight)
    # every weight within half the largest codebook gap (times its block absmax) of the original
    assert ((w - ref["w_ref"]).abs() <= ref["absmax"] * ref["max_gap"] / 2 * (1 + 1e-6)).all()
    # the module's weights are the reference codes times the fp32 absmax (exact products in fp32: 1u)
    w_mod = f64(bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state))
    diff = (w_mod - ref["w_ref"]).abs()
    assert (diff[~ref["tie"]] <= 2 * U * ref["absmax"][~ref["tie"]]).all()
    assert (diff[ref["tie"]] <= ref["absmax"][ref["tie"]] * ref["max_gap"] * (1 + 1e-6)).all()

    torch.manual_seed(15)
    x = torch.randn(2, 5, in_features)
    with torch.no_grad():
        y = module(x)
    assert y.dtype == torch.float32
    x64 = f64(x)
    bound = (
        dot_bound(x64.abs()[..., None, :] * ref["w_ref"].abs(), in_features)
        + x64.abs() @ (2 * U * ref["absmax"]).T
        + x64.abs() @ (ref["tie"] * ref["absmax"] * ref["max_gap"]).T
    )
    err = (f64(y) - x64 @ ref["w_ref"].T).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    with torch.no_grad():
        assert torch.equal(y, to_bnb(layer, mode, blocksize=blocksize)(x))  # deterministic re-conversion


def test_bnb_4bit_keeps_bias_and_source() -> None:
    layer = linear_layer(64, 16, seed=16, bias=True)
    before = layer.weight.detach().clone()
    for mode in ("nf4", "fp4"):
        with torch.no_grad():  # zero input: exactly the bias
            assert torch.equal(to_bnb(layer, mode)(torch.zeros(2, 64)), layer.bias.detach().expand(2, 16))
    assert torch.equal(layer.weight, before) and type(layer.weight) is torch.nn.Parameter


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "convert",
    [
        lambda layer: to_quanto(layer, "int8"),
        lambda layer: to_quanto(layer, "qint2"),
        lambda layer: to_quanto(layer, "qint8", "qint4"),
        lambda layer: to_bnb(layer, "int4"),
        lambda layer: to_bnb(layer, "nf4", blocksize=48),
        lambda layer: to_bnb(linear_layer(96, 8, seed=0), "fp4", blocksize=64),  # 96 % 64: see bnb.py
        lambda layer: to_bnb(layer, "int8", threshold=-1.0),
        lambda layer: to_bnb(layer, "int8", threshold=math.nan),
        lambda layer: to_quanto(torch.nn.Conv1d(4, 4, 1), "qint8"),
        lambda layer: quanto_state(layer),
    ],
)
def test_bad_names_raise_one_line_errors(convert) -> None:
    with pytest.raises(DiffquantError) as info:
        convert(linear_layer(64, 8, seed=0))
    assert "\n" not in str(info.value)


def test_error_messages_list_the_valid_names() -> None:
    with pytest.raises(DiffquantError, match="qint8, qint4, qfloat8"):
        to_quanto(linear_layer(64, 8, seed=0), "int4")
    with pytest.raises(DiffquantError, match="int8, nf4, fp4"):
        to_bnb(linear_layer(64, 8, seed=0), "q4")
