"""The GPU kit's first four stages: the environment, `pytest -m gpu`, the kernel benchmark and the CLI on CUDA.

Each function takes a :class:`kit_util.Context` and a :class:`kit_util.Recorder`, records its numbers as they
come, and ends with a status. Without CUDA (the rehearsal) the two GPU-only stages do what a CPU can for them
(collect the GPU tests; the benchmark's interpreter smoke run) and record ``skipped`` with the reason.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kit_util import REPO, Context, Recorder, diffquant, kill_group, last_error, read_json, run_timed, start

# ------------------------------------------------------------------------------------------------ env
# Imported (a carried wheel built for the wrong CUDA fails at import, worth knowing before the stages use it)
IMPORTED = ("triton", "optimum.quanto", "bitsandbytes", "gguf", "flash_attn")
# Only looked up (slow to import, and used by no stage)
LOOKED_UP = (
    "numpy",  # Triton 3.6's interpreter fails under numpy 2.4 ("only 0-dimensional arrays ..."); 2.2 works
    "transformers",
    "accelerate",
    "tokenizers",
    "safetensors",
    "seaborn",
    "matplotlib",
    "pytest",
    "lm_eval",
)


def _version(module: str) -> str | None:
    """The version of an optional library, or None when it is not importable here (import errors included)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as err:  # noqa: BLE001 - recorded, not raised: one broken library must not end the stage
        return f"import failed: {type(err).__name__}: {str(err)[:160]}"
    return str(getattr(mod, "__version__", None) or _metadata_version(module.split(".")[0]))


