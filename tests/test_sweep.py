"""Sweeps: cells, deltas, resume after SIGKILL, torchrun; recipes: strict schema, every shipped recipe runs."""

import json
import os
import random
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
from diffquant.models.config import ATTENTION_KINDS
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
def _heads_of_64(kind: str, folder: Path) -> str:
    """A tiny random model of ``kind`` with heads of 64 saved as a native checkpoint (KV groups of 64)."""
    import dataclasses

    from diffquant.io import load_model
    from diffquant.io.checkpoint import save_checkpoint
    from diffquant.models.transformer import DecoderLM

    path = folder / f"{kind}-heads64"
    if not path.exists():
        config = dataclasses.replace(load_model(f"init:{kind}:tiny").config, head_dim=64)
        save_checkpoint(DecoderLM(config).eval(), path)
    return str(path)


def _zoo_kind(spec: str) -> str:
    """zoo:diff_v2-s1 -> diff_v2, by the zoo's seed naming (other specifiers: the word after the scheme,
    which is no kind)."""
    from diffquant.report.seeds import SEED_NAME

    word = spec.split(":")[1]
    match = SEED_NAME.match(word)
    return match.group("group") if match else word


def _tiny(raw: dict, text: str, folder: Path) -> dict:
    """The recipe with tiny random models and small budgets, everything else as shipped."""
    from diffquant.quant.presets import PRESETS, preset_data
    from diffquant.report.seeds import seed_groups

    raw = json.loads(json.dumps(raw))
    kinds = ATTENTION_KINDS  # zoo:KIND(-sK) keeps its kind; real checkpoints are Llamas
    groups = seed_groups(raw["models"], raw.get("seeds"))
    if len(raw["models"]) > 8 and groups:  # the rivals study's 15: every kind once, one group with two seeds
        keep = {m for i, members in enumerate(groups.values()) for m in members[: 2 if i == 0 else 1]}
        raw["models"] = {name: spec for name, spec in raw["models"].items() if name in keep}
    # weights in groups of 128 need Linears at least 128 wide: the small preset (d 256), not tiny (d 96)
    # and KV caches in groups of 32 heads a multiple of 32 wide: small's heads of 32, not tiny's 24; groups
    # of 64 (kv4-compact) heads of 64: tiny models with head_dim 64, saved as checkpoints
    plans = raw.get("sweep", {}).get("plans", [])
    wide = any("g128" in p or (p.startswith("kv") and "-g8" not in p) for p in plans)
    kv_groups = [(preset_data(p).get("kv_cache") or {}).get("group", 0) for p in plans if p in PRESETS]
    size = "small" if wide else "tiny"
    raw["models"] = {
        name: f"init:{_zoo_kind(spec) if _zoo_kind(spec) in kinds else 'baseline'}:{size}"
        for name, spec in raw["models"].items()
    }
    if max(kv_groups, default=0) > 32:
        raw["models"] = {
            name: _heads_of_64(spec.split(":")[1], folder) for name, spec in raw["models"].items()
        }
    raw.setdefault("data", {})["calib"] = {"source": text, "tokens": 128, "seq_len": 64}
    if "profile" in raw:
        raw["profile"].update(data=text, tokens=256, seq_len=64)
    for task in raw.get("eval", {}).get("tasks", []):
        if task.get("type", "bpb") in ("bpb", "ppl"):
            task.update(data=text, tokens=256, seq_len=64)
            if task.get("decode") is not None:  # windows longer than the plans' 128-token full-precision
                task.update(decode=8, seq_len=160)  # window: a shorter one would quantize nothing (refused)
        elif task["type"] == "retrieval":
            task.update(samples_per_depth=1, context_bytes=96, depths=[0, 100])
    return raw


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipe_validates_and_runs(tmp_path, text, recipe, capsys):
    load_recipe(recipe)  # as shipped
    small = tmp_path / recipe.name
    small.write_text(yaml.safe_dump(_tiny(yaml.safe_load(recipe.read_text()), text, tmp_path)))
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


# ------------------------------------------------------------------ resume: torn lines, stale cells
def _one_model_spec(text, model="init:baseline:tiny", plans=(), tasks=None):
    return SweepSpec(
        models={"m": model},
        plans=list(plans),
        tasks=tasks or [parse_task(f"bpb:data={text},tokens=256,seq_len=64")],
        calib_data=text,
        calib_tokens=128,
        calib_seq_len=64,
    )


