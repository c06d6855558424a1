"""Choosing Linears by name: the pattern keys every plan section shares (``weights``, ``modules``,
``exclude``) and the selection rule they follow (each pattern must match; the excludes must leave something).

Below :mod:`~diffquant.quant.plan` and the transforms (:mod:`~diffquant.quant.weights`) so that both use one
rule without importing each other.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear
from diffquant.quant.modules import linear_modules


def pattern_list(value: Any) -> str | None:
    """The check of a pattern list key: a glob, or a list of them (what was expected, or None)."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None
    return "a pattern or a list of patterns"


def patterns(value: list[str] | str) -> list[str]:
    """A pattern key's value as a list (a single glob is a list of one)."""
    return [value] if isinstance(value, str) else list(value)


def select_linears(model: nn.Module, include: list[str], exclude: list[str], where: str) -> dict[str, Linear]:
    """Linears matching any of ``include`` but none of ``exclude``; each pattern must match, and the
    excludes must leave something (a selection that quantizes nothing is a typo or a plan written for
    another model, refused in one line naming ``where``)."""
    linears = linear_modules(model)
    chosen = {}
    for pattern in include:
        hits = {n: m for n, m in linears.items() if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            example = ", ".join(list(linears)[:3])
            raise DiffquantError(
                f"{where}: weight pattern {pattern!r} matches no Linear (names look like {example})"
            )
        chosen.update(hits)
    kept = {n: m for n, m in chosen.items() if not any(fnmatch.fnmatchcase(n, e) for e in exclude)}
    if not kept:
        raise DiffquantError(
            f"{where}: patterns {include} select {len(chosen)} Linear(s), all removed by exclude {exclude}; "
            "it would quantize nothing"
        )
    return kept
