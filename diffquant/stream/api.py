"""The public face of the layer-streamed run: profile and evaluate a checkpoint that need not fit in memory,
with the same numbers as the whole-model :func:`~diffquant.profile.runner.profile_model` and
:func:`~diffquant.eval.perplexity.evaluate_stream` (same sites, sample indices, batches and arithmetic)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffquant.data.scoring import StreamScorer, gather_logprobs, keep_scored
from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.kernels.dispatch import path_summary
from diffquant.models.transformer import DecoderLM
from diffquant.options import DEFAULT_TOPK
from diffquant.profile.profiler import Profile, Profiler
from diffquant.profile.runner import shard_starts
from diffquant.quant.plan import QuantPlan
from diffquant.stream.executor import (
    DEFAULT_HIDDEN_BUDGET,
    NotStreamable,
    StreamedModel,
    available_bytes,
    open_streamed,
    prepare_whole_load,
    resolve_stream_spec,
    stream_load_bytes,
    weights_bytes,
    whole_load_bytes,
    would_stream,
)

STREAM_MODES = ("off", "on", "auto")


def _plan(plan: QuantPlan | str | Path | None) -> QuantPlan | None:
    return QuantPlan.load(plan) if isinstance(plan, (str, Path)) else plan


def _calibration_batches(
    plan: QuantPlan | None, calibration: torch.Tensor | None, default: torch.Tensor, batch_size: int
) -> list[torch.Tensor] | None:
    """The calibration windows cut in batches as :func:`~diffquant.quant.pipeline.calibrate` cuts them
    (None: the plan has no static scales)."""
    if plan is None or not plan.uses_static:
        return None
    windows = default if calibration is None else calibration
    if windows.dim() != 2:
        raise DiffquantError(f"calibration windows: expected shape (n, seq_len), got {tuple(windows.shape)}")
    return [windows[s : s + batch_size] for s in range(0, windows.shape[0], batch_size)]


def profile_streamed(
    spec: str | Path,
    windows: torch.Tensor,
    *,
    sites: str | Sequence[str] = "*",
    batch_size: int = 8,
    topk: int = DEFAULT_TOPK,
    attention: bool | None = None,
    plan: QuantPlan | str | Path | None = None,
    calibration: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
    stats: dict[str, Any] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> Profile:
    """The Profile :func:`~diffquant.profile.runner.profile_model` gives for ``load_model(spec)`` over
    ``windows`` (N, L), computed one layer at a time (batch i = windows [i*batch_size, (i+1)*batch_size),
    its rows at their global sample indices). ``plan``: a QuantPlan (or preset name / file) applied first;
    static scales are calibrated on ``calibration`` (default: ``windows``) stage by stage. ``stats`` (a
    dict) receives the run's memory numbers (largest stage's weight bytes, hidden-state bytes).

    ``shard`` (rank, world): profile only the batches i with i % world == rank, each at its global sample
    indices, as :func:`~diffquant.profile.runner.profile_model` shards under torchrun; the ranks' profiles
    merged (:func:`~diffquant.profile.runner.gather_profile`) are the one-process profile. Static scales
    are still calibrated on all the calibration windows on every rank, as the whole-model
    :func:`~diffquant.quant.pipeline.calibrate` is, so every rank quantizes with the one-process scales."""
    if windows.dim() != 2:
        raise DiffquantError(f"windows: expected shape (n, seq_len), got {tuple(windows.shape)}")
    if batch_size < 1:
        raise DiffquantError(f"batch_size: expected an integer >= 1, got {batch_size}")
    starts = shard_starts(windows.shape[0], batch_size, *shard)
    plan = _plan(plan)
    calib = _calibration_batches(plan, calibration, windows, batch_size)
    with open_streamed(spec, device, dtype, plan) as streamed:
        if windows.shape[1] > streamed.config.max_seq_len:
            raise DiffquantError(
                f"windows of {windows.shape[1]} tokens exceed the max_seq_len {streamed.config.max_seq_len} "
                f"of {spec}"
            )
        prof = Profiler(streamed.model, sites=sites, topk=topk, attention=attention)
        info: dict[str, Any] = dict.fromkeys(
            ("stages", "batches", "hidden_peak_bytes", "hidden_spilled", "peak_stage_bytes"), 0
        )
        with prof:
            if starts:  # a rank with no batch (more ranks than batches) reads no weights
                info = streamed.run(
                    [windows[s : s + batch_size] for s in starts],
                    profiler=prof,
                    sample_offsets=starts,
                    calibration=calib,
                    hidden_budget=hidden_budget,
                )
        _report(stats, info, streamed)
        return prof.take()


def _report(stats: dict[str, Any] | None, info: dict[str, Any], streamed: StreamedModel) -> None:
    """Fill the caller's ``stats`` dict: the run's memory numbers, bytes per stage, attention paths."""
    if stats is not None:
        stats.update(
            info, stage_bytes=dict(streamed.stage_bytes), attention_paths=path_summary(streamed.model)
        )


def evaluate_streamed(
    spec: str | Path,
    stream_or_windows: torch.Tensor,
    *,
    tokenizer: Tokenizer | None = None,
    seq_len: int | None = None,
    stride: int | None = None,
    windows: str | None = None,
    batch_size: int = 8,
    plan: QuantPlan | str | Path | None = None,
    calibration: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`~diffquant.eval.perplexity.evaluate_stream` of ``load_model(spec)``, one layer at a time:
    perplexity and bits per byte of a token stream (1-D), or of windows (N, L) scored as disjoint windows
    of L tokens. Same schedule, batches and tally (:class:`~diffquant.data.scoring.StreamScorer`); each
    batch's logits become target log-probabilities as they leave the LM head, a slice of positions at a time
    for a large vocabulary (as the whole model's scorer slices them), so no batch's logits are all held."""
    data = torch.as_tensor(stream_or_windows)
    if data.dim() == 2:
        if seq_len not in (None, data.shape[1]) or stride is not None or windows not in (None, "disjoint"):
            raise DiffquantError(
                "windows (N, L) are scored as disjoint windows of L tokens: pass a 1-D stream"
            )
        seq_len, windows, data = data.shape[1], "disjoint", data.flatten()
    plan = _plan(plan)
    with open_streamed(spec, device, dtype, plan) as streamed:
        scorer = StreamScorer(
            streamed.model,
            data,
            tokenizer=tokenizer,
            seq_len=seq_len,
            stride=stride,
            windows=windows,
            batch_size=batch_size,
        )
        default = scorer.batches[0][1] if calibration is None else calibration
        if calibration is None and plan is not None and plan.uses_static:
            default = torch.cat(
                [ids for _, ids in scorer.batches if ids.shape[1] == scorer.seq_len] or [default]
            )
        calib = _calibration_batches(plan, calibration, default, batch_size)

        parts: dict[int, list[torch.Tensor]] = {}

        def score(k: int, start: int, logits: torch.Tensor) -> None:
            # logits of positions start.. predict the tokens after them; the window's last position has none
            batch, ids = scorer.batches[k]
            end = min(start + logits.shape[1], ids.shape[1] - 1)
            piece = parts.setdefault(k, [])
            if end > start:
                piece.append(gather_logprobs(logits[:, : end - start], ids[:, start + 1 : end + 1]))
            if start + logits.shape[1] >= ids.shape[1]:
                scorer.add(batch, ids, torch.cat(parts.pop(k), dim=1))

        info = streamed.run(
            [ids for _, ids in scorer.batches],
            on_logit_slice=score,
            calibration=calib,
            hidden_budget=hidden_budget,
        )
        _report(stats, info, streamed)
    result = scorer.result()
    keep_scored(scorer)  # a sweep's per-window tally, as the whole-model evaluate_stream leaves it
    return result


