"""What rotation does to SmolLM2's outliers: the residual stream and every Linear's input, before and after.

    OMP_WAIT_POLICY=PASSIVE python analysis/rotate/outliers.py [--model fetch:smollm2] [--tokens 2048]

Profiles ``--model`` on WikiText-2 test (windows of 512 tokens) twice: as it is, and rotated by the preset
``quarot`` (Hadamard R1 residual, R2 heads, R4 online before down_proj; no quantizer: the same logits, checked
here). For the residual stream (every layer's output, pooled) it prints the top-1 |x| and where it sits, the
median |x| and the Pearson kurtosis (E[(x - mu)^4] / sigma^4 over all values; 3 for a Gaussian), and the same
per Linear input over all layers (q_proj and up read the residual stream, o_proj the heads, down the FFN).
Writes outliers.json beside this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diffquant.data import token_windows
from diffquant.io import load_model
from diffquant.profile.runner import profile_model
from diffquant.profile.tables import describe_location
from diffquant.quant.plan import preset
from diffquant.quant.rotate import rotate_model

KINDS = {"residual stream (layer outputs)": "resid"}  # Linear inputs: per Linear (widths differ: 576, 1536)
LINEARS = ("attn.q_proj", "attn.o_proj", "mlp.up", "mlp.down")


def summarise(profile) -> dict:
    out = {}
    for label, kind in KINDS.items():
        s = profile.pooled(kind).summary()
        out[label] = {
            "top1": s["top1"],
            "median": s["median"],
            "kurtosis": s["kurtosis"],
            "top1_at": describe_location(s["top"][0]["loc"] if s["top"] else None),
        }
    per_linear = {}
    for name in LINEARS:
        sites = [st for n, st in profile.sites.items() if n.endswith(f"{name}.input")]
        merged = type(sites[0]).merged(sites, site=name).summary()
        per_linear[name] = {k: merged[k] for k in ("top1", "median", "kurtosis")}
    out["per Linear (all layers)"] = per_linear
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    model = load_model(args.model)
    windows = token_windows("wikitext2:test", args.tokens, 512, model.tokenizer)
    sites = ["kind:resid", "kind:linear_in"]
    before = profile_model(model, windows, batch_size=2, sites=sites, topk=8)
    with torch.no_grad():
        ref = model(windows[:1])
    report = dict(rotate_model(model, preset("quarot").rotate))
    with torch.no_grad():
        rel = float((model(windows[:1]) - ref).abs().max() / ref.abs().max())
    after = profile_model(model, windows, batch_size=2, sites=sites, topk=8)
    result = {
        "model": args.model,
        "tokens": int(windows.numel()),
        "rotation": report,
        "logits_max_rel_diff": rel,
        "before": summarise(before),
        "after": summarise(after),
    }
    print(
        f"{args.model}: {windows.numel():,} tokens of wikitext2:test; rotated logits max rel diff {rel:.1e}"
    )
    for place, what in report.items():
        print(f"  {place}: {what}")
    print(f"\n{'activation':<34} {'':>6} {'top-1 |x|':>10} {'median':>8} {'kurtosis':>9}  top-1 at")
    for label in KINDS:
        for when in ("before", "after"):
            r = result[when][label]
            print(
                f"{label:<34} {when:>6} {r['top1']:10.1f} {r['median']:8.3f} {r['kurtosis']:9.1f}  {r['top1_at']}"
            )
    print(f"\n{'Linear input (all layers)':<34} {'':>6} {'top-1 |x|':>10} {'median':>8} {'kurtosis':>9}")
    for name in LINEARS:
        for when in ("before", "after"):
            r = result[when]["per Linear (all layers)"][name]
            print(f"{name:<34} {when:>6} {r['top1']:10.1f} {r['median']:8.3f} {r['kurtosis']:9.1f}")
    out = Path(__file__).with_name("outliers.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
