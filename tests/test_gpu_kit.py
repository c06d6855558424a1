"""The GPU kit (analysis/gpu, issue 31): its rehearsal on CPU runs every stage for real at toy sizes, and the
parts that only the GPU run would reach (the size check, the model-size choice, the kernel goals, the capped
zips, the trimmed wheel, the offline install, the test-shard parsing, the corpus) are checked here on their own.

A GPU machine is lent for minutes; the kit is only worth those minutes if it runs the first time, so every
checkout proves it still does.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
KIT = ROOT / "analysis" / "gpu"
sys.path.insert(0, str(KIT))

import kit  # noqa: E402
import kit_stages  # noqa: E402
import kit_trio  # noqa: E402

MIB = 2**20


# ------------------------------------------------------------------------------------------- rehearsal
def _kit_call(out: Path, work: Path, *args: str) -> subprocess.Popen:
    """`bash analysis/gpu/run.sh --rehearse ARGS`, as a checkout runs it, started (stdout and stderr
    together), its results into ``out``."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = ["bash", str(KIT / "run.sh"), "--rehearse", "--work", str(work), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kit_py(*args: str) -> subprocess.CompletedProcess:
    """`python analysis/gpu/kit.py ARGS`, its output captured."""
    cmd = [sys.executable, str(KIT / "kit.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """`bash analysis/gpu/run.sh --rehearse`, as a checkout runs it: (the finished process, summary, out,
    work)."""
    base = tmp_path_factory.mktemp("kit")
    out, work = base / "out", base / "work"
    proc = _kit_call(out, work)
    output, _ = proc.communicate(timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, ""), summary, out, work


@pytest.mark.slow
def test_the_rehearsal_runs_every_stage(rehearsal):
    proc, summary, out, _ = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = summary["stages"]
    assert list(stages) == list(kit.DEFAULT_STAGES)
    status = {name: stage["status"] for name, stage in stages.items()}
    assert status == {
        "env": "ok",
        "gpu_tests": "skipped",
        "kernels_bench": "skipped",
        "autocast_gap": "skipped",
        "cli": "ok",
        "trio": "ok",
    }
    for name in ("gpu_tests", "kernels_bench", "autocast_gap"):
        assert "no CUDA" in stages[name]["reason"]
    for stage in stages.values():
        assert stage["wall_s"] > 0 and stage["numbers"]
    # what a CPU can do for the GPU-only stages, it did
    assert stages["gpu_tests"]["numbers"]["collected"] >= 50
    assert stages["kernels_bench"]["numbers"]["smoke_rows"] == 16  # 8 variants x 2 distributions
    assert {g["goal"] for g in stages["kernels_bench"]["numbers"]["issue46_goals"]} == {1, 2, 3, 4}
    assert stages["kernels_bench"]["numbers"]["goals"]["assessable"] is False
    # issue 45's early-gap question: baseline and DIFF V2 in fp32 and bf16, every step's loss, the gap
    gap = stages["autocast_gap"]["numbers"]
    steps = gap["steps"]
    assert set(gap["runs"]) == {f"{k} {p}" for k in ("baseline", "diff_v2") for p in ("fp32", "bf16")}
    assert all(len(run["loss"]) == steps for run in gap["runs"].values())
    for p in ("fp32", "bf16"):
        expected = gap["runs"][f"diff_v2 {p}"]["loss"][-1] - gap["runs"][f"baseline {p}"]["loss"][-1]
        assert gap["gap"][p] == pytest.approx(expected, abs=1e-4)
    assert gap["runs"]["baseline fp32"]["loss"] != gap["runs"]["baseline bf16"]["loss"]  # autocast engaged
    # the CLI: every command ran and left numbers
    commands = stages["cli"]["numbers"]["commands"]
    assert {c for c, r in commands.items() if r["status"] == "ok"} >= {
        "profile",
        "quantize-zoo",
        "quantize-mid",
        "eval",
    }
    assert set(commands["profile"]["table5"]) == {"diff_v2", "mid-diff_v2"}
    assert commands["quantize-zoo"]["logits_error"]["sqnr_db"] > 20
    assert set(commands["eval"]["bpb"]["diff_v2"]) == {"none", *kit_stages.EVAL_PLANS}
    # a site update's two top-k searches timed per size (on a CPU both are the host search: same state)
    topk = stages["cli"]["numbers"]["profile_topk"]
    assert topk["rc"] == 0 and [r["entries"] for r in topk["rows"]] == [4096, 16384]
    assert all(r["same_state"] for r in topk["rows"])
    # a tiny profile's host syncs, counted by the device check's stand-in on a CPU: one per site update and
    # per batch, and the mask's one read (what a GPU's count, CUDA's own, is read against)
    syncs = stages["cli"]["numbers"]["profile_syncs"]
    assert syncs["rc"] == 0 and [(r["kind"], r["counted_by"], r["syncs"]) for r in syncs["rows"]] == [
        ("diff_v1", "stand-in", 69),
        ("diff_v2", "stand-in", 69),
    ]
    assert (
        "a tiny profile's host syncs (stand-in: 69): diff_v1 69 (stand-in)"
        in (out / "digest.txt").read_text()
    )
    # the output that comes back: the summary, the digest, two zips, nothing over the limits
    files = sorted(p.name for p in out.iterdir())
    assert files == ["digest.txt", "profiles.zip", "results.zip", "summary.json"]
    assert all(p.stat().st_size <= 16 * MIB for p in out.iterdir())
    digest = (out / "digest.txt").read_text()
    assert "trio, bits per byte" in digest and digest in proc.stdout


@pytest.mark.slow
def test_the_rehearsal_trains_and_sweeps_a_matched_trio(rehearsal):
    _, summary, out, work = rehearsal
    trio = summary["stages"]["trio"]["numbers"]
    assert trio["choice"]["measured"] and trio["size"] in kit_trio.LADDER["rehearse"]
    assert trio["tokens"] == trio["steps"] * trio["batch"] * 256
    params = [run["parameters"] for run in trio["runs"].values()]
    assert len(params) == 3 and max(params) / min(params) < 1.01  # parameter-matched
    # the training-speed probe (issue 46): every kind at the first size, clipped also keeping its maps; no
    # MFU without a known GPU peak; the trio's pace is its own slowest kind, not a rival's
    first, *rest = trio["probe"].values()
    from diffquant.models.config import ATTENTION_KINDS

    assert set(first) == {*ATTENTION_KINDS, "clipped-keep-maps"}
    assert all(r["mfu"] is None and r["tokens_per_s"] > 0 for r in first.values())
    assert all(set(r) == set(kit_trio.KINDS) for r in rest)
    table5 = json.loads((work / "trio/run/table5.json").read_text())
    for model in kit_trio.KINDS:
        view = table5["models"][model]["table5"]
        assert view["attention logits"]["top1"] > view["attention logits"]["median"] > 0
        assert view["hidden states"]["top1"] > 0
    with open(work / "trio/run/sweep/results.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] == "bits_per_byte"]
    assert {(r["model"], r["plan"]) for r in rows} == {
        (m, p) for m in kit_trio.KINDS for p in ("none", *kit_trio.PLANS)
    }
    with zipfile.ZipFile(out / "results.zip") as z:
        names = set(z.namelist())
    assert {
        "trio/run/report.html",
        "trio/run/table5.json",
        "trio/run/sweep/results.csv",
        "stages/trio.json",
    } <= names
    assert any(n.startswith("trio/run/figures/") and n.endswith(".png") for n in names)
    # of the tensors, only the trio's attention maps come back (a trio joined from parts draws them)
    tensors = sorted(n for n in names if n.endswith(".safetensors"))
    assert tensors == [f"trio/run/profile/{kind}.maps.safetensors" for kind in kit_trio.KINDS], tensors


# ------------------------------------------------------------------------------------------- sizes
def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_size_counts_what_the_device_call_copies(tmp_path):
    """Tracked and untracked-not-ignored files, plus the carried (ignored) folder; an ignored file that is
    not carried does not travel, a deleted tracked file is not counted."""
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("wheels/\nbuild/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    (tmp_path / "gone.py").write_bytes(b"y" * 500)
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t")
    (tmp_path / "gone.py").unlink()
    (tmp_path / "untracked.txt").write_bytes(b"z" * 300)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "big.bin").write_bytes(b"b" * 5000)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1-py3-none-any.whl").write_bytes(b"w" * 2000)
    gitignore = len((tmp_path / ".gitignore").read_bytes())

    report = kit.size_report(tmp_path, ["wheels"], limit_mib=1)
    assert report["tree_bytes"] == 1000 + 300 + gitignore
    assert report["carried_bytes"] == {"wheels": 2000}
    assert report["wheels"] == {"a-1-py3-none-any.whl": 2000}
    assert report["total_bytes"] == 1000 + 300 + gitignore + 2000 and report["fits"]
    tight = kit.size_report(tmp_path, ["wheels"], limit_mib=(1000 + 300 + gitignore + 1999) / MIB)
    assert not tight["fits"]
    assert kit.size_report(tmp_path, ["missing"], limit_mib=1)["carried_bytes"] == {"missing": 0}


def test_the_wheels_folder_is_ignored_and_the_scripts_parse():
    assert (
        subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "analysis/gpu/wheels/x.whl"]).returncode
        == 0
    )
    for script in ("prepare.sh", "run.sh"):
        subprocess.run(["bash", "-n", str(KIT / script)], check=True)


# ------------------------------------------------------------------------------------------- wheels
def _wheel(path: Path, members: dict[str, bytes], modes: dict[str, int] | None = None) -> None:
    with zipfile.ZipFile(path, "w") as z:
        rows = []
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = ((modes or {}).get(name, 0o644) | 0o100000) << 16
            z.writestr(info, data)
            rows.append(f"{name},{kit._record_hash(data)},{len(data)}")
        z.writestr("pkg-1.dist-info/RECORD", "\n".join(rows) + "\npkg-1.dist-info/RECORD,,\n")


def test_trimming_bitsandbytes_keeps_cuda13_and_a_valid_record(tmp_path):
    wheel = tmp_path / "bitsandbytes-1-py3-none-any.whl"
    members = {
        f"bitsandbytes/libbitsandbytes_{lib}.so": lib.encode() * 100
        for lib in ("cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm64")
    }
    members["bitsandbytes/__init__.py"] = b"x = 1\n"
    members["pkg-1.dist-info/METADATA"] = b"Name: bitsandbytes\n"
    _wheel(wheel, members)
    result = kit.trim_wheel(wheel, kit.BNB_DROP)
    assert sorted(result["dropped"]) == [
        f"bitsandbytes/libbitsandbytes_{x}.so" for x in ("cuda118", "cuda128", "rocm64")
    ]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = list(csv.reader(io.StringIO(z.read("pkg-1.dist-info/RECORD").decode())))
        for name, digest, size in record:
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
    assert {r[0] for r in record} == names
    assert (
        "bitsandbytes/libbitsandbytes_cuda130.so" in names and "bitsandbytes/libbitsandbytes_cpu.so" in names
    )
    assert kit.trim_wheel(wheel, kit.BNB_DROP)["dropped"] == []  # idempotent


def test_wheels_install_offline_without_pip_keeping_modes(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(
        folder / "pkg-1-py3-none-any.whl",
        {"pkg/__init__.py": b"VALUE = 7\n", "pkg/bin/tool": b"#!/bin/sh\n"},
        {"pkg/bin/tool": 0o755},
    )
    site = tmp_path / "site"
    result = kit.install_wheels(folder, site, use_pip=False)
    assert result["how"].startswith("unzip") and result["wheels"] == ["pkg-1-py3-none-any.whl"]
    assert (site / "pkg/__init__.py").read_text() == "VALUE = 7\n"
    assert os.access(site / "pkg/bin/tool", os.X_OK)
    assert kit.install_wheels(tmp_path / "none", tmp_path / "site2")["wheels"] == []


# ------------------------------------------------------------------------------------------- zips
def test_zips_stay_under_the_cap_and_name_what_they_left_out(tmp_path):
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"a": 1}))
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(50_000))  # incompressible
    after = tmp_path / "after.txt"
    after.write_text("kept after the one left out\n" * 10)
    path = tmp_path / "r.zip"
    result = kit.zip_capped(
        path, [("small.json", small), ("noise.bin", noise), ("after.txt", after)], cap=20_000
    )
    assert result["left_out"] == ["noise.bin"] and path.stat().st_size <= 20_000
    with zipfile.ZipFile(path) as z:
        assert z.namelist() == ["small.json", "after.txt"]


def test_results_leave_weights_behind_and_profiles_go_apart(tmp_path):
    for rel in (
        "stages/trio.json",
        "trio/run/report.html",
        "trio/run/profile/baseline.json",
        "trio/run/profile/baseline.maps.safetensors",
        "trio/train/baseline/final/model.safetensors",
        "trio/train/baseline/log.csv",
        "trio/corpus.jsonl",
        "cli/quantize-zoo/quant_state.safetensors",
        "logs/trio.log",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    results, profiles = kit.result_members(tmp_path)
    names = [arc for arc, _ in results]
    assert names[:3] == ["stages/trio.json", "logs/trio.log", "trio/run/report.html"]
    assert "trio/train/baseline/log.csv" in names
    # the trio's maps come last (kept where the cap leaves room); weights and the corpus stay behind
    assert names[-1] == "trio/run/profile/baseline.maps.safetensors"
    assert not any(n.endswith((".safetensors", "corpus.jsonl")) for n in names[:-1])
    assert [arc for arc, _ in profiles] == ["trio/run/profile/baseline.json"]


# ------------------------------------------------------------------------------------------- trio parts
PART = ["--stages", "trio", "--trio-size", "toy-b", "--trio-tokens", "4096"]


@pytest.fixture(scope="module")
def trio_parts(tmp_path_factory):
    """Three rehearsed kit calls at one fixed size and token count: the trio stage of baseline and DIFF V2 in
    one call (``whole``), and of each alone (``base``, ``v2``), as two device calls would run them."""
    base = tmp_path_factory.mktemp("trio-parts")
    kinds = {"whole": "baseline,diff_v2", "base": "baseline", "v2": "diff_v2"}
    calls = {
        n: _kit_call(base / n / "out", base / n / "work", *PART, "--trio-kinds", k) for n, k in kinds.items()
    }
    for name, proc in calls.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {output[-3000:]}"
    whole = base / "whole-run"
    for zip_name in ("results.zip", "profiles.zip"):
        with zipfile.ZipFile(base / "whole" / "out" / zip_name) as z:
            z.extractall(whole)
    return base, whole / "trio" / "run"


def _sha(spec: dict) -> str:
    """The sweep's fingerprint as diffquant.eval.sweep.Sweep.fingerprint computes it, over a spec."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@pytest.mark.slow
def test_a_trio_in_parts_joins_into_the_whole_trios_study(trio_parts):
    """Each part trains its kind as the whole call does (the same weights, by their SHA-256), so the joined
    study holds the whole call's numbers: every sweep row and per-window tally, the Table 5 view, each
    profile and its attention maps; the parts are given in the other order and the models still come in the
    trio's order. The sweep's fingerprint is the sweep's own formula over the joined spec (the spec differs
    from the whole call's only in its checkpoint paths). The figures, map figures included, and the report
    are drawn from the joined folder."""
    import kit_merge
    from safetensors.torch import load_file

    base, whole = trio_parts
    joined = base / "joined"
    result = kit_merge.merge([base / "v2" / "out", base / "base" / "out"], joined)
    assert result["kinds"] == ["baseline", "diff_v2"]
    assert result["report_error"] is None, result

    def read(root: Path, rel: str):
        return json.loads((root / rel).read_text())

    ours, theirs = read(joined, "manifest.json"), read(whole, "manifest.json")
    assert {m: c["sha256"] for m, c in ours["checkpoints"].items()} == {
        m: c["sha256"] for m, c in theirs["checkpoints"].items()
    }
    assert [p["kinds"] for p in ours["parts"]] == [["diff_v2"], ["baseline"]]
    assert "maps_left_out" not in ours
    a, b = read(joined, "sweep/results.json"), read(whole, "sweep/results.json")
    assert a["rows"] == b["rows"] and a["per_window"] == b["per_window"] and a["dtypes"] == b["dtypes"]
    assert a["complete"] and sorted(a) == sorted(b)
    spec_a, spec_b = read(joined, "sweep/sweep.json")["spec"], read(whole, "sweep/sweep.json")["spec"]
    assert list(spec_a["models"]) == ["baseline", "diff_v2"]
    assert {**spec_a, "models": None} == {**spec_b, "models": None}
    assert a["fingerprint"] == _sha(spec_a) and b["fingerprint"] == _sha(spec_b)
    assert read(joined, "table5.json") == read(whole, "table5.json")
    assert (joined / "table5.txt").read_text() == (whole / "table5.txt").read_text()
    assert (joined / "sweep/results.csv").read_text() == (whole / "sweep/results.csv").read_text()
    for model in ("baseline", "diff_v2"):
        p, q = read(joined, f"profile/{model}.json"), read(whole, f"profile/{model}.json")
        p["meta"].pop("checkpoint"), q["meta"].pop("checkpoint")
        assert p == q, model
        m, n = (load_file(root / "profile" / f"{model}.maps.safetensors") for root in (joined, whole))
        assert m.keys() == n.keys() and all(m[k].equal(n[k]) for k in m), model
    assert (joined / "report.html").is_file() and list((joined / "figures").glob("maps-*.png"))
    assert not (whole / "figures").exists()  # a part draws no figures: the join draws the trio's


def test_trio_merge_refuses_parts_of_two_trios_or_one_kind_twice(trio_parts, tmp_path):
    """Parts whose match records differ (here the steps), or that train one kind twice, are refused in one
    line with exit code 2, and nothing is written."""
    base, _ = trio_parts
    other = tmp_path / "other"
    other.mkdir()
    for name in ("results.zip", "profiles.zip"):
        (other / name).write_bytes((base / "v2" / "out" / name).read_bytes())
    summary = json.loads((base / "v2" / "out" / "summary.json").read_text())
    summary["stages"]["trio"]["numbers"]["match"]["steps"] += 1
    (other / "summary.json").write_text(json.dumps(summary))
    cases = [
        ([base / "base" / "out", other], "its trio's steps 5 differs from"),
        ([base / "base" / "out", base / "base" / "out"], "baseline is trained in"),
    ]
    for parts, said in cases:
        out = tmp_path / "joined"
        proc = _kit_py("trio-merge", *map(str, parts), "--out", str(out))
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert not out.exists()


def test_figures_skip_the_maps_a_joined_folder_lists_as_left_out(trio_parts, tmp_path):
    """A model whose maps did not come back (results.zip's cap): without its name in the manifest's
    maps_left_out the figures refuse the folder (a missing artifact), with it they are drawn without them."""
    import kit_merge

    from diffquant.cli import main

    base, _ = trio_parts
    folder = tmp_path / "joined"
    kit_merge.merge([base / "base" / "out", base / "v2" / "out"], folder, draw=False)
    (folder / "profile" / "diff_v2.maps.safetensors").unlink()
    assert main(["plot", str(folder), "--what", "maps"]) == 2
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "maps_left_out": ["diff_v2"]}))
    assert main(["plot", str(folder), "--what", "maps"]) == 0
    drawn = sorted(p.name for p in (folder / "figures").glob("maps-*.png"))
    assert drawn, drawn