def logits_streamed(
    spec: str | Path,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    plan: QuantPlan | str | Path | None = None,
    calibration: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
) -> torch.Tensor:
    """The logits (N, L, vocab) of ``windows`` (N, L), streamed (on the CPU; for small vocabularies and
    tests: the logits of all windows are held)."""
    plan = _plan(plan)
    calib = _calibration_batches(plan, calibration, windows, batch_size)
    out: dict[int, torch.Tensor] = {}
    with open_streamed(spec, device, dtype, plan) as streamed:
        batches = [windows[s : s + batch_size] for s in range(0, windows.shape[0], batch_size)]
        streamed.run(
            batches,
            on_logits=lambda k, logits: out.__setitem__(k, logits.cpu()),
            calibration=calib,
            hidden_budget=hidden_budget,
        )
    return torch.cat([out[k] for k in range(len(out))])


# ------------------------------------------------------------------------ --stream off / on / auto
def stream_mode(value: Any) -> str:
    """The ``stream`` option / recipe key as ``off``, ``on`` or ``auto`` (YAML's true / false: on / off)."""
    if value is True:
        return "on"
    if value is False or value is None:
        return "off"
    if value in STREAM_MODES:
        return str(value)
    raise DiffquantError(f"stream: expected one of off, on, auto (or true / false), got {value!r}")


