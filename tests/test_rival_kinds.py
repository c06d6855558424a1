"""The rival attention kinds of issue 30: gated, sink and clipped, each in its variants.

Every formula below is written here from its paper, with plain float64 torch ops per head, and compared with
the model's attention (1e-9 in float64) for prefill and for cached decoding with fewer queries than keys, on
each execution path, with GQA, a sliding window, and a 10-layer model end to end:

- gated (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708, Sec. 2.2, G1):
  Y' = Y ⊙ sigmoid(X W_theta), Y a head's SDPA output, X the pre-normed layer input; W_theta is
  d_model x (heads * head_dim) element-wise, d_model x heads head-wise.
- sink (Miller 2023, "Attention Is Off By One"; OpenAI 2025, gpt-oss): p_j = exp(l_j) / (exp(s) + sum_k exp(l_k)),
  s = 0 (softmax-off-by-one) or a learned logit per head.
- clipped (Bondarenko et al. 2023, "Quantizable Transformers", arXiv 2306.12929, Sec. 4.1):
  p = clip((zeta - gamma) softmax(l) + gamma, 0, 1), the paper's gamma = -0.025, zeta = 1.

Then what the three DIFF-paper kinds get everywhere: parameter matching (0.5 %), profiling taps, quantization
presets, rotation (exact in float64), checkpoints, the kernels' dispatch, training, the command line.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from conftest import tiny_model

from diffquant.errors import DiffquantError
from diffquant.kernels import dispatch
from diffquant.kernels import reference as ref
from diffquant.models import PRESETS, DecoderLM, ModelConfig, matched_config
from diffquant.models.attention import LayerKV

E, H, D = 64, 4, 16  # model width, heads, head width of the attention-level references
DEPTH = 1  # layer under test
BATCH = 2
GAMMA, ZETA = -0.025, 1.0  # the paper's clipped-softmax defaults (Bondarenko et al. 2023)
# variant id -> (kind, variant fields); the clip constants of each clipped variant are the test's own literals
VARIANTS = {
    "gated-elementwise": ("gated", {"gate": "elementwise"}),
    "gated-headwise": ("gated", {"gate": "headwise"}),
    "sink-learned": ("sink", {"sink": "learned"}),
    "sink-zero": ("sink", {"sink": "zero"}),
    "clipped": ("clipped", {}),
    "clipped-wide": ("clipped", {"clip_gamma": -0.1, "clip_zeta": 1.1}),
}
CLIP = {"clipped": (GAMMA, ZETA), "clipped-wide": (-0.1, 1.1)}
PATHS = {"auto": ("auto", None), "explicit": ("explicit", None), "chunked": ("explicit", 2)}
TOL = 1e-9


# ----------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------
def make_config(variant: str, n_rep: int, *, n_layers: int = 3, window: int | None = None) -> ModelConfig:
    kind, fields = VARIANTS[variant]
    return ModelConfig(
        attention=kind,
        vocab_size=61,
        d_model=E,
        n_layers=n_layers,
        n_heads=H,
        n_kv_heads=H // n_rep,
        head_dim=D,
        ffn_dim=96,
        max_seq_len=64,
        sliding_window=window,
        **fields,
    )


def randomise(model: DecoderLM, seed: int) -> DecoderLM:
    """Unit-scale projections (the package's small init makes attention nearly uniform and gates ~0.5),
    learned sinks spread around 0, norm gains away from 1: every piece a reference could get wrong shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(1.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else 1
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * fan_in**-0.5)
    return model


def build(variant: str, n_rep: int, seed: int, **kw) -> tuple[DecoderLM, torch.nn.Module]:
    model = randomise(DecoderLM(make_config(variant, n_rep, **kw)).double().eval(), seed)
    return model, model.layers[DEPTH].attn


def w(linear: torch.nn.Module) -> torch.Tensor:
    return linear.weight.detach().double()


# ----------------------------------------------------------------------------------------------------
# the references, from the papers' formulas
# ----------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX / Llama layout) on x (..., T, d) at positions 0 .. T-1."""
    t, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def allowed(t: int, window: int | None) -> torch.Tensor:
    """(T, T): query i sees key j iff j <= i (and i - window < j with a sliding window)."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    ok = j <= i
    return ok if window is None else ok & (j > i - window)


def reference_attention(
    attn,
    x: torch.Tensor,
    variant: str,
    *,
    window: int | None = None,
    plain: bool = False,
    maps: list | None = None,
) -> torch.Tensor:
    """The layer's attention output (B, T, E) for x (B, T, E) at positions 0 .. T-1, per head in float64.
    ``plain``: the baseline's softmax attention with the same weights (what a model ignoring its kind's
    mechanism would compute). ``maps`` collects each head's probabilities (B, T, T)."""
    kind = VARIANTS[variant][0]
    cfg = attn.config
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    b, t, _ = x.shape
    x = x.double()
    q = rope((x @ w(attn.q_proj).T).view(b, t, h, d).transpose(1, 2))
    k = rope((x @ w(attn.k_proj).T).view(b, t, hkv, d).transpose(1, 2))
    v = (x @ w(attn.v_proj).T).view(b, t, hkv, d).transpose(1, 2)
    ok = allowed(t, window)
    heads = []
    for i in range(h):
        j = i // (h // hkv)  # GQA: head i reads kv head i // (H / H_kv)
        logits = torch.einsum("btd,bsd->bts", q[:, i], k[:, j]) / math.sqrt(d)
        if kind == "sink" and not plain:
            s = float(attn.sinks.detach()[i]) if VARIANTS[variant][1]["sink"] == "learned" else 0.0
            e = torch.where(ok, logits.exp(), 0.0)
            p = e / (math.exp(s) + e.sum(-1, keepdim=True))
        else:
            p = logits.masked_fill(~ok, float("-inf")).softmax(-1)
            if kind == "clipped" and not plain:
                gamma, zeta = CLIP[variant]
                p = ((zeta - gamma) * p + gamma).clamp(0.0, 1.0)
        if maps is not None:
            maps.append(p)
        y = p @ v[:, j]  # (B, T, d)
        if kind == "gated" and not plain:
            width = d if VARIANTS[variant][1]["gate"] == "elementwise" else 1
            z = (x @ w(attn.gate_proj).T).view(b, t, h, width)[:, :, i]
            y = y * (1.0 / (1.0 + torch.exp(-z)))
        heads.append(y)
    return torch.cat(heads, -1) @ w(attn.o_proj).T


