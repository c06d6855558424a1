"""Hostile but realistic input: each defect of the hardening audit (issue 13) as a regression test.

Every user error is one line on stderr and exit code 2, never a traceback, and nothing is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.io import load_model, save_checkpoint


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture()
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny"
    assert main(["init", "--kind", "baseline", "--preset", "tiny", str(path)]) == 0
    return path


@pytest.fixture()
def text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("Differential attention cancels common-mode noise. " * 40)
    return path


# ----------------------------------------------------------------------------- 2. YAML alias bombs
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)


@pytest.mark.parametrize("what", ["recipe", "plan"])
def test_yaml_alias_bombs_are_refused_in_one_line(tmp_path, capsys, tiny, what):
    path = tmp_path / f"{what}.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 600
    if what == "recipe":
        argv = ["run", str(path), "--out", str(tmp_path / "run")]
    else:
        argv = ["quantize", str(tiny), "--plan", str(path), "--out", str(tmp_path / "run")]
    start = time.process_time()  # this process's CPU time: a busy machine stretches wall time, not this
    code, _, err = _run_cli(argv, capsys)
    assert code == 2 and "aliases" in _one_line(err) and str(path) in err
    assert time.process_time() - start < 5 and not (tmp_path / "run").exists()


def test_duplicate_yaml_keys_are_errors(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("name: a\nmodels: {m: zoo:baseline}\nseed: 1\nseed: 2\n")
    code, _, err = _run_cli(["run", str(path), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "duplicate key 'seed' (first on line 3)" in _one_line(err)
    code, _, err = _run_cli(["run", str(path), "--set", "x={a: 1, a: 2}"], capsys)
    assert code == 2 and "duplicate key" in _one_line(err)


def _tiny_hf_llama(tmp_path: Path) -> Path:
    """A tiny random HF Llama folder (analysis/convert/make_tiny_hf.py), for damaging in a test."""
    pytest.importorskip("transformers")
    subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "analysis/convert/make_tiny_hf.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    return tmp_path / "tiny-llama"


# ------------------------------------------------------------------------------- 5. unbounded configs
def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    meta = json.loads(path.read_text())
    meta["config"].update(changes)
    path.write_text(json.dumps(meta))


def test_huge_layer_count_is_refused_before_anything_is_built(tiny, capsys):
    _edit_config(tiny, n_layers=10**9)
    start = time.process_time()  # CPU time, not wall time: independent of how busy the machine is
    code, _, err = _run_cli(["info", str(tiny)], capsys)
    assert code == 2 and "says 1000000000 layers, the weights hold layers 0..1" in _one_line(err)
    assert time.process_time() - start < 5


def test_huge_hf_layer_count_is_refused(tmp_path, capsys):
    folder = _tiny_hf_llama(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**9
    (folder / "config.json").write_text(json.dumps(cfg))
    start = time.process_time()  # CPU time, not wall time: independent of how busy the machine is
    code, _, err = _run_cli(["info", f"hf:{folder}"], capsys)
    assert code == 2 and "says 1000000000 layers" in _one_line(err) and time.process_time() - start < 5


# ------------------------------------------------------------------------------------------ 6. NaN / Inf
@pytest.fixture()
def broken(tmp_path) -> Path:
    model = load_model("init:baseline:tiny")
    with torch.no_grad():
        model.layers[1].mlp.up.weight[3, 5] = float("nan")
        model.layers[0].mlp.down.weight[1, 2] = float("inf")
    return save_checkpoint(model, tmp_path / "broken")


def test_profile_of_a_nan_model_counts_and_locates_the_non_finite(broken, text, tmp_path, capsys):
    out = tmp_path / "prof"
    code, stdout, err = _run_cli(
        [
            "profile",
            str(broken),
            "--data",
            str(text),
            "--tokens",
            "256",
            "--seq-len",
            "64",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    assert "NON-FINITE hidden states in broken:" in stdout and "first nan at layer 1, position 0" in stdout
    profile = json.loads((out / "profile" / "broken.json").read_text())  # valid JSON: no NaN literals
    site = profile["sites"]["layers.1.resid"]
    assert site["nan_count"] > 0 and site["first_nonfinite"]["loc"]["layer"] == 1
    assert profile["sites"]["layers.0.resid"]["nan_count"] == 0
    probs = profile["attention"]["layers.1.attn.probs"]
    assert sum(probs["nonfinite_rows"]) > 0
    table = json.loads((out / "table5.json").read_text())
    assert table["models"]["broken"]["table5"]["hidden states"]["nonfinite"]["nan"] > 0
    assert main(["report", str(out)]) == 0
    assert "NaN" in (out / "report.md").read_text()


# ------------------------------------------------------------------------- 7. types that mean the opposite
def test_profile_false_is_an_error_not_defaults(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("name: a\nmodels: {m: zoo:baseline}\nprofile: false\n")
    code, _, err = _run_cli(["run", str(path), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "profile: expected a mapping, got False" in _one_line(err)
    assert "{enabled: false}" in err and not (tmp_path / "run").exists()


def test_missing_config_fields_are_errors(tiny, capsys):
    meta = json.loads((tiny / "config.json").read_text())
    del meta["config"]["ffn_dim"]
    (tiny / "config.json").write_text(json.dumps(meta))
    code, _, err = _run_cli(["info", str(tiny)], capsys)
    assert code == 2 and "missing key(s) ffn_dim" in _one_line(err)


# ------------------------------------------------------------------------------ 10. partial output
def test_recipe_values_are_checked_before_the_first_write(tmp_path, capsys, text):
    cases = {
        "seq_len": {"profile": {"seq_len": 4096, "data": str(text)}},
        "data": {"profile": {"data": str(tmp_path / "missing.txt")}},
        "model": {"models": {"m": str(tmp_path / "missing-model")}},
        "task": {"eval": {"tasks": [{"type": "ppl", "data": str(text), "seq_len": 9999}]}},
    }
    for name, change in cases.items():
        recipe = {"name": name, "models": {"m": "zoo:baseline"}, **change}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        out = tmp_path / f"run-{name}"
        code, _, err = _run_cli(["run", str(path), "--out", str(out)], capsys)
        assert code == 2, name
        _one_line(err)
        assert not out.exists(), name


def test_a_failed_run_says_so_in_its_manifest_and_report(tmp_path, capsys, text, monkeypatch):
    import diffquant.recipes as recipes

    def boom(*args, **kwargs):
        raise DiffquantError("disk full while writing")

    monkeypatch.setattr(recipes, "_stage_sweep", boom)
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "r",
                "models": {"m": "init:baseline:tiny"},
                "profile": {"data": str(text), "tokens": 128, "seq_len": 64, "sites": ["kind:resid"]},
                "eval": {"tasks": [{"type": "bpb", "data": str(text), "tokens": 128, "seq_len": 64}]},
            }
        )
    )
    out = tmp_path / "run"
    code, _, err = _run_cli(["run", str(path), "--out", str(out)], capsys)
    assert code == 2 and "disk full" in err
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed: disk full while writing"
    code, _, err = _run_cli(["report", str(out)], capsys)
    assert code == 0 and "incomplete run" in err
    assert "INCOMPLETE RUN" in (out / "report.md").read_text()


def test_quantized_folder_holds_its_report(tiny, tmp_path, text, capsys):
    out = tmp_path / "q"
    code, _, err = _run_cli(
        ["quantize", str(tiny), "--plan", "w8a8", "--calib-data", str(text), "--seq-len", "64",
         "--calib-tokens", "128", "--eval-tokens", "64", "--out", str(out)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert {"quant_report.json", "quant_plan.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.")]


# ----------------------------------------------------------------- 11. one line instead of a traceback
def test_os_errors_are_one_line(tmp_path, capsys, text):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = _run_cli(
        ["profile", "init:baseline:tiny", "--data", str(text), "--tokens", "64", "--seq-len", "32",
         "--sites", "kind:resid", "--out", str(blocker / "run")],
        capsys,
    )  # fmt: skip
    assert code == 2 and "Not a directory" in _one_line(err)


@pytest.mark.parametrize(
    ("task", "needle"),
    [
        ("retrieval:depths=abc", "'depths': expected a non-empty list"),
        ("bpb:tokens=abc", "'tokens': expected an integer"),
        ("retrieval:digits=1000", "'digits': expected an integer in [1, 18]"),
        ("ppl:windows=sideways", "'windows': expected one of"),
        ("bpb:tokens=[1", "not valid YAML"),
    ],
)
def test_task_parameters_are_checked(tmp_path, capsys, task, needle):
    code, _, err = _run_cli(
        ["eval", "init:baseline:tiny", "--task", task, "--out", str(tmp_path / "e")], capsys
    )
    assert code == 2 and needle in _one_line(err) and not (tmp_path / "e").exists()


def test_recipe_inputs_that_are_not_recipes(tmp_path, capsys):
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    for path, needle in ((folder, "is a folder"), (latin, "not UTF-8")):
        code, _, err = _run_cli(["run", str(path)], capsys)
        assert code == 2 and needle in _one_line(err)
    good = tmp_path / "r.yaml"
    good.write_text("name: a\nmodels: {m: zoo:baseline}\n")
    for override, needle in (("seed=[", "not valid YAML"), ("seed=1180591620717411303424", "2**63"),
                             ("profile.batch_size=0", "profile.batch_size")):  # fmt: skip
        code, _, err = _run_cli(["run", str(good), "--set", override, "--out", str(tmp_path / "x")], capsys)
        assert code == 2 and needle in _one_line(err) and not (tmp_path / "x").exists()


def test_integer_weights_are_one_line(tiny, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny / "model.safetensors"))
    state["embed.weight"] = state["embed.weight"].to(torch.int32)
    save_file(state, str(tiny / "model.safetensors"))
    code, _, err = _run_cli(["info", str(tiny)], capsys)
    assert code == 2 and "tensor embed.weight has dtype I32, expected a floating dtype" in _one_line(err)


def test_closed_pipe_is_quiet():
    proc = subprocess.run(
        f"{sys.executable} -m diffquant.cli zoo | head -1", shell=True, capture_output=True, text=True
    )
    assert proc.stdout.startswith("model") and "Traceback" not in proc.stderr and "Error" not in proc.stderr


# --------------------------------------------------------------------------------------- 13. smaller
def test_zoo_names_are_names_not_paths(tiny, capsys):
    for spec in (f"zoo:{tiny}", "zoo:../zoo/baseline", "zoo:"):
        code, _, err = _run_cli(["info", spec], capsys)
        assert code == 2 and "zoo model" in _one_line(err)


def test_hf_shard_index_cannot_point_outside_its_folder(tmp_path, capsys):
    folder = _tiny_hf_llama(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as f:
        keys = list(f.keys())  # noqa: SIM118
    index = {"weight_map": dict.fromkeys(keys, "../elsewhere.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = _run_cli(["info", f"hf:{folder}"], capsys)
    assert code == 2 and "is not a file name inside" in _one_line(err)


def test_export_never_overwrites_its_input_and_force_leaves_nothing_behind(tiny, tmp_path, capsys):
    before = (tiny / "model.safetensors").read_bytes()
    code, _, err = _run_cli(["export", str(tiny), "--to", "hf", str(tiny), "--force"], capsys)
    assert code == 2 and "is the model being read" in _one_line(err)
    assert (tiny / "model.safetensors").read_bytes() == before
    target = tmp_path / "target"
    target.write_text("a file in the way")
    assert main(["export", str(tiny), "--to", "native", str(target), "--force"]) == 0
    assert target.is_dir() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] != 0o600


def test_undecodable_text_is_said(tmp_path, capsys):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 na\xefve r\xe9sum\xe9 ".encode("latin-1") * 4)
    code, _, err = _run_cli(
        [
            "eval",
            "init:baseline:tiny",
            "--task",
            f"bpb:data={latin},tokens=40,seq_len=16",
            "--out",
            str(tmp_path / "e"),
        ],
        capsys,
    )
    assert code == 0 and "is not UTF-8: 16 undecodable byte sequence(s) read as U+FFFD (3 bytes each)" in err


def test_help_texts_name_what_exists(capsys):
    for command in ("quantize", "profile", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--list-presets" not in out and "native checkpoint folders" not in out
        assert "gguf:" in " ".join(out.split()) or command == "quantize"


# ------------------------------------------------------------------------------------ fuzz: recipes
_KEYS = [
    "name",
    "models",
    "seed",
    "profile",
    "eval",
    "sweep",
    "data",
    "plots",
    "device",
    "dtype",
    "tokenizer",
]
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(_KEYS + ["profil", "evals", "Seed", "model"]),
    sub=st.sampled_from(
        [None, "enabled", "tokens", "seq_len", "batch_size", "data", "tasks", "plans", "sites"]
    ),
    value=_VALUES,
)
def test_fuzzed_recipes_never_trace_back(tmp_path_factory, key, sub, value):
    """A valid recipe with one key replaced by a random value (or a misspelled key): the run either fails
    with one line and exit 2 before writing anything, or succeeds."""
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "t.txt").write_text("Some text to read. " * 30)
    recipe = {
        "name": "fuzz",
        "models": {"m": "init:baseline:tiny"},
        "plots": {"enabled": False},
        "eval": {"tasks": [{"type": "bpb", "data": str(tmp / "t.txt"), "tokens": 64, "seq_len": 32}]},
    }
    if sub is None or not isinstance(recipe.get(key), dict):
        recipe[key] = value
    else:
        recipe[key][sub] = value
    path = tmp / "r.yaml"
    try:
        path.write_text(yaml.safe_dump(recipe))
    except yaml.YAMLError:
        return
    out = tmp / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", str(path), "--out", str(out)])  # a traceback would fail the test here
    if code != 0:
        assert code == 2 and err.getvalue().strip().count("\n") == 0, err.getvalue()
        assert not out.exists() or json.loads((out / "manifest.json").read_text())["status"] != "complete"
    else:
        assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.sampled_from(["plan", "rule", "scheme"]),
    key=st.sampled_from(
        [
            "name",
            "rules",
            "sites",
            "weights",
            "exclude",
            "scheme",
            "format",
            "granularity",
            "calibration",
            "symmetric",
            "smooth",
            "scale_format",
            "percentile",
            "backend",
            "formt",
            "granularty",
            "site",
        ]
    ),  # fmt: skip
    value=_VALUES,
)
def test_fuzzed_plans_never_trace_back(tmp_path_factory, where, key, value):
    """A valid plan with one key set to a random value (or a misspelled key): quantize either fails with
    one line and exit 2 and writes nothing, or writes a quantized checkpoint that loads."""
    tmp = tmp_path_factory.mktemp("fuzzplan")
    (tmp / "t.txt").write_text("Some text to read. " * 30)
    scheme = {"format": "int8", "granularity": "tensor", "calibration": "absmax"}
    rule = {"sites": ["kind:logits"], "scheme": scheme}
    plan = {"name": "p", "rules": [rule, {"modules": ["layers.*"], "scheme": "int8:channel"}]}
    {"plan": plan, "rule": rule, "scheme": scheme}[where][key] = value
    path = tmp / "plan.yaml"
    try:
        path.write_text(yaml.safe_dump(plan))
    except yaml.YAMLError:
        return
    out = tmp / "q"
    err = io.StringIO()
    argv = ["quantize", "init:baseline:tiny", "--plan", str(path), "--calib-data", str(tmp / "t.txt"),
            "--calib-tokens", "64", "--eval-tokens", "32", "--seq-len", "32", "--out", str(out)]  # fmt: skip
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        assert code == 2 and err.getvalue().strip().count("\n") == 0, err.getvalue()
        assert not out.exists()
    else:
        load_model(out)


def test_eval_of_a_nan_model_is_loud_and_keeps_valid_json(broken, text, tmp_path, capsys):
    out = tmp_path / "ev"
    code, stdout, err = _run_cli(
        ["eval", str(broken), "--task", f"bpb:data={text},tokens=128,seq_len=64", "--out", str(out)], capsys
    )
    assert code == 0
    assert "NON-FINITE result in broken|none|bpb: bits_per_byte = nan" in err
    assert "nan" in stdout.splitlines()[-2]  # the table shows it, not "-"
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["metric"]: r["value"] for r in rows}["bits_per_byte"] == "nan"


def test_a_folder_of_another_profile_is_refused(tiny, tmp_path, text, capsys):
    other = tmp_path / "other"
    assert main(["init", "--kind", "diff_v2", "--preset", "tiny", str(other)]) == 0
    common = ["--data", str(text), "--tokens", "64", "--seq-len", "32", "--sites", "kind:resid"]
    out = str(tmp_path / "prof")
    assert main(["profile", str(tiny), *common, "--out", out]) == 0
    assert main(["profile", str(tiny), *common, "--out", out]) == 0  # the same run may come back
    capsys.readouterr()
    code, _, err = _run_cli(["profile", str(other), *common, "--out", out], capsys)
    assert code == 2 and "--force" in _one_line(err)
    assert main(["profile", str(other), *common, "--out", out, "--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "prof" / "profile").iterdir()) == [
        "other.json",
        "other.maps.safetensors",
    ]


# ------------------------------------------------------------------ hardening round 2 (issue 23, helper E)
def _strict_json(path: Path):
    """Parse as the JSON standard does: a NaN / Infinity literal (Python's json writes them) is an error."""

    def refuse(token: str):
        raise ValueError(f"{path}: non-standard JSON literal {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_topk_is_bounded_instead_of_running_forever(tmp_path, capsys, text):
    """--topk 1e8 made every activation a located Python record (a run that never ends, a profile of
    gigabytes); it is refused in one line, on the command line, in a recipe and in the Python API."""
    from diffquant.profile.profiler import MAX_TOPK, Profiler

    out = tmp_path / "prof"
    code, _, err = _run_cli(
        ["profile", "init:baseline:tiny", "--topk", "100000000", "--out", str(out)], capsys
    )
    assert code == 2 and f"--topk: expected an integer in [1, {MAX_TOPK}], got 100000000" in _one_line(err)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"name": "r", "models": {"m": "init:baseline:tiny"}, "profile": {"topk": 10**8}})
    )
    code, _, err = _run_cli(["run", str(recipe), "--out", str(out)], capsys)
    assert code == 2 and f"profile.topk: expected an integer in [1, {MAX_TOPK}]" in _one_line(err)
    assert not out.exists()
    model = load_model("init:baseline:tiny")
    with pytest.raises(DiffquantError, match=r"topk: expected an integer in \[1, 10000\], got 100000000"):
        Profiler(model, topk=10**8)
    Profiler(model, topk=MAX_TOPK)  # the bound itself is allowed (nothing attached before `with`)


