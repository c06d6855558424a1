"""The native CPU passes: `_native.c`, compiled on first use and called through ctypes.

Every-site profiling spends most of its time in SiteStats.update, whose torch path makes a dozen
tensor-sized passes per update (extremes, magnitudes, bit codes, bincount, float64 row sums, centred powers,
top-k masks ...), each one cheap but each a trip through memory. The C file does the same work in two
traversals (see its header comment for what each pass computes and why its float64 results do not depend
on the thread count). It is compiled once per machine into the diffquant cache
(``$DIFFQUANT_CACHE/native/<hash>/``, ``~/.cache/diffquant`` by default) with the C compiler found as ``$CC``
or ``cc`` (OpenMP when the compiler has it) and loaded with ctypes: no build step at install time, no Python
headers, no torch headers. Where no compiler works the profiler keeps its torch path, which stays the
reference (``DIFFQUANT_NATIVE=0`` selects it). Counts, extremes, the histogram, abs-max and the
located entries are the torch path's bit for bit; moments are float64 sums in another order (tested to
1e-12 against a float64 reference, and within the torch path's documented 1e-6).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["available", "fake_int_rows", "map_rows", "pass1", "pass2", "row_ranges"]

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
# Tried in order: this CPU's vector instructions and OpenMP threads, then without each. The results do not
# depend on which one compiled (no fast-math, no contraction: vector code computes the written lanes).
_VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
ENABLED = os.environ.get("DIFFQUANT_NATIVE", "1") != "0"

_i64, _int, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p


def _cache_dir() -> Path:
    """The diffquant cache (as io.fetch.cache_root, which lives in a layer above this one)."""
    if os.environ.get("DIFFQUANT_CACHE"):
        return Path(os.environ["DIFFQUANT_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "diffquant"
    return Path.home() / ".cache" / "diffquant"


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (part of the cache key, so a cache
    folder shared by machines never serves one CPU's instructions to another)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _compile(cc: str, target: Path, extra: tuple[str, ...]) -> bool:
    """Compile the source into ``target`` (written under a temporary name, then renamed: concurrent
    processes never load a half-written library)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *_FLAGS, *extra, str(_SOURCE), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp, target)
            return True
    except (OSError, subprocess.SubprocessError):
        pass
    Path(tmp).unlink(missing_ok=True)
    return False


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not _SOURCE.exists():
        return None
    key = repr((cc, _FLAGS, _VARIANTS, sys.platform, _cpu())).encode()
    key = hashlib.sha256(_SOURCE.read_bytes() + key).hexdigest()[:16]
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / "diffquant"):
        target = root / "native" / key / "libdqstats.so"
        try:
            if not target.exists() and not any(_compile(cc, target, extra) for extra in _VARIANTS):
                return None
            return _declare(ctypes.CDLL(str(target)))
        except OSError:
            continue  # an unwritable cache: try the temporary folder
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.dq_pass1.restype = _int
    lib.dq_pass1.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _i64, _ptr, _i64, _ptr, _ptr]
    lib.dq_pass1.argtypes += [_ptr, _ptr, _ptr, _ptr, _int]
    lib.dq_pass2.restype = _int
    lib.dq_pass2.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _i64, _ptr, _ptr, _ptr, _ptr]
    lib.dq_pass2.argtypes += [_ptr, _ptr, _int]
    lib.dq_pass2.argtypes += [_f32, _ptr, _i64, _int, _ptr, _i64, _ptr, _int]
    lib.dq_map_rows.restype = _int
    lib.dq_map_rows.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _int, _ptr, _int]
    lib.dq_fake_int_rows.restype = _int
    lib.dq_fake_int_rows.argtypes = [_ptr, _i64, _i64, _f32, _ptr, _int]
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, built on the first call (None: disabled, or no working C compiler)."""
    global _LIB, _TRIED
    if not ENABLED:
        return None
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            _LIB = _build()
    return _LIB


def available() -> bool:
    return library() is not None


def row_ranges(mask: torch.Tensor) -> torch.Tensor | None:
    """(T, 2) int64 [first, last + 1) of each row's True entries of the (T, S) ``mask`` when every row's are
    one run ([0, 0) for a row with none), else None: the columns a map chunk's rows are read in place from
    (a causal mask, with or without a sliding window, is one run per query)."""
    m = mask.to(torch.int8)
    count = m.sum(-1, dtype=torch.int64)
    first = m.argmax(-1)
    last = mask.shape[-1] - m.flip(-1).argmax(-1)
    if not bool(((last - first == count) | (count == 0)).all()):
        return None
    first = torch.where(count > 0, first, 0)
    return torch.stack([first, first + count], -1).contiguous()


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeError(RuntimeError):
    """The native pass could not allocate its buffers (the caller uses the torch path)."""


def pass1(
    x: torch.Tensor,
    width: int,
    keep: tuple[int, int, int, int] | None,
    k_of_m: torch.Tensor,
    slots: int,
    ranges: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, float, int, int, int]:
    """(dense histogram (2 * slots,), float64 row sums, float64 values counted per row, float32 abs-max per
    kept index or None, min, max, #|x| >= 6, #|x| >= 100, #NaN / Inf) of contiguous float32 ``x`` seen as
    rows of ``width``; NaN / Inf are counted and left out of everything else. ``keep`` = (inner, groups,
    percol, n_keep): the kept index of row r, column c is g * width + c (percol) or g, with
    g = (r // inner) % groups. ``ranges`` (T, 2) int64: row r holds values only in columns
    ranges[r % T, 0] .. ranges[r % T, 1] - 1 (None: all)."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous()
    rows = x.numel() // width
    inner, groups, percol, nkeep = keep if keep is not None else (1, 1, 0, 0)
    dense = torch.zeros(2 * slots, dtype=torch.int64)
    row_sum = torch.empty(rows, dtype=torch.float64)
    row_count = torch.empty(rows, dtype=torch.float64)
    absmax = torch.zeros(nkeep, dtype=torch.float32) if keep is not None else None
    ext = torch.empty(2, dtype=torch.float64)
    counts = torch.zeros(3, dtype=torch.int64)
    period = 1 if ranges is None else ranges.shape[0]
    rc = lib.dq_pass1(
        x.data_ptr(), rows, width, _p(ranges), period, inner, groups, percol, nkeep, k_of_m.data_ptr(), slots,
        dense.data_ptr(), row_sum.data_ptr(), row_count.data_ptr(), _p(absmax), ext.data_ptr(),
        counts.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc < 0:
        raise NativeError("out of memory")
    lo, hi = ext.tolist()
    ge6, ge100, nonfinite = counts.tolist()
    return dense, row_sum, row_count, absmax, lo, hi, ge6, ge100, nonfinite


def pass2(
    x: torch.Tensor,
    width: int,
    keep: tuple[int, int, int, int] | None,
    row_sum: torch.Tensor,
    row_count: torch.Tensor,
    squares: str | None,
    bar: float | None,
    top_cap: int,
    massive_cap: int | None,
    ranges: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(M2, M3, M4 per row (float64 central power sums), per-kept-index float64 sum of squares (``squares``
    = "float32" / "float64": the dtype each square is taken in; None: not computed), the flat indices of
    |x| >= ``bar`` in increasing order (None when there are more than ``top_cap``, or no bar), those of
    |x| > 100 (searched when ``massive_cap``, at least their number, is given; else empty)); ``ranges`` as
    for :func:`pass1` (then no sums of squares)."""
    lib = library()
    assert lib is not None
    rows = x.numel() // width
    inner, groups, percol, nkeep = keep if keep is not None else (1, 1, 0, 0)
    m2, m3, m4 = (torch.empty(rows, dtype=torch.float64) for _ in range(3))
    sumsq = torch.empty(nkeep, dtype=torch.float64) if squares is not None else None
    top = torch.empty(top_cap if bar is not None else 0, dtype=torch.int64)
    massive = torch.empty(massive_cap or 0, dtype=torch.int64)
    found = torch.zeros(2, dtype=torch.int64)
    period = 1 if ranges is None else ranges.shape[0]
    rc = lib.dq_pass2(
        x.data_ptr(), rows, width, _p(ranges), period, inner, groups, percol, nkeep, row_sum.data_ptr(),
        row_count.data_ptr(), m2.data_ptr(), m3.data_ptr(), m4.data_ptr(), _p(sumsq), int(squares == "float64"),
        float("inf") if bar is None else bar, top.data_ptr(), top.numel(), int(massive_cap is not None),
        massive.data_ptr(), massive.numel(), found.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc < 0:
        raise NativeError("out of memory")
    n_top, n_massive = found.tolist()
    if n_massive > massive.numel():
        raise NativeError(f"{n_massive} entries > 100 for {massive.numel()} slots")  # cannot happen
    top_idx = top[:n_top] if bar is not None and n_top <= top_cap else None
    return m2, m3, m4, sumsq, top_idx, massive[:n_massive]


def map_rows(x: torch.Tensor, ranges: torch.Tensor, differential: bool) -> torch.Tensor | None:
    """Per-row float64 sums of a float32 attention map (..., T, S) read in place, its rows' visible keys from
    ``ranges`` (T, 2): columns (sum or entropy, value at key 0, sum |D|, sum min(D, 0)); the entropy
    -sum p log p for a softmax map, the signed sum for a ``differential`` one. None when a visible value is
    NaN / Inf (or negative in a softmax map)."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous()
    width = x.shape[-1]
    rows = x.numel() // width
    out = torch.empty(rows, 4, dtype=torch.float64)
    rc = lib.dq_map_rows(
        x.data_ptr(), rows, width, ranges.data_ptr(), ranges.shape[0], int(differential), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else out.view(*x.shape[:-1], 4)


def fake_int_rows(x: torch.Tensor, qmax: float) -> torch.Tensor | None:
    """Symmetric dynamic int fake quantization of contiguous float32 ``x`` with one fp32 scale per row of
    its last dim (amax / qmax, 1 where 0), as the torch fast path computes it bit for bit; None when ``x``
    holds a NaN / Inf."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous()
    width = x.shape[-1]
    out = torch.empty_like(x)
    rc = lib.dq_fake_int_rows(
        x.data_ptr(), x.numel() // width, width, qmax, out.data_ptr(), torch.get_num_threads()
    )
    return None if rc else out
