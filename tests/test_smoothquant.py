"""SmoothQuant (Xiao et al. 2023): act-scales, smoothing, the `smooth` plan key and `diffquant act-scales`.

Act-scales are checked against the profile's channel abs-max and against an independent brute force
(forward hooks on every Linear); smoothing against the unsmoothed model's logits, the formula
s = amax^alpha / wmax^(1 - alpha) and the activation abs-max it leaves (amax / s).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.data import token_windows
from diffquant.data.tokenizer import ByteTokenizer
from diffquant.io import load_model
from diffquant.io.convert_hf import export_hf
from diffquant.profile.runner import profile_model
from diffquant.quant import PRESETS, QuantPlan, apply_plan, calibrate, preset
from diffquant.quant.fake import FakeQuant
from diffquant.quant.smoothquant import (
    act_scales,
    apply_smoothing,
    collect_act_scales,
    default_names,
    linear_modules,
    smooth_model,
    smoothing_groups,
)

SMOOTHED = ("q_proj", "k_proj", "v_proj", "lambda_proj", "gate_proj", "gate", "up")


def _windows(n=4, t=24, vocab=61, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def _plant(model, factor=40.0):
    """Outlier channels in every norm's output (as in real LLMs): a few norm-weight channels scaled up."""
    with torch.no_grad():
        for block in model.layers:
            block.attn_norm.weight[3] *= factor
            block.mlp_norm.weight[5] *= factor
            block.mlp_norm.weight[11] *= -factor / 2
    return model


def _brute_force(model, windows):
    """Per-input-channel abs-max of every nn.Linear's input, from plain forward hooks."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, output):
            amax = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(0)
            seen[name] = amax if name not in seen else torch.maximum(seen[name], amax)

        return record

    handles = [
        m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            for start in range(0, windows.shape[0], 2):
                model(windows[start : start + 2])
    finally:
        for h in handles:
            h.remove()
    return seen


def _rel(ref, got):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny native baseline exported as a HF llama folder (byte vocabulary, so the CLI can read text)."""
    folder = tmp_path_factory.mktemp("llama") / "hf"
    export_hf(_plant(tiny_model("baseline", seed=3, vocab_size=259)), folder)
    return folder


# ------------------------------------------------------------------------------------------- act-scales
def test_act_scales_equal_profile_and_brute_force(kind):
    model = _plant(tiny_model(kind))
    windows = _windows()
    scales = collect_act_scales(model, windows, batch_size=2)
    names = list(linear_modules(model))
    assert list(scales) == names and "lm_head" in scales
    if kind == "diff_v2":
        assert "layers.0.attn.lambda_proj" in scales
    profile = profile_model(model, windows, batch_size=3, sites="kind:linear_in", attention=False)
    brute = _brute_force(model, windows)
    for name in names:
        value = scales[name]
        assert value.dtype == torch.float32 and value.shape == (model.get_submodule(name).in_features,)
        from_profile = torch.tensor(profile.sites[f"{name}.input"].summary()["channel_absmax"])
        assert torch.equal(value, from_profile.float()), name
        assert torch.equal(value, brute[name]), name
    from_other_batches = act_scales(profile, model)  # the same numbers from any profile of that text
    assert all(torch.equal(from_other_batches[n], scales[n]) for n in names)


def test_act_scales_of_a_quantized_model_are_the_float_model_ones():
    model = _plant(tiny_model("baseline"))
    windows = _windows()
    float_scales = collect_act_scales(model, windows, batch_size=2)
    apply_plan(model, preset("w8a8"))  # dynamic quantizers on every Linear input and weight
    quant_scales = collect_act_scales(model, windows, batch_size=2)
    assert all(torch.equal(float_scales[n], quant_scales[n]) for n in float_scales)
    # and the quantizers are back in place afterwards
    assert all(
        t.quantizer is not None for n, t in model.taps("kind:linear_in").items() if n != "lm_head.input"
    )
    assert all(m.weight_quantizer is not None for n, m in linear_modules(model).items() if n != "lm_head")


