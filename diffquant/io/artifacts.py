"""Run-folder artifacts: atomic writes and the manifest that makes a run reproducible.

Every file is written to a temporary sibling and renamed into place, so a killed command never leaves a
half-written JSON behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from diffquant.errors import DiffquantError
from diffquant.io import fetch
from diffquant.io.fetch import FETCHABLE, resolve_fetch
from diffquant.names import (  # noqa: F401 (MODEL_FORMS: public here too)
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_FORMS,
    PLAN_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
)
from diffquant.textfiles import (  # noqa: F401 (moved down for data, profile, quant)
    _umask,
    jsonl_records,
    read_json,
    write_json_atomic,
    write_text_atomic,
)
from diffquant.zoo import zoo_path

LIBRARIES = ("torch", "numpy", "safetensors", "transformers", "optimum-quanto", "bitsandbytes", "triton")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


FILE_SCHEMES = ("hf", "unilm", "gguf")  # specifiers whose rest is a path: hf:FOLDER, unilm:FOLDER, gguf:FILE


def spec_path(spec: str | Path) -> Path:
    """The file or folder a model specifier reads (``hf:X`` -> X, a bare folder -> itself); not meaningful
    for ``init:`` / ``zoo:`` / ``fetch:``, which callers handle first."""
    text = str(spec)
    scheme, _, rest = text.partition(":")
    return Path(rest if scheme in FILE_SCHEMES and rest else text)


def checkpoint_sha256(spec: str | Path) -> str | None:
    """sha256 of the weights a model specifier names: a folder's model.safetensors, a GGUF file, a zoo
    model's shipped model.safetensors; None for ``init:`` models (seeded, versioned with the package) and
    for paths that hold no weights file.

    ``fetch:NAME`` never downloads just to hash: a cached file is hashed (what a run will read); one not
    cached yet gives the sha256 the fetch pins and verifies on extraction (what it will read once fetched).
    """
    text = str(spec)
    if text.startswith("fetch:"):
        return _fetched_sha256(text)
    if text.startswith("zoo:"):
        weights = zoo_path(text[len("zoo:") :]) / WEIGHTS_FILE
        return sha256_file(weights) if weights.is_file() else None
    path = spec_path(resolve_fetch(spec))
    if path.is_file():
        return sha256_file(path)
    weights = path / WEIGHTS_FILE
    return sha256_file(weights) if weights.is_file() else None


def _fetch_cache_file(name: str) -> tuple[Path, int, str] | None:
    """(cache path, pinned size, pinned sha256) of ``fetch:NAME``, found without downloading; None for a
    fetchable name this module does not know the cache layout of."""
    if name == "smollm2":
        path = fetch.cache_root() / "smollm2" / fetch.SMOLLM2_FILE
        return path, fetch.SMOLLM2_SIZE, fetch.SMOLLM2_SHA256
    if name == "gemma3-270m":
        path = fetch.cache_root() / "gemma3-270m" / fetch.GEMMA3_FILE
        return path, fetch.GEMMA3_SIZE, fetch.GEMMA3_SHA256
    return None


def _fetched_sha256(spec: str) -> str | None:
    name = spec[len("fetch:") :]
    if name not in FETCHABLE:
        resolve_fetch(spec)  # the one-line error naming the fetchable models
    known = _fetch_cache_file(name)
    if known is None:
        return None
    path, size, pinned = known
    # fetch treats a cached file of another size as absent and downloads the pinned one again
    return sha256_file(path) if path.is_file() and path.stat().st_size == size else pinned


# Files of a checkpoint folder that decide what a loaded model computes: every *.safetensors (weights, HF
# shards, quantization state) and *.gguf, plus these (config, tokenizer, shard index, quantization plan).
MODEL_FOLDER_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    "tokenizer.model",
    INDEX_FILE,
    PLAN_FILE,
)


def model_content_sha256(spec: str | Path) -> str:
    """sha256 naming what a model specifier loads, for keying results by content rather than by path.

    ``init:KIND:PRESET[:SEED]`` is keyed by the specifier itself (deterministic); ``zoo:NAME`` by its
    shipped folder; ``fetch:NAME`` by :func:`checkpoint_sha256` (no download); ``gguf:FILE`` by the file;
    a folder (native, quantized, ``hf:``, ``unilm:``) by the sha256 of each file in MODEL_FOLDER_FILES,
    ``*.safetensors`` and ``*.gguf`` directly inside it. Files are streamed, never read whole. A path that
    does not exist is a one-line DiffquantError.
    """
    text = str(spec)
    scheme, _, rest = text.partition(":")
    if scheme == "init":
        return _digest({"init": text})
    if scheme == "fetch":
        return _digest({"fetch": text, "sha256": checkpoint_sha256(text)})
    path = zoo_path(rest) if scheme == "zoo" else spec_path(text)
    if path.is_file():
        return _digest({path.name: sha256_file(path)})
    if not path.is_dir():
        raise DiffquantError(f"model {text!r}: {path} is neither a checkpoint folder nor a file")
    files = sorted(
        p
        for p in path.iterdir()
        if p.is_file() and (p.name in MODEL_FOLDER_FILES or p.suffix in (".safetensors", ".gguf"))
    )
    return _digest({p.name: sha256_file(p) for p in files})


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("diffquant", *LIBRARIES):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def manifest(command: str, **fields: Any) -> dict[str, Any]:
    """What ran, with which versions, on which inputs: the first file of every run folder."""
    return {
        "command": command,
        "argv": sys.argv,
        "versions": library_versions(),
        "platform": platform.platform(),
        **fields,
    }


def write_folder_atomic(out_dir: str | Path, write: Callable[[Path], None], overwrite: bool) -> Path:
    """Fill a temporary sibling folder with ``write`` and rename it to ``out_dir``, so an interrupted
    export never leaves a half-written folder; an existing folder is replaced only with ``overwrite``."""
    path = Path(out_dir)
    if path.exists() and not overwrite:
        raise DiffquantError(f"{path}: already exists (pass overwrite / --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _fill(tmp, path, write)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; give the folder the usual mode
        for file in tmp.rglob("*"):  # safetensors writes 0600; every file gets the usual mode too
            if file.is_file() and not file.is_symlink():
                os.chmod(file, 0o666 & ~_umask())
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:  # --force over a file (or a link): remove it too, leave nothing behind
                old.unlink(missing_ok=True)
        else:
            tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _fill(tmp: Path, path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, with a full disk (or a file-size limit, a read-only file system, a quota) refused in one
    line naming the file as it would have been called in ``path``: the writers of every checkpoint (save,
    quantize, export, the streamed quantize) share this, so none of them ends in safetensors' own traceback.
    The caller removes ``tmp``, so nothing half-written stays."""
    try:
        write(tmp)
    except OSError as err:
        if err.errno not in _DISK_ERRNOS:
            raise
        where = _final_name(err.filename, tmp, path)
        raise DiffquantError(f"{where}: {err.strerror or err} (nothing was written)") from None
    # (safetensors' own error type never reaches here: every writer saves through save_tensors, which turns
    # its I/O error into the OSError above, naming the file)


