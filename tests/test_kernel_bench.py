"""analysis/kernels/bench.py, its CPU --smoke mode (Triton's interpreter): the DIFF-on-SDPA variants compute the
reference's math, the goals table is built from the rows, and a variant that raises becomes an "error" row.

The times of a smoke run mean nothing (CPU, interpreter), so only the bookkeeping is checked: the goals'
ratios and verdicts are recomputed here from the rows, not read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "analysis" / "kernels" / "bench.py"
PLANTED = "planted failure: no fp8 Q/K here"

# Runs bench.py --smoke with the Triton entry points wrapped: the fp8-Q/K DIFF V2 variant raises (the kernel
# module is patched, so bench.py imports the wrapper), and every call's keyword names are recorded (the bench
# must leave the tile sizes to the kernel). Triton's interpreter is chosen by the environment, before the
# kernel module is imported.
WRAPPER = f"""
import json, runpy, sys
import diffquant.kernels.triton_diff as td

seen = []
real_v2, real_v1 = td.diff_v2_attention, td.diff_v1_attention

def v2(*args, **kw):
    seen.append(sorted(kw))
    if kw["quant"].qk == "fp8_e4m3":
        raise RuntimeError({PLANTED!r})
    return real_v2(*args, **kw)

def v1(*args, **kw):
    seen.append(sorted(kw))
    return real_v1(*args, **kw)

