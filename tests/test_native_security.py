"""The native library is loaded only from folders nobody else can write, only when it is the file this user
compiled, never crashes the process, and never stalls a profile on a hung compiler (issue 44, items 1, 3, 5, 8).

Every load runs in a subprocess (a truncated library kills its process with SIGBUS: never the test runner's)
that imports ``diffquant/kernels/native.py`` alone, with a stub ``torch`` (the loader does not use torch; each
case then takes ~0.2 s instead of ~3 s). The hostile files are built here: a library compiled from the real
``_native.c`` plus a constructor that writes a marker file (proof that its code ran), a truncated copy of a
good library, a library without the entry points. One real compile serves every test; rebuilds use a
stand-in compiler that copies that library (a rebuild then costs a ``cp``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import diffquant

NATIVE_PY = Path(diffquant.__file__).parent / "kernels" / "native.py"
SOURCE = NATIVE_PY.with_name("_native.c")

# Loads native.py alone (stub torch), then calls dq_fake_int_rows of whatever library it loaded on two rows
# of four floats with qmax 7 (no ties: every x / scale is off a half).
LOADER = r"""
import ctypes, importlib.util, json, sys, types
sys.modules["torch"] = types.ModuleType("torch")
spec = importlib.util.spec_from_file_location("native_under_test", sys.argv[1])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
lib = native.library()
values = None
if lib is not None:
    x = (ctypes.c_float * 8)(1.0, 2.5, -3.0, 4.0, 0.5, -8.0, 0.0, 2.0)
    out = (ctypes.c_float * 8)()
    rc = lib.dq_fake_int_rows(ctypes.addressof(x), 2, 4, 7.0, ctypes.addressof(out), 1)
    values = [rc, *out]
print(json.dumps({"available": native.available(), "values": values}))
"""

# The fake quantization of LOADER's rows, computed here: scale = amax / 7, x / scale rounded, times scale.
S1, S2 = 4.0 / 7.0, 8.0 / 7.0
EXPECTED = [0, 2 * S1, 4 * S1, -5 * S1, 7 * S1, 0.0, -7 * S2, 0.0, 2 * S2]

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("DQ_MARKER");
    FILE *f = fopen(path ? path : "/dev/null", "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
"""

# A stand-in C compiler with a fixed path (the cache key includes it): copies the library the real compiler
# built to its -o argument; DQ_CC_HANG=before / after hangs before / after writing it (a compiler waiting on
# a lock; a compile about to be killed), its sleeping child's pid written to $DQ_CC_PID.
FAKE_CC = """#!/bin/sh
out=
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
[ "$DQ_CC_HANG" = before ] && { sleep 1000 & echo $! > "$DQ_CC_PID"; wait; }
cp "{good}" "$out"
[ "$DQ_CC_HANG" = after ] && { sleep 1000 & echo $! > "$DQ_CC_PID"; wait; }
exit 0
"""


@dataclass(frozen=True)
class Kit:
    root: Path
    good: Path  # the library the real compiler built (mode 0755, as a linker writes it)
    planted: Path  # the real source plus a constructor that writes $DQ_MARKER
    nosym: Path  # a library without the entry points
    cc: Path  # the stand-in compiler
    key: str  # the cache folder's name for the stand-in compiler
    real_cache: Path  # the cache the real compile filled


@dataclass(frozen=True)
class Loaded:
    rc: int
    available: bool | None
    values: list[float] | None
    notes: list[str]  # the non-empty stderr lines
    seconds: float


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _env(cache: Path, tmp: Path, cc: Path | str, marker: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFQUANT_", "DQ_"))}
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(DIFFQUANT_CACHE=str(cache), TMPDIR=str(tmp), CC=str(cc), OMP_WAIT_POLICY="PASSIVE", **extra)
    if marker is not None:
        env["DQ_MARKER"] = str(marker)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _start(env: dict[str, str], umask: int = -1) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LOADER, str(NATIVE_PY)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        umask=umask,
    )


