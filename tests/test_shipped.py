"""Shipped YAML files (diffquant/shipped): recipes, training recipes, plans and lm-eval tasks resolve by name
from any folder, an existing path wins over a shipped name, and a name that is neither is a one-line error
listing what ships. The wheel carrying them is tested in test_wheel.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.shipped import LMEVAL_DIR, PLANS_DIR, RECIPES_DIR, resolve, shipped, shipped_names

ROOT = Path(__file__).parents[1]


def test_a_clones_recipes_folder_is_the_shipped_one():
    """The docs cite recipes/..., a clone's top-level recipes links to the package's folder (one copy)."""
    assert (ROOT / "recipes").resolve() == RECIPES_DIR
    assert (ROOT / "recipes" / "plans" / "example.yaml").resolve() == PLANS_DIR / "example.yaml"
    from diffquant.eval.lmeval import RECIPE_TASKS

    assert RECIPE_TASKS == LMEVAL_DIR and sorted(p.stem for p in LMEVAL_DIR.glob("*.yaml")) == shipped_names(
        "lmeval"
    )


def test_each_kind_is_what_its_loader_accepts():
    """The run / train split (by a top-level `models` key) agrees with the validators: every run recipe
    validates as a recipe and is refused as a training recipe, and the other way round."""
    import yaml

    from diffquant.recipes import validate
    from diffquant.train.trainer import TrainConfig

    run, train = shipped_names("run"), shipped_names("train")
    assert {"paper-table5", "smollm2"} <= set(run) and {"zoo-diff_v2", "train-gpu"} <= set(train)
    assert not set(run) & set(train)
    for name in run:
        validate(yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text()), name)
    for name in train:
        assert TrainConfig.load(name).name
        with pytest.raises(DiffquantError):
            validate(yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text()), name)


def test_names_resolve_from_any_folder(tmp_path, monkeypatch):
    from diffquant.quant.plan import QuantPlan
    from diffquant.recipes import load_recipe
    from diffquant.train.trainer import TrainConfig

    monkeypatch.chdir(tmp_path)  # an empty folder: no recipes/ here
    for spec in ("paper-table5", "paper-table5.yaml", "recipes/paper-table5.yaml"):
        assert load_recipe(spec)["name"] == "paper-table5", spec
    for spec in ("zoo-diff_v2", "zoo-diff_v2.yaml", "recipes/zoo-diff_v2.yaml"):
        assert TrainConfig.load(spec).name == "zoo-diff_v2", spec
    for spec in ("example", "example.yaml", "recipes/plans/example.yaml"):
        assert QuantPlan.load(spec).name == "logits-int6-head-w8-static", spec
    assert QuantPlan.load("w8a8").name == "w8a8"  # presets first


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    from diffquant.recipes import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "paper-table5.yaml").write_text("name: mine\nmodels: {a: 'init:baseline:tiny'}\n")
    assert load_recipe("paper-table5.yaml")["name"] == "mine"
    assert load_recipe("paper-table5")["name"] == "paper-table5"  # no file called that: the shipped one
    assert resolve("paper-table5.yaml", "run") == Path("paper-table5.yaml")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["run", "nope"],
            "recipe 'nope': no such file, and not a shipped recipe; shipped: kv-cache, kv-cache-long, kv-cache-zoo, ",
        ),
        (["train", "nope.yaml"], "training recipe 'nope.yaml': no such file, and not a shipped training "),
        (["run", "plans/example"], "recipe 'plans/example': no such file"),
        (["run", "zoo-diff_v2"], "recipe 'zoo-diff_v2': no such file, and not a shipped recipe"),
        (
            ["quantize", "init:baseline:tiny", "--plan", "nope", "--out", "q"],
            "plan 'nope': neither a preset nor a file; presets: ",
        ),
    ],
)
def test_a_name_that_is_neither_is_one_line_listing_what_ships(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err
    kind = {"run": "run", "train": "train", "quantize": "plan"}[argv[0]]
    assert all(name in err for name in shipped_names(kind)), err
    assert not list(tmp_path.iterdir())  # nothing written


def test_recipes_lists_every_shipped_file_with_a_description(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  ")}
    files = shipped()
    assert sorted(listed) == sorted(f.name for f in files)
    assert listed["paper-table5"] == "Table 5 view (activation outliers) for baseline / DIFF V1 / DIFF V2"
    assert listed["zoo-baseline"] == "The zoo's baseline model"  # no description key: the top comment
    # a top comment's sentence that ends inside a parenthesis drops the parenthesis
    assert listed["hellaswag_local"] == "HellaSwag from a local JSONL file in the dataset's own format"
    assert [line for line in lines if not line.startswith("  ")] == [
        "recipes (diffquant run NAME):",
        "training recipes (diffquant train NAME):",
        "plans (--plan NAME):",
        "lm-eval tasks (--task lmeval:tasks=NAME):",
    ]
