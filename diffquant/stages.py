"""The stages a run is made of, each one dataclass shared by recipes and the command line.

A stage's dataclass is at once a recipe section's schema (checked by :func:`diffquant.schema.check`) and
the options of its command (:func:`diffquant.schema.add_options`), so an option is written once: its type,
default, bounds and help. The dataclasses live in :mod:`diffquant.options` (torch-free, so ``--help`` is
instant) and are re-exported here. The code that runs a stage is here, and ``diffquant profile`` / ``eval`` run
the same functions as a recipe's ``profile`` / ``eval`` + ``sweep`` stages. Errors name what the user
wrote: a recipe key (``profile.seq_len``) or a flag (``--seq-len``), through the stage's ``name`` function.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffquant.eval.sweep import SweepSpec
from diffquant.eval.tasks import TaskSpec
from diffquant.io import load_model
from diffquant.io.options import RunOptions, run_options
from diffquant.io.quantize import quantize_checkpoint
from diffquant.options import (  # noqa: F401 (the stage dataclasses live torch-free there; public here too)
    CALIB_FLAGS,
    DATA_HELP,
    MAX_TOPK,
    QUANTIZE_CALIB_FLAGS,
    CalibData,
    DataSection,
    EvalStage,
    ModelOptions,
    Namer,
    OutputSection,
    PlotsStage,
    ProfileStage,
    QuantizeStage,
    Recipe,
    SweepStage,
    flag_name,
)
from diffquant.profile.runner import profile_stage
from diffquant.schema import require_plain_name
from diffquant.stream import choose_stream, profile_streamed, quantize_streamed, stream_mode, stream_skeleton
from diffquant.stream.placement import load_placed, placement_options


def parse_run_options(env: Mapping[str, Any], name: Namer = flag_name) -> RunOptions:
    """Checked ModelOptions (a command's options or a recipe, as a mapping) as one :class:`RunOptions`,
    parsed once, where the command or the recipe starts: the device map first (checked against ``device`` /
    ``stream``: :func:`diffquant.stream.placement.placement_options`), then the device and dtype
    (:func:`diffquant.io.options.run_options`) and the stream mode. Everything below receives the result."""
    placement = placement_options(env, name)  # --device-map: checked against --device / --stream first
    return run_options(
        env.get("device"),
        env.get("dtype"),
        stream=stream_mode(env.get("stream", "off")),
        placement=placement,
    )


def load_models(
    specs: dict[str, str],
    options: RunOptions | Mapping[str, Any],
    tokenizers: dict[str, str] | None = None,
    *,
    name: Namer = flag_name,
) -> dict[str, tuple[str, Any]]:
    """Each model by name as (spec, model) on ``options.device`` in ``options.dtype`` (a :class:`RunOptions`;
    checked ModelOptions as a mapping are parsed here, once), with its tokenizer override; a model
    ``options.stream`` streams (:func:`diffquant.stream.choose_stream`) is a weightless skeleton
    (:func:`diffquant.stream.stream_skeleton`) that :func:`run_profile` streams; with a device map
    (``options.placement``) each model is spread over devices (:func:`diffquant.stream.placement.load_placed`)."""
    tokenizers = tokenizers or {}
    for model_name in specs:  # each names files in the run folder (profile/NAME.json): never a path
        require_plain_name(model_name, "", "model name")
    if not isinstance(options, RunOptions):
        options = parse_run_options(options, name)
    placement, device, dtype = options.placement, options.device, options.dtype
    models: dict[str, tuple[str, Any]] = {}
    for model_name, spec in specs.items():
        if placement is not None:
            model = load_placed(spec, placement, dtype=dtype, tokenizer=tokenizers.get(model_name))
            models[model_name] = (spec, model)
        elif choose_stream(spec, options.stream, device, what=name("stream")):
            models[model_name] = (spec, stream_skeleton(spec, tokenizers.get(model_name)))
        else:
            models[model_name] = (
                spec,
                load_model(spec, device=device, dtype=dtype, tokenizer=tokenizers.get(model_name)),
            )
    return models


def run_profile(
    models: dict[str, tuple[str, Any]],
    cfg: dict[str, Any],
    out: Path,
    *,
    progress: bool,
    name: Namer = flag_name,
    options: RunOptions | None = None,
) -> tuple[str, str, int]:
    """The profile stage (a checked :class:`ProfileStage` as a dict) into ``out``: profile/NAME.json and
    table5.{txt,json}; returns (header, table, tokens) on rank 0 (see :func:`profile_stage`). Models that
    :func:`load_models` left as skeletons are profiled layer-streamed on ``options.device`` in
    ``options.dtype`` (default: the cpu, the checkpoint's dtype; under torchrun each rank streams its own
    batches): the same profile, without attention maps."""
    options = options or RunOptions()
    attention = None if cfg["attention_metrics"] else False
    streamed = {}
    for model_name, (spec, model) in models.items():
        if getattr(model, "streamed", None) is None:
            continue

        def profile(windows, shard, spec=spec):
            # this rank's batches (under torchrun); profile_stage merges the ranks' profiles on rank 0
            stats: dict[str, Any] = {}
            prof = profile_streamed(
                spec,
                windows,
                sites=cfg["sites"],
                batch_size=cfg["batch_size"],
                topk=cfg["topk"],
                attention=attention,
                device=options.device,
                dtype=options.dtype,
                stats=stats,
                shard=shard,
            )
            return prof, stats["attention_paths"]

        streamed[model_name] = profile
    return profile_stage(
        models,
        data=cfg["data"],
        tokens=cfg["tokens"],
        seq_len=cfg["seq_len"],
        batch_size=cfg["batch_size"],
        sites=cfg["sites"],
        topk=cfg["topk"],
        attention=attention,
        out=out,
        progress=progress,
        key_name=name,
        streamed=streamed,
        sink_rate=cfg["sink_rate"],
    )


def sweep_spec(
    models: dict[str, str],
    plans: list[str],
    tasks: list[TaskSpec],
    calib: dict[str, Any],
    batch_size: int,
    env: dict[str, Any],
    tokenizers: dict[str, str],
    options: RunOptions | None = None,
) -> SweepSpec:
    """The eval / sweep stage as a :class:`SweepSpec` (a checked :class:`CalibData` and ModelOptions:
    ``env``'s device and dtype as written, what the sweep's identity records, and ``options``, the same
    options parsed: :func:`parse_run_options` of ``env`` when not given)."""
    options = options or parse_run_options(env)
    return SweepSpec(
        models=dict(models),
        plans=list(plans),
        tasks=list(tasks),
        calib_data=calib["source"],
        calib_tokens=calib["tokens"],
        calib_seq_len=calib["seq_len"],
        batch_size=batch_size,
        device=env["device"],
        dtype=env["dtype"],
        tokenizers=tokenizers,
        stream=env.get("stream", "off"),
        placement=options.placement,
        options=options,
    )


def run_quantize(
    checkpoint: str,
    plan: str,
    calib: dict[str, Any],
    cfg: dict[str, Any],
    out: str | Path,
    options: RunOptions,
    *,
    force: bool,
    tokenizer: str | None,
    name: Namer = flag_name,
) -> dict[str, Any]:
    """The quantize stage for one model and plan (a checked :class:`CalibData` and :class:`QuantizeStage`
    as dicts, and the parsed :class:`RunOptions`' device / dtype / stream): the quantized checkpoint in
    ``out``; returns its summary. A model ``options.stream`` streams (:func:`diffquant.stream.choose_stream`)
    is calibrated, compared and written one layer at a time (:func:`diffquant.stream.quantize_streamed`: the
    same checkpoint and report). ``diffquant quantize`` and a recipe's ``quantize`` stage run it."""
    streamed = choose_stream(checkpoint, options.stream, options.device, what=name("stream"))
    return (quantize_streamed if streamed else quantize_checkpoint)(
        checkpoint,
        plan,
        calib_data=calib["source"],
        calib_tokens=calib["tokens"],
        eval_tokens=cfg["eval_tokens"],
        seq_len=calib["seq_len"],
        batch_size=cfg["batch_size"],
        out=out,
        force=force,
        device=options.device,
        dtype=options.dtype,
        tokenizer=tokenizer,
    )
