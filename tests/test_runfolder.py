"""One run per run folder (claim_run_folder: refuse another run's folder, force, resume, a lock held by
another process); checkpoint hashes in manifests (zoo:, fetch: without downloading)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from diffquant import DiffquantError
from diffquant.eval.sweep import SweepSpec, run_sweep
from diffquant.eval.tasks import parse_task
from diffquant.io.artifacts import (
    checkpoint_sha256,
    manifest,
    model_content_sha256,
    sha256_file,
    write_json_atomic,
)
from diffquant.io.runfolder import LOCK_FILE, RECORD_FILE, claim_run_folder

A = {"checkpoints": ["init:baseline:tiny"], "tokens": 256}
B = {"checkpoints": ["init:diff_v2:tiny"], "tokens": 256}


def _claim(*args, **kwargs) -> None:
    with claim_run_folder(*args, **kwargs):
        pass


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def test_profile_a_then_b_into_one_folder_is_refused(tmp_path):
    """`profile A --out X; profile B --out X`: B must not write into A's folder (report X would mix them)."""
    out = tmp_path / "X"
    with claim_run_folder(out, "profile", A):
        write_json_atomic(out / "manifest.json", manifest("profile", checkpoints=A["checkpoints"]))
        (out / "profile").mkdir()
        (out / "profile" / "a.json").write_text("{}")
    with pytest.raises(DiffquantError, match="holds a different profile run") as err:
        _claim(out, "profile", B)
    assert (
        "checkpoints changed" in _one_line(err) and "--out" in str(err.value) and "--force" in str(err.value)
    )
    with pytest.raises(DiffquantError, match=r"another run's artifacts \(a `profile` run, not `run`\)"):
        _claim(out, "run", A)
    with claim_run_folder(out, "profile", A):  # the same run may come back (resume / rewrite)
        assert (out / "profile" / "a.json").exists()


def test_artifacts_of_an_unclaimed_run_are_refused(tmp_path):
    """A manifest (or sweep.json) written without a claim: its run is unknown, so not this one's."""
    out = tmp_path / "X"
    write_json_atomic(out / "manifest.json", manifest("profile", checkpoints=A["checkpoints"]))
    with pytest.raises(DiffquantError, match=r"manifest.json of a `profile` run") as err:
        _claim(out, "profile", A)
    _one_line(err)
    sweep = tmp_path / "S"
    write_json_atomic(sweep / "sweep.json", {"fingerprint": "0" * 64, "spec": {}})
    with pytest.raises(DiffquantError, match=r"another run's artifacts \(sweep.json"):
        _claim(sweep, "sweep", A)


def test_force_starts_clean_but_never_empties_a_foreign_folder(tmp_path):
    out = tmp_path / "X"
    with claim_run_folder(out, "profile", A):
        write_json_atomic(out / "manifest.json", manifest("profile"))
        (out / "profile").mkdir()
        (out / "table5.txt").write_text("A")
    with claim_run_folder(out, "profile", B, force=True):
        assert {p.name for p in out.iterdir()} == {LOCK_FILE, RECORD_FILE}
    assert json.loads((out / RECORD_FILE).read_text()) == {"command": "profile", "identity": B}
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / "manifest.json").write_text('{"name": "a web app"}')  # not a diffquant manifest
    with pytest.raises(DiffquantError, match="a manifest.json"):
        _claim(mine, "profile", A)
    with claim_run_folder(mine, "profile", A, force=True):
        pass
    assert (mine / "notes.txt").read_text() == "keep"