def test_hf_names(hf_llama):
    model = load_model(f"hf:{hf_llama}")
    windows = _windows(vocab=259)
    native = collect_act_scales(model, windows, batch_size=2)
    hf = collect_act_scales(model, windows, batch_size=2, names="hf")
    assert list(hf) == [
        *(
            f"model.layers.{i}.{m}"
            for i in range(2)
            for m in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ),
        "lm_head",
    ]
    assert [v.tolist() for v in hf.values()] == [v.tolist() for v in native.values()]
    assert (
        default_names(f"hf:{hf_llama}")
        == default_names("gguf:x.gguf")
        == default_names("fetch:smollm2")
        == "hf"
    )
    assert default_names("init:baseline:tiny") == default_names(str(hf_llama)) == "native"
    # the names are transformers' own modules, which read the same inputs
    transformers = pytest.importorskip("transformers")
    reference = transformers.LlamaForCausalLM.from_pretrained(str(hf_llama)).eval()
    theirs = _brute_force(reference, windows)
    for name, value in hf.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-4, atol=1e-6)
    with pytest.raises(DiffquantError, match="layers.0.attn.lambda_proj has no Hugging Face name"):
        collect_act_scales(tiny_model("diff_v2"), windows[:, :8] % 61, names="hf")


# -------------------------------------------------------------------------------------------- smoothing
@pytest.mark.parametrize(
    "which", ["baseline", "diff_v1", "diff_v2", "gated", "gated-headwise", "sink", "clipped", "hf-llama"]
)
def test_smoothing_keeps_logits_and_migrates_outliers(which, hf_llama):
    model = load_model(f"hf:{hf_llama}") if which == "hf-llama" else _plant(tiny_model(which))
    windows = _windows(vocab=model.config.vocab_size)
    with torch.no_grad():
        before = model(windows)
    scales = collect_act_scales(model, windows, batch_size=2)
    weights = {n: m.weight.detach().clone() for n, m in linear_modules(model).items()}
    norms = {n: norm.weight.detach().clone() for n, norm, _ in smoothing_groups(model)}
    twin = copy.deepcopy(model)
    factors = smooth_model(model, scales, alpha=0.5)
    apply_smoothing(twin, factors)  # the returned factors reproduce the smoothing exactly
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        after = model(windows)
    diff = _rel(before, after)
    print(f"\n{which}: max |logits change| / max |logits| after smoothing = {diff:.2e}")
    assert diff < 1e-5
    groups = {n: lins for n, _, lins in smoothing_groups(model)}
    assert set(factors) == set(groups) and len(groups) == 2 * model.config.n_layers
    smoothed = {lin for lins in groups.values() for lin in lins}
    own = {"diff_v2": {"lambda_proj"}, "gated": {"gate_proj"}}.get(model.config.attention, set())
    assert {n.rsplit(".", 1)[1] for n in smoothed} == set(SMOOTHED) - {"lambda_proj", "gate_proj"} | own
    new_scales = collect_act_scales(model, windows, batch_size=2)
    for norm_name, lins in groups.items():
        s = factors[norm_name].double()
        amax = scales[next(iter(lins))].double()
        wmax = torch.stack([weights[n].abs().double().amax(0) for n in lins]).amax(0)
        expected = (amax.sqrt() / wmax.sqrt()).clamp(min=1e-5)  # alpha = 0.5
        torch.testing.assert_close(s, torch.where(amax > 0, expected, 1.0), rtol=1e-6, atol=0)
        norm = model.get_submodule(norm_name)
        torch.testing.assert_close(norm.weight.double(), norms[norm_name].double() / s, rtol=1e-6, atol=0)
        for name in lins:
            torch.testing.assert_close(
                model.get_submodule(name).weight.double(), weights[name].double() * s, rtol=1e-6, atol=0
            )
            # X' = X / s: the smoothed Linear inputs' abs-max per channel is amax / s
            torch.testing.assert_close(new_scales[name].double(), amax / s, rtol=1e-5, atol=1e-7)
    for name in set(scales) - smoothed:  # o_proj, down, lm_head read unsmoothed tensors
        torch.testing.assert_close(new_scales[name], scales[name], rtol=1e-4, atol=1e-6)
        assert torch.equal(model.get_submodule(name).weight, weights[name])
    # the planted outlier channels are gone from the smoothed inputs: the max over channels drops
    for name in ("layers.0.attn.q_proj", "layers.1.mlp.up"):
        assert new_scales[name].max() < scales[name].max() / 4


