"""Export of a weight-quantized model into the formats serving tools load: compressed-tensors (vLLM,
transformers' compressed-tensors integration, llm-compressor's output) and the GPTQ checkpoint layout
(GPTQModel, AutoGPTQ, transformers' GPTQ integration). See docs/checkpoints.md.

What is exported is what a plan's ``weights:`` section computed: per Linear the codes ``q`` (0 .. 2^b - 1), a
float scale ``s`` and an integer zero point ``z`` per output row and group, the weight being ``(q - z) * s``
(:mod:`diffquant.quant.weightcodes`); everything else (embeddings, norms, the LM head, Linears the section
did not choose) is written dense, in the model's dtype, under the Hugging Face names of the model's family
(:func:`diffquant.models.hf_names.hf_key_map`, :func:`diffquant.io.convert_hf.hf_config`).

Conventions mapped exactly:

- compressed-tensors stores signed codes ``q - 2^(b-1)`` (packed as ``q``) and a signed zero point
  ``z - 2^(b-1)``; its weight is ``(q' - z') * s``, the same number. diffquant's symmetric grid has
  ``z = 2^(b-1)``, so its zero point is 0 and is not stored (``symmetric: true``).
- GPTQ's v1 layout (``checkpoint_format: gptq``, what every GPTQ loader reads) stores ``z - 1`` and its
  kernels add the 1 back; a zero point of 0 (a group with no negative weight, asymmetric) has no v1 code
  and is refused.
- A group size that does not divide a Linear's input width (SmolLM2's 576 at 128) leaves a partial last
  group in diffquant; neither format has one (compressed-tensors refuses the width, GPTQ kernels assume it
  divides), so the groups are written at ``gcd(group_size, every width)`` with each scale and zero point
  repeated over the sub-groups of its group: the same weights, a few more scales.

Refused, in one line each, before anything is written: a model without a plan, a plan with anything a
weight-only format cannot hold (rules, a backend, a KV-cache section, an online rotation), a kind with no
Hugging Face architecture (DIFF, the rival kinds), widths of 3, 5, 6 or 7 bits, HQQ's float zero points.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffquant.data.tokenizer import HFTokenizer
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import save_tensors, write_folder_atomic
from diffquant.io.convert_hf import hf_config, hf_model_type
from diffquant.io.export_pack import PACKABLE_BITS, pack_rows
from diffquant.io.quantized import base_state_dict
from diffquant.models.attention import Linear
from diffquant.models.hf_names import hf_key_map
from diffquant.models.transformer import DecoderLM
from diffquant.names import CONFIG_FILE, WEIGHTS_FILE
from diffquant.quant.weights import weight_modules

FORMATS = ("compressed-tensors", "gptq")
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# compressed-tensors: the scales diffquant computed with (its loaders cast them to the model's dtype);
# GPTQ: the format's own float16 (its kernels and loaders allocate float16 scales).
DEFAULT_SCALE_DTYPE = {"compressed-tensors": "float32", "gptq": "float16"}
GPTQ_CONFIG_FILE = "quantize_config.json"  # AutoGPTQ / GPTQModel read it beside config.json's entry
EXPORT_FILE = "diffquant_export.json"  # where the export came from: the plan, the grid as written


@dataclass
class ExportLinear:
    """One weight-quantized Linear under its Hugging Face module name: codes [out, in] (uint8), scale
    [out, groups] (float32) and zero [out, groups] (int64) at the written group size (its bias, if any, is
    written dense under ``NAME.bias`` with the other tensors)."""

    name: str
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass
class ExportResult:
    path: Path
    to: str
    bits: int
    sym: bool
    group_size: int | None  # as written (None: one scale per output channel)
    plan_group_size: int | None  # as the plan chose it
    linears: int
    scale_dtype: str


def export_quantized(
    model: DecoderLM,
    out_dir: str | Path,
    to: str,
    *,
    scale_dtype: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the weight-quantized ``model`` (a plan with a ``weights:`` section applied, e.g. loaded from a
    ``diffquant quantize`` folder) as a Hugging Face folder in format ``to`` (:data:`FORMATS`), atomically;
    ``scale_dtype`` (:data:`SCALE_DTYPES`, default :data:`DEFAULT_SCALE_DTYPE`) is the dtype of the scales in
    the file."""
    if to not in FORMATS:
        raise DiffquantError(f"export: format {to!r}; valid: {', '.join(FORMATS)}")
    dtype_name = scale_dtype or DEFAULT_SCALE_DTYPE[to]
    if dtype_name not in SCALE_DTYPES:
        raise DiffquantError(f"{to}: scale dtype {dtype_name!r}; valid: {', '.join(SCALE_DTYPES)}")
    plan = check_exportable(model, to)
    grid = plan.weights.grid
    linears, group = collect_linears(model, to)
    config = model.config
    state = base_state_dict(model)
    dtype = state["embed.weight"].dtype
    quantized = {f"{lin.name}.weight" for lin in linears}
    tensors: dict[str, torch.Tensor] = {}
    for native, hf_key in hf_key_map(config).items():
        if hf_key in quantized:
            continue
        tensors[hf_key] = state[native].detach().to("cpu").contiguous()
    hf = hf_config(config, dtype)
    if "lm_head.weight" in quantized and config.tie_embeddings:  # a quantized head is a tensor of its own
        hf["tie_word_embeddings"] = False
    scales = SCALE_DTYPES[dtype_name]
    if to == "compressed-tensors":
        tensors.update(compressed_tensors_tensors(linears, grid.bits, grid.sym, scales))
        all_linears = _hf_linear_names(model)
        hf["quantization_config"] = compressed_tensors_config(
            grid.bits, grid.sym, group, all_linears, quantized
        )
        extra_files: dict[str, Any] = {}
    else:
        tensors.update(gptq_tensors(linears, grid.bits, group, scales))
        hf["quantization_config"] = gptq_config(grid.bits, grid.sym, group, plan.weights)
        extra_files = {GPTQ_CONFIG_FILE: hf["quantization_config"]}
    tokenizer = getattr(model, "tokenizer", None)
    if isinstance(tokenizer, HFTokenizer):  # the folder is only usable with the ids the model reads
        hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    extra_files[EXPORT_FILE] = {
        "format": to,
        "plan": plan.to_dict(),
        "weights": plan.weights.label(),
        "group_size_written": group,
        "scale_dtype": dtype_name,
    }

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        save_tensors(tensors, tmp / WEIGHTS_FILE)
        for name, doc in extra_files.items():
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n")
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save(tmp)

    path = write_folder_atomic(out_dir, write, overwrite)
    return ExportResult(path, to, grid.bits, grid.sym, group, grid.group_size, len(linears), dtype_name)


