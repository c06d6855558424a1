"""The layout of the tensor each site kind carries, so statistics can name where a value sits.

Dimension names: ``batch`` (sample in the batch), ``pos`` (query / token position), ``head``,
``channel`` (hidden or head channel), ``key`` (key position of an attention map). Taps see
q/k/v after RoPE, maps per query chunk (with a ``valid`` mask), lambda as a scalar (DIFF V1, one per
layer) or per token and head (DIFF V2).
"""

from __future__ import annotations

import re

import torch

Layout = tuple[str, ...]

KIND_LAYOUTS: dict[str, Layout] = {
    "q": ("batch", "head", "pos", "channel"),
    "k": ("batch", "head", "pos", "channel"),
    "v": ("batch", "head", "pos", "channel"),
    "logits": ("batch", "head", "pos", "key"),
    "probs": ("batch", "head", "pos", "key"),
    "diff_map": ("batch", "head", "pos", "key"),
    "head_out": ("batch", "pos", "head", "channel"),
    "attn_out": ("batch", "pos", "channel"),
    "resid": ("batch", "pos", "channel"),
    "mlp_act": ("batch", "pos", "channel"),
    "linear_in": ("batch", "pos", "channel"),
}
_LAMBDA_LAYOUTS: dict[int, Layout] = {0: (), 3: ("batch", "pos", "head")}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layout_of(kind: str, x: torch.Tensor) -> Layout:
    """Layout of tensor ``x`` seen at a tap of ``kind``."""
    layout = _LAMBDA_LAYOUTS.get(x.dim()) if kind == "lambda" else KIND_LAYOUTS.get(kind)
    if layout is None or len(layout) != x.dim():
        raise ValueError(f"site kind {kind!r}: unexpected tensor of shape {tuple(x.shape)}")
    return layout


def layer_of(site: str) -> int | None:
    """The layer index in a site name (``layers.3.attn.q`` -> 3), None outside the blocks."""
    match = _LAYER.search(site)
    return int(match.group(1)) if match else None


def query_positions(valid: torch.Tensor) -> torch.Tensor:
    """Absolute query positions of a causal map chunk from its valid mask (..., Tq, S).

    Under a causal mask the query at absolute position p sees keys 0..p, so p = (number of visible keys) - 1;
    this recovers the positions of a query chunk or a cached decode step without extra arguments.
    """
    rows = valid.reshape(-1, valid.shape[-2], valid.shape[-1])[0]
    return rows.sum(-1) - 1
