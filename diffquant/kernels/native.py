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

Loading a shared library runs its code (constructors run inside ``dlopen``), so a library is loaded only
when nobody but this user could have written it, and only when it is the very file this user compiled:

- the folders: the cache root, ``native`` and ``native/<hash>`` must be real folders owned by this user and
  not writable by group or others; every folder above the cache root must be owned by this user or root and
  not writable by group or others unless it has the sticky bit (as ``/tmp``: others may add entries there
  but cannot rename or remove ours). This is OpenSSH's StrictModes rule for ``~/.ssh`` with the sticky-folder
  exception, checked on the resolved path (what the loader opens, symbolic links followed); folders this
  module creates are made 0700 and files 0600 whatever the umask;
- the file: a regular file owned by this user, not writable by others, whose sha256 equals the one recorded
  in ``libdqstats.so.sha256`` beside it by the process that compiled it (written after the library, both
  fsynced before their atomic renames: a library without its sidecar is one a crash interrupted); the hash
  is computed from the open file and that same open file is what ``dlopen`` maps (``/proc/self/fd``);
- after ``dlopen``, the four entry points must be defined.

A cached library that fails a check is rebuilt; a cache folder that fails one is not used at all: the
library is compiled into a private ``mkdtemp`` folder (removed as soon as it is loaded) instead. Never the
shared temporary folder, where anyone can create the folder first. All compiler variants share one budget
(``DIFFQUANT_NATIVE_BUDGET`` seconds, default 60; the compiler's whole process group is killed when it runs
out); when nothing compiles the torch path runs. Each of these detours says so in one line on stderr, once
per process. A compiler that is not there at all is the documented torch path and says nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from diffquant import progress
from diffquant.textfiles import process_alive

__all__ = ["available", "fake_int_rows", "map_rows", "pass1", "pass2", "row_ranges"]

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
# Tried in order: this CPU's vector instructions and OpenMP threads, then without each. The results do not
# depend on which one compiled (no fast-math, no contraction: vector code computes the written lanes).
_VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())
_NAME = "libdqstats.so"
_SIDECAR = _NAME + ".sha256"
_SYMBOLS = ("dq_pass1", "dq_pass2", "dq_map_rows", "dq_fake_int_rows")
BUDGET_ENV = "DIFFQUANT_NATIVE_BUDGET"
BUDGET = 60.0  # seconds for all compiler variants together
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", platform.node()) or "host"
# A compile in progress writes `.libdqstats.so.HOST.PID.tmp` (and `.libdqstats.so.sha256.HOST.PID.tmp`): a
# process killed mid-compile leaves one that the next run on this host removes once PID is gone. The
# `tmpXXXXXXXX.so` of earlier versions are removed an hour after they were last written.
_TEMP = re.compile(r"\.libdqstats\.so(?:\.sha256)?\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.tmp")
_LEGACY_TEMP = re.compile(r"tmp[a-z0-9_]{8}\.so")
_PROC_FD = Path("/proc/self/fd")
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_NOTED = False
ENABLED = os.environ.get("DIFFQUANT_NATIVE", "1") != "0"

_i64, _int, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p


class _Untrusted(Exception):
    """A folder or file that must not be loaded from (the message says why, in a few words)."""


class _CompileFailed(Exception):
    """No variant compiled within the budget: the torch path runs (the message says why)."""


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


def _key(cc: str) -> str:
    """The cache folder's name: the source, the compiler, the flags and the CPU."""
    key = repr((cc, _FLAGS, _VARIANTS, sys.platform, _cpu())).encode()
    return hashlib.sha256(_SOURCE.read_bytes() + key).hexdigest()[:16]


def _budget() -> float:
    """Seconds all compiler variants share: ``$DIFFQUANT_NATIVE_BUDGET`` if a number > 0, else
    :data:`BUDGET` (a malformed value must not stop a profile)."""
    try:
        value = float(os.environ.get(BUDGET_ENV, ""))
    except ValueError:
        return BUDGET
    return value if 0 < value < float("inf") else BUDGET


def _note(line: str) -> None:
    """One line on stderr, at most once per process (above any progress bar)."""
    global _NOTED
    if not _NOTED:
        _NOTED = True
        progress.write(f"diffquant: {line}")


# ---------------------------------------------------------------- who could have written a folder or file
def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _check_mine(st: os.stat_result, what: Path) -> None:
    """A folder of the cache chain or the library: owned by this user, not writable by group or others."""
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"{what} is owned by uid {st.st_uid}, not by this user, uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{what} is writable by other users, mode {_mode(st)}")


