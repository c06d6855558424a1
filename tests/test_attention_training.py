"""Attention in training (issue 46): the explicit path's recomputed maps and SDPA's own GQA on the fused path.

The clipped softmax is checked against a float64 reference written here from Bondarenko et al. 2023
(arXiv 2306.12929, Sec. 4.1): clip((zeta - gamma) * softmax(x) + gamma, 0, 1), with the layer's projections,
rotate-half RoPE and causal mask spelled out per head. The optimisations themselves must not move a bit:
recomputed maps against kept ones, SDPA's GQA against K / V copied per query head.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from diffquant.models import attention as attention_mod

T = 40
CHUNK = 5  # 8 query chunks of the explicit path


def _ids(batch: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 61, (batch, t), generator=torch.Generator().manual_seed(seed))


def _recompute(model, on: bool) -> None:
    for attn in model.attention_modules():
        attn.recompute_maps = on


def _train_step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------------
# clipped softmax: float64 reference
# ----------------------------------------------------------------------------------------------------
def _reference_clipped_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The clipped kind's attention layer in float64, head by head, from the paper's equation."""
    bsz, t, _ = x.shape
    h, h_kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    gamma, zeta = attn.config.clip_gamma, attn.config.clip_zeta
    q = (x @ attn.q_proj.weight.T).view(bsz, t, h, d)
    k = (x @ attn.k_proj.weight.T).view(bsz, t, h_kv, d)
    v = (x @ attn.v_proj.weight.T).view(bsz, t, h_kv, d)
    # rotate-half RoPE (Su et al. 2021): pair channel i with i + d/2, angle = position * theta^(-2i/d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * attn.config.rope_theta ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(z: torch.Tensor) -> torch.Tensor:
        return z * cos + torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1) * sin

    q, k = rope(q), rope(k)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    heads = []
    for i in range(h):
        g = i // (h // h_kv)  # GQA: output head i reads kv head i // n_rep
        x_logits = (q[:, :, i] @ k[:, :, g].transpose(-1, -2)) / math.sqrt(d)
        p = torch.softmax(x_logits.masked_fill(future, float("-inf")), dim=-1)
        p = torch.clamp((zeta - gamma) * p + gamma, 0.0, 1.0)
        heads.append(p @ v[:, :, g])
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


