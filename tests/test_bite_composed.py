"""Composed transforms (issue 47 item 4): with every rotation place on (R1 residual, R2 heads, R3 qk, R4 the
online rotation before ``mlp.down``), GPTQ's codes, and SmoothQuant's factors before them, must come from
the activations of the ROTATED model: the input each weight really multiplies.

The reference is built here, independently of the plan's calibration: the model is rotated alone
(``rotate_model``), then decoder layer by decoder layer the Linear inputs are recorded with hooks written
here (on the Linear module, before its online rotation, which this test applies itself with the rotation's
matrix), each Linear's Hessian 2 X^T X / N is accumulated batch by batch as the project's ``Hessian`` does
(so the floats are the same), its codes are ``gptq_codes`` of the rotated weight on that Hessian, and the
layer's weights are replaced by their dequantized codes before the next layer's inputs are recorded
(sequential GPTQ). The plan's codes must equal these exactly, code for code. A pipeline that reads the
Hessian of ``mlp.down`` before R4 (or after smoothing's norm, or with the activation quantizers on) fails.

Fixture: the zoo's trained checkpoints on WikiText-2 text (real weights and activations; their widths 96,
24 and 384 have Hadamard matrices of Paley's construction).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from diffquant.data.corpus import token_windows
from diffquant.io.load import load_model
from diffquant.models.attention import Linear
from diffquant.quant import QuantPlan, apply_plan, calibrate
from diffquant.quant.gptq import Hessian, gptq_codes
from diffquant.quant.rotate import RotateSpec, rotate_model
from diffquant.quant.weightcodes import QuantizedWeight, WeightGrid

EVERY_PLACE = {"residual": "hadamard", "heads": "hadamard", "ffn": "hadamard", "qk": "hadamard"}
BATCH = 2
GPTQ = {"method": "gptq", "format": "int4", "group": 24, "sym": False, "act_order": True, "lazy_batch": 32}


def _windows() -> torch.Tensor:
    """Four 48-byte windows of WikiText-2 test (the zoo models read bytes)."""
    return token_windows("wikitext2:test", 4 * 48, 48, quiet=True)


def _zoo(kind: str, layers: int = 2) -> torch.nn.Module:
    """A zoo checkpoint cut to its first ``layers`` decoder layers (enough to show the sequential inputs;
    cheaper)."""
    model = load_model(f"zoo:{kind}")
    model.layers = model.layers[:layers]
    model.config = dataclasses.replace(model.config, n_layers=layers)
    return model.eval()


def _layer_rows(model: torch.nn.Module, layer: int, windows: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per Linear of decoder layer ``layer``: its input rows per batch, as the weight multiplies them: the
    Linear's argument, times the online rotation's matrix when the Linear has one (R4 before mlp.down),
    applied here from the matrix, not by the module."""
    rows: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.layers[layer].named_modules():
        if isinstance(module, Linear):

            def record(m, args, name=name):
                x = args[0].detach()
                if m.input_rotation is not None:
                    x = torch.matmul(x, m.input_rotation.matrix.to(x.dtype))
                rows.setdefault(name, []).append(x.reshape(-1, x.shape[-1]))

            handles.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            for start in range(0, windows.shape[0], BATCH):
                model(windows[start : start + BATCH])
    finally:
        for h in handles:
            h.remove()
    return rows


def _reference_codes(
    rotated: torch.nn.Module, windows: torch.Tensor, grid: WeightGrid
) -> dict[str, torch.Tensor]:
    """Sequential GPTQ on ``rotated`` (float, rotated only; changed in place): layer l's Hessians from the
    outputs of layers 0..l-1 already replaced by their dequantized codes. Returns codes by Linear name."""
    out = {}
    for layer in range(len(rotated.layers)):
        rows = _layer_rows(rotated, layer, windows)
        chosen = {}
        for name, batches in rows.items():
            hessian = Hessian(batches[0].shape[-1])
            for x in batches:
                hessian.add(x)
            linear = rotated.layers[layer].get_submodule(name)
            chosen[name] = gptq_codes(
                linear.weight.detach(),
                hessian.matrix,
                grid,
                act_order=GPTQ["act_order"],
                block=GPTQ["lazy_batch"],
                what=name,
            )
        for name, codes in chosen.items():
            linear = rotated.layers[layer].get_submodule(name)
            linear.weight.data = _served(codes).to(linear.weight.dtype)
            out[f"layers.{layer}.{name}"] = codes.codes
    return out


def _served(codes) -> torch.Tensor:
    """The weight a quantized Linear computes with: (q - z) * s in float32, its scale and zero point
    stored as float32 (a quantized checkpoint's buffers); a partial last group when the size does not divide
    the width (DIFF V2's FFN of 352)."""
    n = codes.codes.shape[1]
    group = codes.grid.size(n)
    scale = codes.scale.float().repeat_interleave(group, dim=1)[:, :n]
    zero = codes.zero.float().repeat_interleave(group, dim=1)[:, :n]
    return (codes.codes.float() - zero) * scale


