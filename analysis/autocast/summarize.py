"""Tables of results.json (run.py): training loss at the last step per kind x precision, and the DIFF V2 -
baseline gap per seed in fp32 and under CPU bf16 autocast, paired by seed.

    .venv/bin/python analysis/autocast/summarize.py [results.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f} (1 seed)"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f} (sd, {len(values)} seeds)"


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("results.json")
    runs = json.loads(path.read_text())["runs"]
    cell: dict[tuple[str, str, int, int], dict] = {}
    for r in runs:
        cell[(r["kind"], r["precision"], r["seed"], r["steps"])] = r
    for steps in sorted({k[3] for k in cell}):
        print(f"\n## {steps} steps\n")
        print("| kind | precision | seeds | train loss at last step | val bpb (fp32 eval) |")
        print("|---|---|---|---|---|")
        for kind in ("baseline", "diff_v1", "diff_v2"):
            for prec in ("fp32", "bf16"):
                rs = [r for k, r in cell.items() if k[0] == kind and k[1] == prec and k[3] == steps]
                if not rs:
                    continue
                seeds = ",".join(str(r["seed"]) for r in rs)
                print(
                    f"| {kind} | {prec} | {seeds} | {spread([r['loss'][-1] for r in rs])} "
                    f"| {spread([r['val_bpb_fp32'] for r in rs])} |"
                )
        print("\n| seed | kind | fp32 loss | bf16 loss | bf16 - fp32 |")
        print("|---|---|---|---|---|")
        for (kind, prec, seed, st), r in sorted(cell.items()):
            if st != steps or prec != "fp32" or (kind, "bf16", seed, st) not in cell:
                continue
            b = cell[(kind, "bf16", seed, st)]["loss"][-1]
            print(f"| {seed} | {kind} | {r['loss'][-1]:.4f} | {b:.4f} | {b - r['loss'][-1]:+.4f} |")
        print("\n| seed | gap fp32 (V2 - base) | gap bf16 (V2 - base) | bf16 gap - fp32 gap |")
        print("|---|---|---|---|")
        for seed in sorted({k[2] for k in cell if k[3] == steps}):
            keys = [(k, p, seed, steps) for k in ("baseline", "diff_v2") for p in ("fp32", "bf16")]
            if not all(k in cell for k in keys):
                continue
            g = {
                p: cell[("diff_v2", p, seed, steps)]["loss"][-1]
                - cell[("baseline", p, seed, steps)]["loss"][-1]
                for p in ("fp32", "bf16")
            }
            print(f"| {seed} | {g['fp32']:+.4f} | {g['bf16']:+.4f} | {g['bf16'] - g['fp32']:+.4f} |")
        print("\nper-step loss (fp32 / bf16):")
        for (kind, prec, seed, st), r in sorted(cell.items()):
            if st == steps and prec == "fp32" and (kind, "bf16", seed, st) in cell:
                b = cell[(kind, "bf16", seed, st)]["loss"]
                pairs = " ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(r["loss"], b, strict=True))
                print(f"{kind} s{seed}: {pairs}")


if __name__ == "__main__":
    main()
