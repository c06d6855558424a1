"""Schemes, fake-quant at taps and weights, plans, calibration, the error report, quantized checkpoints."""

import json
import math

import pytest
import torch
import yaml
from conftest import tiny_model

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.io import load_model, save_checkpoint, save_quantized
from diffquant.quant import PRESETS, QuantPlan, apply_plan, calibrate, nan_counts, preset
from diffquant.quant.fake import FakeQuant
from diffquant.quant.report import ErrorStats, compare_models, format_report
from diffquant.quant.schemes import Scheme


def _windows(n=4, t=24, vocab=61, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------- schemes
def test_dynamic_int_per_tensor_is_absmax_over_127():
    x = torch.randn(2, 5, 8) * torch.tensor([1.0, 10.0]).view(2, 1, 1)
    fq = FakeQuant(Scheme.parse("int8:tensor"), "s", "resid")
    y = fq(x)
    for b in range(2):  # one scale per sample: its own absmax / 127
        scale = x[b].abs().max() / 127
        ref = torch.round(x[b] / scale).clamp(-127, 127) * scale
        torch.testing.assert_close(y[b], ref, rtol=0, atol=1e-6)
        assert (y[b] - x[b]).abs().max() <= scale / 2 + 1e-6


@pytest.mark.parametrize(("gran", "dims"), [("row", (-1,)), ("channel", (1,)), ("head", None)])
def test_granularities_reduce_the_right_dims(gran, dims):
    kind = "head_out" if gran == "head" else "resid"
    x = torch.randn(2, 6, 4, 8) if kind == "head_out" else torch.randn(2, 6, 8)
    y = FakeQuant(Scheme.parse(f"int4:{gran}"), "s", kind)(x)
    amax = x.abs().amax(dim=(1, 3), keepdim=True) if dims is None else x.abs().amax(dim=dims, keepdim=True)
    scale = amax / 7
    torch.testing.assert_close(y, torch.round(x / scale).clamp(-7, 7) * scale, rtol=0, atol=1e-6)


def test_weight_groups_and_block_size_check():
    w = torch.randn(6, 64)
    fq = FakeQuant(Scheme.parse("int4:group(32)"), "w", "weight")
    y = fq.quantize_weight(w)
    g = w.view(6, 2, 32)
    s = g.abs().amax(-1, keepdim=True) / 7
    torch.testing.assert_close(y, (torch.round(g / s).clamp(-7, 7) * s).view(6, 64), rtol=0, atol=1e-6)
    assert fq.quantize_weight(w) is y  # quantized once, cached
    with pytest.raises(DiffquantError, match="block size 48 does not divide dimension 64"):
        FakeQuant(Scheme.parse("int4:group(48)"), "w", "weight").quantize_weight(w)


def test_asymmetric_keeps_zero_and_range():
    x = torch.rand(3, 16) * 5 + 1  # all positive: asymmetric uses the whole code range
    y = FakeQuant(Scheme(format="int8", granularity="row", symmetric=False), "s", "resid")(x.unsqueeze(0))[0]
    step = (x.max(-1).values - torch.minimum(x.min(-1).values, torch.zeros(3))) / 255
    assert ((y - x).abs() <= step[:, None] / 2 + 1e-5).all()


def test_straight_through_gradient():
    x = torch.randn(1, 4, 8, requires_grad=True)
    FakeQuant(Scheme.parse("int4:row"), "s", "resid")(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"format": "int5x"}, "unknown format 'int5x'; valid formats: int2, int3"),
        ({"format": "int9"}, "bits 9 out of range 2..8"),
        ({"format": "int4", "granularity": "col"}, "unknown granularity 'col'; valid: tensor, head, row"),
        ({"format": "int4", "granularity": "row", "calibration": "absmax"}, "must not depend on the input"),
        ({"format": "mxfp4", "granularity": "row"}, "brings its own 32-element blocks"),
        ({"format": "int4", "colour": 1}, "unknown key 'colour'"),
    ],
)
def test_bad_scheme_one_line(value, message):
    with pytest.raises(DiffquantError) as err:
        Scheme.parse(value)
    assert message in str(err.value) and "\n" not in str(err.value)


# Plan values whose Python truthiness or coercion would mean something else than written: each must be
# refused with one line naming the field and the value (YAML 'no' unquoted is already a boolean; quoted,
# it is a string that Python reads as true).
BAD_TYPED_PLANS = [
    ({"scheme": {"format": "int8", "symmetric": "false"}}, "symmetric: expected a boolean (YAML true or false), got 'false'"),
    ({"scheme": {"format": "int8", "granularity": "tokens(8)", "smooth": "no"}}, "smooth: expected a boolean (YAML true or false), got 'no'"),
    ({"scheme": {"format": "int8", "symmetric": 0}}, "symmetric: expected a boolean (YAML true or false), got 0 (an integer)"),
    ({"scheme": {"format": "int8", "smooth": 1.0}}, "smooth: expected a boolean (YAML true or false), got 1.0 (a number)"),
    ({"scheme": {"format": "int8", "symmetric": None}}, "symmetric: expected a boolean (YAML true or false), got None (null)"),
    ({"scheme": {"format": "int8", "scale": True}}, "scale: expected a number, got True (a boolean)"),
    ({"scheme": {"format": "int8", "scale": "0.01"}}, "scale: expected a number, got '0.01' (a string)"),
    ({"scheme": {"format": "int8", "calibration": "percentile", "percentile": "99"}}, "percentile: expected a number, got '99'"),
    ({"scheme": {"format": "int8", "granularity": 8}}, "granularity: expected a string, got 8 (an integer)"),
    ({"scheme": {"format": True}}, "format: expected a string, got True (a boolean)"),
    ({"backend": {"name": "bnb", "mode": "nf4", "blocksize": 64.0}}, "backend.blocksize: expected an integer, got 64.0 (a number)"),
    ({"backend": {"name": "bnb", "mode": "nf4", "blocksize": "64"}}, "backend.blocksize: expected an integer, got '64' (a string)"),
    ({"backend": {"name": "bnb", "mode": "nf4", "blocksize": True}}, "backend.blocksize: expected an integer, got True (a boolean)"),
    ({"backend": {"name": "bnb", "mode": "nf4", "blocksize": 48}}, "backend.blocksize: 48; valid: 32, 64"),
    ({"backend": {"name": "bnb", "threshold": "6"}}, "backend.threshold: expected a finite number >= 0, got '6' (a string)"),
    ({"backend": {"name": "bnb", "threshold": False}}, "backend.threshold: expected a finite number >= 0, got False (a boolean)"),
    ({"rules": [{"sites": "kind:logits", "exclude": True, "scheme": "int8"}]}, "rules[0].exclude: expected a pattern or a list of patterns, got True"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "message"), BAD_TYPED_PLANS)
