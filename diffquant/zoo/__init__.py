"""The zoo: small baseline / DIFF V1 / DIFF V2 models trained by this project's own recipes.

Each model is a native checkpoint folder shipped inside the package (``diffquant/zoo/NAME``) with a
``card.json``: the recipe, steps, tokens, final training and validation bits per byte, retrieval accuracy
and the sha256 of its weights. Every command loads them as ``zoo:NAME``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError, did_you_mean
from diffquant.names import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE

ZOO_DIR = Path(__file__).resolve().parent
FILES = (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE)


def zoo_names() -> list[str]:
    return sorted(p.name for p in ZOO_DIR.iterdir() if (p / CONFIG_FILE).is_file())


def zoo_path(name: str) -> Path:
    """The folder of zoo model ``name``: one of :func:`zoo_names`, never a path (``zoo:/abs``,
    ``zoo:../x`` would otherwise load any folder on disk under the zoo's name)."""
    path = ZOO_DIR / name
    if name not in zoo_names():
        names = ", ".join(zoo_names()) or "none shipped"
        hint = did_you_mean(name, zoo_names())
        raise DiffquantError(f"zoo model {name!r} not found; {hint + ' ' if hint else ''}zoo models: {names}")
    return path


def card(name: str) -> dict[str, Any]:
    return json.loads((zoo_path(name) / CARD_FILE).read_text())


def publish(final_dir: str | Path, name: str) -> Path:
    """Copy a training run's ``final/`` folder (weights, config, card) into the package as zoo:NAME."""
    src = Path(final_dir)
    for f in FILES:
        if not (src / f).is_file():
            raise DiffquantError(
                f"{src}: missing {f} (expected the final/ folder of a `diffquant train` run)"
            )
    dest = ZOO_DIR / name
    dest.mkdir(exist_ok=True)
    for f in FILES:
        shutil.copyfile(src / f, dest / f)
    return dest
