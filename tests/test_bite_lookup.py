"""Every lookup path of a shipped name lets a local file of the same name win (issue 47 item 4).

A shipped name (``smollm2``, ``example``, ``zoo-diff_v2``, ``wikitext_local``) is a fallback: when the user
has a file of that name (``NAME.yaml``, the clone's spelling ``recipes/.../NAME.yaml``, or a bare ``NAME``)
the file is what runs. Checked for every shipped name of every kind, through the function each command
calls and through the commands themselves: ``run`` and ``train`` (the recipe handed on is the local one),
``quantize --plan`` whole and streamed, ``eval --plan`` (the plan in the run's results), recipes naming
plans, and lm-eval tasks, where a task YAML of a shipped task's name on the include path is the task lm-eval
runs (its requests, its metrics) and the one a local data file is checked against.

The fixtures are the shipped files themselves, copied with a new ``name`` (a plan, a run recipe, a training
recipe), and an lm-eval task of the shipped name over a JSONL file written here.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from diffquant.cli import main
from diffquant.shipped import LMEVAL_DIR, PLANS_DIR, RECIPES_DIR, resolve, shipped_names

FOLDERS = {"run": RECIPES_DIR, "train": RECIPES_DIR, "plan": PLANS_DIR}
CLONE = {"run": "recipes", "train": "recipes", "plan": "recipes/plans"}


def _copy_renamed(kind: str, name: str, target: Path, new_name: str) -> Path:
    """The shipped file ``name`` of ``kind`` copied to ``target`` with its top-level ``name:`` changed."""
    lines = (FOLDERS[kind] / f"{name}.yaml").read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("name:"))
    lines[index] = f"name: {new_name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n")
    return target


def _spellings(kind: str, name: str) -> list[tuple[str, str]]:
    """(spec, file to create) for each spelling of a local file of a shipped name."""
    return [
        (f"{name}.yaml", f"{name}.yaml"),
        (name, name),
        (f"./{name}.yaml", f"{name}.yaml"),
        (f"{CLONE[kind]}/{name}.yaml", f"{CLONE[kind]}/{name}.yaml"),
    ]


def _loaders():
    from diffquant.quant.plan import QuantPlan
    from diffquant.recipes import load_recipe
    from diffquant.train.trainer import TrainConfig

    return {
        "run": lambda spec: load_recipe(spec)["name"],
        "train": lambda spec: TrainConfig.load(spec).name,
        "plan": lambda spec: QuantPlan.load(spec).name,
    }


@pytest.mark.parametrize("kind", ["run", "train", "plan"])
def test_a_local_file_of_a_shipped_name_wins_in_every_spelling(kind, tmp_path, monkeypatch):
    """Every shipped name of ``kind`` in one of the spellings (all four for the first name)."""
    monkeypatch.chdir(tmp_path)
    load = _loaders()[kind]
    names = shipped_names(kind)
    assert names
    cases = [(names[0], s) for s in _spellings(kind, names[0])]
    cases += [(name, _spellings(kind, name)[i % 4]) for i, name in enumerate(names[1:], start=1)]
    for name, (spec, file) in cases:
        shipped = load(str(FOLDERS[kind] / f"{name}.yaml"))
        assert load(spec) == shipped, (spec, "no local file: the shipped one")
        local = _copy_renamed(kind, name, tmp_path / file, f"mine-{name}")
        assert load(spec) == f"mine-{name}", spec
        if kind != "plan":
            assert resolve(spec, kind).resolve() == local.resolve(), spec
        local.unlink()


def test_run_and_train_commands_hand_on_the_local_recipe(tmp_path, monkeypatch):
    import diffquant.recipes
    import diffquant.train.trainer

    monkeypatch.chdir(tmp_path)
    seen: list[str] = []
    monkeypatch.setattr(diffquant.recipes, "run_recipe", lambda recipe, *a, **k: seen.append(recipe["name"]))
    monkeypatch.setattr(diffquant.train.trainer, "train", lambda cfg, **k: seen.append(cfg.name))
    for command, kind, name in (("run", "run", "smollm2"), ("train", "train", "zoo-diff_v2")):
        out: list[str] = []  # train without --out: the shipped zoo recipes name no out (runs/train/NAME)
        for spec, file in _spellings(kind, name):
            local = _copy_renamed(kind, name, tmp_path / file, f"mine-{command}")
            assert main(["--quiet", command, spec, *out]) == 0
            assert seen.pop() == f"mine-{command}", (command, spec)
            local.unlink()
            assert main(["--quiet", command, spec, *out]) == 0
            assert not seen.pop().startswith("mine"), (command, spec)  # no local file: the shipped one


class _Loaded(Exception):
    """Raised by the spy once a command has loaded its plan: the rest of the command is not under test."""


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "zoo:baseline", "--out", "q"],
        ["quantize", "zoo:baseline", "--out", "q", "--stream", "on"],
        ["eval", "zoo:baseline", "--task", "ppl:tokens=64,seq_len=64", "--out", "e"],
    ],
    ids=["quantize", "quantize-stream", "eval"],
)
def test_commands_with_a_plan_read_the_local_plan(argv, tmp_path, monkeypatch):
    """The plan each command loads (whatever function it goes through) is the local file's."""
    from diffquant.quant.plan import QuantPlan

    monkeypatch.chdir(tmp_path)
    original = QuantPlan.load.__func__
    loaded: list[str] = []

    def spy(cls, spec):
        loaded.append(original(cls, spec).name)
        raise _Loaded

    monkeypatch.setattr(QuantPlan, "load", classmethod(spy))
    for spec, file in _spellings("plan", "example"):
        local = _copy_renamed("plan", "example", tmp_path / file, "mine")
        with pytest.raises(_Loaded):
            main(["--quiet", *argv, "--plan", spec])
        assert loaded.pop() == "mine", spec
        local.unlink()
    assert not list(tmp_path.glob("q*")) and not list(tmp_path.glob("e*"))