def test_torn_last_line_is_recomputed_and_said(tmp_path, text):
    """A full disk cut the last cell record short: the resume recomputes that cell (saying so), the new
    record starts on its own line, and no missing cell is ever reported as done."""
    out = tmp_path / "s"
    spec = _one_model_spec(text, plans=("attn-logits-int8",))
    whole = run_sweep(spec, out)
    cells = out / "cells-rank0.jsonl"
    data = cells.read_bytes()
    assert data.count(b"\n") == 2
    cells.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1 + 40])  # the 2nd line, cut at 40 bytes
    said: list[str] = []
    results = run_sweep(spec, out, log=said.append)
    assert f"{cells}:2: incomplete last line" in "\n".join(said)
    assert "1 already done, 1 to run" in "\n".join(said)
    assert results["complete"] and results["rows"] == whole["rows"]
    lines = cells.read_text().split("\n")
    assert lines[-1] == "" and [json.loads(line)["plan"] for line in lines[:-1]] == [
        "none",
        "attn-logits-int8",
    ]


def test_damaged_record_and_sweep_json_are_one_line_errors(tmp_path, text):
    out = tmp_path / "s"
    spec = _one_model_spec(text, plans=("attn-logits-int8",))
    run_sweep(spec, out)
    cells = out / "cells-rank0.jsonl"
    good = cells.read_text()
    cells.write_text("{not json\n" + good)  # not the last line: damage, not an interrupted write
    with pytest.raises(DiffquantError, match=r"cells-rank0.jsonl:1: damaged cell record") as err:
        run_sweep(spec, out)
    assert "\n" not in str(err.value)
    cells.write_text(good)
    (out / "sweep.json").write_text('{"fingerprint": "ab')
    with pytest.raises(DiffquantError, match=r"sweep.json: not valid JSON") as err:
        run_sweep(spec, out)
    assert "\n" not in str(err.value)


def test_replaced_checkpoint_is_recomputed_plain_resume_is_not(tmp_path, text):
    """`diffquant init --force` with another seed at the same path: the cell is keyed by the weights, so
    the resume recomputes it (and only it); a plain resume of the same inputs recomputes nothing."""
    from diffquant.io import init_model, save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(init_model("init:baseline:tiny:0"), ckpt)
    spec = _one_model_spec(text, model=str(ckpt))
    out = tmp_path / "s"
    first = run_sweep(spec, out)["rows"][0]["value"]
    save_checkpoint(init_model("init:baseline:tiny:1"), ckpt, overwrite=True)
    said: list[str] = []
    second = run_sweep(spec, out, log=said.append)["rows"][0]["value"]
    assert "0 already done, 1 to run" in "\n".join(said) and "model m changed" in "\n".join(said)
    assert second != first
    fresh = run_sweep(spec, tmp_path / "fresh")["rows"][0]["value"]
    assert second == fresh
    said.clear()
    lines = (out / "cells-rank0.jsonl").read_text()
    assert run_sweep(spec, out, log=said.append)["rows"][0]["value"] == second
    assert "1 already done, 0 to run" in "\n".join(said)
    assert (out / "cells-rank0.jsonl").read_text() == lines


