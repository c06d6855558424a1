"""Taps: named identity modules at every probe point, the single seam for profiling and quantization.

A tap's site name is its module path in the model (``layers.3.attn.logits1``), so it is stable across
runs and selectable by glob. Profilers attach ordinary forward hooks; quantizers are set as
``tap.quantizer``. Map taps (logits, probs, diff_map) receive a second argument ``valid``: a boolean mask
broadcastable to the map, False at causally masked positions, so statistics and dynamic scales can ignore
entries that never reach the softmax.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

import torch
from torch import nn

from diffquant.errors import DiffquantError, did_you_mean
from diffquant.models.sites import MAP_KINDS, SITE_KINDS  # noqa: F401 (the table is models.sites)


class Tap(nn.Module):
    """Identity at a probe point; optionally applies ``self.quantizer(x, valid)``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind not in SITE_KINDS:
            raise ValueError(f"unknown site kind {kind!r}")
        self.kind = kind
        self.quantizer: nn.Module | None = None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantizer is not None:
            return self.quantizer(x, valid)
        return x

    @property
    def active(self) -> bool:
        """True when someone observes or rewrites this tap (a hook or a quantizer is attached)."""
        return bool(self._forward_hooks or self._forward_pre_hooks or self.quantizer is not None)

    def extra_repr(self) -> str:
        return f"kind={self.kind}"


def model_taps(model: nn.Module) -> dict[str, Tap]:
    """Every tap of ``model`` by site name, in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, Tap)}


def _site_choices(taps: dict[str, Tap]) -> list[str]:
    """What a mistyped site pattern is compared with: the site names, each with its layer as ``*``
    (``layers.*.attn.q``), and ``kind:NAME`` for each kind."""
    layered = [re.sub(r"^layers\.\d+\.", "layers.*.", name) for name in taps]
    return [*taps, *layered, *(f"kind:{t.kind}" for t in taps.values())]


def select_taps(model: nn.Module, patterns: str | Iterable[str]) -> dict[str, Tap]:
    """Taps whose site name matches any glob in ``patterns`` (``*`` for all, ``kind:logits`` by kind).

    A pattern that matches nothing is an error listing the site kinds this model has, because a silent
    empty selection makes a profile or quantization plan do nothing without saying so.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    taps = model_taps(model)
    chosen: dict[str, Tap] = {}
    for pattern in patterns:
        if pattern.startswith("kind:"):
            kind = pattern.removeprefix("kind:")
            hits = {n: t for n, t in taps.items() if t.kind == kind}
        else:
            hits = {n: t for n, t in taps.items() if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            kinds = sorted({t.kind for t in taps.values()}, key=SITE_KINDS.index)
            hint = did_you_mean(pattern, _site_choices(taps))
            raise DiffquantError(
                f"site pattern {pattern!r} matches no site; this model's site kinds: {', '.join(kinds)} "
                f"(names look like {next(iter(taps), '?')!r}; a pattern is a glob over site names, * any "
                f"characters, ? one, [abc] one of them; 'kind:NAME' selects by kind){'; ' + hint if hint else ''}"
            )
        chosen.update(hits)
    return {n: taps[n] for n in taps if n in chosen}
