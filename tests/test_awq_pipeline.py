"""AWQ as a weight method of a plan (``weights: {method: awq}``): the seam of diffquant/quant/pipeline.py.

The algorithm alone is checked in tests/test_awq.py against a reference written from the paper. Here, on
tiny models of every attention kind: the scales the pipeline folds into layer 0's norms are the paper's
search over that layer's calibration inputs (captured independently here with hooks and searched by a
brute-force float64 loop written in this file); folding leaves the float model's output unchanged and scales
every reader of the norm (DIFF V2's lambda_proj, gated attention's gate_proj included); the codes are the RTN
codes of the folded weights; the checkpoint records ``awq`` and reloads bit for bit without folding again.
"""

from __future__ import annotations

import json

import pytest
import torch

from diffquant.io.quantized import load_quantized, save_quantized
from diffquant.models.attention import Linear
from diffquant.quant import QuantPlan, apply_plan, calibrate
from diffquant.quant.weightcodes import QuantizedWeight
from tests.conftest import tiny_model

KINDS = ("baseline", "diff_v1", "diff_v2", "gated")


def _plan(**weights) -> QuantPlan:
    spec = {"method": "awq", "format": "int4", "group": 16, "alpha_grid": 10, **weights}
    return QuantPlan.from_dict({"name": "awq", "weights": spec})


def _model(kind: str) -> torch.nn.Module:
    model = tiny_model(kind, n_layers=2, d_model=64, head_dim=16, ffn_dim=128)
    with torch.no_grad():  # a few salient input channels, as trained models have: the norm's gain
        for block in model.layers:
            for norm in (block.attn_norm, block.mlp_norm):
                gain = torch.ones(64)
                gain[[3, 17, 40]] = 12.0
                norm.set_gain(gain.double())
    return model


def _windows(n: int = 6, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 61, (n, length), generator=torch.Generator().manual_seed(3))


