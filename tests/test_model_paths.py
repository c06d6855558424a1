"""Fused vs explicit attention paths, chunking, taps, the KV cache and greedy generation."""

import pytest
import torch
from conftest import ALL_KINDS, tiny_model

from diffquant import DiffquantError


def _ids(batch: int, t: int, vocab: int = 61, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


# Kinds with a fused (SDPA) form: all but clipped, whose clipped softmax only the explicit path computes.
FUSED_KINDS = [k for k in ALL_KINDS if k != "clipped"]


@pytest.mark.parametrize("n_kv_heads", ["gqa", "mha"])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_fused_and_explicit_paths_agree(kind, n_kv_heads, t):
    heads = 2 if kind == "diff_v1" else 4
    kv = heads // 2 if n_kv_heads == "gqa" else heads
    model = tiny_model(kind, n_heads=heads, n_kv_heads=kv)
    ids = _ids(2, t)
    with torch.no_grad():
        model.set_attention_path("fused")
        fused = model(ids)
        model.set_attention_path("explicit")
        explicit = model(ids)
    torch.testing.assert_close(explicit, fused, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, 1000])
def test_explicit_chunking_is_exact(any_kind, chunk):
    model = tiny_model(any_kind)
    ids = _ids(2, 64)
    with torch.no_grad():
        model.set_attention_path("explicit", chunk_size=64)
        whole = model(ids)
        model.set_attention_path("explicit", chunk_size=chunk)
        chunked = model(ids)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_auto_path_materialises_maps_only_when_observed(kind):
    model = tiny_model(kind)
    ids = _ids(1, 9)
    suffix = "" if kind == "baseline" else "1"
    assert not any(attn._maps_observed() for attn in model.attention_modules())
    seen = {}

    def grab(name):
        def hook(module, args, output):
            seen[name] = (args[0].clone(), args[1].clone())

        return hook

    hooks = [tap.register_forward_hook(grab(name)) for name, tap in model.taps("kind:probs").items()]
    assert all(attn._maps_observed() for attn in model.attention_modules())
    with torch.no_grad():
        model(ids)
    assert set(seen) == set(model.taps("kind:probs"))
    with torch.no_grad():
        observed = model(ids)
    for h in hooks:
        h.remove()
    assert not any(attn._maps_observed() for attn in model.attention_modules())
    with torch.no_grad():
        assert torch.equal(model(ids), observed)  # observing the maps never changes the output
    probs, valid = seen[f"layers.1.attn.probs{suffix}"]
    assert probs.shape == (1, model.config.n_heads, 9, 9)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, model.config.n_heads, 9))
    assert torch.equal(valid[0, 0], torch.ones(9, 9, dtype=torch.bool).tril())
    assert torch.equal(probs[..., ~valid[0, 0]], torch.zeros_like(probs[..., ~valid[0, 0]]))


@pytest.mark.parametrize("diff_kind", ["diff_v1", "diff_v2"])
def test_diff_map_equals_a1_minus_lambda_a2(diff_kind):
    model = tiny_model(diff_kind)
    got = {}
    for name in ("probs1", "probs2", "lambda", "diff_map"):
        model.taps(f"layers.0.attn.{name}")[f"layers.0.attn.{name}"].register_forward_hook(
            lambda m, a, out, n=name: got.__setitem__(n, out)
        )
    with torch.no_grad():
        model(_ids(2, 11))
    lam = got["lambda"]
    lam = lam.transpose(1, 2).unsqueeze(-1) if lam.dim() == 3 else lam
    torch.testing.assert_close(got["diff_map"], got["probs1"] - lam * got["probs2"])


def test_incremental_decoding_matches_full_forward(any_kind):
    model = tiny_model(any_kind)
    ids = _ids(2, 20)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :8], cache)]  # a prompt, then one token at a time, then a block of 3
        for i in range(8, 17):
            parts.append(model(ids[:, i : i + 1], cache))
        parts.append(model(ids[:, 17:], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == 20


def test_incremental_decoding_explicit_path(any_kind):
    model = tiny_model(any_kind)
    model.set_attention_path("explicit", chunk_size=3)
    ids = _ids(1, 12)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache)] + [model(ids[:, i : i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_generate_is_greedy(any_kind):
    model = tiny_model(any_kind)
    prompt = _ids(2, 5)
    out = model.generate(prompt, max_new_tokens=6)
    # Brute force: re-run the whole sequence for every new token, take the argmax.
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sequence_longer_than_max_is_an_error():
    model = tiny_model("baseline")
    with pytest.raises(DiffquantError, match="exceeds the model's max_seq_len 96"):
        model(_ids(1, 97))


def test_sites_have_stable_names_and_kinds(any_kind):
    sites = tiny_model(any_kind).sites()
    expected = {
        "baseline": ["logits", "probs"],
        "diff_v1": ["logits1", "logits2", "probs1", "probs2", "lambda", "diff_map"],
        "diff_v2": ["logits1", "logits2", "probs1", "probs2", "lambda", "diff_map"],
        "gated": ["logits", "probs", "gate"],
        "sink": ["logits", "probs", "sink_logit"],
        "clipped": ["logits", "probs"],
    }[any_kind]
    for layer in range(2):
        for name in ["q", "k", "v", "head_out", "out", *expected]:
            assert f"layers.{layer}.attn.{name}" in sites
        assert sites[f"layers.{layer}.resid"] == "resid"
        assert sites[f"layers.{layer}.mlp.act"] == "mlp_act"
        assert sites[f"layers.{layer}.mlp.down.input"] == "linear_in"
    assert sites["lm_head.input"] == "linear_in"
    assert sites["layers.0.attn.out"] == "attn_out"


def test_site_pattern_matching_nothing_lists_kinds():
    with pytest.raises(DiffquantError, match="matches no site; this model's site kinds: q, k, v, logits"):
        tiny_model("baseline").taps("layers.*.attn.diff_map")


def test_tied_embeddings_share_storage():
    model = tiny_model("diff_v2", tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    assert model.parameter_groups()["lm_head"] == 0


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_fused_path_gives_sdpa_one_head_width(kind, monkeypatch):
    """DIFF V1's 2d-wide value heads must not send SDPA to its slow math kernel: every call the fused path
    makes has Q, K and V of one width (zero-padded Q/K), in prefill and with a KV cache (explicit mask)."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = tiny_model(kind)
    model.set_attention_path("fused")
    with torch.no_grad():
        model(_ids(2, 9))
        model.generate(_ids(1, 5), max_new_tokens=3)
    assert calls and all(len(set(widths)) == 1 for widths in calls), calls


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_fused_and_explicit_gradients_agree(kind):
    """Training runs the fused path: its gradients (through the zero padding) equal the explicit path's."""
    grads = {}
    for path in ("fused", "explicit"):
        model = tiny_model(kind)
        model.set_attention_path(path)
        model(_ids(2, 16)).float().square().mean().backward()
        grads[path] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["fused"].keys() == grads["explicit"].keys()
    for name, grad in grads["fused"].items():
        torch.testing.assert_close(grad, grads["explicit"][name], rtol=1e-4, atol=1e-5, msg=name)