# No space, file too large (RLIMIT_FSIZE), quota exceeded, read-only file system, input/output error.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO})


def save_tensors(tensors: dict[str, Any], file: Path) -> None:
    """``safetensors.torch.save_file`` (format "pt"), whose I/O error (a full disk) becomes the OSError
    naming ``file`` that :func:`write_folder_atomic` turns into one line: every checkpoint writer saves its
    tensors through here."""
    from safetensors.torch import save_file  # noqa: PLC0415 (torch, not needed by the rest of this module)

    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except SafetensorError as err:
        raise tensor_write_error(err, file) from None


def tensor_write_error(err: SafetensorError, file: Path) -> BaseException:
    """safetensors' error while writing ``file`` as the OSError it stands for (its reason, errno and the file
    it was writing), so that :func:`write_folder_atomic` names the file; an error that is not an I/O error
    (a bug, not the disk) is returned as it is."""
    text = str(err)
    if "I/O error: " not in text:
        return err
    reason = text.rpartition("I/O error: ")[2]
    code = reason.rpartition("(os error ")[2].rstrip(")")
    return OSError(int(code) if code.isdigit() else errno.EIO, reason, str(file))


def _final_name(filename: Any, tmp: Path, path: Path) -> Path:
    """A file in the temporary folder by the name it would have had in ``path`` (the folder when unnamed)."""
    if filename is None:
        return path
    try:
        return path / Path(os.fsdecode(filename)).relative_to(tmp)
    except ValueError:
        return Path(os.fsdecode(filename))
