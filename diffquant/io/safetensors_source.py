"""Checkpoint folders of safetensors weights, read lazily: ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, behind one :class:`TensorSource` (names, shapes and dtypes from the
file headers; a tensor is read only on ``get``). Shared by the Hugging Face and unilm converters.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

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

    def read(self, keys: list[str], when: str = "") -> dict[str, torch.Tensor]:
        """The tensors ``keys``, each file opened once for all of its keys. From a header-only source
        (:func:`open_tensors` ``headers_only``) each tensor's bytes are read at its offset into a tensor of
        its own, with nothing mapped; a file gone, cut short or rewritten since its header was read is one
        line naming it (``when``: words for the message, e.g. " in the middle of the run")."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self._files[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for names in by_file.values():
            handle = self._handles[names[0]]
            if isinstance(handle, _Header):
                out.update(handle.read(names, when))
            else:
                out.update((key, self.get(key)) for key in names)
        return out


# safetensors' dtype tags, as torch dtypes (a tensor's bytes are read as these, little-endian)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Header:
    """A safetensors file's header, parsed without mapping the file: what a :class:`TensorSource` asks of
    an open handle (keys, shapes, dtypes), and the tensors read by offset (:meth:`read`).

    A process under an address-space limit (``ulimit -v``) cannot map every shard of a checkpoint larger
    than the limit at once, nor even one shard of a checkpoint whose shards are each as large as what the
    limit leaves once torch is imported (a 1B model's 500 MB shards under 2.5 GB): a streamed run reads
    only the bytes of the tensors of the stage it runs, into tensors of their own. Each entry's byte range
    is checked against the file's size and against its dtype and shape, so a read never goes astray."""

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
                raw = f.read(n)
                header = json.loads(raw)  # at most 100 MiB; too deep a nesting is a RecursionError
        except RecursionError:  # JSON nested deeper than Python's recursion limit
            raise DiffquantError(
                f"{file}: not a readable safetensors file (its header nests too deep)"
            ) from None
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise DiffquantError(f"{file}: not a readable safetensors file ({err})") from None
        if not isinstance(header, dict):
            raise DiffquantError(f"{file}: not a readable safetensors file (header is not an object)")
        self.head = head + raw  # compared before each read: the file must still be the one parsed
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.ranges: dict[str, tuple[int, int]] = {}  # key -> (first byte, end) in the file
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = (
                    entry["dtype"],
                    tuple(int(d) for d in entry["shape"]),
                    entry["data_offsets"],
                )
                start, end = int(start), int(end)
            except (KeyError, TypeError, ValueError):
                raise DiffquantError(f"{file}: tensor {key}: malformed header entry") from None
            if not 0 <= start <= end <= size - 8 - n:
                raise DiffquantError(
                    f"{file}: tensor {key} ends at byte {8 + n + end}, past the file's {size} bytes (truncated?)"
                )
            _check_extent(file, key, str(dtype), shape, end - start)
            self.entries[key] = (str(dtype), shape)
            self.ranges[key] = (8 + n + start, 8 + n + end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, key: str) -> _Header._Slice:
        return _Header._Slice(*self.entries[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.read([key])[key]

    def read(self, keys: list[str], when: str = "") -> dict[str, torch.Tensor]:
        """The tensors ``keys``, their bytes read at their offsets through one unbuffered handle (nothing
        mapped, nothing copied twice); the file must still start with the header parsed, and hold every
        byte, else a one-line DiffquantError naming it."""
        if sys.byteorder != "little" or any(self.entries[k][0] not in _DTYPES for k in keys):
            return self._mapped(keys)  # a dtype torch reads only through safetensors (or a big-endian host)
        out: dict[str, torch.Tensor] = {}
        try:
            with open(self.file, "rb", buffering=0) as f:
                if _read_exactly(f, 0, len(self.head)) != self.head:
                    raise OSError(0, "its header changed since the run began (the file was replaced)")
                for key in keys:
                    dtype, shape = self.entries[key]
                    start, end = self.ranges[key]
                    data = torch.empty(end - start, dtype=torch.uint8)
                    _read_into(f, start, data)
                    out[key] = data.view(_DTYPES[dtype]).reshape(shape)
        except OSError as err:
            raise DiffquantError(f"{self.file}: shard unreadable{when} ({err.strerror or err})") from None
        return out

    def _mapped(self, keys: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(self.file), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in keys}

    class _Slice:
        def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
            self._dtype, self._shape = dtype, shape

        def get_dtype(self) -> str:
            return self._dtype

        def get_shape(self) -> list[int]:
            return list(self._shape)


def _check_extent(file: Path, key: str, dtype: str, shape: tuple[int, ...], n_bytes: int) -> None:
    """A tensor's byte range must hold exactly its shape in its dtype (what safetensors checks when it maps
    a file; a header-only reader checks it itself, before reading by offset)."""
    if any(d < 0 for d in shape):
        raise DiffquantError(f"{file}: tensor {key}: malformed header entry (shape {list(shape)})")
    if dtype not in _DTYPES:  # read through safetensors, which checks it
        return
    want = math.prod(shape) * _DTYPES[dtype].itemsize
    if n_bytes != want:
        raise DiffquantError(
            f"{file}: tensor {key}: its byte range holds {n_bytes} bytes, but shape {list(shape)} of {dtype} "
            f"needs {want}"
        )


def _read_exactly(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = bytearray(n)
    _fill(f, memoryview(data), offset)
    return bytes(data)


def _read_into(f: BinaryIO, offset: int, data: torch.Tensor) -> None:
    f.seek(offset)
    _fill(f, memoryview(data.numpy()).cast("B"), offset)


def _fill(f: BinaryIO, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``f`` (a read may return fewer bytes than asked: loop); the end of the file before
    the view is full is an OSError saying where."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise OSError(0, f"it ends at byte {offset + done}, inside a tensor's data (cut short?)")
        done += got


@contextlib.contextmanager
def open_tensors(
    folder: Path, device: str | torch.device = "cpu", *, headers_only: bool = False
) -> Iterator[TensorSource]:
    """Open ``model.safetensors`` or every shard named by ``model.safetensors.index.json``, lazily.
    ``headers_only``: parse the headers and map no file (each ``get`` / ``read`` reads its tensors' bytes
    at their offsets; what a layer-streamed run needs, holding only one layer of a checkpoint larger than
    its address space)."""
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
