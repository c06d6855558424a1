"""Independent reference check of the three attention kinds (baseline, DIFF V1, DIFF V2).

Every formula below is written from scratch with plain torch ops (per-head loops, fp64) from the semantics in
shared/reference/diff-attention.md; nothing is shared with ``diffquant`` except the public ``ModelConfig`` /
``DecoderLM`` classes, whose attention modules are compared against the references.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffquant.models import DecoderLM, ModelConfig

E = 64  # model width
ROPE_THETA = 10000.0
EPS = 1e-5
N_LAYERS = 3
DEPTH = 2  # layer under test: lambda_init(2) = 0.4707, far from the depth-0 value 0.2
BATCH = 2
KINDS = ("baseline", "diff_v1", "diff_v2")
# H = output heads, d = Q/K component width; all three are parameter matched to a 4-head, d=16 baseline
HEADS = {"baseline": (4, 16), "diff_v1": (4, 8), "diff_v2": (4, 16)}

PUBLISHED_LAMBDA_INIT = (0.2, 0.3555, 0.4707, 0.5561)  # DIFF paper / unilm, depths 0..3


# ----------------------------------------------------------------------------------------------------
# model construction
# ----------------------------------------------------------------------------------------------------


def make_config(kind: str, n_rep: int, *, n_layers: int = N_LAYERS, **overrides) -> ModelConfig:
    n_heads, head_dim = HEADS[kind]
    kwargs = dict(
        attention=kind,
        vocab_size=64,
        d_model=E,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads // n_rep,
        head_dim=head_dim,
        ffn_dim=128,
        max_seq_len=128,
        rope_theta=ROPE_THETA,
        norm_eps=EPS,
        tie_embeddings=False,
        v1_norm_affine=True,
        v1_lambda_init=None,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def build_attention(cfg: ModelConfig, seed: int, depth: int = DEPTH) -> torch.nn.Module:
    """Build the model; return layer ``depth``'s attention with all its parameters re-randomised."""
    torch.manual_seed(seed)
    model = DecoderLM(cfg).eval()
    attn = model.layers[depth].attn
    with torch.no_grad():
        # the package's small init (std 0.02) makes attention nearly uniform; use unit-scale logits instead
        for module in attn.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
        if cfg.attention == "diff_v1":
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(attn, name).normal_(0.0, 0.3)
            norm_weight = _v1_norm_weight(attn)
            if norm_weight is not None:
                norm_weight.copy_(1.0 + 0.1 * torch.randn_like(norm_weight))
    return attn


def _v1_norm_weight(attn: torch.nn.Module) -> torch.Tensor | None:
    norm = getattr(attn, "norm", None)
    return None if norm is None else getattr(norm, "weight", None)


def _w(linear: torch.nn.Linear) -> torch.Tensor:
    return linear.weight.detach().double()


def run_module(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = attn(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    return y.double()


# ----------------------------------------------------------------------------------------------------
# shared building blocks of the references
# ----------------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotate-half (NeoX / HF Llama) RoPE on the last dim of x (..., T, d), positions 0..T-1."""
    seq_len, d = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angle, angle], dim=-1).cos()
    sin = torch.cat([angle, angle], dim=-1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A = softmax(q k^T / sqrt(d) + causal mask) for q, k of shape (B, T, d) -> (B, T, T)."""
    seq_len, d = q.shape[-2], q.shape[-1]
    scores = torch.einsum("btd,bsd->bts", q, k) / math.sqrt(d)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def lambda_init_schedule(depth: int) -> float:
    """DIFF paper eq. (lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), 1-based l), here with 0-based depth."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


# ----------------------------------------------------------------------------------------------------
# the three references
# ----------------------------------------------------------------------------------------------------


