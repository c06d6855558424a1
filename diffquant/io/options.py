"""Where and in what precision a model runs: the ``--device`` / ``--dtype`` options and recipe keys.

One parser for both, so a typo reads the same from the command line and from a recipe.
"""

from __future__ import annotations

import torch

from diffquant.errors import DiffquantError
from diffquant.names import DTYPE_NAMES
from diffquant.options import ModelOptions  # noqa: F401 (torch-free there, for the CLI's parser; public here)

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
