"""Paired noise of a KV cache's cost: per window, decode-mode bits per byte with the cache minus without.

The sweep's grid prints each cell's change against the unquantized cell, and its noise line compares models
from each cell's own spread over windows (unpaired). A cache's cost is a paired difference: the same windows
scored twice. This script scores each window of the zoo study's bpb-decode task (kv-cache-zoo.yaml: 32
windows of 256 tokens of stdlib:validation, 32 prefilled) with and without each plan, and prints the mean
change in bits per byte with two paired standard errors (sd of the per-window changes / sqrt(windows)).

    python analysis/kvcache/paired.py [--plans kv2-g8 kv2-g8-r8 ...] [--models zoo:baseline zoo:diff_v1 zoo:diff_v2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def per_window_bits(model, stream, decode: int, seq_len: int) -> list[float]:
    import torch

    from diffquant.data.scoring import StreamScorer
    from diffquant.eval.perplexity import decode_logprobs

    scorer = StreamScorer(model, stream, seq_len=seq_len, windows="disjoint", batch_size=8)
    with torch.no_grad():
        for batch, ids in scorer.batches:
            scorer.add(batch, ids, decode_logprobs(model, ids, decode), first_scored=decode + 1)
    return [nats / math.log(2) / max(n_bytes, 1) for nats, _, n_bytes in scorer.per_window]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["zoo:baseline", "zoo:diff_v1", "zoo:diff_v2"])
    parser.add_argument(
        "--plans", nargs="+", default=["kv4-g8", "kv2-g8", "kv2-g8-sinks", "kv2-g8-r8", "kv2-g8-prerope"]
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from diffquant.data import model_tokenizer, token_stream
    from diffquant.io import load_model
    from diffquant.quant import QuantPlan, apply_plan

    torch.set_num_threads(args.threads)
    rows = []
    for spec in args.models:
        model = load_model(spec).eval()
        stream = token_stream("stdlib:validation", 8192, model_tokenizer(model))
        base = per_window_bits(model, stream, 32, 256)
        for plan in args.plans:
            quantized = load_model(spec).eval()
            apply_plan(quantized, QuantPlan.load(plan))
            diffs = [q - b for q, b in zip(per_window_bits(quantized, stream, 32, 256), base, strict=True)]
            mean = sum(diffs) / len(diffs)
            sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
            rows.append(
                {"model": spec, "plan": plan, "change": mean, "two_se": 2 * sd / math.sqrt(len(diffs))}
            )
    print(f"{'model':<14} {'plan':<16} {'change bpb':>11} {'+- 2 s.e.':>10}   (paired over 32 windows)")
    for r in rows:
        print(f"{r['model']:<14} {r['plan']:<16} {r['change']:>+11.4f} {r['two_se']:>10.4f}")
    (Path(__file__).parent / "paired.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
