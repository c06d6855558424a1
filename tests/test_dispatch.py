"""Dispatch to the fused Triton kernel: which plans it takes, and that it computes what fake-quant does.

Runs the real kernels through Triton's interpreter on CPU (TRITON_INTERPRET=1 is set in conftest).
"""

import pytest
import torch

from diffquant.kernels.dispatch import kernel_core, path_summary, planned_paths
from diffquant.models import DecoderLM, ModelConfig, matched_config
from diffquant.quant import QuantPlan, apply_plan, calibrate, preset

pytest.importorskip("triton")

BASE = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    return DecoderLM(matched_config(BASE, kind)).eval()


def _ids(t=21, batch=1, seed=1):
    return torch.randint(0, 61, (batch, t), generator=torch.Generator().manual_seed(seed))


STATIC_LOGITS = {
    "rules": [
        {"sites": "kind:logits", "scheme": {"format": "int8", "granularity": "head", "calibration": "absmax"}}
    ]
}


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
@pytest.mark.parametrize("plan", ["qk-int8-pv-fp8", "qk-int8-token-pv-fp8", "static-logits"])
def test_triton_path_equals_fake_quant_path(kind, plan):
    model = _model(kind)
    apply_plan(model, preset(plan) if plan != "static-logits" else QuantPlan.from_dict(STATIC_LOGITS))
    calibrate(model, _ids(32, 2, seed=5))
    ids = _ids()
    with torch.no_grad():
        fake = model(ids)
        assert path_summary(model) == {"explicit": 2}
        model.set_kernel("triton")
        fused = model(ids)
        assert path_summary(model) == {"triton": 2}
    # same roundings, different summation order: fp32-level agreement on the logits
    rel = (fused - fake).abs().sum() / fake.abs().sum()
    assert rel < 1e-4, float(rel)


def test_kernel_takes_only_what_it_implements():
    baseline = _model("baseline")
    apply_plan(baseline, preset("qk-int8-pv-fp8"))
    assert all(kernel_core(a) is None for a in baseline.attention_modules())  # no baseline kernel: SDPA
    for name in ("attn-logits-int8", "attn-logits-int4-row", "attn-probs-int8"):  # dynamic / asymmetric
        m = _model("diff_v2")
        apply_plan(m, preset(name))
        assert all(kernel_core(a) is None for a in m.attention_modules()), name
    plain = _model("diff_v2")
    assert kernel_core(plain.layers[0].attn) is None  # nothing to quantize: the fused torch path is faster
    sage = _model("diff_v2")
    apply_plan(sage, preset("qk-int8-pv-fp8"))
    core = kernel_core(sage.layers[0].attn)
    assert (core.qk, core.block, core.pv, core.logits_bits) == ("int8", 64, "fp8_e4m3", None)
    assert planned_paths(sage, cuda=True) == {"triton": 2}
    assert planned_paths(sage, cuda=False) == {"explicit": 2}
    per_token = _model("diff_v1")
    apply_plan(per_token, preset("qk-int8-token-pv-fp8"))
    core = kernel_core(per_token.layers[0].attn)
    assert (core.qk, core.block, core.pv) == ("int8", 1, "fp8_e4m3")
    row = QuantPlan.from_dict(
        {
            "rules": [
                {"sites": "kind:q", "scheme": "fp8_e4m3:row"},
                {"sites": "kind:k", "scheme": {"format": "fp8_e4m3", "granularity": "row", "smooth": True}},
            ]
        }
    )
    m = _model("diff_v2")
    apply_plan(m, row)
    assert (kernel_core(m.layers[0].attn).qk, kernel_core(m.layers[0].attn).block) == ("fp8_e4m3", 1)


def test_the_logits_scales_are_read_once_and_again_when_they_change():
    """The kernel's CoreQuant for static logit scales is built once per layer (building it reads the scales
    on the host to check them, a wait for a GPU in every forward): the same object while the scale tensors
    stay as they are, a new one with the new values when a scale is changed in place or replaced, and the
    kernel's output then equals a model that never cached."""
    import copy

    model = _model("diff_v2")
    apply_plan(model, QuantPlan.from_dict(STATIC_LOGITS))
    calibrate(model, _ids(32, 2, seed=5))
    attn = model.layers[0].attn
    core = kernel_core(attn)
    assert kernel_core(attn) is core and core.logits_bits == 8
    model.set_kernel("triton")
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        attn.logits1.quantizer.scale.mul_(2.0)  # in place: same tensor, new values
        after = model(ids)
        fresh = copy.deepcopy(model)
        for a in fresh.attention_modules():
            a.__dict__.pop("_kernel_core_cache", None)
        assert torch.equal(after, fresh(ids)) and not torch.equal(after, before)
    changed = kernel_core(attn)
    assert changed is not core
    assert torch.equal(changed.logits_scale[0::2], attn.logits1.quantizer.scale.reshape(-1))
    attn.logits2.quantizer.scale = attn.logits2.quantizer.scale * 0.5  # replaced
    assert torch.equal(kernel_core(attn).logits_scale[1::2], attn.logits2.quantizer.scale.reshape(-1))


def test_odd_head_dims_fall_back():
    model = DecoderLM(
        matched_config(
            ModelConfig(
                vocab_size=61, d_model=48, n_heads=2, n_kv_heads=2, head_dim=24, ffn_dim=64, n_layers=1
            ),
            "diff_v2",
        )
    )
    apply_plan(model, preset("qk-int8-pv-fp8"))
    model.set_kernel("triton")
    with torch.no_grad():
        model(_ids(9))
    assert path_summary(model) == {"explicit": 1}


@pytest.mark.slow
def test_gpu_benchmark_script_runs_its_smoke_mode():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "analysis" / "kernels" / "bench.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "v2-int8qk-fp8pv-triton" in proc.stdout and "v1-bf16-triton" in proc.stdout
