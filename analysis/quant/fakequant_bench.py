"""Benchmark: what the ``w8a8`` fake-quant plan costs next to a plain forward (issue 27, item 4).

The same measurement as the ``w8a8`` mode of analysis/profile/bench.py: a copy of the model with
``QuantPlan.load("w8a8")`` applied (int8 weights per output channel, int8 Linear inputs per token, dynamic),
timed as the wall time of a no-grad pass over the windows, against the plain model. Two models: ``small``
(a randomly initialised DIFF V2 of preset small, 8 windows x 256 byte ids) and ``smollm2`` (``fetch:smollm2``,
4 windows x 256 tokens of WikiText-2 test; skipped with --no-real). Rounds interleave plain and w8a8; the ratio
is median(w8a8) / median(plain) over the rounds.

``--compare DIR`` also measures another source tree (e.g. ``git archive HEAD | tar -x -C DIR``: the code
before a change): each tree runs in its own subprocess (``PYTHONPATH=tree``), the trees alternate
``--alternations`` times, and the table shows both, each ratio the median over that tree's runs. Set
OMP_WAIT_POLICY=PASSIVE (done here) on a shared machine.

    python analysis/quant/fakequant_bench.py [--rounds 7] [--threads 2] [--no-real] [--compare DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"small": 1.15, "smollm2": 1.10}


def _models(real: bool):
    import torch

    from diffquant.data import token_windows
    from diffquant.io import load_model

    out = {}
    torch.manual_seed(0)
    small = load_model("init:diff_v2:small")
    out["small"] = (small, torch.randint(0, 256, (8, 256), generator=torch.Generator().manual_seed(0)))
    if real:
        smol = load_model("fetch:smollm2")
        out["smollm2"] = (smol, token_windows("wikitext2:test", 4 * 256, 256, smol.tokenizer))
    return out


def _time(model, ids, batch: int) -> float:
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch):
            model(ids[i : i + batch])
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    """{model: {"plain": [s...], "w8a8": [s...]}} from interleaved rounds in this process."""
    import copy

    import torch

    from diffquant.quant import QuantPlan, apply_plan

    torch.set_num_threads(args.threads)
    results = {}
    for name, (model, ids) in _models(not args.no_real).items():
        model.eval()
        quantized = copy.deepcopy(model)
        apply_plan(quantized, QuantPlan.load("w8a8"))
        quantized.eval()
        _time(model, ids[:2], args.batch)  # warm-up: first calls allocate (and fill the weight cache)
        _time(quantized, ids[:2], args.batch)
        times = {"plain": [], "w8a8": []}
        for _ in range(args.rounds):
            times["plain"].append(_time(model, ids, args.batch))
            times["w8a8"].append(_time(quantized, ids, args.batch))
        results[name] = times
    return results


def _ratio(times: dict) -> float:
    return statistics.median(times["w8a8"]) / statistics.median(times["plain"])


def _child(tree: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--threads", str(args.threads)]
    cmd += ["--batch", str(args.batch)] + (["--no-real"] if args.no_real else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per run (default 7)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batch", type=int, default=8, help="windows per forward (default 8)")
    parser.add_argument("--no-real", action="store_true", help="skip SmolLM2")
    parser.add_argument("--compare", type=Path, help="another source tree to measure (the 'before' code)")
    parser.add_argument(
        "--alternations", type=int, default=3, help="runs per tree with --compare (default 3)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    trees = {"this tree": ROOT} if args.compare is None else {"before": args.compare, "after": ROOT}
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.alternations if args.compare else 1):
        for label, tree in trees.items():
            runs[label].append(_child(tree, args))
    names = list(next(iter(runs.values()))[0])
    print(
        f"w8a8 fake-quant / plain forward: median over {args.rounds} interleaved rounds per run, "
        f"{len(next(iter(runs.values())))} run(s) per tree (alternating), {args.threads} threads"
    )
    print(f"{'tree':<10}" + "".join(f"{n:>10}" for n in names) + "   per-run ratios")
    for label, results in runs.items():
        cells = "".join(f"{statistics.median(_ratio(r[n]) for r in results):>10.3f}" for n in names)
        each = "; ".join(f"{n} " + " ".join(f"{_ratio(r[n]):.3f}" for r in results) for n in names)
        print(f"{label:<10}{cells}   {each}")
    print(f"{'target':<10}" + "".join(f"{'<= ' + str(TARGETS[n]):>10}" for n in names))
    for label, results in runs.items():
        plain = {n: statistics.median(statistics.median(r[n]["plain"]) for r in results) for n in names}
        print(f"{label}: plain forward " + ", ".join(f"{n} {plain[n]:.3f} s" for n in names))


if __name__ == "__main__":
    main()
