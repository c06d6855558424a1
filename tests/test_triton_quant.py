"""diffquant.kernels.triton_quant: the one-kernel Q/K block quantizer is bit-identical to the torch reference.

``quantize_tokens_triton(x, fmt, block, smooth)`` against ``reference.quantize_tokens``: the codes byte for byte
after the cast the attention kernel's ``_prepare`` applies (int8 / float8_e4m3fn: so -0.0 codes and NaN signs
count too), and as fp32 values wherever the reference's code is finite; scales and smoothing means exactly
(``torch.equal``; NaN means in the same places). Runs under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); each case is a handful of programs, the interpreter costing some 10 ms each.

Inputs are fixed draws (a seed per case). Cases: partial last blocks (T = 19, 130 with block 64; block 16, 3,
100), bf16 / fp16 / fp32, a transposed view (the model's q is (B, T, h, d).transpose(1, 2)) and a channel
stride of 2, N(0, 1) + N(0, 100) * Bernoulli(0.001) outliers, magnitudes spread over 2^-24..1 (e4m3 subnormal
and -0.0 codes), subnormal inputs (a subnormal scale), exact rounding ties (scale exactly 1), an all-zero block
(its mean-smoothed version too: the data are symmetric so the mean is exactly 0), and +-inf / NaN, including an
all-non-finite block (scale 1). The interpreter divides fp32 in IEEE whatever the kernel says, so the use of
``tl.div_rn`` (compiled Triton's ``/`` is approximate) is checked on the sm_90 PTX instead (slow test).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.kernels.reference import quantize_tokens

try:
    from diffquant.kernels import triton_quant as tq
except ImportError:  # pragma: no cover - Triton is in the test extra on Linux
    tq = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
cpu_kernels = pytest.mark.skipif(
    tq is None or not INTERPRET,
    reason="CPU kernel tests need Triton and TRITON_INTERPRET=1 (conftest sets it)",
)
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
MAX_VALUE = {"int8": 127.0, "fp8_e4m3": 448.0}


# ------------------------------------------------------------------------------------------ inputs
def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _draw(shape, dist: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g)
    if dist == "fa3":  # N(0,1) + N(0,100) * Bernoulli(0.001) (FlashAttention-3's FP8 accuracy test)
        x = x + torch.randn(shape, generator=g) * 10.0 * (torch.rand(shape, generator=g) < 0.001)
    elif dist == "wide":  # magnitudes 2^-24 .. 1: e4m3 subnormal codes and small negatives rounding to -0.0
        x = x * torch.exp2(-24.0 * torch.rand(shape, generator=g))
    elif dist == "subnormal":  # fp32 subnormal inputs: absmax ~ 1e-39, scale ~ 1e-41 (itself subnormal)
        x = x * 1e-39
    return x


def _symmetric(fmt: str, g: torch.Generator, d: int) -> torch.Tensor:
    """(1, 1, 48, d): block 0 = halves k / 2 in [-max, max] with one element at +max (so its scale is exactly
    1 and many codes are exact rounding ties), block 1 = zeros, block 2 = -block 0. Every partial sum of the
    mean is exact, so the mean is exactly 0 and the zero block stays all-zero under smoothing too."""
    top = int(2 * MAX_VALUE[fmt])
    a = torch.randint(-top, top + 1, (16, d), generator=g).float() / 2
    a[3, 5] = MAX_VALUE[fmt]
    return torch.cat([a, torch.zeros(16, d), -a]).reshape(1, 1, 48, d)


def _nonfinite(g: torch.Generator) -> torch.Tensor:
    """(2, 1, 40, 16), block 16: scattered +-inf / NaN, and one block (batch 1, rows 16..31) all non-finite."""
    x = _draw((2, 1, 40, 16), "fa3", g)
    x[0, 0, 3, 5] = float("nan")
    x[0, 0, 20, 1] = float("inf")
    x[0, 0, 21, 2] = -float("inf")
    x[0, 0, 38, 7] = -float("nan")
    x[1, 0, 16:32] = float("inf")
    x[1, 0, 16:32:3] = float("nan")
    x[1, 0, 17:32:3] = -float("inf")
    return x


# (id, builder(fmt, generator) -> x, block); shapes small: the interpreter runs one program per block and head
CASES = [
    ("T19-b64-fp32", lambda f, g: _draw((1, 2, 19, 16), "normal", g), 64),
    ("T64-b64-bf16-fa3", lambda f, g: _draw((1, 2, 64, 32), "fa3", g).bfloat16(), 64),
    # the model's layout: (B, T, h, d) transposed to (B, h, T, d), a view with stride(2) = h * d
    (
        "T130-b64-bf16-transposed",
        lambda f, g: _draw((1, 130, 2, 16), "fa3", g).bfloat16().transpose(1, 2),
        64,
    ),
    ("T40-b16-fp32-fa3", lambda f, g: _draw((1, 2, 40, 16), "fa3", g), 16),
    ("T64-b16-fp16-channel-stride2", lambda f, g: _draw((1, 1, 64, 32), "normal", g).half()[..., ::2], 16),
    ("T13-b3-fp32", lambda f, g: _draw((1, 1, 13, 16), "normal", g), 3),
    # block 100 of d = 128: two 64-row register tiles per block (the kernel's two-pass path), partial
    ("T70-b100-d128-two-tiles", lambda f, g: _draw((1, 1, 70, 128), "fa3", g), 100),
    ("T32-b16-fp32-wide", lambda f, g: _draw((1, 2, 32, 16), "wide", g), 16),
    ("T32-b16-fp32-subnormal", lambda f, g: _draw((1, 1, 32, 16), "subnormal", g), 16),
    ("T48-b16-ties-zero-block", lambda f, g: _symmetric(f, g, 16), 16),
    ("T40-b16-nonfinite", lambda f, g: _nonfinite(g), 16),
    # block 1 (per-token scales): tiles of many tokens with a scale per row; T = 300 at d = 32 is one full
    # 256-row tile and a partial one, the fa3 outliers make neighbouring rows' scales differ
    (
        "T300-b1-bf16-fa3-transposed",
        lambda f, g: _draw((1, 300, 2, 32), "fa3", g).bfloat16().transpose(1, 2),
        1,
    ),
    ("T40-b1-nonfinite", lambda f, g: _nonfinite(g), 1),
    ("T48-b1-ties-zero-rows", lambda f, g: _symmetric(f, g, 16), 1),
]


def _check_matches(x: torch.Tensor, fmt: str, block: int, smooth: bool, what: str) -> None:
    codes, scale, mean = tq.quantize_tokens_triton(x, fmt, block, smooth)
    ref = quantize_tokens(x, fmt, block, smooth)
    b, h, t, d = x.shape
    assert codes.dtype == CODE_DTYPES[fmt] and codes.shape == (b, h, t, d) and codes.is_contiguous(), what
    assert scale.dtype == torch.float32 and scale.shape == (b, h, t) and scale.is_contiguous(), what
    expected = ref.codes.to(CODE_DTYPES[fmt])  # what _prepare hands the attention kernel
    diff = codes.view(torch.uint8) != expected.view(torch.uint8)
    assert not diff.any(), (
        f"{what}: {int(diff.sum())} code bytes differ, first at {diff.nonzero()[0].tolist()}: "
        f"{codes[diff][0].float().item()} vs reference {ref.codes[diff][0].item()}"
    )
    finite = torch.isfinite(ref.codes)
    assert torch.equal(codes.float()[finite], ref.codes[finite]), f"{what}: fp32 codes differ"
    assert torch.equal(scale, ref.scale), f"{what}: scales differ ({int((scale != ref.scale).sum())})"
    if smooth:
        assert mean is not None and mean.dtype == torch.float32 and mean.shape == (b, h, 1, d), what
        torch.testing.assert_close(
            mean, ref.mean, rtol=0, atol=0, equal_nan=True, msg=f"{what}: means differ"
        )
    else:
        assert mean is None, what


# ------------------------------------------------------------------------------------------ tests
@cpu_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf (smooth)
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantize_tokens_triton_matches_reference(fmt, case, smooth):
    name, build, block = case
    x = build(fmt, _gen(f"{name}-{fmt}"))
    _check_matches(x, fmt, block, smooth, f"{fmt} {name} smooth={smooth}")


@cpu_kernels
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_cases_exercise_their_edges(fmt):
    """The edge cases really contain what they are named for (so a passing match is not vacuous)."""
    ties = _symmetric(fmt, _gen(f"T48-b16-ties-zero-block-{fmt}"), 16)
    for smooth in (False, True):
        _, scale, _ = tq.quantize_tokens_triton(ties, fmt, 16, smooth)
        assert torch.equal(scale[0, 0, ::16], torch.ones(3)), "scale exactly 1: max element, zero block"
        if fmt == "int8":
            assert (ties.frac() != 0).sum() > 100, "many exact .5 ties"
    wide = _draw((1, 2, 32, 16), "wide", _gen(f"T32-b16-fp32-wide-{fmt}"))
    codes, _, _ = tq.quantize_tokens_triton(wide, fmt, 16)
    if fmt == "fp8_e4m3":
        byte = codes.view(torch.uint8)
        assert ((byte & 0x78) == 0).logical_and((byte & 0x7) != 0).any(), "e4m3 subnormal codes"
        assert (byte == 0x80).any(), "-0.0 codes"
    _, scale, _ = tq.quantize_tokens_triton(_draw((1, 1, 32, 16), "subnormal", _gen("s")), fmt, 16)
    assert (scale < torch.finfo(torch.float32).tiny).all() and (scale > 0).all(), "subnormal scales"
    codes, scale, _ = tq.quantize_tokens_triton(_nonfinite(_gen("n")), fmt, 16)
    assert scale[1, 0, 16] == 1.0, "an all-non-finite block gets scale 1"
    if fmt == "int8":
        assert codes[1, 0, 16:32].eq(127).any() and codes[1, 0, 16:32].eq(-127).any(), "inf saturates"
        assert codes[1, 0, 16:32:3].eq(0).all(), "NaN codes are 0 (torch's int8 cast of the reference's NaN)"
    else:
        assert codes[1, 0, 16:32].float().isnan().any(), "NaN stays NaN in e4m3"


@cpu_kernels
def test_empty_positions():
    x = torch.zeros(1, 2, 0, 16)
    for smooth in (False, True):
        codes, scale, mean = tq.quantize_tokens_triton(x, "int8", 64, smooth)
        ref = quantize_tokens(x, "int8", 64, smooth)
        assert codes.shape == (1, 2, 0, 16) and scale.shape == (1, 2, 0)
        if smooth:
            torch.testing.assert_close(mean, ref.mean, rtol=0, atol=0, equal_nan=True)


@cpu_kernels
@pytest.mark.parametrize(
    ("shape", "dtype", "fmt", "block", "match"),
    [
        ((1, 1, 8, 24), torch.float32, "int8", 4, "head dim 24"),
        ((1, 1, 8, 256), torch.float32, "int8", 4, "head dim 256"),
        ((1, 1, 8, 8), torch.float32, "int8", 4, "head dim 8"),
        ((1, 8, 16), torch.float32, "int8", 4, "expected \\(batch, heads"),
        ((1, 1, 8, 16), torch.float64, "int8", 4, "dtype"),
        ((1, 1, 8, 16), torch.float32, "int4", 4, "fmt"),
        ((1, 1, 8, 16), torch.float32, "int8", 0, "block=0"),
        ((1, 1, 8, 16), torch.float32, "int8", True, "block=True"),
    ],
)
def test_rejects_bad_arguments(shape, dtype, fmt, block, match):
    with pytest.raises(DiffquantError, match=match):
        tq.quantize_tokens_triton(torch.zeros(shape, dtype=dtype), fmt, block)


@cpu_kernels
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DiffquantError, match="CUDA tensors"):
        tq.quantize_tokens_triton(torch.zeros(1, 1, 8, 16), "int8", 4)


# ------------------------------------------------------------------------------------------ V in fp8
VALUE_CASES = [
    # (id, builder(generator) -> v): V's per-(batch, channel) absmax spans heads and positions, so the cases
    # give different maxima per head, batch and channel, and tiles that end mid-way (T not a multiple of ROWS)
    ("B2-h3-T70-d64-fp32-fa3", lambda g: _draw((2, 3, 70, 64), "fa3", g)),
    (
        "B1-h2-T130-d128-bf16-transposed",
        lambda g: _draw((1, 130, 2, 128), "fa3", g).bfloat16().transpose(1, 2),
    ),
    ("B1-h1-T40-d256-fp16-wide", lambda g: _draw((1, 1, 40, 256), "wide", g).half()),
    ("B2-h1-T40-d16-nonfinite", lambda g: _nonfinite(g)),
    ("B1-h2-T48-d16-ties-zero-channel", lambda g: _symmetric("fp8_e4m3", g, 16).expand(1, 2, 48, 16).clone()),
    ("B1-h1-T32-d16-subnormal", lambda g: _draw((1, 1, 32, 16), "subnormal", g)),
]


@cpu_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_quantize_values_triton_matches_reference(case):
    """V's fp8 codes and per-(batch, channel) scales (two kernels: an atomic absmax, then the codes) equal
    ``reference.quantize_values(v, "fp8_e4m3")`` byte for byte, as the attention kernel receives them."""
    from diffquant.kernels.reference import quantize_values

    name, build = case
    v = build(_gen(name))
    if "zero-channel" in name:
        v[..., 3] = 0.0  # an all-zero channel: scale 1
    codes, scale = tq.quantize_values_triton(v)
    ref_codes, ref_scale = quantize_values(v, "fp8_e4m3")
    b, h, t, d = v.shape
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (b, h, t, d) and codes.is_contiguous(), name
    diff = codes.view(torch.uint8) != ref_codes.to(torch.float8_e4m3fn).view(torch.uint8)
    assert not diff.any(), (
        f"{name}: {int(diff.sum())} code bytes differ, first at {diff.nonzero()[0].tolist()}"
    )
    assert scale.shape == (b, d) and torch.equal(scale, ref_scale.reshape(b, d)), name
    if "zero-channel" in name:
        assert torch.equal(scale[:, 3], torch.ones(b)), "an all-zero channel gets scale 1"
    if "nonfinite" in name:
        assert codes.float().isnan().any() and codes.float().abs().eq(448).any(), "NaN kept, inf saturates"


@cpu_kernels
def test_quantize_values_triton_refuses_what_it_cannot_take():
    for shape, dtype, match in (
        ((1, 1, 8, 24), torch.float32, "value width 24"),
        ((1, 1, 8, 512), torch.float32, "value width 512"),
        ((1, 8, 16), torch.float32, "expected \\(batch, heads"),
        ((1, 1, 8, 16), torch.float64, "dtype"),
    ):
        with pytest.raises(DiffquantError, match=match):
            tq.quantize_values_triton(torch.zeros(shape, dtype=dtype))
    codes, scale = tq.quantize_values_triton(torch.zeros(2, 1, 0, 16))
    assert codes.shape == (2, 1, 0, 16) and torch.equal(scale, torch.ones(2, 16))


# ------------------------------------------------------------------------------------------ compiled code
_PTX_SCRIPT = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from diffquant.kernels import triton_quant as tq

fn = tq._quant_tokens_kernel
out = {}
for fmt, smooth, per_row in (("int8", True, False), ("fp8_e4m3", False, False), ("int8", True, True)):
    consts = {"D": 128, "ROWS": 64, "FMT": tq._FORMATS[fmt][0], "MAX_VALUE": tq._FORMATS[fmt][1],
              "SMOOTH": smooth, "SINGLE": True, "PER_ROW": per_row}
    ptrs = {"X": "*bf16", "MEAN": "*fp32", "CODES": "*i8" if fmt == "int8" else "*u8", "SCALE": "*fp32"}
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    out[fmt + ("-per-row" if per_row else "")] = {
        "div_rn": len(re.findall(r"\\bdiv\\.rn\\.f32\\b", ptx)),
        "div_other": len(re.findall(r"\\bdiv\\.(?:approx|full)", ptx)),
        "rne_constant": "0f4B400000" in ptx,
    }
for name in ("_values_absmax_kernel", "_values_quant_kernel"):
    fn = getattr(tq, name)
    consts = {"D": 128, "ROWS": 64}
    ptrs = {"X": "*bf16", "AMAX": "*i32", "CODES": "*u8", "SCALE": "*fp32"}
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    out[name] = {
        "div_rn": len(re.findall(r"\\bdiv\\.rn\\.f32\\b", ptx)),
        "div_other": len(re.findall(r"\\bdiv\\.(?:approx|full)", ptx)),
        "rne_constant": "0f4B400000" in ptx,
        "atomic_max": len(re.findall(r"\\batom\\.global\\.[a-z_.]*max\\.s32|\\bred\\.global\\.[a-z_.]*max\\.s32", ptx)),
    }
print(json.dumps(out))
"""


