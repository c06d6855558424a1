"""A quantized KV cache for decoding (KIVI, Liu et al. 2024, arXiv 2402.02750): packed codes, not fake floats.

A plan's ``kv_cache`` section replaces every layer's cache (:class:`~diffquant.models.attention.LayerKV`)
with a :class:`QuantizedLayerKV` when the model decodes (``model.new_cache()``: greedy generation, needle
retrieval, lm-eval ``generate_until``, decode-mode perplexity). A whole-window forward has no cache and is
not affected. Per layer, keys and values each hold three parts, in token order::

    [ sinks: the first ``sinks`` tokens, full precision ]   (attention sinks, Xiao et al. 2024)
    [ body: quantized, packed codes + scale + zero per group ]
    [ window: up to ``window`` recent tokens, full precision ]

New tokens join the window (after the sinks are full). Attention at a step reads sinks + the dequantized
body + the window, the new tokens included in full precision; then, when the window holds ``window``
tokens or more, its tokens move into the body, quantized (tokens grouped along the token axis move in
whole groups; the rest waits). That is KIVI's streaming scheme.

Quantization is asymmetric min-max per group (KIVI eq. (1); the rule of optimum-quanto's ``MaxOptimizer``
that transformers' ``QuantizedCache`` uses): for a group G with lo = min G, hi = max G and b bits,
``scale = (hi - lo) / (2^b - 1)``, ``code = clamp(round((x - lo) / scale), 0, 2^b - 1)`` (round half to even),
``x_hat = code * scale + lo``. A constant group (scale 0) stores code 0 and reads back lo exactly.

Groups: ``token`` = ``group`` consecutive channels of one token of one head (KIVI's values; quanto
``axis=0``); ``channel`` = ``group`` consecutive tokens of one channel of one head (KIVI's keys: key outliers
sit in fixed channels, so per-channel scales isolate them; quanto ``axis=-1`` when the sequence is a multiple
of the group). ``pre_rope`` (KVQuant, Hooper et al. 2024) caches keys before RoPE and rotates the
dequantized keys at every read, so the quantizer sees keys whose outlier channels are not mixed by position.

Codes are packed ``8 / bits`` per byte along the channel dim, planar: byte j of a row of D channels holds
channel ``j + i * D / per`` in bits ``[bits * i, bits * (i + 1))`` (per = 8 / bits), so unpacking writes
contiguous half / quarter rows instead of interleaving (a decode step dequantizes the whole body, and the
interleaving copy was its slowest part). Scale and zero are kept in the cache's dtype, or in float16 /
bfloat16 with ``scale_dtype`` (KIVI's layout in a float32 model: 16-bit scales halve their share of the
bytes); the codes are computed from the rounded scale and zero, so what is stored is what is read.
:meth:`QuantizedLayerKV.nbytes` counts the bytes of the tensors it holds.

Works for all three attention kinds: the cache holds what the layer's K / V projections produce (DIFF V1:
two key sub-heads per KV head and 2d-wide values; DIFF V2: the baseline's K / V heads, read by both query
heads of a pair).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.formats import minmax_params
from diffquant.models.attention import LayerKV, apply_rope, rope_cos_sin
from diffquant.models.transformer import KVCache
from diffquant.schema import key

AXES = ("token", "channel")
Axis = Literal["token", "channel"]
FORMATS = ("int2", "int4", "int8", "fp8")  # a plan's kv_cache.format: asymmetric min-max integers, or float8
FP8_MAX = 448.0  # largest float8_e4m3fn magnitude
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class KVCacheSpec:
    """A plan's ``kv_cache`` section (checked by :func:`diffquant.schema.check`). Defaults: KIVI's setting
    (keys per channel, values per token) at int4, groups of 32, a 128-token full-precision window. ``bits``
    is a read-only view of ``format`` (fp8: 8) for the code that packs."""

    # the old spellings: bits + format int / fp8 are one format key, residual is the window
    RENAMED: ClassVar[dict[str, str]] = {"bits": "format", "residual": "window"}

    format: Literal["int2", "int4", "int8", "fp8"] = key(
        "int4", what="one of 'int2', 'int4', 'int8', 'fp8' (the old bits: 4 + format: int is format: int4)"
    )
    keys: Axis = key("channel")
    values: Axis = key("token")
    group: int = key(32, min=1)
    window: int = key(128, min=0)
    sinks: int = key(0, min=0)
    pre_rope: bool = key(False)
    scale_dtype: Literal["model", "float16", "bfloat16"] = key("model")

    @property
    def bits(self) -> int:
        """Bits per code: 2, 4 or 8 (fp8: 8)."""
        return 8 if self.format == "fp8" else int(self.format.removeprefix("int"))

    @property
    def codes(self) -> str:
        """How a group is coded: ``int`` (asymmetric min-max) or ``fp8`` (:func:`quantize_groups`'s ``fmt``)."""
        return "fp8" if self.format == "fp8" else "int"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def label(self) -> str:
        extra = [f"r{self.window}"] + ([f"sinks{self.sinks}"] if self.sinks else [])
        extra += ["pre-rope"] if self.pre_rope else []
        extra += [f"scales:{self.scale_dtype}"] if self.scale_dtype != "model" else []
        kind = "fp8" if self.format == "fp8" else f"kv{self.bits}"
        return f"{kind} K:{self.keys} V:{self.values} g{self.group} " + " ".join(extra)

    def shortest_window(self) -> int:
        """The shortest decode-mode window (prefill + one token per step, ``L`` tokens) whose decode steps
        read a quantized token: the cache holds at most L - 2 tokens before the last step (the tokens
        moved into the body after the last step are never read), of which the first ``sinks`` stay in
        full precision and a move needs a full window of ``window`` tokens (at least one)."""
        return self.sinks + max(self.window, 1) + 2

    def idle_within(self, window: int, where: str) -> str | None:
        """Why decode-mode windows of ``window`` tokens would never read a quantized token under this
        cache (sinks and the full-precision window hold every position), or None when they do. Such a
        run measures the unquantized cache while its results say kv{bits}."""
        if window >= self.shortest_window():
            return None
        return (
            f"{where}: the kv_cache keeps {self.sinks} sink(s) + a window of {self.window} recent tokens "
            f"in full precision, and decode-mode windows of {window} tokens read at most {max(window - 2, 0)} "
            f"cached tokens: nothing would be quantized (the numbers would be the unquantized cache's, "
            f"labelled {self.label().split()[0]}); use seq_len >= {self.shortest_window()}, or fewer "
            "sinks / a smaller window"
        )

    def check_model(self, head_dim: int, value_dim: int, where: str) -> None:
        """One-line errors for a group that cannot tile this model's heads or the window."""
        for name, axis, width in (("keys", self.keys, head_dim), ("values", self.values, value_dim)):
            if axis == "token" and width % self.group:
                raise DiffquantError(
                    f"{where}: kv_cache.group {self.group} does not divide the {name}' head width {width} "
                    f"({name}: token groups channels of one token)"
                )
            if axis == "token" and (width * self.bits) % 8:
                raise DiffquantError(
                    f"{where}: kv_cache: {self.bits}-bit codes of {width} channels do not fill whole bytes"
                )
            if axis == "channel":
                if self.window == 0 or self.window % self.group:
                    raise DiffquantError(
                        f"{where}: kv_cache.window {self.window} must be a positive multiple of "
                        f"group {self.group} ({name}: channel groups {self.group} tokens, which wait in the "
                        "window until a group is full)"
                    )
                if (width * self.bits) % 8:
                    raise DiffquantError(
                        f"{where}: kv_cache: {self.bits}-bit codes of {width} channels do not fill whole bytes"
                    )


# ------------------------------------------------------------------------------------------ codes
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2^bits) packed ``8 // bits`` per byte along the last dim, planar: of a row of D codes,
    byte j holds code ``j + i * D / per`` in bits ``[bits * i, bits * (i + 1))``."""
    per = 8 // bits
    if per == 1:
        return codes
    planes = codes.view(*codes.shape[:-1], per, codes.shape[-1] // per)
    out = planes[..., 0, :].clone()
    for i in range(1, per):
        out |= planes[..., i, :] << (bits * i)
    return out


def unpack_into(out: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Write the codes of ``packed`` into ``out`` (any dtype, last dim ``8 // bits`` times longer; it may be
    a strided view): one contiguous plane per code of a byte, no interleaving copy."""
    per = 8 // bits
    if per == 1:
        return out.copy_(packed)
    planes = out.view(*out.shape[:-1], per, out.shape[-1] // per)
    mask = (1 << bits) - 1
    for i in range(per):
        plane = packed if i == 0 else packed >> (bits * i)
        planes[..., i, :].copy_(plane if i == per - 1 else plane & mask)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: uint8 codes, the last dim ``8 // bits`` times longer."""
    per = 8 // bits
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * per, dtype=torch.uint8, device=packed.device)
    return unpack_into(out, packed, bits)


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """(B, H, S, D) -> groups on the last dim: token axis (B, H, S, D/g, g), channel axis (B, H, S/g, D, g)."""
    b, h, s, d = x.shape
    if axis == "token":
        return x.reshape(b, h, s, d // group, group)
    return x.reshape(b, h, s // group, group, d).transpose(-1, -2)


def _ungrouped(g: torch.Tensor, axis: str, shape: tuple[int, ...]) -> torch.Tensor:
    if axis == "token":
        return g.reshape(shape)
    return g.transpose(-1, -2).reshape(shape)


def quantize_groups(
    x: torch.Tensor,
    bits: int,
    axis: str,
    group: int,
    fmt: str = "int",
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes (B, H, S, D) uint8 in [0, 2^bits), scale, zero) of asymmetric min-max groups of ``x``
    (B, H, S, D); scale / zero have the group dim reduced (token: (B, H, S, D/g); channel: (B, H, S/g, D)).

    ``fmt="fp8"``: symmetric float8 e4m3 codes (the bits of torch's float8_e4m3fn cast, round to nearest even)
    of x / scale with scale = absmax / 448 per group, and no zero (None).

    ``scale_dtype``: scale and zero are rounded to it first and returned in it; the codes are computed from
    the rounded values (x's dtype otherwise)."""
    g = _grouped(x, axis, group)

    def stored(t: torch.Tensor) -> torch.Tensor:
        return t if scale_dtype is None else t.to(scale_dtype).to(x.dtype)

    if fmt == "fp8":
        scale = stored(g.abs().amax(-1) / FP8_MAX)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        ratio = (g / safe.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        codes = ratio.to(torch.float8_e4m3fn).view(torch.uint8)
        return _ungrouped(codes, axis, tuple(x.shape)), scale.to(scale_dtype or x.dtype), None
    # KIVI's min-max: the zero is the (stored) group min itself, x_hat = code * scale + lo
    scale, lo = minmax_params(stored(g.amin(-1)), g.amax(-1), 2**bits - 1, include_zero=False, zero="min")
    scale = stored(scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 2**bits - 1)
    codes = _ungrouped(codes.to(torch.uint8), axis, tuple(x.shape))
    out_dtype = scale_dtype or x.dtype
    return codes, scale.to(out_dtype), lo.to(out_dtype)


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, axis: str, group: int
) -> torch.Tensor:
    """x_hat = code * scale + zero per group (the inverse of :func:`quantize_groups` up to rounding); with
    no zero (fp8) the codes are float8_e4m3fn bits and x_hat = fp8 value * scale. Unpacked codes (B, H, S, D):
    :func:`dequantize_packed_into` of one code per byte."""
    out = torch.empty(codes.shape, dtype=scale.dtype, device=codes.device)
    return dequantize_packed_into(out, codes, scale, zero, 8, axis, group)


def _scale_into(
    out: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, axis: str, group: int
) -> torch.Tensor:
    """In place: ``out`` (B, H, S, D) holding code values becomes code * scale (+ zero) per group. The groups
    are views of ``out`` (channel groups split the token dim, token groups the channel dim), so nothing is
    transposed or copied."""
    b, h, s, d = out.shape
    dim = -1 if axis == "token" else 3  # where a group's members lie in the grouped view
    g = out.view(b, h, s, d // group, group) if axis == "token" else out.view(b, h, s // group, group, d)
    g.mul_(scale.unsqueeze(dim))
    if zero is not None:
        g.add_(zero.unsqueeze(dim))
    return out


def dequantize_packed_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    axis: str,
    group: int,
) -> torch.Tensor:
    """x_hat of packed codes written straight into ``out`` (B, H, S, D), a view of the step's key / value
    tensor: the planes are unpacked into it, then scaled in place (same values as :func:`dequantize_groups`
    of :func:`unpack`, bit for bit)."""
    if zero is None:
        out.copy_(packed.view(torch.float8_e4m3fn))
    else:
        unpack_into(out, packed, bits)
    return _scale_into(out, scale, zero, axis, group)


# ------------------------------------------------------------------------------------------ the cache
class _Stream:
    """Keys or values of one layer: full-precision sinks, the packed quantized body, the full window."""

    def __init__(self, spec: KVCacheSpec, axis: str) -> None:
        self.spec, self.axis = spec, axis
        self.sink: torch.Tensor | None = None
        self.window: torch.Tensor | None = None
        self.codes: torch.Tensor | None = None  # packed (B, H, N, D * bits / 8)
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # of the tokens moved into the body (what a read returns)

    @property
    def body_len(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def _len(self, t: torch.Tensor | None) -> int:
        return 0 if t is None else t.shape[2]

    @property
    def length(self) -> int:
        return self._len(self.sink) + self.body_len + self._len(self.window)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Add new tokens (B, H, T, D); return every cached token (B, H, S, D) for this step's attention."""
        free = self.spec.sinks - self._len(self.sink)
        if free > 0:
            head, x = x[:, :, :free], x[:, :, free:]
            self.sink = head if self.sink is None else torch.cat([self.sink, head], dim=2)
        if x.shape[2]:
            self.window = x if self.window is None else torch.cat([self.window, x], dim=2)
        parts = [t for t in (self.sink, self.window) if t is not None and t.shape[2]]
        if self.codes is None and len(parts) == 1:
            out = parts[0]
        else:  # one tensor for the step, the body dequantized straight into its slice (no concatenation)
            like = x if self.window is None else self.window
            b, h, _, d = like.shape
            out = torch.empty(b, h, self.length, d, dtype=like.dtype, device=like.device)
            body_start = self._len(self.sink)
            window_start = body_start + self.body_len
            if body_start:
                out[:, :, :body_start].copy_(self.sink)
            if self.body_len:
                self._body_into(out[:, :, body_start:window_start])
            if window_start < self.length:
                out[:, :, window_start:].copy_(self.window)
        self._flush()
        return out

    def _body_into(self, out: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        return dequantize_packed_into(
            out, self.codes, self.scale, self.zero, spec.bits, self.axis, spec.group
        )

    def body(self) -> torch.Tensor | None:
        """The quantized body, dequantized (B, H, N, D) in the cache's dtype, or None."""
        if self.codes is None:
            return None
        b, h, n, packed = self.codes.shape
        shape = (b, h, n, packed * (8 // self.spec.bits))
        return self._body_into(torch.empty(shape, dtype=self.dtype, device=self.codes.device))

    def _flush(self) -> None:
        n = self._len(self.window)
        if n == 0 or n < self.spec.window:
            return
        if self.axis == "channel":
            n -= n % self.spec.group  # whole groups of tokens only
            if n == 0:
                return
        move, self.window = self.window[:, :, :n], self.window[:, :, n:]
        self.dtype = move.dtype
        scale_dtype = SCALE_DTYPES.get(self.spec.scale_dtype)
        codes, scale, zero = quantize_groups(
            move, self.spec.bits, self.axis, self.spec.group, self.spec.codes, scale_dtype
        )
        codes = pack(codes, self.spec.bits)
        if self.codes is None:
            self.codes, self.scale, self.zero = codes, scale, zero
        else:
            self.codes = torch.cat([self.codes, codes], dim=2)
            self.scale = torch.cat([self.scale, scale], dim=2)
            self.zero = None if zero is None else torch.cat([self.zero, zero], dim=2)

    def select_rows(self, rows: torch.Tensor) -> _Stream:
        out = _Stream(self.spec, self.axis)
        out.dtype = self.dtype
        for name in ("sink", "window", "codes", "scale", "zero"):
            t = getattr(self, name)
            setattr(out, name, None if t is None else t.index_select(0, rows.to(t.device)))
        return out

    def nbytes(self) -> dict[str, int]:
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "codes": size(self.codes),
            "scales": size(self.scale),
            "zeros": size(self.zero),
            "full": size(self.sink) + size(self.window),
            "quantized_tokens": self.body_len,
        }


class QuantizedLayerKV(LayerKV):
    """One layer's KV cache under a :class:`KVCacheSpec` (see the module docstring)."""

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__()
        self.spec = spec
        self.pre_rope = spec.pre_rope
        self._k = _Stream(spec, spec.keys)
        self._v = _Stream(spec, spec.values)

    @property
    def length(self) -> int:
        return self._k.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.append(k), self._v.append(v)

    def bodies(self) -> dict[str, tuple[int, torch.Tensor | None]]:
        """Per stream (``k``, ``v``): the position of the body's first token and the dequantized body (None
        while nothing is quantized); pre-RoPE keys come back unrotated."""
        return {
            name: (stream._len(stream.sink), stream.body())
            for name, stream in (("k", self._k), ("v", self._v))
        }

    def select_rows(self, rows: torch.Tensor) -> QuantizedLayerKV:
        out = QuantizedLayerKV(self.spec)
        out._k, out._v = self._k.select_rows(rows), self._v.select_rows(rows)
        return out

    def nbytes(self) -> dict[str, dict[str, int]]:
        return {"keys": self._k.nbytes(), "values": self._v.nbytes()}


class KVCacheLayers:
    """The model's cache-layer factory (``model.quant.kv_cache``): a QuantizedLayerKV per layer."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec

    def __call__(self, depth: int) -> QuantizedLayerKV:
        return QuantizedLayerKV(self.spec)


def attach_kv_cache(
    model: nn.Module, spec: KVCacheSpec, where: str = "plan"
) -> tuple[KVCacheLayers, list[tuple[str, str, str]]]:
    """The cache-layer factory that makes ``model.new_cache()`` return quantized caches once the pipeline
    puts it in the model's quantization state, and the insertion record; checks the group against the
    model's heads."""
    config = model.config
    spec.check_model(config.head_dim, config.value_dim, where)
    return KVCacheLayers(spec), [("kv_cache", "layers.*", spec.label())]


def cache_nbytes(cache: Any) -> dict[str, int]:
    """Bytes held by a model's cache (summed over layers): codes, scales, zeros and full-precision tokens;
    for an unquantized cache everything is ``full``."""
    total = {"codes": 0, "scales": 0, "zeros": 0, "full": 0}
    for layer in cache.layers:
        if isinstance(layer, QuantizedLayerKV):
            for part in layer.nbytes().values():
                for name in total:
                    total[name] += part[name]
        else:
            for t in (layer.k, layer.v):
                if t is not None:
                    total["full"] += t.numel() * t.element_size()
    return total


def kv_cache_error(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> list[dict[str, Any]]:
    """Per layer, the quantization error of the cache: each window (B, T) prefilled once into a
    full-precision cache and once into the plan's quantized one (the K / V they receive are the same bits),
    then the dequantized body compared with the keys / values it stands for (pre-RoPE keys rotated back to
    their positions first). Returns per layer ``k_sqnr_db`` / ``v_sqnr_db`` (10 log10 of signal over error
    energy; None when nothing was quantized, inf when exact) and ``quantized_tokens`` per window row."""
    spec = model.quant.kv_cache.spec
    n_layers = model.config.n_layers
    sums = [{"k": [0.0, 0.0], "v": [0.0, 0.0], "tokens": 0} for _ in range(n_layers)]
    with torch.no_grad():
        for batch in windows.split(batch_size):
            plain = KVCache(n_layers)
            model(batch, plain)
            quantized = model.new_cache()
            model(batch, quantized)
            for i, (ref, got) in enumerate(zip(plain.layers, quantized.layers, strict=True)):
                bodies = got.bodies()
                for name, full in (("k", ref.k), ("v", ref.v)):
                    start, body = bodies[name]
                    if body is None or full is None:
                        continue
                    n = body.shape[2]
                    if name == "k" and spec.pre_rope:
                        attn = model.layers[i].attn
                        cos, sin = rope_cos_sin(
                            torch.arange(start, start + n, device=body.device),
                            attn.head_dim,
                            attn.rope_theta,
                            body.dtype,
                            attn.rope_inv_freq(body.device),
                        )
                        body = apply_rope(body, cos, sin)
                    target = full[:, :, start : start + n].double()
                    sums[i][name][0] += float(target.square().sum())
                    sums[i][name][1] += float((body.double() - target).square().sum())
                    sums[i]["tokens"] = n

    def sqnr(signal: float, noise: float) -> float | None:
        if signal == 0.0 and noise == 0.0:
            return None
        return math.inf if noise == 0.0 else 10.0 * math.log10(signal / noise)

    return [
        {
            "layer": i,
            "k_sqnr_db": sqnr(*s["k"]),
            "v_sqnr_db": sqnr(*s["v"]),
            "quantized_tokens": s["tokens"],
        }
        for i, s in enumerate(sums)
    ]


def format_kv_error(rows: list[dict[str, Any]], tokens: int) -> str:
    """One line per layer of :func:`kv_cache_error` under a header (the quantize command's report)."""

    def db(value: float | None) -> str:
        return "-" if value is None else ("exact" if math.isinf(value) else f"{value:.1f}")

    lines = [
        f"KV cache error after a prefill of the {tokens:,} held-out tokens (SQNR dB, dequantized vs cached):"
    ]
    lines.append(f"{'layer':>5} {'K':>7} {'V':>7} {'quantized tokens':>17}")
    for r in rows:
        lines.append(
            f"{r['layer']:>5} {db(r['k_sqnr_db']):>7} {db(r['v_sqnr_db']):>7} {r['quantized_tokens']:>17}"
        )
    return "\n".join(lines)
