"""The plan as a pipeline: every plan section behind one interface, listed once, in the order they run.

A :class:`~diffquant.quant.plan.QuantPlan` is data (its schema lives in ``plan.py``); this module runs it.
:data:`SECTIONS` is the one place that states the order::

    rotate -> rules -> smooth -> weights -> static scales -> backend -> kv_cache

Each section (:class:`Section`) may act in four phases, and every phase walks :data:`SECTIONS` in that order:

1. ``resolve``: select what it acts on and check it against the model; nothing is changed, so a refused plan
   leaves the model unquantized (every rule must select something: a typo would otherwise pass silently);
2. ``apply``: change the model's structure (quantizers inserted, Linears attached to codes or swapped for a
   backend's layers, the rotation prepared, the cache made a quantized one);
3. ``read_stage``: a stage's weights are there (embedding, decoder layer i, final norm + head): the rotation
   of that stage, weight quantizers run once on the weights (shape checked, NaNs counted), data-free codes.
   A whole model reads every stage inside :func:`apply_plan`; a streamed run reads each stage as it is
   materialised (:mod:`diffquant.stream.executor`), so both do the same operations on the same weights;
4. calibration: ``prepare`` (whole-model work before the stages: SmoothQuant's act-scales and smoothing),
   then ``calibrate_stage`` per stage (data-driven weight methods, static scales). :func:`calibrate` (whole
   model) and the streamed executor drive the same :func:`calibrate_stage`, each over its own stages and
   hidden-state stores.

What each section did is written to the model's one :class:`~diffquant.quant.state.QuantState`
(``model.quant``), and a checkpoint's ``transforms`` record (:func:`transforms`) and its reload
(``apply_plan(..., saved=transforms)``) come from the sections.

Adding a plan section is a :class:`Section` subclass placed in :data:`SECTIONS` where it must run, its schema
in ``plan.py`` (see docs/DESIGN.md "Where a new thing goes").
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.models.taps import Tap, select_taps
from diffquant.progress import is_quiet, progress, write
from diffquant.quant import smoothquant  # called through the module, so tests can patch it
from diffquant.quant.backends.quanto import quanto_calibration
from diffquant.quant.caches import weight_caches_dropped
from diffquant.quant.fake import FakeQuant
from diffquant.quant.kv_cache import attach_kv_cache
from diffquant.quant.methods import WeightStats
from diffquant.quant.modules import apply_backend, taps_detached
from diffquant.quant.plan import QuantPlan, Rule
from diffquant.quant.rotate import StageRotation, prepare_rotation
from diffquant.quant.select import select_linears
from diffquant.quant.state import QuantState
from diffquant.quant.weights import attach_weights, fill_data_free, model_stages, weight_modules, weight_stage


class Stage(NamedTuple):
    """One unit of the model a run holds at a time: ``name`` (``embed``, ``layers.3``, ``head``), the weight
    ``prefixes`` it reads (``layers.3.``; the head of a tied model reads ``embed.`` too), its ``modules`` and
    ``fn`` (hidden -> hidden; ids -> hidden for the embedding, hidden -> logits for the head)."""

    name: str
    prefixes: list[str]
    modules: list[nn.Module]
    fn: Callable[[torch.Tensor], torch.Tensor]


def stages(model: nn.Module) -> list[Stage]:
    """The stages of a whole DecoderLM in execution order (:func:`~diffquant.quant.weights.model_stages`)."""
    tied = model.config.tie_embeddings
    head = ["norm.", "lm_head."] + (["embed."] if tied else [])
    return [
        Stage(name, head if name == "head" else [f"{name}."], modules, fn)
        for name, modules, fn in model_stages(model)
    ]


# ============================================================================================ contexts
@dataclass
class Apply:
    """What the phases of :func:`apply_plan` share: the model, the plan, the state being built, what the saved
    weights carry already (``saved``: a checkpoint's ``transforms``) and each section's selections."""

    model: nn.Module
    plan: QuantPlan
    state: QuantState
    saved: frozenset[str] = frozenset()
    selected: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"plan {self.plan.name}"


class Store(Protocol):
    """Hidden states per calibration batch between stages (the streamed run's HiddenStore spills to files)."""

    def get(self, key: int, device: str | torch.device = "cpu") -> torch.Tensor: ...
    def put(self, key: int, tensor: torch.Tensor) -> None: ...
    def drop(self, key: int) -> None: ...
    def close(self) -> None: ...


class MemoryStore:
    """A :class:`Store` that keeps the tensors where they are (a whole model's calibration: on its device)."""

    def __init__(self) -> None:
        self._items: dict[int, torch.Tensor] = {}

    def get(self, key: int, device: str | torch.device = "cpu") -> torch.Tensor:
        return self._items[key].to(device)

    def put(self, key: int, tensor: torch.Tensor) -> None:
        self._items[key] = tensor.detach()

    def drop(self, key: int) -> None:
        self._items.pop(key, None)

    def close(self) -> None:
        self._items.clear()


@dataclass
class Calibration:
    """The calibration of one run: ``batches`` of token ids, the ``device`` stages run on, a factory of hidden
    stores, and the streams (one per section that advances its own hidden states through the stages: the
    weight methods' float-activation stream, the static scales' observing stream)."""

    model: nn.Module
    batches: Sequence[torch.Tensor]
    device: torch.device
    new_store: Callable[[], Store] = MemoryStore
    profiler: Any = None  # a streamed profile's Profiler: paused while calibration batches run
    stats: WeightStats | None = None
    windows: torch.Tensor | None = None  # a whole model's (N, L) token ids, for whole-model passes
    batch_size: int = 8
    streams: dict[str, Store] = field(default_factory=dict)

    def run_stream(self, name: str, stage: Stage, first: bool, last: bool) -> None:
        """Every batch of stream ``name`` through ``stage``, its outputs kept for the next stage (dropped at
        the last)."""
        store = self.stream(name)
        for k in range(len(self.batches)):
            y = stage.fn(self.input(name, k, first))
            if last:
                store.drop(k)
            else:
                store.put(k, y)
            del y

    def stream(self, name: str) -> Store:
        if name not in self.streams:
            self.streams[name] = self.new_store()
        return self.streams[name]

    def input(self, name: str, k: int, first: bool) -> torch.Tensor:
        """Batch ``k`` of stream ``name`` entering the current stage (token ids at the first stage)."""
        if first:
            return self.batches[k].to(self.device)
        return self.stream(name).get(k, self.device)

    def close(self) -> None:
        for store in self.streams.values():
            store.close()
        self.streams.clear()


# ============================================================================================ sections
class Section:
    """One plan section. ``key``: the plan field it reads; ``streams``: whether a streamed run (one stage's
    weights at a time) can carry it. Every phase does nothing by default."""

    key = ""
    streams = True  # whether a streamed run (one stage's weights at a time) can carry it

    def active(self, plan: QuantPlan) -> bool:
        return getattr(plan, self.key) is not None

    def label(self, plan: QuantPlan) -> str:
        """The section as a user names it in a message."""
        return self.key

    def resolve(self, run: Apply) -> None:
        """Select and check; change nothing."""

    def apply(self, run: Apply) -> None:
        """Change the model's structure; record in ``run.state``."""

    def read_stage(self, model: nn.Module, state: QuantState, stage: Stage) -> None:
        """The stage's weights were just read (or, for a whole model, are all there)."""

    def prepare(self, model: nn.Module, calib: Calibration) -> None:
        """Whole-model calibration work before the stages run."""

    def calibrate_stage(self, stage: Stage, calib: Calibration, first: bool, last: bool) -> None:
        """One stage of calibration."""

    def needs_data(self, plan: QuantPlan) -> bool:
        return False

    def keeps_stream(self, plan: QuantPlan) -> bool:
        """Whether its calibration advances a hidden-state stream of its own through the stages (one hidden
        state per calibration token held between stages)."""
        return False

    def rewrites_weights(self, plan: QuantPlan) -> bool:
        """Whether it writes the float weights in place (a model sharing tensors would see it)."""
        return False

    def transforms(self, model: nn.Module, state: QuantState) -> list[str]:
        """What this section did to the float weights or computed from them (saved: not to be redone)."""
        return []


class RotateSection(Section):
    """QuaRot / SpinQuant rotation (:mod:`~diffquant.quant.rotate`): prepared at apply (checks, the tied head
    untied, the report), each stage rotated as it is read. First: every later section reads rotated weights."""

    key = "rotate"

    def apply(self, run: Apply) -> None:
        weights = "rotate" not in run.saved
        spec = run.plan.rotate
        for place, what in prepare_rotation(run.model, spec, weights=weights):
            run.state.applied.append(("rotate", place, what))
        run.state.stage_rotation = StageRotation(spec, weights)
        run.state.record("rotate")

    def rewrites_weights(self, plan: QuantPlan) -> bool:
        return True

    def transforms(self, model: nn.Module, state: QuantState) -> list[str]:
        return ["rotate"]  # the saved weights are rotated, or carry the online rotations' weights

    def read_stage(self, model: nn.Module, state: QuantState, stage: Stage) -> None:
        rotate_stage(model, state.stage_rotation, stage.prefixes)


def rotate_stage(model: nn.Module, rotation: StageRotation, prefixes: Sequence[str]) -> None:
    """The rotation of the stage whose weights under ``prefixes`` (``embed.``, ``layers.3.``, ``lm_head.``)
    are there."""
    for prefix in prefixes:
        layer = re.fullmatch(r"layers\.(\d+)\.", prefix)
        if prefix == "embed.":
            rotation.embedding(model)
        elif prefix == "lm_head.":
            rotation.head(model)
        elif layer is not None:
            rotation.layer(model, int(layer[1]))


def _select_sites(model: nn.Module, rule: Rule, where: str) -> dict[str, Tap]:
    """The taps of ``rule.sites`` minus ``rule.exclude``; like :func:`select_linears`, never empty."""
    try:
        taps = select_taps(model, rule.sites)
    except DiffquantError as err:
        raise DiffquantError(f"{where}: {err}") from None
    kept = {n: t for n, t in taps.items() if not any(fnmatch.fnmatchcase(n, e) for e in rule.exclude)}
    if not kept:
        raise DiffquantError(
            f"{where}: site patterns {rule.sites} select {len(taps)} site(s), all removed by exclude "
            f"{rule.exclude}; it would quantize nothing"
        )
    return kept


class RulesSection(Section):
    """Fake-quant rules: FakeQuant modules at the selected taps and on the selected Linears' weights."""

    key = "rules"

    def active(self, plan: QuantPlan) -> bool:
        return bool(plan.rules)

    def resolve(self, run: Apply) -> None:
        selected = []
        for i, rule in enumerate(run.plan.rules):
            where = f"{run.where}: rules[{i}]"
            taps = _select_sites(run.model, rule, where) if rule.sites else {}
            linears = select_linears(run.model, rule.modules, rule.exclude, where) if rule.modules else {}
            selected.append((rule, taps, linears))
        run.selected["rules"] = selected

    def apply(self, run: Apply) -> None:
        for rule, taps, linears in run.selected["rules"]:
            for name, tap in taps.items():
                tap.quantizer = FakeQuant(rule.scheme, name, tap.kind)
                run.state.applied.append(("site", name, rule.scheme.label()))
            for name, linear in linears.items():
                linear.weight_quantizer = FakeQuant(rule.scheme, f"{name}.weight", "weight")
                run.state.applied.append(("weight", name, rule.scheme.label()))

    def read_stage(self, model: nn.Module, state: QuantState, stage: Stage) -> None:
        # each weight quantizer run once on its weight: the shape is checked now, not mid-run, and the
        # weights' NaNs count in ``nan_counts`` (whole and streamed alike)
        for module in stage.modules:
            for sub in module.modules():
                quantizer = getattr(sub, "weight_quantizer", None)
                if isinstance(quantizer, FakeQuant) and sub.weight.device.type != "meta":
                    quantizer.quantize_weight(sub.weight)


class SmoothSection(Section):
    """SmoothQuant (Xiao et al. 2023): act-scales of the float model over the calibration text, factors folded
    into the norms and their readers before anything observes the weights. Whole-model: the factors come
    from statistics of every layer."""

    key = "smooth"
    streams = False  # its factors come from act-scales of every layer, before the first is quantized

    def label(self, plan: QuantPlan) -> str:
        return "smooth (SmoothQuant)"

    def needs_data(self, plan: QuantPlan) -> bool:
        return True

    def rewrites_weights(self, plan: QuantPlan) -> bool:
        return True

    def prepare(self, model: nn.Module, calib: Calibration) -> None:
        state: QuantState = model.quant
        if state.factors("smooth") is not None:
            return  # smoothed once: a second calibration recalibrates the static scales only
        scales = smoothquant.collect_act_scales(model, calib.windows, batch_size=calib.batch_size)
        state.folded.append(
            ("smooth", smoothquant.smooth_model(model, scales, alpha=state.plan.smooth.alpha))
        )
        state.record("smooth")

    def transforms(self, model: nn.Module, state: QuantState) -> list[str]:
        return ["smooth"] if "smooth" in state.transforms else []


class WeightsSection(Section):
    """The ``weights`` section (:mod:`~diffquant.quant.weights`): each chosen Linear gets a QuantizedWeight
    whose codes a registered method chooses: data-free ones as a stage is read (after smoothing when the plan
    smooths), data-driven ones (GPTQ, AWQ) stage by stage over the calibration text."""

    key = "weights"

    def resolve(self, run: Apply) -> None:
        spec = run.plan.weights
        chosen = select_linears(run.model, spec.modules, spec.exclude, f"{run.where}: weights")
        for i, (_, _, linears) in enumerate(run.selected.get("rules", [])):
            clash = sorted(set(linears) & set(chosen))
            if clash:
                raise DiffquantError(
                    f"{clash[0]}: {run.where}: rules[{i}] fake-quantizes this weight and the weights "
                    "section quantizes it too; exclude it from one of them"
                )
        for name in chosen:
            spec.grid.check(tuple(chosen[name].weight.shape), f"{run.where}: weights: {name}")
        run.selected["weights"] = chosen

    def apply(self, run: Apply) -> None:
        run.state.applied += attach_weights(run.plan.weights, run.selected["weights"], fill=False)
        # data-free codes wait for the smoothing (at calibration) or come from the checkpoint
        run.state.fill_weights = run.plan.smooth is None and "weights" not in run.saved

    def read_stage(self, model: nn.Module, state: QuantState, stage: Stage) -> None:
        if state.fill_weights:
            fill_data_free(stage.modules)

    def needs_data(self, plan: QuantPlan) -> bool:
        return plan.weights.needs_data

    def keeps_stream(self, plan: QuantPlan) -> bool:
        return self.needs_data(plan)  # the data-driven methods' float-activation stream

    def rewrites_weights(self, plan: QuantPlan) -> bool:
        return plan.weights.entry.transform is not None  # AWQ folds its scales into norms and Linears

    def prepare(self, model: nn.Module, calib: Calibration) -> None:
        fill_data_free(model, show=True)  # after smoothing: the data-free codes of the smoothed weights
        if self.needs_data(model.quant.plan) and calib.stats is None:
            calib.stats = WeightStats(model.quant.plan.weights.method)

    def calibrate_stage(self, stage: Stage, calib: Calibration, first: bool, last: bool) -> None:
        if not self.needs_data(calib.model.quant.plan):
            return
        store = calib.stream("weights")
        put = None if last else store.put
        with taps_detached(calib.model):
            weight_stage(
                stage.modules,
                stage.fn,
                len(calib.batches),
                lambda k: calib.input("weights", k, first),
                put,
                calib.stats,
            )
        transform = calib.model.quant.plan.weights.entry.transform
        if transform is not None:  # scales the method folded into the stage's norms and readers (AWQ)
            calib.model.quant.fold(transform, calib.stats.folded)
        calib.stats.folded.clear()
        if last:
            store.close()

    def transforms(self, model: nn.Module, state: QuantState) -> list[str]:
        out = []
        method = state.plan.weights.entry.transform
        if method is not None and method in state.transforms:
            out.append(method)  # AWQ's folded scales: in the saved weights (its codes are ``weights``)
        if any(q.filled for q in weight_modules(model).values()):
            out.append("weights")
        return out


class StaticSection(Section):
    """Static activation scales: the stage's static FakeQuants (and optimum-quanto's activation scales)
    observe the calibration stream (values pass through), then their scales are fixed. Last of the
    calibration: it observes the model with its final weights."""

    key = "static"

    def active(self, plan: QuantPlan) -> bool:
        return any(r.scheme.is_static for r in plan.rules) or _quanto_activations(plan)

    def needs_data(self, plan: QuantPlan) -> bool:
        return True

    def keeps_stream(self, plan: QuantPlan) -> bool:
        return True  # the observing stream

    def calibrate_stage(self, stage: Stage, calib: Calibration, first: bool, last: bool) -> None:
        quantizers = [
            q
            for mod in stage.modules
            for q in mod.modules()
            if isinstance(q, FakeQuant) and q.scheme.is_static
        ]
        for q in quantizers:
            q.start_calibration()
        context = (
            quanto_calibration() if _quanto_activations(calib.model.quant.plan) else contextlib.nullcontext()
        )
        if calib.profiler is not None:
            calib.profiler.paused = True
        try:
            # one weight's quantized copy held at a time: a pass that only observes needs no cache
            with context, _caches_dropped(stage.modules):
                calib.run_stream("static", stage, first, last)
        finally:
            if calib.profiler is not None:
                calib.profiler.paused = False
        for q in quantizers:
            q.finish_calibration()


def _quanto_activations(plan: QuantPlan) -> bool:
    return (
        plan.backend is not None
        and plan.backend.name == "quanto"
        and plan.backend.activation_type is not None
    )


@contextlib.contextmanager
def _caches_dropped(modules: Sequence[nn.Module]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(weight_caches_dropped(module))
        yield


class BackendSection(Section):
    """A real backend (optimum-quanto, bitsandbytes): the chosen Linears swapped for its layers."""

    key = "backend"
    streams = False  # backend Linears hold their own copies of the weights

    def label(self, plan: QuantPlan) -> str:
        return f"backend {plan.backend.name}"

    def resolve(self, run: Apply) -> None:
        spec = run.plan.backend
        chosen = select_linears(run.model, spec.modules, spec.exclude, f"{run.where}: backend {spec.name}")
        for _, _, linears in run.selected.get("rules", []):
            clash = sorted(set(linears) & set(chosen))
            if clash:
                raise DiffquantError(
                    f"{clash[0]}: a plan rule already fake-quantizes this weight; the backend would too"
                )
        run.selected["backend"] = chosen

    def apply(self, run: Apply) -> None:
        run.state.applied += apply_backend(run.model, run.plan.backend, run.selected["backend"])


class KVCacheSection(Section):
    """The ``kv_cache`` section (:mod:`~diffquant.quant.kv_cache`): no weight changes; the model's decoding
    cache becomes a quantized one."""

    key = "kv_cache"

    def resolve(self, run: Apply) -> None:
        spec = run.plan.kv_cache
        spec.check_model(run.model.config.head_dim, run.model.config.value_dim, run.where)
        if spec.pre_rope:
            for i, (_, taps, _) in enumerate(run.selected.get("rules", [])):
                keys = sorted(name for name, tap in taps.items() if tap.kind == "k")
                if keys:
                    raise DiffquantError(
                        f"{keys[0]}: {run.where}: rules[{i}] quantizes this key site, but kv_cache.pre_rope "
                        "caches the keys before RoPE, ahead of the site; drop one of the two"
                    )

    def apply(self, run: Apply) -> None:
        factory, applied = attach_kv_cache(run.model, run.plan.kv_cache, run.where)
        run.state.kv_cache = factory
        run.state.applied += applied


# The one statement of the plan's order.
SECTIONS: tuple[Section, ...] = (
    RotateSection(),
    RulesSection(),
    SmoothSection(),
    WeightsSection(),
    StaticSection(),
    BackendSection(),
    KVCacheSection(),
)


def active_sections(plan: QuantPlan) -> list[Section]:
    return [section for section in SECTIONS if section.active(plan)]


# ============================================================================================ drivers
def apply_plan(
    model: nn.Module, plan: QuantPlan, saved: Sequence[str] = (), *, skeleton: bool = False
) -> list[tuple[str, str, str]]:
    """Apply ``plan`` to ``model`` in place; returns (target, name, what) per insertion, after ("rotate",
    place, what ran) per rotation when the plan rotates (first: rotation changes the weights the quantizers
    read). ``saved``: the transforms a quantized checkpoint's weights carry already (its ``transforms``:
    rotated weights get only the online rotations, stored codes are not recomputed). ``skeleton``: a
    streamed run's meta-device model, whose stages are read (:func:`read_stage`) as they are materialised.

    Every selection must select something in this model, checked per rule (and for the weights section and
    the backend): each site / weight / module pattern must match (``kind:NAME`` included), and the exclude
    patterns must not remove everything a rule selected. Otherwise a one-line DiffquantError names the rule,
    its patterns and excludes. Per rule because a rule that quantizes nothing is a typo or a plan written for
    another model, and would otherwise pass silently as long as another rule matched. Every shipped preset
    selects only sites every attention kind has, so each applies to baseline, DIFF V1, DIFF V2 and the rival
    kinds alike (tests/test_quant.py); a plan naming DIFF-only sites (``kind:diff_map``) is refused on a
    baseline model for the same reason. All selections are resolved before the model is touched."""
    if getattr(model, "quant", None) is not None:
        raise DiffquantError("model is already quantized; apply a plan to the unquantized model")
    chosen = active_sections(plan)
    if skeleton:
        check_streams(plan)
    state = QuantState(plan, transforms=[t for t in saved if t != "weights"])  # codes: from the state file
    run = Apply(model, plan, state, frozenset(saved))
    for section in chosen:
        section.resolve(run)
    for section in chosen:
        section.apply(run)
    model.quant = state
    if not skeleton:
        whole = stages(model)
        heavy = state.fill_weights and plan.weights is not None and plan.weights.method == "hqq"
        for stage in progress(whole, "read weights", "stage", leave=False, enabled=heavy, announce=heavy):
            read_stage(model, stage)
    return list(state.applied)


def check_streams(plan: QuantPlan) -> None:
    """Refuse, in one line, a plan with a section a streamed run cannot carry (rotation and the weights
    section stream: each stage is rotated and coded as it is read or calibrated)."""
    for section in active_sections(plan):
        if not section.streams:
            raise DiffquantError(
                f"plan {plan.name}: {section.label(plan)} is not supported in a streamed run (fake-quant rules "
                "only)"
            )


def read_stage(model: nn.Module, stage: Stage) -> None:
    """Every active section's work on a stage whose weights were just read (see the module docstring)."""
    state: QuantState | None = getattr(model, "quant", None)
    if state is None:
        return
    for section in active_sections(state.plan):
        section.read_stage(model, state, stage)


def calibrate_stage(calib: Calibration, stage: Stage, first: bool, last: bool) -> None:
    """One stage of calibration: every active section's ``calibrate_stage`` in the plan's order (the data-driven
    weight methods choose the stage's codes, then the static scales observe it). The whole-model
    :func:`calibrate` and the streamed executor both call this, stage by stage."""
    for section in active_sections(calib.model.quant.plan):
        section.calibrate_stage(stage, calib, first, last)


def prepare_calibration(calib: Calibration) -> None:
    """The whole-model work before the stages: each active section's ``prepare`` (smoothing first)."""
    for section in active_sections(calib.model.quant.plan):
        section.prepare(calib.model, calib)


def needs_calibration(plan: QuantPlan) -> bool:
    """Whether applying ``plan`` needs calibration text (smoothing, a data-driven weight method, static
    scales, quanto activation scales)."""
    return any(section.needs_data(plan) for section in active_sections(plan))


def rewrites_weights(plan: QuantPlan) -> bool:
    """Whether applying or calibrating ``plan`` writes float weights in place (rotation, smoothing, AWQ)."""
    return any(section.rewrites_weights(plan) for section in active_sections(plan))


def calibration_streams(plan: QuantPlan) -> int:
    """How many hidden-state streams a calibration of ``plan`` keeps between stages (one hidden state per
    calibration token each): the data-driven weight methods' and the static scales'."""
    return sum(section.keeps_stream(plan) for section in active_sections(plan))


@torch.no_grad()
def calibrate(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> int:
    """Calibrate the plan ``model`` carries over ``windows`` (N, L) token ids: the sections' ``prepare``
    (SmoothQuant smoothing of the float model, then the data-free codes of the smoothed weights), then
    :func:`calibrate_stage` over the whole model's stages (data-driven codes, then static scales). Returns
    tokens seen (0: nothing to calibrate). A second ``calibrate`` recalibrates the static scales only."""
    state: QuantState | None = getattr(model, "quant", None)
    if state is None or not needs_calibration(state.plan):
        return 0
    device = next(model.parameters()).device
    batches = [windows[s : s + batch_size] for s in range(0, windows.shape[0], batch_size)]
    calib = Calibration(model, batches, device, windows=windows, batch_size=batch_size)
    prepare_calibration(calib)
    started = time.monotonic()
    whole = stages(model)
    try:
        for i, stage in enumerate(progress(whole, "calibrate", "stage", leave=False, announce=True)):
            calibrate_stage(calib, stage, i == 0, i == len(whole) - 1)
    finally:
        calib.close()
    if calib.stats is not None and calib.stats.linears:
        state.weight_stats = calib.stats.summary()
        if not is_quiet():
            write(calib.stats.line(time.monotonic() - started))
    return windows.numel()


def transforms(model: nn.Module) -> list[str]:
    """The weight transforms already applied to ``model``'s weights, in the order they ran (the saved weights
    carry them; loading must not apply them again), as each section reports them."""
    state: QuantState | None = getattr(model, "quant", None)
    if state is None:
        return []
    out: list[str] = []
    for section in active_sections(state.plan):
        out += section.transforms(model, state)
    return out
