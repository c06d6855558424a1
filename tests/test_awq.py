"""AWQ (diffquant.quant.awq) against a float64 reference written here from the paper (Lin et al., MLSys 2024,
section 3.2 and the authors' ``auto_scale.py``), on the folded model, and on its own edge cases.

The reference is independent of the module: its own group-wise round-to-nearest written from the GPTQ grid's
formula (first checked against ``rtn_codes``), its own s = s_X^alpha with the clamp and the normalisation, and
the loss written as the paper's matrix product ``Q(W diag(s)) diag(s)^-1 X^T - W X^T`` rather than the
module's ``X (Q(W s) / s - W)^T``. Tiny tensors: the whole file runs in a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.quant.awq import (
    MAX_TOKENS,
    ChannelMeans,
    activation_scale,
    awq_codes,
    search_scales,
)
from diffquant.quant.weightcodes import WeightGrid, rtn_codes

GRIDS = {
    "4b-channel-sym": WeightGrid(4, None, True),
    "4b-channel-asym": WeightGrid(4, None, False),
    "4b-g32-sym": WeightGrid(4, 32, True),
    "4b-g32-asym": WeightGrid(4, 32, False),
}


# ------------------------------------------------------------------------------------------- reference


def ref_quantize(w: torch.Tensor, bits: int, group: int | None, sym: bool) -> torch.Tensor:
    """Quantize-dequantize of ``w`` [out, in] (float64), group by group, from the grid's formula:
    asym: lo = min(min w, 0), hi = max(max w, 0), s = (hi - lo) / (2^b - 1), z = round(-lo / s);
    sym: s = 2 max|w| / (2^b - 1), z = 2^(b-1); s = 1 where it is 0; q = clamp(round(w / s) + z, 0, 2^b - 1);
    the value (q - z) s. The last group is partial when ``group`` does not divide the width."""
    maxq = 2**bits - 1
    out = torch.empty_like(w)
    width = w.shape[1] if group is None else group
    for a in range(0, w.shape[1], width):
        g = w[:, a : a + width]
        if sym:
            s = 2 * g.abs().max(dim=1, keepdim=True).values / maxq
            z = torch.full_like(s, 2 ** (bits - 1))
            s[s == 0] = 1.0
        else:
            lo = g.min(dim=1, keepdim=True).values.clamp(max=0)
            hi = g.max(dim=1, keepdim=True).values.clamp(min=0)
            s = (hi - lo) / maxq
            s[s == 0] = 1.0
            z = torch.round(-lo / s)
        q = torch.clamp(torch.round(g / s) + z, 0, maxq)
        out[:, a : a + width] = (q - z) * s
    return out


def ref_scales(s_x: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = s_X^alpha, clamped at 1e-4, divided by sqrt(max s * min s); stored as float32."""
    s = s_x.double() ** alpha
    s = torch.where(s < 1e-4, torch.full_like(s, 1e-4), s)
    s = s / torch.sqrt(s.max() * s.min())
    return s.float()


def ref_loss(weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor | None, grid: WeightGrid) -> float:
    """sum_i || Q(W_i diag(s)) diag(s)^-1 X^T - W_i X^T ||_F^2 in float64."""
    s64 = torch.ones(x.shape[1], dtype=torch.float64) if s is None else s.double()
    total = 0.0
    for w in weights:
        w = w.double()
        q = ref_quantize(w @ torch.diag(s64), grid.bits, grid.group_size, grid.sym)
        err = q @ torch.diag(1 / s64) @ x.double().T - w @ x.double().T
        total += float((err**2).sum())
    return total


def ref_search(s_x: torch.Tensor, weights: list[torch.Tensor], x: torch.Tensor, grid: WeightGrid, n: int):
    """(scales, alpha, losses) of the grid search over alpha = k / n, k = 0 .. n - 1; the first minimum."""
    losses = [ref_loss(weights, x, ref_scales(s_x, k / n), grid) for k in range(n)]
    k = min(range(n), key=lambda i: (losses[i], i))
    return ref_scales(s_x, k / n), k / n, losses


# ------------------------------------------------------------------------------------------------ data


