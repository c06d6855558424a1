"""``diffquant quantize --stream`` (diffquant.stream.quantize_streamed) writes what the whole-model quantize
writes: the same error report (equal, not only within 1e-6), the same quantized checkpoint (tensors,
config, plan and metadata; the weights file byte for byte) for baseline, DIFF V1 and DIFF V2 models,
native and hf: folders, static and dynamic plans; the command line prints the same; plans that cannot
stream are refused in one line; a run that fails leaves no output folder."""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import shard_safetensors, tiny_model, train_byte_bpe
from safetensors import safe_open

import diffquant.io.quantize as whole_quantize
import diffquant.stream.quantize as stream_quantize
from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.io import load_model, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.io.quantize import quantize_checkpoint
from diffquant.recipes import run_recipe, validate
from diffquant.stream import quantize_streamed

KINDS = ("baseline", "diff_v1", "diff_v2")
FILES = ("config.json", "quant_plan.json", "quant_report.json")
# static scales on the attention maps too (their taps force the explicit path in the quantized model only),
# a percentile clip on the LM head's input, dynamic int8 weights including the LM head
MAPS_PLAN = """name: maps-static
rules:
  - modules: ["layers.*", "lm_head"]
    scheme: int8:channel
  - sites: ["kind:logits", "kind:probs"]
    scheme: {format: int8, granularity: tensor, calibration: absmax}
  - sites: ["lm_head.input"]
    scheme: {format: int8, granularity: tensor, calibration: percentile, percentile: 99.9}
"""
# GPTQ weights (sequential: each layer's Hessians from the quantized layers before it) with rotation, the LM
# head included (its Hessian from the last layer's stream), dynamic and static activations: the streamed
# run must choose the same codes stage by stage as the whole-model pass does.
GPTQ_PLAN = """name: gptq-rotated
rotate: {residual: hadamard, heads: hadamard, ffn: hadamard}
weights: {method: gptq, format: int4, group: 16, act_order: true, modules: ["layers.*", "lm_head"]}
rules:
  - sites: ["kind:linear_in"]
    scheme: int8:token
  - sites: ["kind:logits"]
    scheme: {format: int8, granularity: tensor, calibration: absmax}
"""

# AWQ weights (scales searched per norm group on each layer's calibration inputs, folded into the norms and
# their readers, then RTN codes): the streamed run folds and codes stage by stage as the whole model does, and
# its checkpoint stores the folded weights.
AWQ_PLAN = """name: awq
weights: {method: awq, format: int4, group: 16, alpha_grid: 8}
rules:
  - sites: ["kind:logits"]
    scheme: {format: int8, granularity: tensor, calibration: absmax}
"""


def _text(path) -> str:
    """A few thousand bytes of varied text (a repeated line would make every window alike)."""
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "x", "=", "1", "def", "return", "(", ")", "\n", "42"]
    path.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (2500,), generator=g)))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamquant")
    folders = {k: save_checkpoint(load_model(f"init:{k}:tiny"), root / k) for k in KINDS}
    plan = root / "maps.yaml"
    plan.write_text(MAPS_PLAN)
    gptq = root / "gptq.yaml"
    gptq.write_text(GPTQ_PLAN)
    awq = root / "awq.yaml"
    awq.write_text(AWQ_PLAN)
    return {
        "folders": folders,
        "text": _text(root / "t.txt"),
        "maps": str(plan),
        "gptq": str(gptq),
        "awq": str(awq),
    }


PEAK = re.compile(r"; peak memory \d+\.\d\d GiB$", re.MULTILINE)  # the quantize command's last line


def _options(setup, **extra):
    return dict(
        calib_data=setup["text"], calib_tokens=200, eval_tokens=160, seq_len=32, batch_size=3, **extra
    )


def _close(a, b, rel=1e-6):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close(a[k], b[k], rel)
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= rel * max(abs(a), abs(b))
    else:
        assert a == b


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _same_checkpoint(whole, streamed) -> None:
    """The two quantized folders hold the same files, tensors, config, plan, metadata and report."""
    assert sorted(p.name for p in whole.iterdir()) == sorted(p.name for p in streamed.iterdir())
    for name in ("model.safetensors", "quant_state.safetensors"):
        (meta_a, a), (meta_b, b) = _tensors(whole / name), _tensors(streamed / name)
        assert meta_a == meta_b and list(a) == list(b)
        for k in a:  # equal, dtype too (NaN where NaN)
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    # the streamed weights file is laid out as save_file lays it out: the same bytes
    assert (whole / "model.safetensors").read_bytes() == (streamed / "model.safetensors").read_bytes()
    for name in FILES:
        assert json.loads((whole / name).read_text()) == json.loads((streamed / name).read_text()), name
    for path in whole.iterdir():  # config, plan, metadata, report, tokenizer files: the same bytes
        assert path.read_bytes() == (streamed / path.name).read_bytes(), path.name