def test_changed_plan_file_recomputes_its_cells_only(tmp_path, text):
    from diffquant.quant.plan import preset

    plan = tmp_path / "plan.yaml"
    data = {"name": "mine", **{k: v for k, v in preset("attn-logits-int8").to_dict().items() if k != "name"}}
    plan.write_text(yaml.safe_dump(data))
    spec = _one_model_spec(text, plans=(str(plan),))
    out = tmp_path / "s"
    run_sweep(spec, out)
    data["rules"][0]["scheme"]["format"] = "int4"
    plan.write_text(yaml.safe_dump(data))
    said: list[str] = []
    results = run_sweep(spec, out, log=said.append)
    assert "1 already done, 1 to run" in "\n".join(said) and f"plan {plan} changed" in "\n".join(said)
    assert results["rows"] == run_sweep(spec, tmp_path / "fresh")["rows"]


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_sweep_killed_at_random_points_resumes_byte_identical(tmp_path, text):
    """Acceptance: `diffquant eval` SIGKILLed at random points (mid-cell, mid-append, before any cell), and
    once with its last cell line cut by hand, resumes to results byte-identical to an uninterrupted run,
    with every cell recorded exactly once."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh = subprocess.run(_eval_cmd(text, tmp_path / "fresh"), capture_output=True, text=True, env=env)
    assert fresh.returncode == 0, fresh.stderr
    out = tmp_path / "killed"
    cells = out / "cells-rank0.jsonl"
    total = _lines(tmp_path / "fresh" / "cells-rank0.jsonl")
    assert total == 8

    def kill_at_random(low: int = 0) -> None:
        proc = subprocess.Popen(
            _eval_cmd(text, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        target = rng.randint(min(max(low, _lines(cells)), total - 1), total - 1)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and _lines(cells) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.2))  # somewhere inside the next cell (or its append)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode in (0, -signal.SIGKILL), f"seed {seed}: {err.decode()[-2000:]}"

    for low in (0, 0, 0, 1):  # the last kill after at least one finished cell
        kill_at_random(low)
    data = cells.read_bytes()
    data = data[: data.rfind(b"\n") + 1]  # a kill tore the last line already? cut before it by hand
    assert data, f"seed {seed}: no cell finished"
    last = data.rfind(b"\n", 0, len(data) - 1) + 1
    cells.write_bytes(data[: last + rng.randint(1, len(data) - last - 2)])  # the last record, cut short
    resumed = subprocess.run(_eval_cmd(text, out), capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    for name in ("results.csv", "results.json"):
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), f"seed {seed}: {name}"
    n = data.count(b"\n")
    assert f"{cells}:{n}: incomplete last line" in resumed.stderr, f"seed {seed}: {resumed.stderr}"
    assert f"8 cells, {n - 1} already done, {9 - n} to run" in resumed.stderr, f"seed {seed}"
    lines = cells.read_text().split("\n")
    assert lines[-1] == "", f"seed {seed}"
    keys = [json.loads(line)["key"] for line in lines[:-1]]
    assert len(keys) == len(set(keys)) == 8, f"seed {seed}: {keys}"
    again = subprocess.run(_eval_cmd(text, out), capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "8 already done, 0 to run" in again.stderr


def test_resumed_sweep_recomputes_cells_of_a_changed_tokenizer_override(tmp_path, text):
    """A tokenizer override file's special tokens live in the tokenizer_config.json beside it: changing that
    file (or the tokenizer.json) changes the numbers, so a resumed sweep must not reuse the old cells."""
    from conftest import tiny_model, train_byte_bpe

    from diffquant.io import save_checkpoint

    folder = save_checkpoint(tiny_model("baseline", vocab_size=320), tmp_path / "m")
    tok = train_byte_bpe(tmp_path / "tok", [f"def f{i}(x): return x + {i}" for i in range(50)])

    def sweep(log):
        spec = SweepSpec(
            models={"m": str(folder)},
            plans=[],
            tasks=[parse_task(f"bpb:data={text},tokens=256,seq_len=32")],
            tokenizers={"m": str(tok)},
        )
        return run_sweep(spec, tmp_path / "s", log=log)

    said: list[str] = []
    first = sweep(said.append)["rows"][0]["value"]
    said.clear()
    assert sweep(said.append)["rows"][0]["value"] == first
    assert "1 cells, 1 already done, 0 to run" in "\n".join(said)  # a plain resume reuses the cell
    config = tok.parent / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "add_bos_token": True}))
    said.clear()
    changed = sweep(said.append)["rows"][0]["value"]
    assert "1 cells, 0 already done, 1 to run" in "\n".join(said)
    assert changed != first  # BOS in front of every document: other numbers, not the old cell's


# ------------------------------------------------------------------ one load per model, reused over cells
def test_sweep_loads_each_model_once_and_matches_per_cell_loading(tmp_path, text, monkeypatch):
    """A 2-model x 3-plan x 2-task sweep (12 cells; a plan that rewrites weights in place: rotation,
    smoothing, static scales) loads each model once, and writes the same results bytes as a sweep that
    loads the model for every cell (sweep.REUSE_LOADED off); the kept model is dropped once the next
    model's cells start, and each cell's copy before the next cell's."""
    import gc
    import weakref

    from diffquant.eval import sweep

    plans = ("w4a8-quarot-smooth", "attn-logits-int8")
    tasks = [
        parse_task(f"bpb:data={text},tokens=256,seq_len=64"),
        parse_task("retrieval:samples_per_depth=1,context_bytes=96,depths=[0]"),
    ]
    spec = SweepSpec(
        models={"b": "init:baseline:tiny", "d": "init:diff_v2:tiny"},
        plans=list(plans),
        tasks=tasks,
        calib_data=text,
        calib_tokens=128,
        calib_seq_len=64,
    )
    real = sweep.load_for_sweep
    loads: list[str] = []
    alive: list[weakref.ref] = []  # every model a load or a cell made, to count those still held

    def counting(s, name):
        loads.append(name)
        model = real(s, name)
        alive.append(weakref.ref(model))
        return model

    real_fresh = sweep._Runner._fresh
    held = []

    def fresh(self, name):
        gc.collect()
        held.append(sum(r() is not None for r in alive))  # models alive as a cell asks for its own
        made = real_fresh(self, name)
        alive.append(weakref.ref(made))
        return made

    monkeypatch.setattr(sweep, "load_for_sweep", counting)
    monkeypatch.setattr(sweep._Runner, "_fresh", fresh)
    results = run_sweep(spec, tmp_path / "reuse")
    assert loads == ["b", "d"]
    assert held and max(held) == 1  # the kept model only: no earlier cell's copy, no earlier model
    assert results["complete"] and len(read_cells(tmp_path / "reuse")) == 12

    loads.clear()
    monkeypatch.setattr(sweep, "REUSE_LOADED", False)
    run_sweep(spec, tmp_path / "reload")
    assert len(loads) == 12
    for name in ("results.json", "results.csv"):
        assert (tmp_path / "reuse" / name).read_bytes() == (tmp_path / "reload" / name).read_bytes(), name
    strip = ("seconds",)
    cells = {
        k: {f: v for f, v in r.items() if f not in strip} for k, r in read_cells(tmp_path / "reuse").items()
    }
    again = {
        k: {f: v for f, v in r.items() if f not in strip} for k, r in read_cells(tmp_path / "reload").items()
    }
    assert cells == again


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DIFFQUANT_LONG_TESTS") != "1",
    reason="100 s on 2 cores (13 SmolLM2 loads in the per-cell arm); DIFFQUANT_LONG_TESTS=1 runs it",
)
def test_shipped_smollm2_recipe_loads_the_model_once_and_matches_per_cell_loading(tmp_path, monkeypatch):
    """The shipped 13-cell SmolLM2 recipe (the unquantized cell and its 12 plans) loads SmolLM2 once, counted
    by a counting loader, and its results are the bytes of a sweep that loads the model for every cell.
    Only the amounts of text shrink (calibration and scoring tokens) to keep the test cheap; the model, the
    plans (calibrated, static, dynamic, bitsandbytes backend) and the task type are the recipe's own."""
    from diffquant.eval import sweep
    from diffquant.recipes import recipe_sweep_spec

    recipe = load_recipe("smollm2")
    recipe["eval"]["tasks"] = [dict(recipe["eval"]["tasks"][0], tokens=128, seq_len=64)]
    recipe["data"]["calib"] = dict(recipe["data"]["calib"], tokens=128, seq_len=64)
    spec = recipe_sweep_spec(recipe)
    assert len(spec.models) * len(spec.plans) * len(spec.tasks) == 13
    real = sweep.load_for_sweep
    loads: list[str] = []
    monkeypatch.setattr(sweep, "load_for_sweep", lambda s, name: loads.append(name) or real(s, name))
    run_sweep(spec, tmp_path / "reuse")
    assert loads == ["smollm2"]
    loads.clear()
    monkeypatch.setattr(sweep, "REUSE_LOADED", False)
    run_sweep(spec, tmp_path / "reload")
    assert loads == ["smollm2"] * 13
    for name in ("results.json", "results.csv"):
        assert (tmp_path / "reuse" / name).read_bytes() == (tmp_path / "reload" / name).read_bytes(), name
