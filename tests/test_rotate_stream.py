"""Rotation (QuaRot / SpinQuant) in layer-streamed runs: each stage's weights are rotated as the stage is read
(the embedding E Q; a layer's norms folded, readers / writers, R2, R4 and the online modules; the head's
final norm folded and W Q, a tied head read from the embedding's tensor again), so a streamed run gives the
whole-model run's numbers bit for bit: logits, bits per byte, profiles, the quantize report and the quantized
checkpoint (rotated weights, ``transforms: ["rotate"]``), for baseline, DIFF V1 and DIFF V2, native, hf: and
gguf: checkpoints, tied and untied heads. Bad input stays one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import shard_safetensors, tiny_model
from test_gguf import MHA_TIED, Q, write_gguf
from test_gguf import tok_files as tok_files  # noqa: F401 (the fixture, shared)
from test_stream_quantize import _same_checkpoint, _text

from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import evaluate_stream
from diffquant.io import load_model, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.io.quantize import quantize_checkpoint
from diffquant.profile.runner import profile_model
from diffquant.quant import QuantPlan, apply_plan, calibrate
from diffquant.stream import (
    evaluate_streamed,
    logits_streamed,
    open_streamed,
    profile_streamed,
    quantize_streamed,
)

KINDS = ("baseline", "diff_v1", "diff_v2")
# every place rotated with seeded random matrices (R3 per key head too), static scales on Linear inputs and
# on the q / k sites R3 rotates: calibration runs through the rotated stages
RANDOM_STATIC = """name: random-static
rotate: {residual: random, heads: random, ffn: random, qk: random, seed: 11}
rules:
  - modules: ["layers.*", "lm_head"]
    scheme: int8:channel
  - sites: ["layers.*.input", "kind:q", "kind:k"]
    scheme: {format: int8, granularity: tensor, calibration: absmax}
"""
ALL_HADAMARD = """name: all-hadamard
rotate: {residual: hadamard, heads: hadamard, ffn: hadamard, qk: hadamard}
rules:
  - modules: ["layers.*"]
    scheme: int4:channel
  - sites: ["layers.*.input"]
    scheme: int8:token
"""


def _scramble(model):
    """Norm weights far from 1 (a stage whose norm is not folded must show), the model saved as it is."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def _model(kind, tie=False, **overrides):
    return _scramble(tiny_model(kind, vocab_size=259, tie_embeddings=tie, **overrides))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotstream")
    folders = {k: save_checkpoint(_model(k), root / k) for k in KINDS}
    folders["tied"] = save_checkpoint(_model("diff_v2", tie=True), root / "tied")
    hf = export_hf(_model("diff_v1", tie=True), root / "hf")
    shard_safetensors(hf, 2)
    plans = {}
    for name, text in (("random-static", RANDOM_STATIC), ("all-hadamard", ALL_HADAMARD)):
        plans[name] = root / f"{name}.yaml"
        plans[name].write_text(text)
    return {"folders": folders, "hf": f"hf:{hf}", "plans": plans, "text": _text(root / "t.txt")}


def _plan(setup, name):
    return QuantPlan.load(setup["plans"].get(name, name))


def _windows(n=4, length=20, seed=2):
    return torch.randint(0, 259, (n, length), generator=torch.Generator().manual_seed(seed))


def _whole(spec, plan, windows, batch_size=2):
    """The whole-model run: load, apply the plan (rotating), calibrate static scales on ``windows``."""
    model = load_model(spec)
    apply_plan(model, plan)
    if plan.uses_static:
        calibrate(model, windows, batch_size=batch_size)
    return model


def _logits(model, windows, batch_size=2):
    with torch.no_grad():
        return torch.cat([model(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)])


# ------------------------------------------------------------------------------------- logits, bpb
@pytest.mark.parametrize("kind", [*KINDS, "tied"])
@pytest.mark.parametrize("plan", ["quarot", "w4a8-quarot", "random-static", "all-hadamard"])
def test_rotated_streamed_logits_and_bpb_equal_whole(setup, kind, plan):
    spec, plan = str(setup["folders"][kind]), _plan(setup, plan)
    windows = _windows()
    model = _whole(spec, plan, windows)
    streamed = logits_streamed(spec, windows, batch_size=2, plan=plan, calibration=windows)
    assert torch.equal(_logits(model, windows), streamed)  # the same operations on the same tensors
    if plan.name == "quarot":  # rotation alone is exact: the unrotated model's logits, to float32 rounding
        plain = _logits(load_model(spec), windows)
        assert float((streamed - plain).abs().max() / plain.abs().max()) < 1e-5
    stream = _windows(1, 150, seed=3).flatten()
    calib = _windows(4, 32, seed=4)
    whole = _whole(spec, plan, calib)
    a = evaluate_stream(whole, stream, seq_len=32, batch_size=2)
    b = evaluate_streamed(spec, stream, seq_len=32, batch_size=2, plan=plan, calibration=calib)
    assert a == b