def _quantize_both(spec, plan, tmp_path, options):
    a = quantize_checkpoint(spec, plan, out=tmp_path / "whole", **options)
    b = quantize_streamed(spec, plan, out=tmp_path / "streamed", **options)
    return a, b


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("plan", ["w8a8-tensor", "w8a8", "maps", "gptq", "awq"])
def test_streamed_quantize_equals_whole(setup, tmp_path, kind, plan):
    plan = setup.get(plan, plan)
    spec = str(setup["folders"][kind])
    a, b = _quantize_both(spec, plan, tmp_path, _options(setup))
    _close(a["report"], b["report"])
    assert a["report"] == b["report"]  # the same sums in the same order: equal
    assert a["text"].replace("whole", "streamed") == b["text"]
    assert a["report"]["logits"]["n"] > 0 and not a["report"]["logits"]["exact"]
    _same_checkpoint(tmp_path / "whole", tmp_path / "streamed")
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(
            load_model(str(tmp_path / "whole"))(ids), load_model(str(tmp_path / "streamed"))(ids)
        )


def test_sharded_hf_tied_bf16_bpe_and_spilled_hidden_states(setup, tmp_path):
    """An hf: folder in shards with its own BPE tokenizer, tied embeddings, computed in bfloat16, every
    hidden state spilled to files: still the whole-model checkpoint (tokenizer files too) and report."""
    model = tiny_model("diff_v1", vocab_size=300, max_seq_len=64, tie_embeddings=True)
    hf = export_hf(model, tmp_path / "hf")
    train_byte_bpe(hf, Path(setup["text"]).read_text().splitlines())
    shard_safetensors(hf, 2)
    options = _options(setup, dtype="bfloat16")
    a = quantize_checkpoint(f"hf:{hf}", "w8a8-tensor", out=tmp_path / "whole", **options)
    stats: dict = {}
    b = quantize_streamed(
        f"hf:{hf}", "w8a8-tensor", out=tmp_path / "streamed", hidden_budget=0, stats=stats, **options
    )
    assert a["report"] == b["report"] and a["text"].replace("whole", "streamed") == b["text"]
    _same_checkpoint(tmp_path / "whole", tmp_path / "streamed")
    _, weights = _tensors(tmp_path / "streamed" / "model.safetensors")
    assert "lm_head.weight" not in weights and weights["embed.weight"].dtype == torch.bfloat16
    assert (tmp_path / "streamed" / "tokenizer.json").is_file()
    assert stats["stages"] == 2 + model.config.n_layers
    assert stats["hidden_spilled_ref"] > 0 and stats["hidden_peak_bytes_quant"] == 0
    assert stats["peak_stage_bytes"] < sum(t.numel() * 2 for t in weights.values())


def test_nan_weights_are_counted_alike(setup, tmp_path):
    """A NaN in a weight reaches the report and the NaN counts of the metadata the same way."""
    model = load_model(str(setup["folders"]["baseline"]))
    model.layers[1].mlp.up.weight.data[3, 5] = float("nan")
    base = save_checkpoint(model, tmp_path / "base")
    a, b = _quantize_both(str(base), "w8a8-tensor", tmp_path, _options(setup))
    assert a["text"].replace("whole", "streamed") == b["text"] and "NaN seen by quantizers" in a["text"]
    assert json.dumps(a["report"]) == json.dumps(b["report"])
    _same_checkpoint(tmp_path / "whole", tmp_path / "streamed")


@pytest.mark.parametrize("plan", ["w8a8-tensor", "w4a8-quarot"])
def test_cli_stream_on_prints_and_writes_what_stream_off_does(setup, tmp_path, capsys, plan):
    spec = str(setup["folders"]["diff_v1"])
    args = ["quantize", spec, "--plan", plan, "--calib-data", setup["text"], "--seq-len", "32"]
    args += ["--calib-tokens", "200", "--eval-tokens", "160", "--batch-size", "3"]
    assert main([*args, "--out", str(tmp_path / "whole"), "--stream", "off"]) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "streamed"), "--stream", "on"]) == 0
    # the last line ends with the process's peak memory, which varies like a wall time: compared aside
    streamed = capsys.readouterr().out
    assert PEAK.search(whole) and PEAK.search(streamed)
    assert PEAK.sub("", streamed) == PEAK.sub("", whole).replace("whole", "streamed")
    if plan == "w4a8-quarot":  # the rotation's report names what ran, alike in both runs
        assert "rotated heads (R2)" in whole
    _same_checkpoint(tmp_path / "whole", tmp_path / "streamed")


