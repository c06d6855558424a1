"""The options users write, as schema dataclasses: a recipe's sections and the stages' command-line flags.

Torch-free on purpose: ``diffquant --help`` builds its parser from these classes
(:func:`diffquant.schema.add_options`) and must stay instant, so the code that runs a stage lives in
:mod:`diffquant.stages` (which re-exports everything here) and the device / dtype parsers in
:mod:`diffquant.io.options` (which re-exports :class:`ModelOptions`). A stage's dataclass is at once a recipe
section's schema (checked by :func:`diffquant.schema.check`) and the options of its command, so an option is
written once: its type, default, bounds and help.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from diffquant.names import DTYPE_NAMES
from diffquant.schema import key, plain_name

# The most top magnitudes a site may keep (``topk``). Each kept value is a Python record with its
# location, sorted into the site's list on every update and written to the profile JSON, so the cost grows
# with topk x sites, not with the data: 10,000 already makes a 2-layer model's profile ~100 MB and ~4x
# slower than the default 100 (Table 5 reads top-1 .. top-100). Far beyond it (``--topk 1e8``) every
# activation becomes a record and a run never ends; the histogram's quantiles describe the rest.
# (Here, not in diffquant.profile.profiler, which re-exports it: the --topk option's bound, read by --help.)
MAX_TOPK = 10_000
# The default topk: the profile stage's option, the Profiler's and profile_model's / profile_streamed's
# argument (written once: Table 5 reads top-1 .. top-100).
DEFAULT_TOPK = 100


@dataclass(kw_only=True)
class ModelOptions:
    """Where and how models run, and which tokenizer they read: the recipe keys ``device`` / ``dtype`` /
    ``tokenizer`` / ``stream`` / ``device_map`` / ``max_memory`` and the command-line options ``--device`` /
    ``--dtype`` / ``--tokenizer`` / ``--stream`` / ``--device-map`` / ``--max-memory`` (one place each). A
    recipe's ``tokenizer`` is a path for all models or ``{model: path}``; ``stream`` (``diffquant profile`` /
    ``quantize`` / ``eval`` and a recipe's profile / quantize / eval stages) runs models layer-streamed (:mod:`diffquant.stream`);
    ``device_map`` spreads each model over several devices (:mod:`diffquant.stream.placement`), checked
    with the other options by :func:`~diffquant.stream.placement.placement_options`."""

    device: str = key("cpu", help="cpu, cuda or cuda:N (default: cpu)")
    dtype: str | None = key(None, choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    tokenizer: str | dict[str, str] | None = key(
        None,
        metavar="PATH",
        help="'byte', a tokenizer.json or its folder; overrides the model's own tokenizer (default: the model's own)",
    )
    stream: Literal["off", "on", "auto"] | bool = key(
        "off",
        help="run models one decoder layer at a time from their files (native, hf:, gguf:; larger than memory, "
        "same numbers): on, off, or auto (stream only models whose weights do not fit; said on stderr) "
        "(default: off; in a recipe also true / false)",
    )
    device_map: str | dict[str, str | int] | None = key(
        None,
        metavar="MAP",
        help="spread each model over devices through accelerate (hf: and native safetensors checkpoints): "
        "auto, balanced or sequential (fill the GPUs, then cpu, then disk), or a YAML / JSON mapping (or "
        "file) of modules to devices, e.g. '{embed: 0, layers.0: 0, layers.1: 1, norm: 1, lm_head: 1}' "
        "(modules: embed, layers, layers.N, norm, lm_head, '' for the rest; devices: cpu, disk, cuda:N or N); "
        "not with --stream, --device stays cpu (default: one device, --device)",
    )
    max_memory: str | dict[str, str | int] | None = key(
        None,
        metavar="LIMITS",
        help="with --device-map auto / balanced / sequential: the memory each device may hold, accelerate's "
        "format, e.g. 0=20GiB,1=20GiB,cpu=60GiB (default: what is free)",
    )


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
    sites: list[str] | str = key(
        ["*"],
        help="sites to profile: shell-style globs over site names such as layers.3.attn.logits1 (* any "
        "characters, ? one, [abc] one of them: layers.3.* is layer 3, layers.*.resid every residual "
        "stream) or kind:NAME (kind:logits); `diffquant info MODEL` counts them (default: all)",
    )
    topk: int = key(
        DEFAULT_TOPK,
        min=1,
        max=MAX_TOPK,
        help=f"largest magnitudes kept per site, with locations (default: {DEFAULT_TOPK}; at most {MAX_TOPK})",
    )
    attention_metrics: bool = key(True, help="skip per-head attention metrics (default: computed)")
    sink_rate: bool = key(
        False,
        help="also run Gu et al.'s attention-sink probe (100 windows of 64 tokens; whole models, not streamed)",
    )


@dataclass
class QuantizeStage:
    """Quantized checkpoints (recipe ``quantize``; ``diffquant quantize`` writes one)."""

    plans: list[str] = key([], each="a preset name or a plan file path", cli=False)
    eval_tokens: int = key(2048, min=1, help="held-out tokens for the error report (default: 2048)")
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

    # the run's default folder (runs/NAME), and models' / seed groups' names (keys of `models` / `seeds`)
    # name files in it: plain names all (diffquant.names.is_plain_name; recipes.validate checks the keys)
    name: str = key(check=plain_name)
    description: str = key("")
    seed: int = key(0, min=0)
    models: dict[str, str] = key(each="a model specifier string")
    # seed groups ({group: [model names]}; without it, models NAME and NAME-sK group as NAME): Table 5 and
    # the sweep then also report mean +- spread over each group's seeds (diffquant/report/seeds.py)
    seeds: dict[str, list[str]] = key({}, each="a list of the recipe's model names")
    data: DataSection = field(default_factory=DataSection)
    profile: ProfileStage = field(default_factory=ProfileStage)
    quantize: QuantizeStage = field(default_factory=QuantizeStage)
    eval: EvalStage = field(default_factory=EvalStage)
    sweep: SweepStage = field(default_factory=SweepStage)
    plots: PlotsStage = field(default_factory=PlotsStage)
    output: OutputSection = field(default_factory=OutputSection)
