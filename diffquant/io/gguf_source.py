"""A llama.cpp GGUF file as the source of a layer-streamed run (:mod:`diffquant.stream`).

A streamed run reads one stage's weights at a time (the embedding, one decoder layer, the head), so it
needs the file's config, tokenizer, key map and re-layouts up front, with nothing dequantized, and then
each tensor on demand. :func:`read_gguf_checkpoint` gives the former from the header alone, through the
same functions :func:`~diffquant.io.convert_gguf.load_gguf` uses (:func:`~diffquant.io.convert_gguf.
read_gguf_model`, :func:`~diffquant.io.convert_gguf.gguf_key_map`, :func:`~diffquant.io.convert_gguf.
gguf_transforms`), so a file the whole-model load refuses is refused here with the same line, and the
same file gives the same model.

:meth:`GGUFCheckpoint.open` gives the tensors as :class:`~diffquant.io.convert_gguf.GGUFTensors`: ``get``
reads one tensor's byte range with plain reads of a file it opens for that tensor only, dequantizes a chunk
of rows at a time into the target dtype and closes the file. Nothing is memory-mapped and no handle is held
between stages, so a stage's file pages never count in the process's resident set (they stay in the page
cache, which the kernel reclaims), and the run's peak is one stage's dequantized weights. Dequantizing into
the dtype ``load_model('gguf:...', dtype=...)`` uses (float32 for ``dtype=None``) and applying the same
Q/K un-permutation makes every streamed weight bit-identical to the whole-model one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from diffquant.data.tokenizer import HFTokenizer
from diffquant.io.assemble import Transform, check_float_dtype
from diffquant.io.convert_gguf import (
    GGUFFile,
    GGUFTensors,
    gguf_key_map,
    gguf_tensors,
    gguf_transforms,
    metadata,
    read_gguf_model,
)
from diffquant.models.config import ModelConfig

# What ``load_model('gguf:...')`` dequantizes into when no dtype is asked for (a quantized file has no
# floating dtype of its own to keep).
DEFAULT_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF read for streaming: its header (tensor table; the tokenizer metadata dropped once the
    tokenizer is built), config, tokenizer, key map (native key -> GGUF tensor name) and re-layouts."""

    file: Path
    header: GGUFFile
    config: ModelConfig
    tokenizer: HFTokenizer
    key_map: dict[str, str]
    transforms: dict[str, Transform]

    def file_bytes(self) -> int:
        """Bytes of every tensor's data in the file: the quantized blocks (what is read from disk)."""
        return sum(t.n_bytes for t in self.header.tensors)

    def memory_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes the model's weights take dequantized into ``dtype`` (None: float32, as the whole-model load
        gives): what a whole-model load holds, and the sum of what the stages of a streamed run hold one at
        a time. A tied LM head shares the embedding and is counted once."""
        check_float_dtype(dtype, "requested dtype")
        size = torch.empty((), dtype=dtype or DEFAULT_DTYPE).element_size()
        by_name = {t.name: t for t in self.header.tensors}
        return sum(by_name[name].n_elements * size for name in self.key_map.values() if name in by_name)

    @contextlib.contextmanager
    def open(self, dtype: torch.dtype | None = None) -> Iterator[GGUFTensors]:
        """The file's tensors, each dequantized into ``dtype`` (None: float32) on ``get``, after the checks
        that need no data (layer count, dequantizable types). There is nothing to close: every ``get`` opens
        and closes the file itself, so no pages outlive the tensor being read."""
        yield gguf_tensors(self.header, self.file, self.config, dtype or DEFAULT_DTYPE)


def read_gguf_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """The GGUF file at ``path`` as a :class:`GGUFCheckpoint`, from its header alone (no tensor read); a
    file the whole-model load would refuse (missing, truncated, overlapping or misaligned tensor data, a
    block_count the tensors do not hold, not llama, tokenizer too large) is the same one-line
    DiffquantError naming the file, raised before the per-layer key map is built."""
    file = Path(path)
    header, config, tokenizer = read_gguf_model(file)
    transforms = gguf_transforms(config, metadata(header, "general.architecture"))
    return GGUFCheckpoint(file, header, config, tokenizer, gguf_key_map(config), transforms)


__all__ = ["DEFAULT_DTYPE", "GGUFCheckpoint", "read_gguf_checkpoint"]
