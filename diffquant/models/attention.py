"""Baseline, DIFF V1, DIFF V2 and the rival kinds' causal self-attention, with taps at every probe point.

Semantics follow the DIFF paper (arXiv 2410.05258), with the unilm flash variants as reference, and the
DIFF V2 post of 2026-01-20. All kinds reduce to one core: one or two
softmax maps per output head, combined as ``A1 - lambda * A2`` for DIFF, applied to a value head.
The rivals (issue 30) change one step of that core each: ``gated`` multiplies each head's output by a
sigmoid gate of the layer input (Qiu et al. 2025), ``sink`` adds one logit per head to every softmax
denominator (Miller 2023; gpt-oss), ``clipped`` stretches and clips the softmax (Bondarenko et al. 2023).

Two execution paths compute that core:
- fused: torch SDPA, used when nobody observes the maps (the common case, and what GPU kernels replace);
- explicit: materialises logits, probabilities and the differential map, feeding them through their taps,
  in query chunks so a long sequence never holds a full T x S map per head at once. In training with no map
  tap engaged, each chunk runs under activation checkpointing, so autograd keeps no T x S map for backward
  either (``Attention.recompute_maps``; the clipped kind trains on this path).

Family options (``ModelConfig``): q/k/v biases (Qwen2) live in the projections; the per-head q/k RMSNorm
(Qwen3) runs on the projections' output before RoPE, so the q and k taps still see rotated, normalised heads;
a sliding window (Mistral) narrows :func:`_valid_mask`, which both paths and the map taps share. Gemma 3's
``layer_types`` give each layer its own window and RoPE base (``config.layer_window`` / ``layer_rope``, read
once into ``Attention.window`` / ``rope_theta`` / ``rope_scaling``), so every path of a layer uses the same.

A hook on a map tap only observes: the maps are computed for it, but the layer's output still comes from
the fused path, so profiling never changes a model's logits. A quantizer on a map tap rewrites the maps,
so then the explicit path's output is used. A kind with no fused form (``clipped``: SDPA cannot clip its
probabilities) always takes the explicit path; ``sink`` runs on SDPA with the sink as one extra key
(:meth:`Attention._fused`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from diffquant.kernels import (
    dispatch,  # module attributes: tests patch dispatch.kernel_core
    flash,
)
from diffquant.models.config import ATTENTION_KINDS, ModelConfig
from diffquant.models.taps import MAP_KINDS, Tap

ATTN_PATHS = ("auto", "fused", "explicit")
# Elements of one logits chunk (per component) that the explicit path materialises at most: 64 MiB in fp32.
DEFAULT_MAP_BUDGET = 1 << 24
# SDPA's own GQA (``enable_gqa``, torch >= 2.5) on the fused path while autograd records too. Off: its
# backward sums each group's dK / dV in another order than ``repeat_interleave``'s backward does, so the
# gradients would move off today's by rounding (CPU, torch 2.13, issue 46: outputs bit-identical; parameter
# gradients up to 3e-7 of their largest entry apart in fp32, 2.4e-5 on DIFF V1's lambda vectors, and about
# 1 ulp in bf16). Without autograd the forward is bit-identical, so it is used there (:meth:`Attention._fused`).
NATIVE_GQA_WITH_GRAD = False


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision norms, maps and the DIFF combination are computed in: float32 for fp16 / bf16 / fp32
    tensors (so half-precision models normalise like fp32 ones), float64 for float64 models (which must not
    be rounded through float32: relative error 1e-7 instead of 1e-16)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in :func:`compute_dtype` (fp32 for half-precision inputs).

    ``unit_offset`` (Gemma, ``ModelConfig.norm_unit_offset``): the gain is (1 + w) with w stored, so the
    identity norm has w = 0; the product is taken in the compute dtype and cast back, as transformers'
    Gemma3RMSNorm does. :meth:`gain` / :meth:`set_gain` read and write the gain whichever the form, so what
    folds a norm's gain elsewhere (smoothing, rotation) acts on (1 + w) here.
    """

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(compute_dtype(x.dtype))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            w = self.weight.to(y.dtype)
            y = y * (1.0 + w) if self.unit_offset else y * w
        return y.to(x.dtype)

    def gain(self) -> torch.Tensor:
        """The per-channel gain in float64: (1 + w) with ``unit_offset``, else w."""
        assert self.weight is not None, "gain of a norm without a weight"
        w = self.weight.detach().to(torch.float64)
        return 1.0 + w if self.unit_offset else w

    @torch.no_grad()
    def set_gain(self, gain: torch.Tensor) -> None:
        """Store ``gain`` (float64 or any float, cast to the weight's dtype): w = gain - 1 with ``unit_offset``."""
        assert self.weight is not None, "gain of a norm without a weight"
        g = gain.to(self.weight.device, torch.float64)
        self.weight.copy_((g - 1.0 if self.unit_offset else g).to(self.weight.dtype))

    def reset_gain(self) -> None:
        """The identity gain (w = 0 with ``unit_offset``, else 1)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)


class Linear(nn.Linear):
    """nn.Linear (no bias by default) with a ``linear_in`` tap on its input (``layers.0.mlp.up.input``),
    an optional ``weight_quantizer`` (a fake-quantizer applied to the weight) and an optional
    ``input_rotation`` (an online orthogonal transform of the input, applied before the tap, so the tap
    profiles and quantizes the rotated activation: QuaRot's R4 on the FFN's down projection)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.input = Tap("linear_in")
        self.weight_quantizer: nn.Module | None = None
        self.input_rotation: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.weight_quantizer is not None:
            weight = self.weight_quantizer.quantize_weight(weight)
        if self.input_rotation is not None:
            x = self.input_rotation(x)
        return F.linear(self.input(x), weight, self.bias)


