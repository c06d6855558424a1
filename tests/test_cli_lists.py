"""Issue 49, items 5 and 7: options that take several values accumulate repeated flags, a single-valued
`quantize --plan` refuses a second one, a mistyped name gets the closest names, `plot --layers`, a
`--sites` subset recorded in the Table 5 view, a recipe's description after `--set`, the help texts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from diffquant.cli import build_parser, main
from diffquant.errors import DiffquantError

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, *, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"diffquant {command}: error: "), err
    return err


# ------------------------------------------------------------------------------------- repeated flags
@pytest.mark.parametrize(
    ("argv", "dest", "expected"),
    [
        (["eval", "m", "--task", "bpb", "--plan", "a", "--plan", "b"], "plan", ["a", "b"]),
        (["eval", "m", "--task", "bpb", "--plan", "a", "b", "--plan", "c"], "plan", ["a", "b", "c"]),
        (["eval", "m", "--task", "bpb"], "plan", ["none"]),  # the default, when no --plan is given
        (["eval", "m", "--task", "bpb", "--task", "ppl"], "task", ["bpb", "ppl"]),
        (["profile", "m", "--sites", "kind:q", "--sites", "kind:k"], "sites", ["kind:q", "kind:k"]),
        (["profile", "m"], "sites", ["*"]),
        (["plot", "r", "--what", "hist", "--what", "maps"], "what", ["hist", "maps"]),
        (["plot", "r", "--format", "svg"], "format", ["svg"]),  # not png too: the default is replaced
        (["plot", "r", "--format", "svg", "--format", "pdf"], "format", ["svg", "pdf"]),
        (["plot", "r"], "format", ["png"]),
    ],
)
def test_repeated_flags_accumulate_and_replace_the_default(argv, dest, expected):
    assert getattr(build_parser().parse_args(argv), dest) == expected


def test_eval_runs_every_plan_and_task_of_repeated_flags(tmp_path, capsys):
    """`--plan a --plan b` used to run b alone (a dropped without a word); now both, as `--plan a b`."""
    out = tmp_path / "ev"
    args = ["eval", "init:baseline:tiny", "--task", "bpb:data=stdlib:validation,tokens=64,seq_len=32",
            "--task", "ppl:data=stdlib:validation,tokens=64,seq_len=32",
            "--plan", "attn-logits-int8", "--plan", "attn-logits-int4", "--calib-tokens", "64",
            "--calib-seq-len", "32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["plan"] for r in rows} == {"none", "attn-logits-int8", "attn-logits-int4"}
    assert {r["task"] for r in rows} == {"bpb", "ppl"}


def test_quantize_refuses_a_second_plan_in_one_line(tmp_path, capsys):
    args = [
        "quantize",
        "init:baseline:tiny",
        "--plan",
        "w8a8",
        "--plan",
        "w4a8",
        "--out",
        str(tmp_path / "q"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = _one_line_error(capsys, command="quantize")
    assert "--plan given twice ('w8a8', 'w4a8')" in err and "diffquant eval MODEL --plan A B" in err
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------------------------- did you mean
def test_a_mistyped_preset_gets_the_closest_names_not_the_list(capsys):
    assert main(["quantize", "init:baseline:tiny", "--plan", "w4a8-rnt", "--out", "unused"]) == 2
    err = _one_line_error(capsys, command="quantize")
    assert "did you mean 'w4a8-rtn'" in err and "attn-logits-int4-head" not in err  # no list of 70
    from diffquant.quant.plan import QuantPlan

    with pytest.raises(DiffquantError, match="neither a preset nor a file; presets: attn-logits-int4"):
        QuantPlan.load("no-such-preset")  # nothing close: the list, as before


@pytest.mark.parametrize(
    ("spec", "hint"),
    [("zoo:baselin", "did you mean 'baseline'"), ("fetch:smolm2", "did you mean 'smollm2'?")],
)
def test_a_mistyped_model_name_gets_the_closest_names(spec, hint, capsys):
    assert main(["info", spec]) == 2
    assert hint in _one_line_error(capsys, command="info")


@pytest.mark.parametrize(
    ("pattern", "hint"),
    [
        ("layers.0.atn.q", "did you mean 'layers.0.attn.q'"),
        ("layers.*.atn.q", "did you mean 'layers.*.attn.q'"),
        ("kind:resd", "did you mean 'kind:resid'"),
    ],
)
def test_a_mistyped_site_gets_the_closest_names_and_the_glob_syntax(pattern, hint, tmp_path, capsys):
    assert main(["profile", "init:baseline:tiny", "--sites", pattern, "--out", str(tmp_path / "p")]) == 2
    err = _one_line_error(capsys, command="profile")
    assert hint in err and "* any characters, ? one, [abc] one of them" in err


# ------------------------------------------------------------------------------------- --sites recorded
@pytest.fixture(scope="module")
def subset_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("subset") / "run"
    args = ["profile", "init:baseline:tiny", "--sites", "layers.1.*", "--sites", "kind:logits",
            "--tokens", "128", "--seq-len", "32", "--data", "stdlib:validation", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out


def test_a_sites_subset_is_recorded_in_the_table5_view_and_json(subset_run, capsys):
    """A layers-1 table used to read as a whole-model one: the selection is in table5.json, in the header
    printed and written, and in the report's Table 5 section."""
    from diffquant.report import write_report

    assert json.loads((subset_run / "table5.json").read_text())["sites"] == ["layers.1.*", "kind:logits"]
    header = (subset_run / "table5.txt").read_text().splitlines()[0]
    assert " at only the sites matching layers.1.* kind:logits (--sites) from stdlib:validation" in header
    md, _ = write_report(subset_run, figures=[])
    assert "Only the sites matching `layers.1.*`, `kind:logits`, not the whole model." in md.read_text()