def reference_baseline(attn: torch.nn.Module, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Standard causal multi-head attention with GQA (Llama): head_h = softmax(Q_h K_g^T / sqrt(d)) V_g,
    g = h // (H / H_kv); concat heads -> o_proj."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bsz, seq_len, _ = x.shape
    x = x.double()
    q = rope((x @ _w(attn.q_proj).T).view(bsz, seq_len, h, d).transpose(1, 2))
    k = rope((x @ _w(attn.k_proj).T).view(bsz, seq_len, hkv, d).transpose(1, 2))
    v = (x @ _w(attn.v_proj).T).view(bsz, seq_len, hkv, d).transpose(1, 2)
    heads = []
    for i in range(h):
        g = i // (h // hkv)
        heads.append(causal_softmax(q[:, i], k[:, g]) @ v[:, g])
    return torch.cat(heads, dim=-1) @ _w(attn.o_proj).T


def reference_diff_v1(
    attn: torch.nn.Module, x: torch.Tensor, cfg: ModelConfig, depth: int = DEPTH, pairing: str = "grouped"
) -> torch.Tensor:
    """DIFF V1 (arXiv 2410.05258; unilm Diff-Transformer ``multihead_flashdiff_1.py`` semantics):
    head_i = (1 - lambda_init) * RMSNorm((A1 - lambda A2) V_j),
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init (one scalar per layer).

    q sub-head 2i+c is component c of differential head i, likewise k; value head j is one 2d block.
    ``pairing`` chooses which kv pair query pair i reads:
      "grouped": j = i // n_rep (correct);  "modulo": j = i % H_kv (wrong);
      "naive_repeat": repeat the 2*H_kv K sub-heads n_rep times before pairing
      (the GQA bug of unilm ``multihead_diffattn.py``).
    """
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n_rep = h // hkv
    bsz, seq_len, _ = x.shape
    x = x.double()
    q = rope((x @ _w(attn.q_proj).T).view(bsz, seq_len, h, 2, d).permute(0, 2, 3, 1, 4))  # (B, H, 2, T, d)
    k = rope(
        (x @ _w(attn.k_proj).T).view(bsz, seq_len, hkv, 2, d).permute(0, 2, 3, 1, 4)
    )  # (B, Hkv, 2, T, d)
    v = (x @ _w(attn.v_proj).T).view(bsz, seq_len, hkv, 2 * d).transpose(1, 2)  # (B, Hkv, T, 2d)

    lambda_init = cfg.v1_lambda_init if cfg.v1_lambda_init is not None else lambda_init_schedule(depth)
    lq1, lk1, lq2, lk2 = (
        getattr(attn, n).detach().double() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    )
    lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lambda_init
    norm_weight = _v1_norm_weight(attn)

    heads = []
    for i in range(h):
        if pairing == "grouped":
            kv_sub = [(i // n_rep, 0), (i // n_rep, 1)]
            v_head = i // n_rep
        elif pairing == "modulo":
            kv_sub = [(i % hkv, 0), (i % hkv, 1)]
            v_head = i % hkv
        elif pairing == "naive_repeat":
            # expanded K sub-head s is original K sub-head s // n_rep = (pair, component) divmod 2
            kv_sub = [divmod((2 * i + c) // n_rep, 2) for c in (0, 1)]
            v_head = i // n_rep
        else:
            raise ValueError(pairing)
        a1 = causal_softmax(q[:, i, 0], k[:, kv_sub[0][0], kv_sub[0][1]])
        a2 = causal_softmax(q[:, i, 1], k[:, kv_sub[1][0], kv_sub[1][1]])
        o = (a1 - lam * a2) @ v[:, v_head]  # (B, T, 2d)
        o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + EPS)
        if norm_weight is not None:
            o = o * norm_weight.detach().double()
        heads.append((1.0 - lambda_init) * o)
    return torch.cat(heads, dim=-1) @ _w(attn.o_proj).T


def reference_diff_v2(
    attn: torch.nn.Module, x: torch.Tensor, cfg: ModelConfig, pairing: str = "interleaved"
) -> torch.Tensor:
    """DIFF V2 (DIFF V2 post 2026-01-20; unilm ``Diff-Transformer-V2/multihead_flashdiffv2.py``):
    one causal GQA attention over 2H query heads (head q reads kv head q // (2H / H_kv)), then
    out_i = attn[2i] - sigmoid(lambda_proj(x))_i * attn[2i+1] per token ("interleaved", correct);
    "contiguous" pairs attn[i] with attn[i + H] (the variant the post calls wrong)."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    group = 2 * h // hkv
    bsz, seq_len, _ = x.shape
    x = x.double()
    q = rope((x @ _w(attn.q_proj).T).view(bsz, seq_len, 2 * h, d).transpose(1, 2))
    k = rope((x @ _w(attn.k_proj).T).view(bsz, seq_len, hkv, d).transpose(1, 2))
    v = (x @ _w(attn.v_proj).T).view(bsz, seq_len, hkv, d).transpose(1, 2)
    attn_out = [causal_softmax(q[:, j], k[:, j // group]) @ v[:, j // group] for j in range(2 * h)]
    lam = torch.sigmoid(x @ _w(attn.lambda_proj).T)  # (B, T, H)
    heads = []
    for i in range(h):
        first, second = (2 * i, 2 * i + 1) if pairing == "interleaved" else (i, i + h)
        heads.append(attn_out[first] - lam[..., i : i + 1] * attn_out[second])
    return torch.cat(heads, dim=-1) @ _w(attn.o_proj).T


REFERENCES = {
    "baseline": reference_baseline,
    "diff_v1": reference_diff_v1,
    "diff_v2": reference_diff_v2,
}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------


# Execution path of the module: its default, and (when the module exposes the optional ``path`` /
# ``chunk_size`` knobs) the explicit attention-map path, whole and in query chunks of 5.
PATHS = {"default": None, "explicit": ("explicit", None), "explicit_chunked": ("explicit", 5)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("seq_len", [1, 7, 64])
@pytest.mark.parametrize("n_rep", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_matches_reference(kind: str, n_rep: int, seq_len: int, path: str) -> None:
    seed = 1000 * KINDS.index(kind) + 100 * n_rep + seq_len
    cfg = make_config(kind, n_rep)
    attn = build_attention(cfg, seed)
    if PATHS[path] is not None:
        assert hasattr(attn, "path") and hasattr(attn, "chunk_size"), "the explicit path knobs were renamed"
        attn.path, attn.chunk_size = PATHS[path]
    x = torch.randn(BATCH, seq_len, E)
    expected = REFERENCES[kind](attn, x, cfg)
    torch.testing.assert_close(run_module(attn, x), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prefill", [0, 3])
@pytest.mark.parametrize("n_rep", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_matches_reference(kind: str, n_rep: int, prefill: int) -> None:
    """The KV-cache path (a prefill of ``prefill`` tokens, then one token at a time) against the reference
    on the whole sequence: position t sees keys 0..t either way."""
    from diffquant.models.attention import LayerKV

    seq_len = 9
    cfg = make_config(kind, n_rep)
    attn = build_attention(cfg, seed=500 + 10 * n_rep + prefill)
    x = torch.randn(BATCH, seq_len, E)
    cache = LayerKV()
    steps = ([(0, prefill)] if prefill else []) + [(t, t + 1) for t in range(prefill, seq_len)]
    with torch.no_grad():
        out = torch.cat([attn(x[:, a:b], cache) for a, b in steps], dim=1)
    assert cache.length == seq_len
    torch.testing.assert_close(out.double(), REFERENCES[kind](attn, x, cfg), rtol=0, atol=1e-5)


@pytest.mark.parametrize("seq_len", [7, 40])
@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])  # the Triton kernel serves the DIFF kinds only
def test_triton_kernel_matches_reference(kind: str, seq_len: int, monkeypatch) -> None:
    """The Triton kernel (CPU interpreter) without quantization against the reference: forced on with an
    all-fp32 core, the layer output equals the independent computation."""
    pytest.importorskip("triton")
    from diffquant.kernels import dispatch
    from diffquant.kernels.reference import CoreQuant

    cfg = make_config(kind, 2, head_dim=16)  # the kernel's tl.dot needs head widths of 16 or more
    attn = build_attention(cfg, seed=900 + seq_len)
    monkeypatch.setattr(dispatch, "kernel_core", lambda layer: CoreQuant())
    attn.kernel = "triton"
    x = torch.randn(BATCH, seq_len, E)
    out = run_module(attn, x)
    assert attn.last_path == "triton"
    torch.testing.assert_close(out, REFERENCES[kind](attn, x, cfg), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_rep", [1, 2])
def test_diff_v2_pairs_are_interleaved(n_rep: int) -> None:
    cfg = make_config("diff_v2", n_rep)
    attn = build_attention(cfg, seed=7 + n_rep)
    x = torch.randn(BATCH, 16, E)
    y = run_module(attn, x)
    torch.testing.assert_close(y, reference_diff_v2(attn, x, cfg, "interleaved"), rtol=0, atol=1e-5)
    assert max_abs(y, reference_diff_v2(attn, x, cfg, "contiguous")) > 1e-3


@pytest.mark.parametrize("wrong_pairing", ["modulo", "naive_repeat"])
def test_diff_v1_gqa_pairing(wrong_pairing: str) -> None:
    cfg = make_config("diff_v1", n_rep=2)
    attn = build_attention(cfg, seed=11)
    x = torch.randn(BATCH, 16, E)
    y = run_module(attn, x)
    torch.testing.assert_close(y, reference_diff_v1(attn, x, cfg, pairing="grouped"), rtol=0, atol=1e-5)
    assert max_abs(y, reference_diff_v1(attn, x, cfg, pairing=wrong_pairing)) > 1e-3


@pytest.mark.parametrize(("norm_affine", "lambda_init"), [(False, None), (True, 0.5), (False, 0.5)])
def test_diff_v1_variants(norm_affine: bool, lambda_init: float | None) -> None:
    cfg = make_config("diff_v1", n_rep=2, v1_norm_affine=norm_affine, v1_lambda_init=lambda_init)
    attn = build_attention(cfg, seed=23)
    if not norm_affine:
        assert _v1_norm_weight(attn) is None
    else:
        assert _v1_norm_weight(attn).shape == (2 * cfg.head_dim,)
    expected_init = lambda_init_schedule(DEPTH) if lambda_init is None else lambda_init
    assert float(attn.lambda_init) == pytest.approx(expected_init, abs=1e-6)
    x = torch.randn(BATCH, 16, E)
    torch.testing.assert_close(run_module(attn, x), reference_diff_v1(attn, x, cfg), rtol=0, atol=1e-5)


def test_diff_v1_lambda_init_schedule() -> None:
    cfg = make_config("diff_v1", n_rep=1, n_layers=4)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    for depth, published in enumerate(PUBLISHED_LAMBDA_INIT):
        assert lambda_init_schedule(depth) == pytest.approx(published, abs=1e-4)
        assert float(model.layers[depth].attn.lambda_init) == pytest.approx(published, abs=1e-4)


# ----------------------------------------------------------------------------------------------------
# a whole float64 model against a float64 reference
# ----------------------------------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, in x's precision."""
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight.detach()


def reference_logits(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    """Pre-norm decoder (Llama layout): x += attn(norm(x)); x += down(silu(gate(h)) * up(h)), h = norm(x);
    logits = lm_head(norm(x)); silu(z) = z sigmoid(z). Attention from the per-kind references above."""
    cfg = model.config
    x = model.embed.weight.detach().double()[ids]
    for depth, block in enumerate(model.layers):
        h = reference_rms_norm(x, block.attn_norm.weight, cfg.norm_eps)
        if cfg.attention == "diff_v1":
            x = x + reference_diff_v1(block.attn, h, cfg, depth=depth)
        else:
            x = x + REFERENCES[cfg.attention](block.attn, h, cfg)
        h = reference_rms_norm(x, block.mlp_norm.weight, cfg.norm_eps)
        gate, up = h @ _w(block.mlp.gate).T, h @ _w(block.mlp.up).T
        x = x + (gate * torch.sigmoid(gate) * up) @ _w(block.mlp.down).T
    return reference_rms_norm(x, model.norm.weight, cfg.norm_eps) @ _w(model.lm_head).T


@pytest.mark.parametrize("path", ["fused", "explicit", "explicit_chunked"])
@pytest.mark.parametrize("kind", KINDS)
def test_float64_model_matches_float64_reference(kind: str, path: str) -> None:
    """A float64 model computes in float64 throughout: RMSNorm, the DIFF combination and lambda, the explicit
    maps (float32 there would leave relative errors of ~1e-7 instead of ~1e-15)."""
    cfg = make_config(kind, n_rep=2)
    torch.manual_seed(5 + KINDS.index(kind))
    model = DecoderLM(cfg).double().eval()
    with torch.no_grad():  # unit-scale weights so attention is far from uniform and logits are O(1)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
            elif name.endswith("norm") and getattr(module, "weight", None) is not None:
                module.weight.copy_(1.0 + 0.1 * torch.randn_like(module.weight))
        model.embed.weight.normal_(0.0, 1.0)
        for block in model.layers:
            if kind == "diff_v1":
                for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                    getattr(block.attn, name).normal_(0.0, 0.3)
    model.set_attention_path(*PATHS[path] if path != "fused" else ("fused",))
    ids = torch.randint(0, cfg.vocab_size, (BATCH, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids)
    assert got.dtype == torch.float64
    expected = reference_logits(model, ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


# ----------------------------------------------------------------------------------------------------
# fewer queries than keys: a cached chunk (q_len < k_len), the causal mask offset by k_len - q_len
# ----------------------------------------------------------------------------------------------------


def offset_causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) for the last T of S positions, brute force: q (B, T, d), k (B, S, d); query
    t sits at absolute position S - T + t and sees keys 0 .. S - T + t (one row at a time, float64)."""
    t_len, s_len, d = q.shape[-2], k.shape[-2], q.shape[-1]
    rows = []
    for t in range(t_len):
        seen = s_len - t_len + t + 1
        scores = torch.einsum("bd,bsd->bs", q[:, t], k[:, :seen]) / math.sqrt(d)
        row = torch.zeros(q.shape[0], s_len, dtype=torch.float64)
        row[:, :seen] = scores.softmax(dim=-1)
        rows.append(row)
    return torch.stack(rows, dim=1)  # (B, T, S)


def reference_chunk(kind: str, attn: torch.nn.Module, x: torch.Tensor, cfg: ModelConfig, t_len: int):
    """Output (B, T, E) of the last ``t_len`` positions of ``x`` (B, S, E) when the first S - T are cached:
    the equations of the three references above with queries only at the last T positions (RoPE at their
    absolute positions) against keys and values of all S positions."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bsz, s_len, _ = x.shape
    x = x.double()
    last = slice(s_len - t_len, s_len)
    if kind == "baseline":
        q = rope((x @ _w(attn.q_proj).T).view(bsz, s_len, h, d).transpose(1, 2))[:, :, last]
        k = rope((x @ _w(attn.k_proj).T).view(bsz, s_len, hkv, d).transpose(1, 2))
        v = (x @ _w(attn.v_proj).T).view(bsz, s_len, hkv, d).transpose(1, 2)
        heads = [
            offset_causal_softmax(q[:, i], k[:, i // (h // hkv)]) @ v[:, i // (h // hkv)] for i in range(h)
        ]
    elif kind == "diff_v1":
        q = rope((x @ _w(attn.q_proj).T).view(bsz, s_len, h, 2, d).permute(0, 2, 3, 1, 4))[..., last, :]
        k = rope((x @ _w(attn.k_proj).T).view(bsz, s_len, hkv, 2, d).permute(0, 2, 3, 1, 4))
        v = (x @ _w(attn.v_proj).T).view(bsz, s_len, hkv, 2 * d).transpose(1, 2)
        lambda_init = lambda_init_schedule(DEPTH)
        lq1, lk1, lq2, lk2 = (
            getattr(attn, n).detach().double() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
        )
        lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lambda_init
        heads = []
        for i in range(h):
            j = i // (h // hkv)
            a1 = offset_causal_softmax(q[:, i, 0], k[:, j, 0])
            a2 = offset_causal_softmax(q[:, i, 1], k[:, j, 1])
            o = (a1 - lam * a2) @ v[:, j]
            o = (
                o
                * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + EPS)
                * _v1_norm_weight(attn).detach().double()
            )
            heads.append((1.0 - lambda_init) * o)
    else:
        group = 2 * h // hkv
        q = rope((x @ _w(attn.q_proj).T).view(bsz, s_len, 2 * h, d).transpose(1, 2))[:, :, last]
        k = rope((x @ _w(attn.k_proj).T).view(bsz, s_len, hkv, d).transpose(1, 2))
        v = (x @ _w(attn.v_proj).T).view(bsz, s_len, hkv, d).transpose(1, 2)
        outs = [offset_causal_softmax(q[:, j], k[:, j // group]) @ v[:, j // group] for j in range(2 * h)]
        lam = torch.sigmoid(x[:, last] @ _w(attn.lambda_proj).T)  # (B, T, H)
        heads = [outs[2 * i] - lam[..., i : i + 1] * outs[2 * i + 1] for i in range(h)]
    return torch.cat(heads, dim=-1) @ _w(attn.o_proj).T


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cached", "chunks"), [(5, (4,)), (1, (3, 5))])
@pytest.mark.parametrize("kind", KINDS)
def test_cached_chunks_with_fewer_queries_than_keys_match_brute_force(kind, cached, chunks, path) -> None:
    """Chunked prefill / speculative decoding: after ``cached`` positions, chunks of several queries each
    (q_len > 1 and q_len < k_len). Query i of a chunk sits at position k_len - q_len + i, so the causal mask is
    offset by k_len - q_len; a mask aligned top-left (SDPA's is_causal for q_len != k_len) or from 0 fails."""
    from diffquant.models.attention import LayerKV

    cfg = make_config(kind, n_rep=2)
    attn = build_attention(cfg, seed=700 + 10 * KINDS.index(kind) + cached)
    if PATHS[path] is not None:
        attn.path, attn.chunk_size = PATHS[path][0], 2 if PATHS[path][1] else None
    total = cached + sum(chunks)
    x = torch.randn(BATCH, total, E, generator=torch.Generator().manual_seed(cached))
    cache = LayerKV()
    with torch.no_grad():
        attn(x[:, :cached], cache)
        start = cached
        for n in chunks:
            got = attn(x[:, start : start + n], cache).double()
            start += n
            expected = reference_chunk(kind, attn, x[:, :start], cfg, n)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert cache.length == total


@pytest.mark.parametrize("kind", KINDS)
def test_reference_cores_offset_the_mask_for_fewer_queries_than_keys(kind) -> None:
    """kernels/reference.py's cores with q (B, nq, T, d) against k / v of S > T positions, against a float64
    brute force from the equations (query t at position S - T + t sees keys <= S - T + t)."""
    from diffquant.kernels import reference as ref

    g = torch.Generator().manual_seed(31 + KINDS.index(kind))
    bsz, heads, kv_heads, d, t_len, s_len = 2, 4, 2, 8, 3, 7
    nq = heads if kind == "baseline" else 2 * heads
    nk = 2 * kv_heads if kind == "diff_v1" else kv_heads
    dv = 2 * d if kind == "diff_v1" else d
    q = torch.randn(bsz, nq, t_len, d, generator=g)
    k = torch.randn(bsz, nk, s_len, d, generator=g)
    v = torch.randn(bsz, kv_heads, s_len, dv, generator=g)
    qd, kd, vd = q.double(), k.double(), v.double()
    if kind == "baseline":
        got = ref.baseline_core(q, k, v)
        group = heads // kv_heads
        expected = torch.stack(
            [offset_causal_softmax(qd[:, i], kd[:, i // group]) @ vd[:, i // group] for i in range(heads)], 1
        )
    elif kind == "diff_v2":
        lam = torch.rand(bsz, heads, t_len, generator=g)
        got = ref.diff_v2_core(q, k, v, lam)
        group = nq // kv_heads
        maps = [offset_causal_softmax(qd[:, j], kd[:, j // group]) @ vd[:, j // group] for j in range(nq)]
        expected = torch.stack(
            [maps[2 * i] - lam.double()[:, i, :, None] * maps[2 * i + 1] for i in range(heads)], 1
        )
    else:
        lam, lambda_init = 0.3, 0.45
        weight = 1.0 + 0.1 * torch.randn(dv, generator=g)
        got = ref.diff_v1_core(q, k, v, lam, lambda_init, weight)
        outs = []
        for i in range(heads):
            j = i // (heads // kv_heads)
            a1 = offset_causal_softmax(qd[:, 2 * i], kd[:, 2 * j])
            a2 = offset_causal_softmax(qd[:, 2 * i + 1], kd[:, 2 * j + 1])
            o = (a1 - lam * a2) @ vd[:, j]
            outs.append(
                (1 - lambda_init) * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
            )
        expected = torch.stack(outs, 1)
    assert got.shape == (bsz, heads, t_len, dv)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("logits_bits", [None, 8])
@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_dispatch_keeps_p_v_exact_only_for_quantized_logits(kind: str, logits_bits, monkeypatch) -> None:
    """A bf16 layer on the kernel: with quantized logits the kernel keeps P @ V in fp32 (``exact``), as the
    explicit fake-quant path it stands for computes it; without, P is rounded to bf16 as the SDPA path it
    replaces does. The dispatch decides; its choice reaches the kernel and the output is the kernel's own."""
    pytest.importorskip("triton")
    from diffquant.kernels import dispatch, triton_diff
    from diffquant.kernels.reference import CoreQuant

    cfg = make_config(kind, 2, head_dim=16)
    attn = build_attention(cfg, seed=77).to(torch.bfloat16)
    core = CoreQuant(logits_bits=logits_bits, logits_scale=torch.tensor([0.05]) if logits_bits else None)
    monkeypatch.setattr(dispatch, "kernel_core", lambda layer: core)
    name = f"{kind}_attention"
    real, seen = getattr(triton_diff, name), []

    def spy(*args, **kwargs):
        seen.append(kwargs["exact"])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_diff, name, spy)
    attn.kernel = "triton"
    with torch.no_grad():
        out = attn(torch.randn(BATCH, 20, E, dtype=torch.bfloat16))
    assert attn.last_path == "triton" and seen == [logits_bits is not None]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
