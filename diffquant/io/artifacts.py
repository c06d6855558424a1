"""Run-folder artifacts: atomic writes and the manifest that makes a run reproducible.

Every file is written to a temporary sibling and renamed into place, so a killed command never leaves a
half-written JSON behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError

LIBRARIES = ("torch", "numpy", "safetensors", "transformers", "optimum-quanto", "bitsandbytes", "triton")


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_json(path: str | Path, what: str = "file") -> Any:
    """Parsed JSON, or a one-line DiffquantError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DiffquantError(f"{path}: {what} not found") from None
    except UnicodeDecodeError:
        raise DiffquantError(f"{path}: {what} is not a text file") from None
    except json.JSONDecodeError as err:
        raise DiffquantError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except OSError as err:
        raise DiffquantError(f"{path}: cannot read {what} ({err.strerror})") from None


def jsonl_records(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed record) for each non-blank line of JSONL ``text``; a line that is not
    JSON is a one-line DiffquantError naming ``where:LINE``. Split on "\\n" only, not splitlines(): JSON
    strings may hold raw U+2028 and friends, which are not record separators."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DiffquantError(
                f"{where}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
            ) from None


def write_json_atomic(path: str | Path, data: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_sha256(spec: str | Path) -> str | None:
    """sha256 of the weights a model specifier names (a folder's model.safetensors, a GGUF file); None for
    models that are not files (init:, zoo: are versioned with the package)."""
    from diffquant.io import resolve_fetch

    text = resolve_fetch(spec)
    scheme, _, rest = text.partition(":")
    path = Path(rest if scheme in ("hf", "unilm", "gguf") and rest else text)
    if path.is_file():
        return sha256_file(path)
    weights = path / "model.safetensors"
    return sha256_file(weights) if weights.is_file() else None


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
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; give the folder the usual mode
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