def test_plan_fields_must_have_their_type(tmp_path, doc, message):
    if "scheme" in doc:
        doc = {"rules": [{"sites": "kind:logits", **doc}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"name": "typed", **doc}))
    with pytest.raises(DiffquantError) as err:
        QuantPlan.load(path)
    text = str(err.value)
    assert message in text and "\n" not in text and text.startswith(str(path)), text


def test_plan_booleans_and_integers_that_are_right_still_load(tmp_path):
    path = tmp_path / "plan.yaml"
    # YAML 1.1 spellings of booleans (PyYAML: no / off / false) are real booleans
    path.write_text(
        "rules:\n  - sites: kind:k\n    scheme: {format: int8, granularity: tokens(8), smooth: no, symmetric: off}\n"
    )
    rule = QuantPlan.load(path).rules[0]
    assert rule.scheme.smooth is False and rule.scheme.symmetric is False and rule.scheme.asymmetric
    plan = QuantPlan.from_dict({"backend": {"name": "bnb", "mode": "nf4", "blocksize": 32, "threshold": 5}})
    assert plan.backend.blocksize == 32 and plan.backend.threshold == 5.0


def test_nan_propagates_and_is_counted():
    x = torch.randn(1, 3, 8)
    x[0, 1, 2] = float("nan")
    fq = FakeQuant(Scheme.parse("int8:tensor"), "s", "resid")
    y = fq(x)
    assert torch.isnan(y[0, 1, 2]) and torch.isfinite(y).sum() == x.numel() - 1
    assert fq.nan_count == 1


