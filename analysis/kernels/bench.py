"""Benchmark the attention cores on a CUDA GPU: speed (ms, TFLOP/s) and accuracy vs the fp32 reference.

    python analysis/kernels/bench.py [--quick] [--out analysis/kernels]

For each shape (sequence length 1K-16K, heads, head dim 64/128, GQA) it times, with CUDA events after
warm-up (median of --reps):
  baseline-sdpa-bf16      torch SDPA bf16, H heads (and flash-attn bf16 when installed)
  v2-flash-bf16           DIFF V2 core on flash-attn (when installed)
  v2-sdpa-bf16            DIFF V2 the way a user writes it on torch SDPA: ONE causal call over the 2H interleaved
                          query heads (GQA through enable_gqa, or K/V repeat_interleave'd where the installed
                          torch refuses it), then out[:, 0::2] - lam * out[:, 1::2] in fp32, cast to bf16
  v2-bf16-triton          DIFF V2 core, the Triton kernel, bf16
  v2-int8qk-fp8pv-triton  DIFF V2, Triton, int8 Q/K per 64-token block with K smoothing, fp8 P*V (SageAttention)
  v2-int8tokqk-fp8pv-triton  the same with a Q/K scale per token (the same attention kernel: it reads a scale
                          per token either way; only the quantizer's absmax is per row)
  v2-fp8qk-fp8pv-triton   DIFF V2, Triton, fp8 Q/K, fp8 P*V
  v1-sdpa-bf16            DIFF V1 on torch SDPA: two causal calls (map 1 on the even Q/K components, map 2 on
                          the odd ones) over the 2d-wide value heads, Q/K zero-padded to 2d with scale 1/sqrt(d)
                          (as the model's fused path does), o1 - lam * o2, RMSNorm over 2d, * (1 - lambda_init)
  v1-bf16-triton          DIFF V1 core (Triton; 2d value heads, RMSNorm epilogue)
and each one's accuracy against the fp32 torch reference on the same (bf16-rounded) inputs (cosine
similarity, relative L1, RMSE), for inputs N(0,1) and the FlashAttention-3 FP8 test distribution
N(0,1) + N(0,100) * Bernoulli(0.001). The Triton kernels choose their own tiles per shape (no block sizes are
passed). A variant that raises (a kernel that does not build for a shape, out of memory) gets a row with
"error" (the message) instead of ms / accuracy, and the run goes on.
FLOPs count the two maps of a DIFF head (4 * B * heads * T^2 * d per map pair, causal halves it).
On the GPU each row also says where its time goes: ``host_ms`` (the median wall time the host takes to issue
one call, the device idle before it: Python, checks and launches; the device cannot start what the host has
not issued) and, from a torch.profiler trace of one call, ``launches`` (kernels, copies and fills on the
device), ``kernel_ms`` (their summed device time) and ``span_ms`` (first start to last end). A row whose ``ms``
is near ``host_ms`` and well above ``kernel_ms`` is host-bound: its kernels would be faster than ``ms`` says
inside a model or a CUDA graph, where the host runs ahead.

Then the goals, per shape (T, H, Hkv, d), on the N(0,1) times (the time does not depend on the values), printed
as a table and stored under "goals" (one entry per shape and goal: measured ratios, "met" / "missed" / "n/a"):
  1  v2-bf16-triton <= 2.5 x baseline-sdpa-bf16, and faster than v2-sdpa-bf16
  2  v2-int8qk-fp8pv-triton <= 1 x baseline-sdpa-bf16, cosine >= 0.999 on both distributions (the same check
     is reported for v2-int8tokqk-fp8pv-triton and v2-fp8qk-fp8pv-triton)
  3  v1-bf16-triton <= 3 x baseline-sdpa-bf16, and faster than v1-sdpa-bf16
  4  every Triton variant ran (no "error" row) on both distributions
A goal is "missed" when a measured part fails, otherwise "n/a" when a part has no number (its row is missing or
an error), otherwise "met". The verdicts read ``ms`` (event time, the baseline timed alike); the speed goals
also report the ratio of device time alone (``kernels_vs_baseline``, from ``kernel_ms``), which says whether a
miss is the kernels' or the host's.
Writes bench-DATE-DEVICE.json beside this script (or --out) and prints a table. Needs CUDA and Triton.
--json FILE also writes the result to FILE after every shape (``"complete": false`` until the last), so a run
cut short by a time limit (the GPU kit, analysis/gpu) keeps the shapes it finished; with --smoke too.
--smoke runs one tiny shape on the CPU through Triton's interpreter: it checks the script, its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"
DISTS = ("normal", "fa3")
# goal 2's variants: int8 Q/K per 64-token block, per token, and the fp8 Q/K twin
QUANTIZED_V2 = ("v2-int8qk-fp8pv-triton", "v2-int8tokqk-fp8pv-triton", "v2-fp8qk-fp8pv-triton")
TRITON_VARIANTS = ("v2-bf16-triton", *QUANTIZED_V2, "v1-bf16-triton")
# --tune times each kernel once: per-token Q/K scales change the quantizer, not the attention kernel's launch
TUNED_VARIANTS = tuple(v for v in TRITON_VARIANTS if v != "v2-int8tokqk-fp8pv-triton")
BASELINE = "baseline-sdpa-bf16"
GOAL_V2_VS_BASELINE = 2.5  # goal 1: bf16 DIFF V2 Triton time / baseline SDPA time
GOAL_QUANT_VS_BASELINE = 1.0  # goal 2: quantized DIFF V2 Triton time / baseline SDPA time
GOAL_COSINE = 0.999  # goal 2: cosine to the fp32 reference, both distributions
GOAL_V1_VS_BASELINE = 3.0  # goal 3: bf16 DIFF V1 Triton time / baseline SDPA time


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


def measure(fn, reps: int) -> tuple[torch.Tensor, float]:
    """(output, ms). On the GPU one untimed call gives the output, then :func:`timed`; on the CPU (--smoke,
    Triton's interpreter, slow) that one call is also the time."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e3
    out = fn()
    return out, timed(fn, reps)


# the Chrome-trace categories (torch.profiler / Kineto) of work that runs on the device
DEVICE_OPS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_ops(trace: dict, cats: tuple[str, ...] = DEVICE_OPS) -> dict:
    """The device work in a Chrome trace of one call (torch.profiler's ``export_chrome_trace``; ``ts`` and
    ``dur`` in microseconds): how many operations of the categories ``cats`` ran (``launches``), their
    summed duration (``kernel_ms``) and the span from the first one's start to the last one's end
    (``span_ms``); a span much longer than the sum means the device waited between them."""
    ops = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats]
    if not ops:
        return {"launches": 0, "kernel_ms": 0.0, "span_ms": 0.0}
    start = min(e["ts"] for e in ops)
    end = max(e["ts"] + e["dur"] for e in ops)
    return {
        "launches": len(ops),
        "kernel_ms": sum(e["dur"] for e in ops) / 1e3,
        "span_ms": (end - start) / 1e3,
    }


