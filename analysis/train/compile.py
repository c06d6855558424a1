"""Does ``torch_compile`` speed up training? The trainer itself, eager and compiled, per kind (issue 46).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python analysis/train/compile.py [--steps 40] [--skip 5] [--kinds ...]

For each kind: ``diffquant.train.train`` on the zoo's recipe of that kind (``recipes/zoo-KIND.yaml``: 0.9M
parameters, 16 x 256 tokens a step, 2 threads), stopped after ``--steps`` steps and logging every step,
once eagerly and once with ``torch_compile: true``. Tokens/s is the median of the per-step log rows after
the first ``--skip`` (those hold the compile and the warm-up); the first step's seconds show what the
compile costs. The last step's training loss of both runs is printed too: compiling must not change
what is trained beyond float rounding. Prints a table and writes ``compile.json`` beside this file.

On a GPU the same question is the kit's ``train_compile`` stage (analysis/gpu), at 52M in bf16 autocast.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from diffquant.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("baseline", "diff_v1", "diff_v2", "gated", "sink", "clipped")


def one_run(kind: str, compiled: bool, steps: int, skip: int, folder: Path) -> dict[str, float]:
    """``steps`` steps of the zoo recipe of ``kind``: the median tokens/s of the log rows after the first
    ``skip``, the first step's seconds and the last step's loss."""
    recipe = ROOT / "recipes" / f"zoo-{kind}.yaml"
    overrides = ["log_every=1", f"torch_compile={'true' if compiled else 'false'}"]
    cfg = TrainConfig.load(recipe, overrides)
    cfg.out = str(folder / f"{kind}-{'compiled' if compiled else 'eager'}")
    torch._dynamo.reset()  # each run compiles afresh, as a new process would
    out = train(cfg, stop_after=steps, log=lambda message: None)
    with open(out / "log.csv", newline="") as f:
        rows = [
            {k: float(row[k]) for k in ("step", "loss", "tokens_per_second")} for row in csv.DictReader(f)
        ]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_second"] for r in rows if r["step"] > skip),
        "first_step_s": cfg.batch_size * cfg.seq_len / rows[0]["tokens_per_second"],
        "last_loss": rows[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--json", default=str(Path(__file__).with_name("compile.json")))
    args = parser.parse_args()
    results = {}
    print(
        f"{'kind':<10}{'eager tok/s':>13}{'compiled':>10}{'ratio':>7}{'1st step s':>12}{'compiled':>10}"
        f"{'loss eager':>12}{'compiled':>10}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            eager = one_run(kind, False, args.steps, args.skip, Path(tmp))
            compiled = one_run(kind, True, args.steps, args.skip, Path(tmp))
            ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
            results[kind] = {"eager": eager, "compiled": compiled, "ratio": round(ratio, 3)}
            print(
                f"{kind:<10}{eager['tokens_per_s']:>13,.0f}{compiled['tokens_per_s']:>10,.0f}{ratio:>6.2f}x"
                f"{eager['first_step_s']:>12.2f}{compiled['first_step_s']:>10.2f}"
                f"{eager['last_loss']:>12.4f}{compiled['last_loss']:>10.4f}",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "commit": commit or None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "steps": args.steps,
        "skip": args.skip,
    }
    Path(args.json).write_text(json.dumps({"meta": meta, "kinds": results}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