def set_path(attn_or_model, path: str) -> None:
    mode, chunk = PATHS[path]
    if isinstance(attn_or_model, DecoderLM):
        attn_or_model.set_attention_path(mode, chunk_size=chunk)
    else:
        attn_or_model.path, attn_or_model.chunk_size = mode, chunk


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ----------------------------------------------------------------------------------------------------
# attention against the references
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("n_rep", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_equals_the_papers_formula(variant, n_rep, path):
    _, attn = build(variant, n_rep, seed=10 + n_rep)
    set_path(attn, path)
    x = torch.randn(BATCH, 11, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = attn(x)
    want = reference_attention(attn, x, variant)
    assert max_err(got, want) < TOL
    expected_path = "explicit" if path != "auto" or VARIANTS[variant][0] == "clipped" else "sdpa"
    assert attn.last_path == expected_path
    # the mechanism matters at these weights: a model ignoring it would fail the check above
    assert max_err(reference_attention(attn, x, variant, plain=True), want) > 1e-3


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window4"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("n_rep", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_the_papers_formula(variant, n_rep, path, window):
    """Prefill 7 tokens, decode 3 one at a time, then a chunk of 2: every step (fewer queries than keys) equals
    the reference's rows at those positions; a sliding window narrows every step at its own position."""
    _, attn = build(variant, n_rep, seed=20 + n_rep, window=window)
    set_path(attn, path)
    x = torch.randn(BATCH, 12, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = reference_attention(attn, x, variant, window=window)
    cache = LayerKV()
    got = []
    with torch.no_grad():
        for a, b in ((0, 7), (7, 8), (8, 9), (9, 10), (10, 12)):
            got.append(attn(x[:, a:b], cache))
    assert cache.length == 12
    assert max_err(torch.cat(got, 1), want) < TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_probs_tap_sees_the_kinds_probabilities(variant):
    """The explicit path's ``probs`` tap carries the probabilities that multiply V: sink rows sum to 1 minus
    the sink's share, clipped rows hold exact zeros among visible keys; the sink tap its logits."""
    model, attn = build(variant, 2, seed=5)
    x = torch.randn(1, 9, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    seen = {}
    hooks = [attn.probs.register_forward_hook(lambda m, a, o: seen.__setitem__("probs", o.detach()))]
    if VARIANTS[variant][0] == "sink":
        hooks.append(
            attn.sink_logit.register_forward_hook(lambda m, a, o: seen.__setitem__("sink", o.detach()))
        )
    if VARIANTS[variant][0] == "gated":
        hooks.append(attn.gate.register_forward_hook(lambda m, a, o: seen.__setitem__("gate", o.detach())))
    maps: list[torch.Tensor] = []
    with torch.no_grad():
        out = attn(x)
    assert attn.last_path == (
        "explicit" if VARIANTS[variant][0] == "clipped" else "sdpa"
    )  # hooks only observe
    for hook in hooks:
        hook.remove()
    assert max_err(out, reference_attention(attn, x, variant, maps=maps)) < TOL
    want = torch.stack(maps, 1)  # (B, H, T, T)
    assert max_err(seen["probs"], want) < TOL
    kind = VARIANTS[variant][0]
    rows = seen["probs"].sum(-1)
    if kind == "sink":
        assert bool((rows < 1).all())
        learned = VARIANTS[variant][1]["sink"] == "learned"
        assert torch.equal(
            seen["sink"], attn.sinks.detach() if learned else torch.zeros(H, dtype=torch.float64)
        )
    elif kind == "clipped":
        visible = allowed(9, None)
        assert bool((seen["probs"][..., visible] == 0).any())  # a head that does nothing, exactly
    else:
        gate = seen["gate"]
        assert gate.shape == (1, 9, H, D if VARIANTS[variant][1]["gate"] == "elementwise" else 1)
        assert bool(((gate > 0) & (gate < 1)).all())
        torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-12)


def whole_model_reference(model: DecoderLM, ids: torch.Tensor, variant: str) -> torch.Tensor:
    """Logits of the whole decoder in float64: embedding, per layer x + attn(RMSNorm(x) g1) and
    x + down(silu(gate(h)) * up(h)) with h = RMSNorm(x) g2, final RMSNorm, LM head."""
    eps = model.config.norm_eps

    def norm(x, module):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * module.weight.detach().double()

    x = model.embed.weight.detach().double()[ids]
    for block in model.layers:
        x = x + reference_attention(block.attn, norm(x, block.attn_norm), variant)
        h = norm(x, block.mlp_norm)
        gate = h @ w(block.mlp.gate).T
        x = x + (gate * torch.sigmoid(gate) * (h @ w(block.mlp.up).T)) @ w(block.mlp.down).T
    return norm(x, model.norm) @ w(model.lm_head).T


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_ten_layer_model_equals_the_reference_in_prefill_and_decoding(variant):
    model, _ = build(variant, 2, seed=40, n_layers=10)
    ids = torch.randint(0, 61, (BATCH, 12), generator=torch.Generator().manual_seed(4))
    want = whole_model_reference(model, ids, variant)
    scale = float(want.abs().max())
    with torch.no_grad():
        assert max_err(model(ids), want) < TOL * scale
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache)] + [model(ids[:, t : t + 1], cache) for t in range(5, 9)]
        steps.append(model(ids[:, 9:], cache))
    assert max_err(torch.cat(steps, 1), want) < TOL * scale


def test_the_sink_on_sdpa_is_one_extra_key_in_bfloat16_too():
    """The fused sink in bfloat16 stays near the float64 formula (the sink logit passes through a bf16 key
    channel), and a long window-free prefill takes SDPA."""
    model, attn = build("sink-learned", 2, seed=6)
    x = torch.randn(1, 40, E, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = reference_attention(attn, x, "sink-learned")
    attn.to(torch.bfloat16)
    with torch.no_grad():
        got = attn(x.to(torch.bfloat16))
    assert attn.last_path == "sdpa"
    assert max_err(got, want) < 0.05 * float(want.abs().max())


# ----------------------------------------------------------------------------------------------------
# the kernels' torch reference
# ----------------------------------------------------------------------------------------------------
def test_reference_cores_equal_the_formulas_with_fewer_queries_than_keys():
    """kernels/reference.py's gated / sink / clipped cores: q (B, H, T, d) against S > T keys (query t sits at
    S - T + t), in fp32, against the float64 formulas."""
    g = torch.Generator().manual_seed(8)
    b, heads, kv_heads, d, t, s = 2, 4, 2, 8, 3, 7
    q, k, v = (torch.randn(b, n, m, d, generator=g) for n, m in ((heads, t), (kv_heads, s), (kv_heads, s)))
    gate = torch.rand(b, heads, t, d, generator=g)
    sink = torch.randn(heads, generator=g)
    qd, kd, vd = q.double(), k.double(), v.double()
    ok = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    outs = {"gated": [], "sink": [], "clipped": []}
    for i in range(heads):
        j = i // (heads // kv_heads)
        logits = qd[:, i] @ kd[:, j].transpose(-1, -2) / math.sqrt(d)
        p = logits.masked_fill(~ok, float("-inf")).softmax(-1)
        outs["gated"].append((p @ vd[:, j]) * gate.double()[:, i])
        e = torch.where(ok, logits.exp(), 0.0)
        outs["sink"].append(e / (math.exp(float(sink[i])) + e.sum(-1, keepdim=True)) @ vd[:, j])
        outs["clipped"].append(((ZETA - GAMMA) * p + GAMMA).clamp(0, 1) @ vd[:, j])
    got = {
        "gated": ref.gated_core(q, k, v, gate),
        "sink": ref.sink_core(q, k, v, sink),
        "clipped": ref.clipped_core(q, k, v),
    }
    for name, out in got.items():
        assert max_err(out, torch.stack(outs[name], 1)) < 1e-5, name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dispatch_never_sends_a_rival_to_a_kernel(variant):
    """The Triton kernel and flash-attn know no gate, sink or clip: a plan the kernel would take on a DIFF
    model (SageAttention-like int8 Q/K, fp8 P V) leaves a rival on the torch paths, on CUDA and when Triton
    is forced."""
    from diffquant.quant import QuantPlan, apply_plan

    kind, fields = VARIANTS[variant]
    model = tiny_model(kind, head_dim=16, **fields)
    sage = {
        "rules": [
            {"sites": ["kind:q"], "scheme": "int8:tokens(8)"},
            {"sites": ["kind:k"], "scheme": {"format": "int8", "granularity": "tokens(8)", "smooth": True}},
            {"sites": ["kind:probs"], "scheme": {"format": "fp8_e4m3", "scale": 1.0 / 448.0}},
            {"sites": ["kind:v"], "scheme": "fp8_e4m3:channel"},
        ]
    }
    apply_plan(model, QuantPlan.from_dict(sage))
    assert all(dispatch.kernel_core(a) is None for a in model.attention_modules())
    assert "triton" not in dispatch.planned_paths(model, cuda=True)
    assert not any(
        dispatch.flash_ready(a, types.SimpleNamespace(is_cuda=True)) for a in model.attention_modules()
    )
    model.set_kernel("triton")
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 9)))
    assert set(dispatch.path_summary(model)) == {"explicit"}


