"""Entry points that route converter specifiers and the ``export`` command.

Kept free of heavy imports at module level: ``diffquant.cli`` builds its parser from this module, and
``diffquant --help`` must stay instant, so torch and the converters load inside the functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import FILE_SCHEMES

if TYPE_CHECKING:
    import torch

    from diffquant.models.transformer import DecoderLM

CONVERTER_SCHEMES = FILE_SCHEMES
EXPORT_FORMATS = ("hf",)


def load_converted(
    spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """``hf:PATH`` (a local HF Llama / DiffLlama / Qwen2 / Qwen3 / Mistral / Gemma 3 text folder) or
    ``unilm:PATH`` (the unilm layout documented in :mod:`diffquant.io.convert_unilm`) as a native DecoderLM
    in eval mode."""
    text = str(spec)
    scheme, _, path = text.partition(":")
    if scheme not in CONVERTER_SCHEMES or not path:
        raise DiffquantError(
            f"model specifier {text!r}: expected {' or '.join(s + ':PATH' for s in CONVERTER_SCHEMES)}"
        )
    if scheme == "hf":
        from diffquant.io.convert_hf import load_hf

        return load_hf(path, device=device, dtype=dtype)
    if scheme == "gguf":
        from diffquant.io.convert_gguf import load_gguf

        return load_gguf(path, device=device, dtype=dtype)
    from diffquant.io.convert_unilm import load_unilm

    return load_unilm(path, device=device, dtype=dtype)


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``diffquant export MODEL --to hf OUT [--force]``."""
    export = subparsers.add_parser(
        "export",
        help="write a model in another format (baseline -> HF llama, diff_v1 -> HF diffllama)",
        description="Load MODEL (a native folder, zoo:NAME, init:KIND:PRESET[:SEED], hf:PATH or unilm:PATH) "
        "and write it as a Hugging Face folder that transformers' from_pretrained reads. A DIFF V1 per-head "
        "norm weight is folded into o_proj; DIFF V2 has no HF format.",
    )
    export.add_argument("model", metavar="MODEL", help="model specifier")
    export.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="target format")
    export.add_argument("out", metavar="OUT", help="output folder")
    export.add_argument("--force", action="store_true", help="replace an existing output folder")
    export.set_defaults(func=cmd_export)
    return export


def cmd_export(args: argparse.Namespace) -> int:
    """Load ``args.model`` with diffquant.io.load_model and export it; errors are DiffquantErrors."""
    from diffquant.io import load_model
    from diffquant.io.convert_hf import export_hf

    if args.to not in EXPORT_FORMATS:
        raise DiffquantError(f"--to {args.to!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    model = load_model(args.model)
    out = export_hf(model, args.out, overwrite=args.force)
    target = "diffllama" if model.config.attention == "diff_v1" else "llama"
    print(
        f"wrote {out}: HF {target} ({model.config.attention}), {model.num_parameters():,} parameters, "
        f"{str(model.embed.weight.dtype).removeprefix('torch.')}"
    )
    return 0
