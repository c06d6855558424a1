"""Benchmark rotation's online cost on CPU: the fast Hadamard vs a dense matmul, and a rotated fake-quant
forward vs the unrotated one.

    OMP_WAIT_POLICY=PASSIVE python analysis/rotate/bench.py [--model fetch:smollm2] [--rounds 5]

1. x @ H_n^T / sqrt(n) for x of 1,024 rows at n = 576 / 1536 / 4096 / 14336: the fast transform
   (:func:`diffquant.quant.hadamard.fast_hadamard`: butterflies for the 2^m factor, a K x K matmul for the
   rest) vs ``x @ Q`` with the dense matrix, float32, median of interleaved rounds.
2. A forward of 2 x 512 tokens through ``--model`` with the ``w4a4`` plan (fake-quant on) vs ``w4a4-quarot``
   (the same plan after R1 + R2 + R4: online Hadamard before every down_proj) and ``w4a4`` with R3 added (an
   online Hadamard on Q and K per head): the online transforms' share of a quantized forward. R1 / R2 are
   folded into weights and cost nothing at run time. Goal: online R4 + R3 <= 1.15x.

Prints a table and writes bench.json beside this script.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from diffquant.io import load_model
from diffquant.quant import QuantPlan, apply_plan, preset
from diffquant.quant import hadamard as H


def _median_time(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    """Each function timed once per round, rounds interleaved (a busy machine slows all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_transform(rounds: int) -> list[dict]:
    rows = []
    for n in (576, 1536, 4096, 14336):
        x = torch.randn(1024, n)
        q = (H.hadamard(n).T / math.sqrt(n)).float()
        t = _median_time({"fast": lambda x=x: H.fast_hadamard(x), "dense": lambda x=x, q=q: x @ q}, rounds)
        err = float((H.fast_hadamard(x) - x @ q).abs().max())
        rows.append(
            {
                "n": n,
                "construction": H.construction(n),
                "fast_ms": 1e3 * t["fast"],
                "dense_ms": 1e3 * t["dense"],
                "max_abs_diff": err,
            }
        )
    return rows


def bench_forward(model_spec: str, rounds: int) -> dict:
    w4a4 = preset("w4a4")
    plans = {
        "w4a4": w4a4,
        "w4a4-quarot (R1 R2 R4)": preset("w4a4-quarot"),
        "w4a4-quarot + R3": QuantPlan.from_dict(
            {
                **preset("w4a4-quarot").to_dict(),
                "rotate": {**preset("w4a4-quarot").rotate.to_dict(), "qk": "hadamard"},
            }
        ),
    }
    models = {}
    for name, plan in plans.items():
        model = load_model(model_spec)
        apply_plan(model, plan)
        models[name] = model.eval()

    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(0, vocab, (2, 512), generator=torch.Generator().manual_seed(0))

    def run(model):
        with torch.no_grad():
            model(ids)

    t = _median_time({name: (lambda m=m: run(m)) for name, m in models.items()}, rounds)
    base = t["w4a4"]
    return {name: {"s": s, "ratio": s / base} for name, s in t.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    transform = bench_transform(args.rounds)
    print(f"{'n':>6}  {'construction':<34} {'fast ms':>8} {'dense ms':>9} {'speed-up':>8}  max |diff|")
    for r in transform:
        print(
            f"{r['n']:>6}  {r['construction']:<34} {r['fast_ms']:8.2f} {r['dense_ms']:9.2f} "
            f"{r['dense_ms'] / r['fast_ms']:7.2f}x  {r['max_abs_diff']:.1e}"
        )
    forward = bench_forward(args.model, args.rounds)
    print(f"\nforward of 2 x 512 tokens through {args.model}, fake-quant on (median of {args.rounds} rounds)")
    for name, r in forward.items():
        print(f"  {name:<26} {r['s']:7.3f} s  {r['ratio']:.3f}x")
    out = Path(__file__).with_name("bench.json")
    out.write_text(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "transform": transform,
                "forward": {"model": args.model, **forward},
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
