"""Where and in what precision a model runs: the ``--device`` / ``--dtype`` options and recipe keys.

One parser for both, so a typo reads the same from the command line and from a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from diffquant.errors import DiffquantError
from diffquant.names import DTYPE_NAMES
from diffquant.schema import key

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # float32, bfloat16, float16
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``float32`` / ``bfloat16`` / ``float16`` (or fp32 / bf16 / fp16); None keeps the checkpoint's dtype."""
    if name is None:
        return None
    key = _ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise DiffquantError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


def parse_device(name: str | None) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against what this machine has before any model is read."""
    if name is None:
        return "cpu"
    text = str(name)
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DiffquantError(f"device {text!r}: CUDA is not available on this machine (use --device cpu)")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise DiffquantError(
                f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return text
    raise DiffquantError(f"device {text!r}: expected cpu, cuda or cuda:N")


@dataclass(kw_only=True)
class ModelOptions:
    """Where and how models run, and which tokenizer they read: the recipe keys ``device`` / ``dtype`` /
    ``tokenizer`` / ``stream`` / ``device_map`` / ``max_memory`` and the command-line options ``--device`` /
    ``--dtype`` / ``--tokenizer`` / ``--stream`` / ``--device-map`` / ``--max-memory`` (one place each). A
    recipe's ``tokenizer`` is a path for all models or ``{model: path}``; ``stream`` (``diffquant profile`` /
    ``quantize`` / ``eval`` and a recipe's profile / quantize / eval stages) runs models layer-streamed (:mod:`diffquant.stream`);
    ``device_map`` spreads each model over several devices (:mod:`diffquant.stream.placement`), checked
    with the other options by :func:`~diffquant.stream.placement.placement_options`."""

    device: str = key("cpu", help="cpu, cuda or cuda:N (default: cpu)")
    dtype: str | None = key(None, choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    tokenizer: str | dict[str, str] | None = key(
        None,
        metavar="PATH",
        help="'byte', a tokenizer.json or its folder; overrides the model's own tokenizer",
    )
    stream: Literal["off", "on", "auto"] | bool = key(
        "off",
        help="run models one decoder layer at a time from their files (native, hf:, gguf:; larger than memory, "
        "same numbers): on, off, or auto (stream only models whose weights do not fit; said on stderr) "
        "(default: off; in a recipe also true / false)",
    )
    device_map: str | dict[str, str | int] | None = key(
        None,
        metavar="MAP",
        help="spread each model over devices through accelerate (hf: and native safetensors checkpoints): "
        "auto, balanced or sequential (fill the GPUs, then cpu, then disk), or a YAML / JSON mapping (or "
        "file) of modules to devices, e.g. '{embed: 0, layers.0: 0, layers.1: 1, norm: 1, lm_head: 1}' "
        "(modules: embed, layers, layers.N, norm, lm_head, '' for the rest; devices: cpu, disk, cuda:N or N); "
        "not with --stream, --device stays cpu (default: one device, --device)",
    )
    max_memory: str | dict[str, str | int] | None = key(
        None,
        metavar="LIMITS",
        help="with --device-map auto / balanced / sequential: the memory each device may hold, accelerate's "
        "format, e.g. 0=20GiB,1=20GiB,cpu=60GiB (default: what is free)",
    )