def where_time_goes(fn, reps: int, cats: tuple[str, ...] = DEVICE_OPS) -> dict:
    """``host_ms``: the median wall time of issuing one call with the device idle before it (on CUDA the call
    returns once its work is queued, unless it synchronizes); then :func:`device_ops` of one call traced by
    torch.profiler (CUDA activity on the GPU; on the CPU, for the tests, the CPU's ops with ``cats``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        host.append((time.perf_counter() - start) * 1e3)
    sync()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return {"host_ms": statistics.median(host), **device_ops(trace, cats)}


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine, relative L1 and RMSE over every element, summed in float64: fp32 sums over millions of
    elements are off by ~1e-4 in the cosine (1.0002 measured on the CPU for a bf16 core), the size of the
    differences goal 2's 0.999 has to tell apart."""
    o, r = out.double().flatten(), ref.double().flatten()
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
            # the layer's lambda as the model holds it, a tensor on the device: a Python float would be
            # copied to the device in every call, a host sync
            "lam": torch.tensor(0.35, device=DEVICE),
            "lambda_init": 0.5,
        }
    return {
        "q": draw(b, 2 * h, t, d),
        "k": draw(b, hkv, t, d),
        "v": draw(b, hkv, t, d),
        "lam": torch.sigmoid(draw(b, h, t)),
    }