def test_smoothing_alpha_extremes():
    model = _plant(tiny_model("baseline"))
    windows = _windows()
    scales = collect_act_scales(model, windows, batch_size=2)
    w = {
        n: linear_modules(model)[n].weight.detach().abs().double().amax(0)
        for n in ("layers.0.mlp.gate", "layers.0.mlp.up")
    }
    one = smooth_model(_plant(tiny_model("baseline")), scales, alpha=1.0)["layers.0.mlp_norm"]
    torch.testing.assert_close(one.double(), scales["layers.0.mlp.gate"].double(), rtol=1e-6, atol=0)
    zero = smooth_model(_plant(tiny_model("baseline")), scales, alpha=0.0)["layers.0.mlp_norm"]
    torch.testing.assert_close(zero.double(), 1 / torch.maximum(*w.values()), rtol=1e-6, atol=0)
    scales = dict(scales)
    dead = scales["layers.0.mlp.gate"].clone()
    dead[7] = 0.0
    scales["layers.0.mlp.gate"] = scales["layers.0.mlp.up"] = dead
    assert smooth_model(tiny_model("baseline"), scales)["layers.0.mlp_norm"][7] == 1.0  # never fired: s = 1


def _untouched(model, state) -> bool:
    return all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m, s: setattr(m.layers[0].attn_norm, "weight", None), "layers.0.attn_norm: no norm weight"),
        (
            lambda m, s: setattr(m.layers[1].mlp_norm, "weight", m.layers[0].mlp_norm.weight),
            "layers.0.mlp_norm: cannot smooth: its weight is shared with layers.1.mlp_norm.weight",
        ),
        (
            lambda m, s: setattr(m.layers[1].mlp.up, "weight", m.layers[0].mlp.up.weight),
            "layers.0.mlp_norm: cannot smooth into layers.0.mlp.up: its weight is shared with layers.1.mlp.up.weight",
        ),
        (lambda m, s: s.pop("layers.1.attn.v_proj"), "layers.1.attn_norm: act-scales have no entry for"),
        (
            lambda m, s: s.update({"layers.1.mlp.gate": torch.ones(3)}),
            "layers.1.mlp_norm: act-scale of layers.1.mlp.gate has shape (3,)",
        ),
    ],
)
def test_smoothing_refusals(edit, message):
    model = tiny_model("baseline")
    scales = collect_act_scales(model, _windows(2), batch_size=2)
    edit(model, scales)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DiffquantError) as err:
        smooth_model(model, scales)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert _untouched(model, state)  # checked before anything changed


# ------------------------------------------------------------------------------------------------- plans
def test_smoothquant_preset_lowers_the_quantization_error():
    windows, held_out = _windows(8, 32, seed=0), _windows(8, 32, seed=1)

    def model():
        return _plant(tiny_model("baseline", seed=1, d_model=64, head_dim=16, ffn_dim=128), factor=60.0)

    reference = model()
    with torch.no_grad():
        ref = reference(held_out)
    errors = {}
    for name in ("w8a8-tensor", "w8a8-smoothquant"):
        quantized = model()
        plan = preset(name)
        assert plan.uses_static
        apply_plan(quantized, plan)
        assert calibrate(quantized, windows, batch_size=4) == windows.numel()
        with torch.no_grad():
            out = quantized(held_out)
        errors[name] = ((out - ref).pow(2).mean() / ref.var()).item()
    print(f"\nrelative logits MSE: {errors}")
    assert errors["w8a8-smoothquant"] < errors["w8a8-tensor"] / 2
    # the weight quantizers quantize the smoothed weights, and static scales were observed after smoothing
    lin = quantized.layers[0].attn.q_proj
    fresh = FakeQuant(lin.weight_quantizer.scheme, "w", "weight").quantize_weight(lin.weight)
    assert torch.equal(lin.weight_quantizer.quantize_weight(lin.weight), fresh)
    smoothed_amax = collect_act_scales(quantized, windows, batch_size=4)["layers.0.attn.q_proj"].max()
    assert lin.input.quantizer.scale.item() == pytest.approx(smoothed_amax.item() / 127, rel=1e-6)
    assert set(quantized.quant.factors("smooth")) == {n for n, _, _ in smoothing_groups(quantized)}
    factors = {k: v.clone() for k, v in quantized.quant.factors("smooth").items()}
    state = {k: v.clone() for k, v in quantized.state_dict().items() if "quantizer" not in k}
    calibrate(quantized, windows, batch_size=4)  # smoothed once: a second pass recalibrates only
    assert _untouched(quantized, state) and all(
        torch.equal(factors[k], v) for k, v in quantized.quant.factors("smooth").items()
    )


