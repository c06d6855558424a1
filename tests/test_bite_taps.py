"""Every tap of every attention kind against its formula (issue 47 item 4).

A study reads a few taps (``probs``, ``resid``, ``lambda``); a quantization plan or a profile may read any
of them. Here every tap a model exposes (``model_taps``) is recorded in one forward pass and compared with a
float64 reference written from the papers' formulas, per decoder layer:

- q / k after RoPE (B, query or key heads, T, d), v (B, kv heads, T, dv); every Linear input;
- logits q.k / sqrt(d) for every (query, key), masked keys included (the tap sees them before the mask);
  probs: softmax over the visible keys (zero beyond); DIFF V1 / V2 one of each per component;
- DIFF V1 (Ye et al. 2024, Eq. 1-3): lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init (a scalar),
  diff_map = p1 - lambda p2, head_out = (1 - lambda_init) RMSNorm(diff_map V) * w per 2d-wide head;
- DIFF V2: lambda = sigmoid(x W_lambda) per token and head (B, T, H), diff_map = p_2i - lambda_i p_2i+1;
- gated (Qiu et al. 2025, G1): attn_gate = sigmoid(x W_theta) (B, T, H, dv | 1), head_out = Y * gate;
- sink (Miller 2023; gpt-oss): sink_logit (H,), probs = exp(l_j) / (exp(s) + sum_k exp(l_k));
- clipped (Bondarenko et al. 2023): probs = clip((zeta - gamma) softmax + gamma, 0, 1);
- head_out (B, T, H, dv) what o_proj reads, attn_out = o_proj(head_out), mlp act = silu(x Wg) * (x Wu),
  resid the layer output, lm_head's input the final norm's output.

The set of taps the model exposes must equal the set the reference computes, so a new tap without a
formula here fails. Fixtures: the zoo's trained checkpoint of every kind (float64, first two layers) on
WikiText-2 bytes, and the variants no zoo model has (head-wise gate, zero sink, wider clip) randomised at
unit scale; both execution paths (SDPA with observed maps, explicit).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from diffquant.data.corpus import token_windows
from diffquant.io.load import load_model
from diffquant.models import DecoderLM, ModelConfig
from diffquant.models.taps import model_taps

TOL = 1e-9
# id -> (zoo name or None, kind, variant fields of a randomised model)
MODELS = {
    "baseline": ("baseline", "baseline", {}),
    "diff_v1": ("diff_v1", "diff_v1", {}),
    "diff_v2": ("diff_v2", "diff_v2", {}),
    "gated": ("gated", "gated", {}),
    "sink": ("sink", "sink", {}),
    "clipped": ("clipped", "clipped", {}),
    "gated-headwise": (None, "gated", {"gate": "headwise"}),
    "sink-zero": (None, "sink", {"sink": "zero"}),
    "clipped-wide": (None, "clipped", {"clip_gamma": -0.1, "clip_zeta": 1.1}),
}


def _model(name: str) -> DecoderLM:
    zoo, kind, fields = MODELS[name]
    if zoo is not None:
        model = load_model(f"zoo:{zoo}", dtype=torch.float64)
        model.layers = model.layers[:2]
        model.config = dataclasses.replace(model.config, n_layers=2)
        return model.eval()
    config = ModelConfig(
        attention=kind, vocab_size=259, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
        ffn_dim=64, max_seq_len=64, **fields,
    )  # fmt: skip
    model = DecoderLM(config).double().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("sinks"):
                p.copy_(1.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[-1] ** -0.5)
    return model


def _ids() -> torch.Tensor:
    return token_windows("wikitext2:test", 2 * 19, 19, quiet=True)


# ------------------------------------------------------------------------------------------ reference
def _w(linear: torch.nn.Module) -> torch.Tensor:
    return linear.weight.detach().double()


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.detach().double()


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x (..., T, d) at positions 0 .. T-1."""
    t, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _attention(attn, x: torch.Tensor, depth: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The attention's output for its input x (B, T, E) and every attention tap's value by local name."""
    cfg = attn.config
    kind, h, hkv, d, dv = cfg.attention, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.value_dim
    n_rep = h // hkv
    b, t, _ = x.shape
    nq = 2 * h if kind in ("diff_v1", "diff_v2") else h
    nk = 2 * hkv if kind == "diff_v1" else hkv
    taps: dict[str, torch.Tensor] = {}
    q = _rope((x @ _w(attn.q_proj).T).view(b, t, nq, d).transpose(1, 2), cfg.rope_theta)
    k = _rope((x @ _w(attn.k_proj).T).view(b, t, nk, d).transpose(1, 2), cfg.rope_theta)
    v = (x @ _w(attn.v_proj).T).view(b, t, hkv, dv).transpose(1, 2)
    taps.update(q=q, k=k, v=v)
    visible = torch.ones(t, t, dtype=torch.bool).tril()

    def logits_of(qh: torch.Tensor, kh: torch.Tensor) -> torch.Tensor:
        return qh @ kh.transpose(-1, -2) / math.sqrt(d)

    def softmax(lg: torch.Tensor) -> torch.Tensor:
        return lg.masked_fill(~visible, float("-inf")).softmax(-1)

    if kind in ("diff_v1", "diff_v2"):
        if (
            kind == "diff_v1"
        ):  # head i: query sub-heads 2i, 2i+1; key sub-heads 2j, 2j+1 of pair j = i // n_rep
            pairs = [(2 * i + c, 2 * (i // n_rep) + c) for c in (0, 1) for i in range(h)]
            lam_init = (
                0.8 - 0.6 * math.exp(-0.3 * depth) if cfg.v1_lambda_init is None else cfg.v1_lambda_init
            )
            lq1, lk1, lq2, lk2 = (
                getattr(attn, n).detach().double()
                for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
            )
            lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lam_init
            lam_rows = lam.expand(b, h, t, 1)
        else:  # query heads 2i, 2i+1 both read kv head i // n_rep
            pairs = [(2 * i + c, i // n_rep) for c in (0, 1) for i in range(h)]
            lam = torch.sigmoid(x @ _w(attn.lambda_proj).T)  # (B, T, H)
            lam_rows = lam.transpose(1, 2)[..., None]
        lg = [
            torch.stack([logits_of(q[:, qi], k[:, ki]) for qi, ki in pairs[c * h : (c + 1) * h]], 1)
            for c in (0, 1)
        ]
        probs = [softmax(x_) for x_ in lg]
        diff = probs[0] - lam_rows * probs[1]
        taps.update(logits1=lg[0], logits2=lg[1], probs1=probs[0], probs2=probs[1], diff_map=diff)
        taps["lambda"] = lam
        heads = diff @ v.repeat_interleave(n_rep, 1)  # (B, H, T, dv)
        if kind == "diff_v1":
            heads = (1.0 - lam_init) * _rms(heads, attn.norm.weight, cfg.v1_norm_eps)
        head_out = heads.transpose(1, 2)
    else:
        lg = torch.stack([logits_of(q[:, i], k[:, i // n_rep]) for i in range(h)], 1)
        if kind == "sink":
            s = attn.sinks.detach().double() if cfg.sink == "learned" else torch.zeros(h, dtype=torch.float64)
            e = torch.where(visible, lg.exp(), 0.0)
            probs = e / (s.exp().view(1, h, 1, 1) + e.sum(-1, keepdim=True))
            taps["sink_logit"] = s
        else:
            probs = softmax(lg)
            if kind == "clipped":
                probs = ((cfg.clip_zeta - cfg.clip_gamma) * probs + cfg.clip_gamma).clamp(0.0, 1.0)
        taps.update(logits=lg, probs=probs)
        head_out = (probs @ v.repeat_interleave(n_rep, 1)).transpose(1, 2)  # (B, T, H, dv)
        if kind == "gated":
            width = dv if cfg.gate == "elementwise" else 1
            gate = torch.sigmoid(x @ _w(attn.gate_proj).T).view(b, t, h, width)
            taps["gate"] = gate
            taps["gate_proj.input"] = x
            head_out = head_out * gate
    if kind == "diff_v2":
        taps["lambda_proj.input"] = x
    taps["head_out"] = head_out
    for name in ("q_proj", "k_proj", "v_proj"):
        taps[f"{name}.input"] = x
    taps["o_proj.input"] = head_out.reshape(b, t, h * dv)
    out = taps["o_proj.input"] @ _w(attn.o_proj).T
    taps["out"] = out
    return out, taps


def reference_taps(model: DecoderLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tap's value by site name, from the formulas, for the whole model in float64."""
    eps = model.config.norm_eps
    x = model.embed.weight.detach().double()[ids]
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.layers):
        a, taps = _attention(block.attn, _rms(x, block.attn_norm.weight, eps), i)
        out.update({f"layers.{i}.attn.{n}": value for n, value in taps.items()})
        x = x + a
        hm = _rms(x, block.mlp_norm.weight, eps)
        gate = hm @ _w(block.mlp.gate).T
        act = gate * torch.sigmoid(gate) * (hm @ _w(block.mlp.up).T)
        out.update({f"layers.{i}.mlp.gate.input": hm, f"layers.{i}.mlp.up.input": hm})
        out.update({f"layers.{i}.mlp.act": act, f"layers.{i}.mlp.down.input": act})
        x = x + act @ _w(block.mlp.down).T
        out[f"layers.{i}.resid"] = x
    out["lm_head.input"] = _rms(x, model.norm.weight, eps)
    return out


