"""HQQ, Half-Quadratic Quantization (Badri & Shaji 2023, "Half-Quadratic Quantization of Large Machine Learning
Models", https://mobiusml.github.io/hqq_blog/): the zero point of each group is optimised, with the scale
fixed, so that the dequantized weight fits the float weight under a sparsity-promoting l_p loss (p < 1).

HQQ is data-free: unlike GPTQ it needs no calibration inputs and no Hessian, only the weight itself, so it
costs a few passes over each weight matrix. Weights are heavy-tailed (a few outliers stretch a group's
min/max range); an l_p loss with p < 1 tolerates a few large errors in exchange for a closer fit of the
bulk of the group, which a least-squares fit would not. It optimises the zero point only, so it is
asymmetric; its zero is a float, not an integer code as on the GPTQ grid. (On heavy-tailed weights at 2 and
3 bits round-to-nearest with its integer zero, which puts a level on 0, can still do better: see
tests/test_hqq.py.)

The problem for one group is min_z ||W - (Q_z(W) - z) s||_p^p with Q_z(W) = clamp(round(W / s + z)). HQQ
splits it with an auxiliary W_e (the half-quadratic splitting): min_{z, W_e} ||W_e||_p^p
+ beta/2 ||W_e - (W - (Q_z(W) - z) s)||_2^2, solved by alternating (the paper's equations, written here
from them, on this package's ``(q - z) * s`` convention; the paper's code and optimum-quanto store an
inverse scale, or a shift ``z * s``, instead):

1. init: asymmetric min/max over the group, ``s = (max w - min w) / (2^b - 1)``, ``z = -min w / s`` (a float:
   HQQ's zero point is not rounded, and 0 need not be on the grid; a constant group gets ``s = 1``);
2. W_q = clamp(round(W / s + z), 0, 2^b - 1), W_r = (W_q - z) s;
3. W_e = shrink_lp(W - W_r), the generalised soft-thresholding operator of the l_p norm:
   ``sign(x) relu(|x| - |x|^(p-1) / beta)``;
4. z = mean over the group of (W_q - (W - W_e) / s), the closed-form minimiser of the quadratic term;
5. beta *= kappa (the quadratic coupling tightens), and back to 2.

The error is tracked as mean |W - W_r| over the whole weight (as the reference algorithm does); with
``early_stop`` the loop ends at the first update that does not lower it, and the best zero points are kept
(the reference code, which evaluates the error one update late, returns the zero of the non-improving step
instead; optimum-quanto's HqqOptimizer keeps the best, as here). Without ``early_stop`` all ``iters``
updates are applied and the last is returned. The result is a :class:`GroupCodes` on the same storage as
round-to-nearest and GPTQ (codes 0 .. 2^b - 1, float scale and zero per output row and group). A group size
that does not divide the input width leaves a partial last group (as for the other methods); it is
optimised with the full groups, under the one stopping rule. The error is summed in float64.
"""

from __future__ import annotations

import torch

from diffquant.errors import DiffquantError
from diffquant.formats import minmax_params
from diffquant.quant.methods import WeightMethod, register
from diffquant.quant.weightcodes import GroupCodes, WeightGrid


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The proximal (generalised soft-thresholding) operator of ||.||_p^p / beta: for p = 1 the soft threshold
    ``sign(x) relu(|x| - 1 / beta)``, for p < 1 ``sign(x) relu(|x| - |x|^(p-1) / beta)``."""
    mag = x.abs()
    if p == 1:
        return torch.sign(x) * torch.relu(mag - 1.0 / beta)
    return torch.sign(x) * torch.relu(mag - mag.pow(p - 1) / beta)


def hqq_codes(
    weight: torch.Tensor,
    grid: WeightGrid,
    *,
    iters: int = 20,
    lp_norm: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
    early_stop: bool = True,
    dtype: torch.dtype = torch.float32,
    what: str = "weight",
) -> GroupCodes:
    """HQQ codes of ``weight`` [out, in] on the asymmetric ``grid`` (see the module docstring)."""
    if grid.sym:
        raise DiffquantError(f"{what}: hqq optimises the zero point: sym must be false")
    grid.check(tuple(weight.shape), what)
    if iters < 0:
        raise DiffquantError(f"{what}: hqq iters must be >= 0, got {iters}")
    w = weight.detach().to(dtype)
    out, n = w.shape
    size = grid.size(n)
    full = n - n % size
    # one row per group: the full groups, then (when group_size does not divide the width) the partial
    # last group of each output row; one stopping rule over both
    views = ([w[:, :full].reshape(out * (full // size), size)] if full else []) + (
        [w[:, full:]] if full < n else []
    )
    maxq = grid.maxq

    scales, zeros = [], []
    for view in views:
        lo, hi = view.amin(dim=1, keepdim=True), view.amax(dim=1, keepdim=True)
        scale, zero = minmax_params(lo, hi, maxq, include_zero=False, zero="float")
        scales.append(scale)
        zeros.append(zero)

    def fit(zs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        qs = [torch.clamp(torch.round(v / s + z), 0, maxq) for v, s, z in zip(views, scales, zs, strict=True)]
        rs = [(q - z) * s for q, s, z in zip(qs, scales, zs, strict=True)]
        total = sum(float((v - r).abs().sum(dtype=torch.float64)) for v, r in zip(views, rs, strict=True))
        return qs, rs, total / (out * n)

    qs, w_rs, best = fit(zeros)
    b = float(beta)
    for _ in range(iters):
        new_zeros = [
            torch.mean(q - (v - shrink_lp(v - r, b, lp_norm)) / s, dim=1, keepdim=True)
            for v, q, r, s in zip(views, qs, w_rs, scales, strict=True)
        ]
        new_qs, new_rs, err = fit(new_zeros)
        if early_stop and not err < best:
            break
        zeros, qs, w_rs, best = new_zeros, new_qs, new_rs, err
        b *= kappa

    def rows(parts: list[torch.Tensor]) -> torch.Tensor:
        """The per-view tensors back to [out, columns or groups]."""
        return torch.cat([part.reshape(out, -1) for part in parts], dim=1)

    return GroupCodes(rows(qs).to(torch.uint8), rows(scales), rows(zeros), grid)


register(
    WeightMethod(
        "hqq",
        "data-free; the zero points optimised against an lp-norm of the error, so asymmetric",
        default_sym=False,
        sym_allowed=(False,),
        sym_note="hqq optimises the zero point, so it is asymmetric: sym false",
        codes=lambda weight, spec, what: hqq_codes(weight, spec.grid, what=what),
    )
)