def layer(seed: int, width: int = 64, salient: int = 4, dead: bool = True, tokens: int = 96):
    """Activations [tokens, width] with ``salient`` channels of large |x| (x 25) and optionally one channel
    that never fires, and a q/k/v-like group of three weights reading them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    cols = torch.randperm(width, generator=g)[: salient + 1]
    x[:, cols[:salient]] *= 25.0
    if dead:
        x[:, cols[salient]] = 0.0
    weights = [torch.randn(rows, width, generator=g, dtype=torch.float64) for rows in (24, 8, 8)]
    return x, weights


def rms_norm(h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * gain


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_reference_quantizer_is_rtn_codes(grid: WeightGrid, width: int) -> None:
    """The test's own quantize-dequantize equals rtn_codes' (a partial last group at width 80), and AWQ codes
    with s = 1 are the RTN codes."""
    w = torch.randn(12, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64)
    w[3, :32] = 0.0  # an all-zero group
    ref = ref_quantize(w, grid.bits, grid.group_size, grid.sym)
    assert torch.equal(rtn_codes(w, grid).dequantize(), ref)
    plain = awq_codes(w, torch.ones(width), grid)
    assert torch.equal(plain.codes, rtn_codes(w, grid).codes)
    assert torch.equal(plain.dequantize(), ref)


def test_activation_scale_and_channel_means() -> None:
    """mean |x| per channel over every leading dim, in float64; the running mean over batches the same."""
    x = torch.randn(3, 50, 16, generator=torch.Generator().manual_seed(1)) * torch.linspace(-3, 3, 16)
    want = x.double().abs().reshape(-1, 16).mean(0)
    got = activation_scale(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    acc = ChannelMeans(16)
    for part in (x[0], x[1, :7], x[1, 7:], x[2]):
        acc.add(part)
    assert acc.tokens == 150
    torch.testing.assert_close(acc.mean, want, rtol=1e-12, atol=0)
    assert torch.equal(acc.sample, x.reshape(-1, 16))  # fewer rows than max_tokens: all kept


def test_token_sample_is_bounded_strided_and_split_independent() -> None:
    """The kept rows are every stride-th row of all the rows added (stride a power of two), between
    max_tokens / 2 and max_tokens of them, whatever the batch sizes."""
    rows = torch.arange(1000 * 2, dtype=torch.float32).reshape(1000, 2)
    samples = []
    for sizes in ([1000], [1] * 13 + [987], [333, 334, 333], [64] * 15 + [40]):
        acc = ChannelMeans(2, max_tokens=100)
        start = 0
        for n in sizes:
            acc.add(rows[start : start + n])
            start += n
        assert acc.tokens == 1000 and acc.stride == 16
        assert 50 < acc.sample.shape[0] <= 100
        torch.testing.assert_close(acc.mean, rows.double().abs().mean(0), rtol=1e-12, atol=0)
        samples.append(acc.sample)
    for s in samples:
        assert torch.equal(s, rows[::16])
    assert MAX_TOKENS == 4096


@pytest.mark.parametrize("n_grid", [20, 7])
@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_search_matches_reference(grid: WeightGrid, n_grid: int) -> None:
    """Scales, alpha and every grid point's loss equal the reference's; the chosen loss is the minimum and
    never above round-to-nearest's, which is the loss at alpha = 0."""
    x, weights = layer(seed=7)
    s_x = x.abs().mean(0)
    found = search_scales(s_x, weights, x, grid, n_grid=n_grid)
    scales, alpha, losses = ref_search(s_x, weights, x, grid, n_grid)
    assert found.scales.dtype == torch.float32 and found.scales.shape == (64,)
    assert torch.equal(found.scales, scales)
    assert found.alpha == alpha
    assert len(found.losses) == n_grid
    torch.testing.assert_close(torch.tensor(found.losses), torch.tensor(losses), rtol=1e-9, atol=0)
    rtn = ref_loss(weights, x, None, grid)
    assert found.rtn_loss == pytest.approx(rtn, rel=1e-9)
    assert found.losses[0] == found.rtn_loss  # alpha = 0 is s = 1: RTN exactly
    assert found.loss == min(found.losses) <= found.rtn_loss
    assert found.loss == found.losses[round(found.alpha * n_grid)]
    assert found.alpha > 0  # salient channels: some scaling pays


