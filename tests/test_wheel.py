"""The wheel carries what the commands need: built from this tree, installed into a fresh virtual environment,
and run from an empty folder, shipped recipes, plans and lm-eval tasks work by name.

Cheap on purpose: ``pip wheel --no-build-isolation`` (this environment's setuptools, no download), a venv
without pip whose dependencies come from this environment's site-packages through a ``.pth`` line (only
diffquant itself is installed, from the wheel), toy sizes for each command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DATA = Path(__file__).parent / "data" / "lmeval"

pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "DIFFQUANT_QUIET": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the installed copy, not this tree
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, (
        f"{argv}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this tree installed (diffquant only; the rest from this environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "diffquant", src / "diffquant", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)], tmp)
    (wheel,) = dist.glob("diffquant-*.whl")
    env = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], tmp)
    python = env / "bin" / "python"
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], tmp)
    # after the install (pip must not see this environment's editable diffquant): the dependencies
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp
        ).stdout.strip()
    )
    (site / "_deps_from_parent.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env


def test_the_installed_wheel_runs_shipped_files_by_name_from_an_empty_folder(venv, tmp_path):
    work = tmp_path / "empty"
    work.mkdir()
    bin_ = venv / "bin"
    where = _run([str(bin_ / "python"), "-c", "import diffquant.shipped as s; print(s.RECIPES_DIR)"], work)
    shipped = Path(where.stdout.strip())
    assert shipped.is_relative_to(venv) and not shipped.is_relative_to(ROOT), shipped  # not this tree
    assert (shipped / "plans" / "example.yaml").is_file() and (
        shipped / "lmeval" / "wikitext_local.yaml"
    ).is_file()

    listed = _run([str(bin_ / "diffquant"), "recipes"], work).stdout
    for name in ("paper-table5", "zoo-diff_v2", "example", "wikitext_local"):
        assert f"  {name} " in listed, listed

    # a shipped recipe by name, at a toy size (one random tiny model, 512 tokens, no figures)
    toy = [
        "--set",
        "models={tiny: 'init:baseline:tiny'}",
        "--set",
        "profile.tokens=512",
        "--set",
        "profile.seq_len=64",
        "--set",
        "plots.enabled=false",
    ]
    _run([str(bin_ / "diffquant"), "run", "paper-table5", *toy, "--out", "table5"], work)
    assert "tiny" in (work / "table5" / "table5.txt").read_text()

    # a shipped plan by file name
    quantize = ["quantize", "init:baseline:tiny", "--plan", "example.yaml", "--out", "q"]
    _run(
        [
            str(bin_ / "diffquant"),
            *quantize,
            "--calib-tokens",
            "256",
            "--seq-len",
            "64",
            "--eval-tokens",
            "256",
        ],
        work,
    )
    assert "logits-int6-head-w8-static" in (work / "q" / "quant_plan.json").read_text()

    # a shipped lm-eval task (its YAML names diffquant's own process_docs: trusted because it ships)
    shutil.copy(DATA / "wikitext.jsonl", work / "wiki.jsonl")
    task = "lmeval:tasks=wikitext_local,path=wiki.jsonl,limit=2"
    _run([str(bin_ / "diffquant"), "eval", "init:baseline:tiny", "--task", task, "--out", "ev"], work)
    assert "word_perplexity" in (work / "ev" / "results.csv").read_text()
    assert sorted(p.name for p in work.iterdir()) == [
        "ev",
        "q",
        "table5",
        "wiki.jsonl",
    ]  # nothing else written
