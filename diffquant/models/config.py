"""Model configuration: one dataclass for every attention kind, and the parameter-matched set of kinds.

Head counting follows what each kind computes, so that one field means one thing everywhere:

- ``n_heads``: attention *output* heads (baseline: heads; diff_v1: differential heads, each with two Q/K
  components; diff_v2: output heads, each a pair of query heads).
- ``n_kv_heads``: stored key/value heads (diff_v1: kv pairs, each two K components of width d and one V of 2d).
- ``head_dim``: the width d of one Q/K component.

RoPE: ``rope_theta`` is the base; ``rope_scaling`` (None = plain RoPE) rescales its frequencies for long
context, in the two forms the Llama family uses (see :data:`ROPE_SCALING_KEYS`).

Other decoder families, each one field whose default is the Llama behaviour (not for the DIFF kinds):
``attention_bias`` (Qwen2: biases on q/k/v, none on o), ``qk_norm`` (Qwen3: per-head RMSNorm on q and k before
RoPE), ``sliding_window`` (Mistral, windowed Qwen2/3: a query at i sees keys j with i - window < j <= i, in every
layer); Gemma 3's ``layer_types`` / ``rope_local_theta`` (which layers are windowed, and their RoPE base),
``norm_unit_offset`` ((1 + w) RMSNorms), ``sandwich_norms`` (post-attention / post-MLP norms),
``embed_scale`` and ``mlp_activation`` (GeGLU). The last four sit outside attention, so DIFF kinds take them
too; the attention-side ones are refused for DIFF (no DIFF model has them and the DIFF kernels cannot window).

Rival kinds, the single-softmax fixes of attention outliers the DIFF paper competes with (issue 30), each one
kind with its variant in a field only that kind reads (other kinds must leave it at its default, so a typo'd
kind is one line, not a silently ignored field):

- ``gated`` (Qiu et al. 2025): a sigmoid gate from the layer input on each head's SDPA output; ``gate`` =
  "elementwise" (one gate per output channel, the paper's best and Qwen3-Next's) or "headwise" (one per head).
- ``sink`` (Miller 2023, "Attention Is Off By One"; OpenAI's gpt-oss 2025): one extra logit per head in each
  softmax denominator; ``sink`` = "learned" (a trained logit per head, gpt-oss) or "zero" (softmax-off-by-one).
- ``clipped`` (Bondarenko et al. 2023, "Quantizable Transformers"): clip((zeta - gamma) softmax + gamma, 0, 1);
  ``clip_gamma`` / ``clip_zeta`` default to -0.025 / 1.

They are single-map kinds built like the baseline (same heads and projections), so the family fields
(``attention_bias``, ``qk_norm``, ``sliding_window``, Gemma's layer types) apply to them too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.schema import AssignStyle, check, key
from diffquant.textfiles import MAX_CONFIG_BYTES, parse_json, read_text_bounded


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind: ``name`` is the value of ``ModelConfig.attention`` (and of ``--kind``, ``init:KIND``,
    a zoo card's ``kind``); ``label`` is what figures and reports call it; ``differential``: two softmax maps
    subtracted (DIFF V1, DIFF V2) rather than one; ``hf_format``: a transformers architecture holds it (so
    ``diffquant export`` and Hugging Face module names exist for it: baseline -> llama and its families,
    DIFF V1 -> diffllama)."""

    name: str
    label: str
    differential: bool
    hf_format: bool


# The one table of attention kinds; ATTENTION_KINDS and the labels derive from it.
ATTENTION_KIND_TABLE: tuple[AttentionKind, ...] = (
    AttentionKind("baseline", "Transformer", differential=False, hf_format=True),
    AttentionKind("diff_v1", "DIFF V1", differential=True, hf_format=True),
    AttentionKind("diff_v2", "DIFF V2", differential=True, hf_format=False),
    # The rivals (issue 30). transformers has gpt-oss (sinks) and Qwen3-Next (gates), but inside MoE models
    # with other differences, so none has a Hugging Face format here.
    AttentionKind("gated", "Gated attention", differential=False, hf_format=False),
    AttentionKind("sink", "Softmax + sink", differential=False, hf_format=False),
    AttentionKind("clipped", "Clipped softmax", differential=False, hf_format=False),
)
ATTENTION_KINDS: tuple[str, ...] = tuple(k.name for k in ATTENTION_KIND_TABLE)
ATTENTION_LABELS: dict[str, str] = {k.name: k.label for k in ATTENTION_KIND_TABLE}
DIFF_KINDS: tuple[str, ...] = tuple(k.name for k in ATTENTION_KIND_TABLE if k.differential)
HF_KINDS: tuple[str, ...] = tuple(k.name for k in ATTENTION_KIND_TABLE if k.hf_format)

