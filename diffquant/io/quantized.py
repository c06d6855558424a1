"""Quantized checkpoints: the base checkpoint plus the plan and the calibrated quantization state.

A quantized folder holds ``config.json`` and ``model.safetensors`` (the unquantized base weights, so any
plan can be re-applied or compared against), ``quant_plan.json`` (the plan) and
``quant_state.safetensors`` (static scales and backend calibration state). Loading rebuilds the model
by applying the plan to the base weights: fake-quant and both backends quantize weights
deterministically, so the reloaded model gives identical logits. The folder is therefore not smaller
than the base checkpoint; it records a quantized model exactly rather than packing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json, save_tensors
from diffquant.io.checkpoint import load_checkpoint, save_checkpoint
from diffquant.models.transformer import DecoderLM
from diffquant.names import CONFIG_FILE, PLAN_FILE, STATE_FILE, WEIGHTS_FILE
from diffquant.quant.backends.quanto import load_quanto_state, quanto_state
from diffquant.quant.modules import BackendLinear, fake_quantizers
from diffquant.quant.pipeline import apply_plan, transforms
from diffquant.quant.plan import QuantPlan, upgrade_plan
from diffquant.quant.weightcodes import GroupCodes
from diffquant.quant.weights import weight_modules

PLAN_FORMAT = "diffquant-quantized"
CODE_BUFFERS = ("codes", "scale", "zero")


def is_quantized(path: str | Path) -> bool:
    return (Path(path) / PLAN_FILE).is_file()


def base_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The unquantized weights of a (possibly quantized) model, under the base model's keys."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".quantizer." in name or ".weight_quantizer." in name or ".inner." in name:
            continue
        state[name] = tensor
    for name, module in model.named_modules():
        if isinstance(module, BackendLinear):
            state[f"{name}.weight"] = module.source_weight
            if module.source_bias is not None:
                state[f"{name}.bias"] = module.source_bias
    return state


def quant_state(model: DecoderLM) -> dict[str, torch.Tensor]:
    """Static scales of the fake-quantizers, the codes, scales and zero points of the weights section
    (``layers.0.attn.q.weight_quantizer.codes``: uint8) and calibration state of backend layers."""
    state = {}
    for name, q in fake_quantizers(model).items():
        for buf in ("scale", "zero_point"):
            value = getattr(q, buf)
            if value is not None:
                state[f"{name}.{buf}"] = value.detach().contiguous()
    for name, q in weight_modules(model).items():
        if q.filled:
            for buf in CODE_BUFFERS:
                state[f"{name}.{buf}"] = getattr(q, buf).detach().contiguous()
    for name, module in model.named_modules():
        if isinstance(module, BackendLinear) and module.backend == "quanto":
            for key, value in quanto_state(module.inner).items():
                state[f"{name}.inner.{key}"] = value.detach().contiguous()
    return state


def save_quantized(
    model: DecoderLM,
    path: str | Path,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
    documents: dict[str, Any] | None = None,
) -> Path:
    """Write a quantized checkpoint; ``documents`` (file name -> JSON data, e.g. the error report) are
    written into the folder before it is renamed into place, so a folder either has all of them or does
    not exist."""
    if model.quant is None:
        raise DiffquantError("model has no quantization plan; use save_checkpoint for unquantized models")
    base_state = base_state_dict(model)

    def extra(folder: Path) -> None:
        write_quant_files(folder, model, meta or {}, documents)

    return save_checkpoint(model, path, overwrite=overwrite, state=base_state, extra=extra)


def write_quant_files(
    folder: Path, model: DecoderLM, meta: dict[str, Any], documents: dict[str, Any] | None = None
) -> None:
    """What a quantized checkpoint holds beside config and weights: plan.json (the model's plan and
    ``meta``), the quantizers' state (scales) and ``documents`` (file name -> JSON data). Written by
    :func:`save_quantized` and by the streamed quantize once its last stage has run."""
    doc = {"format": PLAN_FORMAT, "plan": model.quant.plan.to_dict(), "transforms": transforms(model)}
    doc["meta"] = meta
    (folder / PLAN_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    save_tensors(quant_state(model), folder / STATE_FILE)
    for name, data in (documents or {}).items():
        (folder / name).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def read_plan(path: str | Path) -> tuple[Any, dict[str, Any]]:
    plan_path = Path(path) / PLAN_FILE
    doc = read_json(plan_path, "quantization plan")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or "plan" not in doc:
        raise DiffquantError(
            f"{plan_path}: not a diffquant quantization plan (expected 'format': '{PLAN_FORMAT}')"
        )
    # a checkpoint diffquant wrote before the plan keys were renamed reads in today's spelling
    return QuantPlan.from_dict(upgrade_plan(doc["plan"]), source=str(plan_path)), doc.get("meta", {})


def load_quantized(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    folder = Path(path)
    plan, _ = read_plan(folder)
    # the transforms the saved weights carry (rotation, smoothing, AWQ's folded scales, codes): each section
    # reads what it must not redo (diffquant.quant.pipeline)
    saved = read_json(folder / PLAN_FILE, "quantization plan").get("transforms", [])
    if not isinstance(saved, list) or not all(isinstance(t, str) for t in saved):
        raise DiffquantError(f"{folder / PLAN_FILE}: transforms: expected a list of names, got {saved!r}")
    model = load_checkpoint(folder, device=device, dtype=dtype)
    apply_plan(model, plan, saved=saved)
    state_path = folder / STATE_FILE
    if not state_path.is_file():
        raise DiffquantError(
            f"{folder}: missing {STATE_FILE} (a quantized checkpoint holds {CONFIG_FILE}, "
            f"{WEIGHTS_FILE}, {PLAN_FILE} and {STATE_FILE})"
        )
    try:
        state = load_file(str(state_path), device=str(device))
    except (SafetensorError, OSError) as err:
        raise DiffquantError(f"{state_path}: not a readable safetensors file ({err})") from None
    quantizers = fake_quantizers(model)
    coded = weight_modules(model)
    codes: dict[str, dict[str, torch.Tensor]] = {}
    backends = {n: m for n, m in model.named_modules() if isinstance(m, BackendLinear)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        owner, _, buf = key.rpartition(".")
        if owner in quantizers and buf in ("scale", "zero_point"):
            setattr(quantizers[owner], buf, value)
            continue
        if owner in coded and buf in CODE_BUFFERS:
            codes.setdefault(owner, {})[buf] = value
            continue
        module_name, sep, inner_key = key.partition(".inner.")
        if sep and module_name in backends:
            pending.setdefault(module_name, {})[inner_key] = value
            continue
        raise DiffquantError(f"{state_path}: unexpected tensor {key} for plan {plan.name!r}")
    for module_name, values in pending.items():
        load_quanto_state(backends[module_name].inner, values)
    for owner, q in coded.items():
        given = codes.get(owner, {})
        if q.filled and not given:  # computed from the weights at apply_plan (a checkpoint before codes)
            continue
        missing_buffers = [b for b in CODE_BUFFERS if b not in given]
        if missing_buffers:
            raise DiffquantError(f"{state_path}: missing {owner}.{missing_buffers[0]} (the weights' codes)")
        q.set_codes(GroupCodes(given["codes"], given["scale"], given["zero"], q.grid))
    missing = [n for n, q in quantizers.items() if q.scheme.is_static and q.scale is None]
    if missing:
        raise DiffquantError(f"{state_path}: missing static scales for {', '.join(missing[:5])}")
    return model.eval()
