"""Benchmark: what a quantized KV cache (a plan's ``kv_cache``) saves in memory and costs in decode speed.

For each context length C (default 1K / 2K / 4K / 8K tokens): prefill C tokens of WikiText-2 test into the
model's cache, then decode ``--steps`` tokens greedily, one forward each; timed are the decode steps only.
Memory is what the cache's tensors hold after the prefill (measured from the tensors: codes, scales, zeros
and the full-precision sinks / window), against the unquantized cache in the model's dtype and against the
same elements in bf16 (2 bytes each, the usual reference). Caches: none (full precision), and the KIVI
settings given by --settings (format / group / window).

Rounds interleave the caches so that machine load hits all alike; the speed is the median over rounds.
Prints a table and writes bench-DTYPE.json beside this file. Set OMP_WAIT_POLICY=PASSIVE on a shared machine.

    python analysis/kvcache/bench.py [--model fetch:smollm2] [--contexts 1024 2048 4096 8192]
        [--steps 16] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# label -> the plan's kv_cache section (None: full precision): the shipped presets, and KIVI's kv4 with one
# change at a time (kv4-g64-s16 is the preset kv4-compact)
def _settings() -> dict[str, dict | None]:
    from diffquant.quant.presets import preset_data

    def kv(name: str, **change) -> dict:
        return {**preset_data(name)["kv_cache"], **change}

    return {
        "fp": None,
        "kv8": kv("kv8"),
        "kv4": kv("kv4"),
        "kv4-s16": kv("kv4", scale_dtype="float16"),
        "kv4-g64": kv("kv4", group=64),
        "kv4-g64-s16": kv("kv4-compact"),
        "kv2": kv("kv2"),
    }


SETTINGS = _settings()
GOALS = {"memory_vs_bf16_at_4k": 0.3, "speed_vs_fp": 0.7}


def _elements(model, context: int) -> int:
    """Key and value elements a cache of ``context`` tokens holds (batch 1), from the model's shape."""
    c = model.config
    k_heads = 2 * c.n_kv_heads if c.attention == "diff_v1" else c.n_kv_heads
    return c.n_layers * context * (k_heads * c.head_dim + c.n_kv_heads * c.value_dim)


def _decode(model, prompt, steps: int) -> tuple[float, dict[str, int]]:
    import torch

    from diffquant.quant.kv_cache import cache_nbytes

    cache = model.new_cache()
    with torch.no_grad():
        logits = model(prompt, cache)
        held = cache_nbytes(cache)
        start = time.perf_counter()
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, cache)
        seconds = time.perf_counter() - start
    return seconds, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype"
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()

    import torch

    from diffquant.data import token_windows
    from diffquant.io import load_model
    from diffquant.quant import QuantPlan, apply_plan

    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval().to(getattr(torch, args.dtype))
    tokenizer = getattr(model, "tokenizer", None)
    top = max(args.contexts)
    if tokenizer is not None:
        stream = token_windows("wikitext2:test", top, top, tokenizer)
    else:
        stream = torch.randint(
            0, model.config.vocab_size, (1, top), generator=torch.Generator().manual_seed(0)
        )
    rows = []
    for asked in args.contexts:
        # the decode steps must fit the model's positions (8K of SmolLM2's 8,192 leaves no room for them)
        context = min(asked, model.config.max_seq_len - args.steps)
        prompt = stream[:, :context]
        times: dict[str, list[float]] = {s: [] for s in args.settings}
        held: dict[str, dict[str, int]] = {}
        for _ in range(args.rounds):
            for label in args.settings:
                section = SETTINGS[label]
                model.quant = None
                if section is not None:
                    apply_plan(model, QuantPlan.from_dict({"name": label, "kv_cache": section}))
                seconds, nbytes = _decode(model, prompt, args.steps)
                times[label].append(seconds)
                held[label] = nbytes
        model.quant = None
        fp_speed = args.steps / statistics.median(times["fp"]) if "fp" in times else None
        bf16 = 2 * _elements(model, context)
        for label in args.settings:
            speed = args.steps / statistics.median(times[label])
            total = sum(held[label].values())
            rows.append(
                {
                    "context": context,
                    "cache": label,
                    "bytes": total,
                    "parts": held[label],
                    "vs_bf16": total / bf16,
                    "tokens_per_s": speed,
                    "speed_vs_fp": speed / fp_speed if fp_speed else None,
                    "all_rounds_s": times[label],
                }
            )
    print(
        f"{args.model} ({args.dtype}): decode {args.steps} tokens after a prefill of C tokens, "
        f"{args.threads} threads; scales, zeros and the window in the model's dtype (-s16: scales and zeros "
        "in float16)"
    )
    print(f"{'context':>7} {'cache':<11} {'MiB':>9} {'vs bf16':>8} {'tok/s':>7} {'vs fp':>6}")
    for r in rows:
        vs_fp = f"{r['speed_vs_fp']:.2f}" if r["speed_vs_fp"] is not None else "-"
        print(
            f"{r['context']:>7} {r['cache']:<11} {r['bytes'] / 2**20:>9.2f} {r['vs_bf16']:>8.3f} "
            f"{r['tokens_per_s']:>7.2f} {vs_fp:>6}"
        )
    print(
        f"goals: 4-bit cache memory <= {GOALS['memory_vs_bf16_at_4k']}x of bf16 at 4K; decode speed >= "
        f"{GOALS['speed_vs_fp']}x of the unquantized cache"
    )
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "steps": args.steps,
        "threads": args.threads,
        "rows": rows,
        "goals": GOALS,
    }
    (Path(__file__).parent / f"bench-{args.dtype}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
