"""The YAML files installed with diffquant: run and training recipes, quantization plans, lm-eval task YAMLs.

They live in ``diffquant/shipped/recipes/`` (``plans/`` and ``lmeval/`` below it), so a wheel carries them; a
clone's top-level ``recipes`` is a link to that folder, so the paths the docs cite (``recipes/smollm2.yaml``)
are the same files. One rule resolves a name, for ``run``, ``train`` and ``--plan`` alike: an existing path
wins; else a shipped file by name (``smollm2``, ``smollm2.yaml``, or the clone's path ``recipes/smollm2.yaml``
from any folder); else a one-line error listing the shipped names. Torch-free and yaml-free to import: the
``run`` / ``train`` help lists the names (``diffquant recipes`` reads the files for their descriptions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from diffquant.errors import DiffquantError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
PLANS_DIR = RECIPES_DIR / "plans"
LMEVAL_DIR = RECIPES_DIR / "lmeval"  # always on lm-eval's include path (diffquant.eval.lmeval)

Kind = Literal["run", "train", "plan", "lmeval"]
_FOLDERS: dict[str, Path] = {
    "run": RECIPES_DIR,
    "train": RECIPES_DIR,
    "plan": PLANS_DIR,
    "lmeval": LMEVAL_DIR,
}
_CLONE_PREFIX = {
    "run": "recipes/",
    "train": "recipes/",
    "plan": "recipes/plans/",
    "lmeval": "recipes/lmeval/",
}
# A run recipe chains stages over its `models`; a training recipe (diffquant.train.TrainConfig) has none.
_RUN_RECIPE = re.compile(r"^models\s*:", re.MULTILINE)


def _kind_of(path: Path) -> Kind:
    if path.parent == RECIPES_DIR:
        return "run" if _RUN_RECIPE.search(path.read_text(encoding="utf-8")) else "train"
    return "plan" if path.parent == PLANS_DIR else "lmeval"


def shipped_names(kind: Kind) -> list[str]:
    """The shipped files of one kind by name (file stem), sorted."""
    paths = sorted(_FOLDERS[kind].glob("*.yaml"), key=lambda p: p.stem)  # kv-cache before kv-cache-zoo
    return [p.stem for p in paths if _kind_of(p) == kind]


def shipped_file(spec: str | Path, kind: Kind) -> Path | None:
    """The shipped file of ``kind`` that ``spec`` names (``NAME``, ``NAME.yaml`` or a clone's
    ``recipes/.../NAME.yaml``), or None. Existing paths are the caller's to prefer (see :func:`resolve`)."""
    text = str(spec).removeprefix("./").removeprefix(_CLONE_PREFIX[kind])
    if not text or "/" in text or "\\" in text:
        return None
    name = text.removesuffix(".yaml").removesuffix(".yml")
    return _FOLDERS[kind] / f"{name}.yaml" if name in shipped_names(kind) else None


def resolve(spec: str | Path, kind: Kind) -> Path:
    """The file ``spec`` names: an existing path wins, else the shipped file of that name; a name that is
    neither is a one-line error listing the shipped names of ``kind``."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    found = shipped_file(spec, kind)
    if found is not None:
        return found
    what = {"run": "recipe", "train": "training recipe", "plan": "plan", "lmeval": "lm-eval task"}[kind]
    raise DiffquantError(
        f"{what} {str(spec)!r}: no such file, and not a shipped {what}; shipped: "
        f"{', '.join(shipped_names(kind)) or 'none'}"
    )


@dataclass(frozen=True)
class Shipped:
    """One shipped file: its kind, name, path and a one-line description."""

    kind: Kind
    name: str
    path: Path
    description: str


def describe(path: Path) -> str:
    """A shipped file's one line: its ``description:`` key, else the first sentence of its top comment (an
    lm-eval task YAML is not parsed: its ``!function`` tags need lm-eval's loader)."""
    from diffquant.textfiles import read_yaml_file  # yaml: not for the --help that lists the names

    raw = None if path.parent == LMEVAL_DIR else read_yaml_file(path, "recipe")
    if isinstance(raw, dict) and isinstance(raw.get("description"), str) and raw["description"].strip():
        return " ".join(raw["description"].split())
    comment = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    text = " ".join(" ".join(comment).split())
    first = re.split(r"(?<=[a-z0-9)])[.:;] ", text, maxsplit=1)[0].rstrip(".:;")
    if first.count("(") > first.count(")"):  # the sentence ended inside a parenthesis: drop it
        first = first[: first.rindex("(")].rstrip(" ,")
    return first


def shipped(kinds: tuple[Kind, ...] = ("run", "train", "plan", "lmeval")) -> list[Shipped]:
    """Every shipped file of ``kinds``, in that order, each with its description (reads every file)."""
    return [
        Shipped(kind, name, _FOLDERS[kind] / f"{name}.yaml", describe(_FOLDERS[kind] / f"{name}.yaml"))
        for kind in kinds
        for name in shipped_names(kind)
    ]
