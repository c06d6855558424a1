"""diffquant: quantization and activation-outlier analysis of Differential Transformers."""

from diffquant.errors import DiffquantError

__version__ = "0.1.0"

__all__ = ["DiffquantError", "__version__"]