# ----------------------------------------------------------------------------------------------------
# configs: variants, validation, parameter matching
# ----------------------------------------------------------------------------------------------------
def _baseline_shape_count(c: ModelConfig) -> int:
    """Parameters of the baseline's shapes with c's FFN width (embeddings, attention, SwiGLU, norms, head)."""
    attn = 2 * c.d_model * c.n_heads * c.head_dim + 2 * c.d_model * c.n_kv_heads * c.head_dim
    block = attn + 3 * c.d_model * c.ffn_dim + 2 * c.d_model
    return 2 * c.vocab_size * c.d_model + c.n_layers * block + c.d_model


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_preset_is_matched_within_half_a_percent(preset, variant):
    kind, fields = VARIANTS[variant]
    base = PRESETS[preset]
    config = matched_config(base, kind, **fields)
    count = DecoderLM(config).num_parameters()
    baseline = DecoderLM(base).num_parameters()
    assert abs(count - baseline) / baseline < 0.005, (count, baseline)
    # what each kind adds, counted from the paper's shapes
    per_layer = {
        "gated-elementwise": base.d_model * base.n_heads * base.head_dim,
        "gated-headwise": base.d_model * base.n_heads,
        "sink-learned": base.n_heads,
    }.get(variant, 0)
    assert count == _baseline_shape_count(config) + base.n_layers * per_layer
    if preset in ("tiny", "zoo"):  # 32-element blocks (MX formats, int4 groups) divide every FFN
        assert config.ffn_dim % 32 == 0
    if per_layer > 3 * base.d_model * base.n_layers:
        assert config.ffn_dim < base.ffn_dim  # a gate this size is absorbed, not ignored


