"""The GPU kit's autocast_gap stage (issue 45, item 5): does bf16 autocast explain DIFF V2's wider early lead?

On the H200 the kit's 3M trio (bf16 autocast, the only precision the trainer used on CUDA then) showed, at
step 12 of its 106-step schedule, training loss baseline 3.143 vs DIFF V2 2.955 (gap -0.188); the same recipe
in fp32 on the CPU gave a gap of about -0.12 (analysis/autocast: -0.122 at seed 0), and CPU bf16 autocast did
not widen it (-0.078). What the CPU cannot say is whether CUDA's bf16 autocast does. This stage trains the
same recipe (the trio's ``train_recipe`` at the 3M ladder size, seed 0, the 106-step schedule, data
stdlib:train) on the GPU for 12 steps, baseline and DIFF V2, with the trainer's ``precision`` fp32 and bf16,
and records every step's loss and the step-12 gap per precision. The fp32 / bf16 pair is the comparison:
the same machine, seed and batches (the GPU machine's own stdlib, Python 3.12's, so its batches are not the
CPU's): a gap much wider in bf16 than in fp32 points at autocast; equal gaps at the GPU's -0.19 point at
CUDA, not the precision; equal gaps near the CPU's -0.12 make the H200's trio another draw. Cheap: four
12-step runs of a 3M model (~131k tokens a step), seconds each on the GPU.
"""

from __future__ import annotations

import csv
import time
from typing import Any

from kit_trio import (
    LADDER,
    SETTINGS,
    learning_rate,
    size_facts,
    train_from_recipe,
    train_recipe,
    trio_configs,
)
from kit_util import Context, Recorder

KINDS = ("baseline", "diff_v2")
PRECISIONS = ("fp32", "bf16")
# per mode: the ladder size, the schedule's steps and the steps trained of it
EARLY = {"gpu": ("3M", 106, 12), "rehearse": ("toy-a", 8, 2)}


def early_recipe(
    kind: str, mode: str, seed: int, precision: str, schedule: int, device: str
) -> dict[str, Any]:
    """The trio's recipe for ``kind`` at the early-gap size of ``mode`` (the kit's own ``train_recipe``), with
    the seed, the trainer's ``precision`` and a log row every step (logging only: batches, schedule and
    evaluation steps are the trio's). analysis/autocast/run.py trains the same recipes on the CPU."""
    size = EARLY[mode][0]
    settings = SETTINGS[mode]
    base = LADDER[mode][size]
    configs = trio_configs(base, settings["seq_len"])
    lr = learning_rate(max(size_facts(base, settings["seq_len"])["params"].values()))
    recipe = train_recipe(
        kind,
        settings["batch_size"][size],
        configs[kind],
        settings,
        schedule,
        lr,
        "stdlib:train",
        settings["stdlib_data_tokens"],
        device,
    )
    recipe.update(name=f"early-{kind}-{precision}-s{seed}", seed=seed, log_every=1, precision=precision)
    return recipe


def stage_autocast_gap(ctx: Context, rec: Recorder) -> None:
    """Baseline and DIFF V2, fp32 and bf16, the first steps of the trio's schedule: losses per step and the
    DIFF V2 - baseline gap at the last step per precision (``gap``), each run recorded as it ends."""
    import torch

    size, schedule, steps = EARLY[ctx.mode]
    rec.set(size=size, schedule=schedule, steps=steps, seed=0)
    runs: dict[str, dict[str, Any]] = {}
    folder = ctx.work / "autocast_gap"
    for precision in PRECISIONS:
        for kind in KINDS:
            recipe = early_recipe(kind, ctx.mode, 0, precision, schedule, ctx.device)
            begin = time.time()
            train_from_recipe(
                recipe,
                folder / f"{kind}-{precision}.yaml",
                folder / f"{kind}-{precision}",
                stop_after=steps,
                log=lambda message: None,
            )
            with open(folder / f"{kind}-{precision}" / "log.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            runs[f"{kind} {precision}"] = {
                "loss": [round(float(r["loss"]), 5) for r in rows],
                "tokens_per_second": round(float(rows[-1]["tokens_per_second"])),
                "wall_s": round(time.time() - begin, 1),
            }
            rec.set(runs=runs)
            if ctx.cuda:
                torch.cuda.empty_cache()
    gap = {
        p: round(runs[f"diff_v2 {p}"]["loss"][-1] - runs[f"baseline {p}"]["loss"][-1], 4) for p in PRECISIONS
    }
    rec.set(gap=gap)
    if not ctx.cuda:
        rec.finish("skipped", "no CUDA: trained on CPU at the toy size (the question is about CUDA autocast)")
        return
    rec.finish("ok")