@pytest.mark.parametrize("plan", ["w8a8-smoothquant", "quanto-w8", "w4a8-quarot-smooth"])
def test_cli_refuses_plans_that_cannot_stream_in_one_line(setup, tmp_path, capsys, plan):
    spec = str(setup["folders"]["baseline"])
    argv = ["quantize", spec, "--plan", plan, "--calib-data", setup["text"], "--seq-len", "32"]
    assert main([*argv, "--out", str(tmp_path / "q"), "--stream", "on"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not supported in a streamed run" in err
    assert not (tmp_path / "q").exists()


def test_stream_on_refuses_what_cannot_stream(setup, tmp_path, capsys):
    argv = ["quantize", "init:baseline:tiny", "--plan", "w8a8", "--calib-data", setup["text"]]
    assert main([*argv, "--seq-len", "32", "--out", str(tmp_path / "q"), "--stream", "on"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stream on: init:baseline:tiny" in err


def test_a_failed_run_leaves_no_output(setup, tmp_path, monkeypatch):
    """A run that fails in a late stage leaves neither the output folder nor a temporary sibling."""
    calls = []
    original = stream_quantize._compare_stage

    def failing(name, *args, **kwargs):
        calls.append(name)
        if name == "layers.1":
            raise DiffquantError("planted failure")
        return original(name, *args, **kwargs)

    monkeypatch.setattr(stream_quantize, "_compare_stage", failing)
    spec = str(setup["folders"]["baseline"])
    with pytest.raises(DiffquantError, match="planted failure"):
        quantize_streamed(spec, "w8a8", out=tmp_path / "q", **_options(setup))
    assert calls == ["embed", "layers.0", "layers.1"]
    assert list(tmp_path.iterdir()) == []


def test_recipe_quantize_stage_streams(setup, tmp_path):
    def recipe(stream):
        raw = {
            "name": "stream-quantize",
            "models": {"v2": str(setup["folders"]["diff_v2"])},
            "data": {"calib": {"source": setup["text"], "tokens": 200, "seq_len": 32}},
            "profile": {"enabled": False},
            "quantize": {"plans": ["w8a8-tensor"], "eval_tokens": 160, "batch_size": 3},
            "plots": {"enabled": False},
            "stream": stream,
        }
        return validate(raw)

    logs_whole: list[str] = []
    logs_streamed: list[str] = []
    run_recipe(recipe("off"), tmp_path / "whole", log=logs_whole.append)
    run_recipe(recipe("on"), tmp_path / "streamed", log=logs_streamed.append)
    q = "quantized/v2--w8a8-tensor"
    _same_checkpoint(tmp_path / "whole" / q, tmp_path / "streamed" / q)
    sqnr = [line for line in logs_streamed if "logits SQNR" in line]
    assert sqnr and sqnr == [
        line.replace("whole", "streamed") for line in logs_whole if "logits SQNR" in line
    ]
    assert not math.isnan(float(sqnr[0].split("SQNR ")[1].split(" dB")[0]))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 12-layer checkpoint: stage names layers.1 and layers.11 both exist, so a prefix match that took one
    for the other would show (byte vocabulary, so the default text and tokenizer apply)."""
    model = tiny_model("baseline", n_layers=12, vocab_size=259)
    return str(save_checkpoint(model, tmp_path_factory.mktemp("deep") / "deep12"))


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_second_quantize_into_the_same_new_out_is_refused(setup, deep, tmp_path, monkeypatch, streamed):
    """Two quantize runs into one new --out: the second, started while the first runs, is refused at once
    (one line naming the folder in use); the first writes its checkpoint. Before, the streamed quantize let
    both run and the later rename replaced the earlier checkpoint (both said "wrote")."""
    out = tmp_path / "q"
    options = _options(setup)
    run = quantize_streamed if streamed else quantize_checkpoint
    module = stream_quantize if streamed else whole_quantize
    hook = "write_config" if streamed else "split_windows"
    real, second = getattr(module, hook), []

    def during_first(*args, **kwargs):
        if not second:  # the first run is under way: start the second into the same folder
            second.append(None)
            with pytest.raises(DiffquantError) as err:
                run(deep, "w8a8", out=out, **options)
            second[0] = str(err.value)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, hook, during_first)
    summary = run(deep, "w8a8", out=out, **options)
    assert second[0] is not None and "\n" not in second[0]
    assert f"{out} is in use by another run (pid {os.getpid()})" in second[0]
    assert f"wrote {out}" in summary["text"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no temporary sibling left
    assert not (out / ".diffquant-run.lock").exists()  # the checkpoint holds no claim files
    model = load_model(out)  # the first run's checkpoint, complete
    assert model.config.n_layers == 12 and model.quant_plan is not None
    with pytest.raises(DiffquantError, match="already exists"):  # afterwards: refused as before
        run(deep, "w8a8", out=out, **options)