def test_a_second_concurrent_run_is_refused_until_the_first_exits(tmp_path):
    out = tmp_path / "X"
    holder = textwrap.dedent(
        f"""
        import sys, time
        from diffquant.io.runfolder import claim_run_folder
        with claim_run_folder({str(out)!r}, "profile", {A!r}):
            print("claimed", flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        with pytest.raises(
            DiffquantError, match=rf"{out} is in use by another run \(pid {proc.pid}\)"
        ) as err:
            _claim(out, "profile", A)
        _one_line(err)
        with pytest.raises(DiffquantError, match="in use by another run"):  # force does not break a live lock
            _claim(out, "profile", A, force=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with claim_run_folder(out, "profile", A):  # the kernel released the dead run's lock
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())
    assert (out / LOCK_FILE).read_text() == ""  # released at exit
    with claim_run_folder(out, "profile", A):  # and can be taken again in the same process
        pass


@pytest.fixture()
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    return str(path)


def _sweep(text, models=("baseline",), plans=()):
    return SweepSpec(
        models={m: f"init:{m}:tiny" for m in models},
        plans=list(plans),
        tasks=[parse_task(f"bpb:data={text},tokens=256,seq_len=64")],
        calib_data=text,
        calib_tokens=128,
        calib_seq_len=64,
    )


def test_sweep_claims_its_folder(tmp_path, text):
    """A sweep into a profile's folder is refused; force starts clean; a resume is still a resume."""
    out = tmp_path / "X"
    with claim_run_folder(out, "profile", A):
        write_json_atomic(out / "manifest.json", manifest("profile"))
    with pytest.raises(DiffquantError, match="a `profile` run, not `sweep`"):
        run_sweep(_sweep(text), out)
    said: list[str] = []
    run_sweep(_sweep(text), out, force=True, log=said.append)
    assert not (out / "manifest.json").exists() and "1 already done" not in "\n".join(said)
    said.clear()
    assert run_sweep(_sweep(text), out, log=said.append)["complete"]
    assert "1 cells, 1 already done, 0 to run" in "\n".join(said)
    with pytest.raises(DiffquantError, match=r"holds a different sweep run \(models changed\)"):
        run_sweep(_sweep(text, models=("diff_v2",)), out)
    said.clear()
    run_sweep(_sweep(text, models=("diff_v2",)), out, force=True, log=said.append)
    assert (
        "0 already done" in "\n".join(said) and len((out / "cells-rank0.jsonl").read_text().splitlines()) == 1
    )


def test_zoo_and_fetch_checkpoints_have_a_sha256(tmp_path, monkeypatch):
    """zoo:NAME hashes its shipped weights; fetch:NAME hashes the cached file, or gives the pinned sha256
    when nothing is cached, without downloading."""
    from diffquant.io import fetch
    from diffquant.zoo import card, zoo_path

    assert checkpoint_sha256("zoo:baseline") == sha256_file(zoo_path("baseline") / "model.safetensors")
    assert checkpoint_sha256("zoo:baseline") == card("baseline")["sha256"]

    def no_download(*args, **kwargs):
        raise AssertionError("hashing must not download")

    monkeypatch.setattr(fetch, "_pip_download", no_download)
    monkeypatch.setenv("DIFFQUANT_CACHE", str(tmp_path / "cache"))
    assert checkpoint_sha256("fetch:smollm2") == fetch.SMOLLM2_SHA256
    cached = tmp_path / "cache" / "smollm2" / fetch.SMOLLM2_FILE
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as f:
        f.truncate(fetch.SMOLLM2_SIZE)  # sparse: the size fetch accepts, other bytes
    assert checkpoint_sha256("fetch:smollm2") == sha256_file(cached) != fetch.SMOLLM2_SHA256
    with pytest.raises(DiffquantError, match="unknown name 'nope'"):
        checkpoint_sha256("fetch:nope")


def test_model_content_sha256(tmp_path):
    from diffquant.io import init_model, save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(init_model("init:baseline:tiny:0"), ckpt)
    first = model_content_sha256(str(ckpt))
    assert model_content_sha256(str(ckpt)) == first
    save_checkpoint(init_model("init:baseline:tiny:1"), ckpt, overwrite=True)
    assert model_content_sha256(str(ckpt)) != first
    assert model_content_sha256("init:baseline:tiny") != model_content_sha256("init:diff_v2:tiny")
    assert model_content_sha256("zoo:baseline") != model_content_sha256("zoo:diff_v1")
    with pytest.raises(DiffquantError, match="neither a checkpoint folder nor a file"):
        model_content_sha256(str(tmp_path / "missing"))


def test_profile_refuses_a_link_a_checkpoint_or_an_input_as_out(tmp_path, capsys):
    """`profile --out LINK` (LINK -> a checkpoint folder) wrote into the checkpoint; an --out that is a
    checkpoint, lies inside one or is the model read is refused too, in one line, force or not."""
    from diffquant.cli import main
    from diffquant.io import init_model, save_checkpoint

    ckpt = save_checkpoint(init_model("init:baseline:tiny"), tmp_path / "ckpt")
    before = sorted(p.name for p in ckpt.iterdir())
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    common = ["--quiet", "profile", "init:baseline:tiny", "--tokens", "64", "--seq-len", "32"]
    cases = [
        (link, "is a symbolic link"),
        (ckpt, "is a checkpoint folder"),
        (ckpt / "runs", "lies inside"),
    ]
    for out, words in cases:
        for force in ([], ["--force"]):
            assert main([*common, "--out", str(out), *force]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and words in err and str(out) in err, err
    other = ["--quiet", "profile", str(ckpt), "--tokens", "64", "--seq-len", "32", "--out", str(ckpt)]
    assert main(other) == 2 and "checkpoint folder" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written into the checkpoint
    assert not (ckpt / "runs").exists()


def test_a_foreign_manifest_with_a_command_key_is_not_a_run_folder(tmp_path):
    """Another tool's manifest.json with `command` (and even `versions`) keys is not diffquant's: refused
    without --force, and --force leaves its files alone."""
    mine = tmp_path / "tool"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / "manifest.json").write_text('{"command": "deploy", "versions": {"node": "18"}}')
    with pytest.raises(DiffquantError, match=r"\(a manifest.json, written by a run"):
        _claim(mine, "profile", A)
    with claim_run_folder(mine, "profile", A, force=True):
        pass
    assert (mine / "notes.txt").read_text() == "keep" and (mine / "manifest.json").exists()
    ours = tmp_path / "ours"  # a manifest diffquant wrote (no claim record): recognised, force cleans it
    write_json_atomic(ours / "manifest.json", manifest("profile"))
    with pytest.raises(DiffquantError, match="manifest.json of a `profile` run"):
        _claim(ours, "profile", A)
    with claim_run_folder(ours, "profile", A, force=True):
        assert not (ours / "manifest.json").exists()
