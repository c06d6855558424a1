"""What the DIFF attention kernel compiles to on Hopper, measured without a GPU: shared memory, registers,
spills and tensor-core (wgmma) use per variant and launch configuration.

    TRITON_INTERPRET=0 python analysis/kernels/compiled.py [--sweep] [--out FILE]

writes analysis/kernels/compiled-triton<VERSION>.json (committed: Triton 3.6.0, the GPU machine's, and 3.9.0,
this project's CPU venv; a second venv with ``pip install torch==2.13.0 triton==3.6.0`` and
PYTHONPATH=. runs it under 3.6).

Triton compiles for a target it is told (here sm_90, the H100 / H200) without a driver, and ships the
``ptxas`` that assembles the PTX; ``ptxas -v`` prints the registers per thread and the bytes spilled to local
memory, and the compiled kernel's metadata holds the shared memory it needs (the GPU refuses a launch above
232,448 bytes per block on sm_90: the "OutOfResources: shared memory" of issue 46). None of this times
anything: it says which configurations can run, and which run P @ V as IEEE fp32 FMAs instead of MMAs
(the first reason the bf16 kernel ran at ~1 % of the chip). The timing is the bench's job
(analysis/kernels/bench.py) on the GPU.

The rows cover the kernel's configuration table (``triton_diff.launch_config``) and, with --sweep, every
candidate (block_m, block_n, num_warps, num_stages) for each variant, so the table can be re-derived.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a script: compile, do not interpret (set before the kernels are imported). Imported as a module
# (bench.py's candidate list, a test), it must not change the importer's environment.
SCRIPT = __name__ == "__main__"
if SCRIPT:
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from diffquant.kernels import triton_diff as td  # noqa: E402

SM90_SHARED_LIMIT = 232448  # bytes per block on sm_90 (the H200's refusal names this number)
ARCH = 90

# (name, kind, qk, pv, two_pass): the bench's variants and the model's two-pass fp8 path.
VARIANTS = [
    ("v2-bf16", "v2", None, "bf16", False),
    ("v2-exact", "v2", None, "fp32", False),
    ("v2-int8qk-fp8pv", "v2", "int8", "fp8_e4m3", False),
    ("v2-fp8qk-fp8pv", "v2", "fp8_e4m3", "fp8_e4m3", False),
    ("v2-int8qk-fp8pv-two-pass", "v2", "int8", "fp8_e4m3", True),
    ("v1-bf16", "v1", None, "bf16", False),
    ("v1-int8qk-fp8pv", "v1", "int8", "fp8_e4m3", False),
]


# The shape each head width is compiled for (the bench's T = 4096 shapes): the launch's integer arguments
# (strides, lengths) are specialized as a real launch specializes them (1 -> constant, multiples of 16 ->
# divisibility hints), which decides vectorized and asynchronous (pipelined) loads.
SHAPES = {64: {"T": 4096, "H": 16, "Hkv": 16}, 128: {"T": 4096, "H": 16, "Hkv": 4}}


class _Captured(Exception):
    """Raised by the stand-in kernel to stop the host code at the launch, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args_, self.kwargs_ = args, kwargs


class _Recorder:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _Captured(args, kwargs)

        return launch


@functools.cache
def _captured(kind: str, qk: str | None, pv: str, two_pass: bool, d: int) -> tuple[tuple, dict]:
    return captured_launch(kind, qk, pv, two_pass, d, {})


def captured_launch(
    kind: str, qk: str | None, pv: str, two_pass: bool, d: int, cfg: dict
) -> tuple[tuple, dict]:
    """The arguments the host code passes to ``_diff_attn_fwd`` for bf16 inputs of SHAPES[d] on CPU tensors
    (the host code runs for real up to the launch: quantization, strides, constants)."""
    import torch

    from diffquant.kernels.reference import CoreQuant, quantize_tokens, quantize_values

    shape = SHAPES[d]
    t, h, hkv = shape["T"], shape["H"], shape["Hkv"]
    gen = torch.Generator().manual_seed(0)

    def draw(*size):
        return torch.randn(*size, generator=gen).to(torch.bfloat16)

    quant = CoreQuant(qk=qk, block=64, pv="fp8_e4m3" if pv == "fp8_e4m3" else "fp32")
    exact = pv == "fp32"

    def quantize_in_torch(x, fmt, block, smooth=False):  # the Triton quantizer needs a GPU; same numbers
        tq = quantize_tokens(x, fmt, block, smooth=smooth)
        return tq.codes.to(torch.int8 if fmt == "int8" else torch.float8_e4m3fn), tq.scale, tq.mean

    def values_in_torch(v):  # likewise for V's fp8 codes
        codes, scale = quantize_values(v, "fp8_e4m3")
        return codes.to(torch.float8_e4m3fn), scale.reshape(v.shape[0], v.shape[-1])

    stand_ins = {
        "_diff_attn_fwd": _Recorder(),
        "_check_inputs": lambda *a: None,
        "_interpreting": lambda: False,
        "quantize_tokens_triton": quantize_in_torch,
        "quantize_values_triton": values_in_torch,
    }
    saved = {name: getattr(td, name) for name in stand_ins}
    for name, value in stand_ins.items():
        setattr(td, name, value)
    try:
        if kind == "v1":
            td.diff_v1_attention(
                draw(1, 2 * h, t, d), draw(1, 2 * hkv, t, d), draw(1, hkv, t, 2 * d), 0.3, 0.5,
                torch.ones(2 * d), quant=quant, two_pass=two_pass, exact=exact, **cfg,
            )  # fmt: skip
        else:
            lam = torch.rand(1, h, t, generator=gen)
            td.diff_v2_attention(
                draw(1, 2 * h, t, d), draw(1, hkv, t, d), draw(1, hkv, t, d), lam,
                quant=quant, two_pass=two_pass, exact=exact, **cfg,
            )  # fmt: skip
    except _Captured as got:
        return got.args_, got.kwargs_
    finally:
        for name, value in saved.items():
            setattr(td, name, value)
    raise RuntimeError("the host code did not launch the kernel")


