"""Reading and writing models and run artifacts: native checkpoints, converters (Hugging Face, GGUF, unilm),
quantized checkpoints, fetched checkpoints, run folders.

The package imports nothing heavy itself (PEP 562 lazy attributes): ``diffquant --help`` and the argument
parsers import ``diffquant.io.fetch`` / ``diffquant.io.artifacts`` without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "check_model_spec": "diffquant.io.load",
    "init_model": "diffquant.io.load",
    "load_model": "diffquant.io.load",
    "peek_config": "diffquant.io.load",
    "peek_tokenizer": "diffquant.io.load",
    "resolve_fetch": "diffquant.io.load",
    "save_quantized": "diffquant.io.load",
    "KNOWN_SCHEMES": "diffquant.io.load",
    "load_checkpoint": "diffquant.io.checkpoint",
    "read_config": "diffquant.io.checkpoint",
    "save_checkpoint": "diffquant.io.checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diffquant.io' has no attribute {name!r}")
