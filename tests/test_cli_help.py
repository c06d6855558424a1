"""The command line's help: instant (building the parser imports no torch), complete (every option has a help
text with its default), and pointing at what ships (recipe names, where recipe keys are documented).

Timing itself is measured by analysis/cli/help_latency.py (a table, not a test: wall time depends on the
machine); these tests pin down the cause of slowness instead: a heavy library imported by the parser.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from diffquant.cli import build_parser, main
from diffquant.shipped import shipped_names

HEAVY = ("torch", "numpy", "matplotlib", "transformers", "lm_eval", "safetensors", "yaml")
OTHER_HELPERS = ("plot", "report")  # their options are owned elsewhere (not checked here)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_and_version_import_no_heavy_library():
    """`--help`, `--version` and every `COMMAND --help`, in one fresh interpreter (this test process has
    imported torch already, which would hide an import): none of them imports torch, numpy, matplotlib,
    transformers, lm_eval, safetensors or yaml."""
    code = f"""
import contextlib, io, json, sys
from diffquant.cli import build_parser, main
parser = build_parser()
after_build = sorted(m for m in {HEAVY!r} if m in sys.modules)
commands = [[], *[[c] for c in {sorted(_subparsers(build_parser()))!r}]]
for argv in [["--version"]] + [c + ["--help"] for c in commands]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
        except SystemExit as stop:
            assert stop.code == 0, (argv, out.getvalue())
    assert out.getvalue().strip(), argv
print(json.dumps({{"after_build": after_build, "after_all": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == {"after_build": [], "after_all": []}, imported


def _checked_actions():
    parser = build_parser()
    yield "diffquant", parser
    for name, sub in _subparsers(parser).items():
        if name not in OTHER_HELPERS:
            yield name, sub


def test_every_option_has_a_help_that_states_its_default():
    """Every argument of every subcommand (plot / report aside) says what it is; an option with a default
    value says it (`(default: ...)`): a switch's default is off and needs no words, nor a required option."""
    missing, silent = [], []
    for command, parser in _checked_actions():
        for action in parser._actions:
            if isinstance(
                action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction
            ):
                continue
            if action.help == argparse.SUPPRESS:
                continue
            name = f"{command} {action.option_strings[0] if action.option_strings else action.dest}"
            if not action.help:
                missing.append(name)
                continue
            switch = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
            has_default = action.default not in (None, [], argparse.SUPPRESS)
            stated = "default" in action.help
            if action.option_strings and not switch and not action.required and has_default and not stated:
                silent.append(f"{name} (default {action.default!r})")
    assert not missing, f"arguments without help: {missing}"
    assert not silent, f"options whose help does not state the default: {silent}"


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_run_and_train_help_name_the_shipped_recipes_and_the_docs(capsys):
    run = _help(["run"], capsys)
    assert "docs/recipes.md" in run
    for name in shipped_names("run"):
        assert name in run.replace("- ", "-"), name  # argparse may wrap a name at its hyphen
    assert "zoo-diff_v2" not in run  # training recipes are train's, not run's
    train = _help(["train"], capsys)
    for name in shipped_names("train"):
        assert name in train.replace("- ", "-"), name  # argparse may wrap a name at its hyphen
    assert "docs/recipes.md" in train


def test_profile_topk_help_shows_its_default(capsys):
    assert "(default: 100; at most 10000)" in _help(["profile"], capsys)


def test_eval_help_lists_exactly_the_task_types_that_run(capsys):
    """`eval --help` reads the torch-free parameter table; each of its types has a runner and no runner is
    missing from it (same order: the help's and the messages')."""
    from diffquant.eval.task_params import TASK_TYPE_PARAMS
    from diffquant.eval.tasks import TASK_TYPES

    assert list(TASK_TYPES) == list(TASK_TYPE_PARAMS)
    assert all(TASK_TYPES[name].params is params for name, params in TASK_TYPE_PARAMS.items())
    text = _help(["eval"], capsys)
    assert (
        "types and their keys: bpb (data, tokens, seq_len, stride, windows, decode, bos, intervene, intervene_layer); ppl ("
        in text
    )
    assert "lmeval (tasks [required], path, limit," in text