td.diff_v2_attention, td.diff_v1_attention = v2, v1
script, out = sys.argv[1], sys.argv[2]
sys.argv = [script, "--smoke", "--json", out]
runpy.run_path(script, run_name="__main__")
print("KWARGS " + json.dumps(seen))
"""

TRITON = (
    "v2-bf16-triton",
    "v2-int8qk-fp8pv-triton",
    "v2-int8tokqk-fp8pv-triton",
    "v2-fp8qk-fp8pv-triton",
    "v1-bf16-triton",
)
VARIANTS = ["baseline-sdpa-bf16", "v2-sdpa-bf16", *TRITON[:4], "v1-sdpa-bf16", "v1-bf16-triton"]
GOAL_FIELDS = {"T", "H", "Hkv", "d", "goal", "variant", "criterion", "measured", "status", "text"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(completed process, the JSON result) of one patched smoke run."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _status(checks):
    return "missed" if False in checks else ("n/a" if None in checks else "met")


def test_bench_smoke_sdpa_variants_goals_and_error_rows(smoke):
    proc, result = smoke
    rows = result["rows"]
    assert result["complete"] is True
    by = {(r["dist"], r["variant"]): r for r in rows}
    for dist in ("normal", "fa3"):
        assert [r["variant"] for r in rows if r["dist"] == dist] == VARIANTS

    # The SDPA DIFF variants are the reference's math in bf16: inputs identical (bf16-rounded, the reference
    # runs them in fp32), the only differences are bf16 roundings of the SDPA outputs, P and the result
    # (unit roundoff 2^-9, relative RMS error ~2e-3, so 1 - cosine ~ rms^2 / 2 ~ 5e-6; measured 0.999995 at
    # this shape and at T=256..512, d=64/128, on both distributions). 0.9999 leaves a 20x margin on 1 - cosine;
    # a wrong sign, lambda, head pairing or softmax scale measured cosine 0.98 or far less. rel_l1 (measured
    # 0.003) catches what cosine cannot see, a wrong overall factor such as a dropped (1 - lambda_init).
    for variant in ("v2-sdpa-bf16", "v1-sdpa-bf16"):
        for dist in ("normal", "fa3"):
            row = by[(dist, variant)]
            assert row["cosine"] > 0.9999, (variant, dist, row)
            assert row["rel_l1"] < 0.01 and row["ms"] > 0
            assert row["kv_expand"] in ("enable_gqa", "repeat_interleave")

    # the planted failure: an error row per distribution, the run went on, the other Triton rows ran
    for dist in ("normal", "fa3"):
        err = by[(dist, "v2-fp8qk-fp8pv-triton")]
        assert PLANTED in err["error"] and "ms" not in err and "cosine" not in err
        for variant in set(TRITON) - {"v2-fp8qk-fp8pv-triton"}:
            assert "error" not in by[(dist, variant)] and by[(dist, variant)]["ms"] > 0
    assert "error: RuntimeError: " + PLANTED in proc.stdout

    # the Triton kernels choose their tiles: no block_m / block_n passed
    kwargs = json.loads(proc.stdout.split("KWARGS ", 1)[1])
    assert len(kwargs) == 10 and not any({"block_m", "block_n"} & set(kw) for kw in kwargs)

    # the goals: one shape, goals 1, 2 (int8 Q/K per block and per token, fp8 Q/K), 3, 4, every field; ratios
    # and verdicts recomputed
    goals = result["goals"]
    assert [(g["goal"], g["variant"]) for g in goals] == [
        (1, "v2-bf16-triton"),
        (2, "v2-int8qk-fp8pv-triton"),
        (2, "v2-int8tokqk-fp8pv-triton"),
        (2, "v2-fp8qk-fp8pv-triton"),
        (3, "v1-bf16-triton"),
        (4, "all Triton variants"),
    ]
    ms = {v: by[("normal", v)].get("ms") for v in VARIANTS}
    base = ms["baseline-sdpa-bf16"]
    for g in goals:
        assert set(g) == GOAL_FIELDS
        assert (g["T"], g["H"], g["Hkv"], g["d"]) == (40, 2, 1, 16)
        assert g["status"] in ("met", "missed", "n/a")
        assert f"{g['goal']:<5}{g['variant']:<26}{g['status']:<8} {g['text']}" in proc.stdout
    g1, g2, g2tok, g2fp8, g3, g4 = goals
    for g, sdpa, bound in ((g1, "v2-sdpa-bf16", 2.5), (g3, "v1-sdpa-bf16", 3.0)):
        t = ms[g["variant"]]
        assert g["measured"] == pytest.approx(
            {"vs_baseline": t / base, "vs_sdpa": t / ms[sdpa], "kernels_vs_baseline": None}
        )
        assert g["status"] == _status([t / base <= bound, t < ms[sdpa]])
    for g, variant in ((g2, "v2-int8qk-fp8pv-triton"), (g2tok, "v2-int8tokqk-fp8pv-triton")):
        cos = [by[(d, variant)]["cosine"] for d in ("normal", "fa3")]
        assert g["measured"] == pytest.approx(
            {
                "vs_baseline": ms[variant] / base,
                "cosine_normal": cos[0],
                "cosine_fa3": cos[1],
                "kernels_vs_baseline": None,  # no device profile in a smoke run
            }
        )
        assert g["status"] == _status([ms[variant] <= base] + [c >= 0.999 for c in cos])
    # the failed variant has no number at all: n/a, not a verdict
    assert g2fp8["measured"] == {
        "vs_baseline": None,
        "cosine_normal": None,
        "cosine_fa3": None,
        "kernels_vs_baseline": None,
    }
    assert g2fp8["status"] == "n/a"
    assert g4["status"] == "missed" and g4["measured"]["ran"] == 8 and g4["measured"]["expected"] == 10
    assert set(g4["measured"]["errors"]) == {"v2-fp8qk-fp8pv-triton (normal)", "v2-fp8qk-fp8pv-triton (fa3)"}


def test_candidates_are_those_every_triton_version_compiled_cleanly(tmp_path, monkeypatch):
    """--tune times only the configurations the offline sm_90 compile (compiled.py --sweep) found clean under
    every Triton version it was run with: a configuration that spills or overflows shared memory under one
    version is left out, and without any such file the whole candidate list is timed."""
    sys.path.insert(0, str(SCRIPT.parent))
    import bench

    def row(bm, spill, fits=True, copies=8):
        return {"source": "sweep", "variant": "v2-bf16", "d": 64, "block_m": bm, "block_n": 64, "num_warps": 8,
                "num_stages": 2, "fits": fits, "spill_bytes": spill, "async_copies": copies}  # fmt: skip

    (tmp_path / "bench.py").write_text("")
    (tmp_path / "compiled-triton3.6.0.json").write_text(
        json.dumps({"rows": [row(64, 0), row(128, 0), row(256, 0, copies=0)]})
    )
    (tmp_path / "compiled-triton3.9.0.json").write_text(
        json.dumps({"rows": [row(64, 0), row(128, 24), row(256, 0, copies=0)]})
    )
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "bench.py"))
    assert bench.candidates("v2-bf16-triton", 64) == [
        {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
    ]
    for path in tmp_path.glob("compiled-*.json"):
        path.unlink()
    before = os.environ.get("TRITON_INTERPRET")
    from compiled import CANDIDATES

    # importing compiled.py must leave the importer's Triton mode alone (it set TRITON_INTERPRET=0 once,
    # and every later interpreter test in the suite failed)
    assert os.environ.get("TRITON_INTERPRET") == before

    assert len(bench.candidates("v2-bf16-triton", 64)) == 2 * len(CANDIDATES)


def test_tune_smoke_times_every_candidate_of_every_triton_variant(tmp_path):
    """``--tune --smoke``: every Triton kernel gets a timed row per candidate with its configuration, and
    "best" holds, per variant and head width, the fastest row's time and configuration. The per-token Q/K
    variant is not tuned: its attention kernel and launch are the per-block one's."""
    out = tmp_path / "tune.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--tune", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["tuning"]
    tuned = [v for v in TRITON if v != "v2-int8tokqk-fp8pv-triton"]
    assert sorted({r["variant"] for r in rows}) == sorted(tuned)
    assert all(
        "ms" in r and set(r["config"]) == {"block_m", "block_n", "num_warps", "num_stages"} for r in rows
    )
    for variant in tuned:
        mine = [r for r in rows if r["variant"] == variant]
        assert len(mine) == 2
        fastest = min(mine, key=lambda r: r["ms"])
        assert result["best"][f"{variant} d=16"] == {"ms": fastest["ms"], "tflops": fastest["tflops"],
                                                     **fastest["config"]}  # fmt: skip