def _plan_codes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.removesuffix(".weight_quantizer"): m.codes
        for n, m in model.named_modules()
        if isinstance(m, QuantizedWeight)
    }


@pytest.mark.parametrize("kind", ["baseline", "diff_v1", "diff_v2"])
def test_gptq_codes_with_every_rotation_place_are_those_of_the_rotated_activations(kind):
    windows = _windows()
    model = _zoo(kind)
    reference = copy.deepcopy(model)
    # int4 per-token activations on every Linear input: off while the weights are chosen
    plan = QuantPlan.from_dict(
        {
            "name": "t",
            "rotate": EVERY_PLACE,
            "weights": GPTQ,
            "rules": [{"sites": ["kind:linear_in"], "scheme": "int4:token"}],
        }
    )
    apply_plan(model, plan)
    calibrate(model, windows, batch_size=BATCH)
    rotate_model(reference, RotateSpec(**EVERY_PLACE))
    assert all(reference.layers[i].mlp.down.input_rotation is not None for i in range(2))
    want = _reference_codes(reference, windows, WeightGrid(4, 24, False))
    got = _plan_codes(model)
    assert sorted(got) == sorted(want) and len(want) == 2 * (7 if kind != "diff_v2" else 8)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name].to(torch.int64), want[name].to(torch.int64)), name


def _reference_smoothing(
    rotated: torch.nn.Module, windows: torch.Tensor, alpha: float
) -> dict[str, torch.Tensor]:
    """SmoothQuant on ``rotated`` (changed in place), from the paper: per norm, s_j = max|X_j|^alpha /
    max|W_j|^(1 - alpha) with max|X_j| over the calibration tokens of the rotated float model and max|W_j|
    over the rows of every Linear reading the norm (clamped at 1e-5); the norm's gain divided by s, the
    readers' input columns multiplied by it. Returns s by norm name."""
    groups = []
    for i, block in enumerate(rotated.layers):
        readers = [m for n, m in block.attn.named_children() if isinstance(m, Linear) and n != "o_proj"]
        groups.append((f"layers.{i}.attn_norm", block.attn_norm, readers))
        groups.append((f"layers.{i}.mlp_norm", block.mlp_norm, [block.mlp.gate, block.mlp.up]))
    amax: dict[str, torch.Tensor] = {}
    handles = [
        readers[0].register_forward_pre_hook(
            lambda _m, args, name=name: amax.__setitem__(
                name,
                torch.maximum(amax.get(name, torch.zeros(())), args[0].detach().abs().flatten(0, -2).amax(0)),
            )
        )
        for name, _, readers in groups
    ]
    with torch.no_grad():
        for start in range(0, windows.shape[0], BATCH):
            rotated(windows[start : start + BATCH])
    for h in handles:
        h.remove()
    factors = {}
    for name, norm, readers in groups:
        a = amax[name].double()
        w = torch.stack([r.weight.detach().abs().double().amax(0) for r in readers]).amax(0).clamp(min=1e-5)
        s = (a**alpha / w ** (1 - alpha)).clamp(min=1e-5)
        s = torch.where(a > 0, s, torch.ones_like(s))
        norm.weight.data = (norm.weight.detach().double() / s).float()
        for r in readers:
            r.weight.data = (r.weight.detach().double() * s[None, :]).float()
        factors[name] = s
    return factors


@pytest.mark.parametrize("kind", ["baseline", "diff_v2"])
def test_smoothing_and_gptq_after_every_rotation_place_read_the_rotated_activations(kind):
    """Rotation (every place), then smoothing whose act-scales are the ROTATED float model's Linear inputs,
    then sequential GPTQ on the rotated and smoothed weights and activations: factors and codes equal the
    reference's."""
    windows = _windows()
    model = _zoo(kind)
    reference = copy.deepcopy(model)
    plan = QuantPlan.from_dict(
        {
            "name": "t",
            "rotate": EVERY_PLACE,
            "smooth": {"alpha": 0.6},
            "weights": GPTQ,
            "rules": [{"sites": ["kind:linear_in"], "scheme": "int4:token"}],
        }
    )
    apply_plan(model, plan)
    calibrate(model, windows, batch_size=BATCH)
    rotate_model(reference, RotateSpec(**EVERY_PLACE))
    factors = _reference_smoothing(reference, windows, 0.6)
    assert sorted(model.quant.factors("smooth")) == sorted(factors)
    for name, s in factors.items():
        torch.testing.assert_close(model.quant.factors("smooth")[name], s, rtol=1e-12, atol=0, msg=name)
        assert (s - 1).abs().max() > 0.1, name  # the smoothing did something
    want = _reference_codes(reference, windows, WeightGrid(4, 24, False))
    got = _plan_codes(model)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name].to(torch.int64), want[name].to(torch.int64)), name
