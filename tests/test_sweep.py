"""Sweeps: cells, deltas, resume after SIGKILL, torchrun; recipes: strict schema, every shipped recipe runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.eval.sweep import SweepSpec, read_cells, run_sweep
from diffquant.eval.tasks import parse_task
from diffquant.recipes import apply_override, load_recipe, validate

# run recipes (`diffquant run`); the zoo-*.yaml / train-*.yaml training recipes are tested in test_train.py
RECIPES = sorted(
    p
    for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml")
    if "models" in yaml.safe_load(p.read_text())
)


@pytest.fixture()
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}  # comment {i * i}\n" for i in range(400)))
    return str(path)


def _spec(text, plans=("attn-logits-int8",), models=("baseline", "diff_v2")):
    return SweepSpec(
        models={m: f"init:{m}:tiny" for m in models},
        plans=list(plans),
        tasks=[parse_task(f"bpb:data={text},tokens=512,seq_len=64")],
        calib_data=text,
        calib_tokens=256,
        calib_seq_len=64,
    )


def test_sweep_cells_and_deltas(tmp_path, text):
    spec = _spec(text, plans=("attn-logits-int8", "attn-logits-int4"))
    results = run_sweep(spec, tmp_path / "s")
    assert results["complete"] and len(read_cells(tmp_path / "s")) == 6
    rows = {(r["model"], r["plan"], r["metric"]): r for r in results["rows"]}
    for model in ("baseline", "diff_v2"):
        none = rows[(model, "none", "bits_per_byte")]
        assert none["delta"] == 0.0 and none["value"] == none["unquantized"]
        q = rows[(model, "attn-logits-int4", "bits_per_byte")]
        assert q["delta"] == pytest.approx(q["value"] - none["value"])
        assert q["delta"] != 0
    csv_lines = (tmp_path / "s" / "results.csv").read_text().splitlines()
    assert csv_lines[0] == "model,attention,plan,task,metric,value,unquantized,delta"


def test_changed_spec_is_refused(tmp_path, text):
    run_sweep(_spec(text, plans=()), tmp_path / "s")
    with pytest.raises(DiffquantError, match="holds a different sweep"):
        run_sweep(_spec(text, plans=("attn-logits-int4",)), tmp_path / "s")


def test_task_parsing_errors():
    with pytest.raises(DiffquantError, match="unknown key 'tokns' for task type bpb; allowed keys"):
        parse_task("bpb:tokns=5")
    with pytest.raises(DiffquantError, match="valid task types: bpb, ppl, retrieval, mc"):
        parse_task("hellaswag")
    with pytest.raises(DiffquantError, match="task type mc needs 'path'"):
        parse_task("mc")


def _eval_cmd(text, out):
    cmd = [sys.executable, "-m", "diffquant.cli", "eval", "init:baseline:tiny", "init:diff_v1:tiny"]
    cmd += ["--task", f"bpb:data={text},tokens=1024,seq_len=64", "--calib-data", text]
    cmd += ["--plan", "attn-logits-int8", "attn-logits-int6", "attn-logits-int4", "--out", str(out)]
    return cmd


@pytest.mark.slow
def test_killed_sweep_resumes_without_recomputing(tmp_path, text):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _eval_cmd(text, killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    cells = killed / "cells-rank0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if cells.exists() and cells.read_text().count("\n") >= 1:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    done_before = read_cells(killed)
    assert 1 <= len(done_before) < 8 and not (killed / "results.csv").exists()
    resumed = subprocess.run(_eval_cmd(text, killed), capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(done_before)} already done" in resumed.stderr
    lines = cells.read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 8  # every cell once: none recomputed
    for key, record in done_before.items():  # finished cells kept as they were
        assert read_cells(killed)[key] == record
    fresh = subprocess.run(_eval_cmd(text, tmp_path / "fresh"), capture_output=True, text=True, env=env)
    assert fresh.returncode == 0, fresh.stderr
    assert (killed / "results.csv").read_bytes() == (tmp_path / "fresh" / "results.csv").read_bytes()
    assert (killed / "results.json").read_bytes() == (tmp_path / "fresh" / "results.json").read_bytes()


@pytest.mark.slow
def test_torchrun_spreads_cells_over_ranks(tmp_path, text):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    cmd += _eval_cmd(text, tmp_path / "two")[2:]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "two" / "cells-rank1.jsonl").exists()
    single = subprocess.run(_eval_cmd(text, tmp_path / "one"), capture_output=True, text=True, env=env)
    assert single.returncode == 0
    assert (tmp_path / "two" / "results.csv").read_bytes() == (tmp_path / "one" / "results.csv").read_bytes()


# ---------------------------------------------------------------------------------------- recipes
def _tiny(raw: dict, text: str) -> dict:
    """The recipe with tiny random models and small budgets, everything else as shipped."""
    raw = json.loads(json.dumps(raw))
    kinds = ("baseline", "diff_v1", "diff_v2")  # zoo:KIND keeps its kind; real checkpoints are Llamas
    raw["models"] = {
        name: f"init:{spec.split(':')[1] if spec.split(':')[1] in kinds else 'baseline'}:tiny"
        for name, spec in raw["models"].items()
    }
    raw.setdefault("data", {})["calib"] = {"source": text, "tokens": 128, "seq_len": 64}
    if "profile" in raw:
        raw["profile"].update(data=text, tokens=256, seq_len=64)
    for task in raw.get("eval", {}).get("tasks", []):
        if task.get("type", "bpb") in ("bpb", "ppl"):
            task.update(data=text, tokens=256, seq_len=64)
        elif task["type"] == "retrieval":
            task.update(samples_per_depth=1, context_bytes=96, depths=[0, 100])
    return raw


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipe_validates_and_runs(tmp_path, text, recipe, capsys):
    load_recipe(recipe)  # as shipped
    small = tmp_path / recipe.name
    small.write_text(yaml.safe_dump(_tiny(yaml.safe_load(recipe.read_text()), text)))
    assert main(["run", str(small), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == yaml.safe_load(recipe.read_text())["name"]
    assert set(manifest["corpora"]) >= {text}
    if "profile" in yaml.safe_load(recipe.read_text()):
        assert "attention logits" in out and (tmp_path / "run" / "table5.json").exists()
    if "sweep" in yaml.safe_load(recipe.read_text()):
        assert json.loads((tmp_path / "run" / "sweep" / "results.json").read_text())["complete"]


def test_misspelled_key_names_its_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: {a: 'init:baseline:tiny'}\nprofile:\n  tokns: 5\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'profile.tokns'; allowed keys under profile: enabled, data, tokens" in err
    assert err.count("\n") == 1


def test_bad_values_and_overrides():
    with pytest.raises(DiffquantError, match="missing required key 'models'"):
        validate({"name": "x"})
    with pytest.raises(DiffquantError, match="profile.tokens: expected int, got 'many'"):
        validate({"name": "x", "models": {"a": "p"}, "profile": {"tokens": "many"}})
    with pytest.raises(DiffquantError, match=r"eval.tasks\[0\]: unknown key 'tokenz'"):
        validate({"name": "x", "models": {"a": "p"}, "eval": {"tasks": [{"type": "bpb", "tokenz": 1}]}})
    raw = {"name": "x", "models": {"a": "p"}, "eval": {"tasks": [{"type": "bpb", "tokens": 5}]}}
    assert apply_override(raw, "eval.tasks[0].tokens=7")["eval"]["tasks"][0]["tokens"] == 7
    assert apply_override(raw, "models.b=init:baseline:tiny")["models"]["b"] == "init:baseline:tiny"
    with pytest.raises(DiffquantError, match="does not exist"):
        apply_override(raw, "eval.tasks[3].tokens=7")


def test_eval_cli_multiple_choice_and_retrieval(tmp_path, capsys):
    items = tmp_path / "mc.jsonl"
    rows = [
        {"ctx": f"Question {i}: two plus {i} is", "endings": [str(2 + i), "blue", "seven"], "label": 0}
        for i in range(6)
    ]
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "init:diff_v1:tiny", "--task", f"mc:path={items}", "--out", str(tmp_path / "e")]
    args += ["--task", "retrieval:samples_per_depth=1,context_bytes=96,depths=[0]"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mc: acc_norm" in out and "retrieval: acc_rank" in out
    results = json.loads((tmp_path / "e" / "results.json").read_text())
    metrics = {(r["task"], r["metric"]) for r in results["rows"]}
    assert {
        ("mc", "acc"),
        ("mc", "acc_norm"),
        ("retrieval", "acc_greedy"),
        ("retrieval", "answer_mass"),
    } <= metrics
