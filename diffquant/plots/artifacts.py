"""Loading the figure artifacts of a run folder (profiles, attention maps, sweep results, model order).

What a run folder may hold (any subset, but at least profiles or sweep results):

* ``profile/NAME.json`` (a Profile) and ``profile/NAME.maps.safetensors`` (attention maps of one sample);
* ``sweep/results.json`` + ``sweep/sweep.json`` (``diffquant run``) or ``results.json`` + ``sweep.json``
  (``diffquant eval --out RUN``);
* ``manifest.json``, read only for the model order (so colours follow the order the user wrote).

A damaged artifact is a user error naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json
from diffquant.plots.style import model_colors
from diffquant.profile.maps import load_maps
from diffquant.profile.profiler import Profile

if TYPE_CHECKING:
    import torch


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


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_profile(path: Path) -> Profile:
    """A Profile, or a one-line DiffquantError naming ``path`` (corrupt JSON, other format or version, or
    a structure the statistics classes reject)."""
    data = read_json(path, "profile")
    try:
        return Profile.from_dict(data, source=str(path))
    except (DiffquantError, KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        msg = one_line(str(err) if not isinstance(err, KeyError) else f"missing key {err}")
        raise DiffquantError(msg if str(path) in msg else f"{path}: malformed profile ({msg})") from None


def load_map_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(maps, meta) of an attention-map artifact; DiffquantError naming ``path`` when it is missing,
    unreadable, of another format, or holds no (heads, T, T) map."""
    try:
        maps, meta = load_maps(path)
    except DiffquantError as err:
        msg = one_line(str(err))
        raise DiffquantError(msg if str(path) in msg else f"{path}: {msg}") from None
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise DiffquantError(f"{path}: unreadable attention-map file ({one_line(str(err))})") from None
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
        without = _models_without_maps(Path(run_dir))
        for name in art.profiles:
            path = art.profile_paths[name].with_name(f"{art.profile_paths[name].stem}.maps.safetensors")
            if name in without and not path.exists():
                # a layer-streamed profile captures no maps (they need the whole model); a folder joined
                # from parts (the GPU kit's trio) may not have brought them along
                continue
            art.maps[name] = load_map_file(path)
    return art


def _models_without_maps(run_dir: Path) -> set[str]:
    """Models whose maps the run folder lacks by design: profiled layer-streamed (the manifest's ``streamed``
    list) or joined without their maps (its ``maps_left_out`` list); a key that is not a list counts as
    absent, and so does the manifest itself."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return set()
    try:
        manifest = json.loads(path.read_text())
        lists = [manifest.get(key) or [] for key in ("streamed", "maps_left_out")]
    except (OSError, ValueError, AttributeError):
        return set()
    return {str(n) for names in lists if isinstance(names, list) for n in names}