# ------------------------------------------------------------------------ the paper's mechanism
def _quantized_logits(plan_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of layer 0 after quantization, with one logit planted at 1000 before the quantizer."""
    model = tiny_model("baseline", seed=1)
    apply_plan(model, preset(plan_name))
    tap = model.taps("layers.0.attn.logits")["layers.0.attn.logits"]
    seen = {}

    def plant(module, args):
        logits, valid = args
        logits = logits.clone()
        logits[0, 0, 10, 3] = 1000.0
        return (logits, valid)

    tap.register_forward_pre_hook(plant)
    tap.register_forward_hook(lambda m, a, out: seen.update(out=out, valid=a[1], raw=a[0]))
    with torch.no_grad():
        model(_windows(1, 16))
    return seen["out"], seen["valid"].expand_as(seen["out"]), seen["raw"]


def test_per_tensor_int4_zeroes_small_logits_per_row_keeps_them():
    per_tensor, valid, raw = _quantized_logits("attn-logits-int4")
    per_row, _, _ = _quantized_logits("attn-logits-int4-row")
    # Exactly the int4 absmax of each row's visible (causal) logits: masked entries (real dot products with
    # future keys, often larger) must not enter the scales.
    amax = torch.where(valid, raw.abs(), 0.0).amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
    want = torch.round(raw / scale).clamp(-7, 7) * scale
    assert torch.equal(per_row[valid], want[valid])
    small = valid.clone()
    small[0, 0, 10, 3] = False
    # scale = 1000 / 7 ~ 143: every ordinary logit (|x| << 71) rounds to zero in that sample
    assert (per_tensor[small] == 0).float().mean() > 0.99
    assert per_tensor[0, 0, 10, 3] == pytest.approx(1000.0)
    others = small.clone()
    others[0, 0, 10] = False  # rows without the planted logit keep their resolution
    assert (per_row[others] != 0).float().mean() > 0.9


# ----------------------------------------------------------------------------------------- plans
def test_every_preset_applies_to_every_kind(any_kind):
    for name in PRESETS:
        if name.startswith(("quanto", "bnb")):
            continue
        # every width a multiple of 128 (the weights presets' groups of 128 divide every Linear), heads of 64
        # (kv4-compact's channel groups of 64 tile them)
        model = tiny_model(any_kind, d_model=128, head_dim=64, ffn_dim=256)
        plan = preset(name)
        applied = apply_plan(model, plan)
        assert applied
        calibrate(model, _windows(2, 16))
        with torch.no_grad():
            out = model(_windows(2, 16))
        assert torch.isfinite(out).all(), name


def test_plan_yaml_is_strict(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("name: x\nrules:\n  - sites: ['kind:logits']\n    schem: int8\n")
    with pytest.raises(DiffquantError, match=r"plan.yaml: rules\[0\]: unknown key 'schem'; allowed keys"):
        QuantPlan.load(path)
    path.write_text("rules:\n  - sites: ['kind:logits']\n    scheme: {format: int4, granularity: row}\n")
    plan = QuantPlan.load(path)
    assert QuantPlan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()


def test_plan_pattern_matching_nothing():
    plan = QuantPlan.from_dict({"rules": [{"sites": "layers.*.attn.nowhere", "scheme": "int8"}]})
    with pytest.raises(DiffquantError, match="matches no site"):
        apply_plan(tiny_model("baseline"), plan)
    plan = QuantPlan.from_dict({"rules": [{"modules": "nothing.*", "scheme": "int8:channel"}]})
    with pytest.raises(DiffquantError, match="weight pattern 'nothing.\\*' matches no Linear"):
        apply_plan(tiny_model("baseline"), plan)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"rules": [{"sites": "kind:logits", "exclude": "*", "scheme": "int8"}]},
            "plan x: rules[0]: site patterns ['kind:logits'] select 2 site(s), all removed by exclude ['*']",
        ),
        (
            {
                "rules": [
                    {
                        "modules": "layers.0.*",
                        "exclude": ["layers.0.attn.*", "layers.0.mlp.*"],
                        "scheme": "int8",
                    }
                ]
            },
            "plan x: rules[0]: patterns ['layers.0.*'] select 7 Linear(s), all removed by exclude",
        ),
        (
            {"backend": {"name": "quanto", "modules": "layers.1.mlp.*", "exclude": "*"}},
            "plan x: backend quanto: patterns ['layers.1.mlp.*'] select 3 Linear(s), all removed by exclude ['*']",
        ),
        (  # one rule that selects something does not excuse another that selects nothing
            {
                "rules": [
                    {"sites": "kind:q", "scheme": "int8"},
                    {"sites": "layers.0.*", "exclude": "layers.0.*", "scheme": "int4"},
                ]
            },
            "plan x: rules[1]: site patterns ['layers.0.*'] select",
        ),
        (
            {"rules": [{"sites": "kind:diff_map", "scheme": "int8"}]},
            "plan x: rules[0]: site pattern 'kind:diff_map' matches no site; this model's site kinds",
        ),
    ],
)
def test_plan_rule_selecting_nothing_is_an_error(doc, message):
    model = tiny_model("baseline")
    plan = QuantPlan.from_dict({"name": "x", **doc})
    with pytest.raises(DiffquantError) as err:
        apply_plan(model, plan)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert "quantize nothing" in str(err.value) or "matches no site" in str(err.value)
    # refused before anything was inserted: the model is still unquantized and takes another plan
    assert getattr(model, "quant_plan", None) is None and not nan_counts(model)
    assert all(tap.quantizer is None for tap in model.taps().values())
    assert apply_plan(model, preset("w8a8"))


def test_cli_quantize_refuses_a_plan_that_quantizes_nothing(tmp_path, capsys):
    base = tmp_path / "base"
    save_checkpoint(tiny_model("diff_v1", vocab_size=259, max_seq_len=64), base)
    data = tmp_path / "d.txt"
    data.write_text("x = 1\n" * 100)
    plan = tmp_path / "none.yaml"
    plan.write_text(
        "name: none\nrules:\n  - sites: kind:linear_in\n    exclude: [layers.*, lm_head.*]\n    scheme: int8\n"
    )
    args = ["quantize", str(base), "--plan", str(plan), "--calib-data", str(data), "--seq-len", "32"]
    assert main([*args, "--calib-tokens", "64", "--eval-tokens", "32", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "rules[0]: site patterns ['kind:linear_in'] select" in err and "all removed by exclude" in err
    assert err.count("\n") == 1 and not (tmp_path / "q").exists()


def test_per_tensor_logit_quantization_ignores_chunking():
    model = tiny_model("diff_v2")
    apply_plan(model, preset("attn-logits-int4"))
    ids = _windows(2, 40)
    with torch.no_grad():
        model.set_attention_path("auto", chunk_size=7)
        chunked = model(ids)
        model.set_attention_path("auto", chunk_size=64)
        whole = model(ids)
    assert torch.equal(chunked, whole)


# ----------------------------------------------------------------------------------- calibration
def test_static_absmax_calibration_and_percentile_mse_clip():
    model = tiny_model("baseline")
    plans = {
        cal: QuantPlan.from_dict(
            {"rules": [{"sites": "kind:resid", "scheme": {"format": "int8", "calibration": cal}}]}
        )
        for cal in ("absmax", "percentile", "mse")
    }
    windows = _windows(4, 16)
    with torch.no_grad():
        resid = []
        hook = model.layers[1].resid.register_forward_hook(lambda m, a, out: resid.append(out))
        model(windows)
        hook.remove()
    amax = torch.cat(resid).abs().max()
    scales = {}
    for cal, plan in plans.items():
        m = tiny_model("baseline")
        apply_plan(m, plan)
        calibrate(m, windows, batch_size=2)
        scales[cal] = float(m.layers[1].resid.quantizer.scale)
    assert scales["absmax"] == pytest.approx(float(amax) / 127, rel=1e-6)
    assert scales["percentile"] <= scales["absmax"] * 1.011  # bin upper edge: within one bin of amax
    assert 0 < scales["mse"] <= scales["absmax"] * 1.000001


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0", "fp8_e4m3"])
def test_static_scale_is_never_zero(scale_format):
    """amax / qmax can underflow to 0 in float32 (amax = 1e-45); a zero scale made x / scale inf and the
    output NaN. Such a scale is 1 (fp32) or the scale format's smallest positive value."""
    fq = FakeQuant(Scheme(format="int8", calibration="absmax", scale_format=scale_format), "s", "resid")
    x = torch.full((1, 4, 8), 1e-45)
    fq.start_calibration()
    fq(x)
    fq.finish_calibration()
    assert float(fq.scale) > 0
    y = fq(x)
    assert torch.isfinite(y).all() and (y - x).abs().max() <= 1e-45


def test_static_before_calibration_is_an_error():
    model = tiny_model("baseline")
    apply_plan(
        model,
        QuantPlan.from_dict(
            {"rules": [{"sites": "kind:resid", "scheme": {"format": "int8", "calibration": "absmax"}}]}
        ),
    )
    with pytest.raises(DiffquantError, match="used before calibration"):
        model(_windows(1, 8))


# ------------------------------------------------------------------------------------ the report
def test_error_stats_formulas():
    r = torch.tensor([1.0, -2.0, 3.0, 0.5])
    q = torch.tensor([1.1, -2.0, 2.5, 0.5])
    s = ErrorStats()
    s.update(r[:2], q[:2])
    s.update(r[2:], q[2:])
    out = s.summary()
    e = q - r
    assert out["sqnr_db"] == pytest.approx(10 * math.log10(float((r * r).sum() / (e * e).sum())))
    assert out["cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(r, q, dim=0)))
    assert out["rel_l1"] == pytest.approx(float(e.abs().sum() / r.abs().sum()))
    assert out["rmse"] == pytest.approx(float(e.pow(2).mean().sqrt()))


def test_compare_models_sees_only_what_changed():
    ref, quant = tiny_model("diff_v1"), tiny_model("diff_v1")
    apply_plan(quant, preset("attn-logits-int8"))
    report = compare_models(ref, quant, _windows(2, 16))
    assert report["layers.0.attn.q"]["rmse"] == 0.0  # upstream of the first quantizer: identical
    assert report["layers.0.attn.logits1"]["rmse"] > 0
    assert 0.99 < report["logits"]["cosine"] < 1.0


def test_error_stats_non_finite_is_never_exact():
    s = ErrorStats()
    nan = torch.tensor([math.nan, 1.0, math.inf])
    s.update(nan, nan.clone())  # the same NaN / inf in both models: still nothing to call exact
    out = s.summary()
    row = format_report({"logits": out}).splitlines()[1]
    assert "exact" not in row and "non-finite: 2 of 3 values" in row, row
    assert out["n"] == 1 and out["nonfinite"] == 2 and out["exact"] is False and out["rmse"] == 0.0
    json.dumps(out, allow_nan=False)
    masked = ErrorStats()  # invalid positions (e.g. above the causal diagonal) are not counted
    masked.update(nan, nan.clone(), valid=torch.tensor([False, True, False]))
    assert masked.summary()["nonfinite"] == 0 and masked.summary()["exact"] is True
    assert "exact" in format_report({"logits": masked.summary()})
    zero = ErrorStats()  # a zero reference with an error has SQNR -inf, not "exact"
    zero.update(torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]))
    assert "-inf" in format_report({"logits": zero.summary()}) and zero.summary()["exact"] is False


