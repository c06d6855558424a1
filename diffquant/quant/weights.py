"""The weight transform of a plan (``weights:``): Linear weights replaced by integer codes chosen by
round-to-nearest, GPTQ or HQQ, on one grid (:mod:`~diffquant.quant.weightcodes`).

::

    weights: {method: gptq, bits: 4, group_size: 128, sym: true, act_order: false, damp: 0.01, block: 128}

- ``rtn``: each value rounded alone (the baseline every paper's tables start from);
- ``hqq`` (Badri & Shaji 2023, :mod:`~diffquant.quant.hqq`): data-free, the zero points optimised against an
  lp-norm of the error (asymmetric: ``sym`` false);
- ``gptq`` (Frantar et al. 2022, :mod:`~diffquant.quant.gptq`): the codes chosen against the layer's
  calibration inputs. Sequential, as GPTQ's and llm-compressor's pipelines are: decoder layer l's Hessians
  come from the inputs the already-quantized layers 0..l-1 produce, with the activations in float (the
  activation quantizers of the plan are off while weights are chosen: QuaRot runs GPTQ before its
  activation quantizers are set, likewise). Within a layer every Linear sees the float layer (GPTQ's
  default; llm-compressor's sequential pipeline does the same). :func:`gptq_stage` is the one step
  both the whole-model pass (:func:`quantize_weights`) and the streamed run (one layer resident) take, so
  both give the same codes.

Order in a plan: rotation (at apply_plan), quantizers inserted, then at calibration SmoothQuant smoothing,
then the weights (they quantize the rotated and smoothed weights), then the static activation scales (which
observe the model with its quantized weights). Without smoothing the data-free methods run at apply_plan.
A quantized checkpoint stores the codes, scales and zero points (``quant_state.safetensors``) and records
``weights`` in ``plan.json``'s ``transforms``, so a reload serves the stored codes without recomputing them.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.attention import Linear
from diffquant.progress import is_quiet, progress, write
from diffquant.quant.gptq import Hessian, gptq_codes
from diffquant.quant.hqq import hqq_codes
from diffquant.quant.modules import taps_detached, weight_quantizers_detached
from diffquant.quant.select import pattern_list
from diffquant.quant.weightcodes import GroupCodes, QuantizedWeight, WeightGrid, rtn_codes
from diffquant.schema import key

METHODS = ("rtn", "gptq", "hqq")
_BOOL = "a boolean (YAML true or false)"
# The options each method reads. One rule for the rest (:func:`unused_option`): an option the chosen method
# does not read is refused, never silently ignored (``{method: rtn, damp: 0.5}`` ran plain rtn).
_COMMON = ("method", "bits", "group_size", "sym", "modules", "exclude")
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "rtn": _COMMON,
    "hqq": _COMMON,
    "gptq": (*_COMMON, "act_order", "damp", "block"),
}


def unused_option(method: str, given: Iterable[str]) -> str | None:
    """The message for the first option in ``given`` (the keys a plan's ``weights`` section sets) that
    ``method`` does not read, naming the methods that do; None when every option is read."""
    for name in given:
        if name in METHOD_OPTIONS.get(method, METHOD_OPTIONS["gptq"]):
            continue
        readers = [m for m, options in METHOD_OPTIONS.items() if name in options]
        if not readers:
            continue  # not an option at all: the schema names the allowed keys
        return (
            f"weights.{name}: a {' / '.join(readers)} option, which method {method} does not read; remove it "
            f"(or method: {readers[0]})"
        )
    return None


def _group_size(value: Any) -> str | None:
    ok = value == "channel" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    return None if ok else "an integer >= 1 (input channels per scale) or 'channel'"


def _damp(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    return None if ok else "a number in (0, 1] (a fraction of the Hessian's mean diagonal)"


def _sym(value: Any) -> str | None:
    return None if value is None or isinstance(value, bool) else _BOOL + " or null (the method's default)"


@dataclass
class WeightsSpec:
    """A plan's ``weights`` section (checked by :func:`diffquant.schema.check`). ``sym`` null: the method's
    convention (true for rtn and gptq, false for hqq, which optimises the zero point)."""

    method: str = key(what="a string")
    bits: int = key(4, min=2, max=8)
    group_size: int | str = key(128, check=_group_size)
    sym: bool | None = key(None, check=_sym)
    act_order: bool = key(False, what=_BOOL)  # gptq: columns by descending Hessian diagonal, static groups
    damp: float = key(0.01, check=_damp)  # gptq: Hessian damping, a fraction of its mean diagonal
    block: int = key(128, min=1)  # gptq: columns per lazy batch update
    modules: list[str] = key(["layers.*"], check=pattern_list)
    exclude: list[str] = key([], check=pattern_list)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            self.modules = [self.modules]
        if isinstance(self.exclude, str):
            self.exclude = [self.exclude]
        if self.method not in METHODS:
            raise DiffquantError(f"weights.method: {self.method!r}; valid: {', '.join(METHODS)}")
        if self.sym is None:
            self.sym = self.method != "hqq"
        if self.method == "hqq" and self.sym:
            raise DiffquantError("weights.sym: hqq optimises the zero point, so it is asymmetric: sym false")
        # built in Python, a field set away from its default is a given option (a plan's section also names
        # the keys it sets: diffquant.quant.plan applies the same rule to them)
        changed = [
            f.name for f in fields(self) if f.default is not MISSING and getattr(self, f.name) != f.default
        ]
        problem = unused_option(self.method, changed)
        if problem is not None:
            raise DiffquantError(problem)

    @property
    def grid(self) -> WeightGrid:
        size = None if self.group_size == "channel" else int(self.group_size)
        return WeightGrid(int(self.bits), size, bool(self.sym))

    @property
    def needs_data(self) -> bool:
        return self.method == "gptq"

    def label(self) -> str:
        size = "channel" if self.group_size == "channel" else f"g{self.group_size}"
        extra = " act-order" if self.act_order else ""
        return f"{self.method} int{self.bits} {size} {'sym' if self.sym else 'asym'}{extra}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "modules": list(self.modules),
        }
        if self.exclude:
            out["exclude"] = list(self.exclude)
        if self.method == "gptq":
            out.update(act_order=self.act_order, damp=self.damp, block=self.block)
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
    """Codes for the rtn / hqq weights under ``modules`` (Linears or their parents) not filled yet (a
    streamed skeleton's weights still on the meta device wait until their stage is read); ``show``: progress
    over the Linears (hqq on a 1.7B model takes minutes)."""
    pending = [
        (linear, q)
        for linear, q in _owners(modules)
        if not (q.filled or q.spec.needs_data or linear.weight.device.type == "meta")
    ]
    if not pending:
        return
    desc = f"{pending[0][1].spec.method} weights"
    for linear, q in progress(pending, desc, "linear", leave=False, enabled=show, announce=True):
        q.set_codes(weight_codes(linear.weight, q.spec))


def weight_codes(
    weight: torch.Tensor, spec: WeightsSpec, hessian: torch.Tensor | None = None, what: str = "weight"
) -> GroupCodes:
    """The codes of one weight by ``spec``'s method (gptq needs ``hessian``)."""
    if spec.method == "rtn":
        return rtn_codes(weight, spec.grid)
    if spec.method == "hqq":
        return hqq_codes(weight, spec.grid, what=what)
    if hessian is None:
        raise DiffquantError(f"{what}: gptq needs calibration data (its Hessian); none was given")
    return gptq_codes(
        weight, hessian, spec.grid, act_order=spec.act_order, damp=spec.damp, block=spec.block, what=what
    )


# ------------------------------------------------------------------------------------------- gptq
@dataclass
class GptqStats:
    """What a GPTQ pass did: Linears quantized, calibration tokens per Linear, the largest Hessian bytes held
    at once and the process's peak resident memory."""

    linears: int = 0
    tokens: int = 0
    hessian_bytes: int = 0

    def line(self, seconds: float) -> str:
        s = self.summary()
        return (
            f"gptq: {s['linears']} Linears on {s['tokens']:,} calibration tokens each in {seconds:.1f} s; "
            f"Hessians up to {s['peak_hessian_bytes'] / 2**20:.1f} MiB at once, "
            f"peak resident memory {s['peak_rss_bytes'] / 2**30:.2f} GiB"
        )

    def summary(self) -> dict[str, Any]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return {
            "linears": self.linears,
            "tokens": self.tokens,
            "peak_hessian_bytes": self.hessian_bytes,
            "peak_rss_bytes": peak,
        }


@torch.no_grad()
def gptq_stage(
    modules: Sequence[nn.Module],
    fn: Callable[[torch.Tensor], torch.Tensor],
    count: int,
    get: Callable[[int], torch.Tensor],
    put: Callable[[int, torch.Tensor], None] | None,
    stats: GptqStats | None = None,
) -> None:
    """One stage of sequential GPTQ: the ``count`` input batches (``get(k)``) through ``fn`` with the stage's
    GPTQ weights in float, accumulating each Linear's Hessian from its input; the codes chosen; then the
    batches through again with the new codes, each output handed to ``put(k, y)`` (the next stage's input).
    Linears that read the same tensor (q, k and v; gate and up) share one Hessian. The caller has the
    activation quantizers detached (:func:`~diffquant.quant.modules.taps_detached`)."""
    pairs = [(lin, q) for lin, q in _owners(modules) if q.spec.needs_data and not q.filled]
    if pairs:
        hessians: dict[int, Hessian] = {}  # owner index -> its Hessian
        alias: dict[int, int] = {}  # linear index -> the index whose Hessian it shares
        # this batch: the input tensor's identity -> (first linear reading it, the tensor: held, so that its
        # memory is not reused by a later tensor of the same shape within the batch)
        seen: dict[tuple, tuple[int, torch.Tensor]] = {}
        handles = []

        def hook(index: int) -> Callable:
            def record(_module: nn.Module, args: tuple) -> None:
                x = args[0]
                ident = (x.data_ptr(), x._version, tuple(x.shape))
                if index not in alias:
                    alias[index] = seen.setdefault(ident, (index, x))[0]
                owner = alias[index]
                if owner == index:
                    if owner not in hessians:
                        hessians[owner] = Hessian(x.shape[-1], device=x.device)
                    hessians[owner].add(x)

            return record

        for i, (linear, _) in enumerate(pairs):
            # the tap's input: after an online rotation (R4), what the weight multiplies
            handles.append(linear.input.register_forward_pre_hook(hook(i)))
        try:
            with weight_quantizers_detached(lin for lin, _ in pairs):
                for k in range(count):
                    seen.clear()
                    fn(get(k))
        finally:
            for handle in handles:
                handle.remove()
        if stats is not None:
            held = sum(h.matrix.numel() * h.matrix.element_size() for h in hessians.values())
            stats.hessian_bytes = max(stats.hessian_bytes, held)
        for i, (linear, q) in enumerate(pairs):
            hessian = hessians.get(alias.get(i, i))
            if hessian is None:
                raise DiffquantError(f"{q.site}: calibration never reached this Linear (no Hessian)")
            q.set_codes(weight_codes(linear.weight, q.spec, hessian.matrix, what=q.site))
            if stats is not None:
                stats.linears += 1
                stats.tokens = max(stats.tokens, hessian.tokens)
        del hessians
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
    """Fill every QuantizedWeight of ``model`` not filled yet: rtn / hqq from the weights, gptq sequentially
    over ``windows`` (N, L) token ids. Returns the GPTQ pass's :class:`GptqStats` summary (None: no gptq)."""
    fill_data_free(model, show=show)
    pending = [q for _, q in _owners(model) if not q.filled]
    if not pending:
        return None
    if windows is None or windows.numel() == 0:
        raise DiffquantError(f"{pending[0].site}: gptq needs calibration data; none was given")
    device = next(model.parameters()).device
    batches = [windows[s : s + batch_size].to(device) for s in range(0, windows.shape[0], batch_size)]
    stages = model_stages(model)
    last = max(
        i for i, (_, modules, _) in enumerate(stages) if any(not q.filled for _, q in _owners(modules))
    )
    hidden: list[torch.Tensor | None] = list(batches)
    stats = GptqStats()

    def get(k: int) -> torch.Tensor:
        return hidden[k]

    def put(k: int, y: torch.Tensor) -> None:
        hidden[k] = y

    start = time.monotonic()
    with taps_detached(model):
        chosen = progress(stages[: last + 1], "gptq", "stage", leave=False, enabled=show, announce=True)
        for i, (_, modules, fn) in enumerate(chosen):
            gptq_stage(modules, fn, len(batches), get, put if i < last else None, stats)
    if show and not is_quiet():
        write(stats.line(time.monotonic() - start))  # through tqdm: a bar on the terminal stays whole
    return stats.summary()
