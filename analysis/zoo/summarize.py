"""Summarise the zoo's training runs: a table of the cards and the training curves.

    python analysis/zoo/summarize.py [runs/train]

Reads each run's log.csv and final/card.json (written by `diffquant train recipes/zoo-KIND.yaml`) and
writes zoo.md (table) and curves.png (training loss and validation bits per byte vs step) beside this file.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

KINDS = ("baseline", "diff_v1", "diff_v2")
COLORS = {"baseline": "#0173B2", "diff_v1": "#DE8F05", "diff_v2": "#029E73"}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/train")
    here = Path(__file__).parent
    lines = [
        "| model | parameters | steps | tokens | train bpb | val bpb | retrieval acc (chance) | seconds/log tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=150, layout="constrained")
    for kind in KINDS:
        run = runs / f"zoo-{kind}"
        card = json.loads((run / "final" / "card.json").read_text())
        rows = list(csv.DictReader((run / "log.csv").open()))
        steps = [int(r["step"]) for r in rows]
        bits = [float(r["bits_per_token"]) for r in rows]
        val = [(int(r["step"]), float(r["val_bpb"])) for r in rows if r["val_bpb"]]
        speed = sorted(float(r["tokens_per_second"]) for r in rows)[len(rows) // 2]
        r = card["retrieval"]
        lines.append(
            f"| zoo:{kind} | {card['parameters']:,} | {card['steps']} | {card['tokens']:,} | "
            f"{card['train_bpb']:.3f} | {card['val_bpb']:.3f} | {r['acc_rank']:.2f} ({r['chance_rank']:.2f}) | "
            f"median {speed:,.0f} tok/s |"
        )
        ax1.plot(steps, bits, color=COLORS[kind], label=kind, linewidth=1)
        ax2.plot(*zip(*val, strict=True), color=COLORS[kind], marker="o", label=kind)
    ax1.set(xlabel="step", ylabel="training loss (bits per token)", title="training loss", yscale="log")
    ax2.set(xlabel="step", ylabel="validation bits per byte", title="stdlib:validation (16,384 tokens)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(here / "curves.png")
    (here / "zoo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