def test_nan_weight_report_says_non_finite_not_exact():
    ref, quant = tiny_model("diff_v2"), tiny_model("diff_v2")
    for model in (ref, quant):  # the checkpoint itself holds one NaN weight
        model.layers[1].mlp.down.weight.data[3, 5] = math.nan
    apply_plan(quant, preset("w8a8"))
    report = compare_models(ref, quant, _windows(2, 16))
    text = format_report(report)
    row = next(line for line in text.splitlines() if line.startswith("(model output logits)"))
    assert "exact" not in row and f"non-finite: {2 * 16 * 61} of {2 * 16 * 61} values" in row, text
    assert "layers.1.resid" in text and "exact" not in text  # the broken sites are listed, worst first
    logits = report["logits"]
    assert logits["n"] == 0 and logits["nonfinite"] == 2 * 16 * 61
    assert logits["exact"] is False and logits["sqnr_db"] is None
    json.loads(json.dumps(report, allow_nan=False))  # valid JSON: null, never NaN


def test_cli_quantize_nan_checkpoint_reports_non_finite(tmp_path, capsys):
    model = tiny_model("baseline", vocab_size=259, max_seq_len=64)
    model.layers[0].attn.v_proj.weight.data[2, 7] = math.nan
    save_checkpoint(model, tmp_path / "base")
    data = tmp_path / "d.txt"
    data.write_text("for i in range(10):\n    print(i * i)\n" * 40)
    args = [
        "quantize",
        str(tmp_path / "base"),
        "--plan",
        "w8a8",
        "--calib-data",
        str(data),
        "--seq-len",
        "32",
    ]
    assert main([*args, "--calib-tokens", "64", "--eval-tokens", "64", "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("(model output logits)"))
    assert "exact" not in row and "non-finite:" in row, out
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())["report"]
    assert report["logits"]["nonfinite"] > 0 and report["logits"]["exact"] is False


# --------------------------------------------------------------------------- checkpoints and CLI
@pytest.mark.parametrize("plan_name", ["w8a8", "attn-logits-int4-row", "qk-int8-pv-fp8"])
def test_quantized_round_trip_identical_logits(tmp_path, plan_name):
    model = tiny_model("diff_v2", d_model=64, head_dim=16, ffn_dim=128)
    apply_plan(model, preset(plan_name))
    save_quantized(model, tmp_path / "q")
    again = load_model(tmp_path / "q")
    ids = _windows(2, 20)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


def test_static_round_trip_keeps_scales(tmp_path):
    model = tiny_model("baseline")
    plan = QuantPlan.from_dict(
        {"rules": [{"sites": "kind:linear_in", "scheme": {"format": "int8", "calibration": "mse"}}]}
    )
    apply_plan(model, plan)
    calibrate(model, _windows(2, 16))
    save_quantized(model, tmp_path / "q")
    again = load_model(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(again(_windows(1, 9)), model(_windows(1, 9)))
    with pytest.raises(DiffquantError, match="save_quantized"):
        save_checkpoint(model, tmp_path / "plain")


def test_cli_quantize_preset_and_plan_file(tmp_path, capsys):
    base = tmp_path / "base"
    save_checkpoint(tiny_model("diff_v2", vocab_size=259, max_seq_len=64), base)
    data = tmp_path / "data.txt"
    data.write_text("for i in range(10):\n    print(i * i)\n" * 60)
    common = ["--calib-data", str(data), "--calib-tokens", "128", "--eval-tokens", "64", "--seq-len", "32"]
    assert (
        main(
            ["quantize", str(base), "--plan", "attn-logits-int6-head", *common, "--out", str(tmp_path / "q1")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plan attn-logits-int6-head" in out and "layers.0.attn.logits1" in out
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "name: mine\nrules:\n  - sites: kind:linear_in\n    scheme: {format: int8, calibration: absmax}\n"
    )
    assert main(["quantize", str(base), "--plan", str(plan), *common, "--out", str(tmp_path / "q2")]) == 0
    report = json.loads((tmp_path / "q2" / "quant_report.json").read_text())
    assert report["plan"]["name"] == "mine" and report["report"]["logits"]["n"] > 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q2")]) == 0
    assert "quantized    plan mine" in capsys.readouterr().out
    assert (
        main(
            [
                "profile",
                str(tmp_path / "q1"),
                "--data",
                str(data),
                "--tokens",
                "64",
                "--seq-len",
                "32",
                "--out",
                str(tmp_path / "prof"),
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("no-such-preset", "neither a preset nor a file; presets: attn-logits-int4"),
        ("mxfp4", "does not divide"),
        ("BADFILE", "rules[0].scheme: format 'int9': bits 9 out of range 2..8"),
    ],
)
def test_cli_quantize_bad_input(tmp_path, capsys, plan, message):
    base = tmp_path / "base"
    save_checkpoint(tiny_model("diff_v2", vocab_size=259, max_seq_len=64, ffn_dim=40), base)
    data = tmp_path / "d.txt"
    data.write_text("x = 1\n" * 100)
    if plan == "BADFILE":
        plan = str(tmp_path / "bad.yaml")
        (tmp_path / "bad.yaml").write_text("rules:\n  - sites: kind:logits\n    scheme: int9\n")
    args = ["quantize", str(base), "--plan", plan, "--calib-data", str(data), "--seq-len", "32"]
    assert main([*args, "--calib-tokens", "64", "--eval-tokens", "32", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "q").exists()


def test_nan_counted_through_a_plan():
    model = tiny_model("baseline")
    apply_plan(model, preset("w8a8"))
    model.embed.weight.data[5] = float("nan")
    with torch.no_grad():
        out = model(torch.tensor([[1, 5, 2]]))
    assert torch.isnan(out).any()
    counts = nan_counts(model)
    assert counts and all(v > 0 for v in counts.values())


# ------------------------------------------------------------------------------- real backends
def _backend_plan(name: str, **backend) -> QuantPlan:
    return QuantPlan.from_dict({"name": name, "backend": {"name": name, **backend}})


def _fake_weights(scheme: str) -> QuantPlan:
    return QuantPlan.from_dict({"rules": [{"modules": "layers.*", "scheme": scheme}]})


def _logits_pair(real: QuantPlan, fake: QuantPlan, **model_kw):
    ids = _windows(2, 16)
    a, b = tiny_model("diff_v2", **model_kw), tiny_model("diff_v2", **model_kw)
    apply_plan(a, real)
    apply_plan(b, fake)
    calibrate(a, ids)
    with torch.no_grad():
        return a(ids), b(ids)


def test_quanto_int8_weights_agree_with_fake_int8_per_channel():
    # Same grid (absmax / 127 per output row, round half to even): the dequantized weights are equal,
    # so the logits differ only by fp32 summation order.
    real, fake = _logits_pair(_backend_plan("quanto", weight_type="qint8"), _fake_weights("int8:channel"))
    torch.testing.assert_close(real, fake, rtol=1e-5, atol=1e-5)


def test_bnb_nf4_agrees_with_fake_nf4_groups():
    # bitsandbytes quantizes the row-major flattened weight in blocks of 64 with an fp32 absmax each:
    # with in_features a multiple of 64 those blocks are our group(64) on the NF4 codebook.
    kw = {"d_model": 64, "head_dim": 16, "ffn_dim": 128}
    real, fake = _logits_pair(
        _backend_plan("bnb", mode="nf4", blocksize=64), _fake_weights("nf4:group(64)"), **kw
    )
    torch.testing.assert_close(real, fake, rtol=1e-4, atol=1e-4)


def test_bnb_int8_agrees_with_fake_w8a8_on_a_linear():
    # LLM.int8 with no input column beyond the 6.0 threshold is int8 weights per output row times int8
    # inputs per token, both taken after an fp16 cast. The same scheme in fake-quant, applied to the same
    # fp16-cast tensors, differs only by bitsandbytes' dequantisation constant 6.200124e-05 for 1/127^2
    # (relative 1.8e-5) and fp32 summation: bound 3e-5 * sum |xq| |wq| per output.
    from diffquant.models.attention import Linear
    from diffquant.quant.backends.bnb import to_bnb

    torch.manual_seed(0)
    linear = Linear(64, 48)
    x = torch.randn(3, 10, 64).clamp(-5.5, 5.5)
    real = to_bnb(linear, mode="int8", threshold=6.0)(x)
    xq = FakeQuant(Scheme.parse("int8:token"), "x", "linear_in")(x.half().float())
    wq = FakeQuant(Scheme.parse("int8:channel"), "w", "weight").quantize_weight(
        linear.weight.detach().half().float()
    )
    fake = xq @ wq.T
    bound = 3e-5 * (xq.abs() @ wq.abs().T) + 1e-6
    # fp16-cast inputs land exactly on rounding ties (x/s = k + 1/2) now and then; there the two round
    # differently (half to even vs half away from zero): one step of slack for each tied element.
    xh, wh = x.half().float(), linear.weight.detach().half().float()
    sx, sw = xh.abs().amax(-1, keepdim=True) / 127, wh.abs().amax(-1, keepdim=True) / 127
    tie_x = ((xh / sx).abs().frac() - 0.5).abs() < 1e-4
    tie_w = ((wh / sw).abs().frac() - 0.5).abs() < 1e-4
    bound = bound + (tie_x * sx) @ wq.abs().T + xq.abs() @ (tie_w * sw).T
    assert ((real - fake).abs() <= bound).all()
    assert ((real - fake).abs() / fake.abs().clamp_min(1e-3)).median() < 1e-4


@pytest.mark.parametrize(
    "backend",
    [
        {"name": "quanto", "weight_type": "qint8", "activation_type": "qint8"},
        {"name": "bnb", "mode": "int8"},
        {"name": "bnb", "mode": "nf4", "blocksize": 32},
        {"name": "quanto", "weight_type": "qint4"},
    ],
)
def test_backend_round_trip_identical_logits(tmp_path, backend):
    model = tiny_model("diff_v1")
    apply_plan(model, QuantPlan.from_dict({"name": "b", "backend": backend}))
    calibrate(model, _windows(2, 16))
    save_quantized(model, tmp_path / "q")
    again = load_model(tmp_path / "q")
    ids = _windows(2, 12, seed=3)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    assert again.layers[0].attn.q_proj.input is not None  # taps survive the swap
    assert "layers.0.attn.q_proj.input" in again.sites()


def test_masked_absmax_and_int_rounding_match_the_reference():
    from diffquant.quant.formats import get_format
    from diffquant.quant.schemes import apply_scale, masked_absmax

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8) * 5
    x[0, 1, 2], x[1, 0, 0], x[1, 2, 7] = math.nan, math.inf, -math.inf
    valid = torch.rand(1, 3, 8) > 0.3
    for v in (None, valid):
        mag = x.abs()
        keep = torch.isfinite(mag) if v is None else torch.isfinite(mag) & v
        ref = torch.where(keep, mag, 0.0).amax(dim=(1, 2), keepdim=True)
        assert torch.equal(masked_absmax(x, (1, 2), v), ref)
    element = get_format("int8")
    scale = masked_absmax(x, (2,)) / element.max_value
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    got, ref = apply_scale(x, scale, element), element.round(x / scale) * scale
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize(
    "spec",
    [
        {"format": "int8", "granularity": "token"},
        {"format": "int8", "granularity": "tensor"},
        {"format": "int4", "granularity": "channel"},
        {"format": "int4", "granularity": "head"},
        {"format": "int8", "granularity": "token", "scale_format": "e8m0"},
        {"format": "int8", "granularity": "tensor", "scale_format": "fp8_e4m3"},
        {"format": "fp8_e4m3", "granularity": "token"},
        {"format": "fp4_e2m1", "granularity": "tensor"},
    ],
)
@pytest.mark.parametrize("kind", ["q", "resid", "weight"])
def test_fake_quant_fast_path_is_bit_identical(monkeypatch, spec, kind):
    """The CPU fast path (one min/max pass, no scrub, no clamp) gives the general path's numbers bit for bit,
    also at ties (x / s = k + 0.5), huge values that saturate an FP8 scale, zeros and bf16 inputs; NaN / Inf
    inputs fall back to the general path and are counted."""
    from diffquant.quant import fake

    if kind == "weight" and spec["granularity"] not in ("tensor", "channel"):
        return
    if kind != "q" and spec["granularity"] == "head":
        return
    g = torch.Generator().manual_seed(31)
    shape = {"q": (2, 3, 5, 16), "resid": (2, 5, 16), "weight": (12, 16)}[kind]
    base = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    ties = torch.round(torch.randn(shape, generator=g) * 40) / 2  # many halves: round-half-even matters
    huge = torch.randn(shape, generator=g) * 1e6  # int8 x 448 saturates the E4M3 scale
    zeros = torch.zeros(shape)
    bad = base.clone()
    bad.view(-1)[[3, 17]] = torch.tensor([math.nan, math.inf])
    scheme = Scheme(**spec)
    for x in (base, ties, huge, zeros, base.to(torch.bfloat16), bad):
        fast_q = FakeQuant(scheme, "s", kind)
        got = fast_q(x)
        monkeypatch.setattr(fake, "FAST", False)
        slow_q = FakeQuant(scheme, "s", kind)
        want = slow_q(x)
        monkeypatch.setattr(fake, "FAST", True)
        assert got.dtype == want.dtype
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
        assert fast_q.nan_count == slow_q.nan_count == int(x.isnan().sum())


def _calibrated_clip(calibration: str, x: torch.Tensor, fmt: str = "int8", **kw) -> float:
    """The clip (scale x qmax) a static FakeQuant settles on after observing ``x`` in two batches."""
    fq = FakeQuant(Scheme(format=fmt, calibration=calibration, **kw), "s", "resid")
    fq.start_calibration()
    half = x.shape[1] // 2
    fq(x[:, :half])
    fq(x[:, half:])
    fq.finish_calibration()
    return float(fq.scale) * fq.scheme.element.max_value


def _heavy_sample() -> torch.Tensor:
    """|x| ~ N(0, 1) bulk with 0.05 % outliers at +-1000: absmax, a high percentile and the MSE-optimal clip
    are three different numbers."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(40000, generator=g)
    x[torch.randperm(40000, generator=g)[:20]] = 1000.0 * torch.sign(torch.randn(20, generator=g))
    return x.view(1, -1, 1)


@pytest.mark.parametrize("percentile", [99.0, 99.9])
def test_percentile_clip_is_the_exact_quantile_within_one_bin(percentile):
    """Against numpy's exact quantile of |x|: the clip is the upper edge of the 64-per-octave bin holding the
    rank, so it lies in [q, q * 2^(1/64)]. absmax (1000) or the other tail (a tiny clip) fail this."""
    import numpy as np

    x = _heavy_sample()
    q = float(np.quantile(x.abs().numpy().ravel(), percentile / 100, method="inverted_cdf"))
    clip = _calibrated_clip("percentile", x, percentile=percentile)
    assert q <= clip <= q * 2 ** (1 / 64) * (1 + 1e-6), (clip, q)


def test_mse_clip_is_near_the_brute_force_optimum_on_the_data():
    """The MSE clip against a brute-force search of the int4 rounding error on the data itself (not the
    histogram), on N(0, 1) with 0.05 % outliers at +-30 (int4's absmax step 30/7 costs more than clipping
    them): its error is within 3 % of the best clip's, under half of absmax's, far below the worst's."""
    g = torch.Generator().manual_seed(42)
    x = torch.randn(40000, generator=g, dtype=torch.float64)
    x[torch.randperm(40000, generator=g)[:20]] = 30.0 * torch.sign(
        torch.randn(20, generator=g, dtype=torch.float64)
    )

    def mse(clip: float) -> float:
        s = clip / 7
        return float(((torch.round(x / s).clamp(-7, 7) * s - x) ** 2).mean())

    grid = [30.0 * r / 600 for r in range(1, 601)]
    errors = [mse(c) for c in grid]
    best, worst = min(errors), max(errors)
    clip = _calibrated_clip("mse", x.float().view(1, -1, 1), fmt="int4")
    got = mse(clip)
    assert got <= best * 1.03, (clip, got, best)
    assert got < 0.5 * mse(30.0) and worst > 3 * got


def _first_batch_outliers() -> list[torch.Tensor]:
    """Four calibration batches (1, 10000, 1): N(0, 1) everywhere, and 0.05 % of all values at +-30 all in
    the FIRST batch, so a calibration that keeps only the last batch sees no outlier at all."""
    g = torch.Generator().manual_seed(43)
    batches = [torch.randn(1, 10000, 1, generator=g) for _ in range(4)]
    idx = torch.randperm(10000, generator=g)[:20]
    batches[0][0, idx, 0] = 30.0 * torch.sign(torch.randn(20, generator=g))
    return batches


def _clip_over(calibration: str, batches: list[torch.Tensor], fmt: str = "int8", **kw) -> float:
    fq = FakeQuant(Scheme(format=fmt, calibration=calibration, **kw), "s", "resid")
    fq.start_calibration()
    for b in batches:
        fq(b)
    fq.finish_calibration()
    return float(fq.scale) * fq.scheme.element.max_value


@pytest.mark.parametrize("calibration", ["absmax", "percentile", "mse"])
def test_calibration_remembers_an_extreme_of_the_first_batch(calibration):
    """The extreme values come in the first of four batches: every observer keeps them (abs-max: the max;
    percentile: the exact quantile of all batches within one bin; MSE: near the brute-force optimum over all
    batches), where one that kept only the last batch would settle near the N(0, 1) bulk (~4)."""
    import numpy as np

    batches = _first_batch_outliers()
    x = torch.cat(batches, dim=1)
    if calibration == "absmax":
        assert _clip_over("absmax", batches) == pytest.approx(float(x.abs().max()), rel=1e-6)
        assert float(x.abs().max()) == 30.0
    elif calibration == "percentile":
        q = float(np.quantile(x.abs().numpy().ravel(), 0.9999, method="inverted_cdf"))
        assert q == 30.0  # the 99.99th percentile of all batches is an outlier; of the last batch it is not
        clip = _clip_over("percentile", batches, percentile=99.99)
        assert q <= clip <= q * 2 ** (1 / 64) * (1 + 1e-6), (clip, q)
    else:
        xd = x.double().reshape(-1)

        def mse(clip: float) -> float:
            s = clip / 7
            return float(((torch.round(xd / s).clamp(-7, 7) * s - xd) ** 2).mean())

        best = min(mse(30.0 * r / 600) for r in range(1, 601))
        got = mse(_clip_over("mse", batches, fmt="int4"))
        assert got <= best * 1.03, (got, best)


# ----------------------------------------------------- the fake-quant hot path against a reference
_E4M3_POSITIVE = torch.unique(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float())
_E4M3_POSITIVE = _E4M3_POSITIVE[torch.isfinite(_E4M3_POSITIVE) & (_E4M3_POSITIVE > 0)]


def _reference_fake_quant(x, spec, dims, group=None):
    """Fake-quantization written out from the definitions, one readable step at a time: the groups'
    finite abs-max (or min / max), scale = amax / qmax (1 where it is 0) rounded *up* onto the scale format,
    then clamp(round-half-even(x / s)) * s for ints, the saturating FP8 cast for fp8_e4m3, and the result
    cast back to the input's dtype."""
    xf = x.float()
    if group is not None:  # group(n) along the last dim
        xf = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    finite = torch.isfinite(xf)
    fmt = spec["format"]
    if not spec.get("symmetric", True) or fmt.startswith("uint"):
        bits = int(fmt.removeprefix("u").removeprefix("int"))
        qmax = 2.0**bits - 1
        lo = torch.where(finite, xf, 0.0).amin(dim=dims, keepdim=True)
        hi = torch.where(finite, xf, 0.0).amax(dim=dims, keepdim=True)
        scale = (hi - lo) / qmax
        scale = torch.where(scale > 0, scale, 1.0)
        zero = torch.round(-lo / scale)
        out = (torch.clamp(torch.round(xf / scale + zero), 0, qmax) - zero) * scale
    else:
        qmax = 448.0 if fmt == "fp8_e4m3" else 2.0 ** (int(fmt.removeprefix("int")) - 1) - 1
        amax = torch.where(finite, xf.abs(), 0.0).amax(dim=dims, keepdim=True)
        scale = amax / qmax
        scale = torch.where(scale > 0, scale, 1.0)
        if spec.get("scale_format") == "e8m0":  # the smallest power of two >= scale
            scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).clamp(2.0**-127, 2.0**127).float()
        elif spec.get("scale_format") == "fp8_e4m3":  # the smallest E4M3 value >= scale, at most 448
            idx = torch.searchsorted(_E4M3_POSITIVE, scale.reshape(-1)).clamp_max(len(_E4M3_POSITIVE) - 1)
            scale = _E4M3_POSITIVE[idx].reshape(scale.shape)
        v = xf / scale
        if fmt == "fp8_e4m3":
            q = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        else:
            q = torch.clamp(torch.round(v), -qmax, qmax)
        out = q * scale
    return out.reshape(x.shape).to(x.dtype)


_HOT_CASES = [  # (scheme, kind, reduced dims of the reference, group size)
    ({"format": "int8", "granularity": "tensor"}, "linear_in", (1, 2), None),
    ({"format": "int8", "granularity": "token"}, "linear_in", (2,), None),
    ({"format": "int4", "granularity": "token"}, "linear_in", (2,), None),
    ({"format": "int8", "granularity": "channel"}, "linear_in", (1,), None),
    ({"format": "int8", "granularity": "token", "symmetric": False}, "linear_in", (2,), None),
    ({"format": "uint4", "granularity": "tensor"}, "linear_in", (1, 2), None),
    ({"format": "int8", "granularity": "token", "scale_format": "e8m0"}, "linear_in", (2,), None),
    ({"format": "int8", "granularity": "token", "scale_format": "fp8_e4m3"}, "linear_in", (2,), None),
    ({"format": "fp8_e4m3", "granularity": "token"}, "linear_in", (2,), None),
    ({"format": "fp8_e4m3", "granularity": "tensor"}, "linear_in", (1, 2), None),
    ({"format": "int8", "granularity": "channel"}, "weight", (1,), None),
    ({"format": "int4", "granularity": "channel"}, "weight", (1,), None),
    ({"format": "int8", "granularity": "tensor"}, "weight", (0, 1), None),
    ({"format": "int4", "granularity": "group(16)"}, "weight", (-1,), 16),
    ({"format": "int8", "granularity": "group(8)", "symmetric": False}, "weight", (-1,), 8),
]


def _hot_inputs(shape, qmax, symmetric):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])
    # ties: halves in (-qmax, qmax) and each row's first entry qmax, so per-row scales are exactly 1 and
    # x / s lands on k + 0.5 (round half to even decides)
    ties = torch.randint(-2 * int(qmax) + 1, 2 * int(qmax), shape, generator=g) / 2
    ties[..., 0] = qmax
    rows_of_zeros = torch.randn(shape, generator=g)
    rows_of_zeros.view(-1, shape[-1])[::2] = 0.0  # every other row all zeros (scale 1, zeros out)
    huge = torch.randn(shape, generator=g) * 1e6  # saturates an E4M3 scale (448)
    cases = [
        base,
        ties,
        rows_of_zeros,
        torch.zeros(shape),
        huge,
        base.to(torch.bfloat16),
        ties.to(torch.bfloat16),
    ]
    if symmetric:
        bad = base.clone()
        bad.view(-1)[[1, 7, 20]] = torch.tensor([math.nan, math.inf, -math.inf])
        cases.append(bad)
    return cases


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
@pytest.mark.parametrize(("spec", "kind", "dims", "group"), _HOT_CASES, ids=lambda v: str(v))
def test_fake_quant_equals_a_reference_implementation(monkeypatch, fast, spec, kind, dims, group):
    """Both paths (CPU fast path and general) of FakeQuant, at taps and on weights (the cached
    quantize_weight), equal the reference bit for bit: per tensor / token / channel / group, int8 / int4 /
    fp8_e4m3, symmetric and asymmetric, fp32 and bf16 inputs, ties at .5, all-zero rows, saturated scales."""
    from diffquant.quant import fake

    monkeypatch.setattr(fake, "FAST", fast)
    scheme = Scheme(**spec)
    shape = (12, 32) if kind == "weight" else (2, 6, 32)
    qmax = scheme.element.max_value
    for x in _hot_inputs(shape, qmax, not scheme.asymmetric):
        want = _reference_fake_quant(x, spec, dims, group)
        fq = FakeQuant(scheme, "s", kind)
        got = fq.quantize_weight(x) if kind == "weight" else fq(x)
        assert got.dtype == x.dtype
        assert torch.equal(got.isnan(), want.isnan()), (spec, x.dtype)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (spec, x.dtype, (got - want).abs().max())
        if kind == "weight":
            assert fq.quantize_weight(x) is got  # cached


def test_cached_weight_is_requantized_when_the_weight_changes():
    """The fake-quantized weight is computed once; an in-place change under no_grad (version counter), a
    replaced ``.data`` (also twice, which may reuse the first storage's address with the same version), a
    view of another shape at the same address and a dtype change each give a fresh value, and a Linear
    computes with it."""
    from diffquant.models.attention import Linear

    spec = {"format": "int8", "granularity": "channel"}
    lin = Linear(32, 12).requires_grad_(False)
    fq = lin.weight_quantizer = FakeQuant(Scheme(**spec), "lin.weight", "weight")
    x = torch.randn(3, 32)

    def check():
        want = _reference_fake_quant(lin.weight.detach(), spec, (1,))
        assert torch.equal(fq.quantize_weight(lin.weight), want)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, want.to(x.dtype)))

    check()
    first = fq.quantize_weight(lin.weight)
    assert fq.quantize_weight(lin.weight) is first
    with torch.no_grad():
        lin.weight.mul_(3.0)  # same storage, version bumped
    check()
    for _ in range(5):  # A -> B -> C: C may land at A's freed address with the parameter's version
        check()
        lin.weight.data = lin.weight.data * 2.0
        lin.weight.data = lin.weight.data - 0.25
        check()
    lin.weight.data = lin.weight.data[:, :16]  # a view: same address and version, another shape
    assert fq.quantize_weight(lin.weight).shape == (12, 16)
    assert torch.equal(fq.quantize_weight(lin.weight), _reference_fake_quant(lin.weight.detach(), spec, (1,)))
    lin.weight.data = lin.weight.data.to(torch.bfloat16)
    assert fq.quantize_weight(lin.weight).dtype == torch.bfloat16
    assert torch.equal(fq.quantize_weight(lin.weight), _reference_fake_quant(lin.weight.detach(), spec, (1,)))


