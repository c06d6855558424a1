"""Real-quantization backends: per-Linear conversions to optimum-quanto and bitsandbytes modules.

The libraries themselves are imported lazily inside the functions (bitsandbytes alone takes ~3 s and emits
warnings), so importing this package only costs torch.

* :mod:`~diffquant.quant.backends.quanto`: ``to_quanto`` (qint8 / qint4 / qfloat8 weights, optional
  qint8 / qfloat8 static activations), ``quanto_calibration``, ``quanto_state`` / ``load_quanto_state``.
* :mod:`~diffquant.quant.backends.bnb`: ``to_bnb`` (LLM.int8 with outlier threshold, NF4 / FP4).
"""

from diffquant.quant.backends.bnb import BNB_BLOCKSIZES, BNB_MODES, to_bnb
from diffquant.quant.backends.quanto import (
    QUANTO_ACTIVATIONS,
    QUANTO_WEIGHTS,
    load_quanto_state,
    quanto_calibration,
    quanto_state,
    register_pure_torch_unpack,
    to_quanto,
)

__all__ = [
    "BNB_BLOCKSIZES",
    "BNB_MODES",
    "QUANTO_ACTIVATIONS",
    "QUANTO_WEIGHTS",
    "load_quanto_state",
    "quanto_calibration",
    "quanto_state",
    "register_pure_torch_unpack",
    "to_bnb",
    "to_quanto",
]
