"""The weight transform of a plan (``weights:``): Linear weights replaced by integer codes chosen by a
registered weight method (:mod:`~diffquant.quant.methods`: round-to-nearest, GPTQ, HQQ, AWQ), on one grid
(:mod:`~diffquant.quant.weightcodes`).

::

    weights: {method: gptq, format: int4, group: 128, sym: true, act_order: false, damp: 0.01,
              lazy_batch: 128}

The grid is GPTQ's (:mod:`~diffquant.quant.weightcodes`): ``format: int4`` means 2^4 = 16 codes, symmetric
levels ``-8 .. 7`` times the scale, not the 15-level ``int4`` codebook (``-7 .. 7``) of the rule schemes.
Every key, and the old spellings (``bits``, ``group_size``, ``block``), are in docs/plans.md.

- ``rtn``: each value rounded alone (the baseline every paper's tables start from);
- ``hqq`` (Badri & Shaji 2023, :mod:`~diffquant.quant.hqq`): data-free, the zero points optimised against an
  lp-norm of the error (asymmetric: ``sym`` false);
- ``gptq`` (Frantar et al. 2022, :mod:`~diffquant.quant.gptq`): the codes chosen against the layer's
  calibration inputs. Sequential, as GPTQ's and llm-compressor's pipelines are: decoder layer l's Hessians
  come from the inputs the already-quantized layers 0..l-1 produce, with the activations in float (the
  activation quantizers of the plan are off while weights are chosen: QuaRot runs GPTQ before its
  activation quantizers are set, likewise). Within a layer every Linear sees the float layer (GPTQ's
  default; llm-compressor's sequential pipeline does the same). :func:`weight_stage` is the one step
  both the whole-model pass and the streamed run (one layer resident) take, so both give the same codes.
- ``awq`` (Lin et al. 2024, :mod:`~diffquant.quant.awq`): per-input-channel scales searched on calibration
  data for each norm's readers, folded into the norm, then round-to-nearest codes.

Where this runs in a plan's order is :data:`diffquant.quant.pipeline.SECTIONS`'s business, not this module's.
A quantized checkpoint stores the codes, scales and zero points (``quant_state.safetensors``) and records
``weights`` in ``plan.json``'s ``transforms``, so a reload serves the stored codes without recomputing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear
from diffquant.progress import is_quiet, progress, write
from diffquant.quant import awq, gptq, hqq, weightcodes  # noqa: F401  (each registers its method)
from diffquant.quant.methods import REGISTRY, WeightMethod, WeightStats, weight_method
from diffquant.quant.modules import taps_detached, weight_quantizers_detached
from diffquant.quant.select import pattern_list
from diffquant.quant.weightcodes import QuantizedWeight, WeightGrid
from diffquant.schema import key

_BOOL = "a boolean (YAML true or false)"


def unused_option(method: str, given: Iterable[str]) -> str | None:
    """The message for the first option in ``given`` (the keys a plan's ``weights`` section sets) that
    ``method`` does not read, naming the methods that do; None when every option is read. One rule for all
    methods: an option the chosen method does not read is refused, never silently ignored (``{method: rtn,
    damp: 0.5}`` ran plain rtn)."""
    reads = REGISTRY[method].reads if method in REGISTRY else ()
    for name in given:
        if name in reads:
            continue
        readers = [m for m, entry in REGISTRY.items() if name in entry.reads]
        if not readers:
            continue  # not an option at all: the schema names the allowed keys
        return (
            f"weights.{name}: {'an' if readers[0][0] in 'aeiou' else 'a'} {' / '.join(readers)} option, which method {method} does not read; remove it "
            f"(or method: {readers[0]})"
        )
    return None


def _group(value: Any) -> str | None:
    ok = value == "channel" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    return None if ok else "an integer >= 1 (input channels per scale) or 'channel'"


def _damp(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    return None if ok else "a number in (0, 1] (a fraction of the Hessian's mean diagonal)"


def _sym(value: Any) -> str | None:
    return None if value is None or isinstance(value, bool) else _BOOL + " or null (the method's default)"


WeightFormat = Literal["int2", "int3", "int4", "int5", "int6", "int7", "int8"]


@dataclass
class WeightsSpec:
    """A plan's ``weights`` section (checked by :func:`diffquant.schema.check`). ``sym`` null: the method's
    convention (true for rtn and gptq, false for hqq, which optimises the zero point). ``bits`` and
    ``group_size`` are read-only views of ``format`` and ``group`` for the code that computes."""

    RENAMED: ClassVar[dict[str, str]] = {"bits": "format", "group_size": "group", "block": "lazy_batch"}

    method: str = key(what="a string")
    format: WeightFormat = key("int4")  # on GPTQ's grid: 2^b codes (weightcodes)
    group: int | str = key(128, check=_group)  # input channels per scale, or "channel"
    sym: bool | None = key(None, check=_sym)
    act_order: bool = key(False, what=_BOOL)  # gptq: columns by descending Hessian diagonal, static groups
    damp: float = key(0.01, check=_damp)  # gptq: Hessian damping, a fraction of its mean diagonal
    lazy_batch: int = key(128, min=1)  # gptq: columns per lazy batch update (the paper's B)
    alpha_grid: int = key(20, min=2, max=1000)  # awq: points of the alpha grid 0, 1/n, .., (n-1)/n
    modules: list[str] = key(["layers.*"], check=pattern_list)
    exclude: list[str] = key([], check=pattern_list)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            self.modules = [self.modules]
        if isinstance(self.exclude, str):
            self.exclude = [self.exclude]
        entry = weight_method(self.method)
        if self.sym is None:
            self.sym = entry.default_sym
        if self.sym not in entry.sym_allowed:
            allowed = " or ".join(str(v).lower() for v in entry.sym_allowed)
            raise DiffquantError(f"weights.sym: {entry.sym_note or f'{self.method} takes sym {allowed}'}")
        # built in Python, a field set away from its default is a given option (a plan's section also names
        # the keys it sets: diffquant.quant.plan applies the same rule to them)
        changed = [
            f.name for f in fields(self) if f.default is not MISSING and getattr(self, f.name) != f.default
        ]
        problem = unused_option(self.method, changed)
        if problem is not None:
            raise DiffquantError(problem)

    @property
    def bits(self) -> int:
        """Bits per code (``format`` int4: 4)."""
        return int(self.format.removeprefix("int"))

    @property
    def group_size(self) -> int | str:
        """``group``: input channels per scale, or ``channel``."""
        return self.group

    @property
    def grid(self) -> WeightGrid:
        size = None if self.group_size == "channel" else int(self.group_size)
        return WeightGrid(int(self.bits), size, bool(self.sym))

    @property
    def entry(self) -> WeightMethod:
        """The registered method (:mod:`~diffquant.quant.methods`)."""
        return weight_method(self.method)

    @property
    def needs_data(self) -> bool:
        return self.entry.needs_data

    def label(self) -> str:
        """``rtn int4 g32 sym (GPTQ grid, levels -8..7)``: the grid said, since the rule schemes' ``int4`` is
        another one (levels -7..7; docs/plans.md)."""
        size = "channel" if self.group == "channel" else f"g{self.group}"
        extra = " act-order" if self.act_order else ""
        half = 2 ** (self.bits - 1)
        grid = f"levels -{half}..{half - 1}" if self.sym else f"codes 0..{2 * half - 1} - zero"
        return (
            f"{self.method} {self.format} {size} {'sym' if self.sym else 'asym'}{extra} (GPTQ grid, {grid})"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "format": self.format,
            "group": self.group,
            "sym": self.sym,
            "modules": list(self.modules),
        }
        if self.exclude:
            out["exclude"] = list(self.exclude)
        for name in self.entry.options:
            out[name] = getattr(self, name)
        return out


# ------------------------------------------------------------------------------------------- attach
def attach_weights(
    spec: WeightsSpec, linears: dict[str, Linear], *, fill: bool = True
) -> list[tuple[str, str, str]]:
    """A :class:`QuantizedWeight` on each chosen Linear (every shape checked first, so a group size that
    does not divide a Linear is refused before any is touched); the data-free methods' codes computed now
    when ``fill`` (and the weights are real, not a streamed skeleton's). Returns (target, name, label)."""
    grid = spec.grid
    for name, linear in linears.items():
        grid.check(tuple(linear.weight.shape), f"weights: {name}")
    applied = []
    for name, linear in linears.items():
        linear.weight_quantizer = QuantizedWeight(name, spec, tuple(linear.weight.shape))
        applied.append(("weight", name, spec.label()))
    if fill and not spec.needs_data:
        fill_data_free(list(linears.values()), show=True)
    return applied


def weight_modules(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Every QuantizedWeight of ``model`` by its module name (``layers.0.attn.q.weight_quantizer``)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}


def _owners(modules: nn.Module | Sequence[nn.Module]) -> list[tuple[Linear, QuantizedWeight]]:
    """(Linear, its QuantizedWeight) under ``modules`` (a model, a stage's modules, or Linears)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    return [
        (m, m.weight_quantizer)
        for root in roots
        for m in root.modules()
        if isinstance(m, Linear) and isinstance(m.weight_quantizer, QuantizedWeight)
    ]


def fill_data_free(modules: nn.Module | Sequence[nn.Module], show: bool = False) -> None:
    """Codes for the data-free weights (rtn, hqq) under ``modules`` (Linears or their parents) not filled
    yet (a streamed skeleton's weights still on the meta device wait until their stage is read); ``show``:
    progress over the Linears (hqq on a 1.7B model takes minutes)."""
    pending = [
        (linear, q)
        for linear, q in _owners(modules)
        if not (q.filled or q.spec.needs_data or linear.weight.device.type == "meta")
    ]
    if not pending:
        return
    desc = f"{pending[0][1].spec.method} weights"
    for linear, q in progress(pending, desc, "linear", leave=False, enabled=show, announce=True):
        q.set_codes(q.spec.entry.codes(linear.weight, q.spec, q.site))


GptqStats = WeightStats  # the name the GPTQ benchmarks and the streamed run read


@torch.no_grad()
def weight_stage(
    modules: Sequence[nn.Module],
    fn: Callable[[torch.Tensor], torch.Tensor],
    count: int,
    get: Callable[[int], torch.Tensor],
    put: Callable[[int, torch.Tensor], None] | None,
    stats: WeightStats | None = None,
) -> None:
    """One stage of the data-driven weight methods (GPTQ, AWQ), sequential as GPTQ's and llm-compressor's
    pipelines are: the ``count`` input batches (``get(k)``) through ``fn`` with the stage's pending weights in
    float, each method's collector (:class:`~diffquant.quant.methods.StageCollector`) hooked on the stage's
    modules; then each collector sets its codes; then the batches through again with the new codes, each
    output handed to ``put(k, y)`` (the next stage's input). The whole-model calibration and the streamed run
    both take this step per stage, so both give the same codes. The caller has the activation quantizers
    detached (:func:`~diffquant.quant.modules.taps_detached`)."""
    pairs = [(lin, q) for lin, q in _owners(modules) if q.spec.needs_data and not q.filled]
    if pairs:
        by_method: dict[str, list[tuple[Linear, QuantizedWeight]]] = {}
        for linear, q in pairs:
            by_method.setdefault(q.method, []).append((linear, q))
        collectors = [weight_method(m).collector(chosen, modules) for m, chosen in by_method.items()]
        handles = []
        try:
            for collector in collectors:
                handles += collector.attach()
            with weight_quantizers_detached(lin for lin, _ in pairs):
                for k in range(count):
                    fn(get(k))
        finally:
            for handle in handles:
                handle.remove()
        for collector in collectors:
            collector.finish(stats if stats is not None else WeightStats())
        del collectors
    if put is not None:
        for k in range(count):
            put(k, fn(get(k)))


def model_stages(model: nn.Module) -> list[tuple[str, list[nn.Module], Callable]]:
    """(name, modules, hidden -> hidden) of a whole DecoderLM, in order: embedding, layers, norm + head."""
    out: list[tuple[str, list[nn.Module], Callable]] = [("embed", [model.embed], model.embed)]
    out += [(f"layers.{i}", [block], block) for i, block in enumerate(model.layers)]
    out.append(("head", [model.norm, model.lm_head], lambda h: model.lm_head(model.norm(h))))
    return out


@torch.no_grad()
def quantize_weights(
    model: nn.Module, windows: torch.Tensor | None, batch_size: int = 8, show: bool = True
) -> dict[str, Any] | None:
    """Fill every QuantizedWeight of ``model`` not filled yet: rtn / hqq from the weights, gptq / awq
    sequentially over ``windows`` (N, L) token ids (:func:`weight_stage` per stage). Returns the pass's
    :class:`~diffquant.quant.methods.WeightStats` summary (None: no data-driven method)."""
    fill_data_free(model, show=show)
    pending = [q for _, q in _owners(model) if not q.filled]
    if not pending:
        return None
    if windows is None or windows.numel() == 0:
        entry = pending[0].spec.entry
        raise DiffquantError(
            f"{pending[0].site}: {entry.name} needs calibration data ({entry.collects}); none was given"
        )
    device = next(model.parameters()).device
    batches = [windows[s : s + batch_size].to(device) for s in range(0, windows.shape[0], batch_size)]
    stages = model_stages(model)
    last = max(
        i for i, (_, modules, _) in enumerate(stages) if any(not q.filled for _, q in _owners(modules))
    )
    hidden: list[torch.Tensor | None] = list(batches)
    stats = WeightStats(pending[0].method)

    def get(k: int) -> torch.Tensor:
        return hidden[k]

    def put(k: int, y: torch.Tensor) -> None:
        hidden[k] = y

    start = time.monotonic()
    with taps_detached(model):
        chosen = progress(
            stages[: last + 1], pending[0].method, "stage", leave=False, enabled=show, announce=True
        )
        for i, (_, modules, fn) in enumerate(chosen):
            weight_stage(modules, fn, len(batches), get, put if i < last else None, stats)
    state = getattr(model, "quant", None)
    transform = pending[0].spec.entry.transform
    if state is not None and transform is not None:
        state.fold(transform, stats.folded)  # AWQ's scales, folded into the model's norms and readers
    stats.folded.clear()
    if show and not is_quiet():
        write(stats.line(time.monotonic() - start))  # through tqdm: a bar on the terminal stays whole
    return stats.summary()
