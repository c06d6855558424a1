"""DecoderLM: the one decoder-only language model every diffquant stage runs (nanoGPT-sized, Llama-shaped).

Pre-norm blocks (RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU -> residual), final RMSNorm, LM head,
rotate-half RoPE, GQA, a KV cache and greedy generation. The attention kind is the only difference
between baseline, DIFF V1, DIFF V2 and the rival kinds' models (gated, sink, clipped). Gemma's config fields change pieces, not the shape: (1 + w)
norms, post-norms on both branches (sandwich), a scaled embedding and the tanh-GELU gate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.kernels.dispatch import KERNEL_MODES
from diffquant.models.attention import (
    ATTENTION_CLASSES,
    ATTN_PATHS,
    Attention,
    DiffV1Attention,
    LayerKV,
    Linear,
    RMSNorm,
    SinkAttention,
)
from diffquant.models.config import ModelConfig
from diffquant.models.taps import Tap, model_taps, select_taps


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act = silu (SwiGLU, Shazeer 2020) or the tanh GELU
    (GeGLU, Gemma's gelu_pytorch_tanh) per ``config.mlp_activation``; ``act`` taps the down input. With
    ``sandwich_norms`` the output, which the block's post-norm reads, is tapped too (``out``, kind mlp_out)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.d_model, config.ffn_dim)
        self.up = Linear(config.d_model, config.ffn_dim)
        self.down = Linear(config.ffn_dim, config.d_model)
        self.act = Tap("mlp_act")
        self.activation = config.mlp_activation
        self.out = Tap("mlp_out") if config.sandwich_norms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = F.gelu(g, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(g)
        y = self.down(self.act(g * self.up(x)))
        return y if self.out is None else self.out(y)


class Block(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)). With ``sandwich_norms`` (Gemma 2 / 3)
    each output is normalised again before its residual add (``attn_post_norm``, ``mlp_post_norm``); their
    inputs are the ``attn.out`` and ``mlp.out`` taps."""

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__()
        offset = config.norm_unit_offset
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, unit_offset=offset)
        self.attn = ATTENTION_CLASSES[config.attention](config, depth)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, unit_offset=offset)
        self.mlp = MLP(config)
        self.attn_post_norm: RMSNorm | None = None
        self.mlp_post_norm: RMSNorm | None = None
        if config.sandwich_norms:
            self.attn_post_norm = RMSNorm(config.d_model, config.norm_eps, unit_offset=offset)
            self.mlp_post_norm = RMSNorm(config.d_model, config.norm_eps, unit_offset=offset)
        self.resid = Tap("resid")  # the layer output: "hidden states" in the DIFF paper's Table 5

    def norm_readers(self) -> list[tuple[str, RMSNorm, dict[str, Linear]]]:
        """(norm attribute, norm, {Linear path in the block: module}) per norm whose output only Linears read:
        the attention norm -> the attention's input Linears (q / k / v and each kind's own readers of the same
        x, ``Attention.input_readers``: DIFF V2's lambda_proj, gated attention's gate_proj), the MLP norm ->
        gate / up. Defined here once and read by every transform that moves a per-channel factor through a
        norm (SmoothQuant and AWQ fold scales into it, QuaRot folds its gain into the readers): a new
        attention kind names its readers in ``input_readers`` and all three follow."""
        attn = {f"attn.{n}": m for n, m in self.attn.input_linears().items()}
        return [
            ("attn_norm", self.attn_norm, attn),
            ("mlp_norm", self.mlp_norm, {"mlp.gate": self.mlp.gate, "mlp.up": self.mlp.up}),
        ]

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), cache)
        x = x + (a if self.attn_post_norm is None else self.attn_post_norm(a))
        m = self.mlp(self.mlp_norm(x))
        x = x + (m if self.mlp_post_norm is None else self.mlp_post_norm(m))
        return self.resid(x)


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding times ``scale`` (Gemma's sqrt(d_model)), the scale rounded to the weight's dtype through
    float32 as transformers' Gemma3TextScaledWordEmbedding does (a float32 buffer cast to the weight's dtype);
    scale 1 is the plain embedding, bit for bit. The state dict is the plain embedding's (``weight``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        if self.scale == 1.0:
            return out
        # a 0-dim host tensor: CUDA takes it as a kernel argument (a device tensor built here per call would be
        # a blocking host-to-device copy, a wait for the GPU in every forward)
        return out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.scale == 1.0 else f", scale={self.scale}")