def v2_variants() -> dict:
    """The DIFF V2 Triton variants by row name: their CoreQuant (imported here: after --smoke has chosen
    Triton's interpreter)."""
    from diffquant.kernels import CoreQuant

    return {
        "v2-bf16-triton": CoreQuant(),
        "v2-int8qk-fp8pv-triton": CoreQuant(qk="int8", block=64, pv="fp8_e4m3"),
        "v2-int8tokqk-fp8pv-triton": CoreQuant(qk="int8", block=1, pv="fp8_e4m3"),
        "v2-fp8qk-fp8pv-triton": CoreQuant(qk="fp8_e4m3", block=64, pv="fp8_e4m3"),
    }


def pair_flops(shape: dict) -> float:
    """FLOPs of a DIFF V2 core (two causal maps per head; QK^T and PV each 2 T^2 d per map, halved by the
    mask); the baseline computes half, DIFF V1 (2d-wide values) twice."""
    return 2 * 4 * shape["H"] * shape["T"] ** 2 * shape["d"] / 2


# --------------------------------------------------------------------- DIFF on torch SDPA, as a user writes it
def sdpa_gqa_supported() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5) and runs it for bf16 on DEVICE."""
    q = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    try:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, scale: float | None = None):
    """Causal SDPA of q (B, Hq, T, dq) on k/v (B, Hkv, T, .): query head j reads kv head j // (Hq / Hkv),
    through ``enable_gqa`` or, where torch refuses it, K/V repeat_interleave'd to the query heads."""
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def diff_v2_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, gqa: bool):
    """DIFF V2 as one SDPA call: q (B, 2H, T, d) interleaved pairs, k/v (B, Hkv, T, d), lam (B, H, T) ->
    (B, H, T, d) in q's dtype; the pair difference in fp32 (the semantics of diff_v2_core)."""
    out = _sdpa(q, k, v, gqa)
    return (out[:, 0::2].float() - lam.float()[..., None] * out[:, 1::2].float()).to(q.dtype)


def diff_v1_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: float | torch.Tensor,
    lambda_init: float,
    gqa: bool,
    eps: float = 1e-5,
):
    """DIFF V1 as two SDPA calls: q (B, 2H, T, d), k (B, 2Hkv, T, d) interleaved components, v (B, Hkv, T, 2d)
    -> (B, H, T, 2d) in q's dtype: (1 - lambda_init) * RMSNorm_2d(A1 V - lam A2 V), the semantics of
    diff_v1_core with norm_weight None (a weight of ones). SDPA's fast CUDA kernel (flash) needs one head width
    for Q, K and V, and V is 2d wide: as the model's fused path (Attention._fused) does, Q and K are
    zero-padded to 2d (exact: the zeros add nothing to Q.K^T) and the scale is passed as 1/sqrt(d)."""
    d, dv = q.shape[-1], v.shape[-1]
    qp, kp = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    o1 = _sdpa(qp[:, 0::2], kp[:, 0::2], v, gqa, scale=1.0 / math.sqrt(d))
    o2 = _sdpa(qp[:, 1::2], kp[:, 1::2], v, gqa, scale=1.0 / math.sqrt(d))
    x = o1.float() - lam * o2.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 - lambda_init)).to(q.dtype)


