"""Why GPTQ loses to round-to-nearest on SmolLM2-135M at W4A16 g128 (docs/weights.md): per-Linear errors on
calibration and held-out text, and where the Hessian's mass sits.

    OMP_WAIT_POLICY=PASSIVE python analysis/gptq/why_smollm2.py [--calib-windows 8]

GPTQ minimises each Linear's error on its calibration inputs; the sweep found it below RTN there on every
Linear (tests/test_weights.py) yet worse in perplexity. Here, for the float model's inputs (every layer
float, so the Linears are compared on equal inputs):

1. per Linear, the relative output error ||(W - Q) X^T||^2 / ||W X^T||^2 of GPTQ and of RTN (the same grid,
   sym int4 g128) on the calibration windows and on held-out windows (WikiText-2 test, 4 x 512);
2. the share of trace(H) that the first token of each window carries (SmolLM2's massive activation sits
   at position 0: Sun et al. 2024), per Linear.

Prints the Linears where GPTQ's held-out error exceeds RTN's, and writes why_smollm2.json beside this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diffquant.data import token_windows
from diffquant.io import load_model
from diffquant.models.attention import Linear
from diffquant.quant.gptq import gptq_codes
from diffquant.quant.weightcodes import WeightGrid, rtn_codes

HERE = Path(__file__).resolve().parent


def linear_inputs(model, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each Linear's inputs [windows, positions, in] of the float model over ``windows`` (float32)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.startswith("layers."):
            hook = lambda _m, args, name=name: seen.setdefault(name, []).append(args[0].detach())  # noqa: E731
            handles.append(m.input.register_forward_pre_hook(hook))
    with torch.no_grad():
        for start in range(0, windows.shape[0], 2):
            model(windows[start : start + 2])
    for h in handles:
        h.remove()
    return {n: torch.cat(xs) for n, xs in seen.items()}


def rel_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    x = x.reshape(-1, x.shape[-1]).double()
    return float(((w - q) @ x.T).square().sum() / (w @ x.T).square().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--calib-windows", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(args.model)
    calib = token_windows("wikitext2:validation", args.calib_windows * 512, 512, model.tokenizer)
    held = token_windows("wikitext2:test", 4 * 512, 512, model.tokenizer)
    grid = WeightGrid(4, 128, True)
    rows = []
    # one layer's inputs at a time would be leaner; 135M parameters fit either way
    x_calib, x_held = linear_inputs(model, calib), linear_inputs(model, held)
    for name, xc in x_calib.items():
        w = model.get_submodule(name).weight.detach().double()
        flat = xc.reshape(-1, xc.shape[-1]).double()
        h = 2 * flat.T @ flat / flat.shape[0]
        first = xc[:, 0].double()
        q_gptq = gptq_codes(w, h, grid).dequantize()
        q_rtn = rtn_codes(w, grid).dequantize()
        row = {
            "linear": name,
            # uniform would be 1 / 512 = 0.002
            "first_token_trace_share": float(first.square().sum() / flat.square().sum()),
            "gptq_calib": rel_error(w, q_gptq, xc),
            "rtn_calib": rel_error(w, q_rtn, xc),
            "gptq_held": rel_error(w, q_gptq, x_held[name]),
            "rtn_held": rel_error(w, q_rtn, x_held[name]),
            "gptq_held_no_first": rel_error(w, q_gptq, x_held[name][:, 1:]),
            "rtn_held_no_first": rel_error(w, q_rtn, x_held[name][:, 1:]),
        }
        rows.append(row)
        flag = "  <-- GPTQ worse held out" if row["gptq_held"] > row["rtn_held"] else ""
        print(
            f"{name:28s} first-token share of tr(H) {row['first_token_trace_share']:7.3f}  "
            f"calib gptq/rtn {row['gptq_calib'] / row['rtn_calib']:.3f}  held {row['gptq_held'] / row['rtn_held']:.3f}  "
            f"held w/o pos 0 {row['gptq_held_no_first'] / row['rtn_held_no_first']:.3f}{flag}",
            flush=True,
        )
    worse = [r["linear"] for r in rows if r["gptq_held"] > r["rtn_held"]]
    print(f"\nGPTQ worse than RTN held out on {len(worse)} of {len(rows)} Linears: {worse}")
    doc = {"calib_windows": args.calib_windows, "seq_len": 512, "grid": "int4 sym g128", "rows": rows}
    (HERE / "why_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