def test_linears_reading_one_tensor_quantize_it_once(monkeypatch):
    """w8a8 on a 10-layer model: q / k / v (and gate / up) read one tensor, so their dynamic input quantizers
    compute it once; the logits are the uncached computation's bit for bit. The cache answers only for the
    very same, unchanged tensor and the same scheme: an in-place edit, another scheme or a new tensor with
    equal values are quantized afresh."""
    from diffquant.models import DecoderLM, ModelConfig
    from diffquant.quant import QuantPlan, apply_plan, fake

    torch.manual_seed(0)
    cfg = ModelConfig(
        attention="baseline", vocab_size=64, d_model=32, n_layers=10, n_heads=4, n_kv_heads=2, ffn_dim=48
    )
    model = DecoderLM(cfg).eval()
    apply_plan(model, QuantPlan.load("w8a8"))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    calls = []
    original = fake.quantize_dynamic_finite

    def spy(*args, **kwargs):
        calls.append(args[0].shape[-1])
        return original(*args, **kwargs)

    monkeypatch.setattr(fake, "quantize_dynamic_finite", spy)
    with torch.no_grad():
        got = model(ids)
    per_layer = len(calls) // cfg.n_layers
    assert len(calls) == 4 * cfg.n_layers and per_layer == 4  # qkv-in, o-in, gate/up-in, down-in
    monkeypatch.setattr(fake, "_LAST", fake._LastDynamic())
    monkeypatch.setattr(fake._LastDynamic, "get", lambda self, *a: None)
    calls.clear()
    with torch.no_grad():
        want = model(ids)
    assert len(calls) == 7 * cfg.n_layers
    assert torch.equal(got, want)

    monkeypatch.undo()
    scheme = QuantPlan.load("w8a8").rules[1].scheme
    a, b = FakeQuant(scheme, "a.input", "linear_in"), FakeQuant(scheme, "b.input", "linear_in")
    x = torch.randn(2, 5, 16)
    first = a(x)
    assert b(x) is first  # same tensor, same scheme: shared
    x.mul_(3.0)  # edited in place: recomputed
    assert torch.equal(b(x), FakeQuant(scheme, "c.input", "linear_in").quantize(x))
    other = Scheme(format="int4", granularity="token")
    assert torch.equal(
        FakeQuant(other, "d.input", "linear_in")(x), FakeQuant(other, "e.input", "linear_in").quantize(x)
    )
    y = x.clone()
    assert b(y) is not b(x)
    # a new tensor at a freed tensor's address (the allocator reuses the block): not the cached one
    for _ in range(20):
        old = torch.randn(3, 7, 16)
        a(old)
        address = old.data_ptr()
        del old
        new = torch.randn(3, 7, 16)
        if new.data_ptr() == address:
            break
    assert torch.equal(b(new), FakeQuant(scheme, "f.input", "linear_in").quantize(new))