# ------------------------------------------------------------------------------------------------- the run
def add_row(
    rows: list[dict],
    head: dict,
    variant: str,
    fn,
    reps: int,
    flops: float,
    ref=None,
    profile: list | None = None,
    **extra,
) -> None:
    """Time ``fn`` (and its accuracy against ``ref``) into a row; a variant that raises gets a row with its
    error message instead, and the run goes on. A timed row and its call are appended to ``profile`` (for
    :func:`profile_rows`) when given."""
    try:
        out, ms = measure(fn, reps)
        acc = {} if ref is None else accuracy(out, ref)
    except Exception as e:  # a kernel that does not build or run for this shape, out of memory, ...
        msg = f"{type(e).__name__}: {e}"[:300]
        rows.append({**head, "variant": variant, "error": msg})
        print(f"error {variant} {head}: {msg}", file=sys.stderr, flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        return
    rows.append({**head, "variant": variant, "ms": ms, "tflops": flops / ms / 1e9, **extra, **acc})
    if profile is not None:
        profile.append((rows[-1], fn))


def profile_rows(pending: list[tuple[dict, object]], reps: int) -> None:
    """:func:`where_time_goes` into each timed row of ``pending`` ((row, call) pairs), after every row was
    timed: the profiler can leave CUPTI attached after it stops (pytorch issue 144455: 10-20 % slower
    launches), which would slow the timings that came after it. A row the profiler fails on keeps its
    times and says why."""
    for row, fn in pending:
        try:
            row.update(where_time_goes(fn, reps))
        except Exception as e:
            row["profile_error"] = f"{type(e).__name__}: {e}"[:300]


def run(args: argparse.Namespace, on_shape=None) -> dict:
    """All shapes' rows; ``on_shape(partial_result)`` is called after each shape (for --json)."""
    from diffquant.kernels import diff_v1_core, diff_v2_core
    from diffquant.kernels.flash import flash_available
    from diffquant.kernels.triton_diff import diff_v1_attention, diff_v2_attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gqa = sdpa_gqa_supported()
    expand = "enable_gqa" if gqa else "repeat_interleave"
    variants = v2_variants()
    rows: list[dict] = []
    pending: list[tuple[dict, object]] = []  # rows to profile once all are timed (the GPU, N(0,1) rows)
    for shape in shapes(args.quick, args.smoke):
        t, h, d = shape["T"], shape["H"], shape["d"]
        flops_pair = pair_flops(shape)
        for dist in DISTS:
            head = {**shape, "dist": dist}
            prof = pending if DEVICE == "cuda" and dist == "normal" else None
            x = inputs(shape, dist, "v2", gen)
            q16, k16, v16 = (x[n].to(torch.bfloat16) for n in ("q", "k", "v"))
            lam = x["lam"]
            ref = diff_v2_core(q16.float(), k16.float(), v16.float(), lam)
            # baseline: h heads over the same kv heads, bf16 SDPA
            qb = q16[:, 0::2].contiguous()
            rep = h // shape["Hkv"]
            kb, vb = k16.repeat_interleave(rep, 1), v16.repeat_interleave(rep, 1)
            sdpa = partial(F.scaled_dot_product_attention, qb, kb, vb, is_causal=True)
            add_row(rows, head, BASELINE, sdpa, args.reps, flops_pair / 2, profile=prof)
            if DEVICE == "cuda" and flash_available():
                from diffquant.kernels.flash import diff_v2_flash

                lam4 = lam.unsqueeze(-1)
                call = partial(diff_v2_flash, q16, k16, v16, lam4)
                add_row(rows, head, "v2-flash-bf16", call, args.reps, flops_pair, ref, profile=prof)
            call = partial(diff_v2_sdpa, q16, k16, v16, lam, gqa)
            add_row(
                rows, head, "v2-sdpa-bf16", call, args.reps, flops_pair, ref, kv_expand=expand, profile=prof
            )
            for name, quant in variants.items():
                # no block_m / block_n: the kernel picks its tiles per shape (triton_diff.launch_config)
                call = partial(diff_v2_attention, q16, k16, v16, lam, quant=quant)
                add_row(rows, head, name, call, args.reps, flops_pair, ref, profile=prof)
            x1 = inputs(shape, dist, "v1", gen)
            q1, k1, v1 = (x1[n].to(torch.bfloat16) for n in ("q", "k", "v"))
            lam1, init1 = x1["lam"], x1["lambda_init"]
            ref1 = diff_v1_core(q1.float(), k1.float(), v1.float(), lam1, init1, None)
            call = partial(diff_v1_sdpa, q1, k1, v1, lam1, init1, gqa)
            add_row(
                rows,
                head,
                "v1-sdpa-bf16",
                call,
                args.reps,
                2 * flops_pair,
                ref1,
                kv_expand=expand,
                profile=prof,
            )
            call = partial(diff_v1_attention, q1, k1, v1, lam1, init1, None)
            add_row(rows, head, "v1-bf16-triton", call, args.reps, 2 * flops_pair, ref1, profile=prof)
            print(f"done T={t} H={h} d={d} {dist}", file=sys.stderr, flush=True)
        if on_shape is not None:
            on_shape(_result(rows, complete=False, sdpa_gqa=gqa))
    profile_rows(pending, min(args.reps, 5))
    return _result(rows, complete=True, sdpa_gqa=gqa)


# ------------------------------------------------------------------------------------------------ the goals
def _status(checks: list[bool | None]) -> str:
    if any(c is False for c in checks):
        return "missed"
    return "n/a" if any(c is None for c in checks) else "met"


def _at_most(value: float | None, bound: float, strict: bool = False) -> bool | None:
    if value is None:
        return None
    return value < bound if strict else value <= bound


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _entry(shape: tuple, goal: int, variant: str, criterion: str, measured: dict, checks: list, text: str):
    t, h, hkv, d = shape
    return {
        "T": t, "H": h, "Hkv": hkv, "d": d, "goal": goal, "variant": variant, "criterion": criterion,
        "measured": measured, "status": _status(checks), "text": text,
    }  # fmt: skip


def _shape_goals(shape: tuple, dists: dict[str, dict[str, dict]]) -> list[dict]:
    """One shape's goal entries; ``dists[dist][variant]`` is that row."""

    def get(variant: str, field: str, dist: str = "normal"):
        return dists.get(dist, {}).get(variant, {}).get(field)

    def ratio(a: str, b: str, field: str = "ms") -> float | None:
        ms_a, ms_b = get(a, field), get(b, field)
        return None if ms_a is None or not ms_b else ms_a / ms_b

    def device_alone(variant: str) -> tuple[dict, str]:
        """The device-time ratio to the baseline (not a verdict: it says whose the time is); "" on the CPU."""
        vs = ratio(variant, BASELINE, "kernel_ms")
        return {"kernels_vs_baseline": vs}, ("" if vs is None else f"; device time alone {vs:.2f}x")

    def speed(goal: int, variant: str, sdpa: str, bound: float) -> dict:  # goals 1 and 3
        vs_base, vs_sdpa = ratio(variant, BASELINE), ratio(variant, sdpa)
        alone, note = device_alone(variant)
        return _entry(
            shape,
            goal,
            variant,
            f"ms <= {bound:g} x {BASELINE} and < {sdpa}",
            {"vs_baseline": vs_base, "vs_sdpa": vs_sdpa, **alone},
            [_at_most(vs_base, bound), _at_most(vs_sdpa, 1.0, strict=True)],
            f"{_num(vs_base, '.2f')}x baseline (<= {bound:g}), {_num(vs_sdpa, '.2f')}x {sdpa} (< 1){note}",
        )

    out = [speed(1, "v2-bf16-triton", "v2-sdpa-bf16", GOAL_V2_VS_BASELINE)]
    for variant in QUANTIZED_V2:  # goal 2
        vs_base = ratio(variant, BASELINE)
        alone, note = device_alone(variant)
        cos = {dist: get(variant, "cosine", dist) for dist in DISTS}
        out.append(
            _entry(
                shape,
                2,
                variant,
                f"ms <= {GOAL_QUANT_VS_BASELINE:g} x {BASELINE}, cosine >= {GOAL_COSINE} on "
                + " and ".join(DISTS),
                {"vs_baseline": vs_base, **{f"cosine_{dist}": c for dist, c in cos.items()}, **alone},
                [_at_most(vs_base, GOAL_QUANT_VS_BASELINE)]
                + [None if c is None else c >= GOAL_COSINE for c in cos.values()],
                f"{_num(vs_base, '.2f')}x baseline (<= {GOAL_QUANT_VS_BASELINE:g}), cosine "
                + " / ".join(f"{_num(c, '.5f')} {dist}" for dist, c in cos.items())
                + f" (>= {GOAL_COSINE}){note}",
            )
        )
    out.append(speed(3, "v1-bf16-triton", "v1-sdpa-bf16", GOAL_V1_VS_BASELINE))
    ran, errors, checks = 0, {}, []  # goal 4: None for a missing row, False for an error row
    for variant in TRITON_VARIANTS:
        for dist in DISTS:
            row = dists.get(dist, {}).get(variant)
            if row is None:
                checks.append(None)
            elif "error" in row:
                checks.append(False)
                errors[f"{variant} ({dist})"] = row["error"]
            else:
                checks.append(True)
                ran += 1
    text = f"{ran}/{len(checks)} Triton runs ({len(TRITON_VARIANTS)} variants x {len(DISTS)} distributions)"
    if errors:
        text += "; failed: " + ", ".join(errors)
    out.append(
        _entry(
            shape,
            4,
            "all Triton variants",
            "every Triton variant ran without an error on " + " and ".join(DISTS),
            {"ran": ran, "expected": len(checks), "errors": errors},
            checks,
            text,
        )
    )
    return out


def goals(rows: list[dict]) -> list[dict]:
    """The goals per shape (T, H, Hkv, d), in the order the shapes ran: one entry per shape and goal with
    ``goal``, ``variant``, ``criterion``, ``measured`` (the ratios / cosines, None where a row is missing or an
    error), ``status`` ("met" / "missed" / "n/a") and ``text`` (the measured line the table prints)."""
    by_shape: dict[tuple, dict[str, dict[str, dict]]] = {}
    for r in rows:
        key = (r["T"], r["H"], r["Hkv"], r["d"])
        by_shape.setdefault(key, {}).setdefault(r["dist"], {})[r["variant"]] = r
    return [g for shape, dists in by_shape.items() for g in _shape_goals(shape, dists)]


def _result(rows: list[dict], complete: bool, sdpa_gqa: bool | None = None) -> dict:
    from diffquant.kernels.flash import flash_available

    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter-smoke",
        "torch": torch.__version__,
        "flash_attn": flash_available(),
        "sdpa_enable_gqa": sdpa_gqa,
        "complete": complete,
        "rows": rows,
        "goals": goals(rows),
    }