# ============================================================================================ checks
def check_exportable(model: DecoderLM, to: str) -> Any:
    """The model's plan when ``to`` can hold it; else a one-line DiffquantError naming what it cannot hold
    and what to do instead."""
    plan = getattr(model, "quant_plan", None)
    if plan is None:
        raise DiffquantError(
            f"{to}: the model is not quantized (no plan); quantize it first with a weights plan (diffquant "
            "quantize MODEL --plan w4a16-rtn-g128 --out Q) and export Q, or write it unquantized with --to hf"
        )
    kind = model.config.attention
    if kind != "baseline":
        raise DiffquantError(
            f"{to}: attention {kind!r} has no Hugging Face architecture that vLLM or transformers load with "
            "quantized weights (only baseline models export: Llama / Qwen / Mistral / Gemma); keep the "
            "quantized checkpoint diffquant wrote (diffquant eval / load_model read it)"
        )
    hf_model_type(model.config)  # a baseline no HF family holds is refused here, before anything is written
    name = f"plan {plan.name!r}"
    if plan.backend is not None:
        raise DiffquantError(
            f"{to}: {name} uses the {plan.backend.name} backend, whose layers hold their own weights; export "
            "reads the codes of a plan's weights: section (rtn / gptq / awq)"
        )
    if plan.weights is None:
        raise DiffquantError(
            f"{to}: {name} has no weights: section, so no integer codes to pack; quantize with a weights plan "
            "(e.g. w4a16-rtn-g128, w4a16-gptq-g128, w4a16-awq-g128)"
        )
    if plan.rules:
        rule = plan.rules[0].to_dict()
        what = ", ".join([*rule.get("sites", []), *rule.get("modules", rule.get("weights", []))][:2])
        raise DiffquantError(
            f"{to}: {name} has {len(plan.rules)} fake-quant rule(s) (rules[0]: {rule['scheme']} on {what}), "
            "which a weight-only format cannot hold (activations are quantized by the server, if at all); "
            "quantize with the weights: section alone"
        )
    if plan.kv_cache is not None:
        raise DiffquantError(
            f"{to}: {name} quantizes the KV cache, a setting of the server (vLLM's --kv-cache-dtype), not of "
            "the weights; quantize without the kv_cache: section"
        )
    rotate = plan.rotate
    if rotate is not None:
        online = [(p, m) for p, m in (("ffn", rotate.ffn), ("qk", rotate.qk)) if m != "none"]
        if online:
            where = {"ffn": "before mlp.down", "qk": "of Q and K after RoPE"}
            place, method = online[0]
            raise DiffquantError(
                f"{to}: rotate.{place} = {method} is an online rotation ({where[place]}) that a Hugging Face "
                f"{hf_model_type(model.config)} model does not compute; rotate: {{ffn: none, qk: none}} keeps "
                "the rotations folded into the weights (residual, heads), which export"
            )
    bits = plan.weights.grid.bits
    if bits not in PACKABLE_BITS:
        raise DiffquantError(
            f"{to}: int{bits} weights; export packs 2, 4 or 8 bits (widths that do not divide 32 are packed "
            "differently by each tool's versions, and vLLM's kernels take 4 and 8)"
        )
    return plan