@pytest.mark.parametrize("plan", ["w4a8-quarot", "random-static"])
def test_tied_hf_shards_and_gguf_untie_and_stream_like_whole(setup, tok_files, tmp_path, plan):
    """Tied embeddings (hf: shards, a GGUF): the head stage reads the embedding's tensor again as its own
    weight (the final norm folded into it, then W Q), as the whole model unties it."""
    pytest.importorskip("gguf")
    path = write_gguf(tmp_path / "tied.gguf", tok_files, MHA_TIED, Q.Q8_0)
    plan = _plan(setup, plan)
    for spec in (setup["hf"], f"gguf:{path}"):
        model = load_model(spec)
        assert model.config.tie_embeddings
        windows = _windows(4, 20) % model.config.vocab_size
        whole = _whole(spec, plan, windows)
        assert not whole.config.tie_embeddings
        streamed = logits_streamed(spec, windows, batch_size=2, plan=plan, calibration=windows)
        assert torch.equal(_logits(whole, windows), streamed), spec
        with torch.no_grad(), open_streamed(spec, plan=plan) as run:
            assert not run.config.tie_embeddings and not run.model.config.tie_embeddings
            assert [p for p in run.stages()[-1][1]] == ["norm.", "lm_head."]  # no embedding re-tied
            assert run.spec.key_map["lm_head.weight"] == run.spec.key_map["embed.weight"]
            run.run([windows[:2]], on_logits=lambda k, y: None, calibration=[windows[:2]], progress=False)
            # a released stage keeps no rotation matrix (R3 / R4 are attached again when it is read)
            online = [
                getattr(m, "input_rotation", None) or getattr(m, "qk_rotation", None)
                for m in run.model.modules()
            ]
            assert not any(online)


# ------------------------------------------------------------------------------------------ profile
@pytest.mark.parametrize("kind", [*KINDS, "tied"])
def test_rotated_streamed_profile_equals_whole(setup, kind):
    spec, plan = str(setup["folders"][kind]), _plan(setup, "random-static")
    windows = _windows(5, 24)
    model = _whole(spec, plan, windows)
    for sites in ("*", "kind:resid"):
        whole = profile_model(model, windows, batch_size=2, sites=sites, topk=8).to_dict()
        streamed = profile_streamed(
            spec, windows, batch_size=2, sites=sites, topk=8, plan=plan, calibration=windows
        ).to_dict()
        assert whole == streamed, sites  # same rotated tensors, same order per site: bit for bit
    # and the rotation did something the profile sees: the unrotated model's residual differs
    plain = profile_model(load_model(spec), windows, batch_size=2, sites="kind:resid", topk=8).to_dict()
    assert (
        plain
        != profile_streamed(
            spec, windows, batch_size=2, sites="kind:resid", topk=8, plan=plan, calibration=windows
        ).to_dict()
    )


# ----------------------------------------------------------------------------------------- quantize
def _options(setup, **extra):
    return dict(
        calib_data=setup["text"], calib_tokens=200, eval_tokens=160, seq_len=32, batch_size=3, **extra
    )


@pytest.mark.parametrize("kind", [*KINDS, "tied", "hf"])
@pytest.mark.parametrize("plan", ["w4a8-quarot", "random-static"])
def test_rotated_streamed_quantize_writes_the_whole_checkpoint(setup, tmp_path, kind, plan):
    spec = setup["hf"] if kind == "hf" else str(setup["folders"][kind])
    plan = str(setup["plans"].get(plan, plan))
    a = quantize_checkpoint(spec, plan, out=tmp_path / "whole", **_options(setup))
    b = quantize_streamed(spec, plan, out=tmp_path / "streamed", **_options(setup))
    assert a["report"] == b["report"]  # the same sums in the same order: equal
    assert a["text"].replace("whole", "streamed") == b["text"] and "rotated residual (R1)" in b["text"]
    _same_checkpoint(tmp_path / "whole", tmp_path / "streamed")
    doc = json.loads((tmp_path / "streamed" / "quant_plan.json").read_text())
    assert doc["transforms"] == ["rotate"] and "rotate" in doc["plan"]
    ids = _windows(2, 24, seed=5)
    with torch.no_grad():
        loaded = load_model(str(tmp_path / "streamed"))
        assert not loaded.config.tie_embeddings
        assert torch.equal(load_model(str(tmp_path / "whole"))(ids), loaded(ids))


def test_cli_eval_sweep_stream_on_with_rotation_equals_off(setup, tmp_path, capsys):
    specs = [str(setup["folders"][k]) for k in ("diff_v2", "tied")]
    task = ["--task", "bpb:tokens=600,seq_len=48", "--batch-size", "3", "--calib-tokens", "384"]
    task += ["--calib-seq-len", "48", "--calib-data", setup["text"]]
    plans = ["--plan", "w4a8-quarot", str(setup["plans"]["random-static"])]
    assert main(["eval", *specs, *task, *plans, "--out", str(tmp_path / "whole")]) == 0
    assert main(["eval", *specs, *task, *plans, "--out", str(tmp_path / "streamed"), "--stream", "on"]) == 0
    capsys.readouterr()
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert whole == json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert "bits_per_byte" in json.dumps(whole)


# --------------------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(setup, tmp_path, capsys):
    """A size without a Hadamard matrix: refused before any tensor is read (API: DiffquantError; CLI: one
    line, exit 2, no output); smoothing still does not stream, with or without rotation."""
    folder = save_checkpoint(_model("baseline", ffn_dim=156), tmp_path / "ffn156")
    with pytest.raises(DiffquantError, match=r"rotate.ffn: size 156 has no Hadamard matrix") as err:
        logits_streamed(str(folder), _windows(), plan="w4a8-quarot")
    assert "\n" not in str(err.value)
    argv = [
        "quantize",
        str(folder),
        "--plan",
        "w4a8-quarot",
        "--calib-data",
        setup["text"],
        "--seq-len",
        "32",
    ]
    assert main([*argv, "--out", str(tmp_path / "q"), "--stream", "on"]) == 2
    out = capsys.readouterr().err
    assert out.count("\n") == 1 and "size 156 has no Hadamard matrix" in out
    assert not (tmp_path / "q").exists()
    with pytest.raises(DiffquantError, match="smooth \\(SmoothQuant\\) is not supported in a streamed run"):
        logits_streamed(str(setup["folders"]["baseline"]), _windows(), plan="w4a8-quarot-smooth")
