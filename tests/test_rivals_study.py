"""The rivals study as committed (issue 30): the recipe covers the whole matched zoo, the documented printout is
the run's, and its seed aggregates are the mean and spread of its own per-model numbers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from docpages import doc_block

from diffquant.shipped import RECIPES_DIR
from diffquant.zoo import zoo_names

STUDY = Path(__file__).parents[1] / "analysis" / "rivals"


def test_the_recipe_runs_every_zoo_model_under_its_own_name():
    recipe = yaml.safe_load((RECIPES_DIR / "rivals.yaml").read_text())
    assert recipe["models"] == {name: f"zoo:{name}" for name in zoo_names()}


def test_the_documented_printout_is_the_runs():
    _, _, shown = doc_block("diffquant run rivals")
    printed = (STUDY / "rivals.txt").read_text().splitlines()
    at = 0
    for line in (line for line in shown if line != "..."):
        assert line in printed[at:], line  # in the run's order
        at = printed.index(line, at) + 1


def test_the_seed_aggregates_are_the_per_model_numbers_averaged():
    models = json.loads((STUDY / "table5.json").read_text())["models"]
    doc = json.loads((STUDY / "table5_seeds.json").read_text())
    assert sorted(m for ms in doc["groups"].values() for m in ms) == sorted(models)
    for group, members in doc["groups"].items():
        for activation in ("attention logits", "hidden states"):
            for column in ("top1", "median"):
                values = [models[m]["table5"][activation][column] for m in members]
                got = doc["table5"][group][activation][column]
                assert got["n"] == len(values)
                assert got["mean"] == pytest.approx(statistics.mean(values), rel=1e-12)
                assert got["sd"] == pytest.approx(statistics.stdev(values), rel=1e-12)
        rates = [100 * models[m]["sink_rate"]["rate"] for m in members]
        assert doc["sink_rate"][group]["mean"] == pytest.approx(statistics.mean(rates), rel=1e-12, abs=1e-12)
