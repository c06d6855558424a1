"""Quantize a checkpoint end to end: plan -> calibrate -> error report -> quantized checkpoint.

Shared by ``diffquant quantize`` and the recipes' quantize stage.
"""

from __future__ import annotations

import copy
import resource
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from diffquant.data import fingerprint, model_tokenizer, token_windows
from diffquant.data.corpus import default_text
from diffquant.data.tokenizer import Tokenizer
from diffquant.errors import DiffquantError
from diffquant.heap import map_blocks_from
from diffquant.io import load_model
from diffquant.io.artifacts import library_versions
from diffquant.io.load import available_bytes
from diffquant.io.options import run_options
from diffquant.io.quantized import is_quantized, save_quantized
from diffquant.io.runfolder import claim_checkpoint_folder, claim_files_only
from diffquant.models.transformer import DecoderLM
from diffquant.progress import step
from diffquant.quant.kv_cache import format_kv_error, kv_cache_error
from diffquant.quant.modules import nan_counts
from diffquant.quant.pipeline import apply_plan, calibrate, calibration_streams, rewrites_weights
from diffquant.quant.plan import QuantPlan
from diffquant.quant.report import compare_models, format_report
from diffquant.quant.rotate import rotate_model
from diffquant.quant.smoothquant import apply_smoothing


