"""Rotation: a plan transform that spreads outlier channels before quantization, exactly (QuaRot / SpinQuant).

QuaRot (Ashkboos et al. 2024, arXiv 2404.00456) and SpinQuant (Liu et al. 2024, arXiv 2405.16406) use the
computational invariance of RMSNorm models (SliceGPT, Ashkboos et al. 2024): for an orthogonal Q,
RMSNorm(x Q) = RMSNorm(x) Q once the norm has no weight. So, with every RMSNorm's weight folded into the
Linears that read its output:

- ``residual`` (R1): the residual stream is carried as x Q. The embedding becomes E Q, every Linear that
  reads the stream W Q (q / k / v, DIFF V2's lambda_proj, gated attention's gate_proj: the attention's
  ``input_linears``; gate / up, the LM head), every Linear that writes it Q^T W (o_proj, down). A tied LM
  head is untied (its folded norm weight differs from the embedding).
- ``heads`` (R2): per layer, each value head's output is rotated by a head-sized matrix R: V's rows R^T W_v,
  O's input columns W_o R. Attention is linear in V (A1 V - lambda A2 V too; a sink's zero value, clipped
  probabilities too), so the head output is rotated by R and O undoes it. DIFF V1 normalises each 2d-wide
  head with RMSNorm(.) * weight * (1 - lambda_init): its weight is folded into O first (an un-weighted
  RMSNorm commutes with R); the scalar (1 - lambda_init) commutes with any R and stays where the kernels
  expect it. A head-wise gate (one scalar per head) commutes with R; an element-wise gate multiplies each
  channel of the head output by its own gate, (Y R) ⊙ g != (Y ⊙ g) R, so R2 is skipped for it (the report
  says so; R1, R3 and R4 still run), rather than refusing every rotation preset on those models.
- ``ffn`` (R4): an online rotation of the down projection's input, x -> x Q, with W_down Q folded into
  the weight; the ``mlp.down.input`` tap (profiled, quantized) sees the rotated activation.
- ``qk`` (R3): an online rotation of Q and K after RoPE, q -> q R, k -> k R per head: every logit q.k is
  unchanged; the ``q`` / ``k`` taps (and a KV cache) see rotated values. One R per KV head: DIFF V1's two
  sub-heads of a pair use their key sub-head's matrix, DIFF V2's two query heads share their KV head's.
  lambda's parameters (V1) are not touched.

Matrices are ``hadamard`` (H / sqrt(n), :mod:`diffquant.quant.hadamard`; a size with none uses a
block-diagonal Hadamard of ``hadamard_block`` if given), ``random`` (seeded: Q of the QR of a Gaussian,
signs fixed so the draw is Haar-distributed) or ``none``. Weights are transformed in float64 and cast back,
so a float64 model is rotated to rounding (1e-12) and a float32 one to float32 rounding.

Order in a plan: rotation runs when the plan is applied, before any quantizer sees a weight, and before
SmoothQuant smoothing (which runs at calibration): smoothing then balances the rotated channels, whose norms
now have unit weights to fold its scales into. Smoothing first would have its scales folded into the readers
by R1 and mixed away by the rotation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear, RMSNorm
from diffquant.quant import hadamard as had
from diffquant.schema import key

METHODS = ("hadamard", "random", "none")
Method = Literal["hadamard", "random", "none"]
PLACES = ("residual", "heads", "ffn", "qk")


@dataclass
class RotateSpec:
    """A plan's ``rotate`` section (checked by :func:`diffquant.schema.check`)."""

    RENAMED: ClassVar[dict[str, str]] = {"block": "hadamard_block"}

    residual: Method = key("hadamard")  # R1
    heads: Method = key("hadamard")  # R2
    ffn: Method = key("hadamard")  # R4 (online)
    qk: Method = key("none")  # R3 (online)
    seed: int = key(0, min=0)
    # a block-diagonal Hadamard of this size for a width with no Hadamard matrix
    hadamard_block: int | None = key(None, min=1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------- matrices


def _seed(seed: int, tag: str) -> int:
    """A seed for one matrix: the plan's seed and where it is used, so every matrix is its own draw."""
    digest = hashlib.sha256(f"{seed}:{tag}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def random_orthogonal(n: int, seed: int, tag: str) -> torch.Tensor:
    """A Haar-random orthogonal (n, n) float64 matrix: Q of the QR of a Gaussian, columns signed by diag(R)
    (Mezzadri 2007), from a generator seeded by (``seed``, ``tag``)."""
    gen = torch.Generator().manual_seed(_seed(seed, tag))
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r))[None, :]


