"""GPTQ (Frantar et al. 2022, arXiv 2210.17323): weights quantized column by column, each column's rounding
error compensated on the columns not yet quantized, through the inverse Hessian of the layer objective.

For one Linear with calibration inputs X [tokens, in], the objective is ||W X^T - Q X^T||_F^2, whose Hessian
in each row of W is H = 2 X^T X / tokens (:class:`Hessian` accumulates it over batches, in float64). The
algorithm (the paper's Algorithm 1, written here from its equations):

1. dead inputs (diag H = 0: a channel that is always 0) get H_jj = 1 and W_:j = 0, as the paper's code does;
2. optional act-order: columns in order of descending diag H, with static groups (each group's scale and
   zero point from the weights before any update, so the groups stay the original consecutive columns and
   the codes need no reordering to be stored);
3. damping: H += damp * mean(diag H) * I; the upper Cholesky factor U of H^-1 (H^-1 = U^T U);
4. for each column j in order: q_j = quant(w_j); the error e = (w_j - q_j) / U_jj; the columns after j in
   the block are updated w_k -= e U_jk; after each block of ``block`` columns the columns beyond it are updated
   at once (the lazy batch update: W_:,rest -= E U_block,rest);
5. without act-order, a group's scale and zero point come from its weights at the moment its first column is
   reached, i.e. after the updates of every earlier column. The reference code reads them from the matrix the
   lazy updates are written to, which lacks the updates of the current block's earlier columns when a group
   starts inside a block (group 32, block 128); here the pending updates are added, so the result does not
   depend on the block size (tests/test_gptq.py checks block 1 against block 128).

Everything runs in ``dtype`` (float64 by default: the inverse of a damped Hessian of a 4,096-wide layer
is well within float64 and the cost is small on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.quant.methods import WeightMethod, WeightStats, register
from diffquant.quant.weightcodes import GroupCodes, WeightGrid


@dataclass
class Hessian:
    """H = 2 X^T X / tokens over every row of every batch added (a float64 running mean)."""

    size: int
    device: torch.device | str = "cpu"
    tokens: int = 0
    matrix: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.matrix = torch.zeros(self.size, self.size, dtype=torch.float64, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` [..., size]. The batch's X^T X is computed in x's precision (float32 for
        float32 / half inputs, as the reference code computes all of H; float64 for float64), then added
        to the float64 running mean: a float64 product would triple the cost of calibration on a CPU."""
        x = x.detach().reshape(-1, x.shape[-1]).to(self.matrix.device)
        if x.dtype != torch.float64:
            x = x.float()
        n = x.shape[0]
        if n == 0:
            return
        total = self.tokens + n
        self.matrix.mul_(self.tokens / total).add_((x.T @ x).double(), alpha=2.0 / total)
        self.tokens = total


@dataclass(frozen=True)
class InverseFactor:
    """What GPTQ takes from a Hessian, whatever weight it then quantizes: the dead inputs (diag H = 0), the
    column order (act-order's descending diag H, else the identity) and the upper Cholesky factor U of the
    damped, permuted H^-1 (steps 1-3 of the module docstring). Linears that read one input (q, k and v;
    gate and up) share a Hessian, so :class:`GptqCollector` computes this once per Hessian: two Cholesky
    factorisations and an inverse of an [in, in] matrix per Linear otherwise."""

    dead: torch.Tensor
    perm: torch.Tensor
    upper: torch.Tensor
    act_order: bool
    damp: float


def inverse_factor(
    hessian: torch.Tensor,
    *,
    act_order: bool = False,
    damp: float = 0.01,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    what: str = "weight",
) -> InverseFactor:
    """:class:`InverseFactor` of ``hessian`` [in, in], in ``dtype`` on ``device`` (None: the Hessian's)."""
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise DiffquantError(f"{what}: Hessian of shape {tuple(hessian.shape)}, expected a square matrix")
    n = hessian.shape[0]
    H = hessian.detach().to(device=device or hessian.device, dtype=dtype).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    perm = torch.arange(n, device=H.device)
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        H = H[perm][:, perm]
    H += damp * torch.mean(torch.diagonal(H)) * torch.eye(n, dtype=dtype, device=H.device)
    try:
        L = torch.linalg.cholesky(H)
        U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError:
        raise DiffquantError(
            f"{what}: the damped Hessian is not positive definite (damp {damp}); raise damp"
        ) from None
    return InverseFactor(dead, perm, U, act_order, damp)