def test_a_trio_part_is_checked_before_anything_is_written(tmp_path):
    for args, said in (
        (["--trio-kinds", "gated", "--trio-size", "toy-b"], "--trio-kinds gated: expected distinct kinds"),
        (["--trio-kinds", "diff_v1", "--trio-size", "52M"], "--trio-size 52M: expected one of toy-b, toy-a"),
        (["--trio-size", "toy-b"], "--trio-size and --trio-tokens go with --trio-kinds"),
        (["--trio-kinds", "diff_v1", "--trio-size", "toy-b", "--stages", "cli"], "the trio stage is not"),
    ):
        out = tmp_path / "out"
        proc = _kit_py("run", "--rehearse", "--out", str(out), *args)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)
        assert not out.exists()


# ------------------------------------------------------------------------------------------- kernels
def _row(t, variant, ms, dist="normal", cosine=None):
    row = {"T": t, "H": 16, "Hkv": 4, "d": 128, "dist": dist, "variant": variant, "ms": ms}
    if cosine is not None:
        row["cosine"] = cosine
    return row


def test_kernel_goals_read_the_issue_8_targets_at_4096_and_beyond():
    rows = []
    for dist, cos in (("normal", 0.9995), ("fa3", 0.998)):
        rows += [
            _row(1024, "baseline-sdpa-bf16", 0.1, dist),
            _row(1024, "v2-int8qk-fp8pv-triton", 1.0, dist, cos),  # slow, but below T = 4096: not judged
            _row(4096, "baseline-sdpa-bf16", 1.0, dist),
            _row(4096, "v2-bf16-triton", 1.4, dist, 1.0),
            _row(4096, "v2-int8qk-fp8pv-triton", 1.0, dist, cos),  # 1.4x the bf16 core, 1.0x the baseline
            _row(4096, "v2-fp8qk-fp8pv-triton", 1.2, dist, cos),  # 1.17x: misses 1.3x and the baseline
        ]
    goals = kit_stages.kernel_goals(rows)
    assert goals["assessable"] and all(r["T"] >= 4096 for r in goals["rows"])
    int8 = goals["met"]["v2-int8qk-fp8pv-triton"]
    assert int8 == {
        "speedup_vs_bf16_v2 >= 1.3": True,
        "speedup_vs_baseline >= 1.0": True,
        "cosine >= 0.999 (normal)": True,
        "cosine >= 0.999 (fa3 outliers)": False,
    }
    fp8 = goals["met"]["v2-fp8qk-fp8pv-triton"]
    assert not fp8["speedup_vs_bf16_v2 >= 1.3"] and not fp8["speedup_vs_baseline >= 1.0"]
    assert (
        kit_stages.kernel_goals([_row(40, "v2-int8qk-fp8pv-triton", 1.0, cosine=1.0)])["assessable"] is False
    )
    # the bench's profile of a row travels with it (None where the row has none: fa3 rows, a smoke run)
    rows[4].update(host_ms=0.3, kernel_ms=0.2, launches=6)
    digest = {(r["variant"], r["dist"]): r for r in kit_stages.kernel_goals(rows)["rows"]}
    assert {
        k: digest[("v2-int8qk-fp8pv-triton", "normal")][k] for k in ("host_ms", "kernel_ms", "launches")
    } == {
        "host_ms": 0.3,
        "kernel_ms": 0.2,
        "launches": 6,
    }
    assert digest[("v2-int8qk-fp8pv-triton", "fa3")]["kernel_ms"] is None
    # the digest line says it too (the output tail may be all that comes back from the device call)
    note = kit._note("kernels_bench", {"rows": len(rows), "goals": kit_stages.kernel_goals(rows)})
    assert note.endswith(
        "; where the time goes: v2-int8qk-fp8pv T=4096 d=128: 1.000 ms, device 0.200, host 0.300"
    )