def test_plan_smooth_key():
    plan = preset("w8a8-smoothquant")
    assert "w8a8-smoothquant" in PRESETS and plan.smooth.alpha == 0.5
    tensor = preset("w8a8-tensor").to_dict()
    doc = plan.to_dict()
    assert doc["smooth"] == {"alpha": 0.5} and doc["rules"] == tensor["rules"] and "smooth" not in tensor
    assert QuantPlan.from_dict(doc).to_dict() == doc
    dynamic = QuantPlan.from_dict(
        {"smooth": {}, "rules": [{"modules": "layers.*", "scheme": "int8:channel"}]}
    )
    assert dynamic.smooth.alpha == 0.5 and dynamic.uses_static  # smoothing alone needs a calibration pass
    assert QuantPlan.from_dict({"smooth": {"alpha": 1}, **tensor}).smooth.alpha == 1.0
    assert QuantPlan.from_dict({"smooth": None, **tensor}).smooth is None


@pytest.mark.parametrize(
    ("smooth", "message"),
    [
        ({"alpha": 1.5}, "plan x: smooth.alpha: expected a number in [0, 1], got 1.5 (a number)"),
        ({"alpha": -0.1}, "plan x: smooth.alpha: expected a number in [0, 1], got -0.1"),
        ({"alpha": "0.5"}, "plan x: smooth.alpha: expected a number in [0, 1], got '0.5' (a string)"),
        ({"alpha": True}, "plan x: smooth.alpha: expected a number in [0, 1], got True (a boolean)"),
        ({"alpha": float("nan")}, "plan x: smooth.alpha: expected a number in [0, 1], got nan"),
        ({"alpha": None}, "plan x: smooth.alpha: expected a number in [0, 1], got None (null)"),
        (0.5, "plan x: smooth: expected a mapping, got float"),
        ({"beta": 1}, "plan x: smooth: unknown key 'beta'; allowed keys: alpha"),
    ],
)
def test_bad_smooth_values(smooth, message):
    with pytest.raises(DiffquantError) as err:
        QuantPlan.from_dict(
            {"name": "x", "smooth": smooth, "rules": [{"sites": "kind:q", "scheme": "int8"}]}, source="plan x"
        )
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_smooth_with_a_backend_is_refused(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("name: x\nsmooth: {alpha: 0.5}\nbackend: {name: quanto}\n")
    with pytest.raises(DiffquantError, match=r"plan.yaml: smooth: works with fake-quant rules only"):
        QuantPlan.load(path)


def test_quantize_and_reload_a_smoothed_model(tmp_path):
    out = tmp_path / "q"
    args = ["--calib-tokens", "128", "--eval-tokens", "64", "--seq-len", "64", "--batch-size", "2"]
    assert (
        main(["quantize", "init:diff_v2:tiny", "--plan", "w8a8-smoothquant", *args, "--out", str(out)]) == 0
    )
    # the same quantization in memory: smoothing and scales from the same calibration windows
    model = load_model("init:diff_v2:tiny")
    apply_plan(model, preset("w8a8-smoothquant"))
    calibrate(model, token_windows("stdlib:train", 192, 64, ByteTokenizer())[:2], batch_size=2)
    reloaded = load_model(str(out))  # the smoothed weights are its base weights; the plan is not re-smoothed
    ids = _windows(2, 32, vocab=259)
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
    report = json.loads((out / "quant_report.json").read_text())
    assert report["plan"]["smooth"] == {"alpha": 0.5}
    # per-site errors compare against the reference smoothed alike, not X / s against X
    assert report["report"]["layers.0.attn.q_proj.input"]["sqnr_db"] > 25


# -------------------------------------------------------------------------------------------------- CLI
def test_act_scales_command(tmp_path, hf_llama, capsys):
    text = tmp_path / "text.txt"
    text.write_text("SmoothQuant migrates the difficulty of activation quantization to the weights. " * 20)
    out = tmp_path / "sub" / "scales.pt"
    common = ["--data", str(text), "--tokens", "256", "--seq-len", "64", "--batch-size", "2"]
    assert main(["act-scales", "init:diff_v2:tiny", "--out", str(out), *common]) == 0
    assert "wrote" in capsys.readouterr().out
    scales = torch.load(out, weights_only=True)
    model = load_model("init:diff_v2:tiny")
    expected = collect_act_scales(model, token_windows(str(text), 256, 64, ByteTokenizer()), batch_size=3)
    assert list(scales) == list(expected) and all(torch.equal(scales[n], expected[n]) for n in expected)
    assert all(v.dtype == torch.float32 and v.dim() == 1 for v in scales.values())
    hf_out = tmp_path / "hf.pt"
    assert main(["act-scales", f"hf:{hf_llama}", "--out", str(hf_out), *common]) == 0  # hf names by default
    assert "model.layers.1.mlp.down_proj" in torch.load(hf_out, weights_only=True)
    assert (
        main(["act-scales", f"hf:{hf_llama}", "--out", str(hf_out), "--names", "native", "--force", *common])
        == 0
    )
    assert "layers.1.mlp.down" in torch.load(hf_out, weights_only=True)
    assert main(["act-scales", "init:diff_v2:tiny", "--out", str(out), *common]) == 2  # exists, no --force
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["init:baseline:tiny", "--tokens", "0"], "--tokens: expected an integer >= 1"),
        (["init:baseline:tiny", "--seq-len", "999"], "exceeds the max_seq_len 256"),
        (["init:nope:tiny"], "expected init:KIND:PRESET"),
        (["init:baseline:tiny", "--data", "/no/such/text"], "/no/such/text"),
        (["init:diff_v2:tiny", "--names", "hf"], "lambda_proj has no Hugging Face name"),
    ],
)
def test_act_scales_command_bad_input(tmp_path, capsys, argv, message):
    out = tmp_path / "scales.pt"
    assert main(["act-scales", "--tokens", "128", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind


def test_act_scales_command_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["act-scales", "init:baseline:tiny", "--out", str(tmp_path / "a.pt"), "--names", "gguf"])
    assert exit_info.value.code == 2
    assert main(["act-scales", "init:baseline:tiny", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["presets"]) == 0 and "w8a8-smoothquant" in capsys.readouterr().out
    assert Path(tmp_path).is_dir() and list(tmp_path.iterdir()) == []


def test_eval_sweep_smooths_before_calibrating(tmp_path, monkeypatch, capsys):
    import diffquant.quant.smoothquant as sq

    calls = []
    original = sq.smooth_model

    def counting(model, scales, alpha=0.5):
        calls.append(alpha)
        return original(model, scales, alpha)

    monkeypatch.setattr(sq, "smooth_model", counting)
    argv = ["eval", "init:baseline:tiny", "--task", "bpb:tokens=128,seq_len=64", "--plan", "w8a8-smoothquant"]
    assert main([*argv, "--calib-tokens", "128", "--calib-seq-len", "64", "--out", str(tmp_path / "ev")]) == 0
    assert calls == [0.5]  # the sweep's calibration path smooths (uses_static is true for smooth plans)
    rows = json.loads((tmp_path / "ev" / "results.json").read_text())["rows"]
    smoothed = [r for r in rows if r["plan"] == "w8a8-smoothquant" and r["metric"] == "bits_per_byte"]
    assert len(smoothed) == 1 and abs(smoothed[0]["delta"]) < 0.05
