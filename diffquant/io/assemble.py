"""Building a native DecoderLM from any converter's tensors: every source tensor checked (names, shapes,
dtypes) from the headers, then read, re-laid out, cast and assigned once on a meta-device model, so a
checkpoint is never held twice. Shared by the Hugging Face, unilm and GGUF converters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import DecoderLM
from diffquant.progress import progress as show_progress

# Floating dtypes the native model computes in; anything else (int8 / fp8 quantized weights) it cannot hold.
FLOAT_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}
_DTYPE_BY_TAG = {tag: dtype for dtype, tag in FLOAT_DTYPES.items()}
# Tensors older transformers versions saved that the native model recomputes (RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Transform = Callable[[torch.Tensor], torch.Tensor]


def check_layer_count(n_layers: int, keys: Iterable[str], pattern: str, source: str) -> None:
    r"""The config's layer count must be the number of layers the weights hold, checked from the tensor
    names alone, before anything is built: a config that says a billion layers would otherwise allocate a
    billion modules (even on the meta device) before any shape check could fail. ``pattern`` is a regex
    whose group 1 is the layer index (``r"model\.layers\.(\d+)\."``)."""
    regex = re.compile(pattern)
    found = {int(m.group(1)) for key in keys if (m := regex.match(key))}
    # More layers in the file than in the config is left to the key check, which names the extra tensors.
    if n_layers > len(found):
        held = f"layers 0..{max(found)}" if found and len(found) == max(found) + 1 else f"{len(found)} layers"
        raise DiffquantError(f"{source}: the config says {n_layers} layers, the weights hold {held}")


def check_float_dtype(dtype: torch.dtype | None, what: str) -> None:
    """Refuse dtypes the native model cannot compute in (integer, bool, fp8, complex)."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise DiffquantError(
            f"{what} {dtype}: expected a floating dtype the model can hold "
            f"({', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)})"
        )


def assemble(
    config: ModelConfig,
    source: Any,  # a safetensors_source.TensorSource, a GGUF's tensors: keys, file, shape, dtype_tag, get
    key_map: dict[str, str],
    transforms: dict[str, Transform],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    optional: frozenset[str] = frozenset(),
    desc: str = "load",
) -> DecoderLM:
    """Build ``config`` on the meta device and assign each source tensor (re-laid out, cast) in place.
    ``desc`` names the step in progress lines (``load FILE.gguf: dequantize``).

    ``key_map`` maps native keys to source keys; every source tensor must be used, except RoPE buffers and
    the source keys in ``optional`` (e.g. an untied LM head in a tied checkpoint). Keys, shapes and dtypes
    are all checked from the file headers before a single tensor is read, so a bad file costs nothing.
    """
    check_float_dtype(dtype, "requested dtype")
    with torch.device("meta"):
        model = DecoderLM(config)
    dtype = check_source(model, source, key_map, dtype, optional)
    state: dict[str, torch.Tensor] = {}
    # Reading (and for GGUF dequantizing) a large checkpoint takes a while: a line every progress interval
    # once it runs past one (the heartbeat speaks during one long tensor too).
    for native, src in show_progress(list(key_map.items()), desc, "tensor"):
        tensor = source.get(src)
        if native in transforms:
            tensor = transforms[native](tensor)
        state[native] = tensor.to(device=device, dtype=dtype).contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:  # a key map that misses a parameter is a bug in the converter, not a user error
        raise AssertionError(f"converter left parameters unassigned: {left}")
    return model.eval()


def check_source(
    model: DecoderLM,
    source: Any,
    key_map: dict[str, str],
    dtype: torch.dtype | None = None,
    optional: frozenset[str] = frozenset(),
) -> torch.dtype:
    """Check ``source`` against ``model`` (a meta-device skeleton) from the file headers alone: every
    tensor of ``key_map`` present, none left over (but RoPE buffers and ``optional``), shapes and floating
    dtypes; one-line DiffquantErrors. Returns the dtype to compute in (``dtype``, else the embedding's).
    Shared by :func:`assemble` and the layer-streamed run (:mod:`diffquant.stream`), which materialises
    the tensors one layer at a time."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    available = set(source.keys())
    missing = [src for native, src in key_map.items() if src not in available]
    if missing:
        extra = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DiffquantError(
            f"{_where(source)}: missing tensor {missing[0]}{extra} (expected by the config for a "
            f"{model.config.attention} model)"
        )
    used = set(key_map.values())
    unexpected = sorted(
        k for k in available - used if not k.endswith(_IGNORED_SUFFIXES) and k not in optional
    )
    if unexpected:
        raise DiffquantError(
            f"{source.file(unexpected[0])}: unexpected tensor {unexpected[0]}"
            + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
            + f" (the native {model.config.attention} model has no place for it)"
        )
    for native, src in key_map.items():
        got, want = source.shape(src), expected[native]
        if got != want:
            raise DiffquantError(
                f"{source.file(src)}: tensor {src} has shape {list(got)}, expected {list(want)} from the config"
            )
        tag = source.dtype_tag(src)
        if tag not in _DTYPE_BY_TAG:
            raise DiffquantError(
                f"{source.file(src)}: tensor {src} has dtype {tag}, expected a floating dtype the model can "
                f"hold ({', '.join(_DTYPE_BY_TAG)}); quantized checkpoints are not supported"
            )
    if dtype is None:
        dtype = _DTYPE_BY_TAG[source.dtype_tag(key_map["embed.weight"])]
    return dtype


def _where(source: Any) -> str:
    files = sorted({str(source.file(k)) for k in source.keys()})  # noqa: SIM118 (a method, not a dict)
    return files[0] if len(files) == 1 else f"{Path(files[0]).parent} (shards)"
