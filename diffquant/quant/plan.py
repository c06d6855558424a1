"""QuantPlan: quantization as data. Site patterns map to schemes; a backend may take over the Linears.

A plan is a list of rules and an optional real backend::

    name: w4a8
    rules:
      - modules: ["layers.*"]            # Linear modules (their weights) by name glob
        scheme: {format: int4, granularity: group(32)}
      - sites: ["layers.*.input"]         # taps by site glob, or kind:NAME
        scheme: int8:token
    backend:                              # optional: real quantized layers (optimum-quanto or bitsandbytes)
      name: quanto
      weight_type: qint8
      activation_type: qint8
      modules: ["layers.*"]
    smooth: {alpha: 0.5}                  # optional: SmoothQuant smoothing before calibration (fake-quant only)
    rotate: {residual: hadamard, heads: hadamard, ffn: hadamard, qk: none}   # optional: QuaRot rotation
    kv_cache: {format: int4, keys: channel, values: token, group: 32, window: 128}  # optional: KIVI cache

This module is the plan's schema only: the sections as dataclasses, checked when a plan is read
(:meth:`QuantPlan.from_dict`, :meth:`QuantPlan.load`), and the shipped presets
(:mod:`~diffquant.quant.presets`). Running a plan (its order, each section's phases) is
:mod:`diffquant.quant.pipeline`'s job; every key is listed in docs/plans.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from diffquant.errors import DiffquantError, did_you_mean
from diffquant.quant.backends.bnb import BNB_BLOCKSIZES, BNB_MODES
from diffquant.quant.backends.quanto import QUANTO_ACTIVATIONS, QUANTO_WEIGHTS
from diffquant.quant.kv_cache import KVCacheSpec
from diffquant.quant.presets import PRESETS, preset_data
from diffquant.quant.rotate import RotateSpec
from diffquant.quant.schemes import Scheme, is_number
from diffquant.quant.select import pattern_list, patterns
from diffquant.quant.weights import WeightsSpec, unused_option
from diffquant.schema import DOCS, check, key
from diffquant.shipped import shipped_file, shipped_names
from diffquant.textfiles import read_yaml_file

__all__ = [
    "BACKENDS",
    "PRESETS",
    "BackendSpec",
    "QuantPlan",
    "RotateSpec",
    "Rule",
    "SmoothSpec",
    "WeightsSpec",
    "preset",
]

BACKENDS = ("quanto", "bnb")


def _finite_at_least_0(value: Any) -> str | None:
    return None if is_number(value) and math.isfinite(value) and value >= 0 else "a finite number >= 0"


@dataclass(kw_only=True)
class RuleDoc:
    """The schema of a plan's rule (its scheme is checked by :meth:`Scheme.parse`)."""

    RENAMED: ClassVar[dict[str, str]] = {"weights": "modules"}

    sites: list[str] = key([], check=pattern_list)
    modules: list[str] = key([], check=pattern_list)
    exclude: list[str] = key([], check=pattern_list)
    scheme: Any = key()


@dataclass
class Rule:
    scheme: Scheme
    sites: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("sites", "modules", "exclude"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        out["scheme"] = self.scheme.to_dict()
        return out


@dataclass
class BackendSpec:
    """A plan's ``backend`` section; also its schema (:func:`diffquant.schema.check`), which reads a single
    pattern as a list of one. ``weight_type`` / ``activation_type``: quanto's qtypes (``qint8``, ...)."""

    RENAMED: ClassVar[dict[str, str]] = {"weights": "weight_type", "activations": "activation_type"}

    name: str = key()
    modules: list[str] = key(["layers.*"], check=pattern_list)
    exclude: list[str] = key([], check=pattern_list)
    weight_type: str = key("qint8")  # quanto
    activation_type: str | None = key(None)  # quanto
    mode: str = key("int8")  # bnb
    # bnb LLM.int8 outlier threshold (Dettmers et al. 2022). No coercion: float("6") would accept a string.
    threshold: float = key(6.0, check=_finite_at_least_0)
    # bnb 4-bit; an integral float (64.0) is refused too: int(64.7) / int(True) would truncate or read a bool
    blocksize: int = key(64, what="an integer")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "modules": list(self.modules)}
        if self.exclude:
            out["exclude"] = list(self.exclude)
        if self.name == "quanto":
            out.update(weight_type=self.weight_type, activation_type=self.activation_type)
        else:
            out.update(mode=self.mode, threshold=self.threshold, blocksize=self.blocksize)
        return out


@dataclass
class SmoothSpec:
    """SmoothQuant smoothing (Xiao et al. 2023): migration strength ``alpha`` in [0, 1]."""

    alpha: float = key(0.5, min=0, max=1)  # no coercion: a string, a boolean or a NaN is refused

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha}


