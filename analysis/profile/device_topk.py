"""Benchmark: one profile site update on a GPU with the packed-key top-k (no wait for the device) against the
host-guided search (two waits), per update size: the evidence that `stats.DEVICE_TOPK_MAX` should rest on.

    python analysis/profile/device_topk.py [--device cuda] [--sizes 16 20 22 24 26] [--rounds 7]
        [--dtype bfloat16] [--out FILE]

For each size 2^n: a residual-stream-like tensor (1, 2^n / 1024, 1024) of N(0,1) values in ``--dtype``
with one massive activation, and `SiteStats("layers.0.resid", "resid").update(x)` timed from a
synchronized start to a synchronized end, in interleaved rounds: `DEVICE_TOPK_MAX` above the size (the
packed-key top-k rides in the update's one transfer) and 0 (the host-guided search after it). Prints the
median milliseconds of each and whether the two give the same state (they must). On a CPU both run the
host search (the packed one serves device tensors only), so a CPU run only checks that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _update(x, packed: bool) -> tuple[float, str]:
    from diffquant.profile import stats

    saved = stats.DEVICE_TOPK_MAX
    stats.DEVICE_TOPK_MAX = x.numel() if packed else 0
    try:
        site = stats.SiteStats("layers.0.resid", "resid")
        _sync(x.device)
        start = time.perf_counter()
        site.update(x)
        _sync(x.device)
        seconds = time.perf_counter() - start
    finally:
        stats.DEVICE_TOPK_MAX = saved
    return seconds, json.dumps(site.to_dict())


def run(device_name: str, sizes: list[int], rounds: int, dtype_name: str) -> dict:
    import torch

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(1, max(1, 2**n // 1024), 1024, generator=g)
        x[0, 0, 7] = 300.0  # a massive activation (|x| >= 100: the massive search runs as well)
        x = x.to(device=device, dtype=dtype)
        for packed in (True, False):  # warm-up: first calls allocate and compile
            _update(x, packed)
        times: dict[str, list[float]] = {"packed": [], "host": []}
        states = set()
        for _ in range(rounds):
            for mode in ("packed", "host"):
                seconds, state = _update(x, mode == "packed")
                times[mode].append(seconds)
                states.add(state)
        packed, host = statistics.median(times["packed"]), statistics.median(times["host"])
        rows.append(
            {
                "entries": x.numel(),
                "packed_ms": round(1000 * packed, 3),
                "host_ms": round(1000 * host, 3),
                "packed_over_host": round(packed / host, 3),
                "same_state": len(states) == 1,
            }
        )
        print(
            f"2^{n:<3} {x.numel():>12,} {rows[-1]['packed_ms']:>10.3f} {rows[-1]['host_ms']:>10.3f} "
            f"{rows[-1]['packed_over_host']:>8.2f}  {rows[-1]['same_state']}",
            flush=True,
        )
    return {"device": str(device), "dtype": dtype_name, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 20, 22, 24, 26])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    print(f"{'size':<6}{'entries':>12} {'packed ms':>10} {'host ms':>10} {'ratio':>8}  same state")
    result = run(args.device, args.sizes, args.rounds, args.dtype)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
