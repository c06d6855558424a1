"""Where the quantized DIFF V2 core loses accuracy (issue 46, goal 2: cosine >= 0.999 on both input
distributions), measured on the CPU with the fp32 torch reference (no GPU, no kernel timing).

    python analysis/kernels/accuracy.py [--T 4096] [--heads 4] [--kernel-T 256]

Each quantized configuration of ``diffquant.kernels.reference.diff_v2_core`` (exact fp32 arithmetic: the
casts are the only error) against the unquantized core on the same bf16-rounded inputs, with the bench's
inputs (analysis/kernels/bench.py: N(0,1), and FlashAttention-3's FP8 test distribution N(0,1) +
N(0,100) * Bernoulli(0.001)) and its metric (cosine over every output element, relative L1). Shapes: the
bench's two T = 4096 goal shapes with fewer heads (d = 64 MHA; d = 128 with 4 query heads per KV head), since
a cosine is an average over elements and the maps of 16 heads take ~5 GiB here. Rows: each cast alone (Q/K per
64-token block, Q/K per token, P*V in fp8) and the kernel's combinations, so the table says which cast costs
what.

``--kernel-T N`` (default 256, 0 to skip) also runs the Triton kernels themselves (Triton's interpreter,
single-pass fp8 P*V as the bench times them: P rounded before normalisation, as SageAttention) at T = N
against the same reference, to show that the reference's cosine is the kernel's: the H200's bench measured
the per-block kernel at 0.9981 on the outlier inputs at T = 4096 (issue 46), the reference gives 0.9981.

Writes nothing: prints a table (analysis/kernels/accuracy.md holds a run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton import: --kernel-T runs on the CPU

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402  (the bench's inputs and metric: one definition of both)

bench.DEVICE = "cpu"

# (row name, CoreQuant fields): each cast alone, then the bench's variants (bench.v2_variants)
CONFIGS = (
    ("bf16 P*V (the bf16 kernel)", {"pv": "bf16"}),
    ("int8 Q/K per 64-token block", {"qk": "int8", "block": 64}),
    ("int8 Q/K per token", {"qk": "int8", "block": 1}),
    ("fp8 Q/K per 64-token block", {"qk": "fp8_e4m3", "block": 64}),
    ("fp8 Q/K per token", {"qk": "fp8_e4m3", "block": 1}),
    ("fp8 P*V (P at 1/448, V per channel)", {"pv": "fp8_e4m3"}),
    ("int8 Q/K per block + fp8 P*V", {"qk": "int8", "block": 64, "pv": "fp8_e4m3"}),
    ("int8 Q/K per token + fp8 P*V", {"qk": "int8", "block": 1, "pv": "fp8_e4m3"}),
    ("fp8 Q/K per block + fp8 P*V", {"qk": "fp8_e4m3", "block": 64, "pv": "fp8_e4m3"}),
    ("fp8 Q/K per token + fp8 P*V", {"qk": "fp8_e4m3", "block": 1, "pv": "fp8_e4m3"}),
)
# the kernels the bench times (their row names there)
KERNELS = (
    ("v2-int8qk-fp8pv-triton", {"qk": "int8", "block": 64, "pv": "fp8_e4m3"}),
    ("v2-int8tokqk-fp8pv-triton", {"qk": "int8", "block": 1, "pv": "fp8_e4m3"}),
)


def shapes(t: int, heads: int) -> list[dict]:
    """The bench's T = 4096 goal shapes at ``t`` tokens and ``heads`` query heads (GQA kept at 4 per KV head)."""
    return [
        {"T": t, "H": heads, "Hkv": heads, "d": 64},
        {"T": t, "H": heads, "Hkv": max(1, heads // 4), "d": 128},
    ]


def rows(t: int, heads: int, seed: int = 0) -> list[dict]:
    """One row per shape, distribution and configuration: cosine and relative L1 to the unquantized core."""
    from diffquant.kernels.reference import CoreQuant, diff_v2_core

    out = []
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(t, heads):
        for dist in bench.DISTS:
            x = bench.inputs(shape, dist, "v2", gen)
            q, k, v = (x[n].to(torch.bfloat16).float() for n in ("q", "k", "v"))
            ref = diff_v2_core(q, k, v, x["lam"])
            for name, fields in CONFIGS:
                got = diff_v2_core(q, k, v, x["lam"], quant=CoreQuant(**fields))
                out.append({**shape, "dist": dist, "config": name, **bench.accuracy(got, ref)})
                print(f"  {shape} {dist} {name}", file=sys.stderr, flush=True)
    return out


def kernel_rows(t: int, heads: int, seed: int = 0) -> list[dict]:
    """The Triton kernels (interpreter, the bench's single-pass call) and the reference of the same
    configuration, against the unquantized reference, at ``t`` tokens (d = 64, MHA)."""
    from diffquant.kernels.reference import CoreQuant, diff_v2_core
    from diffquant.kernels.triton_diff import diff_v2_attention

    out = []
    gen = torch.Generator().manual_seed(seed)
    shape = {"T": t, "H": heads, "Hkv": heads, "d": 64}
    for dist in bench.DISTS:
        x = bench.inputs(shape, dist, "v2", gen)
        q16, k16, v16 = (x[n].to(torch.bfloat16) for n in ("q", "k", "v"))
        ref = diff_v2_core(q16.float(), k16.float(), v16.float(), x["lam"])
        for name, fields in KERNELS:
            quant = CoreQuant(**fields)
            kernel = diff_v2_attention(q16, k16, v16, x["lam"], quant=quant)
            model = diff_v2_core(q16.float(), k16.float(), v16.float(), x["lam"], quant=quant)
            out.append(
                {
                    **shape,
                    "dist": dist,
                    "variant": name,
                    "kernel_cosine": bench.accuracy(kernel, ref)["cosine"],
                    "reference_cosine": bench.accuracy(model, ref)["cosine"],
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--T", type=int, default=4096, help="tokens (default: 4096, the goal's)")
    parser.add_argument("--heads", type=int, default=4, help="DIFF heads H (2H query heads; default: 4)")
    parser.add_argument("--kernel-T", type=int, default=256, help="the kernels' check at this T (0: skip)")
    args = parser.parse_args()
    start = time.perf_counter()
    table = rows(args.T, args.heads)
    print(f"\nDIFF V2 core, cast by cast, vs the unquantized fp32 core (reference arithmetic; T = {args.T})")
    print(
        f"{'H':>3}{'Hkv':>4}{'d':>5} {'config':<38}{'cos normal':>11}{'cos fa3':>10}{'relL1 n':>9}{'relL1 fa3':>10}"
    )
    by = {(r["H"], r["Hkv"], r["d"], r["config"], r["dist"]): r for r in table}
    for shape in shapes(args.T, args.heads):
        for name, _ in CONFIGS:
            n, f = (by[(shape["H"], shape["Hkv"], shape["d"], name, dist)] for dist in bench.DISTS)
            print(
                f"{shape['H']:>3}{shape['Hkv']:>4}{shape['d']:>5} {name:<38}{n['cosine']:>11.5f}{f['cosine']:>10.5f}"
                f"{n['rel_l1']:>9.4f}{f['rel_l1']:>10.4f}"
            )
    if args.kernel_T:
        print(
            f"\nThe Triton kernels (interpreter, single-pass fp8 P*V) vs the reference, T = {args.kernel_T}, d = 64"
        )
        print(f"{'variant':<27}{'dist':<8}{'kernel cos':>11}{'reference cos':>14}")
        for r in kernel_rows(args.kernel_T, min(args.heads, 2)):
            print(
                f"{r['variant']:<27}{r['dist']:<8}{r['kernel_cosine']:>11.5f}{r['reference_cosine']:>14.5f}"
            )
    print(
        f"\n{time.perf_counter() - start:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