def test_variant_fields_are_checked_in_one_line_each():
    cases = [
        (dict(attention="gated", gate="rowwise"), "'gate'", "one of elementwise, headwise"),
        (dict(attention="sink", sink="one"), "'sink'", "one of learned, zero"),
        (dict(attention="clipped", clip_gamma=0.1), "'clip_gamma'", "a number <= 0"),
        (dict(attention="clipped", clip_zeta=0.9), "'clip_zeta'", "a number >= 1"),
        (
            dict(attention="baseline", gate="headwise"),
            "'gate' = 'headwise'",
            "only attention 'gated' reads it",
        ),
        (dict(attention="gated", sink="zero"), "'sink' = 'zero'", "only attention 'sink' reads it"),
        (dict(attention="diff_v2", clip_gamma=-0.1), "'clip_gamma' = -0.1", "only attention 'clipped'"),
    ]
    for fields, name, expected in cases:
        with pytest.raises(DiffquantError) as err:
            ModelConfig(**fields)
        message = str(err.value)
        assert name in message and expected in message and "\n" not in message, message
    with pytest.raises(DiffquantError, match="attention 'sink' takes variant field\\(s\\) sink, not gate"):
        matched_config(PRESETS["tiny"], "sink", gate="headwise")
    # the family fields apply to the rivals (built like the baseline); DIFF kinds still refuse them
    assert (
        ModelConfig(attention="sink", sliding_window=8, qk_norm=True, attention_bias=True).sliding_window == 8
    )
    with pytest.raises(DiffquantError, match="'sliding_window' = 8.*DIFF models do not support it"):
        ModelConfig(attention="diff_v2", sliding_window=8)


