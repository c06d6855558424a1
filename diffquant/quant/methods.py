"""The registry of weight methods: what a plan's ``weights: {method: NAME}`` may name.

A weight method chooses the integer codes of a Linear's weight on a :class:`~diffquant.quant.weightcodes.
WeightGrid`. Each registers itself from its own module (round-to-nearest in ``weightcodes``, GPTQ in ``gptq``,
HQQ in ``hqq``, AWQ in ``awq``) with what the rest of the pipeline needs to know about it:

- ``options``: the ``weights`` section's keys it reads beyond the common ones (an option the chosen method does
  not read is refused, never silently ignored);
- data-free methods give ``codes(weight, spec, what)``; data-driven ones give ``collector(pairs, modules)``:
  an object that hooks the stage's modules while the stage's calibration batches run (``attach``), then sets
  the codes (``finish``), one stage at a time, so whole-model and streamed runs share it
  (:func:`diffquant.quant.weights.weight_stage`). ``collects`` says in words what it gathers (the docs and the
  error for a missing calibration text name it);
- ``transform``: the name recorded in the checkpoint's ``transforms`` when the method also changes the float
  weights (AWQ folds its scales into norms and Linears), so a reload does not repeat it.

Adding a method is one module that calls :func:`register` and one import line in ``weights.py`` (which
imports every method module so the registry is full whenever a plan is read).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle


# The keys every method reads (format, group, sym are the grid; modules / exclude select the Linears).
COMMON_OPTIONS = ("method", "format", "group", "sym", "modules", "exclude")


class StageCollector(Protocol):
    """What a data-driven method gathers over one stage's calibration batches."""

    def attach(self) -> list[RemovableHandle]:
        """Hooks on the stage's modules (removed by the caller after the batches ran)."""

    def finish(self, stats: WeightStats) -> None:
        """Choose and set the codes of the stage's Linears of this method (and fold what it folds)."""


@dataclass
class WeightStats:
    """What a data-driven pass did: Linears quantized, calibration tokens per Linear, the largest calibration
    state (GPTQ's Hessians, AWQ's activation samples) held at once and the process's peak resident memory."""

    method: str = "gptq"
    held: str = "Hessians"
    linears: int = 0
    tokens: int = 0
    hessian_bytes: int = 0
    # per-channel factors a method folded into norms and their readers this stage (AWQ), by norm name: the
    # pipeline moves them into the model's QuantState (the error report's reference folds them too)
    folded: dict[str, Any] = field(default_factory=dict)

    def line(self, seconds: float) -> str:
        s = self.summary()
        return (
            f"{self.method}: {s['linears']} Linears on {s['tokens']:,} calibration tokens each in {seconds:.1f} s; "
            f"{self.held} up to {s['peak_hessian_bytes'] / 2**20:.1f} MiB at once, "
            f"peak resident memory {s['peak_rss_bytes'] / 2**30:.2f} GiB"
        )

    def summary(self) -> dict[str, Any]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return {
            "linears": self.linears,
            "tokens": self.tokens,
            "peak_hessian_bytes": self.hessian_bytes,
            "peak_rss_bytes": peak,
        }


@dataclass(frozen=True)
class WeightMethod:
    """One registered weight method (see the module docstring)."""

    name: str
    summary: str
    options: tuple[str, ...] = ()
    default_sym: bool = True
    sym_allowed: tuple[bool, ...] = (True, False)
    sym_note: str = ""  # why a sym setting is refused (the one-line error's text)
    codes: Callable[[torch.Tensor, Any, str], Any] | None = None  # (weight, spec, site) -> GroupCodes
    collector: Callable[[list[tuple[nn.Module, Any]], Sequence[nn.Module]], StageCollector] | None = None
    collects: str = ""
    transform: str | None = None

    @property
    def needs_data(self) -> bool:
        return self.collector is not None

    @property
    def reads(self) -> tuple[str, ...]:
        return (*COMMON_OPTIONS, *self.options)


REGISTRY: dict[str, WeightMethod] = {}


def register(method: WeightMethod) -> WeightMethod:
    """Add ``method`` (exactly one of ``codes`` / ``collector``); a second method of the same name is a bug."""
    if method.name in REGISTRY:
        raise DiffquantError(f"weight method {method.name!r} registered twice")
    if (method.codes is None) == (method.collector is None):
        raise DiffquantError(
            f"weight method {method.name!r}: give codes (data-free) or a collector, not both"
        )
    REGISTRY[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    """The registered methods, sorted (registration order depends on which module was imported first)."""
    return tuple(sorted(REGISTRY))


def weight_method(name: str, where: str = "weights.method") -> WeightMethod:
    """The method registered as ``name``; a one-line error listing the registered ones."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise DiffquantError(f"{where}: {name!r}; valid: {', '.join(method_names())}") from None