def test_accuracy_sums_in_float64():
    """The bench's cosine over a million elements matches numpy's float64 dot products to 1e-12: in fp32 the
    same sums were off by 2e-5 here (and 1e-4, a cosine of 1.0002, on a 4-head T = 4096 core), the size of
    the gaps goal 2's 0.999 has to tell apart."""
    import numpy as np
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import bench

    ref = torch.randn(4 * 4096 * 64, generator=torch.Generator().manual_seed(0))
    out = ref.bfloat16().float()
    r, o = ref.numpy().astype(np.float64), out.numpy().astype(np.float64)
    cosine = float(o @ r / np.sqrt((o @ o) * (r @ r)))
    got = bench.accuracy(out, ref)
    assert abs(got["cosine"] - cosine) < 1e-12, (got["cosine"], cosine)
    assert got["rel_l1"] == pytest.approx(np.abs(o - r).sum() / np.abs(r).sum(), rel=1e-12)


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench

    return bench


def test_device_ops_counts_the_device_work_of_a_chrome_trace():
    """A trace as torch.profiler writes one on a GPU (Kineto's categories, microseconds): the kernels, fills
    and copies are the device's work; the host's runtime calls, CPU ops, the profiler's own span and instant
    events are not. The span runs from the first one's start to the last one's end (gaps included)."""
    bench = _bench()
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 900.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10.0, "dur": 5.0},
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 0.0, "dur": 1000.0},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 100.0, "dur": 2.0},
            {"ph": "X", "cat": "kernel", "name": "_quant_tokens_kernel", "ts": 110.0, "dur": 8.0},
            {"ph": "X", "cat": "kernel", "name": "_diff_attn_fwd", "ts": 150.0, "dur": 90.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 250.0, "dur": 1.5},
            {"ph": "i", "cat": "kernel", "name": "an instant", "ts": 999.0},
            {"ph": "M", "name": "process_name"},
        ]
    }
    assert bench.device_ops(trace) == {
        "launches": 4,
        "kernel_ms": pytest.approx((2.0 + 8.0 + 90.0 + 1.5) / 1e3),
        "span_ms": pytest.approx((251.5 - 100.0) / 1e3),
    }
    assert bench.device_ops({"traceEvents": []}) == {"launches": 0, "kernel_ms": 0.0, "span_ms": 0.0}