def _check_above(folder: Path) -> None:
    """A folder above the cache root: owned by this user or root; writable by others only when sticky (as
    /tmp: nobody else can then rename or remove the entries this user owns in it)."""
    st = os.stat(folder)
    if st.st_uid not in (os.geteuid(), 0):
        raise _Untrusted(f"{folder} is owned by uid {st.st_uid}, neither this user nor root")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _Untrusted(f"{folder} is writable by other users, mode {_mode(st)}, not sticky")


def _mkdir(folder: Path) -> None:
    """Create ``folder`` 0700 whatever the umask (a folder that exists keeps its mode: it is checked)."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return
    os.chmod(folder, 0o700)


def _check_folder(folder: Path) -> None:
    """A folder of the cache chain: a real folder (not a symbolic link), owned by this user, closed to others."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise _Untrusted(f"{folder} is not a folder")
    _check_mine(st, folder)


def _folder(root: Path, parts: tuple[str, ...]) -> Path:
    """``root / parts``, created where missing (0700) and checked folder by folder (see the module
    docstring); the resolved path. Raises _Untrusted, or OSError when it cannot be created."""
    root = Path(os.path.abspath(root))
    missing, probe = [], root
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if missing:  # nothing is created inside a folder others could rename or replace
        probe = Path(os.path.realpath(probe))
        for above in (*reversed(probe.parents), probe):
            _check_above(above)
    for folder in reversed(missing):
        _mkdir(folder)
    folder = Path(os.path.realpath(root))
    for above in reversed(folder.parents):
        _check_above(above)
    _check_folder(folder)
    for part in parts:
        folder = folder / part
        _mkdir(folder)
        _check_folder(folder)
    return folder


# ---------------------------------------------------------------- the library file
def _open_mine(path: Path) -> int:
    """A read-only descriptor of ``path``, a regular file (never followed through a symbolic link, never a
    FIFO that would block) owned by this user and not writable by others."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted(f"{path} is not a regular file")
        _check_mine(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _recorded(folder: Path) -> str:
    """The sha256 the compiling process recorded beside the library (``HEX  libdqstats.so``, as sha256sum
    writes it)."""
    try:
        fd = _open_mine(folder / _SIDECAR)
    except FileNotFoundError:
        raise _Untrusted("no sha256 sidecar beside it") from None
    except OSError as err:
        raise _Untrusted(f"its sha256 sidecar is unreadable: {err.strerror}") from None
    try:
        text = os.read(fd, 256).decode("ascii", "replace")
    finally:
        os.close(fd)
    found = re.fullmatch(r"([0-9a-f]{64})  " + re.escape(_NAME) + r"\n", text)
    if found is None:
        raise _Untrusted("its sha256 sidecar is malformed")
    return found.group(1)


def _dlclose(lib: ctypes.CDLL) -> None:
    """Unload a library that failed a check, so a rebuilt one at the same name is loaded afresh."""
    import _ctypes  # noqa: PLC0415 (ctypes' private module, only on this rare path)

    with contextlib.suppress(AttributeError, OSError):
        _ctypes.dlclose(lib._handle)


def _dlopen(fd: int, path: Path) -> ctypes.CDLL:
    """Load the checked open file itself (``/proc/self/fd/N`` where there is one: nothing can swap the file
    between its hash and dlopen), then require the entry points."""
    lib = ctypes.CDLL(str(_PROC_FD / str(fd)) if _PROC_FD.is_dir() else str(path))
    missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
    if missing:
        _dlclose(lib)
        raise _Untrusted(f"it does not define {', '.join(missing)}")
    return _declare(lib)


def _load_verified(folder: Path) -> ctypes.CDLL:
    """The cached library, when it passes every check (raises _Untrusted / OSError why not)."""
    expected = _recorded(folder)
    fd = _open_mine(folder / _NAME)
    try:
        if _sha256(fd) != expected:
            raise _Untrusted("its sha256 differs from the one recorded beside it")
        return _dlopen(fd, folder / _NAME)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- compiling
def _compiler() -> str | None:
    """``$CC`` (it may carry words: ``ccache gcc``), else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _argv(cc: str) -> list[str]:
    try:
        return shlex.split(cc) or [cc]
    except ValueError:
        return [cc]


