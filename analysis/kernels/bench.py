"""Benchmark the attention cores on a CUDA GPU: speed (ms, TFLOP/s) and accuracy vs the fp32 reference.

    python analysis/kernels/bench.py [--quick] [--out analysis/kernels]

For each shape (sequence length 1K-16K, heads, head dim 64/128, GQA) it times, with CUDA events after
warm-up (median of --reps):
  baseline   torch SDPA bf16 (and flash-attn bf16 when installed)
  v2-bf16    DIFF V2 core: flash-attn path (when installed) and the Triton kernel, bf16
  v2-int8qk  DIFF V2, Triton, int8 Q/K per 64-token block with K smoothing, fp8 P*V (SageAttention-style)
  v2-fp8qk   DIFF V2, Triton, fp8 Q/K, fp8 P*V
  v1-bf16    DIFF V1 core (Triton; 2d value heads, RMSNorm epilogue)
and each one's accuracy against the fp32 torch reference on the same inputs (cosine similarity, relative L1,
RMSE), for inputs N(0,1) and the FlashAttention-3 FP8 test distribution N(0,1) + N(0,100) * Bernoulli(0.001).
FLOPs count the two maps of a DIFF head (4 * B * heads * T^2 * d per map pair, causal halves it).
Writes bench-DATE-DEVICE.json beside this script (or --out) and prints a table. Needs CUDA and Triton.
--json FILE also writes the result to FILE after every shape (``"complete": false`` until the last), so a run
cut short by a time limit (the GPU kit, analysis/gpu) keeps the shapes it finished; with --smoke too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

DEVICE = "cuda"
BLOCK = 64


def shapes(quick: bool, smoke: bool = False) -> list[dict]:
    if smoke:
        return [{"T": 40, "H": 2, "Hkv": 1, "d": 16}]
    full = [
        {"T": 1024, "H": 16, "Hkv": 16, "d": 64},
        {"T": 4096, "H": 16, "Hkv": 16, "d": 64},
        {"T": 4096, "H": 16, "Hkv": 4, "d": 128},
        {"T": 8192, "H": 16, "Hkv": 4, "d": 128},
        {"T": 16384, "H": 8, "Hkv": 2, "d": 128},
    ]
    return full[:2] if quick else full


def timed(fn, reps: int) -> float:
    if DEVICE == "cpu":  # --smoke: checks the script itself through Triton's interpreter
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    o, r = out.float().flatten(), ref.float().flatten()
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(o, r, dim=0)),
        "rel_l1": float((o - r).abs().sum() / r.abs().sum()),
        "rmse": float((o - r).pow(2).mean().sqrt()),
    }


def inputs(shape: dict, dist: str, kind: str, gen: torch.Generator) -> dict:
    b, t, h, hkv, d = 1, shape["T"], shape["H"], shape["Hkv"], shape["d"]

    def draw(*size):
        x = torch.randn(*size, generator=gen, device=DEVICE)
        if dist == "fa3":  # FlashAttention-3's FP8 accuracy test distribution
            spikes = torch.rand(*size, generator=gen, device=DEVICE) < 0.001
            x = x + spikes * 10.0 * torch.randn(*size, generator=gen, device=DEVICE)
        return x

    if kind == "v1":  # h differential heads: 2h Q components of width d, kv pairs, 2d value heads
        return {
            "q": draw(b, 2 * h, t, d),
            "k": draw(b, 2 * hkv, t, d),
            "v": draw(b, hkv, t, 2 * d),
            "lam": 0.35,
            "lambda_init": 0.5,
        }
    return {
        "q": draw(b, 2 * h, t, d),
        "k": draw(b, hkv, t, d),
        "v": draw(b, hkv, t, d),
        "lam": torch.sigmoid(draw(b, h, t)),
    }


def run(args: argparse.Namespace, on_shape=None) -> dict:
    """All shapes' rows; ``on_shape(partial_result)`` is called after each shape (for --json)."""
    from diffquant.kernels import CoreQuant, diff_v1_core, diff_v2_core
    from diffquant.kernels.flash import flash_available
    from diffquant.kernels.triton_diff import diff_v1_attention, diff_v2_attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    variants = {
        "v2-bf16": CoreQuant(),
        "v2-int8qk-fp8pv": CoreQuant(qk="int8", block=64, pv="fp8_e4m3"),
        "v2-fp8qk-fp8pv": CoreQuant(qk="fp8_e4m3", block=64, pv="fp8_e4m3"),
    }
    rows = []
    for shape in shapes(args.quick, args.smoke):
        t, h, d = shape["T"], shape["H"], shape["d"]
        flops_pair = 2 * 4 * h * t * t * d / 2  # two causal maps (QK^T and PV each 2*T^2*d per map)
        for dist in ("normal", "fa3"):
            x = inputs(shape, dist, "v2", gen)
            q16, k16, v16 = (x[n].to(torch.bfloat16) for n in ("q", "k", "v"))
            lam = x["lam"]
            ref = diff_v2_core(q16.float(), k16.float(), v16.float(), lam)
            # baseline: h heads over the same kv heads, bf16 SDPA
            qb = q16[:, 0::2].contiguous()
            rep = h // shape["Hkv"]
            kb, vb = k16.repeat_interleave(rep, 1), v16.repeat_interleave(rep, 1)
            sdpa = partial(torch.nn.functional.scaled_dot_product_attention, qb, kb, vb, is_causal=True)
            ms = timed(sdpa, args.reps)
            rows.append(
                {
                    **shape,
                    "dist": dist,
                    "variant": "baseline-sdpa-bf16",
                    "ms": ms,
                    "tflops": flops_pair / 2 / ms / 1e9,
                }
            )
            if DEVICE == "cuda" and flash_available():
                from diffquant.kernels.flash import diff_v2_flash

                lam4 = lam.unsqueeze(-1)
                out = diff_v2_flash(q16, k16, v16, lam4)
                ms = timed(partial(diff_v2_flash, q16, k16, v16, lam4), args.reps)
                rows.append(
                    {
                        **shape,
                        "dist": dist,
                        "variant": "v2-flash-bf16",
                        "ms": ms,
                        "tflops": flops_pair / ms / 1e9,
                        **accuracy(out, ref),
                    }
                )
            for name, quant in variants.items():
                out = diff_v2_attention(q16, k16, v16, lam, quant=quant, block_m=BLOCK, block_n=BLOCK)
                call = partial(
                    diff_v2_attention, q16, k16, v16, lam, quant=quant, block_m=BLOCK, block_n=BLOCK
                )
                ms = timed(call, args.reps)
                rows.append(
                    {
                        **shape,
                        "dist": dist,
                        "variant": f"{name}-triton",
                        "ms": ms,
                        "tflops": flops_pair / ms / 1e9,
                        **accuracy(out, ref),
                    }
                )
            x1 = inputs(shape, dist, "v1", gen)
            q1, k1, v1 = (x1[n].to(torch.bfloat16) for n in ("q", "k", "v"))
            ref1 = diff_v1_core(q1.float(), k1.float(), v1.float(), x1["lam"], x1["lambda_init"], None)
            out1 = diff_v1_attention(
                q1, k1, v1, x1["lam"], x1["lambda_init"], None, block_m=BLOCK, block_n=BLOCK
            )
            call = partial(
                diff_v1_attention,
                q1,
                k1,
                v1,
                x1["lam"],
                x1["lambda_init"],
                None,
                block_m=BLOCK,
                block_n=BLOCK,
            )
            ms = timed(call, args.reps)
            rows.append(
                {
                    **shape,
                    "dist": dist,
                    "variant": "v1-bf16-triton",
                    "ms": ms,
                    "tflops": 2 * flops_pair / ms / 1e9,
                    **accuracy(out1, ref1),
                }
            )
            print(f"done T={t} H={h} d={d} {dist}", file=sys.stderr, flush=True)
        if on_shape is not None:
            on_shape(_result(rows, complete=False))
    return _result(rows, complete=True)


