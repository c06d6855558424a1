"""Moved to :mod:`diffquant.formats` (layering, see docs/DESIGN.md); re-exported here for the old import path."""

from diffquant.formats import (  # noqa: F401
    BLOCK_FORMATS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    ELEMENT_FORMATS,
    MXINT8_ELEMENT,
    NF4_VALUES,
    BlockFormat,
    ElementFormat,
    __all__,  # noqa: F401
    absmax_scale,
    block_scales,
    e4m3_round_up,
    e8m0_round,
    e8m0_round_up,
    get_block_format,
    get_format,
    int_format,
    minmax_scale_zero_point,
    nvfp4_tensor_scale,
    quantize_blocks,
    quantize_int,
)
