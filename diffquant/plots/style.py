"""Shared look of every figure: backend choice, the model colour map, rc settings and atomic saving.

Figures are compared side by side in a report, so one model must have one colour everywhere: colours come
from :func:`model_colors`, computed once per run folder from every model any artifact mentions, and are
passed to each figure function. matplotlib is imported lazily (inside functions) so that ``import diffquant``
and ``import diffquant.plots`` stay cheap for commands that draw nothing.
"""

from __future__ import annotations

import colorsys
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffquant.models.config import ATTENTION_LABELS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One colour per model, never two shades of one hue: the first model of an attention kind takes its kind's
# colour, so runs with one model per kind always show baseline blue, DIFF V1 orange, DIFF V2 green
# (colour-blind-safe hues, after the seaborn "colorblind" palette); every other model (a second baseline:
# SmolLM2 beside Gemma; a rival kind) takes the next of EXTRA_COLORS, hues of their own.
KIND_COLORS: dict[str, str] = {"baseline": "#0173B2", "diff_v1": "#DE8F05", "diff_v2": "#029E73"}
EXTRA_COLORS = ("#CC78BC", "#CA9161", "#D55E00", "#949494", "#ECE133", "#7F3C8D", "#E73F74", "#56B4E9")
KIND_LABELS = ATTENTION_LABELS  # the attention-kind table of models/config.py

FORMATS = ("png", "svg", "pdf")
DEFAULT_DPI = 150

# Readable in the report at 100 % zoom: the HTML report shows figures in a column of REPORT_WIDTH_PX CSS
# pixels, so a figure W inches wide is scaled by REPORT_WIDTH_PX / (W * dpi). Figures are at most
# MAX_WIDTH_IN wide and no text is smaller than MIN_FONT_PT, so every label is at least
# MIN_FONT_PT * REPORT_WIDTH_PX / (72 * MAX_WIDTH_IN) ~ 10 px on screen (tests check each figure).
REPORT_WIDTH_PX = 1050
MAX_WIDTH_IN = 11.0
MIN_FONT_PT = 8.0
# Light grid, no top/right spines.
RC: dict[str, Any] = {
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    "legend.frameon": False,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "figure.titlesize": 12,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "lines.linewidth": 1.4,
    "image.interpolation": "nearest",
    "savefig.facecolor": "white",
    "figure.facecolor": "white",
}


def ensure_backend() -> None:
    """Choose the non-interactive Agg backend unless the user (or an earlier import) already chose one.

    Figures here are created as plain ``matplotlib.figure.Figure`` objects, which never need a GUI; this
    only matters for code that later imports pyplot in a headless job (where an interactive default would
    fail). An explicit ``MPLBACKEND`` or an already-resolved backend is left alone.
    """
    import matplotlib  # noqa: PLC0415 (plots load matplotlib on first figure)

    if os.environ.get("MPLBACKEND"):
        return
    get = getattr(matplotlib.rcParams, "_get_backend_or_none", None)
    if get is not None and get() is None:
        matplotlib.use("Agg")


def new_figure(width: float, height: float) -> Figure:
    """A pyplot-free Figure with constrained layout: nothing global to close, no GUI, thread-safe."""
    ensure_backend()
    from matplotlib.figure import Figure  # noqa: PLC0415 (plots load matplotlib on first figure)

    return Figure(figsize=(width, height), layout="constrained")


def style_context():
    """rc settings for one figure (a context, so the user's global rcParams stay untouched)."""
    import matplotlib  # noqa: PLC0415 (plots load matplotlib on first figure)

    return matplotlib.rc_context(RC)


def model_colors(models: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Stable colour per model name from (name, attention kind) pairs, in the given order.

    The first model of a kind takes :data:`KIND_COLORS`' colour for it (baseline blue, DIFF V1 orange, DIFF
    V2 green); every other model takes the next of :data:`EXTRA_COLORS` (then evenly spread hues), so no two
    models share a hue. A name listed twice keeps its first colour.
    """
    colors: dict[str, str] = {}
    extra = 0
    for name, kind in models:
        if name in colors:
            continue
        own = KIND_COLORS.get(kind)
        if own is not None and own not in colors.values():
            colors[name] = own
            continue
        color = _extra_color(extra)
        while color in colors.values() or color in KIND_COLORS.values():
            extra += 1
            color = _extra_color(extra)
        colors[name] = color
        extra += 1
    return colors


def _extra_color(i: int) -> str:
    """The i-th extra colour; past the fixed list, evenly spread hues (so 20 models still differ)."""
    if i < len(EXTRA_COLORS):
        return EXTRA_COLORS[i]
    h = ((i - len(EXTRA_COLORS)) * 0.618034) % 1.0  # golden-ratio steps keep neighbours apart
    r, g, b = colorsys.hsv_to_rgb(h, 0.65, 0.75)
    return f"#{int(r * 255):02X}{int(g * 255):02X}{int(b * 255):02X}"


def colors_for(names: Iterable[str], kinds: dict[str, str], colors: dict[str, str] | None) -> dict[str, str]:
    """``colors`` when it covers every name, else colours computed for these models (standalone use)."""
    names = list(names)
    if colors is not None and all(n in colors for n in names):
        return colors
    computed = model_colors([(n, kinds.get(n, "")) for n in names])
    return {**computed, **(colors or {})}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def safe_name(text: str) -> str:
    """A file-name-safe version of a task / site label (letters, digits, '.', '_', '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def save_figure(fig: Figure, folder: Path, name: str, formats: Sequence[str], dpi: int) -> list[Path]:
    """Write ``fig`` as folder/NAME.FMT for each format, each atomically (temp file in the folder, then
    os.replace), so a reader never sees a half-written image. Returns the written paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    with style_context():
        for fmt in formats:
            path = folder / f"{name}.{fmt}"
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    fig.savefig(f, format=fmt, dpi=dpi)
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give images the usual mode
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            paths.append(path)
    return paths