@dataclass
class PlanDoc:
    """The schema of a plan document (:meth:`QuantPlan.from_dict`). Name and description are strings: a
    list or a number is refused, not turned into its Python spelling (``name: ['a']`` became "['a']")."""

    name: str = key("custom")
    description: str = key("")
    rules: list[RuleDoc] = key([])
    backend: BackendSpec | None = key(None, what="a mapping")
    smooth: SmoothSpec | None = key(None, what="a mapping")
    rotate: RotateSpec | None = key(None, what="a mapping")
    weights: WeightsSpec | None = key(None, what="a mapping")
    kv_cache: KVCacheSpec | None = key(None, what="a mapping")


def _spec(cls: type, section: dict[str, Any] | None, source: str) -> Any:
    """A plan section's dataclass (None when absent); its own checks' errors name the plan file."""
    if section is None:
        return None
    try:
        return cls(**section)
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {err}") from None


@dataclass
class QuantPlan:
    name: str = "custom"
    description: str = ""
    rules: list[Rule] = field(default_factory=list)
    backend: BackendSpec | None = None
    smooth: SmoothSpec | None = None
    rotate: RotateSpec | None = None
    weights: WeightsSpec | None = None
    kv_cache: KVCacheSpec | None = None

    # -------------------------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        if self.smooth is not None:  # only when set: plans without it keep their dict (and sweep cell keys)
            out["smooth"] = self.smooth.to_dict()
        if self.rotate is not None:
            out["rotate"] = self.rotate.to_dict()
        if self.weights is not None:
            out["weights"] = self.weights.to_dict()
        if self.kv_cache is not None:
            out["kv_cache"] = self.kv_cache.to_dict()
        out["rules"] = [r.to_dict() for r in self.rules]
        if self.backend is not None:
            out["backend"] = self.backend.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> QuantPlan:
        """A plan document checked against :class:`PlanDoc`; errors name ``SOURCE: rules[0].scheme: ...``."""
        if not isinstance(data, dict):
            raise DiffquantError(f"{source}: expected a mapping, got {type(data).__name__}")
        doc = check(PlanDoc, data, source, style=DOCS)
        rules = []
        for i, raw in enumerate(doc["rules"]):
            where = f"{source}: rules[{i}]"
            sites, modules = patterns(raw["sites"]), patterns(raw["modules"])
            if not sites and not modules:
                raise DiffquantError(f"{where}: give 'sites' (taps) and/or 'modules' (Linear weights)")
            scheme = Scheme.parse(raw["scheme"], where=f"{where}.scheme")
            rules.append(Rule(scheme, sites, modules, patterns(raw["exclude"])))
        backend = None
        if doc["backend"] is not None:
            backend = _backend(doc["backend"], set(data["backend"]), f"{source}: backend")
        sections = (doc["rotate"], doc["weights"], doc["kv_cache"])
        if not rules and backend is None and all(section is None for section in sections):
            raise DiffquantError(
                f"{source}: a plan needs at least one rule, a backend, a rotation, a weights or a kv_cache "
                "section"
            )
        smooth = None
        if doc["smooth"] is not None:
            smooth = SmoothSpec(alpha=float(doc["smooth"]["alpha"]))
            if backend is not None:
                raise DiffquantError(
                    f"{source}: smooth: works with fake-quant rules only; the backend {backend.name} converts "
                    "its Linears when the plan is applied, before calibration could smooth them"
                )
        rotate = _spec(RotateSpec, doc["rotate"], source)
        if rotate is not None and backend is not None:
            raise DiffquantError(
                f"{source}: rotate: works with fake-quant rules only; the backend {backend.name} would "
                "replace the Linears that carry the online rotations"
            )
        weights = _spec(WeightsSpec, doc["weights"], source)
        if weights is not None:  # the keys the section sets, each read by its method, or refused
            problem = unused_option(weights.method, data["weights"])
            if problem is not None:
                raise DiffquantError(f"{source}: {problem}")
        if weights is not None and backend is not None:
            raise DiffquantError(
                f"{source}: weights: works with fake-quant rules only; the backend {backend.name} "
                "quantizes its Linears' weights itself"
            )
        kv_cache = _spec(KVCacheSpec, doc["kv_cache"], source)
        if kv_cache is not None and kv_cache.pre_rope and rotate is not None and rotate.qk != "none":
            raise DiffquantError(
                f"{source}: kv_cache.pre_rope caches keys before RoPE, but rotate.qk rotates them after "
                "RoPE; use one of the two"
            )
        return cls(doc["name"], doc["description"], rules, backend, smooth, rotate, weights, kv_cache)

    @classmethod
    def load(cls, spec: str | Path) -> QuantPlan:
        """A preset name, a YAML / JSON file, or a shipped plan by name (``example``; diffquant.shipped)."""
        text = str(spec)
        if text in PRESETS:
            return preset(text)
        path = Path(text)
        if not path.exists() or path.is_dir():  # a FIFO or a device is refused by the bounded reader
            path = shipped_file(text, "plan")
        if path is None:
            hint = did_you_mean(text, [*PRESETS, *shipped_names("plan")])
            if hint:  # a typo: the closest names, not the list of every preset
                raise DiffquantError(
                    f"plan {text!r}: neither a preset nor a file; {hint} (`diffquant presets` and "
                    "`diffquant recipes` list them)"
                )
            raise DiffquantError(
                f"plan {text!r}: neither a preset nor a file; presets: {', '.join(sorted(PRESETS))}; "
                f"shipped plans: {', '.join(shipped_names('plan'))}"
            )

        return cls.from_dict(read_yaml_file(path, "plan"), source=str(path))

    @property
    def uses_static(self) -> bool:
        """True when applying the plan needs a calibration pass (:func:`calibrate`): static scales, quanto
        activations, SmoothQuant smoothing (which needs act-scales of calibration text) or GPTQ weights (which
        need each Linear's calibration inputs)."""
        return (
            self.smooth is not None
            or (self.weights is not None and self.weights.needs_data)
            or any(r.scheme.is_static for r in self.rules)
            or (
                self.backend is not None
                and self.backend.name == "quanto"
                and self.backend.activation_type is not None
            )
        )