def _run(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, None when the budget ran out; the compiler's first error line). The compiler runs in
    its own session and its whole process group is killed on timeout (cc1, as, ld, a ccache or a wrapper's
    children); its output goes to a file, not a pipe a surviving grandchild could hold open."""
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as err:
            return 127, f"{cmd[0]}: {err.strerror}"
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.returncode is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        lines = [line.strip() for line in log.read(1 << 16).decode("utf-8", "replace").splitlines()]
    errors = [line for line in lines if "error" in line.lower()] or [line for line in lines if line]
    return code, (errors[0][:200] if errors else f"exit status {code}")


def _compile(cc: str, out: Path, deadline: float) -> None:
    """Compile the source into ``out``, trying each variant in turn until one compiles or the shared
    budget runs out (raises _CompileFailed)."""
    why = "no variant compiled"
    for extra in _VARIANTS:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        code, why = _run([*_argv(cc), *_FLAGS, *extra, str(_SOURCE), "-o", str(out), "-lm"], left)
        if code is None:
            break
        if code == 0 and out.is_file():
            return
        if code == 0:
            why = "it wrote no library"
    else:
        raise _CompileFailed(f"the C compiler {cc} failed: {why}")
    raise _CompileFailed(f"the C compiler {cc} did not finish within {_budget():g} s ({BUDGET_ENV})")


def _write_sidecar(folder: Path, digest: str) -> None:
    """``libdqstats.so.sha256``, 0600, fsynced, then renamed into place (after the library's rename)."""
    tmp = folder / f".{_SIDECAR}.{_HOST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{digest}  {_NAME}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, folder / _SIDECAR)


def _fsync_folder(folder: Path) -> None:
    """Make the renames durable (best effort: some file systems refuse to fsync a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_stale(folder: Path) -> None:
    """Remove what killed compiles left: this host's temporaries of processes that are gone, and the
    ``tmpXXXXXXXX.so`` of earlier versions an hour after their last write."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            temp = _TEMP.fullmatch(entry.name)
            if temp is not None:
                stale = temp["host"] == _HOST and not process_alive(int(temp["pid"]))
            else:
                stale = bool(_LEGACY_TEMP.fullmatch(entry.name)) and _older(entry, 3600)
            if stale:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _older(entry: os.DirEntry, seconds: float) -> bool:
    with contextlib.suppress(OSError):
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > seconds
    return False


def _install(cc: str, folder: Path, deadline: float) -> ctypes.CDLL:
    """Compile into a temporary name in ``folder`` (0600, fsynced), hash it, rename it to libdqstats.so,
    record the hash beside it and load the file this process compiled."""
    tmp = folder / f".{_NAME}.{_HOST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        _compile(cc, tmp, deadline)
        os.chmod(tmp, 0o600)
        fd = _open_mine(tmp)
        try:
            os.fsync(fd)
            digest = _sha256(fd)
            os.replace(tmp, folder / _NAME)
            _write_sidecar(folder, digest)
            _fsync_folder(folder)
            return _dlopen(fd, folder / _NAME)
        finally:
            os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)


def _from_cache(cc: str, deadline: float, why: list[str]) -> ctypes.CDLL | None:
    """The cached library, or a fresh one built into the cache; None when the cache cannot serve (the
    reason appended to ``why``). Raises _CompileFailed."""
    try:
        folder = _folder(_cache_dir(), ("native", _key(cc)))
    except (_Untrusted, OSError) as bad:
        why.append(f"the native library's cache folder is not used ({_reason(bad)})")
        return None
    _remove_stale(folder)
    if os.path.lexists(folder / _NAME):
        try:
            return _load_verified(folder)
        except (_Untrusted, OSError) as bad:
            why.append(f"{folder / _NAME} was not loaded ({_reason(bad)})")
    try:
        return _install(cc, folder, deadline)
    except (_Untrusted, OSError) as bad:
        why.append(f"the native library could not be built in {folder} ({_reason(bad)})")
        return None


def _from_private(cc: str, deadline: float) -> ctypes.CDLL:
    """Compile into a fresh private folder (mkdtemp: 0700, a new name) and remove it once loaded (the
    mapping outlives the file). Raises _Untrusted / _CompileFailed."""
    tmp = tempfile.mkdtemp(prefix="diffquant-native-")
    try:
        return _install(cc, _folder(Path(tmp), ()), deadline)
    except (_Untrusted, OSError) as bad:
        raise _Untrusted(f"a private temporary folder failed too ({_reason(bad)})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _build() -> ctypes.CDLL | None:
    """The library from the cache, else compiled privately, else None (the torch path); any detour is
    said in one line."""
    cc = _compiler()
    if cc is None or not _SOURCE.exists():
        return None
    why: list[str] = []
    deadline = time.monotonic() + _budget()
    lib: ctypes.CDLL | None = None
    try:
        lib = _from_cache(cc, deadline, why)
        outcome = "rebuilt"
        if lib is None:
            lib = _from_private(cc, deadline)
            outcome = "compiled into a private temporary folder instead"
    except (_Untrusted, _CompileFailed) as failed:
        why.append(str(failed))
        outcome = "the profiler uses its torch path (DIFFQUANT_NATIVE=0 skips the native library)"
    if why:
        _note("; ".join(why) + ": " + outcome)
    return lib


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
