"""Does bf16 autocast by itself widen DIFF V2's early lead over the baseline? (issue 45, item 5)

The GPU kit's trio recipe (analysis/gpu/kit_trio.py: the "3M" ladder entry, its matched configs, the
trainer settings of ``train_recipe``: batch 256 x seq 512, lr 2e-3 -> 2e-4 cosine, warmup 10, a 106-step
schedule, data stdlib:train) trained by the project's own trainer (``diffquant.train.train``) on the CPU,
stopped after ``--steps`` steps of the 106-step schedule (``stop_after``), once in fp32 and once with the
forward pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``.

The trainer's ``precision`` key says where the forward pass runs under autocast (``auto``: bf16 on CUDA,
fp32 on the CPU); here ``fp32`` and ``bf16`` (``torch.autocast("cpu", dtype=torch.bfloat16)`` around the
model's forward; the loss on ``logits.float()``, backward, clipping and AdamW outside it, as on the GPU).
Seeds 0 and 1 were run before the key existed, with the same context swapped in for the trainer's CPU no-op
(``trainer._Null``, since removed). A global forward hook counts the dtypes of every nn.Linear output and of
the attention output during training, so the record shows whether autocast engaged (bf16 runs: bf16 Linear
outputs; fp32 runs: none). The GPU kit's ``autocast_gap`` stage trains the same recipes on CUDA
(``kit_autocast.early_recipe``).

After the last step the checkpoint the trainer writes on ``stop_after`` is loaded and its validation bits
per byte measured in fp32 (the trainer's ``_val_bpb``: stdlib:validation, the kit's eval_tokens = 8192).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python analysis/autocast/run.py --steps 12 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "analysis" / "gpu"))

from kit_autocast import EARLY, early_recipe  # noqa: E402
from kit_trio import KINDS, LADDER, SETTINGS, train_from_recipe, trio_configs  # noqa: E402

from diffquant.io import load_checkpoint  # noqa: E402
from diffquant.train import trainer as trainer_mod  # noqa: E402
from diffquant.train.data import TrainData  # noqa: E402

SIZE, SCHEDULE_STEPS, _ = EARLY["gpu"]  # the kit's 3M trio and its 106-step schedule on the H200
PRECISIONS = ("fp32", "bf16")


@contextlib.contextmanager
def dtype_census(counts: Counter):
    """Count output dtypes of nn.Linear modules and of attention modules, in grad mode (training) only."""
    from diffquant.models.attention import Attention

    def hook(module, args, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor):
            if isinstance(module, torch.nn.Linear):
                counts[f"linear:{out.dtype}"] += 1
            elif isinstance(module, Attention):
                counts[f"attention:{out.dtype}"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def one_run(kind: str, seed: int, precision: str, steps: int, schedule: int, work: Path) -> dict[str, Any]:
    recipe = early_recipe(kind, "gpu", seed, precision, schedule, "cpu")
    out = work / f"{kind}-s{seed}-{precision}"
    counts: Counter = Counter()
    lines: list[str] = []
    begin = time.perf_counter()
    with dtype_census(counts):
        cfg = train_from_recipe(
            recipe, work / f"{kind}-s{seed}-{precision}.yaml", out, stop_after=steps, log=lines.append
        )
    train_s = time.perf_counter() - begin
    import csv

    rows = list(csv.DictReader((out / "log.csv").open()))
    loss = [float(r["loss"]) for r in rows]
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1)), "expected a log row per step"
    model = load_checkpoint(out / "checkpoints" / f"step-{steps:07d}" / "model", dtype=torch.float32)
    streams = trainer_mod._eval_streams(cfg)
    val_bpb = trainer_mod._val_bpb(model, cfg, streams["eval_data"])
    lambdas = {k: float(v) for k, v in rows[-1].items() if k.startswith("lambda_")}
    return {
        "kind": kind,
        "seed": seed,
        "precision": precision,
        "parameters": model.num_parameters(),
        "loss": loss,
        "grad_norm": [float(r["grad_norm"]) for r in rows],
        "lr": [float(r["lr"]) for r in rows],
        "tokens_per_second": [float(r["tokens_per_second"]) for r in rows],
        "nan": any(not math.isfinite(v) for v in loss),
        "val_bpb_fp32": val_bpb,
        "last_row_lambda": lambdas,
        "forward_dtypes": dict(counts),
        "train_s": round(train_s, 1),
        "recipe": recipe,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="steps trained (stop_after) of the schedule")
    ap.add_argument("--schedule", type=int, default=SCHEDULE_STEPS, help="the schedule's total steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    ap.add_argument("--append", action="store_true", help="add to the runs already in --out")
    args = ap.parse_args()

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "diffquant", "analysis/gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    result: dict[str, Any] = {"runs": []}
    if args.append and args.out.is_file():
        result = json.loads(args.out.read_text())
    result.setdefault("invocations", []).append(
        {
            "argv": sys.argv[1:],
            "commit": commit,
            "dirty_files": dirty,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_bf16_autocast": "forward under torch.autocast('cpu', dtype=torch.bfloat16): precision bf16",
        }
    )
    settings = SETTINGS["gpu"]
    result["config"] = {
        "size": SIZE,
        "base": LADDER["gpu"][SIZE],
        "matched": {
            k: c.to_dict() for k, c in trio_configs(LADDER["gpu"][SIZE], settings["seq_len"]).items()
        },
        "schedule_steps": args.schedule,
        "stdlib_train_tokens": TrainData(
            "stdlib:train", seq_len=settings["seq_len"], max_tokens=None, needle_fraction=0.2, seed=0
        ).stream.numel(),
    }
    with tempfile.TemporaryDirectory(prefix="autocast-") as tmp:
        work = Path(tmp)
        for seed in args.seeds:
            for kind in args.kinds:
                for precision in args.precisions:
                    run = one_run(kind, seed, precision, args.steps, args.schedule, work)
                    run["steps"] = args.steps
                    result["runs"].append(run)
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
                    print(
                        f"{kind:8s} seed {seed} {precision}: loss@{args.steps} {run['loss'][-1]:.4f} "
                        f"val bpb {run['val_bpb_fp32']:.4f} ({run['train_s']:.0f} s) {run['forward_dtypes']}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