def test_a_config_saved_before_the_variants_loads_with_their_defaults():
    data = ModelConfig().to_dict()
    for field in ("gate", "sink", "clip_gamma", "clip_zeta"):
        del data[field]
    loaded = ModelConfig.from_dict(data, complete=True)
    assert (loaded.gate, loaded.sink, loaded.clip_gamma, loaded.clip_zeta) == (
        "elementwise",
        "learned",
        -0.025,
        1.0,
    )


def test_clipped_has_no_fused_path():
    model = tiny_model("clipped")
    with pytest.raises(DiffquantError, match="attention 'clipped' has no fused \\(SDPA\\) form") as err:
        model.set_attention_path("fused")
    assert "\n" not in str(err.value)
    assert dispatch.planned_paths(model, cuda=False) == {"explicit": model.config.n_layers}


# ----------------------------------------------------------------------------------------------------
# profiling, quantization, rotation, checkpoints
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_profiling_sees_the_new_taps(variant):
    from diffquant.profile.profiler import Profiler

    kind, fields = VARIANTS[variant]
    model = tiny_model(kind, **fields)
    if kind == "sink" and model.layers[0].attn.sinks is not None:
        with torch.no_grad():
            for i, block in enumerate(model.layers):
                block.attn.sinks.copy_(torch.arange(H, dtype=torch.float32) - i)
    ids = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain = model(ids)
        with Profiler(model, sites="*") as prof:
            profiled = model(ids)
    assert torch.equal(plain, profiled)  # observing the maps never changes the output
    profile = prof.result()
    attn = model.layers[1].attn
    if kind == "gated":
        s = profile.sites["layers.1.attn.gate"].summary()
        assert s["kind"] == "attn_gate" and s["count"] == 3 * 17 * H * attn.gate_width
        assert 0 < s["min"] <= s["max"] < 1
    elif kind == "sink":
        s = profile.sites["layers.1.attn.sink_logit"].summary()
        assert s["kind"] == "sink_logit" and s["count"] == H and s["channel_absmax_shape"] == [H]
        assert s["max"] == (H - 2 if attn.sinks is not None else 0.0)
    sink_mass = profile.attention["layers.1.attn.probs"][1].summary()["sink_mass"]
    assert len(sink_mass["per_head"]) == H and all(0 <= m <= 1 for m in sink_mass["per_head"])


