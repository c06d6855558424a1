"""``diffquant quantize --stream``: calibrate, measure the error and write the quantized checkpoint of a model
larger than memory, one stage (embedding, decoder layer, final norm + LM head) at a time.

The result is the whole-model :func:`~diffquant.io.quantize.quantize_checkpoint`'s: the same quantized
checkpoint (``load_model(out)`` rebuilds the same model) and the same error report, because every number
comes from the same tensors in the same order:

* calibration: the calibration windows go through stage i with its static quantizers observing (as
  :meth:`~diffquant.stream.executor.StreamedModel.calibrate_stage` does for profiles), then the scales are
  fixed, before the held-out windows go through it;
* the error report: :func:`~diffquant.quant.report.compare_models` runs the float reference and the quantized
  model over each held-out batch, each model on its own hidden states, and compares site by site. Streamed,
  two hidden streams do the same: the reference stream through an unplanned skeleton (the float model,
  fused attention where it is fused whole), the quantized stream through the planned one; both skeletons
  share the stage's weights (read once). Each site is compared by the report's own
  :func:`~diffquant.quant.report.compare_batch`, in batch order, so the float64 sums add up in the same
  order as the whole-model run and the report is equal, not merely close;
* the checkpoint: its ``model.safetensors`` holds the unquantized base weights (see
  :mod:`diffquant.io.quantized`). Every tensor's name, dtype and shape are known from the skeleton before a
  weight is read, so the file's header is written first and each stage's tensors are written into their
  place as the stage is materialised: one file, laid out as ``save_file`` lays it out (the same bytes),
  loadable by the ordinary loader. The folder is filled in a temporary sibling and renamed into place at the end
  (:func:`~diffquant.io.artifacts.write_folder_atomic`), so a failed run leaves no half-written output.

A rotating plan (QuaRot / SpinQuant) streams: each stage's weights are rotated as they are read
(:meth:`~diffquant.stream.executor.StreamedModel.read_stage`), so the checkpoint holds the rotated weights
the whole-model quantize saves, and its plan records the rotation (``transforms``). Plans with SmoothQuant
smoothing or a backend are refused in one line (:func:`open_streamed`): smoothing rewrites weights from
statistics of all layers, and backend Linears hold their own copies of the weights.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from diffquant.data import model_tokenizer
from diffquant.data.corpus import default_text
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import write_folder_atomic
from diffquant.io.checkpoint import write_config
from diffquant.io.options import run_options
from diffquant.io.quantize import (
    check_calibration_memory,
    check_quantize_target,
    check_seq_len,
    quantize_meta,
    quantize_summary,
    split_windows,
)
from diffquant.io.quantized import base_state_dict, write_quant_files
from diffquant.io.runfolder import claim_checkpoint_folder
from diffquant.models.taps import select_taps
from diffquant.names import WEIGHTS_FILE
from diffquant.progress import is_quiet, progress
from diffquant.progress import write as write_line
from diffquant.quant.fake import FakeQuant
from diffquant.quant.plan import QuantPlan
from diffquant.quant.report import ErrorStats, compare_batch
from diffquant.stream.executor import DEFAULT_HIDDEN_BUDGET, HiddenStore, StreamedModel, open_streamed

# safetensors' dtype tags of the float dtypes a model computes in
_TAGS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def quantize_streamed(
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
    hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`~diffquant.io.quantize.quantize_checkpoint` of a streamable checkpoint (a native folder,
    ``zoo:NAME``, ``hf:FOLDER``: see :func:`~diffquant.stream.executor.resolve_stream_spec`), holding one
    stage's weights at a time: same arguments, same quantized
    checkpoint in ``out``, same summary (printed text, report, logits SQNR). ``hidden_budget``: bytes of
    hidden states kept in memory per stream before they spill to files; ``stats`` (a dict) receives the
    run's memory numbers (bytes per stage, largest stage, hidden-state peaks)."""
    out = check_quantize_target(checkpoint, out, force)
    plan = QuantPlan.load(plan_spec)
    parsed = run_options(device, dtype)  # at this entry point's edge, once (a torch.device: as it is)
    device = parsed.device
    # Without gradients, applying the plan to the weightless skeleton runs no quantizer on a meta weight.
    with torch.no_grad(), open_streamed(checkpoint, device, parsed.dtype, plan) as streamed:
        check_seq_len(seq_len, streamed.config.max_seq_len, checkpoint)
        if tokenizer is not None:  # as load_model(checkpoint, tokenizer=...) sets it
            streamed.model.tokenizer = model_tokenizer(streamed.model, str(checkpoint), override=tokenizer)
        tok = model_tokenizer(streamed.model, str(checkpoint))
        streamed.model.tokenizer = tok
        calib_data = calib_data or default_text([tok], "calib")
        applied = streamed.applied
        windows = split_windows(calib_data, calib_tokens, eval_tokens, seq_len, tok, device)
        d_model, hidden_dtype = streamed.config.d_model, streamed.dtype
        check_calibration_memory(plan, windows, d_model, hidden_dtype, device, streamed=hidden_budget is None)
        # static scales or gptq weights (smoothing and backends, the plan's other readers of calibration
        # text, do not stream)
        static = plan.uses_static
        calibrated = windows.calib.numel() if static else 0
        result: dict[str, Any] = {}

        def write(folder: Path) -> None:
            """Fill the temporary folder: config and tokenizer, the weights stage by stage (the run itself),
            then the plan, the scales and the report, which exist only once every stage has run."""
            write_config(folder, streamed.model)
            started = time.monotonic()
            with _TensorFileWriter(folder / WEIGHTS_FILE, _base_shapes(streamed), streamed.dtype) as weights:
                report, info = _run(
                    streamed,
                    windows.calib if static else None,
                    windows.held_out,
                    batch_size,
                    weights,
                    hidden_budget,
                )
            if streamed.gptq_stats.linears and not is_quiet():
                write_line(streamed.gptq_stats.line(time.monotonic() - started))
            meta = quantize_meta(
                checkpoint, plan_spec, calib_data, calibrated, seq_len, tok, windows, streamed.model
            )
            document = {"plan": plan.to_dict(), "applied": applied, "report": report}
            write_quant_files(folder, streamed.model, meta, {"quant_report.json": document})
            result.update(report=report, meta=meta, info=info)

        # The one claim of every writer of a run or checkpoint folder: a second quantize into the same --out
        # is refused at once (the rename at the end would otherwise silently replace one checkpoint).
        with claim_checkpoint_folder(out, force):
            write_folder_atomic(out, write, True)
    if stats is not None:
        stats.update(result["info"])
    return quantize_summary(plan, applied, calib_data, tok, windows, result["report"], result["meta"], out)


