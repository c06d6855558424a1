"""What a plan puts into a model, and how to find it again.

:class:`BackendLinear` (a real backend's quantized layer behind the original Linear's input tap) and
:func:`apply_backend` (swap chosen Linears for optimum-quanto / bitsandbytes layers); the lookups
:func:`linear_modules`, :func:`fake_quantizers`, :func:`quantized_taps` and :func:`nan_counts`; and
:func:`taps_detached` / :func:`weight_quantizers_detached`, which take inserted quantizers out for a while
(the float model SmoothQuant's act-scales read, the float activations GPTQ's Hessians read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from diffquant.models.attention import Linear
from diffquant.models.taps import Tap, model_taps
from diffquant.quant.backends.bnb import to_bnb
from diffquant.quant.backends.quanto import to_quanto
from diffquant.quant.fake import FakeQuant


class BackendLinear(nn.Module):
    """A backend's quantized layer behind the original Linear's input tap.

    ``source_weight`` keeps the float weight (not in the state dict) so the quantized model can be saved
    as base weights + plan, and rebuilt exactly on load.
    """

    def __init__(self, linear: Linear, inner: nn.Module, backend: str) -> None:
        super().__init__()
        self.input = linear.input
        self.inner = inner
        self.backend = backend
        self.source_weight = linear.weight.detach()
        self.source_bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.input(x))


def linear_modules(model: nn.Module) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def apply_backend(model: nn.Module, spec: Any, chosen: dict[str, Linear]) -> list[tuple[str, str, str]]:
    """Swap each chosen Linear for ``spec``'s (a plan's BackendSpec) quantized layer behind its input tap;
    (target, name, label) each."""
    applied = []
    for name, linear in chosen.items():
        if spec.name == "quanto":
            inner = to_quanto(linear, weights=spec.weight_type, activations=spec.activation_type)
            label = f"quanto {spec.weight_type}" + (
                f"/{spec.activation_type}" if spec.activation_type else ""
            )
        else:
            inner = to_bnb(linear, mode=spec.mode, threshold=spec.threshold, blocksize=spec.blocksize)
            label = f"bnb {spec.mode}"
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BackendLinear(linear, inner, spec.name))
        applied.append(("linear", name, label))
    return applied


def fake_quantizers(model: nn.Module) -> dict[str, FakeQuant]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FakeQuant)}


def nan_counts(model: nn.Module) -> dict[str, int]:
    """NaNs each quantizer has seen (propagated, not crashed on)."""
    return {q.site: q.nan_count for q in fake_quantizers(model).values() if q.nan_count}


def quantized_taps(model: nn.Module) -> dict[str, Tap]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Tap) and m.quantizer is not None}


@contextmanager
def taps_detached(model: nn.Module) -> Iterator[None]:
    """Every tap's quantizer of ``model`` detached for the duration (weights stay as they are)."""
    taps = [(tap, tap.quantizer) for tap in model_taps(model).values() if tap.quantizer is not None]
    try:
        for tap, _ in taps:
            tap.quantizer = None
        yield
    finally:
        for tap, quantizer in taps:
            tap.quantizer = quantizer


@contextmanager
def weight_quantizers_detached(linears: Iterable[Linear]) -> Iterator[None]:
    """The weight quantizers of ``linears`` detached for the duration: they compute with their float weights."""
    held = [(lin, lin.weight_quantizer) for lin in linears if lin.weight_quantizer is not None]
    try:
        for lin, _ in held:
            lin.weight_quantizer = None
        yield
    finally:
        for lin, quantizer in held:
            lin.weight_quantizer = quantizer