def test_where_time_goes_reads_a_real_torch_profiler_trace(monkeypatch):
    """The profiler's own export read back (on the CPU: its CPU ops stand in for the kernels): one
    ``torch.mm`` of 256 x 256 is one ``aten::mm`` (and its ``resolve_conj`` children), timed in
    milliseconds within the wall time of the call."""
    import torch

    bench = _bench()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    a = torch.randn(256, 256)
    start = bench.time.perf_counter()
    got = bench.where_time_goes(lambda: torch.mm(a, a), 3, cats=("cpu_op",))
    wall_ms = (bench.time.perf_counter() - start) * 1e3
    assert set(got) == {"host_ms", "launches", "kernel_ms", "span_ms"}
    assert 1 <= got["launches"] <= 4  # aten::mm and up to three resolve_conj
    assert 0 < got["span_ms"] < wall_ms and 0 < got["host_ms"] < wall_ms
    # aten::mm of 256^3 multiply-adds takes microseconds to milliseconds here, not seconds or nanoseconds
    assert 1e-3 < got["span_ms"] < 1e3


def test_profile_rows_fills_the_timed_rows_and_survives_a_failure(monkeypatch):
    bench = _bench()
    calls = []

    def fake(fn, reps):
        calls.append(reps)
        fn()
        return {"host_ms": 0.01, "launches": 3, "kernel_ms": 0.2, "span_ms": 0.25}

    def broken():
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(bench, "where_time_goes", fake)
    ok, bad = {"variant": "a", "ms": 1.0}, {"variant": "b", "ms": 2.0}
    bench.profile_rows([(ok, lambda: None), (bad, broken)], 5)
    assert ok == {
        "variant": "a",
        "ms": 1.0,
        "host_ms": 0.01,
        "launches": 3,
        "kernel_ms": 0.2,
        "span_ms": 0.25,
    }
    assert bad == {"variant": "b", "ms": 2.0, "profile_error": "RuntimeError: CUPTI unavailable"}
    assert calls == [5, 5]


def test_goals_report_device_time_alone_beside_the_verdict():
    """With the GPU's profile in the rows, each speed goal also gives the variant's device time over the
    baseline's; the verdict stays on the event times. Here the quantized kernel's device time is half the
    baseline's while its event time is 3x (a host-bound call): goal 2 is missed, and the entry says why."""
    bench = _bench()
    shape = {"T": 4096, "H": 16, "Hkv": 16, "d": 64}

    def row(variant, ms, kernel_ms, dist="normal", cosine=None):
        r = {**shape, "dist": dist, "variant": variant, "ms": ms, "kernel_ms": kernel_ms}
        return r if cosine is None else {**r, "cosine": cosine}

    rows = [
        row("baseline-sdpa-bf16", 0.1, 0.1),
        row("v2-sdpa-bf16", 0.3, 0.28, cosine=0.99999),
        row("v2-bf16-triton", 0.2, 0.19, cosine=0.99999),
        row("v2-int8qk-fp8pv-triton", 0.3, 0.05, cosine=0.9995),
        row("v2-int8qk-fp8pv-triton", 0.3, 0.05, dist="fa3", cosine=0.9993),
        row("v1-sdpa-bf16", 0.5, 0.5, cosine=0.99999),
        row("v1-bf16-triton", 0.4, 0.35, cosine=0.99999),
    ]
    goals = {(g["goal"], g["variant"]): g for g in bench.goals(rows)}
    g2 = goals[(2, "v2-int8qk-fp8pv-triton")]
    assert g2["status"] == "missed"
    assert g2["measured"]["vs_baseline"] == pytest.approx(3.0)
    assert g2["measured"]["kernels_vs_baseline"] == pytest.approx(0.5)
    assert g2["text"].endswith("; device time alone 0.50x")
    g1 = goals[(1, "v2-bf16-triton")]
    assert g1["status"] == "met" and g1["measured"]["kernels_vs_baseline"] == pytest.approx(1.9)
    assert goals[(3, "v1-bf16-triton")]["measured"]["kernels_vs_baseline"] == pytest.approx(3.5)
    # a variant without a profile (the CPU smoke run, a failed profile): no ratio and no words for it
    g2tok = goals[(2, "v2-int8tokqk-fp8pv-triton")]
    assert g2tok["measured"]["kernels_vs_baseline"] is None and "device time" not in g2tok["text"]