# ============================================================================================== the run
@torch.no_grad()
def _run(
    streamed: StreamedModel,
    calibration: torch.Tensor | None,
    held_out: torch.Tensor,
    batch_size: int,
    weights: _TensorFileWriter,
    hidden_budget: int | None,
) -> tuple[dict[str, dict], dict[str, Any]]:
    """Every stage once: its weights read (and written to ``weights``), its static scales calibrated, then
    the held-out batches through the float stage (reference stream) and the quantized stage (quantized
    stream), compared site by site as :func:`~diffquant.quant.report.compare_models` compares. Returns the
    report and the run's memory numbers."""
    reference = StreamedModel(streamed.spec, streamed.source, streamed.device, streamed.dtype)
    if streamed.model.rotation is not None:
        # the whole-model reference is rotated alike; here it shares the rotated weights, so only the
        # online rotations (R3, R4) are attached to it, stage by stage
        reference.rotate(streamed.model.rotation, weights=False)
    ref_taps, q_taps = select_taps(reference.model, "*"), select_taps(streamed.model, "*")
    names = [n for n in ref_taps if n in q_taps]
    site_stats = {name: ErrorStats() for name in names}
    logits = ErrorStats()
    calib = None
    if calibration is not None:
        cut = [calibration[s : s + batch_size] for s in range(0, calibration.shape[0], batch_size)]
        calib = streamed.calibration(cut, hidden_budget)
    batches = [held_out[s : s + batch_size] for s in range(0, held_out.shape[0], batch_size)]
    stores = {key: HiddenStore(hidden_budget) for key in ("ref", "quant")}
    info: dict[str, Any] = {"stages": 0, "batches": len(batches)}
    try:
        # One line every few seconds on a pipe (a bar on a terminal): a streamed 70B quantize takes hours.
        desc = f"quantize {Path(streamed.spec.spec).name or streamed.spec.spec} streamed"
        pairs = list(zip(streamed.stages(), reference.stages(), strict=True))
        for (name, prefixes, modules, fn), (_, _, ref_modules, ref_fn) in progress(
            pairs, desc, "stage", leave=False, announce=True
        ):
            size = streamed.materialise(prefixes)
            streamed.stage_bytes[name] = size
            streamed.peak_stage_bytes = max(streamed.peak_stage_bytes, size)
            state = _share(streamed, reference, prefixes)
            reference.read_stage(prefixes)
            _count_weight_nans(modules)
            if calib is not None:
                streamed.calibrate_stage(calib, name, modules, fn)
            # after the calibration: a section may fold scales into the stage's weights (AWQ), and the
            # checkpoint stores the weights the codes were chosen on
            weights.write_all(state)
            stage = [n for n in names if n.startswith(_module_prefixes(streamed.model, modules))]
            _compare_stage(
                name,
                (ref_fn, fn),
                (reference.model, streamed.model),
                batches,
                {n: ref_taps[n] for n in stage},
                {n: q_taps[n] for n in stage},
                {n: site_stats[n] for n in stage},
                logits,
                (stores["ref"], stores["quant"]),
                held_out.shape[1],
                streamed.device,
            )
            streamed.release(modules)
            reference.release(ref_modules)
            info["stages"] += 1
    finally:
        static = calib.streams.get("static") if calib is not None else None
        info["hidden_peak_bytes_calib"] = static.peak_bytes if static is not None else 0
        info["hidden_spilled_calib"] = static.spilled if static is not None else 0
        if calib is not None:
            calib.close()
        for key, store in stores.items():
            info[f"hidden_peak_bytes_{key}"] = store.peak_bytes
            info[f"hidden_spilled_{key}"] = store.spilled
            store.close()
    weights.check_complete()
    report = {name: s.summary() for name, s in site_stats.items()}
    report["logits"] = logits.summary()
    info.update(stage_bytes=dict(streamed.stage_bytes), peak_stage_bytes=streamed.peak_stage_bytes)
    return report, info


