"""Attention maps of one sample, saved beside a profile so figures never need to re-run a model.

For each layer: the softmax map(s) (``probs`` for the baseline; ``probs1``, ``probs2``, ``lambda`` and
``diff_map`` for DIFF), for the first ``max_len`` positions of one window, heads first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from diffquant.errors import DiffquantError
from diffquant.models.taps import model_taps

MAPS_FORMAT = "diffquant-maps"
MAPS_VERSION = "1"
_KINDS = ("probs", "diff_map", "lambda")


@torch.no_grad()
def capture_maps(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Maps of sample ``ids`` (1-D or (1, T)) keyed ``layers.I.probs1`` etc.; lambda as (H, T) or ()."""
    ids = ids.reshape(1, -1)
    found: dict[str, torch.Tensor] = {}
    handles = []
    for name, tap in model_taps(model).items():
        if tap.kind not in _KINDS:
            continue
        key = name.replace(".attn.", ".")

        def keep(module, args, out, key=key):
            value = out.detach().float()
            if value.dim() == 0:  # DIFF V1 lambda: one scalar per layer
                found[key] = value
                return
            value = value[0]  # drop the batch dim
            if value.dim() == 2:  # DIFF V2 lambda (T, H) -> (H, T)
                value = value.transpose(0, 1)
            # maps arrive in query chunks: rows concatenate
            found[key] = value.contiguous() if key not in found else torch.cat([found[key], value], dim=-2)

        handles.append(tap.register_forward_hook(keep))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return found


def save_maps(
    path: str | Path, maps: dict[str, torch.Tensor], *, model: str, attention: str, tokens: list[int]
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    meta = {
        "format": MAPS_FORMAT,
        "version": MAPS_VERSION,
        "model": model,
        "attention": attention,
        "tokens": json.dumps(tokens),
    }
    save_file(maps, str(tmp), metadata=meta)
    tmp.replace(path)


def load_maps(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise DiffquantError(f"{path}: attention-map artifact not found (written by the profile stage)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        maps = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise DiffquantError(f"{path}: not a readable safetensors file ({err})") from None
    if meta.get("format") != MAPS_FORMAT or meta.get("version") != MAPS_VERSION:
        raise DiffquantError(
            f"{path}: not a diffquant maps file of version {MAPS_VERSION} (format {meta.get('format')!r}, "
            f"version {meta.get('version')!r})"
        )
    return maps, meta