def collect_linears(model: DecoderLM, to: str) -> tuple[list[ExportLinear], int | None]:
    """The weight-quantized Linears (HF names, codes regrouped at the written group size) and that size."""
    coded = weight_modules(model)
    key_map = hf_key_map(model.config)
    key_map.setdefault("lm_head.weight", "lm_head.weight")  # tied: HF's lm_head is still a module
    found = []
    for owner, q in coded.items():
        native = owner.removesuffix(".weight_quantizer")
        if not q.filled:
            raise DiffquantError(
                f"{to}: {native}: its {q.method} codes were never computed (run calibration)"
            )
        zero = q.zero
        if not torch.equal(zero, torch.round(zero)):
            frac = zero[zero != torch.round(zero)].flatten()[0].item()
            raise DiffquantError(
                f"{to}: {native}: zero points that are not integers (e.g. {frac:.4g}: {q.method}'s zero point "
                "is a float), which the format's integer zero points cannot hold; export rtn / gptq / awq "
                "codes, or keep this model in diffquant's quantized checkpoint"
            )
        if to == "gptq" and not q.grid.sym and bool((zero == 0).any()):
            raise DiffquantError(
                f"{to}: {native}: a group with zero point 0 (no negative weight), which GPTQ's v1 layout "
                "(zero - 1 stored) cannot hold; use --to compressed-tensors"
            )
        found.append((key_map[f"{native}.weight"].removesuffix(".weight"), q))
    if not found:
        raise DiffquantError(f"{to}: the plan's weights: section quantized no Linear")
    grid = found[0][1].grid
    widths = sorted({q.shape[1] for _, q in found})
    group = grid.group_size
    if group is not None and any(w % group for w in widths):
        group = math.gcd(group, *widths)
    if to == "gptq":
        _check_gptq_shapes(model, found, grid.bits)
    out = []
    for name, q in found:
        codes = q.codes.to("cpu")
        scale, zero = q.scale.to("cpu"), q.zero.to("cpu")
        if group is not None and group != q.grid.size(q.shape[1]):
            scale, zero = regroup(scale, zero, q.grid.size(q.shape[1]), group, q.shape[1])
        out.append(ExportLinear(name, codes, scale.float(), zero.to(torch.int64)))
    return out, group