def test_gpu_test_outcomes_are_read_from_verbose_lines():
    text = (
        "tests/test_kernels.py::test_gpu_kernel_matches_reference[fp32-diff_v2-fp32-blocks0] PASSED [  2%]\n"
        "tests/test_kernels.py::test_gpu_kernel_matches_reference[bf16-diff_v1-sage-blocks1] FAILED [  4%]\n"
        "tests/test_device_map.py::test_two_gpus SKIPPED (needs two CUDA devices) [  6%]\n"
        "FAILED tests/test_kernels.py::test_gpu_kernel_matches_reference[bf16-diff_v1-sage-blocks1] - assert\n"
    )
    assert kit_stages.parse_outcomes(text) == {
        "tests/test_kernels.py::test_gpu_kernel_matches_reference[fp32-diff_v2-fp32-blocks0]": "PASSED",
        "tests/test_kernels.py::test_gpu_kernel_matches_reference[bf16-diff_v1-sage-blocks1]": "FAILED",
        "tests/test_device_map.py::test_two_gpus": "SKIPPED",
    }
    assert "tests/test_kernels.py" in kit_stages.gpu_test_files()


# ------------------------------------------------------------------------------------------- trio sizing
SETTINGS = {
    "target_tokens": 100_000_000,
    "margin": 1.0,
    "batch_size": {"small": 64},
    "seq_len": 512,
    "min_steps": 50,
}
FACTS = {
    "big": {"flops_per_token": 300e6},
    "mid": {"flops_per_token": 150e6},
    "small": {"flops_per_token": 30e6},
}
NO_OVERHEAD = dict.fromkeys(FACTS, 0.0)


