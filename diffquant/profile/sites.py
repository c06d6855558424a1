"""Moved to :mod:`diffquant.models.sites` (layering, see docs/DESIGN.md); re-exported here for the old import path."""

from diffquant.models.sites import (  # noqa: F401
    KIND_LAYOUTS,
    Layout,
    layer_of,
    layout_of,
    query_positions,
    read_query_positions,
    view_place,
)