def choose_stream(
    spec: str | Path, mode: Any, device: str | torch.device = "cpu", *, what: str = "--stream"
) -> bool:
    """Whether model ``spec`` runs layer-streamed under ``mode``: ``off`` never; ``on`` always (a specifier
    that cannot stream is a one-line DiffquantError saying why); ``auto`` when :func:`would_stream` says its
    whole load does not fit ``device`` (said in one line on stderr; a model that fits, or cannot stream, runs
    whole). A model to run whole whose load's peak (:func:`whole_load_bytes`: weights and temporaries), or a
    model to stream whose largest stage (:func:`stream_load_bytes`), exceeds the memory left
    (:func:`available_bytes`) is a one-line DiffquantError here, before anything is read."""
    mode = stream_mode(mode)
    if mode == "off":
        _check_fits(spec, device, what)
        return False
    if mode == "on":
        try:
            resolve_stream_spec(spec)
        except NotStreamable as err:
            raise DiffquantError(f"{what} on: {err}") from None
        _check_stream_fits(spec, device, f"{what} on")
        return True
    streams, size, reason = would_stream(spec, device)
    if streams:
        _check_stream_fits(spec, device, f"{what} auto")
        print(f"diffquant: {spec}: {reason} ({what} auto)", file=sys.stderr)
    else:
        _check_fits(spec, device, what, size)
    return streams


def _check_stream_fits(spec: str | Path, device: str | torch.device, what: str) -> None:
    """Refuse, in one line, a streamed run whose peak (:func:`stream_load_bytes`: the largest stage with its
    read temporaries, and room for a learned tokenizer) exceeds the memory this process can still use
    (:func:`available_bytes`), as :func:`_check_fits` refuses a whole load: under ``ulimit -v`` the run
    would otherwise end in an allocation failure deep inside it, or in an abort of a native library (the
    Rust tokenizer's) with no message at all."""
    need, stage = stream_load_bytes(spec, device)
    room = available_bytes(device)
    if need > room:
        raise DiffquantError(
            f"{spec}: a streamed run ({what}) needs {need / 2**30:.2f} GiB at once (stage {stage}: its "
            f"weights with their read temporaries, and the tokenizer's) but this process can use "
            f"{room / 2**30:.2f} GiB on {torch.device(device)}; use a machine or device with more memory"
        )


def _check_fits(spec: str | Path, device: str | torch.device, what: str, weights: int | None = None) -> None:
    """Refuse, in one line, a whole-model load whose peak (:func:`whole_load_bytes`: the weights plus the
    load's temporaries) exceeds the memory this process can still use (:func:`available_bytes`: free
    memory, address-space limit, memory cgroup, measured once the one-time cost of building a model is
    paid): under ``ulimit -v`` the load would otherwise die in an allocator abort, under a container's limit
    in the kernel's OOM kill, with no message at all. ``weights``: the weights' in-memory bytes when the
    caller has them already."""
    weights = weights_bytes(spec, in_memory=True) if weights is None else weights
    size = whole_load_bytes(spec, device, weights=weights)
    prepare_whole_load(spec)
    room = available_bytes(device)
    if size > room:
        hint = f"run it with {what} on" if _streamable(spec) else "use a machine or device with more memory"
        raise DiffquantError(
            f"{spec}: weights {weights / 2**30:.2f} GiB (a whole load {size / 2**30:.2f} GiB with its "
            f"temporaries) do not fit the {room / 2**30:.2f} GiB this process can use on "
            f"{torch.device(device)}; {hint}"
        )


def _streamable(spec: str | Path) -> bool:
    try:
        resolve_stream_spec(spec)
    except NotStreamable:
        return False
    return True


def stream_skeleton(spec: str | Path, tokenizer: str | Path | None = None) -> DecoderLM:
    """A streamable checkpoint as a meta-device :class:`DecoderLM` (config, taps, tokenizer, no weights):
    what a run checks before it streams (tokenizer fit, site patterns, window lengths), and what ``info``
    describes. Opened as a streamed run opens it, so every shard and tensor header is checked (missing,
    unexpected, wrong shape, truncated: one line, as a whole-model load would say) before anything is
    written. ``tokenizer`` overrides the checkpoint's, as :func:`~diffquant.io.load_model` does. Marked
    ``model.streamed = spec``."""
    with open_streamed(spec) as streamed:
        model = streamed.model
    if tokenizer is not None:
        model.tokenizer = model_tokenizer(model, str(spec), override=tokenizer)
    model.streamed = str(spec)
    return model