def test_the_largest_size_that_trains_on_the_target_is_chosen():
    # big measured at 0.5M tok/s: 100 s give 5e7 tokens; mid projected at 1M tok/s reaches 1e8
    choice = kit_trio.choose_size(FACTS, {"big": 0.5e6}, 100.0, SETTINGS, NO_OVERHEAD)
    assert choice["size"] == "mid" and not choice["measured"] and choice["tokens"] == 100_000_000
    # measured slower than projected: mid falls short, small (projected 3M tok/s from mid) is next
    choice = kit_trio.choose_size(FACTS, {"big": 0.5e6, "mid": 0.6e6}, 100.0, SETTINGS, NO_OVERHEAD)
    assert choice["size"] == "small" and choice["reaches_target"]
    # plenty of time: the largest, on the target (not more)
    choice = kit_trio.choose_size(FACTS, {"big": 2e6}, 100.0, SETTINGS, NO_OVERHEAD)
    assert (choice["size"], choice["tokens"], choice["measured"]) == ("big", 100_000_000, True)


def test_without_time_for_the_target_the_smallest_trains_on_what_fits():
    measured = {"big": 0.1e6, "mid": 0.2e6, "small": 0.5e6}
    overhead = {"big": 30.0, "mid": 20.0, "small": 10.0}
    choice = kit_trio.choose_size(FACTS, measured, 100.0, {**SETTINGS, "margin": 0.5}, overhead)
    assert choice["size"] == "small" and not choice["reaches_target"]
    assert choice["tokens"] == int(0.5e6 * 90 * 0.5)
    assert kit_trio.plan_steps(choice["tokens"], SETTINGS, "small") == choice["tokens"] // (64 * 512)
    assert kit_trio.plan_steps(1000, SETTINGS, "small") == 50  # at least min_steps


