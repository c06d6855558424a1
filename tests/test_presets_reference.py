"""Every weight / activation preset against an independent computation of its published recipe.

The references below are written from the format specifications, not from diffquant's code: E4M3 through
torch's own float8_e4m3fn cast, E2M1 by nearest-value search over its eight magnitudes with ties to the even
encoding (OCP MX v1.0 sec. 5.3.3, saturating at 6), MX shared scales 2^(floor(log2 amax) - 2) (OCP MX v1.0
sec. 6.3), NVFP4's two-level scale (fp32 tensor scale amax / (448 * 6), E4M3 block scale of the block amax /
(6 s_t), rounded to nearest; NVIDIA TensorRT-ModelOpt), int absmax with round-half-even. A preset whose
contents or scale rule changed fails here, not only "applies and stays finite".
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from diffquant.quant import QuantPlan, apply_plan

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to the even encoding (index), saturating at +-6."""
    mag = x.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    # among the nearest codes (one, or two at a tie) take the even index
    idx = torch.arange(8)
    candidates = torch.where(dist == best, idx, 99)
    even = torch.where(candidates % 2 == 0, candidates, 99).min(-1).values
    pick = torch.where(even < 99, even, candidates.min(-1).values)
    return torch.sign(x) * E2M1[pick]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def int_absmax(x: torch.Tensor, bits: int, dims) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    s = x.abs().amax(dim=dims, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-qmax, qmax) * s


def fp8_absmax(x: torch.Tensor, dims) -> torch.Tensor:
    s = x.abs().amax(dim=dims, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return e4m3(x / s) * s


def blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    xb = blocks(x, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax)) - 2), torch.ones_like(amax))
    return (e2m1(xb / scale) * scale).reshape(x.shape)


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    s_t = x.abs().amax() / (448.0 * 6.0)
    xb = blocks(x, 16)
    s_b = e4m3(xb.abs().amax(-1, keepdim=True) / (6.0 * s_t))
    return (e2m1(xb / (s_b * s_t)) * s_b * s_t).reshape(x.shape)


def group_int4(w: torch.Tensor) -> torch.Tensor:
    return int_absmax(blocks(w, 32), 4, (-1,)).reshape(w.shape)


# preset -> (weight reference, activation reference on a (B, T, C) Linear input, or None: not quantized)
PRESETS = {
    "w8a8": (lambda w: int_absmax(w, 8, (1,)), lambda x: int_absmax(x, 8, (-1,))),
    "w4a8": (group_int4, lambda x: int_absmax(x, 8, (-1,))),
    "w4a16": (group_int4, None),
    "fp8": (lambda w: fp8_absmax(w, (1,)), lambda x: fp8_absmax(x, (-1,))),
    "mxfp4": (mxfp4, mxfp4),
    "nvfp4": (nvfp4, lambda x: torch.stack([nvfp4(xb) for xb in x])),  # tensor scale per sample
}


def _heavy(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    x.view(-1)[::97] *= 40.0  # outliers
    return x


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_matches_an_independent_reference(name):
    weight_ref, act_ref = PRESETS[name]
    model = tiny_model("baseline")
    apply_plan(model, QuantPlan.load(name))
    linear = model.layers[0].mlp.up
    w = linear.weight.detach()
    got = linear.weight_quantizer.quantize_weight(w)
    torch.testing.assert_close(got, weight_ref(w), rtol=0, atol=0)
    tap = dict(model.named_modules())["layers.0.mlp.up.input"]
    x = _heavy((2, 8, w.shape[1]), seed=3)
    if act_ref is None:
        assert tap.quantizer is None
    else:
        torch.testing.assert_close(tap.quantizer(x), act_ref(x), rtol=0, atol=0)


def test_references_themselves():
    """The references' own anchors: E2M1 ties to even and saturation; the MX scale of amax 6 is 1."""
    assert e2m1(torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 7.0, -2.5])).tolist() == [
        0.0,
        1.0,
        1.0,
        2.0,
        4.0,
        4.0,
        6.0,
        -2.0,
    ]
    x = torch.zeros(32)
    x[0] = 6.0
    assert mxfp4(x)[0].item() == 6.0