@pytest.mark.parametrize("name", ["w8a8", "attn-logits-int8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantization_presets_apply(variant, name):
    from diffquant.quant import apply_plan, calibrate, preset

    kind, fields = VARIANTS[variant]
    model = tiny_model(kind, d_model=32, ffn_dim=64, **fields)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        before = model(ids)
    applied = apply_plan(model, preset(name))
    calibrate(model, ids)
    with torch.no_grad():
        after = model(ids)
    assert torch.isfinite(after).all() and max_err(after, before) > 1e-6
    targets = {target for _, target, _ in applied}
    if name == "w8a8" and kind == "gated":  # the gate projection is a Linear like q / k / v
        assert "layers.0.attn.gate_proj" in targets and "layers.0.attn.gate_proj.input" in targets
    if name == "attn-logits-int8":
        assert dispatch.path_summary(model) == {"explicit": model.config.n_layers}


def _rotatable(variant: str, seed: int = 0) -> DecoderLM:
    """A float64 model whose every rotated size has a Hadamard matrix (FFN 64), with norm gains far from 1."""
    kind, fields = VARIANTS[variant]
    model = tiny_model(kind, seed=seed, ffn_dim=64, **fields).double()
    return randomise(model, seed + 1)


@pytest.mark.parametrize("places", ["quarot", "all", "random"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rotation_is_exact(variant, places):
    from diffquant.quant.rotate import RotateSpec, rotate_model

    spec = {
        "quarot": RotateSpec(),
        "all": RotateSpec(qk="hadamard"),
        "random": RotateSpec(residual="random", heads="random", ffn="random", qk="random", seed=3),
    }[places]
    model = _rotatable(variant)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(11))
    gate_before = getattr(model.layers[0].attn, "gate_proj", None)
    gate_before = None if gate_before is None else gate_before.weight.detach().clone()
    with torch.no_grad():
        want = model(ids)
        report = dict(rotate_model(model, spec))
        got = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :9], cache), model(ids[:, 9:12], cache), model(ids[:, 12:], cache)]
    scale = float(want.abs().max())
    assert max_err(got, want) < TOL * scale
    assert max_err(torch.cat(steps, 1), want) < TOL * scale
    # R2 runs unless an element-wise gate forbids it: V differs from a twin rotated without R2
    elementwise = VARIANTS[variant][1].get("gate") == "elementwise"
    assert report["heads (R2)"].startswith("skipped") == elementwise
    twin = _rotatable(variant)
    rotate_model(twin, dataclasses.replace(spec, heads="none"))
    v = "layers.0.attn.v_proj.weight"
    assert torch.equal(model.state_dict()[v], twin.state_dict()[v]) == elementwise
    if gate_before is not None:  # R1 rotates the gate projection, a reader of the normed stream
        assert not torch.allclose(model.layers[0].attn.gate_proj.weight, gate_before)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoints_round_trip_bit_for_bit(tmp_path, variant):
    from diffquant.io import load_model, save_checkpoint
    from diffquant.io.quantized import load_quantized, save_quantized
    from diffquant.quant import apply_plan, calibrate, preset

    kind, fields = VARIANTS[variant]
    model = randomise(tiny_model(kind, ffn_dim=64, **fields).double(), 12).float()
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(12))
    save_checkpoint(model, tmp_path / "native")
    loaded = load_model(tmp_path / "native")
    assert loaded.config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    apply_plan(loaded, preset("w8a8-quarot"))
    calibrate(loaded, ids)
    with torch.no_grad():
        want = loaded(ids)
    save_quantized(loaded, tmp_path / "quantized")
    again = load_quantized(tmp_path / "quantized")
    with torch.no_grad():
        assert torch.equal(again(ids), want)