def test_awq_beats_rtn_on_salient_channels_and_the_folded_model_has_the_search_loss() -> None:
    """A norm + q/k/v group whose input has 4 salient channels of 64: folding 1 / s into the norm's gain and
    quantizing W diag(s) gives an output error equal to the search's loss, and well below RTN's."""
    grid = GRIDS["4b-g32-sym"]
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(128, 64, generator=g, dtype=torch.float64)
    gain = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    gain[torch.randperm(64, generator=g)[:4]] *= 30.0  # the norm makes 4 channels salient
    _, weights = layer(seed=4)
    h = rms_norm(raw, gain)
    found = search_scales(activation_scale(h), weights, h, grid)
    s = found.scales.double()
    h_folded = rms_norm(raw, gain / s)  # the caller folds 1 / s into the norm
    awq_err = rtn_err = 0.0
    for w in weights:
        ref = h @ w.T
        awq_err += float(((h_folded @ awq_codes(w, found.scales, grid).dequantize().T - ref) ** 2).sum())
        rtn_err += float(((h @ rtn_codes(w, grid).dequantize().T - ref) ** 2).sum())
    assert awq_err == pytest.approx(found.loss, rel=1e-9)
    assert rtn_err == pytest.approx(found.rtn_loss, rel=1e-9)
    ratio = awq_err / rtn_err
    print(f"AWQ / RTN output error: {ratio:.3f} (alpha {found.alpha})")
    assert ratio < 0.6  # measured 0.50 (alpha 0.25)


def test_folding_is_exact() -> None:
    """norm gain / s and W diag(s) compute the same float output as before (float64, to 1e-12)."""
    x, weights = layer(seed=11, dead=False)
    gain = torch.rand(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    found = search_scales(activation_scale(x), weights, x, GRIDS["4b-g32-asym"])
    s = found.scales.double()
    for w in weights:
        before = rms_norm(x, gain) @ w.T
        after = rms_norm(x, gain / s) @ (w * s).T
        torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)


def test_ties_go_to_the_smallest_alpha() -> None:
    """Equal mean |x| on every channel: every alpha gives s = 1 and the same loss; alpha 0 is chosen."""
    x, weights = layer(seed=5, salient=0, dead=False)
    found = search_scales(torch.full((64,), 0.8, dtype=torch.float64), weights, x, GRIDS["4b-g32-sym"])
    assert len(set(found.losses)) == 1
    assert found.alpha == 0.0
    assert torch.equal(found.scales, torch.ones(64))


def test_bad_inputs_are_one_line_errors() -> None:
    x, weights = layer(seed=2, dead=False)
    s_x = x.abs().mean(0)
    grid = GRIDS["4b-g32-sym"]
    cases = [
        (lambda: search_scales(s_x[:63], weights, x, grid), "63"),
        (lambda: search_scales(s_x, [weights[0][:, :63]], x, grid), "input channels"),
        (lambda: search_scales(s_x, weights, x[:0], grid), "no activation rows"),
        (lambda: search_scales(s_x, weights, x[:, :32], grid), "expected"),
        (lambda: search_scales(s_x, [], x, grid), "no weights"),
        (lambda: search_scales(s_x, weights, x * float("nan"), grid), "non-finite"),
        (lambda: search_scales(s_x * float("inf"), weights, x, grid), "finite"),
        (lambda: search_scales(s_x, [weights[0] * float("inf")], x, grid), "non-finite"),
        (lambda: search_scales(s_x, weights, x, grid, n_grid=0), "n_grid"),
        (lambda: awq_codes(weights[0], torch.ones(63), grid), "scales"),
        (lambda: awq_codes(weights[0], torch.zeros(64), grid), "> 0"),
        (lambda: activation_scale(x[:0]), "no activation rows"),
        (lambda: ChannelMeans(64).mean, "no activations"),
        (lambda: ChannelMeans(64).add(x[:, :8]), "width"),
    ]
    for call, text in cases:
        with pytest.raises(DiffquantError, match=text) as info:
            call()
        assert "\n" not in str(info.value)
