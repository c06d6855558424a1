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

from diffquant import __version__
from diffquant.errors import DiffquantError, did_you_mean
from diffquant.io.artifacts import write_json_atomic
from diffquant.plots.artifacts import (  # noqa: F401 (old import path)
    RunArtifacts,
    _sweep_files,
    load_map_file,
    load_profile,
    load_run,
    one_line,
)
from diffquant.plots.channels import fig_act_scales, resolve_act_site
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
from diffquant.progress import is_quiet, progress, write

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
    linear: str | None = None  # the act-scales figure's Linear (None: the one with the largest act scale)
    layers: tuple[int, ...] | None = None  # the per-layer figures' layers (None: every layer)

    @property
    def layer_profiles(self) -> dict[str, Any]:
        """The profiles the per-layer figures draw (hist-layers, layerwise, lambda): only the sites and
        attention metrics of ``layers`` when it is set, else the whole profiles."""
        if self.layers is None:
            return self.art.profiles
        keep = set(self.layers)
        return {
            name: type(p)(
                sites={n: s for n, s in p.sites.items() if layer_of(n) in keep},
                attention={k: v for k, v in p.attention.items() if layer_of(k) in keep},
                meta=p.meta,
            )
            for name, p in self.art.profiles.items()
        }

    @property
    def layers_note(self) -> str:
        """What a per-layer figure's caption adds when ``layers`` chose a subset."""
        return "" if self.layers is None else f" Layers {format_layers(self.layers)} only (--layers)."

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
    profiles = ctx.layer_profiles
    for kind in ctx.present:
        try:
            fig = fig_histograms(profiles, kind, per_layer=True, colors=ctx.colors)
        except DiffquantError:  # only non-layer sites of this kind (e.g. lm_head.input)
            continue
        yield Drawn(
            f"hist-layers-{kind}",
            fig,
            f"Histograms of |x| of {KIND_TITLES[kind]} ({kind}) per layer (sites of the layer pooled), "
            f"models overlaid; markers as in hist-{kind}.{ctx.layers_note}",
            f"Histograms of |x| per layer: {KIND_TITLES[kind]}",
        )


def draw_layerwise(ctx: FigureContext) -> Iterator[Drawn]:
    present = ctx.present
    for kind in LAYERWISE_KINDS:
        if kind not in present:
            continue
        try:
            fig = fig_layerwise(ctx.layer_profiles, kind, colors=ctx.colors)
        except DiffquantError:  # no per-layer site of this kind
            continue
        yield Drawn(
            f"layerwise-{kind}",
            fig,
            f"Top-1/2/3 and median |x| of {KIND_TITLES[kind]} per layer, per model (log scale; "
            f"massive-activation view, Sun et al. 2024).{ctx.layers_note}",
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
            f"on one y scale; one line per granularity, ending at the unquantized model placed at its "
            f"dtype's width (fp32: 32); dotted = unquantized level, grey dashed = chance where the task "
            f"reports it); other plans (mixed formats, weights sections such as RTN / GPTQ, backends, KV "
            f"caches, rotation) as bars of the change vs unquantized. Error bars: the change ± 2 standard "
            f"errors, paired over the windows both cells scored where the results keep them (the figure's "
            f"bottom line says which rule applies).",
            f"Degradation under quantization: {task} ({metric})",
        )


def draw_act_scales(ctx: FigureContext) -> Iterator[Drawn]:
    profiles = ctx.art.profiles
    site = resolve_act_site(profiles, ctx.linear) if profiles or ctx.linear is not None else None
    if site is None:
        return
    chosen = (
        "chosen with --linear" if ctx.linear is not None else "the Linear input with the largest act scale"
    )
    yield Drawn(
        "act-scales",
        fig_act_scales(profiles, site, colors=ctx.colors),
        f"Per-channel abs-max of {site} ({chosen}) per model (SmoothQuant act scales), by channel and "
        "sorted.",
        f"Per-channel abs-max: {site}",
    )


