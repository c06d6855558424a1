"""SmoothQuant: activation scales and smoothing (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient
Post-Training Quantization for Large Language Models", arXiv 2211.10438).

Activation scales ("act_scales" in the reference code) are, for every Linear, the abs-max of its input per
input channel over calibration text: max_{tokens} |X_j|. They come from one profile pass over the
``linear_in`` taps (the profile's per-site ``channel_absmax``), so they are the very numbers a profile
reports, and are saved as SmoothQuant's own files are: ``torch.save`` of a dict module name -> fp32 1-D
tensor (Hugging Face module names for models that came from Hugging Face / GGUF, native names otherwise).

Smoothing migrates quantization difficulty from activations to weights with a per-channel factor
(Eq. 4 of the paper)::

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

where max|W_j| is taken over the output rows of every Linear that reads X (q/k/v [+ DIFF V2's
lambda_proj, gated attention's gate_proj] read the attention norm's output; gate/up read the MLP norm's output). Then
X' = X diag(s)^-1 and W' = diag(s) W, which leaves X W^T unchanged: the division is folded into the
preceding RMSNorm's gain (norm.weight_j /= s_j; with Gemma's (1 + w) norms (1 + w_j) /= s_j) and the multiplication into the Linear weights'
input columns (W[:, j] *= s_j). As in the reference ``smooth_ln_fcs``, s is clamped to >= 1e-5 and
max|W_j| to >= 1e-5; channels that never fire (max|X_j| = 0) keep s_j = 1. o_proj / down (inputs not
produced by a norm) and the LM head (tied to the embedding in many models) are not smoothed, as in the
paper.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear, RMSNorm
from diffquant.models.config import HF_KINDS
from diffquant.models.hf_names import hf_key_map
from diffquant.profile.profiler import Profiler
from diffquant.progress import progress as show_progress
from diffquant.quant.caches import drop_weight_cache
from diffquant.quant.modules import (
    BackendLinear,
    linear_modules,
    taps_detached,
    weight_quantizers_detached,
)

NAMINGS = ("hf", "native")
# Specifiers of models that came from Hugging Face / llama.cpp: their act-scales use HF module names.
HF_SPEC_PREFIXES = ("hf:", "gguf:", "fetch:")
DEFAULT_ALPHA = 0.5
_CLAMP = 1e-5  # SmoothQuant's clamp of the factors and of the weight abs-max


def default_names(spec: str | Path) -> str:
    """'hf' for a model specifier that reads a Hugging Face folder or a GGUF file (hf:, gguf:, fetch:),
    else 'native'."""
    return "hf" if str(spec).startswith(HF_SPEC_PREFIXES) else "native"


# ------------------------------------------------------------------------------------------- act-scales
def act_scales(profile, model: nn.Module, names: str = "native") -> dict[str, torch.Tensor]:
    """SmoothQuant act_scales of every Linear of ``model`` (LM head included) from ``profile``'s
    ``linear_in`` statistics: module name -> fp32 (in_features,) per-input-channel abs-max.

    ``names``: 'native' (``layers.0.attn.q_proj``) or 'hf' (``model.layers.0.self_attn.q_proj``, the
    names of the Hugging Face llama / diffllama module, see :func:`hf_module_names`).
    """
    if names not in NAMINGS:
        raise DiffquantError(f"act-scales names: {names!r}; expected one of {', '.join(NAMINGS)}")
    mapping = hf_module_names(model) if names == "hf" else None
    out: dict[str, torch.Tensor] = {}
    linears = linear_modules(model)
    for name in linears:
        site = f"{name}.input"
        if site not in profile.sites:
            raise DiffquantError(
                f"profile has no statistics for site {site} (profile with sites kind:linear_in)"
            )
    _refuse_nonfinite(profile, list(linears))
    for name, linear in linears.items():
        stats = profile.sites[f"{name}.input"]
        summary = stats.summary()
        amax, shape = summary["channel_absmax"], summary["channel_absmax_shape"]
        if amax is None or shape != [linear.in_features]:
            raise DiffquantError(
                f"{site}: channel abs-max of shape {shape}, expected [{linear.in_features}] (did data reach it?)"
            )
        # float64 abs-max of fp32 / bf16 / fp16 values: the cast to fp32 is exact for those model dtypes.
        value = torch.tensor(amax, dtype=torch.float64).to(torch.float32)
        out[mapping[name] if mapping is not None else name] = value
    return out


def _refuse_nonfinite(profile, names: list[str], shown: int = 4) -> None:
    """Refuse act-scales when NaN / Inf reached a Linear's input, naming those Linears.

    The profile leaves non-finite values out of the channel abs-max, so such a run would still produce
    numbers: the abs-max of whatever stayed finite (all zeros past the first NaN of a broken model), which
    smoothing would then fold into the weights as if they described the model.
    """
    bad = []
    for name in names:
        stats = profile.sites[f"{name}.input"]
        n_bad = stats.nan_count + stats.posinf_count + stats.neginf_count
        if n_bad:
            bad.append((name, stats.nan_count, n_bad - stats.nan_count))
    if not bad:
        return
    listed = ", ".join(f"{n} ({nan:,} NaN, {inf:,} Inf)" for n, nan, inf in bad[:shown])
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    raise DiffquantError(
        f"non-finite inputs (NaN / Inf) reached {len(bad)} of {len(names)} Linears: {listed}{more}; "
        "act-scales need a finite model (check its weights): none were taken"
    )


def hf_module_names(model: nn.Module) -> dict[str, str]:
    """Native Linear name -> Hugging Face module name (the keys of :func:`convert_hf.hf_key_map` without
    ``.weight``; ``lm_head`` also when tied to the embedding)."""
    config = model.config
    if config.attention == "diff_v1" and config.v1_norm_affine:
        raise DiffquantError(
            "act-scales names 'hf': this DIFF V1 model has a per-head norm weight, which export folds into "
            "o_proj, so the diffllama o_proj inputs differ from these; use names 'native'"
        )
    keys = hf_key_map(config)
    mapping = {"lm_head": "lm_head"}
    for native, hf in keys.items():
        if native.endswith(".weight"):
            mapping[native.removesuffix(".weight")] = hf.removesuffix(".weight")
    out = {}
    for name in linear_modules(model):
        if name not in mapping:
            raise DiffquantError(
                f"act-scales names 'hf': {name} has no Hugging Face name (attention {config.attention} has "
                "no HF format); use names 'native'"
            )
        out[name] = mapping[name]
    if config.attention not in HF_KINDS:  # every Linear has a llama name, but no HF model reads them
        raise DiffquantError(
            f"act-scales names 'hf': attention {config.attention!r} has no Hugging Face format; use names "
            "'native'"
        )
    return out


@contextmanager
def float_model(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its fake-quantizers (taps and weights) detached for the duration: the float model a
    quantization plan was applied to. Backend layers cannot be detached and are refused."""
    for name, module in model.named_modules():
        if isinstance(module, BackendLinear):
            raise DiffquantError(
                f"{name}: a {module.backend} layer; act-scales need the float model (give the base checkpoint)"
            )
    with taps_detached(model), weight_quantizers_detached(linear_modules(model).values()):
        yield model