def quantize_checkpoint(
    checkpoint: str,
    plan_spec: str,
    *,
    calib_data: str | None,
    calib_tokens: int,
    eval_tokens: int,
    seq_len: int,
    batch_size: int,
    out: str | Path,
    force: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """Write the quantized model of ``checkpoint`` under ``plan_spec`` to ``out``.

    Calibration and the error report read ``calib_data`` (None: the default calibration text for the
    model's tokenizer) through the model's own tokenizer (``tokenizer`` overrides it). The error report
    compares against the unquantized model on held-out windows (those after the calibration windows in
    the same source). Returns a summary with the printed text and the report.
    """
    out = check_quantize_target(checkpoint, out, force)
    plan = QuantPlan.load(plan_spec)
    # Claimed for the whole run, as the streamed quantize claims it: a second quantize into the same new
    # --out is refused at once instead of racing this one to the rename.
    with claim_checkpoint_folder(out, force):
        return _quantize_into(
            checkpoint,
            plan_spec,
            plan,
            calib_data,
            calib_tokens,
            eval_tokens,
            seq_len,
            batch_size,
            out,
            device,
            dtype,
            tokenizer,
        )


def _quantize_into(
    checkpoint: str,
    plan_spec: str,
    plan: QuantPlan,
    calib_data: str | None,
    calib_tokens: int,
    eval_tokens: int,
    seq_len: int,
    batch_size: int,
    out: Path,
    device: str,
    dtype: str | None,
    tokenizer: str | None,
) -> dict[str, Any]:
    """:func:`quantize_checkpoint` once ``out`` is claimed."""
    map_large_blocks()
    parsed = run_options(device, dtype)  # at this entry point's edge, once (a torch.device: as it is)
    device, torch_dtype = parsed.device, parsed.dtype
    reference = load_model(checkpoint, device=device, dtype=torch_dtype, tokenizer=tokenizer)
    check_seq_len(seq_len, reference.config.max_seq_len, checkpoint)
    tok = model_tokenizer(reference, str(checkpoint))
    calib_data = calib_data or default_text([tok], "calib")
    model = quantized_copy(reference, plan)
    model.tokenizer = tok
    applied = apply_plan(model, plan)
    if plan.rotate is not None:
        # The float model rotated alike (exact), so each site compares rotated with rotated activations.
        rotate_model(reference, plan.rotate)
    windows = split_windows(calib_data, calib_tokens, eval_tokens, seq_len, tok, device)
    check_calibration_memory(plan, windows, reference.config.d_model, model_dtype(reference), device)
    with torch.no_grad():
        calibrated = calibrate(model, windows.calib, batch_size=batch_size)
        for _, factors in model.quant.folded:
            # The same float model, smoothed alike (SmoothQuant's or AWQ's scales), so each site compares
            # X / s with X / s (the logits are the same either way): an unsmoothed reference would count the
            # smoothing as error.
            apply_smoothing(reference, factors)
        report = compare_models(reference, model, windows.held_out, batch_size=batch_size)
    kv_report = None
    if plan.kv_cache is not None:  # the cache's own error: the report's whole-window forwards use none
        with step("kv cache error"):
            kv_report = kv_cache_error(model, windows.held_out, batch_size=batch_size)
    del reference  # the weights only it holds (a rotated or smoothed plan's), before the write
    meta = quantize_meta(checkpoint, plan_spec, calib_data, calibrated, seq_len, tok, windows, model)
    with step(f"write {out}"):
        save_quantized(
            model,
            out,
            meta=meta,
            overwrite=True,  # the claimed folder (checked free unless --force)
            documents={
                "quant_report.json": {
                    "plan": plan.to_dict(),
                    "applied": applied,
                    "report": report,
                    **({"kv_cache": kv_report} if kv_report is not None else {}),
                }
            },
        )
    return quantize_summary(plan, applied, calib_data, tok, windows, report, meta, out, kv_report)


def quantized_copy(reference: DecoderLM, plan: QuantPlan) -> DecoderLM:
    """The model ``plan`` is applied to: a copy of the unquantized ``reference`` (the same weights, as a second
    load of the checkpoint gives them), built without reading the checkpoint again.

    Unless the plan rewrites weights (rotation, smoothing, AWQ's folded scales), the copy's parameters are new Parameters on the reference's tensors:
    one copy of the weights in memory, not two. Quantizers never write the weights they quantize (a
    FakeQuant caches its quantized weight, the ``weights`` section and the backends keep codes or layers of
    their own), and whatever replaces a parameter of the copy (``linear.weight.data = ...``, a swapped
    module) leaves the reference's alone. Rotation, smoothing and AWQ rewrite weights in place (a norm's
    ``weight.data.fill_(1)``, the folds' ``weight.copy_``) and the reference is transformed alike
    separately, so such a plan gets a copy of its own (:func:`~diffquant.quant.pipeline.rewrites_weights`).
    """
    memo: dict[int, Any] = {id(reference.tokenizer): reference.tokenizer}
    if not rewrites_weights(plan):
        for p in reference.parameters():
            memo[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
    return copy.deepcopy(reference, memo)


class Windows(NamedTuple):
    """The token windows of a quantize run: ``calib`` calibrates, ``held_out`` is what the error report
    reads; ``same`` when the source was too small for a held-out part and ``held_out`` is ``calib``."""

    calib: torch.Tensor
    held_out: torch.Tensor
    same: bool


def check_quantize_target(checkpoint: str, out: str | Path, force: bool) -> Path:
    """``out`` as a Path, once ``checkpoint`` is known not to be quantized already and ``out`` free to write
    (or ``force``). A folder holding only another run's claim is left to :func:`claim_checkpoint_folder`,
    which says it is in use (or free again)."""
    if is_quantized(checkpoint):
        raise DiffquantError(f"{checkpoint}: already quantized; quantize its base checkpoint instead")
    out = Path(out)
    if out.exists() and not force and not claim_files_only(out):
        raise DiffquantError(f"{out}: already exists (pass --force to replace it)")
    return out


def check_seq_len(seq_len: int, max_seq_len: int, checkpoint: str) -> None:
    """Refuse windows longer than the model's ``max_seq_len``, in one line."""
    if seq_len > max_seq_len:
        raise DiffquantError(f"--seq-len {seq_len} exceeds the max_seq_len {max_seq_len} of {checkpoint}")


def split_windows(
    calib_data: str,
    calib_tokens: int,
    eval_tokens: int,
    seq_len: int,
    tok: Tokenizer,
    device: torch.device | str,
) -> Windows:
    """The windows of ``calib_data`` on ``device``: the first ones (at least ``calib_tokens``, at least one
    window) calibrate, the rest are held out for the error report. A source too small for a held-out
    part reports on the calibration windows themselves (``same``, said in the summary)."""
    windows = token_windows(calib_data, calib_tokens + eval_tokens, seq_len, tok).to(device)
    n_calib = max(1, min(windows.shape[0] - 1, -(-calib_tokens // seq_len)))
    calib, held_out = windows[:n_calib], windows[n_calib:]
    same = held_out.shape[0] == 0
    return Windows(calib, calib if same else held_out, same)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes its hidden states in: its first floating parameter's."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_calibration_memory(
    plan: QuantPlan,
    windows: Windows,
    d_model: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    streamed: bool = False,
) -> None:
    """Refuse, in one line and before calibrating, calibration windows whose hidden states cannot be held.

    Calibration tokens are bounded by what the source holds (:func:`split_windows`), but a large source
    (the default text of a byte-level model holds 11.9M tokens) still asks for more than memory when the
    run keeps a hidden state per calibration token: GPTQ runs stage by stage over all calibration windows
    at once, and a streamed run keeps every window's hidden states between stages (the static-scale stream;
    with GPTQ a second stream, and the report's float and quantized streams of the held-out windows).
    Measured: ``--calib-tokens 1e12`` on a tiny model grew to the address-space limit (or the OOM killer)
    in GPTQ's first stage. ``tokens x d_model x bytes`` per stream is compared with the memory this
    process can still use (:func:`~diffquant.io.load.available_bytes`)."""
    per_token = d_model * torch.empty((), dtype=dtype).element_size()
    calib_streams = calibration_streams(plan)
    need = per_token * calib_streams * windows.calib.numel()
    if streamed:
        need += per_token * 2 * windows.held_out.numel()
    if not calib_streams:
        return
    room = available_bytes(device)
    if need <= room:
        return
    held = need - per_token * calib_streams * windows.calib.numel()
    fit = max(0, (room - held) // (per_token * calib_streams))
    what = "calibration holds" if not streamed else "a streamed quantize holds"
    raise DiffquantError(
        f"calibration tokens (--calib-tokens, recipe data.calib.tokens): {windows.calib.numel():,} tokens, "
        f"{what} a hidden state of {per_token:,} bytes per token at once ({need / 2**30:.2f} GiB), more "
        f"than the {room / 2**30:.2f} GiB this process can use on {torch.device(device)}; ask for at most "
        f"{fit:,} tokens"
    )


def check_model_calibration(plan: QuantPlan, model: nn.Module, windows: torch.Tensor) -> None:
    """:func:`check_calibration_memory` for ``model`` (whole, planned) about to be calibrated on ``windows``
    (N, L): what a sweep's cell checks before :func:`~diffquant.quant.pipeline.calibrate`."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    whole = Windows(windows, windows[:0], False)
    check_calibration_memory(plan, whole, model.config.d_model, model_dtype(model), device)


def quantize_meta(
    checkpoint: str,
    plan_spec: str,
    calib_data: str,
    calibrated: int,
    seq_len: int,
    tok: Tokenizer,
    windows: Windows,
    model: nn.Module,
) -> dict[str, Any]:
    """The ``meta`` a quantized checkpoint records: its base, the plan's source, the calibration
    (``calibrated`` tokens, 0 for dynamic scales), the report's token count, the quantizers' NaN counts of
    the calibrated ``model`` and the library versions."""
    return {
        "base": str(checkpoint),
        "plan_source": str(plan_spec),
        "calibration": {
            "source": calib_data,
            "fingerprint": fingerprint(calib_data),
            "tokens": calibrated,
            "seq_len": seq_len,
            "tokenizer": tok.name,
        },
        "report_tokens": windows.held_out.numel(),
        "nan_counts": nan_counts(model),
        "versions": library_versions(),
    }


def quantize_summary(
    plan: QuantPlan,
    applied: list[tuple[str, str, str]],
    calib_data: str,
    tok: Tokenizer,
    windows: Windows,
    report: dict[str, dict],
    meta: dict[str, Any],
    out: Path,
    kv_report: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What a quantize run returns: the printed text (the plan, what was quantized and calibrated, the error
    report, where it was written), the report, the logits' SQNR and the process's peak resident memory."""
    calibrated = meta["calibration"]["tokens"]
    counts = Counter(target for target, _, _ in applied)
    calibration = (
        f"calibrated on {calibrated:,} tokens" if calibrated else "dynamic scales, no calibration needed"
    )
    lines = [
        f"plan {plan.name}: {plan.description}" if plan.description else f"plan {plan.name}",
        f"quantized {counts['site']} sites, {counts['weight']} weights, {counts['linear']} backend Linears; "
        f"{calibration}" + (f" of {calib_data} ({tok.describe()})" if calibrated else ""),
        f"error vs the unquantized model on {windows.held_out.numel():,} held-out tokens"
        + (" (the calibration windows: the source is too small for a held-out part)" if windows.same else "")
        + ":",
        format_report(report),
    ]
    rotations = [f"rotated {place}: {what}" for target, place, what in applied if target == "rotate"]
    lines[1:1] = rotations  # after the plan's line: which matrices ran (a report must name them)
    for target, _, what in applied:
        if target == "kv_cache":  # the report's whole-window forwards run without a cache
            lines.insert(
                len(rotations) + 2,
                f"KV cache for decoding: {what} (not in the report below, whose forwards use no cache; "
                "measure it with a decoding task: ppl decode=N, retrieval)",
            )
    if kv_report:
        lines.append(format_kv_error(kv_report, windows.held_out.numel()))
    if meta["nan_counts"]:
        lines.append(f"NaN seen by quantizers: {meta['nan_counts']}")
    lines.append(f"wrote {out} (load it like any checkpoint: diffquant profile {out} ...)")
    return {
        "text": "\n".join(lines),
        "report": report,
        "logits_sqnr_db": report["logits"]["sqnr_db"],
        "peak_memory_bytes": peak_memory_bytes(),  # the command prints it (it varies run to run)
    }


def peak_memory_bytes() -> int:
    """This process's peak resident set so far (``getrusage`` ``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


MMAP_THRESHOLD = 1 << 20  # bytes: glibc serves blocks this large from their own mappings


def map_large_blocks() -> None:
    """Have glibc's malloc give every block of at least :data:`MMAP_THRESHOLD` its own mapping, returned to
    the system when freed (for the rest of the process; nothing elsewhere than glibc).

    By default glibc raises that threshold each time a large block is freed, up to 32 MiB, and then serves
    the weights-sized tensors of a run (float copies of quantized weights, per-layer activations, their
    temporaries) from its heap, where freed blocks between live ones stay resident: measured on SmolLM2,
    the static-scale pass grew the resident set by 0.7 GB it never used again. Mapped blocks cost a page
    fault per page when first written, nothing next to the arithmetic on them.
    """
    map_blocks_from(MMAP_THRESHOLD)