def _result(rows: list[dict], complete: bool) -> dict:
    from diffquant.kernels.flash import flash_available

    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter-smoke",
        "torch": torch.__version__,
        "flash_attn": flash_available(),
        "complete": complete,
        "rows": rows,
    }


def _write_json(path: Path, result: dict) -> None:
    """Written whole and renamed, so a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU via TRITON_INTERPRET (no timing)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the result here after every shape (partial runs)"
    )
    args = parser.parse_args()
    global DEVICE, BLOCK
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, BLOCK = "cpu", 16
    elif not torch.cuda.is_available():
        sys.exit(
            "analysis/kernels/bench.py needs a CUDA GPU (CPU correctness is covered by tests/test_kernels.py)"
        )
    on_shape = None if args.json is None else partial(_write_json, args.json)
    result = run(args, on_shape)
    if args.json is not None:
        _write_json(args.json, result)
    print(f"{result['device']}  torch {result['torch']}  flash-attn {result['flash_attn']}")
    print(
        f"{'T':>6}{'H':>4}{'Hkv':>4}{'d':>5} {'dist':<7}{'variant':<26}{'ms':>9}{'TFLOP/s':>9}{'cosine':>10}{'relL1':>9}"
    )
    for r in result["rows"]:
        acc = f"{r['cosine']:>10.5f}{r['rel_l1']:>9.4f}" if "cosine" in r else ""
        print(
            f"{r['T']:>6}{r['H']:>4}{r['Hkv']:>4}{r['d']:>5} {r['dist']:<7}{r['variant']:<26}{r['ms']:>9.3f}"
            f"{r['tflops']:>9.1f}{acc}"
        )
    name = f"bench-{result['date']}-{result['device'].replace(' ', '_')}.json"
    path = Path(args.out) / name
    if args.smoke:
        print("smoke run: not written")
        return
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