def test_export_to_hugging_face_and_hf_act_scale_names_are_refused(tmp_path):
    from diffquant.io.convert_hf import export_hf
    from diffquant.quant.smoothquant import collect_act_scales

    ids = torch.randint(0, 61, (1, 8))
    for kind in ("gated", "sink", "clipped"):
        with pytest.raises(DiffquantError, match=f"attention '{kind}' has no Hugging Face format") as err:
            export_hf(tiny_model(kind), tmp_path / kind)
        assert "\n" not in str(err.value) and not (tmp_path / kind).exists()
    for kind, words in (("gated", "gate_proj has no Hugging Face name"), ("sink", "no Hugging Face format")):
        with pytest.raises(DiffquantError, match=words):
            collect_act_scales(tiny_model(kind), ids, names="hf")


# ----------------------------------------------------------------------------------------------------
# training, the command line
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["gated-headwise", "sink-learned", "clipped"])
def test_a_few_training_steps_learn_the_new_parameters(tmp_path, variant):
    from diffquant.train import TrainConfig, train

    kind, fields = VARIANTS[variant]
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def g{i}(a, b):\n    return a * {i} + b\n" for i in range(200)))
    cfg = TrainConfig(
        name="t", kind=kind, preset="tiny", model=dict(fields), data=str(text), data_tokens=None, seq_len=128,
        batch_size=2, steps=3, lr=3e-3, min_lr=3e-4, warmup=1, log_every=1, eval_every=3, eval_data=str(text),
        eval_tokens=256, retrieval_samples=1, checkpoint_every=3, threads=1, out=str(tmp_path / "run"),
    )  # fmt: skip
    # the variant is matched, not patched in: head-wise gates keep the tiny preset's FFN width
    assert cfg.model_config() == matched_config(PRESETS["tiny"], kind, **fields)
    out = train(cfg, log=lambda m: None)
    header = (out / "log.csv").read_text().splitlines()[0].split(",")
    new = {"gated": "gate_L", "sink": "sink_L", "clipped": None}[kind]
    assert new is None or any(c.startswith(new) for c in header)
    from diffquant.io import load_model

    trained = load_model(out / "final")
    assert trained.config.attention == kind
    if kind == "sink":  # the sinks are trained parameters: they moved off their zero init
        assert float(trained.layers[0].attn.sinks.detach().abs().max()) > 0


def test_init_specifier_and_command(tmp_path, capsys):
    from diffquant.cli import main
    from diffquant.io import load_model

    for kind in ("gated", "sink", "clipped"):
        model = load_model(f"init:{kind}:tiny:3")
        assert model.config == matched_config(PRESETS["tiny"], kind)
        assert main(["init", str(tmp_path / kind), "--kind", kind, "--preset", "tiny"]) == 0
        assert load_model(tmp_path / kind).config.attention == kind
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    assert "gated,sink,clipped" in capsys.readouterr().out.replace(" ", "")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "diff_v2, gated, sink, clipped" in " ".join(capsys.readouterr().out.split())
    info = dataclasses.asdict(load_model("init:sink:tiny").config)
    assert info["sink"] == "learned"


def test_a_skipped_r2_needs_no_matrix_of_its_size():
    """R2 is skipped for element-wise gates, so a head width with no Hadamard matrix is no reason to refuse;
    with head-wise gates R2 runs and the size is refused in one line, before any weight changes."""
    from diffquant.quant.rotate import RotateSpec, rotate_model

    spec = RotateSpec(residual="none", heads="hadamard", ffn="none")
    elementwise = tiny_model("gated", head_dim=22)
    assert dict(rotate_model(elementwise, spec))["heads (R2)"].startswith("skipped")
    headwise = tiny_model("gated", head_dim=22, gate="headwise")
    state = {k: v.clone() for k, v in headwise.state_dict().items()}
    with pytest.raises(DiffquantError, match="rotate.heads: size 22 has no Hadamard matrix"):
        rotate_model(headwise, spec)
    assert all(torch.equal(v, headwise.state_dict()[k]) for k, v in state.items())
