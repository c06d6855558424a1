"""Moved to :mod:`diffquant.textfiles` (layering, see docs/DESIGN.md); re-exported here for the old import path."""

from diffquant.textfiles import (  # noqa: F401
    MAX_YAML_BYTES,
    parse_yaml,
    read_yaml_file,
)