def _metadata_version(name: str) -> str | None:
    dist = {"optimum": "optimum-quanto"}.get(name, name.replace("_", "-"))
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stage_env(ctx: Context, rec: Recorder) -> None:
    """GPU name, torch / triton / CUDA versions, the optional libraries, and the commit the kit was prepared
    from (prepare.sh writes it beside the wheels; the device's copy of the tree may have no .git)."""
    import torch

    numbers: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    rec.set(**numbers)  # first: the driver reads cuda_available even if the imports below hang
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        numbers.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            numbers["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            numbers["nvidia_smi"] = f"unavailable: {err}"
    rec.set(**numbers)
    numbers["libraries"] = {
        **{name: _version(name) for name in IMPORTED},
        **{name: _metadata_version(name) for name in LOOKED_UP},
    }
    numbers["prepared"] = read_json(REPO / "analysis/gpu/wheels/MANIFEST.json")
    try:
        numbers["commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        numbers["commit"] = None
    rec.set(**numbers)
    if ctx.mode == "gpu" and not numbers["cuda_available"]:
        rec.finish("failed", "no CUDA device: the GPU stages cannot run (use --rehearse on a CPU machine)")
        return
    rec.finish("ok")


# ------------------------------------------------------------------------------------------ gpu tests
OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def gpu_test_files() -> list[str]:
    """The test files that hold GPU-marked tests: collecting only these keeps the collection short (the
    whole suite takes ~10 s to collect on 2 cores)."""
    tests = sorted((REPO / "tests").glob("test_*.py"))
    return [p.relative_to(REPO).as_posix() for p in tests if "mark.gpu" in p.read_text(errors="replace")]


def parse_outcomes(text: str) -> dict[str, str]:
    """node id -> outcome, from `pytest -v` output (the lines pytest prints as each test ends, so a shard
    killed half-way still tells which of its tests finished)."""
    found = {}
    for line in text.splitlines():
        match = OUTCOME.match(line.strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


def stage_gpu_tests(ctx: Context, rec: Recorder) -> None:
    """`pytest -m gpu`: the compiled Triton kernels against the CPU reference. The node ids are spread
    over parallel shards (Triton compiles on the CPU, one kernel at a time per process; the machine has 16
    cores), each shard killed at the stage's deadline with its finished tests kept."""
    logs = ctx.work / "logs"
    files = gpu_test_files()
    env = {"TRITON_INTERPRET": "0"}
    collect_log = logs / "gpu_tests-collect.log"
    res = run_timed(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *files,
        ],
        collect_log,
        timeout=min(120.0, ctx.left() - 5),
        env=env,
    )
    ids = [
        line.strip()
        for line in collect_log.read_text().splitlines()
        if "::" in line and " " not in line.strip()
    ]
    rec.set(files=files, collected=len(ids), collect_s=res["wall_s"])
    if res["rc"] != 0:
        rec.finish("failed", f"collection failed: {last_error(collect_log)}")
        return
    if not ctx.cuda:
        rec.finish(
            "skipped",
            f"no CUDA: {len(ids)} gpu tests collected, none run (they run compiled Triton kernels on a GPU)",
        )
        return
    n_shards = max(1, min(4, (os.cpu_count() or 1) // 4, len(ids)))
    shards = [ids[i::n_shards] for i in range(n_shards)]
    begin = time.time()
    procs = []
    for i, shard in enumerate(shards):
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-v",
            "-p",
            "no:cacheprovider",
            "--tb=short",
            *shard,
        ]
        procs.append((start(cmd, logs / f"gpu_tests-shard{i}.log", env), logs / f"gpu_tests-shard{i}.log"))
    cut = False
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, ctx.left() - 5))
        except subprocess.TimeoutExpired:
            cut = True
            kill_group(proc)
    outcomes: dict[str, str] = {}
    for _, log in procs:
        outcomes.update(parse_outcomes(log.read_text(errors="replace")))
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = sorted(n for n, v in outcomes.items() if v in ("FAILED", "ERROR"))
    not_run = len(ids) - len(outcomes)
    rec.set(
        shards=n_shards,
        wall_s_tests=round(time.time() - begin, 1),
        passed=counts["PASSED"],
        failed=counts["FAILED"],
        errors=counts["ERROR"],
        skipped=counts["SKIPPED"],
        not_run=not_run,
        failed_ids=failed[:30],
        returncodes=[p.returncode for p, _ in procs],
    )
    if failed:
        rec.finish("failed", f"{len(failed)} of {len(ids)} gpu tests failed (first: {failed[0]})")
    elif cut or not_run:
        rec.finish("timeout", f"{not_run} of {len(ids)} gpu tests did not finish within the stage's budget")
    elif counts["SKIPPED"]:
        rec.finish("ok", f"{counts['SKIPPED']} gpu tests skipped themselves (see the shard logs)")
    else:
        rec.finish("ok")


# ------------------------------------------------------------------------------------- kernels bench
GOAL_SPEEDUP_VS_BF16 = 1.3  # issue 8: the quantized DIFF V2 core at least 1.3x the bf16 DIFF V2 core
GOAL_VS_BASELINE = 1.0  # ... and at least as fast as the baseline's flash attention (T >= 4096)
GOAL_COSINE = 0.999  # ... with cosine similarity >= 0.999 to the fp32 reference
GOAL_MIN_T = 4096
QUANTIZED = ("v2-int8qk-fp8pv-triton", "v2-int8tokqk-fp8pv-triton", "v2-fp8qk-fp8pv-triton")
BF16_V2 = ("v2-bf16-triton", "v2-flash-bf16")
BASELINE = ("baseline-sdpa-bf16", "baseline-flash-bf16")


def kernel_goals(rows: list[dict]) -> dict[str, Any]:
    """The issue-8 goals, read from the benchmark's rows: per quantized DIFF V2 variant and shape with
    T >= 4096, its speed-up over the fastest bf16 DIFF V2 core and over the fastest baseline, and its cosine
    to the fp32 reference (both input distributions); ``met`` per goal and variant over all such shapes.
    Speed is read on the N(0,1) inputs (the time does not depend on the values), cosine on both."""
    shapes: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if "error" in row:  # a variant that raised on this shape (bench.py records it and goes on)
            continue
        key = (row["T"], row["H"], row["Hkv"], row["d"], row["dist"])
        shapes.setdefault(key, {})[row["variant"]] = row
    per_shape = []
    for (t, h, hkv, d, dist), variants in sorted(shapes.items()):
        if t < GOAL_MIN_T:
            continue
        bf16 = min((variants[v]["ms"] for v in BF16_V2 if v in variants), default=None)
        base = min((variants[v]["ms"] for v in BASELINE if v in variants), default=None)
        for name in QUANTIZED:
            if name not in variants:
                continue
            row = variants[name]
            per_shape.append(
                {
                    "T": t,
                    "H": h,
                    "Hkv": hkv,
                    "d": d,
                    "dist": dist,
                    "variant": name,
                    "ms": row["ms"],
                    "speedup_vs_bf16_v2": None if bf16 is None else bf16 / row["ms"],
                    "speedup_vs_baseline": None if base is None else base / row["ms"],
                    "cosine": row.get("cosine"),
                    # where the time goes (bench.py's profile of the N(0,1) rows): host-bound or the kernels'
                    "host_ms": row.get("host_ms"),
                    "kernel_ms": row.get("kernel_ms"),
                    "launches": row.get("launches"),
                }
            )
    if not per_shape:
        return {"assessable": False, "reason": f"no quantized DIFF V2 row at T >= {GOAL_MIN_T}", "rows": []}
    met: dict[str, dict[str, bool]] = {}
    for name in QUANTIZED:
        mine = [r for r in per_shape if r["variant"] == name]
        if not mine:
            continue
        speed = [r for r in mine if r["dist"] == "normal"] or mine
        met[name] = {
            f"speedup_vs_bf16_v2 >= {GOAL_SPEEDUP_VS_BF16}": all(
                (r["speedup_vs_bf16_v2"] or 0) >= GOAL_SPEEDUP_VS_BF16 for r in speed
            ),
            f"speedup_vs_baseline >= {GOAL_VS_BASELINE}": all(
                (r["speedup_vs_baseline"] or 0) >= GOAL_VS_BASELINE for r in speed
            ),
            f"cosine >= {GOAL_COSINE} (normal)": all(
                (r["cosine"] or 0) >= GOAL_COSINE for r in mine if r["dist"] == "normal"
            ),
            f"cosine >= {GOAL_COSINE} (fa3 outliers)": all(
                (r["cosine"] or 0) >= GOAL_COSINE for r in mine if r["dist"] == "fa3"
            ),
        }
    return {"assessable": True, "min_T": GOAL_MIN_T, "met": met, "rows": per_shape}


def stage_kernels_bench(ctx: Context, rec: Recorder) -> None:
    """analysis/kernels/bench.py: speed and accuracy of every attention core, then the issue-8 goals. The
    script writes its JSON after every shape (--json), so a cut run keeps its finished shapes."""
    bench = ctx.work / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    log = ctx.work / "logs" / "kernels_bench.log"
    script = "analysis/kernels/bench.py"
    if not ctx.cuda:
        path = bench / "bench-smoke.json"
        res = run_timed([sys.executable, script, "--smoke", "--json", str(path)], log, ctx.left() - 3)
        result = read_json(path) or {}
        rows = result.get("rows", [])
        rec.set(
            smoke_rc=res["rc"],
            smoke_wall_s=res["wall_s"],
            smoke_rows=len(rows),
            goals=kernel_goals(rows),
            issue46_goals=result.get("goals", []),
        )
        if res["rc"] != 0 or not rows:
            rec.finish("failed", f"the CPU smoke run of bench.py failed: {last_error(log)}")
            return
        rec.finish(
            "skipped",
            "no CUDA: ran bench.py --smoke on CPU instead (Triton's interpreter, one 40-token shape; its "
            "times are not GPU times and no goal can be assessed)",
        )
        return
    path = bench / "bench.json"
    res = run_timed(
        [sys.executable, script, "--out", str(bench), "--json", str(path)],
        log,
        ctx.left() - 3,
        env={"TRITON_INTERPRET": "0"},
    )
    result = read_json(path) or {}
    rows = result.get("rows", [])
    rec.set(
        rc=res["rc"],
        bench_wall_s=res["wall_s"],
        complete=bool(result.get("complete")),
        device=result.get("device"),
        flash_attn=result.get("flash_attn"),
        rows=len(rows),
        shapes=sorted({(r["T"], r["H"], r["Hkv"], r["d"]) for r in rows}),
        errors=[f"{r['variant']} T={r['T']} d={r['d']}: {r['error']}" for r in rows if "error" in r][:20],
        goals=kernel_goals(rows),
        issue46_goals=result.get("goals", []),
    )
    rec.finish_run(res, log, f"cut at the stage's budget after {len(rows)} rows (kept in bench.json)")


def stage_kernels_tune(ctx: Context, rec: Recorder) -> None:
    """analysis/kernels/bench.py --tune: every launch configuration the offline sm_90 compile found clean,
    timed per Triton variant at T = 4096 (head dim 64 and 128); the fastest per variant is what the kernel's
    table (triton_diff._CONFIGS) should hold. The JSON is rewritten after each variant, so a cut run keeps
    what it timed."""
    bench = ctx.work / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    log = ctx.work / "logs" / "kernels_tune.log"
    script = "analysis/kernels/bench.py"
    path = bench / ("tune-smoke.json" if not ctx.cuda else "tune.json")
    cmd = [sys.executable, script, "--tune", "--json", str(path)] + ([] if ctx.cuda else ["--smoke"])
    env = {"TRITON_INTERPRET": "0"} if ctx.cuda else None
    res = run_timed(cmd, log, ctx.left() - 3, env=env)
    result = read_json(path) or {}
    rows = result.get("tuning", [])
    rec.set(
        rc=res["rc"],
        wall_s_tune=res["wall_s"],
        rows=len(rows),
        errors=[f"{r['variant']} d={r['d']} {r.get('config')}: {r['error']}" for r in rows if "error" in r][
            :20
        ],
        best=result.get("best", {}),
    )
    if not ctx.cuda:
        if res["rc"] != 0 or not rows:
            rec.finish("failed", f"the CPU smoke run of bench.py --tune failed: {last_error(log)}")
            return
        rec.finish(
            "skipped", "no CUDA: ran bench.py --smoke --tune on CPU instead (its times are not GPU times)"
        )
        return
    rec.finish_run(
        res, log, f"cut at the stage's budget after {len(rows)} configurations (kept in tune.json)"
    )


# ------------------------------------------------------------------------------------------------ cli
# The random mid-size model of the CLI stage (a baseline config, made DIFF V2 by matched_config): on the GPU
# ~190M parameters with a 2,048-token context (the size of train-gpu.yaml's suggested larger model); in the
# rehearsal a toy one.
MID = {
    "gpu": {
        "d_model": 1024,
        "n_layers": 16,
        "n_heads": 16,
        "n_kv_heads": 8,
        "head_dim": 64,
        "ffn_dim": 2816,
        "max_seq_len": 2048,
    },
    "rehearse": {
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "ffn_dim": 384,
        "max_seq_len": 256,
    },
}
CLI_SIZES = {
    "gpu": {
        "profile_tokens": 16384,
        "profile_seq_len": 512,
        "calib_tokens": 4096,
        "report_tokens": 2048,
        "eval_tokens": 16384,
    },
    "rehearse": {
        "profile_tokens": 1024,
        "profile_seq_len": 256,
        "calib_tokens": 256,
        "report_tokens": 256,
        "eval_tokens": 512,
    },
}
EVAL_PLANS = ("attn-logits-int8", "attn-logits-int4", "w8a8", "qk-int8-pv-fp8", "qk-int8-token-pv-fp8")
# Real backends run in float32: optimum-quanto's layers fail under --dtype bfloat16 (found by this kit's
# rehearsal: "expected m1 and m2 to have the same dtype"); bitsandbytes runs in either.
BACKEND_PLANS = (("quanto-w8a8", "optimum.quanto"), ("bnb-int8", "bitsandbytes"))


def write_mid_model(folder: Path, mode: str) -> dict[str, Any]:
    """A random DIFF V2 model of the mid size, saved in bfloat16 (``init:`` only knows the presets)."""
    import torch

    from diffquant.io import save_checkpoint
    from diffquant.models import DecoderLM, ModelConfig, matched_config

    config = matched_config(ModelConfig(**MID[mode]), "diff_v2")
    torch.manual_seed(0)
    model = DecoderLM(config).to(torch.bfloat16)
    save_checkpoint(model, folder, overwrite=True)
    return {"parameters": model.num_parameters(), "config": config.to_dict()}


def _table5(path: Path) -> dict[str, Any]:
    data = read_json(path) or {}
    out = {}
    for model, entry in data.get("models", {}).items():
        out[model] = {
            act: {k: entry["table5"][act].get(k) for k in ("top1", "top10", "median")}
            for act in ("attention logits", "hidden states")
            if act in entry.get("table5", {})
        }
    return out


def _sweep(folder: Path, metric: str = "bits_per_byte") -> dict[str, Any]:
    """{model: {plan: {value, delta, seconds, paths}}} from a sweep's results.csv and timing.csv."""
    out: dict[str, dict[str, dict]] = {}
    try:
        with open(folder / "results.csv") as f:
            for row in csv.DictReader(f):
                if row["metric"] == metric:
                    out.setdefault(row["model"], {})[row["plan"]] = {
                        "value": float(row["value"]),
                        "delta": float(row["delta"]),
                    }
        with open(folder / "timing.csv") as f:
            for row in csv.DictReader(f):
                cell = out.get(row["model"], {}).get(row["plan"])
                if cell is not None and row["task"] in ("bpb", "ppl"):
                    cell["seconds"] = float(row["seconds"])
                    cell["paths"] = row.get("attention_paths")
    except (OSError, KeyError, ValueError):
        pass
    return out


def _profile_script(
    ctx: Context, cmd: list[str], path: Path, log_name: str, limit_s: float
) -> dict[str, Any]:
    """Run one of analysis/profile's GPU scripts, ``cmd`` writing its JSON to ``path``, within ``limit_s``
    and the stage's budget: its rows, its exit code and time, and its last error if it failed."""
    log = ctx.work / "logs" / log_name
    res = run_timed(cmd, log, min(limit_s, ctx.left() - 5))
    result = read_json(path) or {}
    out: dict[str, Any] = {"rc": res["rc"], "wall_s": res["wall_s"], "rows": result.get("rows", [])}
    if res["rc"] != 0:
        out["error"] = last_error(log)
    return out


def _profile_topk(ctx: Context, path: Path) -> dict[str, Any]:
    """analysis/profile/device_topk.py: one site update with the packed-key top-k against the host-guided
    search, per size (what `stats.DEVICE_TOPK_MAX` should be); a few seconds. Its rows, or why none."""
    if ctx.left() < 20:
        return {"status": "not run", "reason": "the stage's budget was spent"}
    sizes = ["16", "20", "22", "24", "26"] if ctx.cuda else ["12", "14"]
    cmd = [sys.executable, "analysis/profile/device_topk.py", "--device", ctx.device, "--sizes", *sizes]
    cmd += ["--rounds", "7" if ctx.cuda else "2", "--out", str(path)]
    return _profile_script(ctx, cmd, path, "profile-topk.log", 90.0)


def _profile_syncs(ctx: Context, path: Path) -> dict[str, Any]:
    """analysis/profile/device_syncs.py: a tiny DIFF V1 and V2 profile's host syncs, as CUDA reports them (the
    rehearsal: as the CPU's fake-CUDA device check counts them, 69 each); a few seconds. Its rows, or why
    none."""
    if ctx.left() < 15:
        return {"status": "not run", "reason": "the stage's budget was spent"}
    cmd = [sys.executable, "analysis/profile/device_syncs.py", "--device", ctx.device, "--out", str(path)]
    return _profile_script(ctx, cmd, path, "profile-syncs.log", 60.0)


def stage_cli(ctx: Context, rec: Recorder) -> None:
    """`diffquant profile`, `quantize` and `eval` on CUDA in bfloat16 (the rehearsal: on CPU), on the zoo's
    DIFF V2 and a random mid-size DIFF V2, each command timed; one failing command does not stop the rest.
    `qk-int8-pv-fp8` and `qk-int8-token-pv-fp8` are the plans that dispatch to the Triton kernel on CUDA (their
    cells record the path)."""
    cli = ctx.work / "cli"
    logs = ctx.work / "logs"
    sizes = CLI_SIZES[ctx.mode]
    mid = cli / "mid-diff_v2"
    begin = time.time()
    rec.set(mid_model=write_mid_model(mid, ctx.mode), mid_write_s=round(time.time() - begin, 1))
    dev = ["--device", ctx.device]
    bf16 = ["--dtype", "bfloat16"]
    zoo = "zoo:diff_v2"
    backends = [plan for plan, module in BACKEND_PLANS if importlib.util.find_spec(module.split(".")[0])]
    tokens = ["--tokens", str(sizes["profile_tokens"]), "--seq-len", str(sizes["profile_seq_len"])]
    calib = ["--calib-tokens", str(sizes["calib_tokens"]), "--eval-tokens", str(sizes["report_tokens"])]
    task = ["--task", f"bpb:tokens={sizes['eval_tokens']}"]

    def outs(name: str) -> list[str]:
        return ["--out", str(cli / name), "--force"]

    # Most telling first (the stage may run out of time): the Table 5 view of both, the sweep with the plan
    # that runs the Triton kernel, then quantized checkpoints and the real backends; the 190M quantize last.
    commands: list[tuple[str, list[str]]] = [
        ("profile", ["profile", zoo, str(mid), *dev, *bf16, *tokens, *outs("profile")]),
        (
            "eval",
            ["eval", zoo, str(mid), *task, "--plan", *EVAL_PLANS, *dev, *bf16, *outs("eval")],
        ),
        ("quantize-zoo", ["quantize", zoo, "--plan", "w8a8", *dev, *bf16, *calib, *outs("quantize-zoo")]),
    ]
    if backends:
        fp32 = ["--dtype", "float32"]
        commands.append(
            ("eval-backends", ["eval", zoo, *task, "--plan", *backends, *dev, *fp32, *outs("eval-backends")])
        )
    commands.append(
        ("quantize-mid", ["quantize", str(mid), "--plan", "w8a8", *dev, *bf16, *calib, *outs("quantize-mid")])
    )

    results: dict[str, dict[str, Any]] = {}
    for name, args in commands:
        if ctx.left() < 5:
            results[name] = {"status": "not run", "reason": "the stage's budget was spent"}
            rec.set(commands=results)
            continue
        log = logs / f"cli-{name}.log"
        res = run_timed(diffquant(*args), log, ctx.left() - 2)
        entry: dict[str, Any] = {"argv": "diffquant " + " ".join(args), **res}
        entry["status"] = "ok" if res["rc"] == 0 else ("timeout" if res["timed_out"] else "failed")
        if res["rc"] != 0:
            entry["error"] = last_error(log)
        if name == "profile":
            entry["table5"] = _table5(cli / "profile" / "table5.json")
        elif name.startswith("quantize"):
            report = (read_json(cli / name / "quant_report.json") or {}).get("report", {})
            entry["logits_error"] = report.get("logits")
        else:
            entry["bpb"] = _sweep(cli / name)
        results[name] = entry
        rec.set(commands=results)
    if not backends:
        results["eval-backends"] = {
            "status": "not run",
            "reason": "neither optimum-quanto nor bitsandbytes imports",
        }
        rec.set(commands=results)
    rec.set(profile_topk=_profile_topk(ctx, cli / "profile-topk.json"))
    rec.set(profile_syncs=_profile_syncs(ctx, cli / "profile-syncs.json"))
    bad = [n for n, r in results.items() if r["status"] not in ("ok", "not run")]
    unrun = [n for n, r in results.items() if r["status"] == "not run" and n != "eval-backends"]
    if bad:
        rec.finish(
            "failed", "; ".join(f"{n}: {results[n].get('error') or results[n]['status']}" for n in bad)
        )
    elif unrun:
        rec.finish("timeout", f"not run within the budget: {', '.join(unrun)}")
    else:
        rec.finish("ok")
