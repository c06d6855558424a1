"""The stages a run is made of, each one dataclass shared by recipes and the command line.

A stage's dataclass is at once a recipe section's schema (checked by :func:`diffquant.schema.check`) and
the options of its command (:func:`diffquant.schema.add_options`), so an option is written once: its type,
default, bounds and help. The code that runs a stage is here too, and ``diffquant profile`` / ``eval`` run
the same functions as a recipe's ``profile`` / ``eval`` + ``sweep`` stages. Errors name what the user
wrote: a recipe key (``profile.seq_len``) or a flag (``--seq-len``), through the stage's ``name`` function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffquant.eval.sweep import SweepSpec
from diffquant.eval.tasks import TaskSpec
from diffquant.io import load_model
from diffquant.io.options import ModelOptions, parse_device, parse_dtype
from diffquant.io.quantize import quantize_checkpoint
from diffquant.profile.profiler import MAX_TOPK
from diffquant.profile.runner import profile_stage
from diffquant.schema import key
from diffquant.stream import choose_stream, profile_streamed, quantize_streamed, stream_skeleton
from diffquant.stream.placement import load_placed, placement_options

DATA_HELP = "wikitext2:test, wikitext2:validation, stdlib[:train|:validation], a text file or a folder"
Namer = Callable[[str], str]


def flag_name(field_name: str) -> str:
    """How the command line names a stage field: ``seq_len`` -> ``--seq-len``."""
    return "--" + field_name.replace("_", "-")


@dataclass
class CalibData:
    """Calibration text for static scales (recipe ``data.calib``; ``--calib-data`` / ``--calib-tokens``)."""

    source: str | None = key(
        None,
        help="calibration text (default: wikitext2:validation when a model has its own tokenizer, else "
        "stdlib:train)",
    )
    tokens: int = key(4096, min=1, help="calibration tokens (default: 4096)")
    seq_len: int = key(256, min=2, help="calibration window length (default: 256)")


CALIB_FLAGS = {"source": "--calib-data", "tokens": "--calib-tokens", "seq_len": "--calib-seq-len"}
QUANTIZE_CALIB_FLAGS = {**CALIB_FLAGS, "seq_len": "--seq-len"}  # one window length: calibration and report


@dataclass
class DataSection:
    calib: CalibData = field(default_factory=CalibData)


@dataclass
class ProfileStage:
    """Outlier statistics of every model on the same text (recipe ``profile``; ``diffquant profile``)."""

    enabled: bool = key(True, cli=False)
    data: str | None = key(
        None,
        help=f"{DATA_HELP} (default: wikitext2:test when a model has its own tokenizer, else stdlib:validation)",
    )
    tokens: int = key(16384, min=1, help="tokens to profile (default: 16384)")
    seq_len: int = key(256, min=1, help="window length (default: 256)")
    batch_size: int = key(8, min=1, help="windows per forward pass (default: 8)")
    sites: list[str] | str = key(["*"], help="site globs or kind:NAME (default: all)")
    topk: int = key(
        100,
        min=1,
        max=MAX_TOPK,
        help=f"largest magnitudes kept per site, with locations (at most {MAX_TOPK})",
    )
    attention_metrics: bool = key(True, help="skip per-head attention metrics")


@dataclass
class QuantizeStage:
    """Quantized checkpoints (recipe ``quantize``; ``diffquant quantize`` writes one)."""

    plans: list[str] = key([], each="a preset name or a plan file path", cli=False)
    eval_tokens: int = key(2048, min=1, help="held-out tokens for the error report")
    batch_size: int = key(8, min=1, help="windows per forward pass (default: 8)")


@dataclass
class EvalStage:
    """Tasks (recipe ``eval``; ``diffquant eval --task``)."""

    tasks: list[Any] = key([{"type": "bpb"}], cli=False)
    batch_size: int = key(8, min=1, help="windows per forward pass (default: 8)")


@dataclass
class SweepStage:
    """Plans every model is evaluated under (recipe ``sweep``; ``diffquant eval --plan``)."""

    plans: list[str] = key([], each="a preset name or a plan file path", cli=False)


@dataclass
class PlotsStage:
    enabled: bool = key(True)
    formats: list[str] = key(["png"])
    dpi: int = key(150, min=1)


@dataclass
class OutputSection:
    dir: str | None = key(None)


@dataclass(kw_only=True)
class Recipe(ModelOptions):
    """A recipe file: its keys, their defaults, and the stages it chains."""

    name: str = key()
    description: str = key("")
    seed: int = key(0, min=0)
    models: dict[str, str] = key(each="a model specifier string")
    data: DataSection = field(default_factory=DataSection)
    profile: ProfileStage = field(default_factory=ProfileStage)
    quantize: QuantizeStage = field(default_factory=QuantizeStage)
    eval: EvalStage = field(default_factory=EvalStage)
    sweep: SweepStage = field(default_factory=SweepStage)
    plots: PlotsStage = field(default_factory=PlotsStage)
    output: OutputSection = field(default_factory=OutputSection)


def load_models(
    specs: dict[str, str],
    env: dict[str, Any],
    tokenizers: dict[str, str] | None = None,
    *,
    name: Namer = flag_name,
) -> dict[str, tuple[str, Any]]:
    """Each model by name as (spec, model) on ``env['device']`` in ``env['dtype']`` (checked ModelOptions),
    with its tokenizer override; a model ``env['stream']`` streams (:func:`diffquant.stream.choose_stream`)
    is a weightless skeleton (:func:`diffquant.stream.stream_skeleton`) that :func:`run_profile` streams;
    with ``env['device_map']`` each model is spread over devices (:func:`diffquant.stream.placement.load_placed`)."""
    tokenizers = tokenizers or {}
    placement = placement_options(env, name)  # --device-map: checked against --device / --stream first
    device, dtype = parse_device(env["device"]), parse_dtype(env["dtype"])
    mode = env.get("stream", "off")
    models: dict[str, tuple[str, Any]] = {}
    for model_name, spec in specs.items():
        if placement is not None:
            model = load_placed(spec, placement, dtype=dtype, tokenizer=tokenizers.get(model_name))
            models[model_name] = (spec, model)
        elif choose_stream(spec, mode, device, what=name("stream")):
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
    env: dict[str, Any] | None = None,
) -> tuple[str, str, int]:
    """The profile stage (a checked :class:`ProfileStage` as a dict) into ``out``: profile/NAME.json and
    table5.{txt,json}; returns (header, table, tokens) on rank 0 (see :func:`profile_stage`). Models that
    :func:`load_models` left as skeletons are profiled layer-streamed on ``env['device']`` in
    ``env['dtype']`` (under torchrun each rank streams its own batches): the same profile, without
    attention maps."""
    env = env or {}
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
                device=parse_device(env.get("device")),
                dtype=parse_dtype(env.get("dtype")),
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
    )


def sweep_spec(
    models: dict[str, str],
    plans: list[str],
    tasks: list[TaskSpec],
    calib: dict[str, Any],
    batch_size: int,
    env: dict[str, Any],
    tokenizers: dict[str, str],
) -> SweepSpec:
    """The eval / sweep stage as a :class:`SweepSpec` (a checked :class:`CalibData` and ModelOptions)."""
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
        placement=placement_options(env),
    )


def run_quantize(
    checkpoint: str,
    plan: str,
    calib: dict[str, Any],
    cfg: dict[str, Any],
    out: str | Path,
    env: dict[str, Any],
    *,
    force: bool,
    tokenizer: str | None,
    name: Namer = flag_name,
) -> dict[str, Any]:
    """The quantize stage for one model and plan (a checked :class:`CalibData` and :class:`QuantizeStage`
    as dicts, and ModelOptions' device / dtype / stream): the quantized checkpoint in ``out``; returns its
    summary. A model ``env['stream']`` streams (:func:`diffquant.stream.choose_stream`) is calibrated,
    compared and written one layer at a time (:func:`diffquant.stream.quantize_streamed`: the same
    checkpoint and report). ``diffquant quantize`` and a recipe's ``quantize`` stage run it."""
    streamed = choose_stream(
        checkpoint, env.get("stream", "off"), parse_device(env["device"]), what=name("stream")
    )
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
        device=env["device"],
        dtype=env["dtype"],
        tokenizer=tokenizer,
    )