def _write_json(path: Path, result: dict) -> None:
    """Written whole and renamed, so a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def print_tables(result: dict, smoke: bool = False) -> None:
    print(f"{result['device']}  torch {result['torch']}  flash-attn {result['flash_attn']}")
    print(
        f"{'T':>6}{'H':>4}{'Hkv':>4}{'d':>5} {'dist':<7}{'variant':<26}{'ms':>9}{'TFLOP/s':>9}{'cosine':>10}"
        f"{'relL1':>9}{'host ms':>9}{'dev ms':>9}{'ops':>5}"
    )
    for r in result["rows"]:
        shape = f"{r['T']:>6}{r['H']:>4}{r['Hkv']:>4}{r['d']:>5} {r['dist']:<7}{r['variant']:<26}"
        if "error" in r:
            print(f"{shape}  error: {r['error'][:100]}")
            continue
        acc = f"{r['cosine']:>10.5f}{r['rel_l1']:>9.4f}" if "cosine" in r else f"{'':>19}"
        where = f"{r['host_ms']:>9.3f}{r['kernel_ms']:>9.3f}{r['launches']:>5}" if "host_ms" in r else ""
        print(f"{shape}{r['ms']:>9.3f}{r['tflops']:>9.1f}{acc}{where}".rstrip())
    print()
    note = " (smoke: CPU interpreter times, the verdicts mean nothing)" if smoke else ""
    print(f"goals, on the normal inputs' times{note}")
    print(f"{'T':>6}{'H':>4}{'Hkv':>4}{'d':>5} {'goal':<5}{'variant':<26}{'status':<8} measured")
    for g in result["goals"]:
        print(
            f"{g['T']:>6}{g['H']:>4}{g['Hkv']:>4}{g['d']:>5} {g['goal']:<5}{g['variant']:<26}{g['status']:<8} "
            f"{g['text']}"
        )


# ------------------------------------------------------------------------------------------------ tuning
TUNE_SHAPES = [{"T": 4096, "H": 16, "Hkv": 16, "d": 64}, {"T": 4096, "H": 16, "Hkv": 4, "d": 128}]
COMPILED = "compiled-triton*.json"  # analysis/kernels/compiled.py --sweep, one file per Triton version


def candidates(variant: str, d: int, smoke: bool = False) -> list[dict]:
    """Launch configurations worth timing for a Triton variant and head width: those the offline sm_90
    compile (analysis/kernels/compiled.py --sweep) found to fit shared memory, spill no register and
    pipeline their loads under every Triton version it was run with; every candidate of that sweep when no
    such file is here."""
    if smoke:
        return [{"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}] * 2
    name = variant.removesuffix("-triton")
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    verdicts: dict[tuple, list[bool]] = {}
    for path in sorted(Path(__file__).parent.glob(COMPILED)):
        for r in json.loads(path.read_text()).get("rows", []):
            if r.get("source") == "sweep" and r["variant"] == name and r["d"] == d:
                good = bool(r.get("fits")) and r.get("spill_bytes") == 0 and r.get("async_copies", 0) > 0
                verdicts.setdefault(tuple(r[k] for k in keys), []).append(good)
    good = [dict(zip(keys, cfg, strict=True)) for cfg, ok in verdicts.items() if all(ok)]
    if good:
        return good
    sys.path.insert(0, str(Path(__file__).parent))
    from compiled import CANDIDATES

    return [
        {"block_m": m, "block_n": n, "num_warps": w, "num_stages": st}
        for m, n, w in CANDIDATES
        for st in (2, 3)
    ]


def tune(args: argparse.Namespace, on_variant=None) -> dict:
    """Time every candidate configuration of every Triton variant on the T = 4096 shapes (N(0,1) inputs):
    the rows, and the fastest per (variant, d) as the kernel's table (triton_diff._CONFIGS) would hold it."""
    from diffquant.kernels.triton_diff import diff_v1_attention, diff_v2_attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    quants = v2_variants()
    rows: list[dict] = []
    for shape in shapes(False, smoke=True) if args.smoke else TUNE_SHAPES:
        t, h, d = shape["T"], shape["H"], shape["d"]
        flops_pair = pair_flops(shape)
        head = {**shape, "dist": "normal"}
        x = {
            n: v.to(torch.bfloat16) if n != "lam" else v
            for n, v in inputs(shape, "normal", "v2", gen).items()
        }
        x1 = inputs(shape, "normal", "v1", gen)
        q1, k1, v1 = (x1[n].to(torch.bfloat16) for n in ("q", "k", "v"))
        for variant in TUNED_VARIANTS:
            for cfg in candidates(variant, d, args.smoke):
                if variant.startswith("v1"):
                    call = partial(diff_v1_attention, q1, k1, v1, x1["lam"], x1["lambda_init"], None, **cfg)
                    flops = 2 * flops_pair
                else:
                    call = partial(
                        diff_v2_attention, x["q"], x["k"], x["v"], x["lam"], quant=quants[variant], **cfg
                    )
                    flops = flops_pair
                add_row(rows, head, variant, call, args.reps, flops, config=cfg)
            if on_variant is not None:
                on_variant(_tune_result(rows))
        print(f"tuned T={t} H={h} d={d}", file=sys.stderr, flush=True)
    return _tune_result(rows)