def _share(streamed: StreamedModel, reference: StreamedModel, prefixes: Sequence[str]) -> dict[str, Any]:
    """The stage's base weights (just materialised on the planned skeleton) assigned to the reference
    skeleton too: the same tensors, held once, so the float stage runs on exactly the weights the quantized
    stage quantizes. Returns them by base key (what the checkpoint stores)."""
    state = {k: v for k, v in base_state_dict(streamed.model).items() if k.startswith(tuple(prefixes))}
    reference.model.load_state_dict(state, strict=False, assign=True)
    if streamed.config.tie_embeddings:
        reference.model.lm_head.weight = reference.model.embed.weight
    return state


def _count_weight_nans(modules: Sequence[nn.Module]) -> None:
    """Each weight quantizer of the stage run once on its weight, as :func:`apply_plan` runs it on the
    loaded weights of the whole model: the NaNs of the weights count in ``nan_counts`` alike."""
    for module in modules:
        for sub in module.modules():
            quantizer = getattr(sub, "weight_quantizer", None)
            if isinstance(quantizer, FakeQuant):  # (the weights section's codes count no NaNs)
                quantizer(sub.weight)


def _module_prefixes(model: nn.Module, modules: Sequence[nn.Module]) -> tuple[str, ...]:
    """The name prefixes (``layers.3.``) of ``modules`` in ``model``: where the stage's sites live."""
    chosen = {id(m) for m in modules}
    return tuple(f"{name}." for name, m in model.named_modules() if id(m) in chosen)