@torch.no_grad()
def collect_act_scales(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 8,
    names: str = "native",
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Run ``model`` (its float weights: fake-quantizers detached) over ``windows`` (N, L) under a
    Profiler of the ``kind:linear_in`` sites and return :func:`act_scales`.

    One process, whatever the torchrun world: a calibration pass belongs to one sweep cell, which runs on
    one rank (``profile_model`` would split the windows over ranks that are not there).
    """
    if batch_size < 1:
        raise DiffquantError(f"batch_size: expected an integer >= 1, got {batch_size}")
    if names not in NAMINGS:
        raise DiffquantError(f"act-scales names: {names!r}; expected one of {', '.join(NAMINGS)}")
    if names == "hf":
        hf_module_names(model)  # a model without HF names is refused before the pass, not after
    device = next(model.parameters()).device
    with float_model(model), Profiler(model, sites=["kind:linear_in"], topk=1, attention=False) as prof:
        starts = range(0, windows.shape[0], batch_size)
        for start in show_progress(
            starts, "act-scales", "batch", bar=progress or None, leave=False, announce=True
        ):
            prof.start_samples_at(start)
            model(windows[start : start + batch_size].to(device))
        profile = prof.take()
    return act_scales(profile, model, names=names)


# ------------------------------------------------------------------------------------------- smoothing
def smoothing_groups(model: nn.Module) -> list[tuple[str, RMSNorm, dict[str, nn.Module]]]:
    """(norm name, norm, {Linear name: module}) per RMSNorm whose output only Linears read: the model's own
    :meth:`~diffquant.models.transformer.DecoderLM.norm_readers` (per block, the attention norm -> q/k/v and
    the kind's own readers of the same x: DIFF V2's lambda_proj, gated attention's gate_proj; the MLP norm ->
    gate/up). The final norm -> LM head is not smoothed (tied to the embedding in many models)."""
    return model.norm_readers()


def _check_group(norm_name: str, norm: nn.Module, linears: dict[str, nn.Module], owners: dict) -> None:
    if not isinstance(norm, RMSNorm) or norm.weight is None:
        raise DiffquantError(f"{norm_name}: no norm weight to fold the smoothing into (affine=False)")
    shared = [n for n in owners.get(norm.weight.data_ptr(), []) if n != f"{norm_name}.weight"]
    if shared:
        raise DiffquantError(f"{norm_name}: cannot smooth: its weight is shared with {shared[0]}")
    for name, linear in linears.items():
        if not isinstance(linear, Linear):
            raise DiffquantError(
                f"{norm_name}: cannot smooth into {name}: a {type(linear).__name__}, not a float Linear"
            )
        if linear.in_features != norm.weight.numel():
            raise DiffquantError(
                f"{norm_name}: {name} reads {linear.in_features} channels, the norm has {norm.weight.numel()}"
            )
        shared = [n for n in owners.get(linear.weight.data_ptr(), []) if n != f"{name}.weight"]
        if shared:
            raise DiffquantError(
                f"{norm_name}: cannot smooth into {name}: its weight is shared with {shared[0]}"
            )


def smoothing_factors(
    scales: torch.Tensor, weights: list[torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """SmoothQuant's s (float64): s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (Eq. 4), max|W_j| over the
    rows of every weight reading channel j, clamped to >= 1e-5; s_j = 1 where max|X_j| = 0."""
    amax = scales.to(torch.float64)
    wmax = torch.stack([w.detach().abs().to(torch.float64).amax(dim=0).cpu() for w in weights]).amax(0)
    wmax = wmax.clamp(min=_CLAMP)
    s = (amax.pow(alpha) / wmax.pow(1.0 - alpha)).clamp(min=_CLAMP)
    return torch.where(amax > 0, s, torch.ones_like(s))


@torch.no_grad()
def smooth_model(
    model: nn.Module, scales: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> dict[str, torch.Tensor]:
    """Smooth ``model`` in place with act-scales ``scales`` (keyed by native Linear name, see
    :func:`collect_act_scales`); returns the factors s (float64, on the CPU) by norm name.

    For each norm of :func:`smoothing_groups`: norm.weight /= s and W[:, j] *= s_j for each Linear it
    feeds, computed in float64 and cast back, so the float model's output is unchanged up to rounding.
    Everything is checked before anything changes: a norm without a weight, a weight shared with another
    module (tied: scaling one would scale the other), a missing or misshapen scale, a non-finite factor.
    """
    if not (0.0 <= alpha <= 1.0):
        raise DiffquantError(f"smooth alpha: expected a number in [0, 1], got {alpha!r}")
    factors = {}
    for norm_name, _, linears in _checked_groups(model):
        acts = []
        for name, linear in linears.items():
            if name not in scales:
                raise DiffquantError(
                    f"{norm_name}: act-scales have no entry for {name} (smoothing needs native module names)"
                )
            value = torch.as_tensor(scales[name])
            if tuple(value.shape) != (linear.in_features,):
                raise DiffquantError(
                    f"{norm_name}: act-scale of {name} has shape {tuple(value.shape)}, "
                    f"expected ({linear.in_features},)"
                )
            acts.append(value.detach().to("cpu", torch.float64))
        amax = torch.stack(acts).amax(0)  # one input, so equal; the max if a caller's scales differ
        s = smoothing_factors(amax, [lin.weight for lin in linears.values()], alpha)
        if not torch.isfinite(s).all():
            raise DiffquantError(f"{norm_name}: non-finite smoothing factor (act-scales with inf or NaN?)")
        factors[norm_name] = s
    apply_smoothing(model, factors)
    return factors


@torch.no_grad()
def apply_smoothing(model: nn.Module, factors: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Divide each norm's weight by its factors s and multiply the input columns of the Linears it feeds
    (float64, cast back). ``factors``: by norm name, as :func:`smooth_model` returns them (applying them to
    an equal copy of the model reproduces the smoothed one exactly). ``partial``: norms without factors are
    left alone (AWQ folds only the norms whose readers it quantizes)."""
    groups = _checked_groups(model)
    for norm_name, norm, _ in groups:
        if norm_name not in factors:
            if partial:
                continue
            raise DiffquantError(f"{norm_name}: no smoothing factors for it (factors of another model?)")
        shape = tuple(torch.as_tensor(factors[norm_name]).shape)
        if shape != (norm.weight.numel(),):
            raise DiffquantError(
                f"{norm_name}: smoothing factors of shape {shape}, expected ({norm.weight.numel()},)"
            )
    extra = sorted(set(factors) - {norm_name for norm_name, _, _ in groups})
    if extra:
        raise DiffquantError(f"{extra[0]}: smoothing factors for a norm this model does not smooth")
    for norm_name, norm, linears in groups:
        if norm_name in factors or not partial:
            fold_factors(norm, linears.values(), factors[norm_name])


@torch.no_grad()
def fold_factors(norm: RMSNorm, linears: Iterable[nn.Module], factors: torch.Tensor) -> None:
    """X / s into the norm, W diag(s) into each Linear that reads it (float64, cast back): the float model's
    output unchanged up to rounding. SmoothQuant's and AWQ's scales fold the same way."""
    # The factors live on the host (smooth_model returns them there); each product is formed on the weights'
    # device.
    s = torch.as_tensor(factors).to(norm.weight.device, torch.float64)
    # The gain divides: w / s, or with Gemma's (1 + w) norms w' = (1 + w) / s - 1 (RMSNorm.set_gain).
    norm.set_gain(norm.gain() / s)
    for linear in linears:
        lw = linear.weight
        lw.copy_((lw.to(torch.float64) * s.to(lw.device)[None, :]).to(lw.dtype))
        drop_weight_cache(linear.weight_quantizer)  # its cache holds the old weight: quantize afresh


def _checked_groups(model: nn.Module) -> list[tuple[str, RMSNorm, dict[str, nn.Module]]]:
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(p.data_ptr(), []).append(name)
    groups = smoothing_groups(model)
    for norm_name, norm, linears in groups:
        _check_group(norm_name, norm, linears, owners)
    return groups
