"""--stream on the command line and the recipe key ``stream``: a streamed profile / eval writes what the
whole-model run writes (profiles equal, bits per byte equal); specifiers that cannot stream are refused
with one line; ``info`` says the weight bytes and whether ``--stream auto`` would stream."""

import json

import pytest

from diffquant.cli import main
from diffquant.io import load_model, save_checkpoint
from diffquant.recipes import run_recipe, validate

KINDS = ("baseline", "diff_v1", "diff_v2")
PROFILE = ["--tokens", "256", "--seq-len", "32", "--batch-size", "3", "--topk", "8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamcli")
    return {k: save_checkpoint(load_model(f"init:{k}:tiny"), root / k) for k in KINDS}


def _profiles(out):
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "profile").glob("*.json"))}


def test_profile_stream_on_equals_whole_model(folders, tmp_path, capsys):
    specs = [str(folders[k]) for k in KINDS]
    assert main(["profile", *specs, *PROFILE, "--out", str(tmp_path / "whole")]) == 0
    whole_out = capsys.readouterr().out
    assert main(["profile", *specs, *PROFILE, "--out", str(tmp_path / "streamed"), "--stream", "on"]) == 0
    captured = capsys.readouterr()
    whole, streamed = _profiles(tmp_path / "whole"), _profiles(tmp_path / "streamed")
    assert set(whole) == set(KINDS)
    assert whole == streamed  # the same statistics, meta (attention paths too) and order
    # the same Table 5 print; the attention maps need the whole model: skipped, one line per model
    assert captured.out.replace("streamed", "whole") == whole_out
    notes = [line for line in captured.err.splitlines() if "attention maps not captured" in line]
    assert len(notes) == 3
    assert not list((tmp_path / "streamed" / "profile").glob("*.maps.safetensors"))
    assert len(list((tmp_path / "whole" / "profile").glob("*.maps.safetensors"))) == 3
    manifest = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    assert manifest["streamed"] == list(KINDS)


def test_profile_stream_auto_keeps_models_that_fit_whole(folders, tmp_path, capsys):
    spec = str(folders["diff_v1"])
    out = tmp_path / "auto"
    assert main(["profile", spec, "init:baseline:tiny", *PROFILE, "--out", str(out), "--stream", "auto"]) == 0
    err = capsys.readouterr().err
    assert "stream" not in err  # nothing streamed, nothing said
    assert len(list((out / "profile").glob("*.maps.safetensors"))) == 2


def test_eval_bpb_stream_on_equals_whole_model(folders, tmp_path, capsys):
    specs = [str(folders[k]) for k in KINDS]
    task = ["--task", "bpb:tokens=600,seq_len=48", "--batch-size", "3"]
    plans = ["--plan", "w8a8", "attn-logits-int4"]
    assert main(["eval", *specs, *task, *plans, "--out", str(tmp_path / "whole")]) == 0
    assert main(["eval", *specs, *task, *plans, "--out", str(tmp_path / "streamed"), "--stream", "on"]) == 0
    capsys.readouterr()
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert whole == streamed
    assert "bits_per_byte" in json.dumps(streamed)


def test_eval_stream_on_refuses_tasks_that_need_the_whole_model(folders, tmp_path, capsys):
    code = main(
        ["eval", str(folders["baseline"]), "--task", "retrieval:samples_per_depth=1", "--stream", "on"]
        + ["--out", str(tmp_path / "r")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "retrieval needs the whole model" in err[0]


@pytest.mark.parametrize("command", ["profile", "eval"])
def test_stream_on_refuses_what_cannot_stream(tmp_path, capsys, command):
    extra = ["--task", "bpb:tokens=200,seq_len=32"] if command == "eval" else PROFILE
    code = main([command, "init:baseline:tiny", *extra, "--stream", "on", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1
    assert "stream on: init:baseline:tiny: a streamed run reads safetensors checkpoints" in err[0]
    assert not (tmp_path / "x" / "profile").exists()


def test_info_shows_weight_bytes_and_stream(folders, capsys):
    spec = str(folders["diff_v2"])
    assert main(["info", spec]) == 0
    out = capsys.readouterr().out
    size = (folders["diff_v2"] / "model.safetensors").stat().st_size
    line = next(x for x in out.splitlines() if x.startswith("weights"))
    bytes_ = int(line.split()[1].replace(",", ""))
    assert 0 < bytes_ <= size  # the tensors, without the safetensors header
    assert "--stream auto on cpu: whole (weights" in out
    assert main(["info", spec, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["weights_bytes"] == bytes_
    assert info["stream"]["would_stream"] is False
    assert info["stream"]["device"] == "cpu" and "fit the budget" in info["stream"]["reason"]


@pytest.mark.parametrize("value", [True, "on"])
def test_recipe_stream_key_profiles_streamed(folders, tmp_path, capsys, value):
    def recipe(stream):
        raw = {
            "name": "stream-test",
            "models": {k: str(folders[k]) for k in ("baseline", "diff_v2")},
            "profile": {"tokens": 256, "seq_len": 32, "batch_size": 3, "topk": 8},
            "plots": {"enabled": False},
        }
        if stream is not None:
            raw["stream"] = stream
        return validate(raw)

    logs: list[str] = []
    run_recipe(recipe(None), tmp_path / "whole", log=logs.append)
    run_recipe(recipe(value), tmp_path / "streamed", log=logs.append)
    err = capsys.readouterr().err
    assert _profiles(tmp_path / "whole") == _profiles(tmp_path / "streamed")
    assert err.count("attention maps not captured") == 2
    assert not list((tmp_path / "streamed" / "profile").glob("*.maps.safetensors"))


def test_recipe_stream_key_is_checked():
    with pytest.raises(Exception, match="stream"):
        validate({"name": "x", "models": {"a": "init:baseline:tiny"}, "stream": "sometimes"})


def test_streamed_runs_draw_figures_without_the_maps(folders, tmp_path, capsys):
    """A streamed profile has no attention maps: plots and the report skip that figure (the manifest names
    the streamed models) instead of failing; a recipe with plots on finishes."""
    from diffquant.plots import render_run

    specs = [str(folders[k]) for k in KINDS]
    out = tmp_path / "cli"
    assert main(["profile", *specs, *PROFILE, "--out", str(out), "--stream", "on"]) == 0
    families = {r.kind for r in render_run(out, dpi=60)}
    assert "hist" in families and "maps" not in families
    assert main(["report", str(out)]) == 0
    raw = {
        "name": "stream-plots",
        "models": {k: str(folders[k]) for k in ("baseline", "diff_v2")},
        "profile": {"tokens": 256, "seq_len": 32, "batch_size": 3, "topk": 8},
        "stream": "on",
    }
    run_recipe(validate(raw), tmp_path / "recipe", log=lambda line: None)
    manifest = json.loads((tmp_path / "recipe" / "manifest.json").read_text())
    assert manifest["streamed"] == ["baseline", "diff_v2"] and manifest["status"] == "complete"
    assert (tmp_path / "recipe" / "report.html").is_file()
    assert not list((tmp_path / "recipe" / "figures").glob("maps-*"))
