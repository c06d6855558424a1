"""What every figure module shares: titles of the site kinds, the models' attention kinds, legend proxies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.models.sites import KIND_TITLES  # noqa: F401 (titles of the site kinds: models.sites)
from diffquant.profile.profiler import Profile


def profile_kinds(profiles: Mapping[str, Profile]) -> dict[str, str]:
    """Attention kind per model, from each profile's metadata (for the colour map)."""
    return {name: str(p.meta.get("attention", "")) for name, p in profiles.items()}


def require_profiles(profiles: Mapping[str, Any], what: str) -> None:
    if not profiles:
        raise DiffquantError(f"{what}: no profiles given")


def legend_proxy(**kw: Any):
    """A legend entry not drawn on any axes (explains a line style shared by all models)."""
    from matplotlib.lines import Line2D  # noqa: PLC0415 (plots load matplotlib on first figure)

    return Line2D([], [], **kw)
