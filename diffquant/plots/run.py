"""Render every applicable figure of a run folder into RUN/figures/, from its artifacts alone.

The run folder is read by :mod:`diffquant.plots.artifacts` (what it may hold is described there). Each
figure family is one function in the table :data:`FIGURES` (family -> function yielding the family's
figures, drawn from the loaded artifacts); :func:`render_run` walks the table in order, saves each figure
and records it. An absent optional artifact (no sweep, no DIFF model for the lambda figure) only skips its
figures. Every image is written atomically, and an index of what was drawn goes to
``figures/figures.json`` for reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import write_json_atomic
from diffquant.plots.artifacts import (  # noqa: F401 (old import path)
    RunArtifacts,
    _sweep_files,
    load_map_file,
    load_profile,
    load_run,
    one_line,
)
from diffquant.plots.channels import default_act_site, fig_act_scales
from diffquant.plots.common import KIND_TITLES
from diffquant.plots.degradation import fig_degradation
from diffquant.plots.hist import (
    HIST_KINDS,
    HIST_LOG_RATIO,
    HIST_LOW_QUANTILE,
    fig_histograms,
    hist_bar_width,
)
from diffquant.plots.layers import fig_lambda, fig_layerwise, lambda_summaries
from diffquant.plots.maps import fig_attention_maps
from diffquant.plots.style import DEFAULT_DPI, FORMATS, safe_name, save_figure
from diffquant.profile.sites import layer_of

LAYERWISE_KINDS = ("resid", "logits")
FIGURES_DIR = "figures"
INDEX_NAME = "figures.json"


@dataclass(frozen=True)
class FigureRecord:
    """One rendered figure: its file stem, the files written (one per format), a caption, its family and
    a short title (for a report's figure index)."""

    name: str
    paths: tuple[Path, ...]
    caption: str
    kind: str
    title: str = ""

    @property
    def path(self) -> Path:
        """The first file (the PNG with the default formats)."""
        return self.paths[0]

    def to_dict(self, root: Path | None = None) -> dict[str, Any]:
        files = [str(p.relative_to(root)) if root is not None else str(p) for p in self.paths]
        return {
            "name": self.name,
            "kind": self.kind,
            "files": files,
            "caption": self.caption,
            "title": self.title,
        }


@dataclass(frozen=True)
class Drawn:
    """One figure a family drew, not yet saved: file stem, the matplotlib Figure, caption and title."""

    name: str
    figure: Any
    caption: str
    title: str


@dataclass(frozen=True)
class FigureContext:
    """What a family draws from: the run's artifacts, its colours, and the options of :func:`render_run`."""

    art: RunArtifacts
    colors: dict[str, str]
    strict: bool  # the user named the families: a family the artifacts cannot feed is an error
    layer: int | None
    head: int

    @property
    def present(self) -> list[str]:
        """Histogram kinds some profile has a site of, in HIST_KINDS order."""
        profiles = self.art.profiles.values()
        return [k for k in HIST_KINDS if any(s.kind == k for p in profiles for s in p.sites.values())]

    @property
    def token_text(self) -> str:
        tokens = {n: p.meta.get("tokens") for n, p in self.art.profiles.items()}
        return ", ".join(f"{n}: {t:,} tokens" for n, t in tokens.items() if isinstance(t, int))


# ---------------------------------------------------------------------------------------- families
def draw_hist(ctx: FigureContext) -> Iterator[Drawn]:
    for kind in ctx.present:
        try:
            fig = fig_histograms(ctx.art.profiles, kind, colors=ctx.colors)
        except DiffquantError:  # sites of this kind saw no finite value
            continue
        yield Drawn(
            f"hist-{kind}",
            fig,
            f"Histogram of |x| of {KIND_TITLES[kind]} ({kind}), every such site pooled per model "
            f"({ctx.token_text}); log counts, bins x{hist_bar_width():.3f} wide; x up to past the largest "
            f"|x| (logarithmic from the {100 * HIST_LOW_QUANTILE:g} % quantile when the largest is "
            f"{HIST_LOG_RATIO:g}x the median or more, else linear from 0). Dashed: each model's "
            f"largest |x|; dash-dot: |mean| + 6 std; dotted black: |x| = 6 (LLM.int8 threshold).",
            f"Histogram of |x|: {KIND_TITLES[kind]}",
        )


def draw_hist_layers(ctx: FigureContext) -> Iterator[Drawn]:
    for kind in ctx.present:
        try:
            fig = fig_histograms(ctx.art.profiles, kind, per_layer=True, colors=ctx.colors)
        except DiffquantError:  # only non-layer sites of this kind (e.g. lm_head.input)
            continue
        yield Drawn(
            f"hist-layers-{kind}",
            fig,
            f"Histograms of |x| of {KIND_TITLES[kind]} ({kind}) per layer (sites of the layer pooled), "
            f"models overlaid; markers as in hist-{kind}.",
            f"Histograms of |x| per layer: {KIND_TITLES[kind]}",
        )


def draw_layerwise(ctx: FigureContext) -> Iterator[Drawn]:
    present = ctx.present
    for kind in LAYERWISE_KINDS:
        if kind not in present:
            continue
        try:
            fig = fig_layerwise(ctx.art.profiles, kind, colors=ctx.colors)
        except DiffquantError:  # no per-layer site of this kind
            continue
        yield Drawn(
            f"layerwise-{kind}",
            fig,
            f"Top-1/2/3 and median |x| of {KIND_TITLES[kind]} per layer, per model (log scale; "
            f"massive-activation view, Sun et al. 2024).",
            f"Largest and median |x| per layer: {KIND_TITLES[kind]}",
        )


def _map_layers(art: RunArtifacts) -> list[int]:
    per_model = [{layer_of(k) for k in maps if layer_of(k) is not None} for maps, _ in art.maps.values()]
    return sorted(set.intersection(*per_model)) if per_model else []


def draw_maps(ctx: FigureContext) -> Iterator[Drawn]:
    art, head = ctx.art, ctx.head
    if not art.maps:
        return
    layers = _map_layers(art)
    if not layers:
        raise DiffquantError(f"{art.run_dir / 'profile'}: the attention-map files share no layer")
    chosen = layers[len(layers) // 2] if ctx.layer is None else ctx.layer
    if chosen not in layers:
        raise DiffquantError(f"--layer {chosen}: attention maps hold layers {layers[0]}..{layers[-1]}")
    yield Drawn(
        f"maps-L{chosen}-H{head}",
        fig_attention_maps(art.maps, chosen, head, colors=ctx.colors),
        f"Attention maps of layer {chosen}, head {head} for one sample: DIFF rows show A1, A2, λ·A2 and "
        f"A1 − λ·A2 (DIFF V2: λ per query row); the baseline's softmax map on the right. RdBu_r "
        f"centred at 0; grey = causally masked.",
        f"Attention maps, layer {chosen}, head {head}",
    )


def draw_degradation(ctx: FigureContext) -> Iterator[Drawn]:
    art = ctx.art
    if art.results is None:
        return
    assert art.sweep is not None and art.sweep_path is not None
    for task in art.results["primary"]:
        try:
            fig = fig_degradation(art.results, art.sweep, task, colors=ctx.colors)
        except DiffquantError as err:
            if not ctx.strict:  # drawing what the artifacts allow: a sweep of `none` alone has no curve
                continue
            raise DiffquantError(f"{art.sweep_path}: {one_line(str(err))}") from None
        metric = art.results["primary"][task].get("metric")
        yield Drawn(
            f"degradation-{safe_name(task)}",
            fig,
            f"{task}: {metric} vs bits per element for single-format plans (one panel per model, all "
            f"on one y scale; one line per granularity, 16 = unquantized, dotted = unquantized level, "
            f"grey dashed = chance where the task reports it); other plans as bars of the "
            f"change vs unquantized.",
            f"Degradation under quantization: {task} ({metric})",
        )


def draw_act_scales(ctx: FigureContext) -> Iterator[Drawn]:
    profiles = ctx.art.profiles
    site = default_act_site(profiles) if profiles else None
    if site is None:
        return
    yield Drawn(
        "act-scales",
        fig_act_scales(profiles, site, colors=ctx.colors),
        f"Per-channel abs-max of {site} per model (SmoothQuant act scales), by channel and sorted.",
        f"Per-channel abs-max: {site}",
    )


def draw_lambda(ctx: FigureContext) -> Iterator[Drawn]:
    profiles = ctx.art.profiles
    if not any(lambda_summaries(p) for p in profiles.values()):
        return
    yield Drawn(
        "lambda",
        fig_lambda(profiles, colors=ctx.colors),
        "λ per layer for each DIFF model (V1: the learned scalar; V2: mean of sigmoid(Wx) over tokens and "
        "heads, band = min..max) and, for DIFF V2, per head (mean ± std, min..max).",
        "λ per layer and per head",
    )


# The figure registry: family -> the function drawing its figures, in the order render_run draws them.
FIGURES: dict[str, Callable[[FigureContext], Iterator[Drawn]]] = {
    "hist": draw_hist,
    "hist-layers": draw_hist_layers,
    "layerwise": draw_layerwise,
    "maps": draw_maps,
    "degradation": draw_degradation,
    "act-scales": draw_act_scales,
    "lambda": draw_lambda,
}
FAMILIES = tuple(FIGURES)


# ------------------------------------------------------------------------------------------ rendering
def _check_what(what: Iterable[str] | str | None) -> tuple[str, ...]:
    if what is None:
        return FAMILIES
    chosen = [what] if isinstance(what, str) else list(what)
    unknown = [w for w in chosen if w not in FAMILIES]
    if unknown:
        raise DiffquantError(f"unknown figure {unknown[0]!r}; valid: {', '.join(FAMILIES)}")
    return tuple(w for w in FAMILIES if w in chosen)


def _check_formats(formats: Sequence[str] | str) -> tuple[str, ...]:
    chosen = [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in chosen if f not in FORMATS]
    if bad or not chosen:
        raise DiffquantError(f"figure format {bad[0] if bad else ''!r}: valid formats: {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(chosen))


def _write_index(art: RunArtifacts, records: list[FigureRecord], dpi: int) -> None:
    index_path = art.run_dir / FIGURES_DIR / INDEX_NAME
    previous = []
    if index_path.is_file():  # keep entries of families not redrawn this time
        try:
            previous = json.loads(index_path.read_text()).get("figures", [])
        except (json.JSONDecodeError, AttributeError, OSError):
            previous = []
    names = {r.name for r in records}
    kept = [e for e in previous if isinstance(e, dict) and e.get("name") not in names]
    entries = kept + [r.to_dict(art.run_dir) for r in records]
    write_json_atomic(index_path, {"dpi": dpi, "figures": entries})


def render_run(
    run_dir: str | Path,
    what: Iterable[str] | str | None = None,
    formats: Sequence[str] | str = ("png",),
    dpi: int = DEFAULT_DPI,
    layer: int | None = None,
    head: int = 0,
) -> list[FigureRecord]:
    """Draw every applicable figure of ``run_dir`` into RUN/figures/NAME.FMT and return their records.

    Args:
        what: figure families to draw (``hist``, ``hist-layers``, ``layerwise``, ``maps``, ``degradation``,
            ``act-scales``, ``lambda``); None = all. A family named here that the run cannot feed (e.g.
            ``degradation`` without sweep results) is an error; with None it is skipped.
        formats: any of png, svg, pdf; each figure is written once per format.
        dpi: raster resolution; a PNG is figsize x dpi pixels.
        layer, head: the attention maps shown (layer None = the middle layer common to all models).
    """
    families = _check_what(what)
    formats = _check_formats(formats)
    if not isinstance(dpi, int) or isinstance(dpi, bool) or not 10 <= dpi <= 2400:
        raise DiffquantError(f"dpi: expected an integer in 10..2400, got {dpi!r}")
    art = load_run(run_dir, maps="maps" in families)
    out = art.run_dir / FIGURES_DIR
    ctx = FigureContext(art, art.colors(), strict=what is not None, layer=layer, head=head)
    records: list[FigureRecord] = []
    produced: set[str] = set()
    for family in families:
        for drawn in FIGURES[family](ctx):
            paths = save_figure(drawn.figure, out, drawn.name, formats, dpi)
            drawn.figure.clear()  # release the artists now; a long run draws dozens of figures
            records.append(FigureRecord(drawn.name, tuple(paths), drawn.caption, family, drawn.title))
            produced.add(family)
    if what is not None:
        missing = [f for f in families if f not in produced]
        if missing:
            raise DiffquantError(
                f"{art.run_dir}: cannot draw {missing[0]!r} figures from this run's artifacts "
                f"(drawn: {', '.join(sorted(produced)) or 'none'})"
            )
    if records:
        _write_index(art, records, dpi)
    return records
