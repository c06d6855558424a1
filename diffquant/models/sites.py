"""Site kinds: the one table of what each kind of tap carries, and the layout of its tensor.

:data:`SITE_KIND_TABLE` holds one :class:`SiteKind` per kind; every other list of kinds derives from it
(:data:`SITE_KINDS`, :data:`MAP_KINDS`, :data:`KIND_LAYOUTS`, :data:`SHARING_KINDS`, :data:`KIND_TITLES`).

Dimension names: ``batch`` (sample in the batch), ``pos`` (query / token position), ``head``,
``channel`` (hidden or head channel), ``key`` (key position of an attention map). Taps see
q/k/v after RoPE, maps per query chunk (with a ``valid`` mask), lambda as a scalar (DIFF V1, one per
layer) or per token and head (DIFF V2), sink logits per head, gates per token, head and channel.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch

Layout = tuple[str, ...]

_HEADS: Layout = ("batch", "head", "pos", "channel")
_MAP: Layout = ("batch", "head", "pos", "key")
_TOKENS: Layout = ("batch", "pos", "channel")


@dataclass(frozen=True)
class SiteKind:
    """One kind of probe site.

    name: the ``Tap.kind`` string (``kind:NAME`` selects every site of it).
    layout: dimension names of the tensor its taps see; None for ``lambda``, whose layout depends on the
        model (see :func:`layout_of`).
    title: what figures and reports call it.
    is_map: an attention map (its taps get a ``valid`` mask; observing one materialises the maps).
    shares_input: its taps may see a tensor another tap sees too (the profiler then computes the statistics
        of that tensor once); q/k/v, maps and lambda are always their own tensor.
    """

    name: str
    layout: Layout | None
    title: str
    is_map: bool = False
    shares_input: bool = False


# In model order (the order `diffquant info` lists kinds in).
SITE_KIND_TABLE: tuple[SiteKind, ...] = (
    SiteKind("q", _HEADS, "queries (after RoPE)"),
    SiteKind("k", _HEADS, "keys (after RoPE)"),
    SiteKind("v", _HEADS, "values"),
    SiteKind("logits", _MAP, "attention logits", is_map=True),
    # Sink attention only: the (H,) sink logits joining every softmax denominator (the same every token).
    SiteKind("sink_logit", ("head",), "attention-sink logits"),
    SiteKind("probs", _MAP, "attention probabilities", is_map=True),
    SiteKind("lambda", None, "lambda"),
    SiteKind("diff_map", _MAP, "differential attention maps", is_map=True),
    # Gated attention only: sigmoid(x W) per token, head and channel (channel width 1 for head-wise gates).
    SiteKind("attn_gate", ("batch", "pos", "head", "channel"), "attention output gates"),
    SiteKind(
        "head_out", ("batch", "pos", "head", "channel"), "per-head attention outputs", shares_input=True
    ),
    SiteKind("attn_out", _TOKENS, "attention-block outputs", shares_input=True),
    SiteKind("resid", _TOKENS, "hidden states (layer outputs)", shares_input=True),
    SiteKind("mlp_act", _TOKENS, "MLP activations", shares_input=True),
    # Only with sandwich_norms (Gemma): the MLP output its post-norm reads (attn_out is the attention's).
    SiteKind("mlp_out", _TOKENS, "MLP-block outputs", shares_input=True),
    SiteKind("linear_in", _TOKENS, "Linear-layer inputs", shares_input=True),
)
SITE_KIND_BY_NAME: dict[str, SiteKind] = {k.name: k for k in SITE_KIND_TABLE}
SITE_KINDS: tuple[str, ...] = tuple(SITE_KIND_BY_NAME)
MAP_KINDS: tuple[str, ...] = tuple(k.name for k in SITE_KIND_TABLE if k.is_map)
SHARING_KINDS: tuple[str, ...] = tuple(k.name for k in SITE_KIND_TABLE if k.shares_input)
KIND_LAYOUTS: dict[str, Layout] = {k.name: k.layout for k in SITE_KIND_TABLE if k.layout is not None}
KIND_TITLES: dict[str, str] = {k.name: k.title for k in SITE_KIND_TABLE}
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

    The query at absolute position p sees keys up to p (all of 0..p under a causal mask, the last W under a
    sliding window), so p = the index of its last visible key; this recovers the positions of a query chunk
    or a cached decode step without extra arguments (a row that sees no key gives -1).
    """
    rows = valid.reshape(-1, valid.shape[-2], valid.shape[-1])[0]
    keys = torch.arange(rows.shape[-1], device=rows.device)
    return torch.where(rows, keys, -1).amax(-1)


# The last mask whose query positions were read to the host, keyed as profile.stats keys its mask reads:
# the tensor it views (a weak reference), the view's place in it, its version counter and the device. A
# forward's layers share one mask per shape (attention._valid_mask) and a layer's map taps one view of it,
# so a profile's taps and metrics read the positions once per shape, where each read was a wait for a GPU.
_last_read: tuple[weakref.ref, tuple, list[int]] | None = None


def _forget_read(ref: weakref.ref) -> None:
    global _last_read
    if _last_read is not None and _last_read[0] is ref:
        _last_read = None


def view_place(valid: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(the tensor ``valid`` views, its place in it): offset, shape, strides, the version counter (shared by
    a tensor and its views: an in-place change moves it) and the device. Two views at one place of one
    tensor, unchanged since, hold the same values, so what was read off one serves the other."""
    root = valid if valid._base is None else valid._base
    return root, (valid.storage_offset(), tuple(valid.shape), valid.stride(), valid._version, valid.device)


def read_query_positions(valid: torch.Tensor) -> list[int]:
    """:func:`query_positions` of ``valid`` as a list on the host, read once per mask (see above)."""
    global _last_read
    root, where = view_place(valid)
    if _last_read is not None and _last_read[0]() is root and _last_read[1] == where:
        return list(_last_read[2])
    positions = query_positions(valid).tolist()
    _last_read = (weakref.ref(root, _forget_read), where, positions)
    return list(positions)