def _backend(raw: dict[str, Any], given: set[str], where: str) -> BackendSpec:
    """A checked backend section (``given``: the keys the plan wrote) whose names and options agree."""
    name = raw["name"]
    if name not in BACKENDS:
        raise DiffquantError(f"{where}.name: {name!r}; valid backends: {', '.join(BACKENDS)}")
    spec = BackendSpec(**{**raw, "modules": patterns(raw["modules"]) or ["layers.*"]})
    spec.exclude = patterns(raw["exclude"])
    if name == "quanto":
        extra = sorted(given & {"mode", "threshold", "blocksize"})
        if extra:
            raise DiffquantError(
                f"{where}: '{extra[0]}' is a bnb option; quanto takes weight_type and activation_type"
            )
        if spec.weight_type not in QUANTO_WEIGHTS:
            raise DiffquantError(
                f"{where}.weight_type: {spec.weight_type!r}; valid: {', '.join(QUANTO_WEIGHTS)}"
            )
        if spec.activation_type is not None and spec.activation_type not in QUANTO_ACTIVATIONS:
            raise DiffquantError(
                f"{where}.activation_type: {spec.activation_type!r}; valid: {', '.join(QUANTO_ACTIVATIONS)} "
                "or null"
            )
    else:
        extra = sorted(given & {"weight_type", "activation_type"})
        if extra:
            raise DiffquantError(
                f"{where}: '{extra[0]}' is a quanto option; bnb takes mode, threshold, blocksize"
            )
        if spec.mode not in BNB_MODES:
            raise DiffquantError(f"{where}.mode: {spec.mode!r}; valid: {', '.join(BNB_MODES)}")
        if spec.blocksize not in BNB_BLOCKSIZES:
            raise DiffquantError(
                f"{where}.blocksize: {spec.blocksize}; valid: {', '.join(map(str, BNB_BLOCKSIZES))}"
            )
        spec.threshold = float(spec.threshold)
    return spec


def upgrade_plan(data: Any) -> Any:
    """A plan dict diffquant itself wrote before the plan keys were renamed (a quantized checkpoint's
    ``quant_plan.json``, a sweep's recorded plans) in today's spelling; anything else is returned as it is.
    A plan file a user writes is not upgraded: its old spellings are refused naming the new key (each
    section's ``RENAMED``), so the file gets fixed; what diffquant wrote itself stays readable."""
    if not isinstance(data, dict):
        return data

    def renamed(section: Any, names: dict[str, str]) -> Any:
        return {names.get(k, k): v for k, v in section.items()} if isinstance(section, dict) else section

    out = dict(data)
    if isinstance(out.get("rules"), list):
        out["rules"] = [renamed(rule, RuleDoc.RENAMED) for rule in out["rules"]]
    for section, cls in (("backend", BackendSpec), ("rotate", RotateSpec)):
        if section in out:
            out[section] = renamed(out[section], cls.RENAMED)
    weights = out.get("weights")
    if isinstance(weights, dict) and "bits" in weights:
        weights = {
            ("format" if k == "bits" else k): (f"int{v}" if k == "bits" else v) for k, v in weights.items()
        }
    if "weights" in out:
        out["weights"] = renamed(weights, WeightsSpec.RENAMED)
    kv = out.get("kv_cache")
    if isinstance(kv, dict) and "bits" in kv:
        kv = dict(kv)
        kind, bits = kv.pop("format", "int"), kv.pop("bits")
        kv["format"] = "fp8" if kind == "fp8" else f"int{bits}"
    if "kv_cache" in out:
        out["kv_cache"] = renamed(kv, KVCacheSpec.RENAMED)
    return out


def preset(name: str) -> QuantPlan:
    """The shipped plan ``name`` (the table is :data:`diffquant.quant.presets.PRESET_TABLE`)."""
    return QuantPlan.from_dict(preset_data(name), source=f"preset {name}")