def _compare_stage(
    name: str,
    fns: tuple[Callable, Callable],
    models: tuple[nn.Module, nn.Module],
    batches: Sequence[torch.Tensor],
    ref_taps: dict[str, nn.Module],
    q_taps: dict[str, nn.Module],
    stats: dict[str, ErrorStats],
    logits: ErrorStats,
    stores: tuple[HiddenStore, HiddenStore],
    seq_len: int,
    device: torch.device,
) -> None:
    """The held-out batches through one stage of both streams, the stage's sites compared batch by batch
    (:func:`~diffquant.quant.report.compare_batch`: reference captured, quantized compared call by call)
    with the attention maps unchunked as :func:`~diffquant.quant.report.compare_models` runs them; the
    head's outputs are the logits compared."""
    ref_fn, q_fn = fns
    ref_store, q_store = stores
    for model in models:
        model.set_attention_path("auto", chunk_size=seq_len)
    try:
        for k, ids in enumerate(batches):
            if name == "embed":
                x_ref = x_q = ids.to(device)
            else:
                x_ref, x_q = ref_store.get(k, device), q_store.get(k, device)
            y_ref, y_q = compare_batch(
                lambda _, x=x_ref: ref_fn(x), lambda _, x=x_q: q_fn(x), None, ref_taps, q_taps, stats
            )
            if name == "head":
                logits.update(y_ref, y_q)
                ref_store.drop(k)
                q_store.drop(k)
            else:
                ref_store.put(k, y_ref)
                q_store.put(k, y_q)
            del x_ref, x_q, y_ref, y_q
    finally:
        for model in models:
            model.set_attention_path("auto")


# ===================================================================================== the checkpoint
def _base_shapes(streamed: StreamedModel) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the quantized checkpoint's weights file holds, from the skeleton alone:
    the base weights (no quantizer state), without the tied LM head (safetensors stores no aliases; it is
    tied on load)."""
    shapes = {k: tuple(v.shape) for k, v in base_state_dict(streamed.model).items()}
    if streamed.config.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


class _TensorFileWriter:
    """One safetensors file of tensors of one dtype, written tensor by tensor in any order: the header
    (names, dtype, shapes, offsets) first, from the known shapes, then each tensor's bytes at its offset
    as it comes. The layout is ``save_file``'s for tensors of one dtype (data sorted by name; the header
    lists them by offset, compact JSON padded with spaces to 8 bytes), so the file is the one ``save_file``
    would write for the same tensors, and any safetensors reader reads it."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        if dtype not in _TAGS:
            raise DiffquantError(f"{path}: cannot write {dtype} tensors (expected one of {list(_TAGS)})")
        self.path, self.shapes, self.dtype = path, shapes, dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, int] = {}
        offset = 0
        for key in sorted(shapes):
            size = itemsize * math.prod(shapes[key])
            header[key] = {
                "dtype": _TAGS[dtype],
                "shape": list(shapes[key]),
                "data_offsets": [offset, offset + size],
            }
            self.offsets[key] = offset
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.written: set[str] = set()
        self._file: BinaryIO = path.open("wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self.data_start + offset)  # the full size now; unwritten bytes read as zeros

    def __enter__(self) -> _TensorFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def write_all(self, state: dict[str, torch.Tensor]) -> None:
        """The tensors of ``state`` the file holds and has not got yet, each at its place (little-endian
        bytes, as safetensors stores them); a tied LM head is not one of them."""
        for key, tensor in state.items():
            if key not in self.shapes or key in self.written:
                continue
            if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shapes[key]:
                raise DiffquantError(
                    f"{self.path}: tensor {key} is {tensor.dtype} {list(tensor.shape)}, expected "
                    f"{self.dtype} {list(self.shapes[key])}"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._file.seek(self.data_start + self.offsets[key])
            self._file.write(data)  # the buffer itself: no second copy of a large weight
            self.written.add(key)

    def check_complete(self) -> None:
        """Every tensor written: a stage that wrote nothing would otherwise leave zeros in the file."""
        missing = sorted(set(self.shapes) - self.written)
        if missing:
            raise DiffquantError(f"{self.path}: tensors never written: {', '.join(missing[:5])}")