def source(args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """An ASTSource specialized as Triton's launcher specializes these arguments, and the compile options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    fn = td._diff_attn_fwd
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages")}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = values[name]
        if name in kwargs:  # the kernel's tl.constexpr parameters
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
        if kind == "constexpr":
            signature[name], constexprs[(index,)] = "constexpr", spec
            continue
        signature[name] = kind
        if spec:
            attrs[(index,)] = CUDABackend.parse_attr(spec)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def compile_row(kind, qk, pv, two_pass, d, cfg) -> dict:
    """Compile one variant for sm_90 and read its resources; an error is a row too (e.g. out of shared)."""
    row = {"kind": kind, "qk": qk, "pv": pv, "two_pass": two_pass, "d": d, "dtype": "bf16", **cfg}
    try:
        # the host code's arguments do not depend on the configuration (only the grid does): capture once
        args, kwargs = _captured(kind, qk, pv, two_pass, d)
        kwargs = {**kwargs, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        kwargs.update(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"])
        src, options = source(args, kwargs)
        kernel = triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=options)
    except Exception as exc:  # noqa: BLE001 (the error is the measurement)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return row
    ptx = kernel.asm["ptx"]
    row["shared"] = int(kernel.metadata.shared)
    row["fits"] = row["shared"] <= SM90_SHARED_LIMIT
    row["wgmma"] = sorted(
        set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.\w+\.(\w+)\.", ptx))
    )
    row["async_copies"] = len(re.findall(r"\bcp\.async\b", ptx))  # pipelined (asynchronous) tile loads
    row["fp32_fma"] = len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32\b", ptx))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        proc = subprocess.run(
            [
                get_ptxas(ARCH).path,
                "-v",
                f"--gpu-name=sm_{ARCH}a",
                str(path),
                "-o",
                str(path.with_suffix(".o")),
            ],
            capture_output=True,
            text=True,
        )
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    row["registers"] = int(regs.group(1)) if regs else None
    row["spill_bytes"] = int(spills.group(1)) + int(spills.group(2)) if spills else None
    return row


def table_rows() -> list[dict]:
    rows = []
    for (name, kind, qk, pv, two_pass), d in itertools.product(VARIANTS, (64, 128)):
        cfg = td.launch_config(
            kind="diff_" + kind, d=d, dv=2 * d if kind == "v1" else d, qk=qk, pv=pv, interpreting=False
        )
        rows.append({"variant": name, "source": "table", **compile_row(kind, qk, pv, two_pass, d, cfg)})
    return rows


# Candidate (block_m, block_n, num_warps) for the sweep, each with 2 and 3 pipeline stages: FlashAttention-2's
# and the Triton tutorial's tile shapes; 4 warps only for 64-row query tiles (two fp32 accumulators of a
# 128-row tile do not fit 4 warps' registers).
CANDIDATES = [(64, 32, 4), (64, 64, 4), (64, 32, 8), (64, 64, 8), (128, 32, 8), (128, 64, 8)]


def sweep_rows() -> list[dict]:
    rows = []
    cands = [
        {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
        for m, n, w in CANDIDATES
        for s in (2, 3)
    ]
    for (name, kind, qk, pv, two_pass), d in itertools.product(VARIANTS, (64, 128)):
        if two_pass or pv == "fp32":
            continue  # the two-pass and exact paths take the single-pass variant's configuration
        for cfg in cands:
            row = compile_row(kind, qk, pv, two_pass, d, cfg)
            rows.append({"variant": name, "source": "sweep", **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=None, help="default: compiled-triton<VERSION>.json beside this script"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="every candidate configuration, not only the table"
    )
    args = parser.parse_args()
    rows = table_rows() + (sweep_rows() if args.sweep else [])
    result = {
        "triton": triton.__version__,
        "arch": f"sm_{ARCH}",
        "shared_limit": SM90_SHARED_LIMIT,
        "rows": rows,
    }
    out = Path(args.out or Path(__file__).with_name(f"compiled-triton{triton.__version__}.json"))
    out.write_text(json.dumps(result, indent=1) + "\n")
    head = f"{'variant':26} {'d':>4} {'bm':>4} {'bn':>4} {'w':>2} {'st':>2} {'shared':>7} {'regs':>4} {'spill':>6} mma"
    print(f"triton {triton.__version__}, sm_{ARCH}\n{head}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:26} {r['d']:>4} {r['block_m']:>4} {r['block_n']:>4} {r['num_warps']:>2} "
                  f"{r['num_stages']:>2} {r['error']}")  # fmt: skip
            continue
        print(
            f"{r['variant']:26} {r['d']:>4} {r['block_m']:>4} {r['block_n']:>4} {r['num_warps']:>2} "
            f"{r['num_stages']:>2} {r['shared']:>7} {r['registers']!s:>4} {r['spill_bytes']!s:>6} "
            f"{','.join(r['wgmma'])} fma={r['fp32_fma']}"
        )


if __name__ == "__main__":
    main()