def test_the_ladder_makes_parameter_matched_trios():
    for mode, ladder in kit_trio.LADDER.items():
        assert set(kit_trio.SETTINGS[mode]["batch_size"]) == set(ladder)
        sizes = [max(kit_trio.size_facts(base, 256)["params"].values()) for base in ladder.values()]
        assert sizes == sorted(sizes, reverse=True), mode  # largest first
        for name, base in ladder.items():
            params = kit_trio.size_facts(base, 256)["params"]
            assert max(params.values()) / min(params.values()) < 1.01
            # the study's W4A8 quantizes every Linear's input in groups of 32: each width of the trio divides
            for kind, config in kit_trio.trio_configs(base, 256).items():
                if kind in kit_trio.KINDS:
                    assert config.ffn_dim % 32 == 0 and config.d_model % 32 == 0, (mode, name, kind)
    assert 45e6 < max(kit_trio.size_facts(kit_trio.LADDER["gpu"]["52M"], 512)["params"].values()) < 60e6


def test_the_corpus_reads_package_sources_in_order_up_to_the_need(tmp_path):
    from diffquant.data import token_stream

    root = tmp_path / "site-packages"
    for rel, text in {
        "a/__init__.py": "A = 1\n" * 50,
        "a/tests/test_a.py": "skipped\n",
        "a/__pycache__/x.py": "skipped\n",
        "b/mod.py": "B = 2\n" * 50,
        "c/late.py": "C = 3\n" * 50,
        "b/data.json": "{}",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    corpus = kit_trio.build_corpus(tmp_path / "corpus.jsonl", need=400, roots=[root], lead=None)
    assert (corpus["files_stdlib"], corpus["files_packages"], corpus["short"]) == (0, 2, False)
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"][:1] for line in lines] == ["A", "B"]
    stream = token_stream(str(tmp_path / "corpus.jsonl"))
    assert stream.numel() == corpus["tokens"] == 2 * (300 + 2)
    short = kit_trio.build_corpus(tmp_path / "all.jsonl", need=10**6, roots=[root], lead=None)
    assert short["short"] and short["files_packages"] == 3


def test_kernels_tune_stage_runs_only_when_named_and_records_the_best(tmp_path, monkeypatch):
    """The tuning stage (issue 46) is not in a plain run (it needs a device call of its own); named, on a
    machine without CUDA it runs bench.py --tune --smoke and records, per Triton variant, the fastest
    configuration of the rows it timed."""
    import time

    from kit_util import Context, Recorder

    assert "kernels_tune" in kit.STAGES and "kernels_tune" not in kit.DEFAULT_STAGES
    monkeypatch.chdir(kit.REPO)
    ctx = Context(mode="rehearse", work=tmp_path, deadline=time.time() + 300, cuda=False)
    (tmp_path / "logs").mkdir()
    rec = Recorder(tmp_path / "tune.json")
    kit_stages.stage_kernels_tune(ctx, rec)
    data = rec.data
    assert data["status"] == "skipped" and "no CUDA" in data["reason"], data
    best = data["numbers"]["best"]
    triton_variants = ("v2-bf16-triton", "v2-int8qk-fp8pv-triton", "v2-fp8qk-fp8pv-triton", "v1-bf16-triton")
    assert sorted(best) == sorted(f"{v} d=16" for v in triton_variants)
    rows = json.loads((tmp_path / "bench" / "tune-smoke.json").read_text())["tuning"]
    for key, cfg in best.items():
        variant = key.split(" ")[0]
        assert cfg["ms"] == min(r["ms"] for r in rows if r["variant"] == variant)


def test_train_compile_stage_probes_every_kind_eager_then_compiled(tmp_path, monkeypatch):
    """The training-compile stage (issue 46, goal 5) is not in a plain run; named, it probes every kind at
    the ladder's largest size eagerly and then through the trainer's ``training_forward`` with compilation
    on, each kind recorded as it ends, with compiled / eager tokens/s per kind and a digest table.
    (The compile itself is replaced here by a recorder: tests/test_train.py compiles the trainer for real.)"""
    import time

    import torch
    from kit_util import Context, Recorder

    from diffquant.models.config import ATTENTION_KINDS
    from diffquant.train import trainer

    assert "train_compile" in kit.STAGES and "train_compile" not in kit.DEFAULT_STAGES
    asked: list[bool] = []

    def forward(model, compile_model):
        asked.append(compile_model)
        return model

    monkeypatch.setattr(trainer, "training_forward", forward)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: asked.append("reset"))
    monkeypatch.setitem(kit_trio.SETTINGS["rehearse"], "probe_steps", 1)
    ctx = Context(mode="rehearse", work=tmp_path, deadline=time.time() + 300, cuda=False)
    rec = Recorder(tmp_path / "train_compile.json")
    kit_trio.stage_train_compile(ctx, rec)
    data = json.loads((tmp_path / "train_compile.json").read_text())
    assert data["status"] == "skipped" and "no CUDA" in data["reason"], data
    n = data["numbers"]
    kinds = {*ATTENTION_KINDS, "clipped-keep-maps"}
    assert n["size"] == next(iter(kit_trio.LADDER["rehearse"]))
    assert set(n["eager"]) == set(n["compiled"]) == set(n["speedup"]) == kinds
    # each kind compiles afresh (TorchDynamo's recompile limit counts across models, then it runs eagerly)
    assert asked == [False] * len(kinds) + ["reset", True] * len(kinds)
    assert all(not r["compiled"] for r in n["eager"].values())
    assert all(r["compiled"] for r in n["compiled"].values())
    for kind in kinds:
        ratio = n["compiled"][kind]["tokens_per_s"] / n["eager"][kind]["tokens_per_s"]
        assert n["speedup"][kind] == pytest.approx(ratio, abs=1e-3)
    lines = kit._compile_lines(n)
    assert lines[0].startswith(f"train_compile, {n['size']}") and len(lines) == 2 + len(kinds)
    # no CUDA, no sync count: its column says "-"; on a GPU the probe's count stands there
    assert all(line.endswith("  -") for line in lines[2:]), lines
    n["eager"]["baseline"]["host_syncs_per_step"] = 3
    assert any(line.strip().startswith("baseline") and " 3 " in line for line in kit._compile_lines(n))
    assert f"compiled / eager tokens/s: baseline {n['speedup']['baseline']:.2f}x" in kit._note(
        "train_compile", n
    )