def regroup(
    scale: torch.Tensor, zero: torch.Tensor, group: int, finer: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of groups of ``group`` columns written over groups of ``finer`` columns (a divisor of
    ``group`` and of ``width``): each repeated ``group / finer`` times, the partial last group's as often as
    it has sub-groups."""
    repeat, groups = group // finer, width // finer
    return scale.repeat_interleave(repeat, dim=1)[:, :groups], zero.repeat_interleave(repeat, dim=1)[
        :, :groups
    ]


def _hf_linear_names(model: DecoderLM) -> list[str]:
    key_map = hf_key_map(model.config)
    key_map.setdefault("lm_head.weight", "lm_head.weight")
    return [
        key_map[f"{n}.weight"].removesuffix(".weight")
        for n, m in model.named_modules()
        if isinstance(m, Linear) and f"{n}.weight" in key_map
    ]


def _check_gptq_shapes(model: DecoderLM, found: list, bits: int) -> None:
    """GPTQ's layout: every Linear of every decoder layer quantized, none outside them (its config has no
    per-module list that every loader reads), and widths that fill whole int32 words."""
    per_word = 32 // bits
    names = {name for name, _ in found}
    layers = {n for n in _hf_linear_names(model) if n.startswith("model.layers.")}
    if names != layers:
        odd = sorted(names ^ layers)[0]
        where = "is quantized" if odd in names else "is not quantized"
        raise DiffquantError(
            f"gptq: {odd} {where}; the GPTQ layout quantizes every Linear of every decoder layer and nothing "
            "else (its config lists no exceptions every loader reads): use --to compressed-tensors (its "
            "ignore list)"
        )
    for name, q in found:
        out, n = q.shape
        if n % per_word or out % per_word:
            raise DiffquantError(
                f"gptq: {name} is {out} x {n}; GPTQ packs {per_word} int{bits} codes per int32 word along "
                f"both widths, so each must be a multiple of {per_word}: use --to compressed-tensors"
            )


# ============================================================================== compressed-tensors
def compressed_tensors_tensors(
    linears: list[ExportLinear], bits: int, sym: bool, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``weight_packed`` (the codes q, i.e. compressed-tensors' signed q - 2^(b-1) plus its offset, packed
    along the input dimension), ``weight_scale`` [out, groups], ``weight_shape`` and, asymmetric,
    ``weight_zero_point`` (z - 2^(b-1) plus the offset, i.e. z, packed along the output dimension)."""
    out: dict[str, torch.Tensor] = {}
    for lin in linears:
        rows, cols = lin.codes.shape
        out[f"{lin.name}.weight_packed"] = pack_rows(lin.codes, bits)
        out[f"{lin.name}.weight_scale"] = lin.scale.to(scale_dtype).contiguous()
        out[f"{lin.name}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        if not sym:
            out[f"{lin.name}.weight_zero_point"] = pack_rows(lin.zero.T, bits).T.contiguous()
    return out


def compressed_tensors_config(
    bits: int, sym: bool, group: int | None, all_linears: list[str], quantized: set[str]
) -> dict[str, Any]:
    """config.json's ``quantization_config``: one config group over every Linear (``targets: [Linear]``), the
    Linears left dense in ``ignore`` (the LM head, modules the plan excluded)."""
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "channel" if group is None else "group",
        "group_size": group,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    ignore = [n for n in all_linears if f"{n}.weight" not in quantized]
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


# ============================================================================================= GPTQ
def gptq_tensors(
    linears: list[ExportLinear], bits: int, group: int | None, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """GPTQ's v1 layout per Linear: ``qweight`` [in * b / 32, out] (codes packed along the input
    dimension), ``qzeros`` [groups, out * b / 32] (z - 1 packed along the output dimension), ``scales``
    [groups, out] and ``g_idx`` [in] (the group of each input channel: i // group_size, static groups)."""
    mask = (1 << bits) - 1
    out: dict[str, torch.Tensor] = {}
    for lin in linears:
        cols = lin.codes.shape[1]
        size = cols if group is None else group
        out[f"{lin.name}.qweight"] = pack_rows(lin.codes, bits).T.contiguous()
        out[f"{lin.name}.qzeros"] = pack_rows((lin.zero - 1).T & mask, bits)
        out[f"{lin.name}.scales"] = lin.scale.T.to(scale_dtype).contiguous()
        out[f"{lin.name}.g_idx"] = (torch.arange(cols) // size).to(torch.int32)
    return out


def gptq_config(bits: int, sym: bool, group: int | None, spec: Any) -> dict[str, Any]:
    """The ``quantization_config`` (and quantize_config.json) of a GPTQ v1 checkpoint. ``desc_act`` is false
    even after GPTQ's act-order: diffquant keeps static groups (column i in group i // group_size), so the
    codes are stored in the original column order with a plain g_idx."""
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": -1 if group is None else group,
        "desc_act": False,
        "static_groups": False,
        "sym": sym,
        "true_sequential": True,
        "damp_percent": float(getattr(spec, "damp", 0.01)),
        "lm_head": False,
        "checkpoint_format": "gptq",
        "meta": {"quantizer": ["diffquant"], "method": spec.method},
    }


def folder_bytes(path: str | Path) -> int:
    """The bytes of the files in a folder (its size on a disk that does not round up to blocks)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
