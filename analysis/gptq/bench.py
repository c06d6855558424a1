"""Benchmark GPTQ on CPU: wall time and peak memory of the sequential pass over SmolLM2-135M, per calibration
size, whole-model and layer-streamed.

    OMP_WAIT_POLICY=PASSIVE python analysis/gptq/bench.py [--model fetch:smollm2] [--windows 8 32 128]

Each row runs in a fresh process (so the peak resident memory is the row's own): the model loaded, the plan
``w4a16-gptq-g128`` applied, then :func:`diffquant.quant.weights.quantize_weights` over N windows of 512
tokens of WikiText-2 validation (the whole model), or the streamed executor's calibration over the same
windows (``--stream``: one decoder layer resident); ``--ppl`` adds the quantized model's WikiText-2 test
perplexity (8 x 1,024 tokens, as recipes/weights.yaml scores it) to each whole-model row. Reports the GPTQ pass alone (load excluded), the peak
RSS of the process and the largest set of Hessians held at once. Prints a table and writes bench.json beside
this script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(model_spec: str, windows: int, seq_len: int, stream: bool) -> dict:
    import torch

    from diffquant.data import token_windows
    from diffquant.io import load_model
    from diffquant.quant import apply_plan, preset
    from diffquant.quant.weights import quantize_weights

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    plan = preset("w4a16-gptq-g128")
    if stream:
        from diffquant.stream import open_streamed

        with open_streamed(model_spec, plan=plan) as streamed:
            ids = token_windows("wikitext2:validation", windows * seq_len, seq_len, streamed.model.tokenizer)
            start = time.monotonic()
            batches = [ids[s : s + 8] for s in range(0, ids.shape[0], 8)]
            streamed.run(batches[:1], calibration=batches, progress=False)
            seconds = time.monotonic() - start
            stats = streamed.gptq_stats.summary()
    else:
        model = load_model(model_spec)
        ids = token_windows("wikitext2:validation", windows * seq_len, seq_len, model.tokenizer)
        apply_plan(model, plan)
        start = time.monotonic()
        stats = quantize_weights(model, ids, batch_size=8, show=False)
        seconds = time.monotonic() - start
        if os.environ.get("BENCH_PPL") == "1":  # the quantized model's WikiText-2 test ppl (8 x 1024)
            from diffquant.eval.perplexity import evaluate_bpb

            ppl = evaluate_bpb(model, "wikitext2:test", max_tokens=8192, seq_len=1024, batch_size=2)[
                "perplexity"
            ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    extra = {"wikitext2_test_ppl": round(ppl, 2)} if not stream and os.environ.get("BENCH_PPL") == "1" else {}
    return {
        **extra,
        "mode": "streamed" if stream else "whole",
        "windows": windows,
        "seq_len": seq_len,
        "tokens": windows * seq_len,
        "gptq_seconds": round(seconds, 1),
        "linears": stats["linears"],
        "peak_hessian_mib": round(stats["peak_hessian_bytes"] / 2**20, 1),
        "peak_rss_gib": round(peak / 2**30, 2),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stream", action="store_true", help="also the streamed pass at the first size")
    parser.add_argument("--ppl", action="store_true", help="also the WikiText-2 test ppl of each whole row")
    parser.add_argument("--one", nargs=3, metavar=("WINDOWS", "SEQ_LEN", "STREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, int(args.one[0]), int(args.one[1]), args.one[2] == "1")))
        return
    rows = []
    for n in args.windows:
        for stream in [False, True] if args.stream and n == args.windows[0] else [False]:
            cmd = [sys.executable, __file__, "--model", args.model, "--one", str(n), str(args.seq_len)]
            env = {**os.environ, "BENCH_PPL": "1" if args.ppl else "0", "DIFFQUANT_QUIET": "1"}
            out = subprocess.run(
                [*cmd, "1" if stream else "0"], capture_output=True, text=True, check=True, env=env
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print("\n| mode | calibration | GPTQ s | Linears | Hessians MiB | peak RSS GiB | WikiText-2 test ppl |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['windows']} x {r['seq_len']} = {r['tokens']:,} | {r['gptq_seconds']} | "
            f"{r['linears']} | {r['peak_hessian_mib']} | {r['peak_rss_gib']} | {r.get('wikitext2_test_ppl', '-')} |"
        )
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True)
    doc = {"model": args.model, "plan": "w4a16-gptq-g128", "cpu": cpu.stdout.strip(), "rows": rows}
    (HERE / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
