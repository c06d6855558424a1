"""Benchmark GPTQ on CPU: wall time and peak memory of the sequential pass over SmolLM2-135M, per calibration
size, whole-model and layer-streamed.

    OMP_WAIT_POLICY=PASSIVE python analysis/gptq/bench.py [--model fetch:smollm2] [--windows 8 32 128]
        [--stream] [--ppl] [--threads 2 1 3]

Each row runs in a fresh process (so the peak resident memory is the row's own): the model loaded, the plan
``w4a16-gptq-g128`` applied, then :func:`diffquant.quant.weights.quantize_weights` over N windows of 512
tokens of WikiText-2 validation (the whole model), or the streamed executor's calibration over the same
windows (``--stream``: one decoder layer resident); ``--ppl`` adds the quantized model's WikiText-2 test
perplexity (8 x 1,024 tokens, as recipes/weights.yaml scores it) to each whole-model row. Reports the GPTQ pass alone (load excluded), the peak
RSS of the process and the largest set of Hessians held at once. Prints a table and writes bench.json beside
this script.

``--threads A B ...`` runs each whole row again at thread counts B, ... (A's run is the timed one) and records
each run's perplexity and the share of the weights' codes that differ from A's. Why: GPTQ's codes are a
discontinuous function of the Hessian, and the float32 X^T X sums (and the layers' matmuls) round
differently with another thread count, BLAS or machine; a code flipped in one layer changes the next
layer's calibration inputs, so the flips compound through the model. The spread of these runs is the
smallest difference between two single GPTQ runs that means anything (the calibration sample's own spread
comes on top).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
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
        if os.environ.get("BENCH_CODES"):  # the codes, for --threads' comparison between runs
            from diffquant.quant.weights import weight_modules

            codes = {name: m.codes for name, m in weight_modules(model).items()}
            torch.save(codes, os.environ["BENCH_CODES"])
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


def codes_changed(first: Path, other: Path) -> float:
    """The share of all weight codes in ``other`` that differ from ``first``'s (same model and plan)."""
    import torch

    a, b = torch.load(first), torch.load(other)
    changed = sum(int((a[k] != b[k]).sum()) for k in a)
    return changed / sum(a[k].numel() for k in a)


def run_one(args: argparse.Namespace, windows: int, stream: bool, threads: int, codes: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--one", str(windows), str(args.seq_len)]
    env = {
        **os.environ,
        "BENCH_PPL": "1" if args.ppl else "0",
        "BENCH_THREADS": str(threads),
        "BENCH_CODES": str(codes or ""),
        "DIFFQUANT_QUIET": "1",
    }
    out = subprocess.run([*cmd, "1" if stream else "0"], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread_cell(row: dict, key: str, fmt: str) -> str:
    """``row[key]`` followed by the other thread counts' values in brackets (``--threads``)."""
    value = row.get(key)
    if value is None:
        return "-"
    others = [format(s[key], fmt) for s in row.get("spread", [])]
    return format(value, fmt) + (f" ({' / '.join(others)})" if others else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="fetch:smollm2")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stream", action="store_true", help="also the streamed pass at the first size")
    parser.add_argument("--ppl", action="store_true", help="also the WikiText-2 test ppl of each whole row")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[int(os.environ.get("BENCH_THREADS", "2"))],
        help="thread counts: the first is timed; each other one re-runs every whole row (the spread)",
    )
    parser.add_argument("--one", nargs=3, metavar=("WINDOWS", "SEQ_LEN", "STREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, int(args.one[0]), int(args.one[1]), args.one[2] == "1")))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.windows:
            for stream in [False, True] if args.stream and n == args.windows[0] else [False]:
                spread = not stream and len(args.threads) > 1
                first = Path(tmp, f"{n}-{args.threads[0]}.pt") if spread else None
                rows.append(run_one(args, n, stream, args.threads[0], first))
                print(rows[-1], flush=True)
                if spread:
                    rows[-1]["spread"] = []
                    for threads in args.threads[1:]:
                        other = Path(tmp, f"{n}-{threads}.pt")
                        r = run_one(args, n, False, threads, other)
                        rows[-1]["spread"].append(
                            {
                                "threads": threads,
                                "wikitext2_test_ppl": r.get("wikitext2_test_ppl"),
                                "gptq_seconds": r["gptq_seconds"],
                                "codes_changed": round(codes_changed(first, other), 4),
                            }
                        )
                        print("  ", rows[-1]["spread"][-1], flush=True)
    counts = " / ".join(str(t) for t in args.threads[1:])
    print(
        "\n| mode | calibration | GPTQ s | Linears | Hessians MiB | peak RSS GiB | WikiText-2 test ppl"
        + (f" ({counts} threads) | codes changed ({counts} threads) |" if counts else " |")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if counts else ""))
    for r in rows:
        shares = " / ".join(format(x["codes_changed"], ".1%") for x in r.get("spread", [])) or "-"
        changed = f" {shares} |" if counts else ""
        print(
            f"| {r['mode']} | {r['windows']} x {r['seq_len']} = {r['tokens']:,} | {r['gptq_seconds']} | "
            f"{r['linears']} | {r['peak_hessian_mib']} | {r['peak_rss_gib']} | "
            f"{spread_cell(r, 'wikitext2_test_ppl', '.2f')} |{changed}"
        )
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True)
    doc = {"model": args.model, "plan": "w4a16-gptq-g128", "cpu": cpu.stdout.strip(), "rows": rows}
    (HERE / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