def draw_lambda(ctx: FigureContext) -> Iterator[Drawn]:
    profiles = ctx.layer_profiles
    if not any(lambda_summaries(p) for p in profiles.values()):
        return
    yield Drawn(
        "lambda",
        fig_lambda(profiles, colors=ctx.colors),
        "λ per layer for each DIFF model (V1: the learned scalar; V2: mean of sigmoid(Wx) over tokens and "
        f"heads, band = min..max) and, for DIFF V2, per head (mean ± std, min..max).{ctx.layers_note}",
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
LAYERS_FORMAT = "layer numbers and ranges, e.g. 3-5 or 0,4,8-11"


def parse_layers(text: str) -> tuple[int, ...]:
    """``--layers`` text (``3-5``, ``0,4,8-11``) as sorted layer numbers; anything else is one line."""
    layers: set[int] = set()
    for part in str(text).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise DiffquantError(f"--layers {text!r}: expected {LAYERS_FORMAT}")
        layers.update(range(int(low), int(high if dash else low) + 1))
    return tuple(sorted(layers))


def format_layers(layers: Iterable[int]) -> str:
    """Layer numbers as ranges: (3, 4, 5, 9) -> '3-5, 9'."""
    runs: list[list[int]] = []
    for layer in sorted(set(layers)):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _check_layers(layers: Iterable[int] | str | None, profiles: dict[str, Any]) -> tuple[int, ...] | None:
    """``layers`` (numbers, or ``--layers`` text) checked against the layers the profiles hold."""
    if layers is None:
        return None
    chosen = parse_layers(layers) if isinstance(layers, str) else tuple(sorted(set(layers)))
    held = sorted({lay for p in profiles.values() for n in p.sites if (lay := layer_of(n)) is not None})
    if not chosen or not held or not set(chosen) & set(held):
        where = f"the profiles hold layers {format_layers(held)}" if held else "the run holds no profile"
        raise DiffquantError(f"--layers {format_layers(chosen) or repr(layers)}: {where}")
    return chosen


def _check_what(what: Iterable[str] | str | None) -> tuple[str, ...]:
    if what is None:
        return FAMILIES
    chosen = [what] if isinstance(what, str) else list(what)
    unknown = [w for w in chosen if w not in FAMILIES]
    if unknown:
        hint = did_you_mean(unknown[0], FAMILIES)
        raise DiffquantError(
            f"unknown figure {unknown[0]!r}; {hint + ' ' if hint else ''}valid: {', '.join(FAMILIES)}"
        )
    return tuple(w for w in FAMILIES if w in chosen)


def _check_formats(formats: Sequence[str] | str) -> tuple[str, ...]:
    chosen = [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in chosen if f not in FORMATS]
    if bad or not chosen:
        raise DiffquantError(f"figure format {bad[0] if bad else ''!r}: valid formats: {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(chosen))


def _read_index(run_dir: Path) -> dict[str, Any]:
    """figures.json ({} when absent or unreadable: nothing is known to be current)."""
    try:
        index = json.loads((run_dir / FIGURES_DIR / INDEX_NAME).read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return {}
    return index if isinstance(index, dict) else {}


def inputs_stamp(run_dir: Path) -> list[list[Any]]:
    """What every figure is drawn from, as [relative path, size, mtime_ns] per artifact file (manifest,
    profiles, attention maps, sweep results and description; the colours depend on all of them), plus the
    diffquant version that drew them: a figure recorded with this stamp is current."""
    files = [run_dir / "manifest.json", *sorted((run_dir / "profile").glob("*.json"))]
    files += sorted((run_dir / "profile").glob("*.maps.safetensors"))
    found = _sweep_files(run_dir)
    files += list(found) if found is not None else []
    out: list[list[Any]] = [["diffquant", __version__, 0]]
    for path in files:
        if path.name.startswith(".") or not path.is_file():  # a writer's temporary file; absent manifest
            continue
        st = path.stat()
        out.append([str(path.relative_to(run_dir)), st.st_size, st.st_mtime_ns])
    return out


def _current(
    run_dir: Path, families: tuple[str, ...], formats: tuple[str, ...], dpi: int
) -> dict[str, list[FigureRecord]]:
    """{family: its recorded figures} for each family figures.json records as drawn from exactly the
    current artifacts (:func:`inputs_stamp`) at ``dpi`` in every one of ``formats``, with its files present."""
    index = _read_index(run_dir)
    stamps = index.get("families")
    if not isinstance(stamps, dict):
        return {}
    stamp = inputs_stamp(run_dir)
    out: dict[str, list[FigureRecord]] = {}
    entries = [e for e in index.get("figures", []) if isinstance(e, dict)]
    for family in families:
        recorded = stamps.get(family)
        if not isinstance(recorded, dict) or recorded.get("inputs") != stamp or recorded.get("dpi") != dpi:
            continue
        if not set(formats) <= set(recorded.get("formats") or ()):
            continue
        records = []
        for e in (e for e in entries if e.get("kind") == family):
            paths = tuple(run_dir / f for f in e.get("files", []) if Path(f).suffix[1:] in formats)
            if len(paths) != len(formats) or not all(p.is_file() for p in paths):
                break
            records.append(
                FigureRecord(
                    str(e.get("name")), paths, str(e.get("caption", "")), family, str(e.get("title", ""))
                )
            )
        else:
            out[family] = records
    return out


def _write_index(
    run_dir: Path, records: list[FigureRecord], drawn: dict[str, dict[str, Any]], dpi: int
) -> None:
    """figures.json: every figure with its files and caption, and per family drawn the stamp it was drawn
    from (inputs, formats, dpi); entries and stamps of families not drawn this time are kept."""
    index = _read_index(run_dir)
    previous = [e for e in index.get("figures", []) if isinstance(e, dict)]
    stamps = index.get("families") if isinstance(index.get("families"), dict) else {}
    names = {r.name for r in records}
    kept = [e for e in previous if e.get("kind") not in drawn and e.get("name") not in names]
    entries = kept + [r.to_dict(run_dir) for r in records]
    stamps = {f: v for f, v in stamps.items() if f not in drawn} | drawn
    write_json_atomic(
        run_dir / FIGURES_DIR / INDEX_NAME, {"dpi": dpi, "figures": entries, "families": stamps}
    )


def _say(line: str) -> None:
    """A progress line on stderr (``plot: hist: drawing``), unless quiet."""
    if not is_quiet():
        write(line)


def render_run(
    run_dir: str | Path,
    what: Iterable[str] | str | None = None,
    formats: Sequence[str] | str = ("png",),
    dpi: int = DEFAULT_DPI,
    layer: int | None = None,
    head: int = 0,
    linear: str | None = None,
    reuse: bool = False,
    command: str = "plot",
    layers: Iterable[int] | str | None = None,
) -> list[FigureRecord]:
    """Draw every applicable figure of ``run_dir`` into RUN/figures/NAME.FMT and return their records.

    Args:
        what: figure families to draw (``hist``, ``hist-layers``, ``layerwise``, ``maps``, ``degradation``,
            ``act-scales``, ``lambda``); None = all. A family named here that the run cannot feed (e.g.
            ``degradation`` without sweep results) is an error; with None it is skipped.
        formats: any of png, svg, pdf; each figure is written once per format.
        dpi: raster resolution; a PNG is figsize x dpi pixels.
        layer, head: the attention maps shown (layer None = the middle layer common to all models).
        linear: the Linear of the act-scales figure (``layers.11.mlp.down``); None = the one with the
            largest act scale in any profile.
        reuse: keep the figures of each family that figures.json records as drawn from the current
            artifacts (same files, sizes and mtimes, same diffquant version) at this dpi in these formats,
            whatever layer / head / linear they were drawn with (a report keeps what ``plot`` drew);
            redraw the others.
        command: the name progress lines start with (``plot: hist: drawing``, one as each family starts;
            within a family a line every progress interval while its figures take longer, naming the last
            figure written).
        layers: the layers of the per-layer figures (hist-layers, layerwise, lambda): layer numbers or
            ``--layers`` text (``3-5``, ``0,4,8-11``); None = every layer. Layers no profile holds are an
            error naming the ones it does.
    """
    families = _check_what(what)
    formats = _check_formats(formats)
    if not isinstance(dpi, int) or isinstance(dpi, bool) or not 10 <= dpi <= 2400:
        raise DiffquantError(f"dpi: expected an integer in 10..2400, got {dpi!r}")
    current = _current(Path(run_dir), families, formats, dpi) if reuse else {}
    if current and all(f in current for f in families):
        kept = [r for f in families for r in current[f]]
        _say(f"{command}: {len(kept)} figures current (drawn from these artifacts at {dpi} dpi), reused")
        return kept
    if isinstance(layers, str):
        parse_layers(layers)  # malformed text is refused before the run is read
    art = load_run(run_dir, maps="maps" in families and "maps" not in current)
    if linear is not None and "act-scales" in families:
        resolve_act_site(art.profiles, linear)  # a bad name is refused before any figure is drawn
    chosen_layers = _check_layers(layers, art.profiles)
    out = art.run_dir / FIGURES_DIR
    ctx = FigureContext(
        art,
        art.colors(),
        strict=what is not None,
        layer=layer,
        head=head,
        linear=linear,
        layers=chosen_layers,
    )
    records: list[FigureRecord] = []
    produced: set[str] = set()
    stamps: dict[str, dict[str, Any]] = {}
    stamp = inputs_stamp(art.run_dir)
    for number, family in enumerate(families, start=1):
        where = f"family {number} of {len(families)}"
        if family in current:
            records += current[family]
            if current[family]:
                produced.add(family)
            _say(f"{command}: {family}: {len(current[family])} figures current, reused ({where})")
            continue
        _say(f"{command}: {family}: drawing ({where})")
        # A family of a 30-layer model's figures takes minutes: a line every interval while it draws
        # (the heartbeat speaks during one long figure too), with the last figure written.
        with progress(desc=f"{command}: {family}", unit="figure", leave=False) as drawing:
            for drawn in FIGURES[family](ctx):
                paths = save_figure(drawn.figure, out, drawn.name, formats, dpi)
                drawn.figure.clear()  # release the artists now; a long run draws dozens of figures
                records.append(FigureRecord(drawn.name, tuple(paths), drawn.caption, family, drawn.title))
                produced.add(family)
                drawing.set_postfix_str(f"last {drawn.name}")
                drawing.update(1)
        stamps[family] = {"inputs": stamp, "formats": list(formats), "dpi": dpi}
    if what is not None:
        missing = [f for f in families if f not in produced]
        if missing:
            raise DiffquantError(
                f"{art.run_dir}: cannot draw {missing[0]!r} figures from this run's artifacts "
                f"(drawn: {', '.join(sorted(produced)) or 'none'})"
            )
    if records or stamps:
        _write_index(art.run_dir, [r for r in records if r.kind in stamps], stamps, dpi)
    return records
