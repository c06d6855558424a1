"""Command-line option helpers shared by the ``diffquant`` commands (cli.py) and the sub-commands defined in
their own modules (act_scales_cli.py), so neither imports the other. Importing it does not import torch
(the help must stay instant): the model loading imports happen inside :func:`load_for_args`.
"""

from __future__ import annotations

import argparse

from diffquant.errors import DiffquantError


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise DiffquantError(
                f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}"
            )


def run_options_for(args: argparse.Namespace):
    """The command's ``--device`` / ``--dtype`` parsed, once (a :class:`diffquant.io.options.RunOptions`;
    cpu and the checkpoint's dtype where the command has no such option)."""
    from diffquant.io.options import run_options

    return run_options(getattr(args, "device", None), getattr(args, "dtype", None))


def load_for_args(args: argparse.Namespace, spec: str, options=None):
    """A model on ``--device`` in ``--dtype`` with ``--tokenizer`` (where the command has those options);
    ``options``: the command's :func:`run_options_for`, when it has parsed them already."""
    from diffquant.io import load_model

    options = options or run_options_for(args)
    return load_model(
        spec, device=options.device, dtype=options.dtype, tokenizer=getattr(args, "tokenizer", None)
    )


def add_model_options(
    parser: argparse.ArgumentParser, tokenizer: bool = True, stream: bool = False, device_map: bool = False
) -> None:
    """--device, --dtype (and --tokenizer, --stream, --device-map / --max-memory): the fields of
    io.options.ModelOptions, a recipe's keys too. --device-map only where the command loads its models
    through :func:`diffquant.stages.load_models` or a sweep, which place them."""
    from diffquant.options import ModelOptions  # torch-free (io.options, which re-exports it, imports torch)
    from diffquant.schema import add_options

    only = ("device", "dtype") + (("tokenizer",) if tokenizer else ()) + (("stream",) if stream else ())
    only += ("device_map", "max_memory") if device_map else ()
    add_options(parser, ModelOptions, only=only)
