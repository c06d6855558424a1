"""GPTQ (diffquant.quant.gptq) against a reference written here from the paper's equations.

The reference (:func:`ref_gptq`) is the OBS / OBQ form of Frantar et al. 2022 (arXiv 2210.17323): an explicit
inverse of the damped Hessian, one column q at a time

    delta_F = -(w_q - quant(w_q)) / [H_F^-1]_qq * (H_F^-1)_{:, q}
    H_F^-1 <- H_F^-1 - (H_F^-1)_{:, q} (H_F^-1)_{q, :} / [H_F^-1]_qq

(Gaussian elimination of q from the inverse), with no Cholesky factor and no blocking, so it checks the
Cholesky / lazy-batch form of the module. The quantization grid (:func:`ref_params`, :func:`ref_quant`) is
written from the weightcodes module docstring, not imported from it.
"""

from __future__ import annotations

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.quant.gptq import Hessian, gptq_codes
from diffquant.quant.weightcodes import WeightGrid, rtn_codes

D = torch.float64


# --------------------------------------------------------------------------------------------- reference


def ref_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [rows] of the group values ``w`` [rows, n], one row at a time."""
    maxq = 2**bits - 1
    scales, zeros = [], []
    for row in w.tolist():
        if sym:
            s = 2 * max(abs(v) for v in row) / maxq
            s = s if s > 0 else 1.0
            z = float(2 ** (bits - 1))
        else:
            lo, hi = min(min(row), 0.0), max(max(row), 0.0)
            s = (hi - lo) / maxq
            s = s if s > 0 else 1.0
            z = float(torch.round(torch.tensor(-lo / s, dtype=D)))
        scales.append(s)
        zeros.append(z)
    return torch.tensor(scales, dtype=D), torch.tensor(zeros, dtype=D)


def ref_quant(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """(clamp(round(w / s) + z, 0, 2^b - 1) - z) * s, elementwise (w, s, z broadcast together)."""
    q = torch.clamp(torch.round(w / s) + z, 0, 2**bits - 1)
    return (q - z) * s


def tie_margin(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> float:
    """How far w / s is from a rounding tie whose two sides give different codes (inf: none).

    The symmetric grid puts a group's negative extreme exactly on a tie (w / s = -2^(b-1) + 1/2), where the
    last bit of w decides the code; the tests below use data whose ties never matter, so that two exact
    computations (the reference here, the module's blocked Cholesky form) must agree to 1e-9."""
    t = w / s
    lo, hi = torch.clamp(torch.floor(t) + z, 0, 2**bits - 1), torch.clamp(torch.ceil(t) + z, 0, 2**bits - 1)
    d = (t - torch.floor(t) - 0.5).abs()
    d = torch.where(lo != hi, d, torch.full_like(d, float("inf")))
    return float(d.min())


def ref_rtn(W: torch.Tensor, bits: int, group: int | None, sym: bool) -> torch.Tensor:
    out, n = W.shape
    size = n if group is None else group
    Q = torch.empty_like(W)
    for g in range(-(-n // size)):  # the last group partial when the size does not divide
        cols = slice(g * size, (g + 1) * size)
        s, z = ref_params(W[:, cols], bits, sym)
        Q[:, cols] = ref_quant(W[:, cols], s[:, None], z[:, None], bits)
    return Q


def ref_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    group: int | None,
    sym: bool,
    act_order: bool = False,
    damp: float = 0.01,
) -> tuple[torch.Tensor, float]:
    """Dequantized GPTQ weight by the per-column OBS update on the explicit inverse Hessian, and the
    smallest :func:`tie_margin` met on the way."""
    W = W.clone().to(D)
    H = H.clone().to(D)
    out, n = W.shape
    size = n if group is None else group
    for j in range(n):
        if H[j, j] == 0:  # dead input
            H[j, j] = 1.0
            W[:, j] = 0.0
    diag = [float(H[j, j]) for j in range(n)]
    H = H + damp * (sum(diag) / n) * torch.eye(n, dtype=D)
    Hinv = torch.linalg.inv(H)
    params: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if act_order:
        order = sorted(range(n), key=lambda j: -diag[j])  # stable: ties keep index order
        for g in range(-(-n // size)):  # static groups, from the weights before any update
            params[g] = ref_params(W[:, g * size : (g + 1) * size], bits, sym)
    else:
        order = list(range(n))
    Q = torch.zeros_like(W)
    margin = float("inf")
    for q in order:
        g = q // size
        if not act_order and q % size == 0:  # group parameters from the current (updated) weights
            params[g] = ref_params(W[:, q : q + size], bits, sym)
        s, z = params[g]
        Q[:, q] = ref_quant(W[:, q], s, z, bits)
        margin = min(margin, tie_margin(W[:, q], s, z, bits))
        d = Hinv[q, q]
        W = W - ((W[:, q] - Q[:, q]) / d)[:, None] * Hinv[:, q][None, :]
        Hinv = Hinv - torch.outer(Hinv[:, q], Hinv[q, :]) / d
    return Q, margin


def linear(seed: int, out: int, n: int, tokens: int = 300, dead: tuple[int, ...] = ()):
    """A random weight [out, n], correlated inputs X [tokens, n] (channels ``dead`` zero) and H = 2 X^T X / N."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g, dtype=D)
    X = torch.randn(tokens, n, generator=g, dtype=D) @ torch.randn(n, n, generator=g, dtype=D)
    X = X + 0.5 * torch.randn(1, n, generator=g, dtype=D)  # a mean offset, as activations have
    X[:, list(dead)] = 0.0
    return W, X, 2 * X.T @ X / tokens


def tie_free(seed: int, out: int, n: int, configs, *, dead: tuple[int, ...] = (), reshape=None):
    """The first ``linear(seed + 1000 k, ...)`` (H through ``reshape``) whose reference runs for every
    (bits, group, sym, act_order) of ``configs`` stay 1e-7 clear of rounding ties; W, X, H and the
    reference results."""
    for k in range(60):
        W, X, H = linear(seed + 1000 * k, out, n, dead=dead)
        if reshape is not None:
            H = reshape(H)
        refs = {c: ref_gptq(W, H, *c) for c in configs}
        if all(m > 1e-7 for _, m in refs.values()):
            return W, X, H, {c: q for c, (q, _) in refs.items()}
    raise AssertionError("no tie-free data")


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# --------------------------------------------------------------------------------------------- tests

# group 24 on 64 inputs: groups of 24, 24 and a partial 16 (as GPTQ's code does for SmolLM2's 576 = 4.5 x 128)
GRIDS = [(bits, group, sym) for bits in (3, 4) for group in (None, 16, 24, 32) for sym in (True, False)]


@pytest.mark.parametrize("bits,group,sym", GRIDS)
def test_matches_reference(bits, group, sym):
    W, X, H, refs = tie_free(100 + bits + (group or 0) + sym, 12, 64, [(bits, group, sym, False)])
    ref = refs[bits, group, sym, False]
    got = gptq_codes(W, H, WeightGrid(bits, group, sym), block=1).dequantize()
    assert got.dtype == D and got.shape == W.shape
    assert maxdiff(got, ref) < 1e-9
    # and the default (blocked) form too
    assert maxdiff(gptq_codes(W, H, WeightGrid(bits, group, sym)).dequantize(), ref) < 1e-9
    # it is not round-to-nearest (the updates matter)
    assert maxdiff(ref, ref_rtn(W, bits, group, sym)) > 1e-3


def scrambled_diagonal(H: torch.Tensor) -> torch.Tensor:
    """H with its diagonal made far from monotone, so act-order really reorders across groups."""
    n = H.shape[0]
    scale = torch.linspace(0.3, 3.0, n, dtype=D)[
        torch.randperm(n, generator=torch.Generator().manual_seed(5))
    ]
    return scale[:, None] * H * scale[None, :]


@pytest.mark.parametrize(
    "bits,group,sym", [(4, 16, True), (4, 32, False), (3, 16, False), (4, None, True), (4, 24, False)]
)
def test_act_order_matches_reference(bits, group, sym):
    configs = [(bits, group, sym, True), (bits, group, sym, False)]
    W, X, H, refs = tie_free(200 + bits + (group or 0) + sym, 10, 64, configs, reshape=scrambled_diagonal)
    ref = refs[bits, group, sym, True]
    grid = WeightGrid(bits, group, sym)
    for block in (1, 128):
        got = gptq_codes(W, H, grid, act_order=True, block=block)
        assert maxdiff(got.dequantize(), ref) < 1e-9
    # static groups: the stored scales / zero points are the round-to-nearest ones of the original weight
    rtn = rtn_codes(W, grid)
    assert torch.equal(got.scale, rtn.scale) and torch.equal(got.zero, rtn.zero)
    assert maxdiff(ref, refs[bits, group, sym, False]) > 1e-6


@pytest.mark.parametrize(
    "group,blocks,act_order",
    [
        (None, (1, 7, 32, 128), False),
        (16, (1, 7, 32, 128), False),
        (32, (1, 7, 24, 32, 128), False),
        (16, (1, 7, 24, 128), True),
    ],
)
def test_block_size_invariant(group, blocks, act_order):
    configs = [(4, group, sym, act_order) for sym in (True, False)]
    W, X, H, refs = tie_free(300 + (group or 0), 9, 96, configs)
    for sym in (True, False):
        grid = WeightGrid(4, group, sym)
        results = [gptq_codes(W, H, grid, block=b, act_order=act_order) for b in blocks]
        first = results[0].dequantize()
        for r in results[1:]:
            assert maxdiff(r.dequantize(), first) < 1e-9
            assert maxdiff(r.scale, results[0].scale) < 1e-9


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_dead_columns(act_order, sym):
    dead = (0, 5, 17, 18, 40)
    W, X, H, refs = tie_free(400 + sym, 8, 48, [(4, 16, sym, act_order)], dead=dead)
    assert all(float(H[j, j]) == 0 for j in dead)
    assert float(W[:, list(dead)].abs().min()) > 0  # the weight itself is not 0 there
    grid = WeightGrid(4, 16, sym)
    got = gptq_codes(W, H, grid, act_order=act_order, block=7)
    Q = got.dequantize()
    assert torch.isfinite(Q).all()
    assert torch.equal(Q[:, list(dead)], torch.zeros(8, len(dead), dtype=D))
    assert maxdiff(Q, refs[4, 16, sym, act_order]) < 1e-9
    # the groups' parameters are computed with the dead columns at 0
    Wz = W.clone()
    Wz[:, list(dead)] = 0.0
    s, z = ref_params(Wz[:, 0:16], 4, sym)  # the first group: nothing updated before it starts
    assert maxdiff(got.scale[:, 0], s) < 1e-12 and torch.equal(got.zero[:, 0], z)


def objective(W: torch.Tensor, Q: torch.Tensor, X: torch.Tensor) -> float:
    return float(((W - Q) @ X.T).pow(2).sum())


@pytest.mark.parametrize("sym", [True, False])
def test_objective_beats_rtn(sym):
    for seed in range(6):
        for bits, group in ((3, None), (4, 16), (4, 32), (3, 8)):
            out, n = (8 + 3 * seed, 32 * (1 + seed % 3))
            W, X, H = linear(500 + seed, out, n, tokens=200 + 20 * seed)
            grid = WeightGrid(bits, group, sym)
            rtn = ref_rtn(W, bits, group, sym)
            codes = rtn_codes(W, grid)
            assert codes.codes.dtype == torch.uint8
            assert torch.equal(codes.dequantize(), rtn)  # the module's RTN is exactly the grid formula
            for act_order in (False, True):
                Q = gptq_codes(W, H, grid, act_order=act_order).dequantize()
                assert objective(W, Q, X) <= objective(W, rtn, X), (seed, bits, group, act_order)


def test_rtn_grid_details():
    # exact values: sym 4-bit over [-1.5, 0.75]: s = 2 * 1.5 / 15 = 0.2, z = 8; asym: s = 2.25 / 15, z = 10
    W = torch.tensor([[-1.5, 0.75, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D)
    sym = rtn_codes(W, WeightGrid(4, None, True))
    assert torch.allclose(sym.scale[:, 0], torch.tensor([0.2, 1.0], dtype=D), rtol=0, atol=1e-15)
    assert torch.equal(sym.zero[:, 0], torch.tensor([8.0, 8.0], dtype=D))
    assert sym.codes.tolist() == [[0, 12, 8, 8], [8, 8, 8, 8]]
    asym = rtn_codes(W, WeightGrid(4, None, False))
    assert torch.allclose(asym.scale[:, 0], torch.tensor([0.15, 1.0], dtype=D), rtol=0, atol=1e-15)
    assert torch.equal(asym.zero[:, 0], torch.tensor([10.0, 0.0], dtype=D))
    assert asym.codes.tolist() == [[0, 15, 11, 10], [0, 0, 0, 0]]
    assert torch.equal(asym.dequantize()[1], torch.zeros(4, dtype=D))


def test_hessian_accumulates():
    g = torch.Generator().manual_seed(7)
    batches = [
        torch.randn(3, 11, 24, generator=g),
        torch.randn(50, 24, generator=g, dtype=D),
        torch.randn(0, 24),
        torch.randn(2, 1, 7, 24, generator=g, dtype=torch.float16),
    ]
    h = Hessian(24)
    for x in batches:
        h.add(x)
    X = torch.cat([x.reshape(-1, 24).to(D) for x in batches])
    want = 2 * X.T @ X / X.shape[0]
    assert h.tokens == X.shape[0] == 33 + 50 + 14
    assert h.matrix.dtype == D
    # float32 / float16 batches: X^T X in float32 (the reference code's precision), summed in float64
    assert float((h.matrix - want).abs().max() / want.abs().max()) < 1e-6
    h64 = Hessian(24)
    for x in batches:
        h64.add(x.to(D))
    assert float((h64.matrix - want).abs().max() / want.abs().max()) < 1e-12  # float64 batches: exact


def test_errors():
    W, X, H = linear(1, 8, 40)
    with pytest.raises(DiffquantError, match="group 48 is wider than the 40 input channels") as e:
        gptq_codes(W, H, WeightGrid(4, 48, True))
    assert "\n" not in str(e.value)
    with pytest.raises(DiffquantError, match="group 48"):
        rtn_codes(W, WeightGrid(4, 48, True))
    with pytest.raises(DiffquantError, match="Hessian") as e:
        gptq_codes(W, H[:32, :32], WeightGrid(4, 8, True))
    assert "\n" not in str(e.value)
    with pytest.raises(DiffquantError, match="Hessian"):
        gptq_codes(W, H[None], WeightGrid(4, 8, True))


@pytest.mark.parametrize("act_order", [False, True])
def test_a_shared_inverse_factor_gives_the_same_codes(act_order):
    """Linears that read one input share a Hessian, so GPTQ factors it once (:func:`inverse_factor`): the
    codes from the factor are those from the Hessian, bit for bit, for each weight quantized with it (dead
    inputs included); a factor made with other settings is refused in one line."""
    from diffquant.quant.gptq import inverse_factor

    W, X, H = linear(600, 12, 48)
    H = scrambled_diagonal(H)
    H[:, 7] = H[7, :] = 0.0  # a dead input
    grid = WeightGrid(4, 16, False)
    factor = inverse_factor(H, act_order=act_order, damp=0.02)
    for w in (W, W.flip(0) * 1.5):  # two weights, one factor
        a = gptq_codes(w, factor, grid, act_order=act_order, damp=0.02)
        b = gptq_codes(w, H, grid, act_order=act_order, damp=0.02)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
        assert torch.equal(a.dequantize()[:, 7], torch.zeros(12, dtype=D))
    with pytest.raises(DiffquantError, match="inverse factor made with act_order") as e:
        gptq_codes(W, factor, grid, act_order=act_order, damp=0.01)
    assert "\n" not in str(e.value)
    with pytest.raises(DiffquantError, match=r"Hessian of shape \(48, 48\), expected \(40, 40\)"):
        gptq_codes(W[:, :40], factor, WeightGrid(4, 8, False), act_order=act_order, damp=0.02)


def test_linears_sharing_a_hessian_share_one_factorisation(monkeypatch):
    """A layer's q, k and v read one tensor, gate and up another: GPTQ factors 4 Hessians per layer (q/k/v,
    o, gate/up, down), not one per Linear (7)."""
    from conftest import tiny_model

    from diffquant.quant import QuantPlan, apply_plan, calibrate
    from diffquant.quant import gptq as module

    made = []
    original = module.inverse_factor
    monkeypatch.setattr(module, "inverse_factor", lambda h, **kw: made.append(h.shape) or original(h, **kw))
    model = tiny_model("baseline")
    apply_plan(model, QuantPlan.from_dict({"weights": {"method": "gptq", "format": "int4", "group": 16}}))
    ids = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    calibrate(model, ids, batch_size=2)
    d, ffn = model.config.d_model, model.config.ffn_dim
    per_layer = [
        (d, d),
        (d, d),
        (d, d),
        (ffn, ffn),
    ]  # q/k/v, o (its input: heads x head dim = d), gate/up, down
    assert made == per_layer * model.config.n_layers
