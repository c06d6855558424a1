"""Streamed runs under torchrun: each rank streams its own batches (batch i on rank i % world, at its global
sample indices, as the whole-model profile shards) and rank 0 merges them the way the whole-model profile
does; static scales are calibrated on all the calibration windows on every rank; a streamed eval cell runs
on any rank. Merged results equal the one-process run (profiles to float64 rounding: the moments are merged
in another order; exactly the whole-model run under the same torchrun)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close_tree

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.io import load_model, save_checkpoint
from diffquant.profile.profiler import Profiler, merge_profiles
from diffquant.profile.runner import shard_starts
from diffquant.quant import apply_plan, calibrate, preset
from diffquant.stream import profile_streamed

KINDS = ("baseline", "diff_v2")
# 256 tokens in windows of 32: 8 windows, batches of 3: 3 batches, not a multiple of the 2 ranks
PROFILE = ["--tokens", "256", "--seq-len", "32", "--batch-size", "3", "--topk", "8"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamtorchrun")
    return {k: save_checkpoint(load_model(f"init:{k}:tiny"), root / k) for k in KINDS}


def _torchrun(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [*TORCHRUN, "-m", "diffquant.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _profiles(out) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "profile").glob("*.json"))}


@pytest.mark.slow
def test_profile_stream_on_under_torchrun_equals_one_process(folders, tmp_path, capsys):
    specs = [str(folders[k]) for k in KINDS]
    _torchrun(["profile", *specs, *PROFILE, "--stream", "on", "--out", str(tmp_path / "two")])
    _torchrun(["profile", *specs, *PROFILE, "--out", str(tmp_path / "two-whole")])
    assert main(["profile", *specs, *PROFILE, "--stream", "on", "--out", str(tmp_path / "one")]) == 0
    assert main(["profile", *specs, *PROFILE, "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    two, one = _profiles(tmp_path / "two"), _profiles(tmp_path / "one")
    assert set(two) == set(KINDS)
    # the same ranks' batches merged the same way: exactly the whole-model profile under torchrun
    assert two == _profiles(tmp_path / "two-whole")
    assert one == _profiles(tmp_path / "whole")
    assert_close_tree(two, one, rel=1e-9)
    for profile in two.values():
        assert profile["meta"]["windows"] == 8 and profile["meta"]["samples"] == 8
    samples = {
        entry["loc"]["sample"]
        for profile in two.values()
        for site in profile["sites"].values()
        for entry in site["top"]
    }
    assert samples > {3, 4, 5}  # rank 1's batch, at its global indices
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["streamed"] == list(KINDS)


def test_static_plan_shards_calibrate_on_all_windows(folders):
    """Each shard of a profile under a static plan (w8a8-tensor) calibrates on every calibration window, as
    the whole-model calibrate does on every rank: the merged shards are the one-process and whole-model
    profile; a rank with no batch (4 ranks, 3 batches) adds nothing and reads no weights."""
    spec = str(folders["diff_v2"])
    windows = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(3))
    calib = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(4))
    common = {"batch_size": 3, "topk": 8, "plan": "w8a8-tensor", "calibration": calib}
    one = profile_streamed(spec, windows, **common).to_dict()
    model = load_model(spec)
    apply_plan(model, preset("w8a8-tensor"))
    calibrate(model, calib, batch_size=3)
    with torch.no_grad(), Profiler(model, topk=8) as prof:
        for start in range(0, 7, 3):
            prof.start_samples_at(start)
            model(windows[start : start + 3])
    assert one == prof.take().to_dict()
    for world in (2, 4):
        stats: list[dict] = [{} for _ in range(world)]
        parts = [
            profile_streamed(spec, windows, **common, shard=(r, world), stats=stats[r]) for r in range(world)
        ]
        assert [p.meta["samples"] for p in parts] == [
            sum(min(3, 7 - s) for s in shard_starts(7, 3, r, world)) for r in range(world)
        ]
        assert_close_tree(merge_profiles(parts).to_dict(), one, f"world {world}", rel=1e-9)
    assert stats[3]["batches"] == 0 and stats[3]["stages"] == 0  # 4 ranks, 3 batches: nothing read
    rank1 = profile_streamed(spec, windows, **common, shard=(1, 2)).to_dict()
    locations = {e["loc"]["sample"] for site in rank1["sites"].values() for e in site["top"]}
    assert locations <= {3, 4, 5}  # batch 1's global sample indices
    with pytest.raises(DiffquantError, match="expected 0 <= rank < world, got rank 2 of world 2"):
        profile_streamed(spec, windows, shard=(2, 2))


def test_shard_starts_is_round_robin():
    assert shard_starts(8, 3) == [0, 3, 6]
    assert shard_starts(8, 3, 0, 2) == [0, 6] and shard_starts(8, 3, 1, 2) == [3]
    assert shard_starts(2, 3, 1, 2) == []


@pytest.mark.slow
def test_eval_stream_on_under_torchrun_equals_one_process(folders, tmp_path, capsys):
    """Cells are spread over ranks: the static-plan cells (w8a8-tensor) run streamed on rank 1."""
    specs = [str(folders[k]) for k in KINDS]
    args = ["eval", *specs, "--task", "bpb:tokens=600,seq_len=48", "--batch-size", "3"]
    args += ["--plan", "w8a8-tensor", "--stream", "on"]
    _torchrun([*args, "--out", str(tmp_path / "two")])
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    rank1 = [json.loads(line) for line in (tmp_path / "two" / "cells-rank1.jsonl").read_text().splitlines()]
    assert {(r["model"], r["plan"]) for r in rank1} == {(k, "w8a8-tensor") for k in KINDS}
    for name in ("results.json", "results.csv"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
