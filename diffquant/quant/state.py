"""QuantState: what applying a plan leaves on a model, in one declared object (``model.quant``).

Before, a quantized model carried loose attributes (``quant_plan``, ``smooth_factors``, ``gptq_stats``,
``kv_cache_layer``) read back with ``getattr(model, ..., None)``, and a checkpoint's record of
"which transforms ran" was rebuilt by sniffing them. Now each plan section (:mod:`diffquant.quant.pipeline`)
writes what it did here, and the checkpoint's ``transforms`` list is :attr:`QuantState.transforms`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffquant.quant.plan import QuantPlan


@dataclass
class QuantState:
    """The quantization state of a model (``model.quant``; None on an unquantized model).

    ``applied``: (target, name, what) per insertion, in the order the sections ran (the quantize report's
    list). ``transforms``: the weight transforms that changed the model's float weights or computed codes
    from them, in the order they ran (``rotate``, ``smooth``, ``awq``, ``weights``): a checkpoint saves the
    transformed weights and codes, so loading must not run these again. ``folded``: per-channel factors a
    section folded into norms and their readers (SmoothQuant's s, AWQ's s), by norm name, in order; the error
    report's float reference gets the same folds. ``kv_cache``: the quantized cache's layer factory (depth ->
    layer cache), None for a full-precision cache. ``weight_stats``: what a data-driven weight method's
    calibration measured (GPTQ's Linears, tokens, Hessian bytes)."""

    plan: QuantPlan
    applied: list[tuple[str, str, str]] = field(default_factory=list)
    transforms: list[str] = field(default_factory=list)
    folded: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    kv_cache: Callable[[int], Any] | None = None
    weight_stats: dict[str, Any] | None = None
    # the rotation's per-stage part (R1's matrix built once), which a streamed run applies as stages are read
    stage_rotation: Any = None
    # the weights section's data-free codes are computed as stages are read (not when the plan smooths first,
    # nor when a checkpoint stores them)
    fill_weights: bool = False

    def record(self, transform: str) -> None:
        """Note that ``transform`` changed the weights (once, in order)."""
        if transform not in self.transforms:
            self.transforms.append(transform)

    def fold(self, name: str, factors: dict[str, torch.Tensor]) -> None:
        """Record that transform ``name`` folded ``factors`` (by norm name; merged with its earlier stages')."""
        if not factors:
            return
        known = self.factors(name)
        if known is None:
            self.folded.append((name, dict(factors)))
        else:
            known.update(factors)
        self.record(name)

    def factors(self, name: str) -> dict[str, torch.Tensor] | None:
        """The factors the ``name`` transform folded (``smooth``, ``awq``), None when it did not run."""
        for what, factors in self.folded:
            if what == name:
                return factors
        return None


def quant_state(model: torch.nn.Module) -> QuantState | None:
    """``model``'s quantization state (None: unquantized, or a module that is not a DecoderLM)."""
    return getattr(model, "quant", None)


def kv_cache_spec(model: torch.nn.Module) -> Any:
    """The KVCacheSpec of ``model``'s quantized decoding cache, None for a full-precision cache."""
    state = quant_state(model)
    return None if state is None or state.kv_cache is None else state.kv_cache.spec
