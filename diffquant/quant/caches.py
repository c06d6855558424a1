"""The quantized weights that weight quantizers cache, dropped as soon as their Linear has run.

A FakeQuant on a weight (:meth:`~diffquant.quant.fake.FakeQuant.quantize_weight`) and the weights section's
codes (:class:`~diffquant.quant.weightcodes.QuantizedWeight`) keep a float copy of the quantized weight, so
that a model evaluated batch after batch quantizes each weight once. A run that only goes over the model
once per batch to observe it (calibration's static scales, the error report) does not need them kept: with
:func:`weight_caches_dropped` each cache lives only while its Linear runs, so a model's worth of float
copies of its quantized weights (as much as the weights themselves) is never held at once. Quantization is
deterministic, so a weight quantized again is the same weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from diffquant.quant.fake import FakeQuant
from diffquant.quant.weightcodes import QuantizedWeight


def drop_weight_cache(quantizer: nn.Module | None) -> None:
    """Forget the quantized weight ``quantizer`` cached (a FakeQuant or a QuantizedWeight; else nothing)."""
    if isinstance(quantizer, FakeQuant):
        quantizer._weight_cache = None
    elif isinstance(quantizer, QuantizedWeight):
        quantizer._cache = None


def weight_quantized_modules(model: nn.Module) -> Iterable[nn.Module]:
    """The modules of ``model`` with a weight quantizer that caches (FakeQuant or QuantizedWeight)."""
    for module in model.modules():
        if isinstance(getattr(module, "weight_quantizer", None), FakeQuant | QuantizedWeight):
            yield module


@contextmanager
def weight_caches_dropped(model: nn.Module) -> Iterator[None]:
    """Within the block, every weight quantizer's cache of ``model`` is dropped right after its module has
    run (a forward hook each, removed on exit); the caches are dropped on entry too."""
    handles = []
    for module in weight_quantized_modules(model):
        drop_weight_cache(module.weight_quantizer)
        handles.append(
            module.register_forward_hook(lambda m, args, out: drop_weight_cache(m.weight_quantizer))
        )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