def test_a_recipe_and_a_sweep_read_the_local_plan(tmp_path, monkeypatch):
    """A run recipe's quantize and sweep stages name plans: each is the local file (the recipe checks
    them as it loads, the sweep loads them again)."""
    from diffquant.eval.sweep import load_plans
    from diffquant.quant.plan import QuantPlan
    from diffquant.recipes import load_recipe

    monkeypatch.chdir(tmp_path)
    original = QuantPlan.load.__func__
    loaded: list[str] = []

    def spy(cls, spec):
        plan = original(cls, spec)
        loaded.append(plan.name)
        return plan

    monkeypatch.setattr(QuantPlan, "load", classmethod(spy))
    _copy_renamed("plan", "example", tmp_path / "example.yaml", "mine")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodels: {a: 'zoo:baseline'}\nquantize: {plans: [example.yaml]}\n"
        "sweep: {plans: [none, example.yaml]}\n"
    )
    load_recipe(str(recipe))
    assert loaded and set(loaded) == {"mine"}
    loaded.clear()
    plans = load_plans(types.SimpleNamespace(plans=["none", "example.yaml"]))  # what a sweep reads: its plans
    assert plans["none"] is None and plans["example.yaml"].name == "mine" and loaded == ["mine"]


# ------------------------------------------------------------------------------------------ lm-eval
LOCAL_TASK = """task: {name}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _recorder():
    from lm_eval.api.model import LM

    class Recorder(LM):
        """An lm-eval model that scores every continuation alike and keeps the requests it was sent."""

        def __init__(self) -> None:
            super().__init__()
            self.requests: list[tuple] = []

        def loglikelihood(self, requests):
            self.requests += [tuple(r.args) for r in requests]
            return [(-1.0, True) for _ in requests]

        def loglikelihood_rolling(self, requests):
            self.requests += [tuple(r.args) for r in requests]
            return [-1.0 for _ in requests]

        def generate_until(self, requests):
            self.requests += [tuple(r.args) for r in requests]
            return ["" for _ in requests]

    return Recorder()


_LMEVAL_NAMES = sorted(p.stem for p in LMEVAL_DIR.glob("*.yaml"))


@pytest.mark.slow  # two lm-eval runs per task: seconds each
@pytest.mark.parametrize("name", _LMEVAL_NAMES)
def test_an_lmeval_task_of_a_shipped_name_on_the_include_path_is_the_one_that_runs(name, tmp_path):
    pytest.importorskip("lm_eval")
    from diffquant.eval.lmeval import check_lmeval, run_lmeval

    data = tmp_path / "local.jsonl"
    data.write_text(
        "".join(json.dumps({"context": f"local context {i}", "target": f"t{i}"}) + "\n" for i in range(3))
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{name}.yaml").write_text(LOCAL_TASK.format(name=name, data=data))
    local = check_lmeval([name], include_path=tasks)
    assert local.configs[name][1] == (tasks / f"{name}.yaml").resolve()
    lm = _recorder()
    out = run_lmeval(lm, [name], include_path=tasks, limit=2, bootstrap_iters=0)
    assert out[name]["acc"] == 1.0 and out[name]["n_samples"] == 2
    assert sorted(lm.requests) == [("local context 0", " t0"), ("local context 1", " t1")]
    # a data file given for the task is checked against the local task's fields (context, target), not the
    # shipped task's, and read by the local task
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"context": "given", "target": "file"}) + "\n")
    lm = _recorder()
    out = run_lmeval(lm, [name], include_path=tasks, data_files=other, bootstrap_iters=0)
    assert lm.requests == [("given", " file")] and out[name]["acc"] == 1.0
