"""AWQ, Activation-aware Weight Quantization (Lin et al., MLSys 2024, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration", arXiv 2306.00978): before round-to-nearest,
the input channels that see large activations are scaled up in the weight (and their activations down by the
same factor), so that the few weights that matter most lose less to rounding.

The paper's argument (section 3): a weight w multiplied by an activation x has the output error
``Delta * RoundErr(w / Delta) * x``; scaling the input channel by s > 1 (``Q(w s) x / s``) leaves the
rounding error of the channel about the same in units of its group's step Delta, which barely grows while
only one channel of the group is scaled, and divides its contribution to the output by s. Channels with a
large mean |x| are the salient ones, so the scale is a power of it:

1. ``s_X`` = mean |x| per input channel over the calibration tokens (:func:`activation_scale`,
   :class:`ChannelMeans`);
2. ``s = s_X^alpha``, clamped to >= 1e-4 and normalised to ``s / sqrt(max s * min s)`` (the authors' code,
   ``auto_scale.py``: the normalisation centres the scales around 1 on a log scale, so neither the weight
   nor the folded norm is pushed far from its original range; the clamp keeps a channel that never fires
   from giving s = 0);
3. alpha on the grid ``0, 1/n, ..., (n - 1)/n`` (n = 20 as in the paper), chosen to minimise the output
   error of the whole group of Linears that read the same input X (q/k/v [+ DIFF V2's lambda_proj]
   after the attention norm, gate/up after the FFN norm), which share one s because s is folded into
   the one norm before them::

       L(s) = sum_i || Q(W_i diag(s)) diag(s)^-1 X^T - W_i X^T ||^2

   (Q: the grid's quantize-dequantize, :func:`~diffquant.quant.weightcodes.rtn_codes`). alpha = 0 gives
   s = 1, i.e. plain round-to-nearest, so the loss chosen is never above RTN's. Ties go to the smaller
   alpha (the authors' strict ``<``);
4. the codes are the RTN codes of ``W_i diag(s)`` (:func:`awq_codes`); the caller folds ``diag(s)^-1``
   into the norm before the group (``norm.weight /= s``; ``(1 + w) /= s`` for Gemma's norms), so the float
   model computes exactly what it did and the quantized one computes ``Q(W diag(s)) (X diag(s)^-1)^T``.

The authors' code also searches a clipping range after the scales (``auto_clip``); that step is not part of
this module. Their loss is the mean squared error of the whole attention / MLP block output; here it is the
error of the group's own outputs, as the paper's objective (Eq. 4) states it.

The scales are computed in float64 and then rounded to float32 (what the caller stores and folds), and the
loss of each grid point is evaluated with those float32 scales, so the loss reported for the chosen alpha is
the error of exactly the codes :func:`awq_codes` returns. Losses are summed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.quant.methods import WeightMethod, register
from diffquant.quant.smoothquant import fold_factors  # SmoothQuant's fold: the same float64 ops
from diffquant.quant.weightcodes import GroupCodes, WeightGrid, rtn_codes

CLAMP = 1e-4  # the authors' clamp of s_X^alpha before normalising
N_GRID = 20  # the paper's grid of alpha
# Tokens kept for the loss. The loss costs tokens x out x in float64 multiply-adds per grid point and per
# Linear: for a 4,096-wide q/k/v group (out 12,288) 4,096 tokens (8 sequences of 512) make the 20-point
# search about 4e12, seconds of float64 matmul on a data-centre GPU, minutes on a CPU. The loss is an
# average over tokens; at 4,096 its sampling error can only swap grid points whose losses are within a few
# percent of each other, i.e. neighbours on the flat bottom of the curve, where either choice costs little.
MAX_TOKENS = 4096
_CHUNK = 1 << 22  # elements of one [rows, out] float64 product in the loss (32 MiB)


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """s_X: mean |x| per input channel (the last dim) over all leading dims, in float64."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise DiffquantError(f"awq: activations of shape {tuple(x.shape)} have no input channels")
    rows = x.detach().reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        raise DiffquantError("awq: no activation rows to average")
    return rows.abs().sum(0, dtype=torch.float64) / rows.shape[0]


