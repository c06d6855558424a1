"""``diffquant act-scales MODEL --out FILE.pt``: SmoothQuant activation scales of a model, as a .pt file.

The file is what SmoothQuant's ``generate_act_scales.py`` writes (Xiao et al. 2023): ``torch.save`` of a
dict module name -> fp32 1-D tensor, the abs-max of each Linear's input per input channel over the text
(see :mod:`diffquant.quant.smoothquant`). Keys are Hugging Face module names for hf: / gguf: / fetch:
models and native names otherwise (``--names`` overrides). Loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from diffquant.cli_options import add_model_options as _add_model_options
from diffquant.cli_options import check_positive as _positive
from diffquant.cli_options import load_for_args as _load
from diffquant.errors import DiffquantError
from diffquant.names import MODEL_FORMS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``diffquant act-scales`` (its handler is :func:`run`)."""

    parser = subparsers.add_parser(
        "act-scales",
        help="SmoothQuant activation scales (per-input-channel abs-max of every Linear) as a .pt file",
        description="Profile every Linear input over calibration text and write SmoothQuant's act_scales: "
        "torch.save of {module name: fp32 per-input-channel abs-max}, keyed by Hugging Face module names for "
        "hf: / gguf: / fetch: models and by native names otherwise.",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"the model: {MODEL_FORMS}",
    )
    parser.add_argument("--out", required=True, metavar="FILE.pt", help="output file")
    parser.add_argument(
        "--data",
        default=None,
        help="text source (default: the calibration text, wikitext2:validation when the model has its own "
        "tokenizer, else stdlib:train)",
    )
    parser.add_argument("--tokens", type=int, default=16384, help="tokens to read (default: 16384)")
    parser.add_argument("--seq-len", type=int, default=256, help="window length (default: 256)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default: 8)")
    parser.add_argument(
        "--names",
        choices=("hf", "native"),
        default=None,
        help="module names of the keys (default: hf for hf: / gguf: / fetch: models, else native)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    _add_model_options(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from diffquant.data import token_windows
    from diffquant.eval.tasks import default_text
    from diffquant.profile.runner import check_profile
    from diffquant.quant.smoothquant import collect_act_scales, default_names

    _positive(args, "tokens", "seq_len", "batch_size")
    out = Path(args.out)
    if out.is_dir():
        raise DiffquantError(f"{out}: is a folder; --out names the .pt file to write")
    if out.exists() and not args.force:
        raise DiffquantError(f"{out}: already exists (pass --force to replace it)")
    names = args.names or default_names(args.model)
    model = _load(args, args.model)
    tokenizer = check_profile({"model": (args.model, model)}, args.seq_len, args.data, "kind:linear_in")[
        "model"
    ]
    data = args.data or default_text([tokenizer], "calib")
    windows = token_windows(data, args.tokens, args.seq_len, tokenizer)
    scales = collect_act_scales(
        model, windows, batch_size=args.batch_size, names=names, progress=sys.stderr.isatty()
    )
    save_atomic(scales, out)
    top_name, top = max(((n, v.max().item()) for n, v in scales.items()), key=lambda item: item[1])
    print(
        f"wrote {out}: act-scales of {len(scales)} Linears ({names} names) over {windows.numel():,} tokens of "
        f"{data} ({tokenizer.describe()}); largest {top:.4g} at {top_name}"
    )
    return 0


def save_atomic(obj: object, path: Path) -> Path:
    """``torch.save`` to a temporary sibling, renamed into place: a killed run leaves no partial file."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
