"""RunOptions: a command's or a recipe's --device / --dtype / --stream / --device-map parsed once, where it
starts, and passed down (diffquant.io.options, diffquant.stages.parse_run_options)."""

from __future__ import annotations

import pytest
import torch
import yaml

import diffquant.io.options as io_options
from diffquant.cli import main
from diffquant.eval.sweep import SweepSpec
from diffquant.io.options import RunOptions, parse_device, parse_dtype, run_options
from diffquant.options import DEFAULT_TOPK, ProfileStage
from diffquant.profile.profiler import Profiler
from diffquant.profile.runner import profile_model
from diffquant.stream import profile_streamed

TINY = "init:baseline:tiny"
TEXT = "stdlib:validation"


@pytest.fixture
def parsed(monkeypatch) -> list:
    """The argument of every parse_device call (the one parser of --device) while the test runs."""
    seen: list = []
    real = io_options.parse_device

    def counting(name):
        seen.append(name)
        return real(name)

    monkeypatch.setattr(io_options, "parse_device", counting)
    return seen


def _strings(seen: list) -> list:
    """The calls that parsed text (a torch.device passed on is returned as it is: not a parse)."""
    return [s for s in seen if not isinstance(s, torch.device)]


PROFILE = ["--data", TEXT, "--tokens", "64", "--seq-len", "32", "--sites", "kind:resid", "--device", "cpu"]
COMMANDS = {
    "info": ["info", TINY, "--device", "cpu"],
    "profile": ["profile", TINY, *PROFILE, "--out", "{out}"],
    "profile-streamed": ["profile", "zoo:baseline", *PROFILE, "--stream", "on", "--out", "{out}"],
    "quantize": [
        "quantize", TINY, "--plan", "w8a8", "--calib-data", TEXT, "--calib-tokens", "64", "--seq-len", "32",
        "--eval-tokens", "64", "--device", "cpu", "--out", "{out}",
    ],
    "eval": [
        "eval", TINY, "--task", f"bpb:data={TEXT},tokens=64,seq_len=32", "--plan", "w8a8", "--calib-data", TEXT,
        "--calib-tokens", "64", "--calib-seq-len", "32", "--device", "cpu", "--out", "{out}",
    ],
    "eval-streamed": [
        "eval", "zoo:baseline", "--task", f"bpb:data={TEXT},tokens=64,seq_len=32", "--stream", "on",
        "--device", "cpu", "--out", "{out}",
    ],
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_parses_its_device_once(command, tmp_path, parsed, capsys):
    """One parse of --device per command, whatever it runs (loads, streams, quantizes, sweeps): each stage
    and library call below receives the parsed device, and none asks CUDA again."""
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in COMMANDS[command]]
    assert main(argv) == 0, capsys.readouterr().err
    assert _strings(parsed) == ["cpu"]


def test_a_recipe_parses_its_device_once(tmp_path, parsed, capsys):
    """A recipe's profile, quantize and sweep stages share the options parsed when the run starts."""
    recipe = {
        "name": "once",
        "device": "cpu",
        "models": {"tiny": TINY},
        "data": {"calib": {"source": TEXT, "tokens": 64, "seq_len": 32}},
        "profile": {"data": TEXT, "tokens": 64, "seq_len": 32, "sites": ["kind:resid"]},
        "quantize": {"plans": ["w8a8"], "eval_tokens": 64},
        "eval": {"tasks": [{"type": "bpb", "data": TEXT, "tokens": 64, "seq_len": 32}]},
        "sweep": {"plans": ["w8a8"]},
        "plots": {"enabled": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert _strings(parsed) == ["cpu"]


def test_a_parsed_device_is_not_parsed_again(monkeypatch):
    """A torch.device / torch.dtype given to the one helper is taken as it is: CUDA is not asked (a device
    the machine lacks passes through: whoever parsed it checked it)."""

    def no_cuda(*_):
        raise AssertionError("CUDA asked again")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", no_cuda)
    options = run_options(torch.device("cuda:7"), torch.bfloat16, stream="on")
    assert options == RunOptions(torch.device("cuda:7"), torch.bfloat16, "on", None)
    assert parse_device(options.device) is options.device and parse_dtype(torch.float16) is torch.float16
    assert run_options() == RunOptions(torch.device("cpu"), None, "off", None)
    assert parse_dtype("bf16") is torch.bfloat16 and parse_device("cpu") == torch.device("cpu")


def test_a_sweep_spec_parses_its_strings_once_and_keeps_them_as_written(parsed):
    """A SweepSpec built from strings parses them at its first use, once; its identity keeps the strings
    (a resumed sweep's cells keep their keys); one given parsed options parses nothing."""
    spec = SweepSpec(models={"m": TINY}, device="cpu", dtype="fp32")
    assert spec.parsed() is spec.parsed() and spec.parsed().dtype is torch.float32
    assert _strings(parsed) == ["cpu"]
    assert (spec.to_dict()["device"], spec.to_dict()["dtype"]) == ("cpu", "fp32")
    given = RunOptions(torch.device("cpu"), torch.float32)
    assert SweepSpec(models={"m": TINY}, options=given).parsed() is given and len(parsed) == 1


def test_topk_default_is_one_constant(tmp_path):
    """--topk's default is written once (diffquant.options.DEFAULT_TOPK): the option's, the Profiler's and
    the profile entry points' defaults are that constant."""
    import inspect

    from diffquant.schema import fields_of

    topk = next(f for f, _ in fields_of(ProfileStage) if f.name == "topk")
    assert topk.default == DEFAULT_TOPK == 100
    for fn in (Profiler.__init__, profile_model, profile_streamed):
        assert inspect.signature(fn).parameters["topk"].default == DEFAULT_TOPK, fn
