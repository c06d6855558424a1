"""Moved to :mod:`diffquant.io.quantize` (it reads and writes checkpoints, so it sits above quant: see
docs/DESIGN.md); re-exported here for the old import path."""

from diffquant.io.quantize import quantize_checkpoint  # noqa: F401
