"""Hostile but realistic input: each defect of the hardening audit (issue 13) as a regression test.

Every user error is one line on stderr and exit code 2, never a traceback, and nothing is written.
"""

from __future__ import annotations

import contextlib
import io
import json
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
    plan = {"name": "p", "rules": [rule, {"weights": ["layers.*"], "scheme": "int8:channel"}]}
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

    from safetensors import SafetensorError

    from diffquant.io import checkpoint

    def full_weights(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def full_text(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if which == "weights":
        monkeypatch.setattr(checkpoint, "save_file", full_weights)
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