def hadamard_orthogonal(n: int, block: int | None, where: str) -> tuple[torch.Tensor, str]:
    """H_n^T / sqrt(n) (float64) and how it was built; a block-diagonal Hadamard of ``block`` when size ``n``
    has none; a one-line error when neither exists."""
    how = _hadamard_how(n, block, where)  # raises unless one of the two forms exists
    if had.has_hadamard(n):
        return had.hadamard(n).T / math.sqrt(n), how
    h = had.hadamard(block).T / math.sqrt(block)
    return torch.block_diag(*[h] * (n // block)), how


def orthogonal(n: int, method: str, spec: RotateSpec, tag: str, where: str) -> tuple[torch.Tensor, str]:
    """The (n, n) float64 orthogonal matrix of ``method`` for the matrix named ``tag``, and its description."""
    if method == "random":
        return random_orthogonal(n, spec.seed, tag), f"random orthogonal (seed {spec.seed})"
    return hadamard_orthogonal(n, spec.hadamard_block, where)


# Below this size a dense matmul by the (float32) matrix beats the butterflies on CPU (analysis/rotate/bench.py:
# 576 dense 16 ms vs fast 26 ms, 1536 dense 107 ms vs fast 70 ms, for 1,024 rows).
FAST_MIN = 1024


class OnlineRotation(nn.Module):
    """x -> x Q along the last dimension (``Q`` float64 (n, n), kept as a non-persistent buffer: the plan
    rebuilds it, so state dicts stay the base model's). A Hadamard ``Q`` of a supported size runs as the
    fast transform (O(n log n) for its power-of-two part)."""

    def __init__(self, matrix: torch.Tensor, fast: bool, label: str) -> None:
        super().__init__()
        # the fast transform needs no matrix: keeping a dense float64 one per layer would cost n^2 * 8 bytes
        # (1.6 GB at FFN 14336) for nothing
        self.register_buffer("matrix", None if fast else matrix, persistent=False)
        self.fast = fast
        self.label = label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return had.fast_hadamard(x)
        return torch.matmul(x, self.matrix.to(x.dtype))

    def extra_repr(self) -> str:
        return self.label


class QKRotation(nn.Module):
    """q -> q R_h, k -> k R_h per head after RoPE. ``matrices`` (n_k_heads, d, d) float64, one per key head;
    ``q_index`` names the key head (hence matrix) each query head is dotted with."""

    def __init__(self, matrices: torch.Tensor, q_index: list[int], fast: bool, label: str) -> None:
        super().__init__()
        self.register_buffer("matrices", None if fast else matrices, persistent=False)
        self.register_buffer("q_index", torch.tensor(q_index, dtype=torch.long), persistent=False)
        self.fast = fast
        self.label = label

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fast:  # one Hadamard for every head
            return had.fast_hadamard(q), had.fast_hadamard(k)
        m = self.matrices.to(q.dtype)  # (Hk, d, d); q, k: (B, H, T, d)
        return torch.matmul(q, m[self.q_index][None]), torch.matmul(k, m[None])

    def extra_repr(self) -> str:
        return self.label


# ------------------------------------------------------------------------------------------- transform


def _mul_right(linear: nn.Linear, q: torch.Tensor) -> None:
    """A reader of the rotated space: W <- W Q (input side)."""
    w = linear.weight
    linear.weight.data = (w.data.double() @ q.to(w.device)).to(w.dtype)


def _mul_left(linear: nn.Linear, q: torch.Tensor) -> None:
    """A writer into the rotated space: W <- Q^T W, b <- Q^T b (output side)."""
    w = linear.weight
    qd = q.to(w.device)
    linear.weight.data = (qd.T @ w.data.double()).to(w.dtype)
    if linear.bias is not None:
        linear.bias.data = (qd.T @ linear.bias.data.double()).to(linear.bias.dtype)


def _fold_norm(norm: RMSNorm, readers: list[nn.Linear]) -> None:
    """RMSNorm(x) * w read by W  ==  RMSNorm(x) read by W diag(w): move the gain, leave the identity."""
    if norm.weight is None:
        return
    w = norm.gain()  # (1 + w) for Gemma's unit-offset norms: that is what multiplies the normed x
    for linear in readers:
        linear.weight.data = (linear.weight.data.double() * w.to(linear.weight.device)[None, :]).to(
            linear.weight.dtype
        )
    norm.reset_gain()


def _readers(block: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The Linears reading the attention norm's output (q / k / v and the kind's own: DIFF V2's lambda_proj,
    gated attention's gate_proj) and the MLP norm's output: the block's own ``norm_readers``."""
    (_, _, first), (_, _, second) = block.norm_readers()
    return list(first.values()), list(second.values())


def _heads_commute(attn: nn.Module) -> bool:
    """False when a per-head rotation of V / O (R2) does not commute with the attention: an element-wise
    output gate multiplies each channel of the head output by its own gate."""
    return getattr(attn, "gate_width", 1) == 1


def _check_model(model: nn.Module) -> None:
    if getattr(model, "quant", None) is not None:
        raise DiffquantError("rotate: the model is already quantized; rotate the unquantized model")
    if getattr(model, "rotation", None) is not None:
        raise DiffquantError("rotate: the model is already rotated")
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight_quantizer is not None:
            raise DiffquantError(f"rotate: {name} already has a weight quantizer; rotate before quantizing")


def _check_sizes(model: nn.Module, spec: RotateSpec) -> None:
    """A one-line error for a Hadamard place whose size has no Hadamard matrix (nor the asked block)."""
    attn = model.layers[0].attn
    sizes = {
        "residual": model.config.d_model,
        "heads": attn.value_dim,
        "ffn": model.layers[0].mlp.down.in_features,
        "qk": attn.head_dim,
    }
    if not _heads_commute(attn):
        del sizes["heads"]  # R2 is skipped for this model: its size needs no matrix
    for place, n in sizes.items():
        if getattr(spec, place) == "hadamard" and not had.has_hadamard(n):
            # raises unless the block form exists
            hadamard_orthogonal(n, spec.hadamard_block, f"rotate.{place}")


def rotate_model(model: nn.Module, spec: RotateSpec, weights: bool = True) -> list[tuple[str, str]]:
    """Rotate ``model`` in place per ``spec``; returns (place, what ran) per transform (which matrix, how
    built), for the quantize report and the checkpoint's record.

    ``weights=False`` attaches only the online parts (R3, R4) and marks the model rotated: for a checkpoint
    whose saved weights were rotated already (a quantized checkpoint's plan says so).

    One stage at a time (:class:`StageRotation`: the embedding, each decoder layer, the head), as a streamed
    run rotates each stage when it is read: every weight goes through the same operations either way."""
    report = prepare_rotation(model, spec, weights)
    stages = StageRotation(spec, weights)
    stages.embedding(model)
    for i in range(len(model.layers)):
        stages.layer(model, i)
    stages.head(model)
    return report


def _q_to_k(kind: str, n_q: int, n_k: int) -> list[int]:
    """The key head each query head is dotted with (see the attention classes' ``_components``)."""
    if kind == "diff_v1":  # query sub-heads 2i, 2i+1 of head i; key sub-heads 2j, 2j+1 of kv pair j
        n_heads, n_kv = n_q // 2, n_k // 2
        n_rep = n_heads // n_kv
        return [2 * ((qi // 2) // n_rep) + qi % 2 for qi in range(n_q)]
    if kind == "diff_v2":  # query heads 2i, 2i+1 read kv head i // n_rep
        n_rep = (n_q // 2) // n_k
        return [(qi // 2) // n_rep for qi in range(n_q)]
    n_rep = n_q // n_k
    return [qi // n_rep for qi in range(n_q)]


# ------------------------------------------------------------------------------------------ per stage
# rotate_model in pieces: what the whole model needs once (checks, untying, the report), then one stage
# (embedding, decoder layer, head) at a time, so a streamed run rotates each stage's weights as it reads them.


def _hadamard_how(n: int, block: int | None, where: str) -> str:
    """How :func:`hadamard_orthogonal` builds its size-``n`` matrix (a one-line error when it cannot)."""
    if had.has_hadamard(n):
        return f"hadamard {had.construction(n)}"
    if block is not None:
        if n % block or not had.has_hadamard(block):
            raise DiffquantError(
                f"{where}: size {n} has no Hadamard matrix, and block {block} "
                f"{'does not divide it' if n % block else 'has none either'}"
            )
        return f"block-diagonal hadamard {n // block} x {block}"
    raise DiffquantError(
        f"{where}: size {n} has no Hadamard matrix here (sizes K * 2^m with K from Paley's constructions); "
        "set rotate.hadamard_block (a size that divides it, e.g. 64) or use random"
    )


def describe(n: int, method: str, spec: RotateSpec, where: str) -> str:
    """What :func:`orthogonal` returns as its description, without building the matrix."""
    if method == "random":
        return f"random orthogonal (seed {spec.seed})"
    return _hadamard_how(n, spec.hadamard_block, where)


def prepare_rotation(model: nn.Module, spec: RotateSpec, weights: bool = True) -> list[tuple[str, str]]:
    """The whole-model part of :func:`rotate_model`, no weight read: the checks (every matrix exists before
    any weight changes), the tied LM head untied (a parameter of its own, ``config.tie_embeddings`` False:
    its folded norm weight differs from the embedding), the model marked rotated, and the report
    :func:`rotate_model` returns. Works on a meta-device skeleton; the stages then rotate with
    :class:`StageRotation`."""
    _check_model(model)
    _check_sizes(model, spec)
    config = model.config
    if weights and spec.residual != "none" and config.sandwich_norms:
        # x + post_norm(attn(...)): the post-norm's gain acts channel by channel on the residual stream, and
        # RMSNorm(y Q) * g != RMSNorm(y) * g Q for a non-constant g, so R1 cannot pass it.
        raise DiffquantError(
            f"rotate.residual = {spec.residual!r}: the model has sandwich_norms = true (post-norms on the "
            "attention / MLP outputs), which a residual rotation (R1) does not commute with; use residual: "
            "none (heads / ffn / qk rotations work)"
        )
    attn = model.layers[0].attn
    report: list[tuple[str, str]] = []
    if weights and spec.residual != "none":
        if config.tie_embeddings:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
            model.config = dataclasses.replace(config, tie_embeddings=False)
            report.append(("embeddings", "untied: the LM head gets the final norm's weight folded in"))
        d = config.d_model
        how = describe(d, spec.residual, spec, "rotate.residual")
        report.append(("residual (R1)", f"{how}, d {d}; norms folded into their readers"))
    if weights and spec.heads != "none":
        if _heads_commute(attn):
            how = describe(attn.value_dim, spec.heads, spec, "rotate.heads")
            report.append(("heads (R2)", f"{how}, per value head of {attn.value_dim}"))
        else:
            report.append(("heads (R2)", "skipped: an element-wise output gate does not commute with it"))
    if spec.ffn != "none":
        n = model.layers[0].mlp.down.in_features
        how = describe(n, spec.ffn, spec, "rotate.ffn")
        report.append(("ffn (R4, online before mlp.down)", f"{how}, size {n}"))
    if spec.qk != "none":
        how = describe(attn.head_dim, spec.qk, spec, "rotate.qk")
        report.append(("qk (R3, online after RoPE)", f"{how}, head {attn.head_dim}"))
    model.rotation = spec
    return report


class StageRotation:
    """One stage of :func:`rotate_model` at a time, on a model :func:`prepare_rotation` prepared: the
    embedding (E Q), decoder layer i (its two norms folded into their readers, readers W Q, writers Q^T W,
    R2 per value head, R4's weight and online module, R3's online module) and the head (the final norm
    folded, W Q). Each matrix is rebuilt from the spec (Hadamard, or random from the seed and its tag); R1's
    is built once and kept. ``weights=False``: only the online modules (R3, R4), for weights rotated
    already."""

    def __init__(self, spec: RotateSpec, weights: bool = True) -> None:
        self.spec = spec
        self.weights = weights
        self._residual: torch.Tensor | None = None

    @property
    def rotates_residual(self) -> bool:
        return self.weights and self.spec.residual != "none"

    def residual(self, d: int) -> torch.Tensor:
        """R1's (d, d) float64 matrix (CPU), built on first use."""
        if self._residual is None:
            self._residual = orthogonal(d, self.spec.residual, self.spec, "residual", "rotate.residual")[0]
        return self._residual

    def embedding(self, model: nn.Module) -> None:
        if self.rotates_residual:
            emb = model.embed.weight
            q = self.residual(model.config.d_model)
            emb.data = (emb.data.double() @ q.to(emb.device)).to(emb.dtype)

    def layer(self, model: nn.Module, i: int) -> None:
        block, spec = model.layers[i], self.spec
        if self.rotates_residual:
            first, second = _readers(block)
            _fold_norm(block.attn_norm, first)
            _fold_norm(block.mlp_norm, second)
            q = self.residual(model.config.d_model)
            for linear in first + second:
                _mul_right(linear, q)
            _mul_left(block.attn.o_proj, q)
            _mul_left(block.mlp.down, q)
        if self.weights and spec.heads != "none" and _heads_commute(block.attn):
            _rotate_heads_layer(i, block, spec)
        if spec.ffn != "none":
            _rotate_ffn_layer(i, block, spec, self.weights)
        if spec.qk != "none":
            _rotate_qk_layer(i, block, spec)

    def head(self, model: nn.Module) -> None:
        if self.rotates_residual:
            _fold_norm(model.norm, [model.lm_head])
            _mul_right(model.lm_head, self.residual(model.config.d_model))


def drop_online(module: nn.Module) -> None:
    """Remove the online rotations (R3, R4) under ``module``: a streamed run releases a stage's matrices
    with its weights and attaches them again when the stage is read next."""
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.input_rotation = None
        if hasattr(sub, "qk_rotation"):
            sub.qk_rotation = None


def _rotate_heads_layer(i: int, block: nn.Module, spec: RotateSpec) -> None:
    """R2 in layer ``i``: V's rows R^T W_v, O's input columns W_o R per value head (DIFF V1's head-norm weight
    folded into O first)."""
    attn = block.attn
    dv, n_kv, n_heads = attn.value_dim, attn.n_kv_heads, attn.n_heads
    n_rep = n_heads // n_kv
    if getattr(attn, "norm", None) is not None and attn.norm.weight is not None:
        # DIFF V1: RMSNorm(u) * w * c, read by O  ==  RMSNorm(u) * c read by O diag(w) per head
        w = attn.norm.weight.data.double().repeat(n_heads)
        o = attn.o_proj.weight
        o.data = (o.data.double() * w.to(o.device)[None, :]).to(o.dtype)
        attn.norm.weight.data.fill_(1.0)
    v = attn.v_proj.weight.data.double()
    vb = attn.v_proj.bias
    o = attn.o_proj.weight.data.double()
    for j in range(n_kv):
        r, _ = orthogonal(dv, spec.heads, spec, f"heads.{i}.{j}", "rotate.heads")
        r = r.to(v.device)
        rows = slice(j * dv, (j + 1) * dv)
        v[rows] = r.T @ v[rows]
        if vb is not None:
            vb.data[rows] = (r.T @ vb.data[rows].double()).to(vb.dtype)
        for h in range(j * n_rep, (j + 1) * n_rep):
            cols = slice(h * dv, (h + 1) * dv)
            o[:, cols] = o[:, cols] @ r
    attn.v_proj.weight.data = v.to(attn.v_proj.weight.dtype)
    attn.o_proj.weight.data = o.to(attn.o_proj.weight.dtype)


def _rotate_ffn_layer(i: int, block: nn.Module, spec: RotateSpec, weights: bool) -> None:
    """R4 in layer ``i``: W_down Q (with ``weights``) and the online x -> x Q before ``mlp.down``."""
    down = block.mlp.down
    n = down.in_features
    q, how = orthogonal(n, spec.ffn, spec, f"ffn.{i}", "rotate.ffn")
    if weights:
        _mul_right(down, q)
    fast = spec.ffn == "hadamard" and had.has_hadamard(n) and n >= FAST_MIN
    down.input_rotation = OnlineRotation(q.to(down.weight.device), fast, how)


def _rotate_qk_layer(i: int, block: nn.Module, spec: RotateSpec) -> None:
    """R3 in layer ``i``: the online rotation of Q and K after RoPE, one matrix per key head."""
    attn = block.attn
    d = attn.head_dim
    n_k = attn.k_proj.out_features // d
    mats = []
    how = ""
    for j in range(n_k if spec.qk == "random" else 1):
        r, how = orthogonal(d, spec.qk, spec, f"qk.{i}.{j}", "rotate.qk")
        mats.append(r)
    matrices = torch.stack(mats * (n_k if len(mats) == 1 else 1)).to(attn.q_proj.weight.device)
    n_q = attn.q_proj.out_features // d
    fast = spec.qk == "hadamard" and had.has_hadamard(d) and d >= FAST_MIN
    attn.qk_rotation = QKRotation(matrices, _q_to_k(attn.kind, n_q, n_k), fast, how)
