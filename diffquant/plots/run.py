"""Render every applicable figure of a run folder into RUN/figures/, from its artifacts alone.

What a run folder may hold (any subset, but at least profiles or sweep results):

* ``profile/NAME.json`` (a Profile) and ``profile/NAME.maps.safetensors`` (attention maps of one sample);
* ``sweep/results.json`` + ``sweep/sweep.json`` (``diffquant run``) or ``results.json`` + ``sweep.json``
  (``diffquant eval --out RUN``);
* ``manifest.json``, read only for the model order (so colours follow the order the user wrote).

A damaged artifact is a user error naming the file; an absent optional one (no sweep, no DIFF model for
the lambda figure) only skips its figures. Every image is written atomically, and an index of what was
drawn goes to ``figures/figures.json`` for reports.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json, write_json_atomic
from diffquant.plots import figures as F
from diffquant.plots.style import DEFAULT_DPI, FORMATS, model_colors, safe_name, save_figure
from diffquant.profile.maps import load_maps
from diffquant.profile.profiler import Profile
from diffquant.profile.sites import layer_of

if TYPE_CHECKING:
    import torch


FAMILIES = ("hist", "hist-layers", "layerwise", "maps", "degradation", "act-scales", "lambda")
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


@dataclass
class RunArtifacts:
    """The loaded contents of a run folder (only what figures need)."""

    run_dir: Path
    profiles: dict[str, Profile] = field(default_factory=dict)
    profile_paths: dict[str, Path] = field(default_factory=dict)
    maps: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = field(default_factory=dict)
    results: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    results_path: Path | None = None
    sweep_path: Path | None = None
    order: list[str] = field(default_factory=list)

    def kinds(self) -> dict[str, str]:
        """Attention kind per model, from profile metadata and sweep rows."""
        out: dict[str, str] = {}
        for row in (self.results or {}).get("rows", []):
            if isinstance(row, dict) and row.get("model") is not None:
                out.setdefault(str(row["model"]), str(row.get("attention", "")))
        for name, p in self.profiles.items():
            out[name] = str(p.meta.get("attention", out.get(name, "")))
        return out

    def colors(self) -> dict[str, str]:
        """One colour per model for every figure of this run, in the run's model order."""
        kinds = self.kinds()
        names = [n for n in self.order if n in kinds] + [n for n in kinds if n not in self.order]
        return model_colors([(n, kinds[n]) for n in names])

    def ordered(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        return [n for n in self.order if n in names] + [n for n in names if n not in self.order]


# ------------------------------------------------------------------------------------------- loading
def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_profile(path: Path) -> Profile:
    """A Profile, or a one-line DiffquantError naming ``path`` (corrupt JSON, other format or version, or
    a structure the statistics classes reject)."""
    data = read_json(path, "profile")
    try:
        return Profile.from_dict(data, source=str(path))
    except (DiffquantError, KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        msg = _one_line(str(err) if not isinstance(err, KeyError) else f"missing key {err}")
        raise DiffquantError(msg if str(path) in msg else f"{path}: malformed profile ({msg})") from None


def load_map_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(maps, meta) of an attention-map artifact; DiffquantError naming ``path`` when it is missing,
    unreadable, of another format, or holds no (heads, T, T) map."""
    try:
        maps, meta = load_maps(path)
    except DiffquantError as err:
        msg = _one_line(str(err))
        raise DiffquantError(msg if str(path) in msg else f"{path}: {msg}") from None
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise DiffquantError(f"{path}: unreadable attention-map file ({_one_line(str(err))})") from None
    probs = [v for k, v in maps.items() if k.rsplit(".", 1)[-1] in ("probs", "probs1", "probs2")]
    if not probs or any(v.dim() != 3 or v.shape[-1] != v.shape[-2] for v in probs):
        raise DiffquantError(
            f"{path}: attention-map file holds no (heads, T, T) probs / probs1 / probs2 maps"
        )
    return maps, meta


def _sweep_files(run_dir: Path) -> tuple[Path, Path] | None:
    for folder in (run_dir / "sweep", run_dir):
        results = folder / "results.json"
        if results.is_file():
            return results, folder / "sweep.json"
    return None


def load_run(run_dir: str | Path, *, maps: bool = True) -> RunArtifacts:
    """Load every figure artifact of ``run_dir`` (``maps=False`` skips the attention-map files)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DiffquantError(f"{run_dir}: run folder not found")
    art = RunArtifacts(run_dir)
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = read_json(manifest_path, "manifest")
        if isinstance(manifest, dict):
            recipe = manifest.get("recipe")
            for source in (
                recipe.get("models") if isinstance(recipe, dict) else None,
                manifest.get("checkpoints"),
            ):
                if isinstance(source, dict):
                    art.order += [str(n) for n in source if str(n) not in art.order]
    profile_dir = run_dir / "profile"
    if profile_dir.is_dir():
        for path in sorted(profile_dir.glob("*.json")):
            if path.name.startswith("."):  # a writer's temporary file
                continue
            profile = load_profile(path)
            name = str(profile.meta.get("model") or path.stem)
            art.profiles[name] = profile
            art.profile_paths[name] = path
    found = _sweep_files(run_dir)
    if found is not None:
        results_path, sweep_path = found
        results = read_json(results_path, "sweep results")
        if not (
            isinstance(results, dict)
            and isinstance(results.get("rows"), list)
            and isinstance(results.get("primary"), dict)
        ):
            raise DiffquantError(f"{results_path}: not a sweep results file (expected 'rows' and 'primary')")
        if not sweep_path.is_file():
            raise DiffquantError(
                f"{sweep_path}: sweep description not found (needed beside {results_path.name})"
            )
        sweep = read_json(sweep_path, "sweep description")
        if not (isinstance(sweep, dict) and isinstance(sweep.get("spec"), dict)):
            raise DiffquantError(f"{sweep_path}: not a sweep description (expected a 'spec')")
        if not isinstance(sweep["spec"].get("plans", {}), dict):
            raise DiffquantError(f"{sweep_path}: 'spec.plans' must be a mapping")
        art.results, art.sweep, art.results_path, art.sweep_path = results, sweep, results_path, sweep_path
        art.order += [str(m) for m in sweep["spec"].get("models", {}) if str(m) not in art.order]
    if not art.profiles and art.results is None:
        raise DiffquantError(
            f"{run_dir}: no figure artifacts (expected profile/NAME.json, sweep/results.json or results.json)"
        )
    art.order += [n for n in sorted(art.profiles) if n not in art.order]
    art.profiles = {n: art.profiles[n] for n in art.ordered(art.profiles)}
    if maps:
        for name in art.profiles:
            path = art.profile_paths[name].with_name(f"{art.profile_paths[name].stem}.maps.safetensors")
            art.maps[name] = load_map_file(path)
    return art


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


def _map_layers(art: RunArtifacts) -> list[int]:
    per_model = [{layer_of(k) for k in maps if layer_of(k) is not None} for maps, _ in art.maps.values()]
    return sorted(set.intersection(*per_model)) if per_model else []


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
    colors = art.colors()
    profiles = art.profiles
    records: list[FigureRecord] = []
    produced: set[str] = set()
    tokens = {n: p.meta.get("tokens") for n, p in profiles.items()}
    token_text = ", ".join(f"{n}: {t:,} tokens" for n, t in tokens.items() if isinstance(t, int))

    def emit(family: str, name: str, fig: Any, caption: str, title: str) -> None:
        paths = save_figure(fig, out, name, formats, dpi)
        fig.clear()  # release the artists now; a long run draws dozens of figures
        records.append(FigureRecord(name, tuple(paths), caption, family, title))
        produced.add(family)

    present = [
        k for k in F.HIST_KINDS if any(s.kind == k for p in profiles.values() for s in p.sites.values())
    ]
    if "hist" in families:
        for kind in present:
            try:
                fig = F.fig_histograms(profiles, kind, colors=colors)
            except DiffquantError:  # sites of this kind saw no finite value
                continue
            emit(
                "hist",
                f"hist-{kind}",
                fig,
                f"Histogram of |x| of {F.KIND_TITLES[kind]} ({kind}), every such site pooled per model "
                f"({token_text}); log counts, bins x{F._hist_bar_width():.3f} wide; x up to past the largest "
                f"|x| (logarithmic from the {100 * F.HIST_LOW_QUANTILE:g} % quantile when the largest is "
                f"{F.HIST_LOG_RATIO:g}x the median or more, else linear from 0). Dashed: each model's "
                f"largest |x|; dash-dot: |mean| + 6 std; dotted black: |x| = 6 (LLM.int8 threshold).",
                f"Histogram of |x|: {F.KIND_TITLES[kind]}",
            )
    if "hist-layers" in families:
        for kind in present:
            try:
                fig = F.fig_histograms(profiles, kind, per_layer=True, colors=colors)
            except DiffquantError:  # only non-layer sites of this kind (e.g. lm_head.input)
                continue
            emit(
                "hist-layers",
                f"hist-layers-{kind}",
                fig,
                f"Histograms of |x| of {F.KIND_TITLES[kind]} ({kind}) per layer (sites of the layer pooled), "
                f"models overlaid; markers as in hist-{kind}.",
                f"Histograms of |x| per layer: {F.KIND_TITLES[kind]}",
            )
    if "layerwise" in families:
        for kind in LAYERWISE_KINDS:
            if kind not in present:
                continue
            try:
                fig = F.fig_layerwise(profiles, kind, colors=colors)
            except DiffquantError:  # no per-layer site of this kind
                continue
            emit(
                "layerwise",
                f"layerwise-{kind}",
                fig,
                f"Top-1/2/3 and median |x| of {F.KIND_TITLES[kind]} per layer, per model (log scale; "
                f"massive-activation view, Sun et al. 2024).",
                f"Largest and median |x| per layer: {F.KIND_TITLES[kind]}",
            )
    if "maps" in families and art.maps:
        layers = _map_layers(art)
        if not layers:
            raise DiffquantError(f"{art.run_dir / 'profile'}: the attention-map files share no layer")
        chosen = layers[len(layers) // 2] if layer is None else layer
        if chosen not in layers:
            raise DiffquantError(f"--layer {chosen}: attention maps hold layers {layers[0]}..{layers[-1]}")
        fig = F.fig_attention_maps(art.maps, chosen, head, colors=colors)
        emit(
            "maps",
            f"maps-L{chosen}-H{head}",
            fig,
            f"Attention maps of layer {chosen}, head {head} for one sample: DIFF rows show A1, A2, λ·A2 and "
            f"A1 − λ·A2 (DIFF V2: λ per query row); the baseline's softmax map on the right. RdBu_r "
            f"centred at 0; grey = causally masked.",
            f"Attention maps, layer {chosen}, head {head}",
        )
    if "degradation" in families and art.results is not None:
        assert art.sweep is not None and art.sweep_path is not None
        for task in art.results["primary"]:
            try:
                fig = F.fig_degradation(art.results, art.sweep, task, colors=colors)
            except DiffquantError as err:
                if what is None:  # drawing what the artifacts allow: a sweep of `none` alone has no curve
                    continue
                msg = _one_line(str(err))
                raise DiffquantError(f"{art.sweep_path}: {msg}") from None
            metric = art.results["primary"][task].get("metric")
            emit(
                "degradation",
                f"degradation-{safe_name(task)}",
                fig,
                f"{task}: {metric} vs bits per element for single-format plans (one panel per model, all "
                f"on one y scale; one line per granularity, 16 = unquantized, dotted = unquantized level, "
                f"grey dashed = chance where the task reports it); other plans as bars of the "
                f"change vs unquantized.",
                f"Degradation under quantization: {task} ({metric})",
            )
    if "act-scales" in families and profiles:
        site = F.default_act_site(profiles)
        if site is not None:
            fig = F.fig_act_scales(profiles, site, colors=colors)
            emit(
                "act-scales",
                "act-scales",
                fig,
                f"Per-channel abs-max of {site} per model (SmoothQuant act scales), by channel and sorted.",
                f"Per-channel abs-max: {site}",
            )
    if "lambda" in families and any(F.lambda_summaries(p) for p in profiles.values()):
        fig = F.fig_lambda(profiles, colors=colors)
        emit(
            "lambda",
            "lambda",
            fig,
            "λ per layer for each DIFF model (V1: the learned scalar; V2: mean of sigmoid(Wx) over tokens and "
            "heads, band = min..max) and, for DIFF V2, per head (mean ± std, min..max).",
            "λ per layer and per head",
        )
    if what is not None:
        missing = [f for f in families if f not in produced]
        if missing:
            raise DiffquantError(
                f"{art.run_dir}: cannot draw {missing[0]!r} figures from this run's artifacts "
                f"(drawn: {', '.join(sorted(produced)) or 'none'})"
            )
    if records:
        index_path = out / INDEX_NAME
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
    return records