def recorded_taps(model: DecoderLM, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every tap's output in one forward pass (each tap called exactly once), and the logits."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        tap.register_forward_hook(lambda _m, _a, o, name=name: seen.setdefault(name, []).append(o.detach()))
        for name, tap in model_taps(model).items()
    ]
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        for handle in handles:
            handle.remove()
    assert all(len(v) == 1 for v in seen.values()), {n: len(v) for n, v in seen.items() if len(v) != 1}
    return {n: v[0] for n, v in seen.items()}, logits


# ------------------------------------------------------------------------------------------ the test
@pytest.mark.parametrize("path", ["auto", "explicit"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_tap_of_every_kind_equals_its_formula(name, path):
    model = _model(name)
    model.set_attention_path(path)
    ids = _ids()
    want = reference_taps(model, ids)
    got, logits = recorded_taps(model, ids)
    assert sorted(got) == sorted(want)  # a tap without a formula here (or a formula without its tap) fails
    assert sorted(model_taps(model)) == sorted(got)  # every tap was called
    for site, value in want.items():
        assert got[site].shape == value.shape, (site, tuple(got[site].shape), tuple(value.shape))
        scale = max(1.0, float(value.abs().max()))
        err = float((got[site] - value).abs().max())
        assert err < TOL * scale, (site, err)
    lm = want["lm_head.input"] @ model.lm_head.weight.detach().double().T
    assert float((logits - lm).abs().max()) < TOL * float(lm.abs().max())
    kind = MODELS[name][1]
    if kind == "gated":  # the gate matters: head_out is not the ungated output
        heads = want["layers.1.attn.head_out"] / want["layers.1.attn.gate"]
        assert float((heads - want["layers.1.attn.head_out"]).abs().max()) > 1e-3