class KVCache:
    """Per-layer keys and values of the tokens decoded so far. ``layer``: a factory depth -> layer cache (a
    plan's quantized cache, diffquant/quant/kv_cache.py); None: full-precision :class:`LayerKV`."""

    def __init__(self, n_layers: int, layer: Callable[[int], LayerKV] | None = None) -> None:
        self.layers = [LayerKV() if layer is None else layer(i) for i in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed = ScaledEmbedding(config.vocab_size, config.d_model, config.embed_scale)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps, unit_offset=config.norm_unit_offset)
        self.lm_head = Linear(config.d_model, config.vocab_size)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # The quantization state a plan leaves (diffquant.quant.state.QuantState: the plan, what each of its
        # sections recorded, the quantized cache); None: unquantized. One declared attribute, not several.
        self.quant = None
        # A rotation folded into the float weights (a RotateSpec; diffquant.quant.rotate): a property of the
        # weights, set with or without a plan, so a model is never rotated twice.
        self.rotation = None
        self.streamed: str | None = None  # a streamed run's specifier (diffquant.stream.api)
        self.reset_parameters()

    @property
    def quant_plan(self):  # noqa: ANN201 (a QuantPlan; the type lives above this layer)
        """The plan applied to this model (``quant.plan``), None when unquantized."""
        return None if self.quant is None else self.quant.plan

    def norm_readers(self, head: bool = False) -> list[tuple[str, RMSNorm, dict[str, Linear]]]:
        """Every block's :meth:`Block.norm_readers` under model names (``layers.3.attn_norm``,
        ``{"layers.3.attn.q_proj": ...}``), in layer order; ``head``: the final norm -> the LM head too."""
        out = []
        for i, block in enumerate(self.layers):
            for norm_name, norm, readers in block.norm_readers():
                out.append(
                    (f"layers.{i}.{norm_name}", norm, {f"layers.{i}.{n}": m for n, m in readers.items()})
                )
        if head:
            out.append(("norm", self.norm, {"lm_head": self.lm_head}))
        return out

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, init_std) for embeddings and projections, the identity gain for norms (ones;
        zeros for (1 + w) norms).

        DIFF V1's lambda vectors get N(0, 0.1) and DIFF V2's lambda_proj keeps PyTorch's default init, as in
        the reference code. Learned sinks start at 0 (softmax-off-by-one); gated attention's gate_proj is a
        projection like q/k/v (gates start near sigmoid(0) = 0.5).
        """
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding) or (
                isinstance(module, nn.Linear) and "lambda_proj" not in name
            ):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:  # Qwen2's q/k/v biases start at zero
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_gain()
            elif isinstance(module, DiffV1Attention):
                module.reset_lambda()
            elif isinstance(module, SinkAttention):
                module.reset_sinks()

    # ---------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T); with ``cache``, continues from the cached tokens."""
        return self.lm_head(self.hidden_states(input_ids, cache))

    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The final norm's output (B, T, d_model), what the LM head reads: ``forward`` is
        ``lm_head(hidden_states(...))``, so a scorer can apply the head a slice of positions at a time and a
        262k vocabulary's logits are never all held (:func:`diffquant.eval.perplexity.target_logprobs`)."""
        if input_ids.dim() != 2:
            raise DiffquantError(f"input_ids: expected shape (batch, seq), got {tuple(input_ids.shape)}")
        start = cache.length if cache is not None else 0
        if start + input_ids.shape[1] > self.config.max_seq_len:
            raise DiffquantError(
                f"sequence length {start + input_ids.shape[1]} exceeds the model's max_seq_len "
                f"{self.config.max_seq_len}"
            )
        x = self.embed(input_ids)
        for i, block in enumerate(self.layers):
            x = block(x, cache.layers[i] if cache is not None else None)
        return self.norm(x)

    def new_cache(self) -> KVCache:
        """An empty cache for decoding; quantized when a plan's ``kv_cache`` section left a cache-layer factory
        in the quantization state."""
        return KVCache(self.config.n_layers, None if self.quant is None else self.quant.kv_cache)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None = None
    ) -> torch.Tensor:
        """Greedy decoding with the KV cache; returns the prompt followed by the new tokens."""
        cache = self.new_cache()
        logits = self(input_ids, cache)
        out = [input_ids]
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
            if cache.length >= self.config.max_seq_len:
                break
            logits = self(nxt, cache)
        return torch.cat(out, dim=1)

    # ------------------------------------------------------------------------------ taps, paths
    def sites(self) -> dict[str, str]:
        """Every probe point: site name -> kind."""
        return {name: tap.kind for name, tap in model_taps(self).items()}

    def taps(self, patterns: str | list[str] = "*") -> dict[str, Tap]:
        return select_taps(self, patterns)

    def attention_modules(self) -> list[Attention]:
        return [block.attn for block in self.layers]

    def set_attention_path(self, path: str = "auto", chunk_size: int | None = None) -> None:
        """Force the fused (SDPA) or explicit (materialised maps) path, or let taps decide ("auto")."""
        if path not in ATTN_PATHS:
            raise DiffquantError(f"attention path {path!r}: expected one of {', '.join(ATTN_PATHS)}")
        if chunk_size is not None and chunk_size < 1:
            raise DiffquantError(f"chunk_size: expected an integer >= 1, got {chunk_size}")
        if path == "fused" and not all(attn.fused for attn in self.attention_modules()):
            raise DiffquantError(
                f"attention path 'fused': attention {self.config.attention!r} has no fused (SDPA) form (its "
                "softmax is clipped); use auto or explicit"
            )
        for attn in self.attention_modules():
            attn.path = path
            attn.chunk_size = chunk_size

    def set_kernel(self, mode: str = "auto") -> None:
        """'auto': the fused Triton kernel on CUDA where the quantization plan fits it; 'triton': also on
        CPU (through Triton's interpreter when TRITON_INTERPRET=1, for testing); 'off': torch paths only."""
        if mode not in KERNEL_MODES:
            raise DiffquantError(f"kernel mode {mode!r}: expected one of {', '.join(KERNEL_MODES)}")
        for attn in self.attention_modules():
            attn.kernel = mode

    # ---------------------------------------------------------------------------------- counting
    def parameter_groups(self) -> dict[str, int]:
        """Parameter counts by group: embeddings, attention, lambda, MLP, norms, LM head (untied only)."""
        groups: Counter[str] = Counter()
        seen: set[int] = set()
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            groups[_param_group(name)] += p.numel()
        order = ("embeddings", "attention", "lambda", "mlp", "norms", "lm_head")
        return {g: groups.get(g, 0) for g in order}

    def num_parameters(self) -> int:
        return sum(self.parameter_groups().values())


def _param_group(name: str) -> str:
    if name.startswith("embed."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".lambda" in name:
        return "lambda"
    if "norm" in name.split(".")[-2]:
        return "norms"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    raise AssertionError(f"unclassified parameter {name}")