def _tune_result(rows: list[dict]) -> dict:
    """The tuning rows and, per (variant, d), the fastest configuration that ran."""
    best: dict[str, dict] = {}
    for row in rows:
        if "ms" not in row:
            continue
        key = f"{row['variant']} d={row['d']}"
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = {"ms": row["ms"], "tflops": row["tflops"], **row["config"]}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "tuning": rows,
        "best": best,
    }


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
    parser.add_argument(
        "--tune",
        action="store_true",
        help="time every candidate tile / warp / stage configuration of the Triton variants (T = 4096)",
    )
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit(
            "analysis/kernels/bench.py needs a CUDA GPU (CPU correctness is covered by tests/test_kernels.py)"
        )
    if args.tune:
        result = tune(args, None if args.json is None else partial(_write_json, args.json))
        for key, cfg in result["best"].items():
            print(f"best {key}: {cfg}")
        if args.json is not None:
            _write_json(args.json, result)
        if not args.smoke:
            path = Path(args.out) / f"tune-{result['date']}-{result['device'].replace(' ', '_')}.json"
            path.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {path}")
        return
    on_shape = None if args.json is None else partial(_write_json, args.json)
    result = run(args, on_shape)
    if args.json is not None:
        _write_json(args.json, result)
    print_tables(result, smoke=args.smoke)
    name = f"bench-{result['date']}-{result['device'].replace(' ', '_')}.json"
    path = Path(args.out) / name
    if args.smoke:
        print("smoke run: not written")
        return
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