def rope_inv_freq(
    dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """RoPE inverse frequencies (dim / 2,) in float64: theta^(-2i/dim), rescaled per ``scaling``.

    ``scaling`` is a validated ``ModelConfig.rope_scaling``:

    - ``linear``: every frequency / factor, which is the same as feeding positions / factor (position
      interpolation, Chen et al. 2023, arXiv 2306.15595).
    - ``llama3``: the piecewise rule released with Llama 3.1 (Dubey et al. 2024, arXiv 2407.21783; Meta's
      reference ``apply_scaling`` in llama-models), written here from the formula. With wavelength
      w = 2 pi / f and N the original context: w < N / high_freq_factor (fast, local channels) keeps f;
      w > N / low_freq_factor (slow channels that turned fewer than low_freq_factor times within the trained
      context) uses f / factor; in between, f is blended as
      (1 - s) f / factor + s f with s = (N / w - low_freq_factor) / (high_freq_factor - low_freq_factor),
      which is 0 at the slow edge and 1 at the fast edge, so the rule is continuous.

    Neither type rescales the cos/sin amplitude (transformers' ``attention_factor`` is 1 for both).
    """
    freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    if scaling is None:
        return freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * freq / factor + smooth * freq
    out = torch.where(wavelength > original / low, freq / factor, blended)
    return torch.where(wavelength < original / high, freq, out)


def rope_cos_sin(
    positions: torch.Tensor,
    dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, dim) for rotate-half RoPE (Su et al. 2021; the GPT-NeoX / HF Llama layout).

    ``inv_freq`` (float64, from :func:`rope_inv_freq`) carries any scaling; None = plain RoPE of ``theta``.
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(dim, theta, device=positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, d) by position: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LayerKV:
    """Keys (post-RoPE) and values of one layer for incremental decoding. A cache with ``pre_rope`` True
    (a quantized cache, diffquant/quant/kv_cache.py) takes keys before RoPE and returns them unrotated; the
    layer then rotates every returned key at its position."""

    pre_rope = False

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def select_rows(self, rows: torch.Tensor) -> LayerKV:
        """A new cache of batch rows ``rows`` (a prompt's cache branched per candidate continuation)."""
        out = type(self)()
        if self.k is not None and self.v is not None:
            out.k, out.v = (
                self.k.index_select(0, rows.to(self.k.device)),
                self.v.index_select(0, rows.to(self.v.device)),
            )
        return out


class Attention(nn.Module):
    """Shared machinery of every kind: projections, RoPE, cache, taps and both execution paths.

    Subclasses say how Q/K/V heads form the one or two maps per output head and what happens to the
    per-head output (``_components``, ``_lambda``, ``_finish_heads``), and the rivals what changes in the
    softmax or after it (``_sink_logits``, ``_normalise``, ``_gate``).
    """

    kind = ""
    # False: no SDPA form (the explicit path always computes the output, whatever ``path`` says).
    fused = True
    # The Linears that read the layer input x (the attention norm's output). R1 rotation rotates every
    # reader of the residual stream and SmoothQuant smooths them as one group, so a kind's own reader of x
    # must be named here (:meth:`input_linears`).
    input_readers: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__()
        self.config = config
        self.depth = depth
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.value_dim = c.value_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        k_heads = 2 * c.n_kv_heads if self.kind == "diff_v1" else c.n_kv_heads  # DIFF V1: two K components
        bias = c.attention_bias  # Qwen2: q, k, v only; o never
        self.q_proj = Linear(c.d_model, c.n_q_heads * c.head_dim, bias=bias)
        self.k_proj = Linear(c.d_model, k_heads * c.head_dim, bias=bias)
        self.v_proj = Linear(c.d_model, c.n_kv_heads * c.value_dim, bias=bias)
        self.o_proj = Linear(c.n_heads * c.value_dim, c.d_model)
        # Qwen3's qk-norm: one (d,) weight shared by every q head (and one by every k head), eps = norm_eps.
        # Gemma 3 has them too, with the (1 + w) gain (norm_unit_offset) of its other norms.
        offset = c.norm_unit_offset
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, unit_offset=offset) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, unit_offset=offset) if c.qk_norm else None
        # This layer's window and RoPE (Gemma 3's layer_types: sliding layers windowed with their own base).
        self.window = c.layer_window(depth)
        self.rope_theta, self.rope_scaling = c.layer_rope(depth)
        self.q, self.k, self.v = Tap("q"), Tap("k"), Tap("v")
        self.path = "auto"
        self.chunk_size: int | None = None  # queries per explicit-path chunk; None = from DEFAULT_MAP_BUDGET
        self.kernel = "auto"  # "auto": Triton kernel on CUDA when the plan fits; "triton": also on CPU; "off"
        self.last_path = "not run"
        # Explicit path under autograd, no map tap engaged: backward recomputes each query chunk's maps instead
        # of autograd keeping them (float32, T x S per head and component, several per chunk). False: keep them.
        self.recompute_maps = True
        # Optional online rotation of Q and K after RoPE (QuaRot's R3): a module called as
        # qk_rotation(q, k) -> (q, k), before the q / k taps, the kernels and the cache; logits are unchanged.
        self.qk_rotation: nn.Module | None = None
        # (key, inv_freq): a plain attribute, not a buffer, so state dicts and meta-device builds are unchanged.
        self._rope_cache: tuple[tuple, torch.Tensor] | None = None

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """This layer's RoPE inverse frequencies on ``device``, computed once per (config, device)."""
        theta, rope_scaling = self.rope_theta, self.rope_scaling
        scaling = tuple(sorted(rope_scaling.items())) if rope_scaling else None
        if torch.compiler.is_compiling():
            # traced into the graph once (Inductor folds it); filling the cache here would change state the
            # compiled graph is guarded on, and the next call would compile again
            return rope_inv_freq(self.head_dim, theta, rope_scaling, device)
        key = (self.head_dim, theta, scaling, device)
        if self._rope_cache is None or self._rope_cache[0] != key:
            self._rope_cache = (key, rope_inv_freq(self.head_dim, theta, rope_scaling, device))
        return self._rope_cache[1]

    def input_linears(self) -> dict[str, Linear]:
        """The Linears reading the layer input, by attribute name (see ``input_readers``)."""
        return {name: getattr(self, name) for name in self.input_readers}

    # ------------------------------------------------------------------------------ kind-specific
    def _components(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool = True
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """[(q_c, k_c)] per map component, each (B, H, T|S, d), and v (B, H, S, dv), kv expanded to H.

        ``expand`` False: k_c and v stay at their kv heads (B, Hkv, S, .), query head h reading kv head
        h // n_rep, the grouping SDPA's ``enable_gqa`` applies itself (no copy of K and V per query head)."""
        raise NotImplementedError

    def _lambda(self, x: torch.Tensor) -> torch.Tensor | None:
        """lambda broadcastable to (B, H, T, 1), or None for the baseline."""
        return None

    def _finish_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Post-processing of the per-head output (B, H, T, dv)."""
        return out

    def _sink_logits(self, like: torch.Tensor) -> torch.Tensor | None:
        """Per-head sink logits (H,) joining every softmax denominator, or None (no sink)."""
        return None

    def _normalise(self, logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
        """Attention probabilities from masked logits (-inf where invalid), in the logits' dtype."""
        return torch.softmax(logits, dim=-1)

    def _gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """Gate (B, T, H, 1 | dv) multiplying the per-head output, from the layer input x, or None."""
        return None

    def _map_taps(self) -> list[Tap]:
        return [m for m in self.children() if isinstance(m, Tap) and m.kind in MAP_KINDS]

    # ---------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        bsz, t, _ = x.shape
        pos0 = cache.length if cache is not None else 0
        q = self.q_proj(x).view(bsz, t, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 (transformers' Qwen3Attention): normalise each head over its d channels, then RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, -1, self.value_dim).transpose(1, 2)
        positions = torch.arange(pos0, pos0 + t, device=x.device)
        inv_freq = self.rope_inv_freq(x.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype, inv_freq)
        k_unrotated = k
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.qk_rotation is not None:
            q, k = self.qk_rotation(q, k)
        core = self._kernel_core(x, cache)
        if core is not None:
            # The fused kernel quantizes Q/K/P/V itself, exactly as the taps' fake-quantizers would;
            # the q/k/v and map taps are not called on this path.
            out = dispatch.run_kernel(self, q, k, v, self._lambda(x), core)
            self.last_path = "triton"
            return self._output(out, x)
        q, k, v = self.q(q), self.k(k), self.v(v)
        if cache is not None and cache.pre_rope:
            # KVQuant's pre-RoPE keys: the cache stores keys before RoPE; every key it returns is rotated
            # at its own position (the new ones come back exact, so they equal ``k``).
            keys, v = cache.append(k_unrotated, v)
            cos_all, sin_all = rope_cos_sin(
                torch.arange(keys.shape[2], device=x.device),
                self.head_dim,
                self.rope_theta,
                q.dtype,
                inv_freq,
            )
            k = apply_rope(keys, cos_all, sin_all)
        elif cache is not None:
            k, v = cache.append(k, v)
        lam = self._lambda(x)
        if cache is None and x.is_cuda and _flash_ready(self, x):
            out = (flash.diff_v2_flash if self.kind == "diff_v2" else flash.diff_v1_flash)(q, k, v, lam)
            self.last_path = "flash"
            return self._output(self._finish_heads(out), x)
        sink = self._sink_logits(q)
        if self._use_explicit():
            components, v_heads = self._components(q, k, v)
            out = self._explicit(components, v_heads, lam, pos0, sink=sink)
            self.last_path = "explicit"
        else:
            if self._maps_observed():
                # Observers see the maps, but the output stays the fused one, bit for bit.
                components, v_heads = self._components(q, k, v)
                self._explicit(components, v_heads, lam, pos0, need_output=False, sink=sink)
            out = self._fused(q, k, v, lam, pos0, sink=sink)
            self.last_path = "sdpa"
        return self._output(self._finish_heads(out), x)

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head output (B, H, T, dv) -> the gate, if the kind has one -> head_out tap -> o_proj -> attn_out
        tap. ``x`` is the layer input (B, T, d_model), which the gate reads."""
        bsz, t, _ = x.shape
        out = out.transpose(1, 2)  # (B, T, H, dv)
        gate = self._gate(x)
        if gate is not None:
            out = (out.to(gate.dtype) * gate).to(out.dtype)
        out = self.head_out(out)
        return self.out(self.o_proj(out.reshape(bsz, t, -1)))

    def _kernel_core(self, x: torch.Tensor, cache: LayerKV | None):
        """The Triton kernel's CoreQuant when this call should run it (prefill on CUDA, or forced), else None."""
        if cache is not None or self.kernel == "off" or (self.kernel == "auto" and not x.is_cuda):
            return None
        if self._maps_hooked() and self.kernel == "auto":
            return None  # someone watches the maps: they only exist on the explicit path

        return dispatch.kernel_core(self)

    def _use_explicit(self) -> bool:
        """Explicit output when forced, when a quantizer rewrites a map (hooks alone only observe), or when
        the kind has no fused form."""
        if not self.fused:
            return True
        if self.path == "auto":
            return any(tap.quantizer is not None for tap in self._map_taps())
        return self.path == "explicit"

    def _maps_observed(self) -> bool:
        return self.path != "fused" and any(tap.active for tap in self._map_taps())

    def _maps_hooked(self) -> bool:
        """A hook watches a map (a profiler, capture_maps): the maps exist only on the explicit path. Map
        quantizers alone do not count: the kernel implements those it accepts (dispatch.kernel_core), such as
        the fp8 P of the ``qk-int8-pv-fp8`` preset, which used to send every such layer down the explicit
        path on CUDA (issue 45)."""
        return self.path != "fused" and any(
            tap._forward_hooks or tap._forward_pre_hooks for tap in self._map_taps()
        )

    def _fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lam: torch.Tensor | None,
        pos0: int,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The core through SDPA: q (B, n_q_heads, T, d) and k / v at their kv heads -> (B, H, T, dv)."""
        t, s = q.shape[2], k.shape[2]
        # (the sink's mask comes with its extra key, from _sink_as_key below)
        mask, causal = (None, False) if sink is not None else self._sdpa_mask(t, s, pos0, v.device)
        # SDPA's own GQA instead of copying K / V per query head: only without a mask (CUDA's flash kernel
        # takes enable_gqa but no mask; with a mask it would fall to the math kernel, as transformers'
        # use_gqa_in_sdpa also avoids), never for the sink (its key carries a per-head logit), and under
        # autograd only when NATIVE_GQA_WITH_GRAD says so (see there: gradients differ by rounding).
        native = sink is None and mask is None and (NATIVE_GQA_WITH_GRAD or not _records_grad(q, k, v, lam))
        components, v = self._components(q, k, v, expand=not native)
        if sink is not None:
            components, v, mask = self._sink_as_key(components, v, sink, pos0)
        # SDPA's fast kernels (flash on CPU and CUDA) need one head width for Q, K and V; DIFF V1's value
        # heads are 2d wide against d-wide Q/K, which would send it to the slow math kernel. Zero-padding the
        # narrower side to the common width is exact: the extra channels add 0 to every Q.K^T dot product
        # (the scale is passed explicitly, so it stays 1/sqrt(d)) and padded V channels are sliced off.
        # Same cost as the DIFF paper's split-V flash variant ([softmax(QK^T) V1, softmax(QK^T) V2]) in
        # one call instead of two per component, and one softmax.
        dv = v.shape[-1]
        width = max(components[0][0].shape[-1], dv)
        v = _pad_width(v, width)

        def sdpa(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            gqa = {"enable_gqa": True} if qc.shape[1] != kc.shape[1] else {}
            return F.scaled_dot_product_attention(
                _pad_width(qc, width),
                _pad_width(kc, width),
                vc,
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                **gqa,
            )[..., :dv]

        if native and self.kind == "diff_v2":
            # The DIFF V2 post's form: one SDPA call over all 2H query heads (pairs interleaved, so both of a
            # pair read one kv head), then the pairs are split: the same per-head results as two calls.
            both = sdpa(q, components[0][1], v)
            outs = [both[:, 0::2], both[:, 1::2]]
        else:
            outs = [sdpa(qc, kc, v) for qc, kc in components]
        if lam is None:
            return outs[0]
        dtype = compute_dtype(v.dtype)
        return (outs[0].to(dtype) - lam.to(dtype) * outs[1].to(dtype)).to(v.dtype)

    def _sdpa_mask(self, t: int, s: int, pos0: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for SDPA: is_causal where it says exactly what the layer sees, else a
        boolean (T, S) mask, else nothing (one query after its whole cache)."""
        if self.window is not None and s > self.window:
            # The last query's window starts after key 0 (a prefill longer than the window, or a decode step
            # past it): SDPA's is_causal cannot express that, so the window goes in as a boolean mask.
            return _valid_mask(t, s, pos0, device, self.window)[0, 0], False
        if t == s:
            return None, t > 1
        if t > 1:
            return _valid_mask(t, s, pos0, device)[0, 0], False
        return None, False

    def _sink_as_key(self, components, v, sink: torch.Tensor, pos0: int):
        """SDPA has no sink, but a sink is exactly one more key whose logit is s and whose value is 0: it joins
        the softmax denominator and adds nothing to the output (gpt-oss appends the sink logit as a column
        and drops its probability; same thing). The logit s comes out of the dot product through one extra
        channel: queries get a 1 there, real keys a 0 (their logits are unchanged), the sink key s / scale
        (SDPA multiplies by scale), so no (H, T, S) float bias is ever built. The sink key goes first and is
        visible to every query (windowed or not, as in gpt-oss); the rest of the mask is the layer's causal /
        windowed one, as a (T, 1 + S) boolean. Returns (components, v, mask) for SDPA."""
        ((qc, kc),) = components
        bsz, heads, t, d = qc.shape
        s = kc.shape[2]
        # 16-bit on CUDA (training under autocast, bf16 inference): the head is zero-padded past the sink
        # channel to a multiple of 8, which SDPA's memory-efficient kernel (the one that takes this mask)
        # needs for 16-bit inputs; d + 1 sent the sink kind to the math kernel, which materialises T x S per
        # head (issue 46). Zero channels add exact zeros to every logit, but a longer dot product may sum
        # in another order, so elsewhere (CPU, fp32 on CUDA: a checking setting) the width stays d + 1 and
        # the results stay those of the CPU bit for bit.
        half = qc.dtype in (torch.float16, torch.bfloat16)
        width = -(-(d + 1) // 8) * 8 if qc.is_cuda and half else d + 1
        q1 = F.pad(torch.cat([qc, qc.new_ones(bsz, heads, t, 1)], dim=-1), (0, width - d - 1))
        sink_key = kc.new_zeros(bsz, heads, 1, width)
        sink_key[..., d] = (sink.to(compute_dtype(kc.dtype)) / self.scale).to(kc.dtype).view(1, heads, 1)
        k1 = torch.cat([sink_key, F.pad(kc, (0, width - d))], dim=2)
        v1 = torch.cat([v.new_zeros(bsz, heads, 1, v.shape[-1]), v], dim=2)
        valid = _valid_mask(t, s, pos0, v.device, self.window)[0, 0]
        mask = torch.cat([valid.new_ones(t, 1), valid], dim=1)
        return [(q1, k1)], v1, mask

    def _explicit(
        self, components, v, lam, pos0: int, need_output: bool = True, sink: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        bsz, heads, t, _ = components[0][0].shape
        s = components[0][1].shape[2]
        chunk = self.chunk_size or max(1, DEFAULT_MAP_BUDGET // max(1, bsz * heads * s))
        map_taps = self._map_taps()
        if not all(getattr(tap.quantizer, "row_local", True) for tap in map_taps):
            chunk = t  # a scale shared across query rows (per tensor / head) must see the whole map
        valid_all = _valid_mask(t, s, pos0, v.device, self.window)
        names = ("",) if len(components) == 1 else ("1", "2")
        # Observing only (no output wanted): stop after the last map someone watches (logits-only profiles
        # skip the softmax and the difference map).
        need_probs = need_output or any(tap.active for tap in map_taps if tap.kind in ("probs", "diff_map"))
        vf = v.to(compute_dtype(v.dtype))
        # Training: autograd would keep every chunk's logits and probabilities (float32, chunk x S per head
        # and component, several tensors each) until backward, i.e. all T x S maps of every layer at once.
        # Checkpointing a chunk keeps only its inputs (references to q, k, v, lambda) and recomputes its maps
        # in backward: the same ops on the same inputs, so outputs and gradients are the same bits. Not when a
        # map tap is engaged: its hooks and quantizers would run a second time in the recomputation. A chunk
        # draws no random numbers (no dropout), so the RNG state need not be saved and restored around it.
        recompute = (
            need_output
            and self.recompute_maps
            and _records_grad(*(x for pair in components for x in pair), v, lam, sink)
            and not any(tap.active for tap in map_taps)
        )
        pieces = []
        for t0 in range(0, t, chunk):
            t1 = min(t, t0 + chunk)
            args = (components, vf, lam, sink, valid_all[:, :, t0:t1], t0, t1, names, need_probs, need_output)
            if recompute:
                piece = torch.utils.checkpoint.checkpoint(
                    self._explicit_chunk, *args, use_reentrant=False, preserve_rng_state=False
                )
            else:
                piece = self._explicit_chunk(*args)
            if piece is not None:
                pieces.append(piece)
        return torch.cat(pieces, dim=2).to(v.dtype) if need_output else None

    def _explicit_chunk(
        self,
        components: list[tuple[torch.Tensor, torch.Tensor]],
        vf: torch.Tensor,
        lam: torch.Tensor | None,
        sink: torch.Tensor | None,
        valid: torch.Tensor,
        t0: int,
        t1: int,
        names: tuple[str, ...],
        need_probs: bool,
        need_output: bool,
    ) -> torch.Tensor | None:
        """Queries t0 .. t1 - 1 of the explicit path: their maps through the taps and, with ``need_output``,
        their output rows (B, H, t1 - t0, dv) in ``vf``'s (the compute) dtype. One function so that
        checkpointing recomputes exactly what the forward ran."""
        dtype = vf.dtype
        probs = []
        for (qc, kc), suffix in zip(components, names, strict=True):
            logits = torch.matmul(qc[:, :, t0:t1].to(dtype), kc.to(dtype).transpose(-1, -2)) * self.scale
            logits = getattr(self, "logits" + suffix)(logits, valid)
            if need_probs:
                p = self._normalise(logits.masked_fill(~valid, float("-inf")), sink)
                probs.append(getattr(self, "probs" + suffix)(p, valid))
        if not need_probs:
            return None
        if lam is None:
            attn_map = probs[0]
        else:
            lam_chunk = lam[:, :, t0:t1] if lam.dim() == 4 else lam
            attn_map = self.diff_map(probs[0] - lam_chunk * probs[1], valid)
        return torch.matmul(attn_map, vf) if need_output else None


def _flash_ready(attn: Attention, x: torch.Tensor) -> bool:
    return dispatch.flash_ready(attn, x)


def _pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with its last dimension zero-padded to ``width`` (unchanged when already that wide)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd records this step: grad mode is on and one of ``tensors`` (None allowed) requires grad."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


# The masks of the last few (T, S, position, device, window), shared by every layer of a forward and by the
# next forward of that shape. A profile reads a mask's visible and query positions off the device once per
# mask (diffquant.profile.stats._mask_positions): one mask for all layers is one read per batch, where a
# mask per layer was two waits for a GPU per layer. A kept mask whose version counter moved (an in-place
# change by a caller) is built again; masks of more than _MASK_KEEP_MAX entries are not kept (4,096 x 4,096
# tokens, 16 MiB; a 32K map's is 1 GiB), nor those made under torch.compile's tracing or inference_mode
# (whose tensors autograd cannot save later).
_MASKS: dict[tuple, tuple[torch.Tensor, int]] = {}
_MASKS_KEPT = 4
_MASK_KEEP_MAX = 1 << 24


def _valid_mask(t: int, s: int, pos0: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(1, 1, T, S) bool: query at absolute position p = pos0 + i may see keys 0 .. p, or with a sliding
    ``window`` W only keys j with p - W < j <= p (W keys, itself included: transformers'
    ``sliding_window_overlay``, Mistral's rolling buffer). Keys are at absolute positions 0 .. S - 1 (the
    cache keeps every key), so a decode step (T < S) is windowed at its own position. The same tensor for
    the same arguments while it is kept (:data:`_MASKS`): callers must not change it in place."""
    keep = t * s <= _MASK_KEEP_MAX and not (
        torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
    )
    key = (t, s, pos0, torch.device(device), window)
    if keep and key in _MASKS:
        valid, version = _MASKS.pop(key)
        if valid._version == version:
            _MASKS[key] = (valid, version)  # the most recent last
            return valid
    valid = _build_valid_mask(t, s, pos0, device, window)
    if keep:
        _MASKS[key] = (valid, valid._version)
        while len(_MASKS) > _MASKS_KEPT:
            del _MASKS[next(iter(_MASKS))]
    return valid


def _build_valid_mask(t: int, s: int, pos0: int, device: torch.device, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(pos0, pos0 + t, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    valid = k_pos <= q_pos
    if window is not None:
        valid = valid & (k_pos > q_pos - window)
    return valid[None, None]


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, d) -> (B, Hkv * n_rep, S, d); output head h reads kv head h // n_rep (GQA)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class BaselineAttention(Attention):
    """Standard multi-head causal attention with GQA (the comparison Transformer)."""

    kind = "baseline"

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        self.logits, self.probs = Tap("logits"), Tap("probs")
        self.head_out, self.out = Tap("head_out"), Tap("attn_out")

    def _components(self, q, k, v, expand=True):
        n_rep = self.n_heads // self.n_kv_heads if expand else 1
        return [(q, _repeat_heads(k, n_rep))], _repeat_heads(v, n_rep)


class DiffV1Attention(Attention):
    """DIFF V1 (DIFF paper, Eq. 1-3; unilm ``multihead_flashdiff_1``).

    Differential head i owns query sub-heads 2i, 2i+1 (interleaved) and reads kv pair i // n_rep, whose K
    sub-heads are 2j, 2j+1 and whose value is one 2d-wide head. One scalar lambda per layer:
    exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init; each head is RMS-normalised over its 2d channels and
    scaled by (1 - lambda_init).
    """

    kind = "diff_v1"

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        d = config.head_dim
        self.lambda_init = config.lambda_init(depth)
        self.lambda_q1 = nn.Parameter(torch.zeros(d))
        self.lambda_k1 = nn.Parameter(torch.zeros(d))
        self.lambda_q2 = nn.Parameter(torch.zeros(d))
        self.lambda_k2 = nn.Parameter(torch.zeros(d))
        self.norm = RMSNorm(2 * d, eps=config.v1_norm_eps, affine=config.v1_norm_affine)
        self.logits1, self.logits2 = Tap("logits"), Tap("logits")
        self.probs1, self.probs2 = Tap("probs"), Tap("probs")
        self.add_module("lambda", Tap("lambda"))
        self.diff_map = Tap("diff_map")
        self.head_out, self.out = Tap("head_out"), Tap("attn_out")

    def reset_lambda(self, std: float = 0.1) -> None:
        """The reference init: the four lambda vectors ~ N(0, 0.1)."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=std)

    def lambda_value(self) -> torch.Tensor:
        dtype = compute_dtype(self.lambda_q1.dtype)
        lam1 = torch.exp(torch.sum(self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)))
        lam2 = torch.exp(torch.sum(self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)))
        return lam1 - lam2 + self.lambda_init

    def _lambda(self, x):
        return getattr(self, "lambda")(self.lambda_value())

    def _components(self, q, k, v, expand=True):
        n_rep = self.n_heads // self.n_kv_heads if expand else 1
        k1, k2 = _repeat_heads(k[:, 0::2], n_rep), _repeat_heads(k[:, 1::2], n_rep)
        return [(q[:, 0::2], k1), (q[:, 1::2], k2)], _repeat_heads(v, n_rep)

    def _finish_heads(self, out):
        return self.norm(out) * (1.0 - self.lambda_init)


class DiffV2Attention(Attention):
    """DIFF V2 (DIFF V2 post; unilm ``multihead_flashdiffv2``).

    2h query heads of width d over the baseline's kv heads; output head i = attn(q_2i) -
    sigmoid(lambda_proj(x))_i * attn(q_2i+1), pairs interleaved so both lie in one GQA group. No norm,
    no lambda_init.
    """

    kind = "diff_v2"
    input_readers = (*Attention.input_readers, "lambda_proj")  # lambda = sigmoid(lambda_proj(x))

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        self.lambda_proj = Linear(config.d_model, config.n_heads)
        self.logits1, self.logits2 = Tap("logits"), Tap("logits")
        self.probs1, self.probs2 = Tap("probs"), Tap("probs")
        self.add_module("lambda", Tap("lambda"))
        self.diff_map = Tap("diff_map")
        self.head_out, self.out = Tap("head_out"), Tap("attn_out")

    def _lambda(self, x):
        z = self.lambda_proj(x)
        lam = getattr(self, "lambda")(torch.sigmoid(z.to(compute_dtype(z.dtype))))  # (B, T, H)
        return lam.transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)

    def _components(self, q, k, v, expand=True):
        # query head q reads kv head q // (2h / h_kv); for a pair (2i, 2i+1) that is i // n_rep.
        n_rep = self.n_heads // self.n_kv_heads if expand else 1
        k, v = _repeat_heads(k, n_rep), _repeat_heads(v, n_rep)
        return [(q[:, 0::2], k), (q[:, 1::2], k)], v


class GatedAttention(BaselineAttention):
    """Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708,
    Sec. 2.2, the G1 position): the baseline's heads, each head's SDPA output Y multiplied by a sigmoid gate
    of the layer input X (the pre-normed hidden state q/k/v read), before the heads are concatenated for
    o_proj:

        Y' = Y ⊙ sigmoid(X W_theta)

    ``config.gate`` = "elementwise": W_theta is d_model x (n_heads * head_dim), one gate per output channel
    (the paper's best variant, Qwen3-Next's); "headwise": d_model x n_heads, one scalar per head broadcast
    over its channels. W_theta is ``gate_proj``, a Linear like q/k/v (so plans quantize it and R1 rotates it);
    the sigmoid runs in the compute dtype (fp32 for half-precision models). Taps: ``gate`` (kind
    ``attn_gate``, the sigmoid values, (B, T, H, dv | 1)); ``head_out`` sees the gated output o_proj reads.
    """

    kind = "gated"
    input_readers = (*Attention.input_readers, "gate_proj")

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        self.gate_width = config.value_dim if config.gate == "elementwise" else 1
        self.gate_proj = Linear(config.d_model, config.n_heads * self.gate_width)
        self.gate = Tap("attn_gate")

    def _gate(self, x):
        z = self.gate_proj(x)
        g = torch.sigmoid(z.to(compute_dtype(z.dtype)))
        return self.gate(g.view(*x.shape[:2], self.n_heads, self.gate_width))  # (B, T, H, dv | 1)


class SinkAttention(BaselineAttention):
    """Softmax with an attention sink: one extra logit s_h per head in every row's softmax denominator,
    whose probability is dropped, so a head can put less than all of its attention on the keys:

        p_j = exp(l_j) / (exp(s_h) + sum_k exp(l_k))

    ``config.sink`` = "zero": s_h = 0, softmax-off-by-one (Miller 2023, "Attention Is Off By One": softmax_1);
    "learned": s_h a trained parameter per head (``sinks``, zero at init; OpenAI 2025, gpt-oss: "a learned
    bias in the denominator of the softmax"). The sink is always visible (a sliding window does not hide it).
    Taps: ``sink_logit`` (kind ``sink_logit``, the (H,) logits; quantizing it quantizes the sink, the
    ``logits`` tap holds the key logits only); ``probs`` are the key probabilities, whose rows sum to
    1 - the sink's share. The fused path runs SDPA with the sink as one extra key
    (:meth:`Attention._sink_as_key`).
    """

    kind = "sink"

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.sink == "learned" else None
        self.sink_logit = Tap("sink_logit")

    def reset_sinks(self) -> None:
        """The initial sinks: zero (the model starts as softmax-off-by-one)."""
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def _sink_logits(self, like):
        s = self.sinks if self.sinks is not None else like.new_zeros(self.n_heads)
        return self.sink_logit(s)

    def _normalise(self, logits, sink):
        # gpt-oss's form: the sink logit as one more column of the row, its probability dropped.
        column = sink.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([column, logits], dim=-1), dim=-1)[..., 1:]


class ClippedAttention(BaselineAttention):
    """Clipped softmax (Bondarenko et al. 2023, "Quantizable Transformers: Removing Outliers by Helping
    Attention Heads Do Nothing", arXiv 2306.12929, Sec. 4.1):

        clipped_softmax(x; zeta, gamma) = clip((zeta - gamma) * softmax(x) + gamma, 0, 1)

    gamma = ``config.clip_gamma`` (default -0.025) <= 0 and zeta = ``config.clip_zeta`` (default 1) >= 1 let
    a head reach exact 0 (and 1) with finite logits, so it need not grow outliers to do nothing. Rows no
    longer sum to 1 (that is the paper's). Masked keys stay 0: gamma clips to 0. SDPA cannot clip, so this
    kind always takes the explicit path (in query chunks: the clip is per entry, so chunking is exact);
    ``probs`` sees the clipped probabilities that multiply V.
    """

    kind = "clipped"
    fused = False

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__(config, depth)
        self.clip_gamma, self.clip_zeta = float(config.clip_gamma), float(config.clip_zeta)

    def _normalise(self, logits, sink):
        p = torch.softmax(logits, dim=-1)
        return ((self.clip_zeta - self.clip_gamma) * p + self.clip_gamma).clamp(0.0, 1.0)


# Keyed by each class's ``kind`` (a name of config.ATTENTION_KINDS), in that table's order.
ATTENTION_CLASSES: dict[str, type[Attention]] = {
    cls.kind: cls
    for cls in (
        BaselineAttention,
        DiffV1Attention,
        DiffV2Attention,
        GatedAttention,
        SinkAttention,
        ClippedAttention,
    )
}
assert tuple(ATTENTION_CLASSES) == ATTENTION_KINDS, "one attention class per kind of models.config"
