"""Where and in what precision a model runs: the ``--device`` / ``--dtype`` options and recipe keys, and
:class:`RunOptions`, the run options parsed once.

One parser for both, so a typo reads the same from the command line and from a recipe. A command or a recipe
parses its options once, at its edge, into a :class:`RunOptions` (:func:`diffquant.stages.parse_run_options`)
and passes that down; a library entry point that takes a device string for convenience parses it once, at its
own edge (:func:`run_options`), and a ``torch.device`` given is taken as it is (no second CUDA query).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffquant.errors import DiffquantError
from diffquant.names import DTYPE_NAMES
from diffquant.options import ModelOptions  # noqa: F401 (torch-free there, for the CLI's parser; public here)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # float32, bfloat16, float16
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``float32`` / ``bfloat16`` / ``float16`` (or fp32 / bf16 / fp16); None keeps the checkpoint's dtype; a
    ``torch.dtype`` is already parsed."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = _ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise DiffquantError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


def parse_device(name: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against what this machine has before any model is read. A
    ``torch.device`` is already parsed: returned as it is, without asking CUDA again. Called by
    :func:`run_options` only: everything else receives the parsed device."""
    if isinstance(name, torch.device):
        return name
    if name is None:
        return torch.device("cpu")
    text = str(name)
    if text == "cpu":
        return torch.device(text)
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DiffquantError(f"device {text!r}: CUDA is not available on this machine (use --device cpu)")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise DiffquantError(
                f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device(text)
    raise DiffquantError(f"device {text!r}: expected cpu, cuda or cuda:N")


@dataclass(frozen=True)
class Placement:
    """A checked ``device_map`` option: a strategy name or a {module: device} mapping (devices as ``cpu``,
    ``disk``, ``cuda:N``), the ``max_memory`` of a strategy (bytes by GPU index or ``cpu``), and how the
    user wrote the option (``--device-map`` or the recipe key ``device_map``) for messages. (Here, beside
    :class:`RunOptions` which holds one; :mod:`diffquant.stream.placement` checks the option and places models.)"""

    device_map: str | dict[str, str]
    max_memory: dict[int | str, int] | None = None
    what: str = "--device-map"


@dataclass(frozen=True)
class RunOptions:
    """Where and how a run's models run, parsed once (the model options of :class:`ModelOptions`): the
    ``device``, the compute ``dtype`` (None: the checkpoint's), the ``stream`` mode (``off`` / ``on`` /
    ``auto``, :func:`diffquant.stream.stream_mode`) and the ``placement`` of a device map (None: one device).
    A command or a recipe makes it at its edge (:func:`diffquant.stages.parse_run_options`) and passes it
    down; nothing below parses ``--device`` or ``--dtype`` again."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype | None = None
    stream: str = "off"
    placement: Placement | None = None


def run_options(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    stream: str = "off",
    placement: Placement | None = None,
) -> RunOptions:
    """The one place ``--device`` and ``--dtype`` are parsed (:func:`parse_device`, :func:`parse_dtype`):
    a library entry point that accepts strings calls it once, at its edge; a ``torch.device`` /
    ``torch.dtype`` is taken as it is. ``stream`` (already ``off`` / ``on`` / ``auto``) and ``placement``
    (a checked :class:`Placement`) are stored as given."""
    return RunOptions(parse_device(device), parse_dtype(dtype), stream, placement)
