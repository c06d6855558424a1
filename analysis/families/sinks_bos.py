"""Gu et al.'s sink rate with and without a BOS token in front of each probe sequence.

The profile's probe (``diffquant profile --sink-rate``) cuts WikiText-2 test into 100 disjoint 64-token
windows with no BOS, so the first token is whatever token the window starts with. Gemma 3 is trained with
<bos> first in every sequence, SmolLM2 without one; this script prints both probes side by side (the
first 100 windows of 63 tokens with the model's BOS prepended, so the sequences are 64 long as in Gu et al.).

    python analysis/families/sinks_bos.py fetch:smollm2 fetch:gemma3-270m
"""

from __future__ import annotations

import sys

import torch

from diffquant.data import token_windows
from diffquant.data.tokenizer import model_tokenizer
from diffquant.io import load_model
from diffquant.profile.sinks import sink_rate_summary, sink_rates


def main(specs: list[str]) -> None:
    print(f"{'model':<22} {'probe':<14} {'sink rate':>9}  {'first-token attention':>21}  per layer (%)")
    for spec in specs:
        model = load_model(spec)
        tok = model_tokenizer(model)
        plain = token_windows("wikitext2:test", 100 * 64, 64, tok, quiet=True)
        body = token_windows("wikitext2:test", 100 * 63, 63, tok, quiet=True)
        bos = tok.bos_id if tok.bos_id is not None else 0
        probes = {"no BOS": plain, f"BOS ({bos}) first": torch.cat([torch.full((100, 1), bos), body], 1)}
        for label, windows in probes.items():
            s = sink_rate_summary(sink_rates(model, windows, batch_size=16))
            layers = " ".join(f"{100 * r:.0f}" for r in s["per_layer"])
            print(
                f"{spec:<22} {label:<14} {100 * s['rate']:>8.1f}%  {s['first_token_importance']:>21.3f}  {layers}"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["fetch:smollm2", "fetch:gemma3-270m"])