def test_native_per_token_int_fake_quant_is_the_torch_one(monkeypatch):
    """w8a8's per-token int8 (and int4) fake quantization runs natively (two traversals per row) on float32
    inputs and gives the torch fast path's and the general path's numbers bit for bit: ties at x / s = k + 0.5
    (round half to even), rows of zeros and of subnormals (scale 1), a row with one huge value, a NaN
    (falls back and is counted)."""
    from diffquant.kernels import native
    from diffquant.quant import fake, schemes

    calls = []
    monkeypatch.setattr(
        native, "fake_int_rows", lambda *a, _f=native.fake_int_rows: calls.append(1) or _f(*a)
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, 96, generator=g) * torch.logspace(-3, 3, 96)
    x[0] = torch.round(torch.randn(40, 96, generator=g) * 40) / 2  # halves: ties after the division
    x[0, :, 0] = 127.0 / 2 * torch.arange(40)[:, None].squeeze(1) / 20  # scales that make exact ties
    x[1, 3] = 0.0
    x[1, 4] = 1e-41
    x[2, 7, 5] = 3e30
    for fmt in ("int8", "int4"):
        scheme = Scheme(format=fmt, granularity="token")
        calls.clear()
        got = FakeQuant(scheme, "s.input", "resid")(x)
        assert len(calls) == 1
        monkeypatch.setattr(schemes, "NATIVE", False)
        torch_fast = FakeQuant(scheme, "t.input", "resid")(x)
        monkeypatch.setattr(fake, "FAST", False)
        general = FakeQuant(scheme, "u.input", "resid")(x)
        monkeypatch.setattr(fake, "FAST", True)
        monkeypatch.setattr(schemes, "NATIVE", True)
        assert torch.equal(got, torch_fast) and torch.equal(got, general), fmt
    bad = x.clone()
    bad[2, 1, 1] = math.nan
    fq = FakeQuant(Scheme(format="int8", granularity="token"), "v.input", "resid")
    y = fq(bad)
    assert fq.nan_count == 1 and torch.isnan(y[2, 1, 1])