@pytest.mark.slow
def test_compiled_kernel_divides_in_ieee_fp32():
    """The interpreter's ``/`` on fp32 is numpy's IEEE division, so it cannot tell ``tl.div_rn`` from compiled
    Triton's approximate ``/``; the sm_90 code (compiled offline, no GPU needed) shows it: every division is
    ``div.rn.f32`` (per element and the scale), none ``div.full`` / ``div.approx``, and the RNE add survives;
    V's absmax pass is an atomic integer max on the fp32 bits."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=env)
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    absmax = got.pop("_values_absmax_kernel")  # V's first pass: only the atomic max, no division
    assert absmax["atomic_max"] > 0 and absmax["div_rn"] == absmax["div_other"] == 0, absmax
    assert set(got) == {"int8", "fp8_e4m3", "int8-per-row", "_values_quant_kernel"}
    for fmt, ptx in got.items():
        assert ptx["div_rn"] > 0 and ptx["div_other"] == 0 and ptx["rne_constant"], (fmt, ptx)


def test_the_quantizers_launch_only_their_kernels_a_mean_and_a_fill(monkeypatch):
    """The torch work around the Triton kernels, on a bf16 K and V: K's smoothing mean is one reduction that
    reads K as float32 (no float32 copy of K first: a cast kernel and a tensor-sized write on a GPU), and V's
    only fill is the absmax it accumulates into (its scale is written by the kernel). With the Q quantizer's
    launch and the attention kernel, a quantized call is 7 device operations, 5 of them Triton kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    launched = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(self.name)

    for name in ("_quant_tokens_kernel", "_values_absmax_kernel", "_values_quant_kernel"):
        monkeypatch.setattr(tq, name, Stub(name))

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) not in ("aten.view.dtype", "aten.detach.default"):  # views: no device work
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    with Record() as k_ops:
        tq.quantize_tokens_triton(x, "int8", 16, smooth=True)
    with Record() as v_ops:
        tq.quantize_values_triton(x)
    allocate = "aten.empty.memory_format"
    assert k_ops.ops == ["aten.mean.dim", allocate, allocate]
    assert v_ops.ops == [allocate, allocate, "aten.zeros.default"]
    assert launched == ["_quant_tokens_kernel", "_values_absmax_kernel", "_values_quant_kernel"]