def test_a_whole_model_profile_records_every_site(tmp_path):
    out = tmp_path / "run"
    args = ["profile", "init:baseline:tiny", "--tokens", "64", "--seq-len", "32", "--data", "stdlib:validation",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert json.loads((out / "table5.json").read_text())["sites"] == ["*"]
    assert "only the sites" not in (out / "table5.txt").read_text()


# ------------------------------------------------------------------------------------- plot --layers
def test_plot_layers_limits_the_per_layer_figures(subset_run, tmp_path, capsys):
    from diffquant.plots import render_run

    records = render_run(subset_run, what=["hist-layers", "layerwise"], dpi=20, layers="1")
    assert records and all("Layers 1 only (--layers)." in r.caption for r in records)
    assert main(["plot", str(subset_run), "--what", "layerwise", "--layers", "0-1", "--dpi", "20"]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3-x", "--layers '3-x': expected layer numbers and ranges, e.g. 3-5 or 0,4,8-11"),
        ("5-3", "--layers '5-3': expected layer numbers and ranges"),
        ("", "--layers '': expected layer numbers and ranges"),
        ("7-9", "--layers 7-9: the profiles hold layers 0-1"),
    ],
)
def test_plot_layers_refuses_bad_input_in_one_line(subset_run, text, message, capsys):
    assert main(["plot", str(subset_run), "--layers", text]) == 2
    assert message in _one_line_error(capsys, command="plot")


def test_parse_and_format_layers():
    from diffquant.plots.run import format_layers, parse_layers

    assert parse_layers("3-5") == (3, 4, 5)
    assert parse_layers(" 0, 4,8-9,4") == (0, 4, 8, 9)
    assert format_layers((9, 3, 4, 5, 0)) == "0, 3-5, 9"


# ------------------------------------------------------------------------------------- the rest
def test_a_recipe_description_says_what_set_changed():
    """`--set sweep.plans=...` replaced the plans the description names; the report kept it as is."""
    from diffquant.recipes import load_recipe

    plain = load_recipe("paper-fig8")
    changed = load_recipe("paper-fig8", ["sweep.plans=[w8a8]", "seed=3"])
    assert changed["description"] == (
        f"{plain['description']} (--set changed sweep.plans, seed; the description is the recipe's as written)"
    )
    assert load_recipe("paper-fig8", ["description=mine", "seed=3"])["description"] == "mine"


def test_help_names_every_family_hf_reads(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family in ("Llama", "DiffLlama", "Qwen2", "Qwen3", "Mistral", "Gemma 3"):
        assert family in text


def test_the_test_extra_has_what_python_m_build_needs():
    """README "Install" says `python -m build`: the venv `make setup` makes (the test extra) can run it."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(req.split(">")[0].split("=")[0].strip() == "build" for req in extra)
    assert "python -m build" in (ROOT / "README.md").read_text()
