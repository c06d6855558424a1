"""Why GPTQ does not beat round-to-nearest at W4A4 on two zoo rows (docs/weights.md): the same cells with
GPTQ variants, bits per byte on stdlib:validation (32 x 256 tokens), calibration on stdlib:train.

    OMP_WAIT_POLICY=PASSIVE python analysis/gptq/why_w4a4.py

Variants: the plan as shipped (GPTQ's Hessian from float activations, 8,192 calibration tokens); 4x the
calibration tokens; act-order; and the Hessian taken from the *quantized* activations the deployed model
multiplies (the plan's int4 input quantizers left on during calibration: an experiment, not a plan option),
against RTN. Writes why_w4a4.json beside this script.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from diffquant.data import token_windows
from diffquant.eval.perplexity import evaluate_bpb
from diffquant.io import load_model
from diffquant.quant import apply_plan, calibrate, preset
from diffquant.quant import weights as W

HERE = Path(__file__).resolve().parent


def bpb(
    model_name: str, plan_name: str, calib_tokens: int = 8192, act_order: bool = False, aware: bool = False
):
    model = load_model(f"zoo:{model_name}")
    plan = copy.deepcopy(preset(plan_name))
    if act_order:
        plan.weights.act_order = True
    apply_plan(model, plan)
    windows = token_windows("stdlib:train", calib_tokens, 256, model.tokenizer)
    saved = W.taps_detached
    if aware:
        W.taps_detached = lambda _model: contextlib.nullcontext()
    try:
        with torch.no_grad():
            calibrate(model, windows, batch_size=8)
    finally:
        W.taps_detached = saved
    return evaluate_bpb(model, "stdlib:validation", max_tokens=8192, seq_len=256, batch_size=8)[
        "bits_per_byte"
    ]


def main() -> None:
    rows = []
    for model_name, plan in [("diff_v2", "w4a4"), ("baseline", "w4a4-quarot"), ("diff_v1", "w4a4")]:
        fp = evaluate_bpb(
            load_model(f"zoo:{model_name}"), "stdlib:validation", max_tokens=8192, seq_len=256, batch_size=8
        )["bits_per_byte"]
        row = {"model": model_name, "plan": plan, "fp": fp, "rtn": bpb(model_name, f"{plan}-rtn")}
        row["gptq"] = bpb(model_name, f"{plan}-gptq")
        row["gptq_32k_calib"] = bpb(model_name, f"{plan}-gptq", calib_tokens=32768)
        row["gptq_act_order"] = bpb(model_name, f"{plan}-gptq", act_order=True)
        row["gptq_quantized_inputs"] = bpb(model_name, f"{plan}-gptq", aware=True)
        rows.append(row)
        print(
            {k: (round(v - fp, 4) if isinstance(v, float) and k != "fp" else v) for k, v in row.items()},
            flush=True,
        )
    (HERE / "why_w4a4.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