def _rtn(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric min-max round-to-nearest in groups (AWQ's default grid), from its formula, float64."""
    out, n = w.shape
    g = w.double().reshape(out, n // group, group)
    maxq = 2**bits - 1
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale) + zero, 0, maxq)
    return ((q - zero) * scale).reshape(out, n)


def _reference_scales(x: torch.Tensor, weights: list[torch.Tensor], n_grid: int) -> torch.Tensor:
    """The paper's search, brute force in float64: s = mean|x|^a / sqrt(max * min), a in {0, 1/n, ..}, the
    a minimising sum_i ||Q(W_i diag(s)) (x / s)^T - W_i x^T||^2 (ties: the smallest a)."""
    x = x.double()
    mean = x.abs().mean(0)
    best, chosen = None, None
    for k in range(n_grid):
        s = mean.pow(k / n_grid).clamp(min=1e-4)
        s = (s / (s.max() * s.min()).sqrt()).float().double()
        loss = sum(
            float(((_rtn(w.double() * s, 4, 16) @ (x / s).T - w.double() @ x.T) ** 2).sum()) for w in weights
        )
        if best is None or loss < best:
            best, chosen = loss, s
    return chosen


@pytest.mark.parametrize("kind", KINDS)
def test_layer0_scales_are_the_papers_search_and_the_float_model_is_unchanged(kind):
    model = _model(kind)
    ids = _windows()
    block = model.layers[0]
    captured: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": []}
    handles = [
        block.attn_norm.register_forward_hook(
            lambda m, a, out: captured["attn"].append(out.detach().clone())
        ),
        block.mlp_norm.register_forward_hook(lambda m, a, out: captured["mlp"].append(out.detach().clone())),
    ]
    with torch.no_grad():
        before = model(ids)
    for h in handles:
        h.remove()
    readers = {
        "attn": {n: m.weight.detach().clone() for n, m in block.attn.input_linears().items()},
        "mlp": {"gate": block.mlp.gate.weight.detach().clone(), "up": block.mlp.up.weight.detach().clone()},
    }
    apply_plan(model, _plan())
    calibrate(model, ids, batch_size=2)
    folded = model.quant.factors("awq")
    assert model.quant.transforms == ["awq"]
    for part, norm_name in (("attn", "layers.0.attn_norm"), ("mlp", "layers.0.mlp_norm")):
        x = torch.cat(captured[part]).reshape(-1, 64)  # layer 0's input: nothing quantized before it
        want = _reference_scales(x, list(readers[part].values()), 10)
        torch.testing.assert_close(folded[norm_name], want, rtol=1e-6, atol=0)
        # every reader of the norm scaled (lambda_proj / gate_proj too), quantized to the RTN codes of W s
        modules = (
            block.attn.input_linears() if part == "attn" else {"gate": block.mlp.gate, "up": block.mlp.up}
        )
        for name, linear in modules.items():
            scaled = readers[part][name].double() * want
            torch.testing.assert_close(linear.weight.double(), scaled, rtol=1e-6, atol=1e-7)
            assert isinstance(linear.weight_quantizer, QuantizedWeight)
            torch.testing.assert_close(
                linear.weight_quantizer.quantize_weight(linear.weight).double(),
                _rtn(linear.weight, 4, 16),
                rtol=0,
                atol=1e-6,
            )
    # the float model (every weight quantizer off) computes what it did: the folds are exact
    quantizers = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            quantizers[name], m.weight_quantizer = m.weight_quantizer, None
    with torch.no_grad():
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert set(folded) == {f"layers.{i}.{n}" for i in range(2) for n in ("attn_norm", "mlp_norm")}


def test_awq_lowers_the_output_error_below_rtn_on_salient_channels():
    ids = _windows(8)
    errors = {}
    for method in ("rtn", "awq"):
        model = _model("baseline")
        with torch.no_grad():
            reference = model(ids)
        grid = {"method": method, "format": "int4", "group": 16, "sym": False}  # the same grid
        plan = _plan(**grid) if method == "awq" else QuantPlan.from_dict({"name": "rtn", "weights": grid})
        apply_plan(model, plan)
        calibrate(model, ids, batch_size=4)
        with torch.no_grad():
            errors[method] = float(((model(ids) - reference) ** 2).mean())
    assert errors["awq"] < 0.9 * errors["rtn"], errors


def test_checkpoint_records_awq_and_reloads_without_folding_again(tmp_path):
    model = _model("diff_v2")
    ids = _windows()
    apply_plan(model, _plan())
    calibrate(model, ids, batch_size=3)
    save_quantized(model, tmp_path / "q")
    doc = json.loads((tmp_path / "q" / "quant_plan.json").read_text())
    assert doc["transforms"] == ["awq", "weights"]
    loaded = load_quantized(tmp_path / "q")
    assert loaded.quant.transforms == ["awq"]
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert torch.equal(loaded.layers[1].attn_norm.weight, model.layers[1].attn_norm.weight)


def test_awq_without_calibration_text_is_one_line():
    from diffquant.errors import DiffquantError
    from diffquant.quant.weights import quantize_weights

    model = _model("baseline")
    apply_plan(model, _plan())
    with pytest.raises(DiffquantError, match=r"awq needs calibration data \(each norm group's mean") as err:
        quantize_weights(model, None)
    assert "\n" not in str(err.value)


def test_readers_left_unquantized_are_scaled_too():
    """DIFF V2's lambda_proj and gated attention's gate_proj read the attention norm: excluded from the
    weights section they keep float weights, but the norm's 1 / s reaches them, so they must take the s."""
    for kind, reader in (("diff_v2", "lambda_proj"), ("gated", "gate_proj")):
        model = _model(kind)
        ids = _windows()
        with torch.no_grad():
            before = model(ids)
        apply_plan(model, _plan(exclude=[f"*.{reader}"]))
        calibrate(model, ids, batch_size=3)
        assert getattr(model.layers[0].attn, reader).weight_quantizer is None
        for _name, m in model.named_modules():
            if isinstance(m, Linear):
                m.weight_quantizer = None
        with torch.no_grad():
            torch.testing.assert_close(model(ids), before, rtol=1e-4, atol=1e-4)
