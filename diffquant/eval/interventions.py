"""Massive-activation interventions (Sun et al. 2024, "Massive Activations in Large Language Models", Table 3).

Sun et al. find a few activations of the residual stream thousands of times larger than the median (LLaMA2-7B:
two channels, at the starting token and the first delimiter, from layer 2 on) and test whether the model
needs their values: at the layer where they appear they set them to zero (perplexity explodes) or to their
mean over many sequences (perplexity barely moves). They act as fixed biases: the model needs them to be
there, not to carry information.

Here, in the same set-up: a first pass over disjoint windows of the evaluation text finds, at every layer
output, the entries with |x| > max(100, 1000 x the median |x| of that sequence's layer output) (the profile's
massive-activation criterion, ``diffquant.profile.accumulators.MASSIVE_FLOOR`` / ``MASSIVE_RATIO``); the
first layer that has any is the intervention layer (or the one the task names), its channels holding them
are the massive channels, and each channel's mean massive value is kept. A model with none at any layer (a small
or a differential one may have none) is a result, not an error: the task reports its perplexity unchanged
with ``intervene_found`` 0 and no layer, so a sweep over several families keeps its row for that one. During the evaluation a hook on that
layer's output sets every entry of a massive channel that passes the same criterion on that forward to 0
(``zero``) or to its channel's mean (``mean``), the mean of the first token's entries for the first token and
of the later tokens' entries otherwise (Sun et al. set each massive activation to its own mean; the starting
token's are the largest). Entries that pass the criterion in other channels are left
alone and counted (``massive_outside``), so a set-up that misses some is visible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.profile.accumulators import MASSIVE_FLOOR, MASSIVE_RATIO

MODES = ("zero", "mean")


def massive_mask(x: torch.Tensor) -> torch.Tensor:
    """Entries of a layer output (B, T, D) with |x| > max(100, 1000 x the median |x| of its batch row).

    Per row (one sequence, or one decode step of it), not per batch: a batch-wide median would make the
    chosen entries, and so the perplexity, depend on the batch size (SmolLM2's channel 247 sits within 5 %
    of the bar)."""
    magnitude = x.detach().abs()
    median = magnitude.reshape(magnitude.shape[0], -1).float().median(dim=1).values
    bar = (MASSIVE_RATIO * median).clamp_min(MASSIVE_FLOOR)
    return magnitude.float() > bar.view(-1, *([1] * (magnitude.dim() - 1)))


def _first_rows(args: tuple, x: torch.Tensor) -> torch.Tensor:
    """(T,) bool: which rows of a block's output are the sequence's first token. A forward with a cache
    (decode steps, a prefill over a cache) starts where the cache did: its length less the rows just added."""
    cache = args[1] if len(args) > 1 else None
    start = 0 if cache is None else cache.length - x.shape[1]
    return torch.arange(start, start + x.shape[1], device=x.device) == 0


@dataclass
class MassiveSites:
    """Where the massive activations sit: the intervention layer, its massive channels, and each channel's
    mean massive value on the first token and on later tokens (Sun et al. find them on the starting token
    and on delimiters: two roles with different sizes, each set to its own mean)."""

    layer: int | None  # None: no layer output had any (nothing to intervene on)
    means: dict[tuple[int, str], float]  # (channel, "first" | "later") -> mean massive value
    entries: int  # massive entries found at that layer in the finding pass

    @property
    def channels(self) -> list[int]:
        return sorted({c for c, _ in self.means})

    def mean(self, channel: int, role: str) -> float:
        """The channel's mean in that role; a role it never had massive entries in takes the other's."""
        other = "later" if role == "first" else "first"
        return self.means.get((channel, role), self.means.get((channel, other), 0.0))

    def metrics(self) -> dict[str, Any]:
        """Flat task metrics (numbers and strings, for results.csv): layer, channels and their means."""
        return {
            "intervene_layer": self.layer,
            "intervene_channels": ",".join(str(c) for c in self.channels),
            "intervene_means": ",".join(f"{c}@{r}={v:.6g}" for (c, r), v in sorted(self.means.items())),
            "intervene_found": self.entries,
        }


def find_massive(
    model: torch.nn.Module, windows: torch.Tensor, *, batch_size: int = 8, layer: int | None = None
) -> MassiveSites:
    """The first pass: per layer output the massive entries of each forward; the intervention ``layer``
    (None: the first layer with any) with its massive channels' mean values over all windows. With no
    layer named and none found anywhere, sites with no layer and no channels (the intervention is a no-op);
    a named layer without any is an error (the user expected them there)."""
    blocks = list(model.layers)
    if layer is not None and not 0 <= layer < len(blocks):
        raise DiffquantError(f"intervene_layer {layer}: the model has layers 0..{len(blocks) - 1}")
    counts = [0] * len(blocks)
    sums: list[dict[tuple[int, str], list[float]]] = [{} for _ in blocks]

    def watch(i: int):
        def hook(_module, args, out):
            mask = massive_mask(out)
            counts[i] += int(mask.sum())
            if mask.any():
                first = _first_rows(args, out)
                where = mask.nonzero()
                values = out.detach()[mask].double().tolist()
                roles = first[where[:, 1]].tolist()
                for c, is_first, v in zip(where[:, 2].tolist(), roles, values, strict=True):
                    total = sums[i].setdefault((c, "first" if is_first else "later"), [0.0, 0])
                    total[0] += v
                    total[1] += 1

        return hook

    handles = [block.register_forward_hook(watch(i)) for i, block in enumerate(blocks)]
    device = next(model.parameters()).device  # the windows are tokenized on the host
    try:
        with torch.no_grad():
            for start in range(0, windows.shape[0], batch_size):
                model(windows[start : start + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()
    if layer is None:
        layer = next((i for i, n in enumerate(counts) if n), None)
        if layer is None:
            return MassiveSites(None, {}, 0)
    elif not counts[layer]:
        raise DiffquantError(
            f"intervene_layer {layer}: its output has no massive activations on {windows.numel():,} tokens"
        )
    means = {key: total / n for key, (total, n) in sorted(sums[layer].items())}
    return MassiveSites(layer, means, counts[layer])


@contextlib.contextmanager
def intervened(model: torch.nn.Module, sites: MassiveSites, mode: str) -> Iterator[dict[str, int]]:
    """Within the block, layer ``sites.layer``'s output has its massive entries in the massive channels set
    to 0 (``zero``) or to the channel's mean in that role (``mean``: first token or later tokens); yields
    counters {intervened, massive_outside}."""
    if mode not in MODES:
        raise DiffquantError(f"intervene: {mode!r}, expected one of {', '.join(MODES)}")
    counters = {"intervened": 0, "massive_outside": 0}
    channels = torch.tensor(sites.channels)
    roles = torch.tensor([[sites.mean(c, r) for c in sites.channels] for r in ("first", "later")])

    def hook(_module, args, out):
        mask = massive_mask(out)
        in_channels = torch.zeros(out.shape[-1], dtype=torch.bool, device=out.device)
        in_channels[channels.to(out.device)] = True
        chosen = mask & in_channels
        counters["intervened"] += int(chosen.sum())
        counters["massive_outside"] += int((mask & ~in_channels).sum())
        if mode == "zero":
            return out.masked_fill(chosen, 0.0)
        value = torch.zeros(2, out.shape[-1], dtype=out.dtype, device=out.device)  # first / later rows
        value[:, channels.to(out.device)] = roles.to(device=out.device, dtype=out.dtype)
        per_row = torch.where(_first_rows(args, out)[:, None], value[0], value[1])  # (T, D)
        return torch.where(chosen, per_row, out)

    if sites.layer is None:  # nothing found: the model runs as it is
        yield counters
        return
    handle = model.layers[sites.layer].register_forward_hook(hook)
    try:
        yield counters
    finally:
        handle.remove()