def gptq_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor | InverseFactor,
    grid: WeightGrid,
    *,
    act_order: bool = False,
    damp: float = 0.01,
    block: int = 128,
    dtype: torch.dtype = torch.float64,
    what: str = "weight",
) -> GroupCodes:
    """GPTQ codes of ``weight`` [out, in] for the Hessian ``hessian`` [in, in] (see the module docstring), or
    for its :func:`inverse_factor` (made with the same ``act_order`` and ``damp``)."""
    grid.check(tuple(weight.shape), what)
    out, n = weight.shape
    shape = tuple(hessian.upper.shape if isinstance(hessian, InverseFactor) else hessian.shape)
    if shape != (n, n):
        raise DiffquantError(f"{what}: Hessian of shape {shape}, expected ({n}, {n})")
    if block < 1:
        raise DiffquantError(f"{what}: block must be >= 1, got {block}")
    W = weight.detach().to(dtype).clone()
    if isinstance(hessian, InverseFactor):
        if (hessian.act_order, hessian.damp) != (act_order, damp):
            raise DiffquantError(
                f"{what}: inverse factor made with act_order {hessian.act_order}, damp {hessian.damp}; "
                f"expected act_order {act_order}, damp {damp}"
            )
        factor = hessian
    else:
        factor = inverse_factor(
            hessian, act_order=act_order, damp=damp, dtype=dtype, device=W.device, what=what
        )
    dead, perm, U = factor.dead, factor.perm, factor.upper.to(device=W.device, dtype=dtype)
    W[:, dead.to(W.device)] = 0.0
    size = grid.size(n)
    groups = grid.groups(n)
    scale = torch.empty(out, groups, dtype=dtype, device=W.device)
    zero = torch.empty(out, groups, dtype=dtype, device=W.device)
    perm = perm.to(W.device)
    if act_order:
        # static groups: every group's parameters from the (dead-zeroed) weights before any update
        for g in range(groups):
            s, z = grid.params(W[:, g * size : (g + 1) * size])
            scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
        W = W[:, perm]
    # The loop runs on W^T [in, out], so that each column of W is a contiguous row (a third of the time of
    # strided columns on a CPU); scale / zero as [groups, out] rows likewise.
    WT = W.T.contiguous()
    CT = torch.empty_like(WT)  # the codes, column by column (permuted order)
    scaleT, zeroT = scale.T.contiguous(), zero.T.contiguous()
    group_of = (perm // size).tolist()  # the group of each (permuted) column
    maxq = float(grid.maxq)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1 = WT[i1:i2].clone()
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not act_order and col % size == 0:
                values = W1[i : i + size]
                if values.shape[0] < size:  # the group runs past this block: add the pending updates
                    rest = WT[i2 : col + size] - U[i1:col, i2 : col + size].T @ E1[:i]
                    values = torch.cat([values, rest], dim=0)
                s_, z_ = grid.params(values.T)
                scaleT[col // size], zeroT[col // size] = s_[:, 0], z_[:, 0]
            g = group_of[col]
            s_, z_ = scaleT[g], zeroT[g]
            w = W1[i]
            c = torch.div(w, s_).round_().add_(z_).clamp_(0.0, maxq)  # grid.codes, in place
            CT[col] = c
            err = E1[i]
            torch.sub(w, (c - z_).mul_(s_), out=err).div_(U1[i, i])
            W1[i:].addr_(U1[i, i:], err, alpha=-1.0)  # the columns after this one in the block
        WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)  # the lazy batch update of the rest
    scale, zero = scaleT.T.contiguous(), zeroT.T.contiguous()
    codes = CT[torch.argsort(perm)].T
    return GroupCodes(codes.to(torch.uint8), scale, zero, grid)


# ----------------------------------------------------------------------------------- as a weight method
class GptqCollector:
    """GPTQ's calibration over one stage (:class:`~diffquant.quant.methods.StageCollector`): each Linear's
    Hessian from its input (the tap's input: after an online rotation R4, what the weight multiplies);
    Linears that read the same tensor (q, k and v; gate and up) share one Hessian."""

    def __init__(self, pairs: list, modules: Sequence[nn.Module]) -> None:
        self.pairs = pairs
        self.hessians: dict[int, Hessian] = {}  # owner index -> its Hessian
        self.alias: dict[int, int] = {}  # linear index -> the index whose Hessian it shares
        # the first batch: the input tensor's identity -> (first linear reading it, the tensor: held, so that
        # its memory is not reused by a later tensor of the same shape within the batch)
        self.seen: dict[tuple, tuple[int, torch.Tensor]] = {}

    def attach(self) -> list:
        return [
            linear.input.register_forward_pre_hook(self._hook(i)) for i, (linear, _) in enumerate(self.pairs)
        ]

    def _hook(self, index: int) -> Callable:
        def record(_module: nn.Module, args: tuple) -> None:
            x = args[0]
            if index not in self.alias:  # the first batch: who reads the same tensor as whom
                ident = (x.data_ptr(), x._version, tuple(x.shape))
                self.alias[index] = self.seen.setdefault(ident, (index, x))[0]
                if len(self.alias) == len(self.pairs):
                    self.seen.clear()  # every reader placed: the first batch's inputs need not be held
            owner = self.alias[index]
            if owner == index:
                if owner not in self.hessians:
                    self.hessians[owner] = Hessian(x.shape[-1], device=x.device)
                self.hessians[owner].add(x)

        return record

    def finish(self, stats: WeightStats) -> None:
        held = sum(h.matrix.numel() * h.matrix.element_size() for h in self.hessians.values())
        stats.hessian_bytes = max(stats.hessian_bytes, held)
        factors: dict[tuple, InverseFactor] = {}
        for i, (linear, q) in enumerate(self.pairs):
            owner = self.alias.get(i, i)
            hessian = self.hessians.get(owner)
            if hessian is None:
                raise DiffquantError(f"{q.site}: calibration never reached this Linear (no Hessian)")
            spec = q.spec
            key = (owner, spec.act_order, spec.damp, linear.weight.device)
            if key not in factors:  # once per shared Hessian (q, k, v; gate, up)
                factors[key] = inverse_factor(
                    hessian.matrix,
                    act_order=spec.act_order,
                    damp=spec.damp,
                    device=linear.weight.device,
                    what=q.site,
                )
            codes = gptq_codes(
                linear.weight,
                factors[key],
                spec.grid,
                act_order=spec.act_order,
                damp=spec.damp,
                block=spec.lazy_batch,
                what=q.site,
            )
            q.set_codes(codes)
            stats.linears += 1
            stats.tokens = max(stats.tokens, hessian.tokens)
        self.hessians.clear()
        self.seen.clear()


register(
    WeightMethod(
        "gptq",
        "codes chosen column by column against each Linear's calibration inputs (its Hessian)",
        options=("act_order", "damp", "lazy_batch"),
        collector=GptqCollector,
        collects="each Linear's input Hessian",
    )
)
