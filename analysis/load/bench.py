"""Benchmark: loading a GGUF model holds its weights once (peak RSS of the load vs the weights' bytes).

For each dtype, a fresh subprocess imports torch, diffquant and everything the GGUF load imports (gguf,
tokenizers, numpy, the converter modules), builds a tiny model on the meta device (the loader builds its
model there, and the first meta-device init lazily imports torch._dynamo and sympy, ~150 MiB of library
that is reported but not measured), collects garbage, reads its RSS (the *baseline*), then runs
``diffquant.io.load_model("gguf:" + FILE, dtype=DTYPE)`` while a thread samples ``VmRSS`` from
/proc/self/status every ``--interval-ms``. The peak is the larger of that sampled maximum and
``getrusage(RUSAGE_SELF).ru_maxrss`` read after the load (ru_maxrss catches what the sampler misses
between samples, e.g. inside a C call that holds the GIL; it cannot be reset, so the child also reports its
value just before the load: when that exceeds the baseline, imports peaked higher than the load started,
and only the sampled peak is above suspicion; both are in bench.json).

    measure = (peak RSS during the load - RSS just before it) / parameter bytes of the loaded model

Parameter bytes count every parameter tensor once (the tied LM head is the embedding, counted once), in
the dtype loaded. Buffers (none for the baseline model) would be listed separately. Import cost is not in
the measure; the tokenizer the file describes is (load_model builds it), as are the file's parsed
metadata and anything the loader leaves behind.

    python analysis/load/bench.py [--file PATH.gguf] [--dtypes float32 bfloat16 float16] [--repeat 1]

Prints a table and writes bench.json beside this file. Default file: the cached SmolLM2-135M-Instruct
Q4_1 GGUF (``diffquant fetch smollm2`` puts it there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FILE = Path.home() / ".cache/diffquant/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LIMIT = 1.3  # acceptance: peak - baseline <= 1.3 x parameter bytes
MIB = 1024 * 1024


def vm_rss() -> int:
    """Resident set size now, bytes (VmRSS of /proc/self/status)."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def max_rss() -> int:
    """getrusage's ru_maxrss, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler(threading.Thread):
    """Samples VmRSS every ``interval`` seconds until stopped; keeps the maximum and the sample count."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = vm_rss()
        self.samples = 1
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, vm_rss())
            self.samples += 1
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.peak = max(self.peak, vm_rss())


def child(args: argparse.Namespace) -> dict:
    import gc

    import gguf  # noqa: F401  (everything the load imports, so its import cost stays out of the measure)
    import numpy  # noqa: F401
    import tokenizers  # noqa: F401
    import torch

    import diffquant  # noqa: F401
    import diffquant.io
    import diffquant.io.convert_cli  # noqa: F401
    import diffquant.io.convert_gguf  # noqa: F401
    from diffquant.models import DecoderLM, preset_config

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    # The loader builds the model on the meta device, and the first meta-device init (normal_ goes
    # through torch._refs) imports torch._dynamo and sympy: library import cost, paid once per process.
    # A tiny model built on meta first pays it here, outside the measure, and its size is reported.
    gc.collect()
    before_warmup = vm_rss()
    with torch.device("meta"):
        DecoderLM(preset_config("tiny", "baseline"))
    gc.collect()
    baseline, maxrss_before = vm_rss(), max_rss()
    sampler = Sampler(args.interval_ms / 1000)
    sampler.start()
    start = time.perf_counter()
    model = diffquant.io.load_model("gguf:" + str(args.file), dtype=dtype)
    seconds = time.perf_counter() - start
    sampler.stop()
    maxrss_after = max_rss()
    after = vm_rss()
    seen: set[int] = set()
    param_bytes = 0
    for p in model.parameters():  # parameters() already yields a tied tensor once; dedupe storage anyway
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            param_bytes += p.numel() * p.element_size()
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert {p.dtype for p in model.parameters()} == {dtype}
    peak = max(sampler.peak, maxrss_after)
    return {
        "dtype": args.dtype,
        "params": n_params,
        "weights_mib": param_bytes / MIB,
        "buffers_mib": buffer_bytes / MIB,
        "baseline_mib": baseline / MIB,
        "meta_init_imports_mib": (baseline - before_warmup) / MIB,
        "peak_mib": peak / MIB,
        "peak_minus_baseline_mib": (peak - baseline) / MIB,
        "ratio": (peak - baseline) / param_bytes,
        "sampled_peak_minus_baseline_mib": (sampler.peak - baseline) / MIB,
        "ru_maxrss_minus_baseline_mib": (maxrss_after - baseline) / MIB,
        "ru_maxrss_before_load_mib": maxrss_before / MIB,
        "after_load_minus_baseline_mib": (after - baseline) / MIB,
        "samples": sampler.samples,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per dtype (the table shows the worst)")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "bench.json")
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if not args.file.is_file():
        sys.exit(f"{args.file}: not found (run `diffquant fetch smollm2` first)")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    runs = []
    for dtype in args.dtypes:
        for _ in range(args.repeat):
            cmd = [sys.executable, __file__, "--child", "--dtype", dtype, "--file", str(args.file)]
            cmd += ["--interval-ms", str(args.interval_ms), "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                sys.exit(f"child {dtype} failed:\n{done.stderr}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = [max((r for r in runs if r["dtype"] == d), key=lambda r: r["ratio"]) for d in args.dtypes]
    measure = (
        "peak RSS during load_model('gguf:FILE', dtype) minus RSS just before it (fresh subprocess per "
        "dtype, after importing torch, diffquant, gguf, tokenizers and building a tiny model on the meta device, "
        "which pays the lazy torch._dynamo import of meta-device init); peak = max(VmRSS sampled every "
        f"{args.interval_ms:g} ms, ru_maxrss); ratio = (peak - baseline) / parameter bytes in the loaded "
        "dtype, tied tensors counted once"
    )
    print(f"file: {args.file} ({args.file.stat().st_size / MIB:.1f} MiB)")
    print(f"measure: {measure}")
    print(f"acceptance: ratio <= {LIMIT}")
    head = f"{'dtype':<10}{'weights MiB':>12}{'baseline MiB':>14}{'peak MiB':>10}"
    head += f"{'peak-base MiB':>15}{'ratio':>7}{'seconds':>9}"
    print(head)
    for r in rows:
        print(
            f"{r['dtype']:<10}{r['weights_mib']:>12.1f}{r['baseline_mib']:>14.1f}{r['peak_mib']:>10.1f}"
            f"{r['peak_minus_baseline_mib']:>15.1f}{r['ratio']:>7.2f}{r['seconds']:>9.2f}"
        )
    lazy = max(r["meta_init_imports_mib"] for r in runs)
    print(
        f"not in the measure: lazy imports of the first meta-device init, {lazy:.0f} MiB (once per process)"
    )
    ok = all(r["ratio"] <= LIMIT for r in rows)
    print("PASS" if ok else "FAIL", f"(worst ratio {max(r['ratio'] for r in rows):.2f})")
    report = {
        "file": args.file.name,
        "file_mib": args.file.stat().st_size / MIB,
        "measure": measure,
        "limit": LIMIT,
        "pass": ok,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