def test_autocast_gap_trains_the_recipe_of_the_cpu_experiment():
    """The GPU's early-gap runs must be the recipes analysis/autocast trained on the CPU (seed 0, the 3M trio
    of the H200's first run, its 106-step schedule), or the two cannot be compared: every key equal but the
    run's name and the two keys added since (``torch_compile`` off, ``precision`` the one asked)."""
    import kit_autocast

    assert kit_autocast.EARLY["gpu"] == ("3M", 106, 12)
    recorded = json.loads((ROOT / "analysis" / "autocast" / "results.json").read_text())["runs"]
    seen = set()
    for run in recorded:
        if run["seed"] != 0 or run["kind"] not in kit_autocast.KINDS:
            continue
        recipe = kit_autocast.early_recipe(run["kind"], "gpu", 0, run["precision"], 106, "cpu")
        assert recipe.pop("torch_compile") is False and recipe.pop("precision") == run["precision"]
        assert recipe.pop("name") != run["recipe"]["name"]
        old = {k: v for k, v in run["recipe"].items() if k != "name"}
        assert recipe == old
        seen.add((run["kind"], run["precision"]))
    assert seen == {(k, p) for k in kit_autocast.KINDS for p in kit_autocast.PRECISIONS}


def test_step_syncs_records_what_cuda_warns_of_and_restores_the_mode(monkeypatch):
    """The probe's count of a training step's host syncs on a GPU (torch.cuda.set_sync_debug_mode("warn"):
    a warning per synchronizing call): each warning the step raises is one entry naming its line, and the
    mode goes back to "default" even when the step fails. CUDA's switch is a stand-in here (no GPU)."""
    import warnings

    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def step(i):
        assert modes[-1] == "warn"
        for _ in range(i):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    got = kit_trio.step_syncs(step, 2)
    assert len(got) == 2 and all(g.startswith("test_gpu_kit.py:") for g in got)
    assert all(g.endswith(": called a synchronizing CUDA operation") for g in got)
    assert modes == ["warn", "default"]

    def broken(i):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        kit_trio.step_syncs(broken, 0)
    assert modes[-2:] == ["warn", "default"]