def _kill_sleeper(pid_file: Path) -> None:
    """Kill the stand-in compiler's sleeping child if it still runs (a test that failed leaves no process)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text())
        if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x001000\x00":
            os.kill(pid, signal.SIGKILL)


def _load(env: dict[str, str], umask: int = -1, timeout: float = 20.0) -> Loaded:
    """Run LOADER; a run past ``timeout`` is killed (with its process group) and fails the test."""
    start = time.monotonic()
    proc = _start(env, umask)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        pytest.fail(f"the load did not return within {timeout} s")
    seconds = time.monotonic() - start
    answer = json.loads(out) if proc.returncode == 0 and out.strip() else {}
    notes = [line for line in err.splitlines() if line.strip()]
    return Loaded(proc.returncode, answer.get("available"), answer.get("values"), notes, seconds)


def _assert_works(loaded: Loaded) -> None:
    """The process lived and a working library (the rebuilt or privately compiled one) was used."""
    assert loaded.rc == 0, loaded
    assert loaded.available is True, loaded
    assert loaded.values is not None and loaded.values[0] == 0
    assert loaded.values[1:] == pytest.approx(EXPECTED[1:], rel=1e-6, abs=1e-7)


def _plant(folder: Path, library: Path, sidecar: str | None) -> Path:
    """``library`` as folder/libdqstats.so (0600, folders 0700), with ``sidecar`` as its recorded hash."""
    folder.mkdir(parents=True, exist_ok=True)  # 0755 under the usual umask: nobody else can write
    target = folder / "libdqstats.so"
    shutil.copyfile(library, target)
    target.chmod(0o600)
    if sidecar is not None:
        (folder / "libdqstats.so.sha256").write_text(f"{sidecar}  libdqstats.so\n")
    return target


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Kit:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    root = tmp_path_factory.mktemp("native-kit")
    real_cache = root / "real-cache"
    loaded = _load(_env(real_cache, root / "tmp", cc), timeout=120)
    _assert_works(loaded)
    assert loaded.notes == []
    (built,) = real_cache.glob("native/*/libdqstats.so")
    good = root / "good.so"
    shutil.copyfile(built, good)
    good.chmod(0o755)
    (root / "planted.c").write_text(PLANTED_C)
    (root / "nosym.c").write_text("int dq_something_else(void) { return 0; }\n")
    planted, nosym = root / "planted.so", root / "nosym.so"
    base = [cc, "-O0", "-fPIC", "-shared"]
    subprocess.run([*base, str(SOURCE), str(root / "planted.c"), "-o", str(planted), "-lm"], check=True)
    subprocess.run([*base, str(root / "nosym.c"), "-o", str(nosym)], check=True)
    # the marker mechanism works: loading the planted library writes it
    marker = root / "marker-proof"
    env = {**os.environ, "DQ_MARKER": str(marker)}
    subprocess.run(
        [sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", planted], env=env, check=True
    )
    assert marker.read_text() == "planted code ran\n"
    fake = root / "fake-cc"
    fake.write_text(FAKE_CC.replace("{good}", str(good)))
    fake.chmod(0o755)
    probe = root / "probe-cache"
    _assert_works(_load(_env(probe, root / "tmp", fake)))
    (key,) = [p.parent.name for p in probe.glob("native/*/libdqstats.so")]
    return Kit(root, good, planted, nosym, fake, key, real_cache)


def _case(kit: Kit, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(cache, the cache's library folder for the stand-in compiler, the marker path) of one test."""
    cache = tmp_path / "cache"
    return cache, cache / "native" / kit.key, tmp_path / "marker"


def _assert_one_note(loaded: Loaded, *words: str) -> None:
    assert len(loaded.notes) == 1, loaded.notes
    assert loaded.notes[0].startswith("diffquant: "), loaded.notes
    for word in words:
        assert word in loaded.notes[0], loaded.notes


