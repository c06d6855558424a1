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
    ``tokenizer`` / ``stream`` and the command-line options ``--device`` / ``--dtype`` / ``--tokenizer`` /
    ``--stream`` (one place each). A recipe's ``tokenizer`` is a path for all models or ``{model: path}``;
    ``stream`` (``diffquant profile`` / ``eval`` and a recipe's profile / eval stages) runs models
    layer-streamed (:mod:`diffquant.stream`)."""

    device: str = key("cpu", help="cpu, cuda or cuda:N (default: cpu)")
    dtype: str | None = key(None, choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    tokenizer: str | dict[str, str] | None = key(
        None,
        metavar="PATH",
        help="'byte', a tokenizer.json or its folder; overrides the model's own tokenizer",
    )
    stream: Literal["off", "on", "auto"] | bool = key(
        "off",
        help="run models one decoder layer at a time from their safetensors files (larger than memory, same "
        "numbers): on, off, or auto (stream only models whose weights do not fit; said on stderr) "
        "(default: off; in a recipe also true / false)",
    )
