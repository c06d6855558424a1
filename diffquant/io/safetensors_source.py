"""Checkpoint folders of safetensors weights, read lazily: ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, behind one :class:`TensorSource` (names, shapes and dtypes from the
file headers; a tensor is read only on ``get``). Shared by the Hugging Face and unilm converters.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def open_tensors(folder: Path, device: str | torch.device = "cpu") -> Iterator[TensorSource]:
    """Open ``model.safetensors`` or every shard named by ``model.safetensors.index.json``, lazily."""
    source = TensorSource()
    with contextlib.ExitStack() as stack:
        single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
        if single.is_file():
            source.add(_open(stack, single, device), single)
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
                handle = _open(stack, file, device)
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


def _open(stack: contextlib.ExitStack, file: Path, device: str | torch.device) -> Any:
    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device=str(device)))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise DiffquantError(f"{file}: not a readable safetensors file ({err})") from None
