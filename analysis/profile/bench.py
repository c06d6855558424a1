"""Benchmark: what profiling costs, and that its memory does not grow with the tokens profiled.

For a randomly initialised model of a preset (default: small, ~3M parameters), each mode runs in a fresh
subprocess so peak RSS (ru_maxrss) is its own:
  plain     forward passes only
  resid     Profiler on the residual stream (layer outputs) only
  all       Profiler on every site, attention maps and per-head metrics included
Each mode runs at N tokens and at 10 x N tokens. Prints a table and writes bench.json beside this file.

    python analysis/profile/bench.py [--preset small] [--kind diff_v2] [--tokens 4096] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = {"plain": None, "resid": ["kind:resid"], "all": ["*"]}


def child(args: argparse.Namespace) -> None:
    import torch

    from diffquant.models import DecoderLM, preset_config
    from diffquant.profile.runner import profile_model

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = DecoderLM(preset_config(args.preset, args.kind)).eval()
    n_windows = args.tokens // args.seq_len
    windows = torch.randint(0, 256, (n_windows, args.seq_len), generator=torch.Generator().manual_seed(0))
    sites = MODES[args.mode]
    start = time.perf_counter()
    if sites is None:
        with torch.no_grad():
            for i in range(0, n_windows, args.batch_size):
                model(windows[i : i + args.batch_size])
    else:
        profile_model(model, windows, batch_size=args.batch_size, sites=sites)
    seconds = time.perf_counter() - start
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mib": rss_mib, "tokens": n_windows * args.seq_len}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--kind", default="diff_v2")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=list(MODES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for mode in MODES:
        for scale in (1, 10):
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--tokens", str(args.tokens * scale)]
            cmd += ["--preset", args.preset, "--kind", args.kind, "--seq-len", str(args.seq_len)]
            cmd += ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append({"mode": mode, **json.loads(out.strip().splitlines()[-1])})
    print(
        f"preset {args.preset}, kind {args.kind}, seq-len {args.seq_len}, batch {args.batch_size}, "
        f"{args.threads} threads"
    )
    print(f"{'mode':<6}{'tokens':>9}{'seconds':>10}{'tok/s':>10}{'peak RSS MiB':>14}")
    for r in rows:
        print(
            f"{r['mode']:<6}{r['tokens']:>9}{r['seconds']:>10.2f}{r['tokens'] / r['seconds']:>10.0f}"
            f"{r['peak_rss_mib']:>14.0f}"
        )
    out = Path(__file__).with_name("bench.json")
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