# ---------------------------------------------------------------- what the real compile leaves
def test_a_real_compile_records_its_sha256_beside_a_private_library(kit):
    (folder,) = [p.parent for p in kit.real_cache.glob("native/*/libdqstats.so")]
    library = folder / "libdqstats.so"
    assert (folder / "libdqstats.so.sha256").read_text() == f"{_sha(library)}  libdqstats.so\n"
    assert sorted(p.name for p in folder.iterdir()) == ["libdqstats.so", "libdqstats.so.sha256"]
    assert stat.S_IMODE(library.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "libdqstats.so.sha256").stat().st_mode) == 0o600
    for f in (folder, folder.parent, kit.real_cache):
        assert stat.S_IMODE(f.stat().st_mode) == 0o700, f


def test_a_verified_cached_library_is_loaded_silently_and_not_rebuilt(kit, tmp_path):
    cache, folder, marker = _case(kit, tmp_path)
    target = _plant(folder, kit.good, _sha(kit.good))
    before = target.stat()
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    _assert_works(loaded)
    assert loaded.notes == []
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# ---------------------------------------------------------------- planted libraries never run
@pytest.mark.parametrize("sidecar", ["none", "the good library's"])
def test_a_planted_library_in_the_cache_is_not_loaded_but_rebuilt(kit, tmp_path, sidecar):
    cache, folder, marker = _case(kit, tmp_path)
    target = _plant(folder, kit.planted, None if sidecar == "none" else _sha(kit.good))
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    assert not marker.exists()
    _assert_works(loaded)
    _assert_one_note(loaded, str(target), "sha256", "rebuilt")
    assert target.read_bytes() == kit.good.read_bytes()
    assert (folder / "libdqstats.so.sha256").read_text() == f"{_sha(kit.good)}  libdqstats.so\n"


def test_nothing_is_loaded_from_the_shared_temporary_folder(kit, tmp_path):
    """The old fallback: a cache that cannot be created sent the loader to TMPDIR/diffquant/native/KEY, a
    folder any local user can create first. The planted library there even has a matching sidecar."""
    cache, _, marker = _case(kit, tmp_path)
    (tmp_path / "a-file").write_text("")
    tmp = tmp_path / "tmp"
    _plant(tmp / "diffquant" / "native" / kit.key, kit.planted, _sha(kit.planted))
    loaded = _load(_env(tmp_path / "a-file" / "cache", tmp, kit.cc, marker))
    assert not marker.exists()
    _assert_works(loaded)
    _assert_one_note(loaded, "Not a directory", "private temporary folder")
    assert [p.name for p in tmp.iterdir()] == ["diffquant"]  # the private folder is gone