# The variants of the rival kinds: ModelConfig.gate (kind gated) and ModelConfig.sink (kind sink) values.
GATES: tuple[str, ...] = ("elementwise", "headwise")
SINKS: tuple[str, ...] = ("learned", "zero")
# Each variant field, the kind that reads it and its default; another kind must leave it at the default.
VARIANT_FIELDS: dict[str, tuple[str, Any]] = {
    "gate": ("gated", "elementwise"),
    "sink": ("sink", "learned"),
    "clip_gamma": ("clipped", -0.025),
    "clip_zeta": ("clipped", 1.0),
}

# ModelConfig.mlp_activation values; LAYER_TYPES: the entries of ModelConfig.layer_types.
MLP_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")

# rope_scaling["rope_type"] -> the numeric keys that type needs, all required, no others allowed. An exact key
# set (rather than "at least") because a key we do not know means a scheme we would silently compute wrong.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    # positions / factor (Chen et al. 2023, "position interpolation"; kaiokendev's SuperHOT)
    "linear": ("factor",),
    # Llama 3.1's piecewise frequency rescaling (see diffquant.models.attention.rope_inv_freq)
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class ModelConfig:
    # The attention *kind*: one of ATTENTION_KINDS (not a flag, not a table of metrics).
    attention: str = key("baseline", check=lambda v: _one_of(v, ATTENTION_KINDS))
    vocab_size: int = key(259, min=1)
    d_model: int = key(128, min=1)
    n_layers: int = key(4, min=1)
    n_heads: int = key(4, min=1)
    n_kv_heads: int = key(4, min=1)
    head_dim: int = key(32, min=1)
    ffn_dim: int = key(352, min=1)
    max_seq_len: int = key(512, min=1)
    rope_theta: float = key(10000.0, check=lambda v: _number(v, 1, None, "a number > 1"))
    # None = plain RoPE. Else {"rope_type": "linear", "factor": F} or {"rope_type": "llama3", "factor": F,
    # "low_freq_factor": L, "high_freq_factor": H, "original_max_position_embeddings": N}.
    rope_scaling: dict[str, Any] | None = key(None, check=lambda v: _scaling_problem(v))
    norm_eps: float = key(1e-5, check=lambda v: _number(v, 0, 1, "a number in (0, 1)"))
    tie_embeddings: bool = key(False)
    init_std: float = key(0.02, check=lambda v: _number(v, 0, None, "a number > 0"))
    # DIFF V1 only: learnable weight on the per-head RMSNorm (unilm has one; HF DiffLlama has none).
    v1_norm_affine: bool = key(True)
    # DIFF V1 only: eps of the per-head RMSNorm (unilm hard-codes 1e-5; HF DiffLlama uses rms_norm_eps).
    v1_norm_eps: float = key(1e-5, check=lambda v: _number(v, 0, 1, "a number in (0, 1)"))
    # DIFF V1 only: None = the paper's schedule 0.8 - 0.6 exp(-0.3 depth); a number = that constant.
    v1_lambda_init: float | None = key(None, check=lambda v: _lambda_init_problem(v))
    # Qwen2 (Yang et al. 2024): a bias on q_proj, k_proj and v_proj (o_proj has none). Input-side of the
    # residual stream, so rotation R1 and SmoothQuant's column scaling leave it alone; R2 rotates v's bias.
    attention_bias: bool = key(False)
    # Qwen3 (Yang et al. 2025): RMSNorm over each d-wide q and k head (weight (d,), eps norm_eps), applied to
    # the projections' output before RoPE, so before the q / k taps, which still see the rotated heads.
    qk_norm: bool = key(False)
    # Mistral (Jiang et al. 2023): None = full causal attention; W = a query at position i sees keys j with
    # i - W < j <= i (transformers' sliding_window_overlay), in every layer, prefill and cached decoding alike.
    sliding_window: int | None = key(None, check=lambda v: _window_problem(v))
    # Gemma 3 (Gemma Team 2025): None = every layer as ``sliding_window`` says; else one entry per layer,
    # "sliding_attention" (windowed by ``sliding_window``, RoPE base ``rope_local_theta``, plain RoPE) or
    # "full_attention" (causal, ``rope_theta`` with ``rope_scaling``), transformers' names for them.
    layer_types: list[str] | None = key(None, check=lambda v: _layer_types_problem(v))
    # Gemma 3's rope_local_base_freq: the RoPE base of "sliding_attention" layers (None = rope_theta).
    rope_local_theta: float | None = key(
        None, check=lambda v: None if v is None else _number(v, 1, None, "null or a number > 1")
    )
    # Gemma: every RMSNorm (block, final, q / k norms) scales by (1 + w), the weight stored as w (as in
    # transformers; llama.cpp's GGUF stores w + 1), computed in float32 and cast back as Gemma does.
    norm_unit_offset: bool = key(False)
    # Gemma 2 / 3: RMSNorms on the attention and MLP outputs before each residual add (post_attention_ /
    # post_feedforward_layernorm), beside the pre-norms attn_norm / mlp_norm (input_ / pre_feedforward_).
    sandwich_norms: bool = key(False)
    # Gemma: embeddings are multiplied by this (sqrt(d_model), rounded to the embedding's dtype); 1 = none.
    embed_scale: float = key(1.0, check=lambda v: _number(v, 0, None, "a number > 0"))
    # The gated MLP's activation: "silu" (SwiGLU, Llama) or "gelu_tanh" (GeGLU with the tanh approximation
    # of GELU, Gemma's gelu_pytorch_tanh).
    mlp_activation: str = key("silu", check=lambda v: _one_of(v, MLP_ACTIVATIONS))
    # Gated attention only (Qiu et al. 2025, G1): "elementwise" = one sigmoid gate per channel of each head's
    # output (gate_proj d_model -> n_heads * head_dim), "headwise" = one per head (d_model -> n_heads).
    gate: str = key("elementwise", check=lambda v: _one_of(v, GATES))
    # Sink attention only: "learned" = one trained logit per head in every softmax denominator (gpt-oss's
    # ``sinks``), "zero" = the constant logit 0 (softmax-off-by-one, Miller 2023); no parameter then.
    sink: str = key("learned", check=lambda v: _one_of(v, SINKS))
    # Clipped softmax only (Bondarenko et al. 2023): p = clip((zeta - gamma) softmax + gamma, 0, 1). gamma <= 0
    # lets a probability reach exact 0, zeta >= 1 exact 1; (0, 1) is the plain softmax.
    clip_gamma: float = key(-0.025, check=lambda v: _at_most(v, 0.0))
    clip_zeta: float = key(1.0, check=lambda v: _at_least(v, 1.0))

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Each field's type and range (the schema checker, :mod:`diffquant.schema`), then how they agree."""
        check(ModelConfig, dataclasses.asdict(self), "model config", style=_FIELDS)

        def need(ok: bool, field: str, expected: str) -> None:
            if not ok:
                raise DiffquantError(
                    f"model config: field '{field}' = {getattr(self, field)!r}, expected {expected}"
                )

        need(self.head_dim % 2 == 0, "head_dim", "an even integer (RoPE rotates pairs of channels)")
        need(
            self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            f"a divisor of n_heads={self.n_heads}",
        )
        for field, (reader, default) in VARIANT_FIELDS.items():
            need(
                self.attention == reader or getattr(self, field) == default,
                field,
                f"{json.dumps(default)} (the default) for attention {self.attention!r} "
                f"(only attention {reader!r} reads it)",
            )
        if self.attention in DIFF_KINDS:
            # DIFF models with these exist nowhere to compare against, and the DIFF kernels cannot do a window.
            for field, off in (
                ("attention_bias", False),
                ("qk_norm", False),
                ("sliding_window", None),
                ("layer_types", None),
                ("rope_local_theta", None),
            ):
                need(
                    getattr(self, field) == off,
                    field,
                    f"{json.dumps(off)} for attention {self.attention!r} (DIFF models do not support it)",
                )

        if self.layer_types is not None:
            need(
                len(self.layer_types) == self.n_layers,
                "layer_types",
                f"one entry per layer ({self.n_layers}), got {len(self.layer_types)}",
            )
            need(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "layer_types",
                "no 'sliding_attention' layer when sliding_window is null",
            )
        need(
            self.rope_local_theta is None or self.layer_types is not None,
            "rope_local_theta",
            "null unless layer_types says which layers are sliding",
        )

    def layer_window(self, depth: int) -> int | None:
        """The sliding window of layer ``depth`` (None: full causal attention)."""
        if self.layer_types is not None and self.layer_types[depth] == "full_attention":
            return None
        return self.sliding_window

    def layer_rope(self, depth: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, rope_scaling) of layer ``depth``: Gemma 3's sliding layers use plain RoPE with
        ``rope_local_theta``; every other layer uses ``rope_theta`` and ``rope_scaling``."""
        if self.layer_types is not None and self.layer_types[depth] == "sliding_attention":
            return (self.rope_local_theta or self.rope_theta), None
        return self.rope_theta, self.rope_scaling

    # ------------------------------------------------------------------------------ derived widths
    @property
    def n_q_heads(self) -> int:
        """Query heads of width d that the Q projection produces (two per head for DIFF)."""
        return 2 * self.n_heads if self.attention in DIFF_KINDS else self.n_heads

    @property
    def value_dim(self) -> int:
        """Width of one value head: 2d for DIFF V1 (one value head per differential pair), else d."""
        return 2 * self.head_dim if self.attention == "diff_v1" else self.head_dim

    @property
    def n_rep(self) -> int:
        """Output heads that share one kv head (GQA group size in output heads)."""
        return self.n_heads // self.n_kv_heads

    def lambda_init(self, depth: int) -> float:
        """DIFF V1 lambda_init at 0-based layer ``depth`` (paper: 0.8 - 0.6 exp(-0.3 (l - 1)), 1-based l)."""
        if self.v1_lambda_init is not None:
            return float(self.v1_lambda_init)
        return 0.8 - 0.6 * math.exp(-0.3 * depth)

    # ---------------------------------------------------------------------------------- round trip
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], source: str = "model config", complete: bool = False
    ) -> ModelConfig:
        """A validated config from a dict. ``complete=True`` (a saved checkpoint's config) also requires
        every field but those added after checkpoints first existed (:data:`OPTIONAL_FIELDS`): a field
        missing from a saved config would otherwise silently take a default the weights were not trained
        with."""
        if not isinstance(data, dict):
            raise DiffquantError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        check(cls, data, source, style=_FIELDS)  # unknown keys, types and ranges
        missing = sorted(known - set(data) - set(OPTIONAL_FIELDS)) if complete else []
        if missing:
            raise DiffquantError(f"{source}: missing key(s) {', '.join(missing)}")
        try:
            return cls(**data)
        except DiffquantError as err:
            raise DiffquantError(f"{source}: {str(err).removeprefix('model config: ')}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "model config") -> ModelConfig:
        return cls.from_dict(parse_json(text, source), source)  # invalid or too deeply nested: one line

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """A config from a JSON file (a regular file of at most 16 MiB: :func:`read_text_bounded`)."""
        path = Path(path)
        return cls.from_json(read_text_bounded(path, MAX_CONFIG_BYTES, "model config"), source=str(path))


# Fields a saved config may lack (added later; their default is the behaviour of older checkpoints).
OPTIONAL_FIELDS = {
    "rope_scaling": None,
    "v1_norm_eps": 1e-5,
    "attention_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "layer_types": None,
    "rope_local_theta": None,
    "norm_unit_offset": False,
    "sandwich_norms": False,
    "embed_scale": 1.0,
    "mlp_activation": "silu",
    **{field: default for field, (_, default) in VARIANT_FIELDS.items()},
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _one_of(value: Any, names: tuple[str, ...]) -> str | None:
    return None if isinstance(value, str) and value in names else f"one of {', '.join(names)}"


def _number(value: Any, low: float, high: float | None, expected: str) -> str | None:
    """None when ``value`` is a finite number in the open interval (low, high), else ``expected``."""
    ok = _is_number(value) and value > low and (high is None or value < high)
    return None if ok else expected


def _at_most(value: Any, high: float) -> str | None:
    return None if _is_number(value) and value <= high else f"a number <= {high:g}"


def _at_least(value: Any, low: float) -> str | None:
    return None if _is_number(value) and value >= low else f"a number >= {low:g}"


def _scaling_problem(value: Any) -> str | None:
    problem = rope_scaling_problem(value)
    return None if problem is None else f"null or a supported scaling ({problem})"


def _window_problem(value: Any) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    return None if ok else "null (full causal attention) or an integer >= 1"


def _layer_types_problem(value: Any) -> str | None:
    ok = value is None or (
        isinstance(value, list) and value and all(isinstance(v, str) and v in LAYER_TYPES for v in value)
    )
    return None if ok else f"null or a list with one of {', '.join(LAYER_TYPES)} per layer"


def _lambda_init_problem(value: Any) -> str | None:
    ok = value is None or (_is_number(value) and 0 <= value < 1)
    return None if ok else "null (depth schedule) or a number in [0, 1)"


_FIELDS = AssignStyle(field=True)


def rope_scaling_problem(scaling: Any) -> str | None:
    """What is wrong with a ``rope_scaling`` value, in a few words, or None when it is valid.

    Shared by :meth:`ModelConfig.validate` and the HF importer, so both refuse the same things with the same
    words. Bounds follow what the formulas need: factor >= 1 (transformers and Meta both state it; < 1 would
    compress rather than stretch the context), 0 < low_freq_factor < high_freq_factor (the llama3 blend
    divides by their difference), an integer original context.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        return f"got a {type(scaling).__name__}, not an object"
    rope_type = scaling.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in ROPE_SCALING_KEYS:
        return f"rope_type {rope_type!r} is not one of {', '.join(ROPE_SCALING_KEYS)}"
    want = ROPE_SCALING_KEYS[rope_type]
    missing = [k for k in want if k not in scaling]
    if missing:
        return f"{rope_type} needs key(s) {', '.join(missing)}"
    extra = sorted(set(scaling) - {"rope_type", *want})
    if extra:
        return f"{rope_type} takes only {', '.join(want)}, not {', '.join(extra)}"
    if not (_is_number(scaling["factor"]) and scaling["factor"] >= 1):
        return f"factor must be a number >= 1, got {scaling['factor']!r}"
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if not (_is_number(low) and _is_number(high) and 0 < low < high):
            return f"need 0 < low_freq_factor < high_freq_factor, got {low!r} and {high!r}"
        original = scaling["original_max_position_embeddings"]
        if not (isinstance(original, int) and not isinstance(original, bool) and original >= 1):
            return f"original_max_position_embeddings must be an integer >= 1, got {original!r}"
    return None


# ---------------------------------------------------------------------------------- matched trio
def matched_config(base: ModelConfig, kind: str, **variant: Any) -> ModelConfig:
    """The ``kind`` model that is parameter-matched to the baseline config ``base``; ``variant`` sets the
    kind's variant fields (``gate="headwise"`` for gated, ``sink="zero"`` for sink, ``clip_gamma`` /
    ``clip_zeta`` for clipped; :data:`VARIANT_FIELDS`), which the match depends on.

    diff_v1 (DIFF paper, Sec. 3): half the heads, each with two d-wide Q/K components and a 2d value head;
    under GQA the kv heads halve too. The projections then have exactly the baseline's shapes, so the only
    extra parameters are 4d (lambda vectors) + 2d (norm weight) per layer.
    diff_v2 (DIFF V2 post): 2h query heads of width d and a lambda projection add E*h*d + E*h per layer;
    the SwiGLU width shrinks by that amount / (3E), rounded, so the totals stay within 1 %.
    gated / sink / clipped keep the baseline's heads and projections. gated adds gate_proj (E*h*d per layer
    element-wise, E*h head-wise), sink h logits per layer (learned; none for zero), clipped nothing; the
    SwiGLU width absorbs the extra as for diff_v2, within 0.5 % (tests/test_rival_kinds.py checks every
    preset).
    """
    if base.attention != "baseline":
        raise DiffquantError(
            f"matched_config: base config must be a baseline, got attention={base.attention!r}"
        )
    wrong = sorted(f for f in variant if VARIANT_FIELDS.get(f, ("",))[0] != kind)
    if wrong:
        own = [f for f, (reader, _) in VARIANT_FIELDS.items() if reader == kind]
        raise DiffquantError(
            f"matched_config: attention {kind!r} takes variant field(s) {', '.join(own) or 'none'}, "
            f"not {', '.join(wrong)}"
        )
    if kind == "baseline":
        return dataclasses.replace(base)
    if kind == "diff_v1":
        if base.n_heads % 2 or base.n_kv_heads % 2:
            raise DiffquantError(
                f"matched_config: diff_v1 halves the heads, so n_heads ({base.n_heads}) and n_kv_heads "
                f"({base.n_kv_heads}) must be even"
            )
        return dataclasses.replace(
            base, attention="diff_v1", n_heads=base.n_heads // 2, n_kv_heads=base.n_kv_heads // 2
        )
    if kind == "diff_v2":
        extra = base.d_model * base.n_heads * base.head_dim + base.d_model * base.n_heads
        return dataclasses.replace(base, attention="diff_v2", ffn_dim=_absorbed_ffn(base, extra, 0.009, kind))
    if kind in _RIVAL_KINDS:
        config = dataclasses.replace(base, attention=kind, **variant)  # validates the variant's values
        ffn = _absorbed_ffn(base, _rival_extra(config), _RIVAL_TOLERANCE, kind)
        return dataclasses.replace(config, ffn_dim=ffn)
    raise DiffquantError(
        f"matched_config: unknown kind {kind!r}; expected one of {', '.join(ATTENTION_KINDS)}"
    )


_RIVAL_KINDS = ("gated", "sink", "clipped")
# How far a rival's FFN width may move off the exact match to land on a multiple of 32 / 16 / 8: the issue
# asks for 0.5 % of the baseline's parameters; 0.45 % leaves room for the rounding of the exact width.
_RIVAL_TOLERANCE = 0.0045


def _rival_extra(c: ModelConfig) -> int:
    """Parameters per layer a rival kind adds to the baseline's attention (see :func:`matched_config`)."""
    if c.attention == "gated":
        return c.d_model * c.n_heads * (c.head_dim if c.gate == "elementwise" else 1)
    if c.attention == "sink":
        return c.n_heads if c.sink == "learned" else 0
    return 0


def _absorbed_ffn(base: ModelConfig, extra: int, tolerance: float, kind: str) -> int:
    """The SwiGLU width that absorbs ``extra`` parameters per layer: exact = ffn - extra / (3E), moved to a
    multiple of 32 (then 16, 8) when that costs at most ``tolerance`` of the baseline's parameters, so
    32-element blocks (MX formats, int4 groups) divide it; else the exact width rounded."""
    exact = base.ffn_dim - extra / (3 * base.d_model)
    if exact < 1:
        raise DiffquantError(
            f"matched_config: ffn_dim={base.ffn_dim} is too small to absorb {kind}'s extra parameters"
        )
    total = _count_parameters(base)
    for multiple in (32, 16, 8):
        candidate = max(multiple, multiple * round(exact / multiple))
        if abs(3 * base.d_model * base.n_layers * (candidate - exact)) <= tolerance * total:
            return candidate
    return max(1, round(exact))


def _count_parameters(c: ModelConfig) -> int:
    """Parameters of a baseline config, from its shapes (embeddings, blocks, final norm, LM head)."""
    attn = c.d_model * c.n_heads * c.head_dim * 2 + 2 * c.d_model * c.n_kv_heads * c.head_dim
    block = attn + 3 * c.d_model * c.ffn_dim + 2 * c.d_model
    head = 0 if c.tie_embeddings else c.vocab_size * c.d_model
    return c.vocab_size * c.d_model + c.n_layers * block + c.d_model + head


def matched_configs(base: ModelConfig) -> dict[str, ModelConfig]:
    """One config per attention kind (each in its default variant), derived from one baseline config."""
    return {kind: matched_config(base, kind) for kind in ATTENTION_KINDS}


# Baseline presets, the one table of model sizes (its keys are the preset names of `--preset`, `init:KIND:PRESET`
# and training recipes); `diffquant init --kind K --preset P` derives kind K from preset P.
PRESETS: dict[str, ModelConfig] = {
    # For trying every command in seconds. Widths chosen so every derived matrix (DIFF V2's and the rivals'
    # FFNs too) divides into 32-element blocks, so MX / group presets apply to every kind.
    "tiny": ModelConfig(
        d_model=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=256, max_seq_len=256
    ),
    # The zoo: trains in minutes on 2 CPU cores; DIFF V2's derived FFN (352) still takes 32-blocks.
    "zoo": ModelConfig(
        d_model=96, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=384, max_seq_len=512
    ),
    # About the size of the CPU trial models (3.3M parameters with 259 byte-level tokens).
    "small": ModelConfig(
        d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, max_seq_len=512
    ),
}


def preset_config(preset: str, kind: str = "baseline", **variant: Any) -> ModelConfig:
    if preset not in PRESETS:
        raise DiffquantError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return matched_config(PRESETS[preset], kind, **variant)
