"""Benchmark: peak RSS and wall time of one lm-eval LAMBADA-format cell (issue 27).

For each model, a fresh subprocess (``OMP_WAIT_POLICY=PASSIVE``) does what a sweep cell does: loads the
model (``diffquant.io.load_model``, float32 on the CPU) and runs the task
``lmeval:tasks=lambada_local,path=FILE,limit=N`` through :func:`diffquant.eval.tasks.run_task` (batch size
8, the sweep default). FILE holds LAMBADA-format passages cut from WikiText-2 the way
tests/test_real_smollm2.py::test_lmeval_adapter_equals_hflm cuts them: the paragraphs of
``diffquant/data/wikitext2/wiki.test.raw`` with more than 80 words, each cut to its first 60 words, one
``{"text": ...}`` per line (the target is the last word).

The child reports ``getrusage(RUSAGE_SELF).ru_maxrss`` (the peak so far) after each stage: imports (torch,
diffquant, lm_eval, datasets), the model load, the lm-eval run; and the wall time of the run. The goal is
a peak of at most ``--goal-gb`` (2.0 GB, 10^9 bytes) for the whole cell.

    python analysis/memory/lmeval.py [--models zoo:diff_v2 fetch:smollm2] [--limit 200] [--goal-gb 2.0]

Prints a table (keep it in lmeval.txt beside this file) and the metrics, so a change can be checked
for equal numbers as well.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RAW = ROOT / "diffquant/data/wikitext2/wiki.test.raw"
GB = 1e9


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lambada_file(path: Path, n: int) -> Path:
    paragraphs = [line.strip() for line in RAW.read_text().splitlines() if len(line.split()) > 80]
    if len(paragraphs) < n:
        raise SystemExit(f"only {len(paragraphs)} paragraphs of more than 80 words in {RAW}")
    path.write_text("".join(json.dumps({"text": " ".join(p.split()[:60])}) + "\n" for p in paragraphs[:n]))
    return path


def child(model_spec: str, file: str, limit: int, batch_size: int) -> None:
    stages = {}
    import lm_eval  # noqa: F401, PLC0415
    import torch  # noqa: PLC0415

    from diffquant.eval.tasks import parse_task, run_task  # noqa: PLC0415
    from diffquant.io import load_model  # noqa: PLC0415

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    stages["imports"] = max_rss()
    model = load_model(model_spec, device=torch.device("cpu"), dtype=torch.float32)
    stages["load"] = max_rss()
    task = parse_task(f"lmeval:tasks=lambada_local,path={file},limit={limit}")
    start = time.perf_counter()
    with torch.no_grad():
        metrics = run_task(model.eval(), task, batch_size=batch_size)
    seconds = time.perf_counter() - start
    stages["lmeval"] = max_rss()
    print(json.dumps({"stages": stages, "seconds": seconds, "metrics": metrics}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["zoo:diff_v2", "fetch:smollm2"])
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--goal-gb", type=float, default=2.0)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.limit, args.batch_size)
        return
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        file = lambada_file(Path(tmp) / "lambada.jsonl", args.limit)
        for spec in args.models:
            cmd = [sys.executable, __file__, "--child", spec, str(file), "--limit", str(args.limit)]
            cmd += ["--batch-size", str(args.batch_size)]
            start = time.perf_counter()
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - start
            if run.returncode != 0:
                raise SystemExit(f"{spec}: the child failed\n{run.stderr[-4000:]}")
            data = json.loads(run.stdout.strip().splitlines()[-1])
            rows.append((spec, data, wall))
    print(
        f"lm-eval cell: lambada_local, {args.limit} passages (WikiText-2), batch {args.batch_size}, fp32, CPU"
    )
    print(f"{'model':<16}{'imports GB':>11}{'load GB':>9}{'peak GB':>9}{'lm-eval s':>11}{'total s':>9}  goal")
    for spec, data, wall in rows:
        s = data["stages"]
        ok = s["lmeval"] <= args.goal_gb * GB
        print(
            f"{spec:<16}{s['imports'] / GB:>11.2f}{s['load'] / GB:>9.2f}{s['lmeval'] / GB:>9.2f}"
            f"{data['seconds']:>11.1f}{wall:>9.1f}  {'PASS' if ok else 'FAIL'} (<= {args.goal_gb} GB)"
        )
    for spec, data, _ in rows:
        print(f"{spec} metrics: {json.dumps(data['metrics'], sort_keys=True)}")


if __name__ == "__main__":
    main()