@pytest.mark.parametrize("how", ["mode 0777", "mode 0770", "owned by uid 65534"])
def test_a_cache_folder_others_can_write_is_not_used(kit, tmp_path, how):
    """The attacker wrote the library and its sidecar: the folder's owner and mode refuse it."""
    cache, folder, marker = _case(kit, tmp_path)
    _plant(folder, kit.planted, _sha(kit.planted))
    if how.startswith("owned"):
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(folder, 65534, 65534)
        os.chown(folder / "libdqstats.so", 65534, 65534)
        words = (str(folder), "owned by uid 65534")
    else:
        (cache / "native").chmod(int(how[-4:], 8))
        words = (str(cache / "native"), f"writable by other users, {how}")
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    assert not marker.exists()
    _assert_works(loaded)
    _assert_one_note(loaded, *words, "private temporary folder")
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("sticky", [True, False])
def test_a_folder_above_the_cache_may_be_shared_only_when_sticky(kit, tmp_path, sticky):
    """/tmp-like parents (others can add entries but not rename ours) are fine; a plain shared one is not."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777 if sticky else 0o777)
    cache, marker = shared / "cache", tmp_path / "marker"
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    _assert_works(loaded)
    if sticky:
        assert loaded.notes == []
        assert (cache / "native" / kit.key / "libdqstats.so").read_bytes() == kit.good.read_bytes()
    else:
        _assert_one_note(loaded, str(shared), "mode 0777, not sticky", "private temporary folder")
        assert not cache.exists()  # nothing is created inside a folder others can rename


# ---------------------------------------------------------------- broken libraries never crash
def test_a_truncated_library_is_rebuilt_not_mapped(kit, tmp_path):
    """What a crash right after the first compile could leave: dlopen of it dies of SIGBUS."""
    cache, folder, marker = _case(kit, tmp_path)
    data = kit.good.read_bytes()
    (tmp_path / "half.so").write_bytes(data[: len(data) // 2])
    target = _plant(folder, tmp_path / "half.so", _sha(kit.good))
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    _assert_works(loaded)
    _assert_one_note(loaded, str(target), "sha256", "rebuilt")
    assert target.read_bytes() == data


def test_a_library_without_the_entry_points_is_rebuilt(kit, tmp_path):
    """Its recorded hash matches (only the symbol check can refuse it): no AttributeError traceback."""
    cache, folder, marker = _case(kit, tmp_path)
    target = _plant(folder, kit.nosym, _sha(kit.nosym))
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    _assert_works(loaded)
    _assert_one_note(loaded, str(target), "dq_pass1", "rebuilt")
    assert target.read_bytes() == kit.good.read_bytes()


# ---------------------------------------------------------------- modes, budget, litter
@pytest.mark.parametrize("umask", [0o000, 0o277], ids=["umask-000", "umask-277"])
def test_folders_are_0700_and_files_0600_under_any_umask(kit, tmp_path, umask):
    """0o000 would leave them open to everyone, 0o277 read-only for their owner: chmod, not the umask."""
    cache = tmp_path / "new" / "cache"
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc), umask=umask)
    _assert_works(loaded)
    assert loaded.notes == []
    folder = cache / "native" / kit.key
    for f in (tmp_path / "new", cache, cache / "native", folder):
        assert stat.S_IMODE(f.stat().st_mode) == 0o700, f
    for f in (folder / "libdqstats.so", folder / "libdqstats.so.sha256"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_hung_compiler_is_abandoned_within_the_budget(kit, tmp_path):
    cache, folder, marker = _case(kit, tmp_path)
    pid_file = tmp_path / "cc.pid"
    env = _env(cache, tmp_path / "tmp", kit.cc, marker, DIFFQUANT_NATIVE_BUDGET="1", DQ_CC_HANG="before")
    env["DQ_CC_PID"] = str(pid_file)
    try:
        loaded = _load(env)
        # the compiler's child was killed with its process group (a zombie at most, where nothing reaps it)
        pid = int(pid_file.read_text())
        with contextlib.suppress(FileNotFoundError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state in ("Z", "X"), state
    finally:
        _kill_sleeper(pid_file)
    assert loaded.rc == 0 and loaded.available is False and loaded.values is None
    assert loaded.seconds < 8, loaded.seconds
    _assert_one_note(
        loaded, str(kit.cc), "did not finish within 1 s", "DIFFQUANT_NATIVE_BUDGET", "torch path"
    )
    assert [p.name for p in folder.iterdir()] == []


def test_a_killed_compile_leaves_no_litter(kit, tmp_path):
    """The loader killed while its compiler runs (after it wrote its output): the next run removes the
    temporary, and an earlier version's ``tmpXXXXXXXX.so`` once it is an hour old."""
    cache, folder, marker = _case(kit, tmp_path)
    pid_file = tmp_path / "cc.pid"
    env = _env(cache, tmp_path / "tmp", kit.cc, marker, DQ_CC_HANG="after", DQ_CC_PID=str(pid_file))
    proc = _start(env)
    try:
        deadline = time.monotonic() + 15
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), "the stand-in compiler never ran"
    finally:
        _kill_group(proc)
        _kill_sleeper(pid_file)
    left = [p.name for p in folder.iterdir()]
    assert len(left) == 1 and left[0] != "libdqstats.so", left  # the killed compile's temporary
    old, young = folder / "tmpabcd1234.so", folder / "tmpwxyz9876.so"
    old.write_bytes(b"")
    young.write_bytes(b"")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    loaded = _load(_env(cache, tmp_path / "tmp", kit.cc, marker))
    _assert_works(loaded)
    assert loaded.notes == []
    assert sorted(p.name for p in folder.iterdir()) == ["libdqstats.so", "libdqstats.so.sha256", young.name]