@pytest.fixture()
def broken_v2(tmp_path) -> Path:
    """A DIFF V2 model whose layer-0 lambda of head 0 is NaN at every token (a NaN row of lambda_proj)."""
    model = load_model("init:diff_v2:tiny")
    with torch.no_grad():
        model.layers[0].attn.lambda_proj.weight[0] = float("nan")
    return save_checkpoint(model, tmp_path / "broken_v2")


def test_profile_of_a_nan_diff_v2_model_counts_the_lambda_and_keeps_valid_json(
    broken_v2, text, tmp_path, capsys
):
    out = tmp_path / "prof"
    code, stdout, err = _run_cli(
        ["profile", str(broken_v2), "--data", str(text), "--tokens", "256", "--seq-len", "64",
         "--sites", "kind:lambda", "kind:resid", "kind:probs", "--out", str(out)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    profile = _strict_json(out / "profile" / "broken_v2.json")
    tokens = profile["meta"]["tokens"]
    assert tokens == 256
    lam0 = profile["attention"]["layers.0.attn.lambda"]
    assert lam0["nonfinite"] == [tokens, 0, 0, 0] and lam0["count"] == [0, tokens, tokens, tokens]
    assert lam0["min"][0] is None and all(0 < v < 1 for v in lam0["min"][1:] + lam0["max"][1:])
    lam1 = profile["attention"]["layers.1.attn.lambda"]  # the NaN head's output reaches every head of layer 1
    assert lam1["nonfinite"] == [tokens] * 4 and lam1["count"] == [0] * 4
    _strict_json(out / "table5.json")
    assert "NON-FINITE hidden states in broken_v2" in stdout


def test_act_scales_of_a_nan_model_name_the_linears_and_write_nothing(broken, text, tmp_path, capsys):
    """It wrote all-zero scales (the abs-max of what stayed finite) with exit 0; now it refuses, naming the
    Linears whose inputs held NaN / Inf (found here by hooks on the same windows)."""
    from diffquant.data import token_windows
    from diffquant.data.tokenizer import ByteTokenizer
    from diffquant.quant.modules import linear_modules

    model = load_model(str(broken))
    windows = token_windows(str(text), 256, 64, ByteTokenizer())
    bad: dict[str, None] = {}
    hooks = [
        lin.register_forward_pre_hook(
            lambda m, a, n=name: None if torch.isfinite(a[0]).all() else bad.setdefault(n)
        )
        for name, lin in linear_modules(model).items()
    ]
    with torch.no_grad():
        model(windows)
    for h in hooks:
        h.remove()
    order = list(linear_modules(model))
    bad_names = sorted(bad, key=order.index)
    assert 0 < len(bad_names) < len(order)

    out = tmp_path / "scales.pt"
    code, _, err = _run_cli(
        ["act-scales", str(broken), "--data", str(text), "--tokens", "256", "--seq-len", "64", "--out", str(out)],
        capsys,
    )  # fmt: skip
    line = _one_line(err)
    assert (
        code == 2
        and f"non-finite inputs (NaN / Inf) reached {len(bad_names)} of {len(order)} Linears" in line
    )
    assert all(name in line for name in bad_names[:4]) and not out.exists()
    assert not list(tmp_path.glob(".scales.pt.*"))


@pytest.mark.parametrize("which", ["weights", "config"])
def test_init_on_a_full_disk_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, which):
    """ENOSPC while writing (safetensors raises its own error type for the weights; a Python write's OSError
    carries no file name): one line naming what was being written, and no folder left behind."""
    import errno
    import pathlib

    import safetensors.torch
    from safetensors import SafetensorError

    def full_weights(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def full_text(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if which == "weights":
        monkeypatch.setattr(safetensors.torch, "save_file", full_weights)
    else:
        monkeypatch.setattr(pathlib.Path, "write_text", full_text)
    out = tmp_path / "model"
    code, _, err = _run_cli(["init", str(out)], capsys)
    line = _one_line(err)
    assert code == 2 and "No space left on device" in line
    assert (f"{out / 'model.safetensors'}: " if which == "weights" else f"{out}: ") in line
    assert not out.exists() and not list(tmp_path.iterdir())


def test_init_seed_is_bounded_as_a_recipe_seed(tmp_path, capsys):
    """--seed 1e23 (as an integer) crashed in torch.manual_seed with a traceback; both init and a recipe now
    say the same range in one line."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "models": {"m": "init:baseline:tiny"}, "seed": 10**23}))
    code, _, err = _run_cli(["run", str(recipe), "--out", str(tmp_path / "run")], capsys)
    assert (
        code == 2
        and "seed: expected an integer in [0, 2**63 - 1], got 100000000000000000000000" in _one_line(err)
    )
    for seed, words in ((10**23, "an integer in [0, 2**63 - 1]"), (-1, "an integer >= 0")):
        code, _, err = _run_cli(["init", "--seed", str(seed), str(tmp_path / "m")], capsys)
        assert code == 2 and f"--seed: expected {words}, got {seed}" in _one_line(err)
    assert not (tmp_path / "m").exists() and not (tmp_path / "run").exists()
    code, out, _ = _run_cli(["init", "--seed", str(2**63 - 1), str(tmp_path / "m")], capsys)
    assert code == 0 and f"seed {2**63 - 1}" in out


def test_recipe_without_models_is_one_line_before_any_write(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodels: {}\n")
    out = tmp_path / "run"
    code, _, err = _run_cli(["run", str(recipe), "--out", str(out)], capsys)
    assert code == 2 and "models: expected at least one model" in _one_line(err) and not out.exists()


@pytest.mark.parametrize("seed", ["100000000000000000000000", "-1"])
def test_init_specifier_seed_is_bounded(capsys, seed):
    """init:KIND:PRESET:SEED with a seed torch.manual_seed cannot take: one line, exit 2 (was a traceback)."""
    code, _, err = _run_cli(["info", f"init:baseline:tiny:{seed}"], capsys)
    assert code == 2 and f"seed {int(seed)} is not in [0, 2**63 - 1]" in _one_line(err)


# =========================================================== issue 44: hostile input, round 3 (items 2, 4, 6, 7, 8)
_PLAIN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}"  # the plain-name rule, written out independently of the code
HOSTILE_NAMES = ["/abs/victim", "../../x", "a/../../x", "..", ".", "a\\b", "", "a\0b", "x" * 101]


def _recipe(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_recipe_model_names_are_plain_names(tmp_path, capsys, text, name):
    """Item 2: a model named like a path wrote profile/NAME.json outside the run folder (an absolute name
    replaced victim.json; ../../x wrote two folders up). Refused in one line before anything is written."""
    victim = tmp_path / "victim.json"
    victim.write_text('{"mine": true}\n')
    name = str(tmp_path / "victim") if name == "/abs/victim" else name
    doc = {"name": "r", "models": {name: "init:baseline:tiny"},
           "profile": {"data": str(text), "tokens": 64, "seq_len": 32, "sites": ["kind:resid"]}}  # fmt: skip
    out = tmp_path / "a" / "b" / "run"
    code, _, err = _run_cli(["run", str(_recipe(tmp_path, doc)), "--out", str(out)], capsys)
    assert code == 2 and f"models: {name!r} is not a plain name" in _one_line(err)
    assert victim.read_text() == '{"mine": true}\n' and not (tmp_path / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "text.txt", "victim.json"]


def test_recipe_name_seed_groups_and_task_names_are_plain_names(tmp_path, capsys, monkeypatch):
    """Item 2 / 7: the recipe's name (its default folder runs/NAME), seed-group names and task names
    are plain names; a seed group needs a member; a task name is a string, never a list spelled out."""
    from diffquant.recipes import validate

    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)  # a default folder runs/../../x would land in tmp_path/x
    code, _, err = _run_cli(
        ["run", str(_recipe(tmp_path, {"name": "../../x", "models": {"m": "init:baseline:tiny"}}))], capsys
    )
    assert code == 2 and "name: expected a plain name" in _one_line(err)
    assert not (tmp_path / "x").exists() and not (work / "runs").exists()
    base = {"name": "r", "models": {"m": "init:baseline:tiny", "m2": "init:baseline:tiny"}}
    cases = [
        ({"seeds": {"a": []}}, "seeds.a: expected at least one of the recipe's models (m, m2), got an empty list"),
        ({"seeds": {"../g": ["m", "m2"]}}, "seeds: '../g' is not a plain name"),
        ({"eval": {"tasks": [{"type": "bpb", "name": ["a"]}]}}, "eval.tasks[0]: name: ['a'] is not a plain name"),
        ({"eval": {"tasks": [{"type": "bpb", "name": "a/b"}]}}, "eval.tasks[0]: name: 'a/b' is not a plain name"),
    ]  # fmt: skip
    for extra, needle in cases:
        with pytest.raises(DiffquantError) as err:
            validate({**base, **extra}, "r.yaml")
        assert str(err.value).startswith("r.yaml: ") and needle in str(err.value), str(err.value)
    assert validate({**base, "seeds": {"g_1.x-y": ["m", "m2"]}}, "r.yaml")["seeds"] == {
        "g_1.x-y": ["m", "m2"]
    }


@pytest.mark.parametrize(
    "spec",
    ["hf:..", "hf:/tmp/..", "fetch:../../x", "zoo:../zoo/baseline", "gguf:/a/..gguf", "init:../x:y",
     "hf:my model/", "a\\b"],
)  # fmt: skip
def test_model_names_made_from_specifiers_are_plain(spec):
    """Item 2: `diffquant profile` / `eval` name a model after its specifier (profile/NAME.json): the name
    made from a path is a plain name too, whatever the path."""
    from diffquant.cli import _unique_name

    name = _unique_name(spec, {})
    assert re.fullmatch(_PLAIN, name), name
    assert _unique_name(spec, {name: spec}) == f"{name}-2"


def _fifo_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("Some text to read. " * 20)
    (tmp_path / "plan.yaml").symlink_to("/dev/zero")  # a link to a device, as a plan
    os.mkfifo(data / "b.txt")  # a FIFO inside a data folder: listed as a text file by name
    hf = tmp_path / "hf"
    hf.mkdir()
    os.mkfifo(hf / "config.json")
    out = str(tmp_path / "out")
    cases = [
        (["run", "/dev/zero"], "/dev/zero: is a character device, not a regular file; expected a recipe"),
        (["run", "/dev/urandom"], "/dev/urandom: is a character device, not a regular file"),
        (["run", str(fifo)], f"{fifo}: is a FIFO (named pipe), not a regular file; expected a recipe"),
        (["quantize", "init:baseline:tiny", "--plan", str(fifo), "--out", out], f"{fifo}: is a FIFO"),
        (["eval", "init:baseline:tiny", "--task", "bpb", "--plan", str(tmp_path / "plan.yaml"), "--out", out],
         f"{tmp_path / 'plan.yaml'}: is a character device, not a regular file; expected a plan"),
        (["profile", "init:baseline:tiny", "--data", str(data), "--tokens", "64", "--seq-len", "32",
          "--out", out], f"{data / 'b.txt'}: is a FIFO (named pipe), not a regular file; expected a text file"),
        (["info", f"hf:{hf}"], f"{hf / 'config.json'}: is a FIFO"),
        (["eval", "init:baseline:tiny", "--task", f"mc:path={fifo}", "--out", out],
         f"{fifo}: is a FIFO (named pipe), not a regular file; expected a multiple-choice file"),
    ]  # fmt: skip
    return cases


def test_devices_and_fifos_are_refused_never_read(tmp_path):
    """Item 4: `run /dev/zero` grew to 11 GB; /dev/urandom and a FIFO never returned (st_size is 0 for
    them). Each is refused in one line, exit 2, before it is opened for reading. Run in a child with a
    timeout and an address-space limit, so a reader that hangs or grows fails the test instead of it."""
    cases = _fifo_cases(tmp_path)
    script = (
        "import contextlib, io, json, sys\nfrom diffquant.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n    with contextlib.redirect_stderr(err):\n        code = main(argv)\n"
        "    print(json.dumps([code, err.getvalue()]), flush=True)\n"
    )
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # noqa: E731
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps([argv for argv, _ in cases])],
            capture_output=True, text=True, timeout=120, preexec_fn=limit, cwd=tmp_path,
        )  # fmt: skip
    except subprocess.TimeoutExpired as stop:
        pytest.fail(f"a read never returned; done so far: {stop.stdout}")
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stderr[-2000:]
    for (argv, needle), (code, err) in zip(cases, results, strict=True):
        assert code == 2 and needle in _one_line(err), (argv, err)
    assert not (tmp_path / "out").exists()


def test_bounded_read_reads_at_most_limit_plus_one(tmp_path, monkeypatch):
    """Item 4: the reader stops at limit + 1 bytes even when the size it saw first is wrong (a file that
    grows, what st_size 0 stood for): exactly `limit` bytes pass, one more is refused naming the limit."""
    from diffquant import textfiles

    path = tmp_path / "f.txt"
    path.write_bytes(b"x" * 10)
    assert textfiles.read_bytes_bounded(path, 10) == b"x" * 10
    path.write_bytes(b"x" * 11)
    with pytest.raises(DiffquantError, match=r"11 bytes; a file here is at most 10 bytes \(10 bytes\)"):
        textfiles.read_bytes_bounded(path, 10)
    path.write_bytes(b"y" * 5000)
    seen = os.stat(path)
    fake = os.stat_result((seen.st_mode, *seen[1:6], 0, *seen[7:]))  # st_size 0, as a device reports
    monkeypatch.setattr(textfiles.os, "stat", lambda p, *a, **k: fake)
    read: list[int] = []
    real_read = os.read
    monkeypatch.setattr(textfiles.os, "read", lambda fd, n: read.append(len(b := real_read(fd, n))) or b)
    with pytest.raises(DiffquantError, match="more bytes than that; a file here is at most 100 bytes"):
        textfiles.read_bytes_bounded(path, 100)
    assert sum(read) == 101


DEEP = "[" * 50_000 + "]" * 50_000


def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path, capsys):
    """Item 6: `[[[[...]]]]` 50,000 deep, or 3,000 levels in a recipe or --set, was a RecursionError
    traceback; JSON too. Nesting deeper than 100 is refused in one line (100 is accepted)."""
    recipe = tmp_path / "deep.yaml"
    recipe.write_text(DEEP)
    code, _, err = _run_cli(["run", str(recipe)], capsys)
    assert code == 2 and f"{recipe}: line 1: nested more than 100 levels deep" in _one_line(err)
    good = _recipe(tmp_path, {"name": "r", "models": {"m": "init:baseline:tiny"}})
    for sets in (["x=" + "{a: " * 3000 + "}" * 3000], ["a" + ".a" * 3000 + "=1", "seed=1"]):
        argv = ["run", str(good), "--out", str(tmp_path / "run")]
        code, _, err = _run_cli([*argv, *(arg for s in sets for arg in ("--set", s))], capsys)
        assert code == 2 and "nested more than 100 levels deep" in _one_line(err)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": ' + DEEP + "}")
    code, _, err = _run_cli(["info", f"hf:{hf}"], capsys)
    assert code == 2 and f"{hf / 'config.json'}: nested more than 100 levels deep" in _one_line(err)
    from diffquant.textfiles import parse_json, parse_yaml

    assert parse_yaml("[" * 100 + "]" * 100, "y") == parse_json("[" * 100 + "]" * 100, "j")
    for parse in (parse_yaml, parse_json):
        with pytest.raises(DiffquantError, match="nested more than 100 levels deep"):
            parse("[" * 101 + "]" * 101, "x")
    assert not (tmp_path / "run").exists()


def test_memory_limit_at_import_is_one_line():
    """Item 6: under `ulimit -v 300000` torch's libraries do not map and the ImportError was a traceback
    before the CLI's handler: now one line naming the memory limit, exit code 2."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (300 << 20, 300 << 20))  # noqa: E731
    proc = subprocess.run(
        [sys.executable, "-m", "diffquant.cli", "info", "init:baseline:tiny"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc.stderr)
    assert (
        line.startswith("diffquant info: error: cannot load its libraries: out of memory")
        and "ulimit -v" in line
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["presets", "foo"], "diffquant: error: unrecognized arguments: foo (see diffquant --help)"),
        (["init", "--kind", "diff_v3", "x"], "diffquant init: error: argument --kind: invalid choice: 'diff_v3'"),
        (["fetch", "nosuch"], "diffquant fetch: error: argument NAME: invalid choice: 'nosuch'"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line(capsys, argv, needle):
    """Item 8: argparse printed its usage block (2 to 12 lines) before the error."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and needle in _one_line(err)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"bos_token": ["<|bos|>"]}, "bos_token must be a string or an AddedToken object"),
        ({"bos_token": 5}, "bos_token must be a string or an AddedToken object ({\"content\": \"<s>\", ...}) or null, got 5"),
        ({"eos_token": {"id": 0}}, "eos_token must be a string or an AddedToken object"),
        ({"pad_token": 0}, "pad_token must be a string"),
        ({"add_bos_token": "yes"}, "add_bos_token must be true or false, got 'yes'"),
        ({"add_eos_token": 1}, "add_eos_token must be true or false, got 1"),
    ],
)  # fmt: skip
def test_tokenizer_config_types_are_checked(tmp_path, config, needle):
    """Item 7: a special token of the wrong type was read as "no such token" (BOS / EOS silently dropped),
    add_bos_token "yes" as "not given"."""
    pytest.importorskip("tokenizers")
    from conftest import train_byte_bpe

    from diffquant.data import load_tokenizer

    train_byte_bpe(tmp_path, ["differential attention cancels noise"] * 8, config=config)
    with pytest.raises(DiffquantError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'tokenizer_config.json'}: ") and needle in str(err.value)


def test_tokenizer_config_accepts_added_token_objects(tmp_path):
    pytest.importorskip("tokenizers")
    from conftest import train_byte_bpe

    from diffquant.data import load_tokenizer

    added = {
        "content": "<|bos|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }
    train_byte_bpe(
        tmp_path, ["differential attention"] * 8, config={"bos_token": added, "add_bos_token": True}
    )
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 0, True)


def test_plan_name_is_a_string_and_unused_weight_options_are_refused():
    """Item 7: plan `name: ['a']` became the string "['a']"; `weights: {method: rtn, damp: 0.5}` ran
    plain rtn while act_order with rtn was refused: one rule for every option a method does not read."""
    from diffquant.quant.plan import QuantPlan

    rule = {"sites": ["kind:resid"], "scheme": "int8"}
    for name, got in ((["a"], "['a'] (list)"), (5, "5 (an integer)")):
        with pytest.raises(DiffquantError) as err:
            QuantPlan.from_dict({"name": name, "rules": [rule]}, "p.yaml")
        assert str(err.value) == f"p.yaml: name: expected a string, got {got}"
    for method, option, value in (("rtn", "damp", 0.5), ("rtn", "lazy_batch", 64), ("hqq", "act_order", True),
                                  ("rtn", "damp", 0.01)):  # fmt: skip
        with pytest.raises(DiffquantError) as err:
            QuantPlan.from_dict({"weights": {"method": method, option: value}}, "p.yaml")
        assert str(err.value) == (
            f"p.yaml: weights.{option}: a gptq option, which method {method} does not read; remove it "
            "(or method: gptq)"
        )
    plan = QuantPlan.from_dict(
        {"weights": {"method": "gptq", "damp": 0.5, "lazy_batch": 64, "act_order": True}}
    )
    assert (plan.weights.damp, plan.weights.lazy_batch, plan.weights.act_order) == (0.5, 64, True)
    hqq = QuantPlan.from_dict({"weights": {"method": "hqq", "format": "int3", "group": 64, "sym": False}})
    assert hqq.weights.label() == "hqq int3 g64 asym (GPTQ grid, codes 0..7 - zero)"


def test_unknown_top_level_key_of_a_native_config_is_refused(tiny, capsys):
    meta = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**meta, "tokeniser": "byte"}))
    code, _, err = _run_cli(["info", str(tiny)], capsys)
    assert code == 2 and (
        f"{tiny / 'config.json'}: unknown top-level key 'tokeniser'; allowed keys: config, format, "
        "format_version, tokenizer"
    ) in _one_line(err)


def test_kv_cache_that_quantizes_nothing_is_refused(tmp_path):
    """Item 7: sinks + the full-precision window covering every position a decode-mode window reads
    quantized nothing and was reported as a 2-bit cache. Measured, not assumed: decode-mode log-probs with
    the cache equal those without it exactly when the refusal fires (window 11 here), and differ one token
    later (window 12, accepted)."""
    from conftest import tiny_model

    from diffquant.eval.perplexity import decode_logprobs, evaluate_bpb
    from diffquant.quant import QuantPlan, apply_plan
    from diffquant.recipes import validate

    kv = {"kv_cache": {"format": "int2", "group": 4, "window": 8, "sinks": 2, "keys": "token"}}
    plan_file = tmp_path / "kv.yaml"
    plan_file.write_text(yaml.safe_dump(kv))
    plain = tiny_model("baseline", vocab_size=259)  # the byte vocabulary: evaluate_bpb reads text
    cached = tiny_model("baseline", vocab_size=259)
    apply_plan(cached, QuantPlan.from_dict(kv))
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for window, quantizes in ((11, False), (12, True)):
            same = torch.equal(
                decode_logprobs(plain, ids[:, :window], 2), decode_logprobs(cached, ids[:, :window], 2)
            )
            assert same is not quantizes
            task = {"type": "bpb", "tokens": 64, "seq_len": window, "decode": 2}
            raw = {"name": "r", "models": {"m": "init:baseline:tiny"}, "eval": {"tasks": [task]},
                   "sweep": {"plans": [str(plan_file)]}}  # fmt: skip
            if quantizes:
                validate(raw, "r.yaml")
                continue
            with pytest.raises(DiffquantError) as err:
                validate(raw, "r.yaml")
            assert str(err.value).startswith(
                f"r.yaml: task bpb, plan {plan_file}: the kv_cache keeps 2 sink(s)"
            )
            assert "nothing would be quantized" in str(err.value) and "seq_len >= 12" in str(err.value)
            out = tmp_path / "e"  # diffquant eval refuses it the same way, before its folder is claimed
            code = main(["eval", "init:baseline:tiny", "--task", f"bpb:tokens=64,seq_len={window},decode=2",
                         "--plan", str(plan_file), "--out", str(out)])  # fmt: skip
            assert code == 2 and not out.exists()
        text = tmp_path / "t.txt"
        text.write_text("Differential attention cancels common-mode noise. " * 8)
        logger = logging.getLogger("diffquant")  # the CLI may stop propagation: listen on it directly
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:  # at run time (a window the model decides is only known then): a warning line
            evaluate_bpb(cached, str(text), max_tokens=64, seq_len=11, decode=2)
            evaluate_bpb(cached, str(text), max_tokens=64, seq_len=12, decode=2)
        finally:
            logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if "nothing would be quantized" in r.getMessage()]
    assert len(warned) == 1 and "decode-mode windows of 11 tokens" in warned[0]


def _lmeval_task(folder: Path, name: str, template: str) -> Path:
    """A task YAML over the shipped LAMBADA test file whose doc_to_text is ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = Path(__file__).parent / "data" / "lmeval" / "lambada.jsonl"
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"output_type: loglikelihood\ntest_split: test\ndoc_to_text: {json.dumps(template)}\n"
        'doc_to_target: " x"\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n'
    )
    return folder


@pytest.mark.slow  # lm-eval's import and task index: ~10 s
def test_every_jinja_error_of_a_task_template_is_one_line(tmp_path, monkeypatch):
    """Item 6: templates the sandbox blocks escaped as UndefinedError (an |attr('__class__') chain) and
    OverflowError (range(100000000)); every Jinja error is now the same one-line refusal. The model is a
    stand-in lm-eval LM: templates render before any model call."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.model import LM

    from diffquant.eval.lmeval import run_lmeval

    monkeypatch.setenv("DIFFQUANT_QUIET", "1")

    class Constant(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            return [(-1.0, True)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return [-1.0] * len(requests)

        def generate_until(self, requests, disable_tqdm=False):
            return [""] * len(requests)

    hostile = {
        "attr_chain": ("{{ text|attr('__class__')|attr('__mro__') }}", "UndefinedError"),
        "big_range": (
            "{% for i in range(100000000) %}{% endfor %}{{ text }}",
            "OverflowError: Range too big",
        ),
    }
    for name, (template, words) in hostile.items():
        folder = _lmeval_task(tmp_path / name, name, template)
        with pytest.raises(DiffquantError) as err:
            run_lmeval(Constant(), [name], include_path=str(folder), limit=1, bootstrap_iters=0)
        message = str(err.value)
        assert "\n" not in message and message.startswith("lm-eval: a task template was refused or failed")
        assert f"({words}" in message and "sandbox" in message
    folder = _lmeval_task(tmp_path / "plain", "plain", "{{ text }}")
    out = run_lmeval(Constant(), ["plain"], include_path=str(folder), limit=1, bootstrap_iters=0)
    assert out["plain"]["acc"] == 1.0 and out["plain"]["n_samples"] == 1


def test_lmeval_task_files_are_read_bounded(tmp_path):
    """Items 4 and 6 for lm-eval task YAMLs (read as data before lm-eval indexes them): a FIFO among them
    blocked the read forever, YAML nested 3,000 deep was a RecursionError. The FIFO is read in a thread:
    should the reader block, the test opens the FIFO's other end to free it, and fails."""
    pytest.importorskip("lm_eval")
    import threading

    from diffquant.eval.lmeval import check_lmeval

    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "deep.yaml").write_text("task: deep\ntag: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(DiffquantError) as err:
        check_lmeval(["deep"], include_path=str(deep))
    assert (
        str(err.value)
        == f"lm-eval task file {deep / 'deep.yaml'}: line 2: nested more than 100 levels deep (lists / mappings inside each other)"
    )
    piped = tmp_path / "piped"
    piped.mkdir()
    os.mkfifo(piped / "task.yaml")
    got: list[BaseException | None] = []

    def scan() -> None:
        try:
            check_lmeval(["lambada_local"], include_path=str(piped))
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
            got.append(exc)

    reader = threading.Thread(target=scan, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():
        os.close(os.open(piped / "task.yaml", os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        reader.join(timeout=10)
        pytest.fail("reading the task folder blocked on a FIFO")
    assert isinstance(got[0], DiffquantError), got
    assert (
        str(got[0])
        == f"{(piped / 'task.yaml').resolve()}: is a FIFO (named pipe), not a regular file; expected a YAML task file (lm-eval)"
    )


def test_a_too_deep_safetensors_header_or_cell_record_is_one_line(tmp_path):
    """JSON the project reads back from files (a safetensors header, a sweep's cell records) nested deeper
    than Python's recursion limit was a RecursionError traceback: one line naming the file instead."""
    import struct

    from diffquant.eval.sweep import _read_records
    from diffquant.io.safetensors_source import _Header

    deep = b"[" * 50_000 + b"]" * 50_000
    st = tmp_path / "model.safetensors"
    st.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(DiffquantError, match="not a readable safetensors file") as err:
        _Header(st)
    assert str(st) in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "cells-rank0.jsonl").write_bytes(deep + b"\n")
    with pytest.raises(DiffquantError, match="nested too deep"):
        _read_records(tmp_path, None)