def test_clipped_attention_matches_the_float64_reference_forward_and_backward():
    """Training mode, recomputed chunks: output and input / weight gradients equal the paper's equation's."""
    model = tiny_model("clipped-wide").double().train()
    model.set_attention_path("explicit", chunk_size=CHUNK)
    attn = model.layers[0].attn
    assert attn.recompute_maps and attn.n_kv_heads < attn.n_heads
    x = torch.randn(
        2, T, model.config.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    w = torch.randn(
        2, T, model.config.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    xa = x.clone().requires_grad_()
    out = attn(xa)
    (out * w).sum().backward()
    grads = {"x": xa.grad, "q_proj": attn.q_proj.weight.grad, "v_proj": attn.v_proj.weight.grad}
    attn.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    ref = _reference_clipped_attention(attn, xr)
    (ref * w).sum().backward()
    ref_grads = {"x": xr.grad, "q_proj": attn.q_proj.weight.grad, "v_proj": attn.v_proj.weight.grad}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-11, msg=name)
    # the clip is engaged at both ends in this test (else it would not tell clipped from plain softmax)
    with torch.no_grad():
        model.set_attention_path("explicit", chunk_size=T)
        seen = []
        hook = attn.probs.register_forward_hook(lambda m, a, o: seen.append(o))
        attn(x)
        hook.remove()
    probs, valid = seen[0], torch.ones(T, T, dtype=torch.bool).tril()
    assert (probs[..., valid] == 0).any() and (probs[..., valid] == 1).any()


# ----------------------------------------------------------------------------------------------------
# recomputed maps: the same bits, no T x S map kept
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("kind", ["clipped", "baseline", "diff_v1", "diff_v2", "sink"])
def test_recomputed_maps_give_the_same_bits(kind, autocast):
    """One training step with each chunk checkpointed equals the step with the maps kept, bit for bit
    (logits and every gradient): the recomputation replays the same ops on the same inputs. Under CPU bf16
    autocast too, which the checkpoint must restore in backward (the trainer autocasts on CUDA)."""
    model = tiny_model(kind).train()
    model.set_attention_path("explicit", chunk_size=CHUNK)
    ids = _ids(t=T + 1)
    results = {}
    for on in (False, True):
        _recompute(model, on)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            results[on] = _train_step(model, ids)
    (logits_kept, grads_kept), (logits_re, grads_re) = results[False], results[True]
    torch.testing.assert_close(logits_re, logits_kept, rtol=0, atol=0)
    assert grads_re.keys() == grads_kept.keys() and grads_kept
    for name, grad in grads_kept.items():
        torch.testing.assert_close(grads_re[name], grad, rtol=0, atol=0, msg=name)


def _saved_maps(model, ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the float (B, H, chunk, S) maps autograd saves for backward during a forward (tensors a
    checkpoint holds back are packed by its own hooks, not these)."""
    heads = model.config.n_heads
    maps = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dim() == 4 and x.shape[1] == heads and x.shape[-2:] == (CHUNK, T):
            maps.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(ids).float().square().mean()
    return maps


def test_training_keeps_no_attention_map_for_backward():
    """The memory point of recomputation: with it no (chunk x S) map is saved for backward; without it,
    several per chunk and layer are (which shows the probe sees them)."""
    model = tiny_model("clipped").train()
    model.set_attention_path("explicit", chunk_size=CHUNK)
    ids = _ids()
    _recompute(model, False)
    kept = _saved_maps(model, ids)
    assert len(kept) >= model.config.n_layers * (T // CHUNK) * 2, kept
    _recompute(model, True)
    assert _saved_maps(model, ids) == []
    with torch.no_grad():  # and nothing is checkpointed when autograd is off
        calls = []
        real = torch.utils.checkpoint.checkpoint
        torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            model(ids)
        finally:
            torch.utils.checkpoint.checkpoint = real
        assert calls == []


@pytest.mark.parametrize("engaged", ["hook", "quantizer"])
def test_an_engaged_map_tap_runs_once_per_chunk(engaged):
    """A hook (a profiler) or a quantizer on a map tap sees each chunk once per step: recomputation would run
    it a second time in backward, so it is off while a map tap is engaged."""
    model = tiny_model("clipped").train()
    model.set_attention_path("explicit", chunk_size=CHUNK)
    calls = []
    taps = model.taps("kind:probs")

    class Count(torch.nn.Module):
        row_local = True

        def forward(self, x, valid):
            calls.append(1)
            return x

    for tap in taps.values():
        if engaged == "hook":
            tap.register_forward_hook(lambda m, a, o: calls.append(1))
        else:
            tap.quantizer = Count()
    _train_step(model, _ids(t=T + 1))
    assert len(calls) == len(taps) * (T // CHUNK)


# ----------------------------------------------------------------------------------------------------
# fused path: SDPA's own GQA and DIFF V2 in one call
# ----------------------------------------------------------------------------------------------------
FUSED = ["baseline", "diff_v1", "diff_v2", "gated", "sink"]


def _spy_sdpa(monkeypatch) -> list[dict]:
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        gqa, mask = kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is not None
        calls.append({"q": q.shape[1], "k": k.shape[1], "gqa": gqa, "mask": mask})
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _incremental(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` fed as a 6-token prefill then one token at a time through the KV cache."""
    cache = model.new_cache()
    out = [model(ids[:, :6], cache)]
    out += [model(ids[:, i : i + 1], cache) for i in range(6, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", [*FUSED, "diff_v2-mha"])
def test_sdpa_gqa_is_bit_identical_to_copied_kv(kind, dtype, monkeypatch):
    """Without autograd the fused path hands SDPA the kv heads unexpanded (enable_gqa) and runs DIFF V2's
    two components as one call over its 2H query heads: the logits equal those of K / V copied per query
    head (the path autograd still takes), bit for bit, in prefill and in cached decoding."""
    name, mha = kind.removesuffix("-mha"), kind.endswith("-mha")
    model = tiny_model(name, **({"n_kv_heads": 4} if mha else {})).to(dtype)
    assert mha or model.config.n_kv_heads < model.config.n_heads
    model.set_attention_path("fused")
    ids = _ids(t=24)
    calls = _spy_sdpa(monkeypatch)
    with torch.no_grad():
        native = model(ids), _incremental(model, ids)
    layers = model.config.n_layers
    if name == "sink":
        assert not any(c["gqa"] for c in calls)  # the sink key is per head: K / V stay copied
    else:
        assert calls and all(c["gqa"] == (c["q"] != c["k"]) for c in calls)
        assert any(c["gqa"] for c in calls)
        assert len(calls) == (1 if name == "diff_v2" else 1 + (name == "diff_v1")) * layers * (2 + 24 - 6)
    calls.clear()
    monkeypatch.setattr(attention_mod, "_records_grad", lambda *tensors: True)  # today's copied-K/V path
    with torch.no_grad():
        copied = model(ids), _incremental(model, ids)
    assert not any(c["gqa"] for c in calls)
    for a, b in zip(native, copied, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["baseline", "diff_v2"])
def test_a_masked_sdpa_call_gets_copied_kv(kind, monkeypatch):
    """SDPA's GQA only where no mask goes in: on CUDA the flash kernel takes enable_gqa but no mask, and a
    masked GQA call falls to the math kernel. Masks come with a sliding window shorter than the prefill and
    with a cached multi-token continuation."""
    model = tiny_model(kind, **({} if kind == "diff_v2" else {"sliding_window": 8}))
    model.set_attention_path("fused")
    calls = _spy_sdpa(monkeypatch)
    ids = _ids(t=24)
    with torch.no_grad():
        model(ids)
        model(ids[:, :6])  # within the window: causal, no mask
        cache = model.new_cache()
        model(ids[:, :10], cache)
        model(ids[:, 10:14], cache)
    masked = [c for c in calls if c["mask"]]
    assert masked and not any(c["gqa"] for c in masked)
    assert any(c["gqa"] for c in calls if not c["mask"])


@pytest.mark.parametrize("kind", FUSED)
def test_training_copies_kv_so_gradients_stay_as_they_were(kind, monkeypatch):
    """Under autograd K / V are still copied per query head (SDPA's GQA backward sums a group's dK / dV in
    another order): every call has as many kv heads as query heads. Switching NATIVE_GQA_WITH_GRAD on leaves
    the logits and moves the gradients by rounding only (measured on CPU, fp32: up to 3e-7 of a parameter's
    largest gradient; 2.4e-5 on DIFF V1's lambda vectors, whose gradients are sums with cancellation)."""
    model = tiny_model(kind).train()
    model.set_attention_path("fused")
    ids = _ids(t=T + 1)
    calls = _spy_sdpa(monkeypatch)
    logits, grads = _train_step(model, ids)
    assert calls and all(c["q"] == c["k"] and not c["gqa"] for c in calls)
    monkeypatch.setattr(attention_mod, "NATIVE_GQA_WITH_GRAD", True)
    calls.clear()
    logits_native, grads_native = _train_step(model, ids)
    torch.testing.assert_close(logits_native, logits, rtol=0, atol=0)
    assert (kind == "sink") == (not any(c["gqa"] for c in calls))
    for name, grad in grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads_native[name], grad, rtol=0, atol=1e-4 * scale + 1e-12, msg=name)
