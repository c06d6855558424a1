"""Checkpoint folders of safetensors weights, read lazily: ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, behind one :class:`TensorSource` (names, shapes and dtypes from the
file headers; a tensor is read only on ``get``). Shared by the Hugging Face and unilm converters.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json
from diffquant.names import INDEX_FILE, WEIGHTS_FILE


def checkpoint_folder(path: str | Path) -> Path:
    """``path`` as a folder, or a one-line DiffquantError (not found, or not a folder)."""
    folder = Path(path)
    if not folder.is_dir():
        what = "not found" if not folder.exists() else "not a folder"
        raise DiffquantError(f"{folder}: checkpoint folder {what}")
    return folder


class TensorSource:
    """The tensors of one or more open safetensors files, read on demand (header-only until ``get``)."""

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}  # key -> safe_open handle
        self._files: dict[str, Path] = {}  # key -> file (for messages)

    def add(self, handle: Any, file: Path, keys: list[str] | None = None) -> None:
        for key in handle.keys() if keys is None else keys:
            self._handles[key] = handle
            self._files[key] = file

    def keys(self) -> list[str]:
        return list(self._handles)

    def file(self, key: str) -> Path:
        return self._files[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[key].get_slice(key).get_shape())

    def dtype_tag(self, key: str) -> str:
        return self._handles[key].get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handles[key].get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise DiffquantError(f"{self._files[key]}: tensor {key} is unreadable ({err})") from None


class _Header:
    """A safetensors file's header, parsed without mapping the file: what a :class:`TensorSource` asks of
    an open handle (keys, shapes, dtypes). A process under an address-space limit (``ulimit -v``) cannot
    map every shard of a checkpoint larger than the limit at once, but it can read their headers."""

    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            with open(file, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                size = file.stat().st_size
                if n > min(size - 8, 100 * 2**20):
                    raise ValueError(f"header length {n} does not fit the file's {size} bytes")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise DiffquantError(f"{file}: not a readable safetensors file ({err})") from None
        if not isinstance(header, dict):
            raise DiffquantError(f"{file}: not a readable safetensors file (header is not an object)")
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = (
                    entry["dtype"],
                    tuple(int(d) for d in entry["shape"]),
                    entry["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise DiffquantError(f"{file}: tensor {key}: malformed header entry") from None
            if not 0 <= start <= end <= size - 8 - n:
                raise DiffquantError(
                    f"{file}: tensor {key} ends at byte {8 + n + end}, past the file's {size} bytes (truncated?)"
                )
            self.entries[key] = (str(dtype), shape)

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, key: str) -> _Header._Slice:
        return _Header._Slice(*self.entries[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        # Mapped for this one read only (see the class docstring).
        with safe_open(str(self.file), framework="pt", device="cpu") as handle:
            return handle.get_tensor(key)

    class _Slice:
        def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
            self._dtype, self._shape = dtype, shape

        def get_dtype(self) -> str:
            return self._dtype

        def get_shape(self) -> list[int]:
            return list(self._shape)


@contextlib.contextmanager
def open_tensors(
    folder: Path, device: str | torch.device = "cpu", *, headers_only: bool = False
) -> Iterator[TensorSource]:
    """Open ``model.safetensors`` or every shard named by ``model.safetensors.index.json``, lazily.
    ``headers_only``: parse the headers and map no file (each ``get`` maps its file for that read; what a
    layer-streamed run needs, holding only one layer of a checkpoint larger than its address space)."""
    source = TensorSource()
    with contextlib.ExitStack() as stack:
        single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
        if single.is_file():
            source.add(_open(stack, single, device, headers_only), single)
        elif index.is_file():
            meta = read_json(index)
            weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise DiffquantError(f"{index}: expected a non-empty 'weight_map' object (tensor -> shard)")
            by_shard: dict[str, list[str]] = {}
            for key, shard in weight_map.items():
                by_shard.setdefault(str(shard), []).append(key)
            for shard, keys in sorted(by_shard.items()):
                file = folder / shard
                # A shard is a file name inside the folder: an index must not read weights from elsewhere.
                if Path(shard).name != shard or shard in ("", ".", ".."):
                    raise DiffquantError(
                        f"{index}: shard {shard!r} is not a file name inside {folder} (it holds {keys[0]})"
                    )
                if not file.is_file():
                    raise DiffquantError(
                        f"{index}: shard {shard} is missing from {folder} (it holds {keys[0]} and "
                        f"{len(keys) - 1} more tensors)"
                    )
                handle = _open(stack, file, device, headers_only)
                absent = sorted(set(keys) - set(handle.keys()))
                if absent:
                    raise DiffquantError(
                        f"{file}: tensor {absent[0]} listed in {INDEX_FILE} is not in the shard"
                    )
                source.add(handle, file, keys)
        else:
            raise DiffquantError(
                f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
            )
        yield source


def _open(stack: contextlib.ExitStack, file: Path, device: str | torch.device, headers_only: bool) -> Any:
    if headers_only:
        return _Header(file)
    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device=str(device)))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise DiffquantError(f"{file}: not a readable safetensors file ({err})") from None
