"""Benchmark: peak RSS and wall time per stage of ``diffquant quantize`` (issue 27).

For each model, a fresh subprocess (``OMP_WAIT_POLICY=PASSIVE``) runs::

    diffquant quantize MODEL --plan w8a8-tensor --calib-tokens 1024 --seq-len 512 --eval-tokens 1024 --out OUT

through :func:`diffquant.cli.main`, with the functions :mod:`diffquant.io.quantize` calls for each stage
wrapped: the loads (``load_model``; the quantized model's share of the reference, ``quantized_copy``),
``apply_plan``, ``calibrate`` (static scales), ``compare_models`` (the error report against the
unquantized model) and ``save_quantized`` (the checkpoint write). A thread samples the resident set
(``/proc/self/statm``) every 5 ms; a stage's peak is the largest sample while it ran, or
``getrusage(RUSAGE_SELF).ru_maxrss`` when the process peak rose during the stage (a spike between two
samples). The run's peak is ``ru_maxrss`` at the end. GB here is 10^9 bytes; the goal is a peak of at most
``--goal-gb`` (2.0 GB) for ``fetch:smollm2`` (0.54 GB of float32 weights) and no worse than before for
the zoo model.

    python analysis/memory/quantize.py [--models fetch:smollm2 zoo:diff_v2] [--goal-gb 2.0]

Prints a table (keep it in quantize.txt beside this file) and the last summary line of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GB = 1e9
FLAGS = ["--plan", "w8a8-tensor", "--calib-tokens", "1024", "--seq-len", "512", "--eval-tokens", "1024"]
STAGES = {  # the name diffquant.io.quantize calls -> the stage it is
    "load_model": "load",
    "quantized_copy": "quantized model (shares the reference)",
    "apply_plan": "apply plan",
    "calibrate": "calibrate (static scales)",
    "compare_models": "error report",
    "save_quantized": "write checkpoint",
}


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler(threading.Thread):
    """The resident set every ``interval`` s; ``take()`` returns the largest since the last take."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak = interval, 0
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def take(self) -> int:
        peak, self.peak = max(self.peak, self.rss()), self.rss()
        return peak


def child(model: str, out: str) -> None:
    import diffquant.io.quantize as q  # noqa: PLC0415
    from diffquant.cli import main  # noqa: PLC0415

    sampler = Sampler()
    sampler.start()
    stages: list[dict] = [{"stage": "imports", "s": 0.0, "peak": sampler.take(), "end": sampler.rss()}]

    def wrap(name, fn):
        def wrapped(*args, **kwargs):
            before, t0 = max_rss(), time.perf_counter()
            sampler.take()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds, peak = time.perf_counter() - t0, sampler.take()
                if max_rss() > before:
                    peak = max(peak, max_rss())
                stages.append({"stage": STAGES[name], "s": seconds, "peak": peak, "end": sampler.rss()})

        return wrapped

    for name in STAGES:
        if hasattr(q, name):
            setattr(q, name, wrap(name, getattr(q, name)))
    t0 = time.perf_counter()
    code = main(["quantize", model, *FLAGS, "--out", out])
    total = {"stage": "whole run", "s": time.perf_counter() - t0, "peak": max_rss(), "end": sampler.rss()}
    print("STAGES " + json.dumps({"code": code, "stages": [*stages, total]}))


def run(model: str) -> tuple[dict, str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", model, str(Path(tmp) / "out")],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=False,
        )
    lines = proc.stdout.splitlines()
    result = [json.loads(line[7:]) for line in lines if line.startswith("STAGES ")]
    if proc.returncode or not result:
        raise SystemExit(f"{model}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = next((line for line in reversed(lines) if line.startswith("wrote ")), "")
    return result[0], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["fetch:smollm2", "zoo:diff_v2"])
    parser.add_argument("--goal-gb", type=float, default=2.0)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"diffquant quantize MODEL {' '.join(FLAGS)} --out OUT (GB = 10^9 bytes)")
    for model in args.models:
        result, summary = run(model)
        print(f"\n{model}")
        print(f"  {'stage':<42}{'wall s':>8}{'peak GB':>9}{'after GB':>10}")
        for s in result["stages"]:
            print(f"  {s['stage']:<42}{s['s']:>8.1f}{s['peak'] / GB:>9.2f}{s['end'] / GB:>10.2f}")
        peak = result["stages"][-1]["peak"] / GB
        if model.startswith("fetch:smollm2"):
            verdict = "PASS" if peak <= args.goal_gb else "FAIL"
            print(f"  peak {peak:.2f} GB, goal <= {args.goal_gb} GB: {verdict}")
        print(f"  summary: {summary}")


if __name__ == "__main__":
    main()
