"""bitsandbytes backend: one ``nn.Linear`` -> ``Linear8bitLt`` (LLM.int8) or ``Linear4bit`` (NF4 / FP4).

What bitsandbytes 0.50 does on CPU (read from its source, checked by tests/test_backends.py):

* ``int8`` (LLM.int8, Dettmers et al. 2022): the weight is cast to **fp16**, then quantized per output row,
  ``SCB = absmax(row)``, ``CB = round(w * 127 / SCB)`` (int8). Each forward casts the input to **fp16**,
  finds the *columns* (input features) holding any ``|x| >= threshold`` over all tokens of the call (so the
  outlier set depends on the whole batch, padding included), zeroes the outlier elements, takes per-token
  ``absmax`` of the rest, quantizes ``round(x * 127 / absmax)`` and zeroes the outlier columns. The int8 part
  is an exact int32 matmul dequantized as ``acc * absmax_x * SCB * 6.200124e-05`` (bnb's literal for 1/127**2,
  1.8e-5 relative too large); the outlier columns are added in the input's dtype (fp32 here) against the
  int8 weights dequantized as ``CB * SCB / 127`` — the activations of outlier columns are exact, their weights
  are still int8. ``threshold=0`` disables the decomposition (pure vector-wise int8). Input fp32 -> output
  fp32. Only in eval mode: in train mode bnb silently multiplies by dequantized weights instead, so the module
  returned here is pinned to eval (a forward pre-hook resets ``training``).
* ``nf4`` / ``fp4`` (QLoRA, Dettmers et al. 2023): the fp32 weight is flattened (row-major) and cut into blocks
  of ``blocksize`` consecutive elements, each block scaled by its fp32 absmax and rounded to the nearest of 16
  code values (NF4: the QLoRA normal-float table; FP4: ``{0, 0.0625, 2, 3, 4, 6, 8, 12} / 12`` with sign).
  ``compress_statistics=False`` keeps the absmax in fp32 (no double quantization). Forward dequantizes to fp32
  and runs ``F.linear`` in fp32 (``compute_dtype=float32``).
  ``in_features`` must be a multiple of ``blocksize`` (enforced): bitsandbytes 0.50's AVX-512 CPU dequantize
  kernel applies the wrong block scales when blocks span rows (seen for in_features % blocksize != 0 with
  in_features % 16 == 0, e.g. 32/48/96/160 with blocksize 64: errors of the order of the weights themselves),
  while the quantization itself is right; refusing such shapes everywhere keeps results host-independent.

CPUs with AVX512-BF16 (e.g. Sapphire Rapids) would make bnb repack 4-bit weights and compute in **bf16** with
bf16 block scales whenever the module is in eval mode without grad; that path is switched off here
(``support_avx512bf16_for_cpu = False``) so numerics do not depend on the host CPU.

Two log lines of bnb are filtered (only those): the per-call "MatMul8bitLt: inputs will be cast ... to float16"
(expected, described above) and the import-time "Failed to load CPU gemm_4bit_forward from kernels-community"
(that kernel is the AVX512-BF16 path switched off above).
"""

from __future__ import annotations

import logging
import math
import warnings
from types import ModuleType

import torch

from diffquant.errors import DiffquantError

__all__ = ["BNB_BLOCKSIZES", "BNB_MODES", "to_bnb"]

BNB_MODES: tuple[str, ...] = ("int8", "nf4", "fp4")
#: Block sizes bitsandbytes' 4-bit kernels accept.
BNB_BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)

_QUIET_MESSAGES: tuple[str, ...] = (
    "MatMul8bitLt: inputs will be cast from",
    "Failed to load CPU gemm_4bit_forward from kernels-community",
)
_QUIET_LOGGERS: tuple[str, ...] = ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops")


class _DropKnownMessages(logging.Filter):
    """Drops the bitsandbytes log records listed in ``_QUIET_MESSAGES`` (expected behaviour, not news)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_QUIET_MESSAGES)


_FILTER = _DropKnownMessages()


def _import_bnb() -> ModuleType:
    """Import bitsandbytes lazily (~2-3 s), silencing its import-time DeprecationWarnings and the log noise."""
    for name in _QUIET_LOGGERS:  # before the import: the kernels-community message is logged while importing
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import bitsandbytes  # noqa: PLC0415 (optional heavy library)

    return bitsandbytes


def _keep_eval(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook: LLM.int8 exists only in eval mode on CPU, so ``model.train()`` must not switch it."""
    module.training = False


def _check(mode: str, threshold: float, blocksize: int, in_features: int) -> None:
    if mode not in BNB_MODES:
        raise DiffquantError(f"unknown bitsandbytes mode {mode!r}; valid: {', '.join(BNB_MODES)}")
    if mode == "int8" and not (
        isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0
    ):
        raise DiffquantError(f"LLM.int8 threshold must be a finite number >= 0, got {threshold!r}")
    if mode != "int8" and blocksize not in BNB_BLOCKSIZES:
        raise DiffquantError(
            f"bitsandbytes 4-bit blocksize must be one of {', '.join(map(str, BNB_BLOCKSIZES))}, got {blocksize!r}"
        )
    if mode != "int8" and in_features % blocksize:
        raise DiffquantError(
            f"bitsandbytes {mode} needs in_features ({in_features}) to be a multiple of blocksize ({blocksize}): "
            "bitsandbytes 0.50's CPU kernel mis-scales blocks that span rows; pick a smaller blocksize"
        )


def to_bnb(
    linear: torch.nn.Linear, mode: str = "int8", threshold: float = 6.0, blocksize: int = 64
) -> torch.nn.Module:
    """Convert one Linear into a bitsandbytes module with quantized weights, in eval mode.

    ``mode``: ``"int8"`` -> ``Linear8bitLt(has_fp16_weights=False, threshold=threshold)`` (``blocksize``
    unused); ``"nf4"`` / ``"fp4"`` -> ``Linear4bit(quant_type=mode, compute_dtype=float32,
    compress_statistics=False)`` with ``blocksize``, which must divide ``in_features`` (``threshold`` unused).
    Weight quantization is deterministic
    (absmax rounding, no search), so converting the same weights again gives bit-identical outputs — which is
    what lets checkpoints keep the original weights. The module lives on ``linear.weight``'s device; the
    source Linear is not modified. Inputs: fp32, 2-D or 3-D (bnb's int8 path reshapes only 3-D inputs).
    """
    if not isinstance(linear, torch.nn.Linear):
        raise DiffquantError(f"to_bnb expects a torch.nn.Linear, got {type(linear).__name__}")
    _check(mode, threshold, blocksize, linear.in_features)
    bnb = _import_bnb()
    device = linear.weight.device
    # bnb quantizes inside Param.to(device) and only from CPU data, hence the CPU fp32 copy.
    weight = linear.weight.detach().to("cpu", torch.float32, copy=True).contiguous()
    has_bias = linear.bias is not None
    if mode == "int8":
        module = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            has_fp16_weights=False,
            threshold=float(threshold),
            device="meta",
        )
        module.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to(device)
        module.register_forward_pre_hook(_keep_eval)
    else:
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=torch.float32,
            compress_statistics=False,
            quant_type=mode,
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=False,
            quant_type=mode,
            module=module,
        ).to(device)
        module.support_avx512bf16_for_cpu = False
    if has_bias:
        module.bias = torch.nn.Parameter(
            linear.bias.detach().to(device, torch.float32, copy=True), requires_grad=False
        )
    return module.eval()