@dataclass
class ChannelMeans:
    """Running mean |x| per input channel (float64) over every row of every batch added, and a bounded,
    deterministic sample of the rows for the loss.

    The sample keeps the rows whose index (counted over everything added) is a multiple of ``stride``; when
    more than ``max_tokens`` are kept, every other kept row is dropped and the stride doubles. So it is
    always an evenly strided sample of all the tokens seen (at least ``max_tokens / 2`` of them once that
    many were added), spread over the whole calibration set rather than its first sequences, and it
    depends on the order of the rows only, not on a random state."""

    size: int
    max_tokens: int = MAX_TOKENS
    tokens: int = 0
    stride: int = 1
    total: torch.Tensor | None = field(default=None, repr=False)
    kept: list[torch.Tensor] = field(default_factory=list, repr=False)
    n_kept: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise DiffquantError(f"awq: max_tokens must be >= 1, got {self.max_tokens}")

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` [..., size] (kept in x's dtype and on its device)."""
        if x.shape[-1] != self.size:
            raise DiffquantError(f"awq: activations of width {x.shape[-1]}, expected {self.size}")
        rows = x.detach().reshape(-1, self.size)
        n = rows.shape[0]
        if n == 0:
            return
        part = rows.abs().sum(0, dtype=torch.float64)
        self.total = part if self.total is None else self.total + part.to(self.total.device)
        first = -self.tokens % self.stride  # the first row of this batch whose global index is on the stride
        take = rows[first :: self.stride]
        self.tokens += n
        if take.shape[0]:
            self.kept.append(take.clone())
            self.n_kept += take.shape[0]
        while self.n_kept > self.max_tokens:
            joined = torch.cat(self.kept)[::2]
            self.kept, self.n_kept, self.stride = [joined], joined.shape[0], self.stride * 2

    @property
    def mean(self) -> torch.Tensor:
        """s_X (float64, [size])."""
        if self.total is None:
            raise DiffquantError("awq: no activations were added (run the calibration)")
        return self.total / self.tokens

    @property
    def sample(self) -> torch.Tensor:
        """The kept rows [<= max_tokens, size]."""
        if not self.kept:
            raise DiffquantError("awq: no activations were added (run the calibration)")
        if len(self.kept) > 1:
            self.kept = [torch.cat(self.kept)]
        return self.kept[0]


def awq_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = s_X^alpha clamped to >= 1e-4, normalised by sqrt(max s * min s); float64, [in]."""
    s = mean_abs.to(torch.float64).pow(alpha).clamp(min=CLAMP)
    return s / (s.max() * s.min()).sqrt()


def group_error(
    weights: Sequence[torch.Tensor], x: torch.Tensor, grid: WeightGrid, scales: torch.Tensor | None = None
) -> float:
    """sum_i || Q(W_i diag(s)) diag(s)^-1 X^T - W_i X^T ||^2 (float64) over the rows ``x`` [tokens, in];
    ``scales`` None: plain round-to-nearest (s = 1)."""
    total = 0.0
    for w in weights:
        w64 = w.detach().to(torch.float64)
        if scales is None:
            delta = rtn_codes(w64, grid).dequantize() - w64
        else:
            s = scales.to(device=w64.device, dtype=torch.float64)
            delta = rtn_codes(w64 * s, grid).dequantize() / s - w64
        rows = max(1, _CHUNK // max(1, delta.shape[0]))
        for i in range(0, x.shape[0], rows):
            total += float((x[i : i + rows] @ delta.T).pow(2).sum())
    return total


@dataclass(frozen=True)
class AwqSearch:
    """The result of :func:`search_scales`: ``scales`` (float32, [in]) for the chosen ``alpha``, the loss of
    every grid point (``losses[k]`` for alpha = k / n_grid) and plain round-to-nearest's loss."""

    scales: torch.Tensor
    alpha: float
    losses: list[float]
    rtn_loss: float

    @property
    def loss(self) -> float:
        """The loss of the chosen alpha (never above ``rtn_loss``)."""
        return min(self.losses)


def _check(mean_abs: torch.Tensor, weights: Sequence[torch.Tensor], x: torch.Tensor, grid: WeightGrid) -> int:
    """The input width, after checking the shapes and values of the search's arguments."""
    if mean_abs.dim() != 1 or mean_abs.numel() == 0:
        raise DiffquantError(f"awq: mean |x| must be 1-D and non-empty, got shape {tuple(mean_abs.shape)}")
    n = mean_abs.shape[0]
    if not bool(torch.isfinite(mean_abs).all()) or bool((mean_abs < 0).any()):
        raise DiffquantError("awq: mean |x| must be finite and >= 0")
    if not weights:
        raise DiffquantError("awq: no weights in the group")
    for i, w in enumerate(weights):
        grid.check(tuple(w.shape), f"awq: weight {i}")
        if w.shape[1] != n:
            raise DiffquantError(f"awq: weight {i} has {w.shape[1]} input channels, mean |x| has {n}")
        if not bool(torch.isfinite(w).all()):
            raise DiffquantError(f"awq: weight {i} has non-finite values")
    if x.dim() < 1 or x.shape[-1] != n:
        raise DiffquantError(f"awq: activations of shape {tuple(x.shape)}, expected [..., {n}]")
    if x.numel() == 0:
        raise DiffquantError("awq: no activation rows for the loss")
    if not bool(torch.isfinite(x).all()):
        raise DiffquantError("awq: activations have non-finite values")
    return n


def search_scales(
    mean_abs: torch.Tensor,
    weights: Sequence[torch.Tensor],
    x: torch.Tensor,
    grid: WeightGrid,
    n_grid: int = N_GRID,
) -> AwqSearch:
    """The grid search of alpha for the group ``weights`` (each [out_i, in]) that reads the activations
    whose mean |x| per channel is ``mean_abs`` [in]; the loss on the rows ``x`` [..., in] (see the module
    docstring). Runs on the first weight's device."""
    if n_grid < 1:
        raise DiffquantError(f"awq: n_grid must be >= 1, got {n_grid}")
    n = _check(mean_abs, weights, x, grid)
    device = weights[0].device
    rows = x.detach().reshape(-1, n).to(device=device, dtype=torch.float64)
    means = mean_abs.detach().to(device)
    losses: list[float] = []
    best, best_scales = 0, None
    for k in range(n_grid):
        scales = awq_scales(means, k / n_grid).to(torch.float32)
        loss = group_error(weights, rows, grid, scales)
        if not losses or loss < losses[best]:
            best, best_scales = k, scales
        losses.append(loss)
    assert best_scales is not None
    return AwqSearch(best_scales, best / n_grid, losses, group_error(weights, rows, grid))


def awq_codes(
    weight: torch.Tensor, scales: torch.Tensor, grid: WeightGrid, dtype: torch.dtype = torch.float64
) -> GroupCodes:
    """Round-to-nearest codes of ``weight`` [out, in] with input column j multiplied by ``scales[j]``.

    The codes dequantize to Q(W diag(s)), not to an approximation of W: the caller divides the norm before
    the group by s (or, for a Linear fed by another Linear, that Linear's output rows), so that the model
    computes ``Q(W diag(s)) (X diag(s)^-1)^T``."""
    if scales.dim() != 1 or scales.shape[0] != weight.shape[-1]:
        raise DiffquantError(
            f"awq: scales of shape {tuple(scales.shape)} for a weight of shape {tuple(weight.shape)}"
        )
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise DiffquantError("awq: scales must be finite and > 0")
    w = weight.detach().to(dtype)
    return rtn_codes(w * scales.to(device=w.device, dtype=dtype), grid, dtype)


# ----------------------------------------------------------------------------------- as a weight method
class AwqCollector:
    """AWQ's calibration over one stage (:class:`~diffquant.quant.methods.StageCollector`). The groups are
    the model's own norm -> readers (:meth:`~diffquant.models.transformer.Block.norm_readers`: q / k / v and
    each attention kind's readers of the same x, e.g. DIFF V2's lambda_proj, gated attention's gate_proj;
    gate / up): per norm whose readers include AWQ Linears, the mean |x| and a token sample of the readers'
    input. At ``finish`` the scales are searched over the group's AWQ Linears, folded into the norm and into
    every reader (quantized or not, so the float model is unchanged), and the AWQ Linears get the RTN codes
    of their scaled weights. AWQ Linears outside a norm group (o_proj, down, the LM head) get plain RTN
    codes: the authors also balance v -> o and up -> down, which this does not (a GQA value head feeds
    several output heads, and DIFF V1's per-head norm sits between v and o)."""

    def __init__(self, pairs: list, modules: Sequence[nn.Module]) -> None:
        pending = {id(linear): (linear, q) for linear, q in pairs}
        self.groups: list[tuple[str, nn.Module, dict[str, nn.Module], list, ChannelMeans]] = []
        grouped: set[int] = set()
        for module in modules:
            if not hasattr(module, "norm_readers"):
                continue
            for norm_name, norm, readers in module.norm_readers():
                chosen = [pending[id(r)] for r in readers.values() if id(r) in pending]
                if not chosen:
                    continue
                first_path = next(p for p, r in readers.items() if r is chosen[0][0])
                prefix = chosen[0][1].site[: -len(f"{first_path}.weight")]
                means = ChannelMeans(norm.weight.numel())
                self.groups.append((f"{prefix}{norm_name}", norm, readers, chosen, means))
                grouped.update(id(linear) for linear, _ in chosen)
        self.alone = [(linear, q) for linear, q in pairs if id(linear) not in grouped]
        self.folded: dict[str, torch.Tensor] = {}

    def attach(self) -> list:
        handles = []
        for _, _, _, chosen, means in self.groups:
            # the reader's input tap: what its weight multiplies (the norm's output)
            handles.append(chosen[0][0].input.register_forward_pre_hook(_recorder(means)))
        return handles

    def finish(self, stats: Any) -> None:
        for name, norm, readers, chosen, means in self.groups:
            if means.total is None:
                raise DiffquantError(
                    f"{chosen[0][1].site}: calibration never reached this Linear (no inputs)"
                )
            spec = chosen[0][1].spec
            weights = [linear.weight for linear, _ in chosen]
            sample = means.sample.to(weights[0].device)
            search = search_scales(
                means.mean.to(weights[0].device), weights, sample, spec.grid, spec.alpha_grid
            )
            fold_factors(norm, readers.values(), search.scales.double())
            self.folded[name] = search.scales.double().cpu()
            for linear, q in chosen:
                q.set_codes(rtn_codes(linear.weight, spec.grid))
            stats.linears += len(chosen)
            stats.tokens = max(stats.tokens, means.tokens)
            held = sample.numel() * sample.element_size()
            stats.hessian_bytes = max(stats.hessian_bytes, held)
        for linear, q in self.alone:
            q.set_codes(rtn_codes(linear.weight, q.spec.grid))
            stats.linears += 1
        stats.held = "activation samples"
        stats.folded.update(self.folded)


def _recorder(means: ChannelMeans) -> Any:
    def record(_module: nn.Module, args: tuple) -> None:
        means.add(args[0].detach())

    return record


register(
    WeightMethod(
        "awq",
        "activation-aware scales searched per norm group on calibration data, then round-to-nearest",
        options=("alpha_grid",),
        default_sym=False,  # the authors' default (zero_point: true) and llm-compressor's W4A16_ASYM
        collector=AwqCollector,
        collects="each norm group's mean |x| per input channel and a token sample",
        transform="awq",
    )
)
