"""optimum-quanto backend: one ``nn.Linear`` -> one quanto ``QLinear`` with frozen quantized weights.

What quanto 0.2.7 actually does (read from its source, checked by tests/test_backends.py):

* ``qint8`` weights: symmetric, per output row, ``scale = absmax(row) / 127``,
  ``q = clamp(round(w / scale), -128, 127)`` stored as int8 (``weight._data``), dequantized as ``scale * q``.
* ``qfloat8`` weights (float8 e4m3fn): per output row, ``scale = absmax(row) / 448``,
  ``q = float8_e4m3fn(clamp(w / scale, -448, 448))`` (round-to-nearest-even cast).
* ``qint4`` weights: *affine* (not symmetric), group-wise along the input dimension:
  ``scale = (max - min) / 15``, ``shift = -min`` per group, ``q = clamp(round((w + shift) / scale), 0, 15)``,
  dequantized as ``scale * q - shift``. The group size is 128; when ``in_features`` is not a multiple of 128
  quanto tries 96, 64, 32 (only when ``in_features > 128``); otherwise (``in_features <= 128`` or no divisor)
  there is one group per output row. The chosen size is ``module.weight_group_size`` (None = per row).
* Activations (``qint8`` / ``qfloat8``): per-tensor, static. Under :func:`quanto_calibration` every forward
  pass sets ``input_scale = absmax(x) / qmax`` (qmax 127 or 448) for the first batch, then an exponential
  moving average ``0.9 * old + 0.1 * new`` for later batches (momentum hard-wired in quanto). At inference the
  input is quantized with that fixed scale, values beyond the calibrated range are clipped
  (int8: to [-128, 127] steps).
* On CPU with int8 activations and int8 weights the matmul is ``torch._int_mm`` (exact int32 accumulation)
  times ``input_scale * weight_scale``; every other combination dequantizes and runs an fp32 matmul.

Everything here is built in fp32 (weights are copied to fp32 before quantization, so scales are fp32); feed
fp32 activations, outputs are fp32. The source ``nn.Linear`` is never modified.

Gotchas handled here: quanto's ``qint4`` unpack op is a C++ extension JIT-built on first use (~50 s, needs a
compiler); :func:`register_pure_torch_unpack` replaces it with a bit-identical torch implementation, on
every torch that allows replacing quanto's Python-registered kernel (2.8 on; older ones keep quanto's).
Not handled (callers must know): ``qint4`` modules fail under ``torch.inference_mode()`` (quanto sets version
counters on its packed tensors): use ``torch.no_grad()``.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch

from diffquant.errors import DiffquantError

__all__ = [
    "QUANTO_ACTIVATIONS",
    "QUANTO_WEIGHTS",
    "UNPACK_KEYS",
    "load_quanto_state",
    "quanto_calibration",
    "quanto_state",
    "register_pure_torch_unpack",
    "to_quanto",
]

#: Weight formats accepted by :func:`to_quanto` -> quanto qtype names (``qfloat8`` is e4m3fn).
_WEIGHT_QTYPES: dict[str, str] = {"qint8": "qint8", "qint4": "qint4", "qfloat8": "qfloat8_e4m3fn"}
#: Activation formats: quanto only supports 8-bit per-tensor static activations.
_ACTIVATION_QTYPES: dict[str, str] = {"qint8": "qint8", "qfloat8": "qfloat8_e4m3fn"}

QUANTO_WEIGHTS: tuple[str, ...] = tuple(_WEIGHT_QTYPES)
QUANTO_ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATION_QTYPES)

#: Keys of :func:`quanto_state` for a module that quantizes activations (none for weight-only modules).
_STATE_KEYS: tuple[str, ...] = ("input_scale", "output_scale")

# The torch.library handle must stay alive: its registrations are dropped when it is garbage collected.
_UNPACK_LIBRARY: torch.library.Library | None = None


def _pure_torch_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto::unpack in plain torch: the ``8 // bits`` values of each byte, low bits first, stacked on dim 0.

    Same layout as quanto's Python reference (optimum/quanto/library/unpack.py) and its C++ kernel:
    value ``i`` of a byte is ``(byte & (2**(bits*(i+1)) - 1)) >> (bits*i)``, and the unpacked chunks are
    concatenated along the first dimension (quanto's packing puts rows ``i*R .. (i+1)*R`` into bit field i).
    """
    values_per_byte = 8 // bits
    chunks = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(values_per_byte)]
    return torch.cat(chunks).to(torch.uint8)


def register_pure_torch_unpack() -> None:
    """Make quanto's int4/int2 unpack use :func:`_pure_torch_unpack` on CPU and CUDA (once per process).

    Why: quanto registers a C++ extension kernel for ``quanto::unpack`` whose first call JIT-compiles it
    (~50 s on 2 cores, needs g++/nvcc, writes into site-packages). The torch version is bit-identical and fast
    enough for the weight sizes here. Must run after ``optimum.quanto`` is imported, since that import
    registers the kernels being overridden; torch's one-off "Overriding a previously registered kernel"
    warning is expected and silenced.

    quanto registers its kernels from Python (``torch.library.impl``), and torch refuses a second Python
    kernel for the same (namespace, op, dispatch key) unless told: torch 2.8 - 2.11 raise "already a kernel
    registered from python" without ``allow_override=True`` (the GPU machine's torch 2.11 did, issue 45),
    later ones override by default, and before 2.8 there is no way to override. So the override is asked for
    where torch has the flag; where torch refuses anyway, quanto's own kernel stays for that key (correct,
    it JIT-builds on first use) and :data:`UNPACK_KEYS` says which keys run the torch version.
    """
    global _UNPACK_LIBRARY
    if _UNPACK_LIBRARY is not None:
        return
    import optimum.quanto  # noqa: F401, PLC0415  (defines quanto::unpack and registers the kernels we replace)

    library = torch.library.Library("quanto", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for dispatch_key in ("CPU", "CUDA"):
            if _override_unpack(library, dispatch_key):
                UNPACK_KEYS.append(dispatch_key)
    _UNPACK_LIBRARY = library


#: Dispatch keys whose ``quanto::unpack`` is :func:`_pure_torch_unpack` (the others keep quanto's kernel).
UNPACK_KEYS: list[str] = []


def _override_unpack(library: torch.library.Library, dispatch_key: str) -> bool:
    """Register :func:`_pure_torch_unpack` for ``dispatch_key``; False where torch refuses to replace the
    Python kernel quanto registered there (torch < 2.8: no ``allow_override``)."""
    override = (
        {"allow_override": True} if "allow_override" in inspect.signature(library.impl).parameters else {}
    )
    try:
        library.impl("unpack", _pure_torch_unpack, dispatch_key, **override)
    except RuntimeError as err:
        if "already a kernel registered from python" not in str(err):
            raise
        return False
    return True


def _check_names(weights: str, activations: str | None) -> tuple[str, str | None]:
    """Map our names to quanto qtype names, or raise a one-line DiffquantError listing the valid ones."""
    if weights not in _WEIGHT_QTYPES:
        raise DiffquantError(f"unknown quanto weight format {weights!r}; valid: {', '.join(QUANTO_WEIGHTS)}")
    if activations is not None and activations not in _ACTIVATION_QTYPES:
        raise DiffquantError(
            f"unknown quanto activation format {activations!r}; valid: None, {', '.join(QUANTO_ACTIVATIONS)}"
        )
    return _WEIGHT_QTYPES[weights], None if activations is None else _ACTIVATION_QTYPES[activations]


def _fp32_source(linear: torch.nn.Linear) -> torch.nn.Linear:
    """A plain fp32 ``nn.Linear`` holding copies of ``linear``'s weight and bias.

    Why: ``QLinear.from_module`` adopts the source's Parameter objects (and its dtype for the scales), so
    quantizing a copy keeps the caller's module untouched and makes every scale fp32 whatever the source dtype.
    """
    source = torch.nn.Linear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
    )
    source.weight = torch.nn.Parameter(
        linear.weight.detach().to(torch.float32, copy=True), requires_grad=False
    )
    if linear.bias is not None:
        source.bias = torch.nn.Parameter(
            linear.bias.detach().to(torch.float32, copy=True), requires_grad=False
        )
    return source


def to_quanto(
    linear: torch.nn.Linear, weights: str = "qint8", activations: str | None = None
) -> torch.nn.Module:
    """Convert one Linear into an optimum-quanto ``QLinear`` with frozen quantized weights, in eval mode.

    ``weights`` in ``QUANTO_WEIGHTS``; ``activations`` None (weight-only) or in ``QUANTO_ACTIVATIONS``.
    Weight quantization is deterministic (absmax / min-max, no search), so re-converting the same weights gives
    the same module. With activations, run forward passes under :func:`quanto_calibration` before use (an
    uncalibrated module has ``input_scale == 1``, i.e. int8 steps of 1.0 and clipping at +-127) and persist the
    scales with :func:`quanto_state`.

    quanto would also quantize the *output* to the activation format (its ``quantize_output`` hook, returning
    an ``ActivationQBytesTensor``); that hook is removed here so the module always returns a plain fp32
    tensor — which is what quanto's own ``Calibration(streamline=True)`` does anyway for every Linear whose
    output feeds a non-quantized op (all of them in a transformer block). ``output_scale`` is still
    calibrated and kept in the state.
    """
    weight_qtype, activation_qtype = _check_names(weights, activations)
    if not isinstance(linear, torch.nn.Linear):
        raise DiffquantError(f"to_quanto expects a torch.nn.Linear, got {type(linear).__name__}")
    register_pure_torch_unpack()
    from optimum.quanto import QLinear, qtypes  # noqa: PLC0415 (optional heavy library)

    qlinear = QLinear.from_module(
        _fp32_source(linear),
        weights=qtypes[weight_qtype],
        activations=None if activation_qtype is None else qtypes[activation_qtype],
    )
    qlinear.freeze()
    if activation_qtype is not None:
        qlinear.disable_output_quantization()
    qlinear.requires_grad_(False)
    return qlinear.eval()


@contextlib.contextmanager
def quanto_calibration() -> Iterator[None]:
    """Record activation scales of quanto modules during the forward passes run inside (under no_grad).

    Wraps ``optimum.quanto.Calibration`` with ``streamline=False``: streamlining only decides whether to
    quantize module outputs, which :func:`to_quanto` never does. Scales follow quanto's rule: the first batch
    sets ``absmax / qmax``, later batches an EMA with momentum 0.9 (so the result is not the max over batches).
    no_grad because calibration is inference and because qint4 modules break under inference_mode.
    """
    from optimum.quanto import Calibration  # noqa: PLC0415 (optional heavy library)

    with torch.no_grad(), Calibration(streamline=False):
        yield


def _check_qmodule(module: torch.nn.Module) -> None:
    from optimum.quanto.nn import QModuleMixin  # noqa: PLC0415 (optional heavy library)

    if not isinstance(module, QModuleMixin):
        raise DiffquantError(
            f"expected an optimum-quanto module (from to_quanto), got {type(module).__name__}"
        )


def quanto_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The calibration state of a :func:`to_quanto` module, as plain detached tensors (safetensors-ready).

    Why only scales: the quantized weights are a deterministic function of the original weights, so a
    checkpoint keeps the fp32 weights and re-runs :func:`to_quanto`; the activation scales are the only thing
    that depends on calibration data. Weight-only modules have no state (empty dict).
    """
    _check_qmodule(module)
    if module.activation_qtype is None:
        return {}
    return {key: getattr(module, key).detach().clone().contiguous() for key in _STATE_KEYS}


def load_quanto_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a :func:`quanto_state` dict back into a freshly converted module (same formats), in place."""
    _check_qmodule(module)
    expected = set() if module.activation_qtype is None else set(_STATE_KEYS)
    if set(state) != expected:
        raise DiffquantError(
            f"quanto state keys {sorted(state)} do not match the module's {sorted(expected)} "
            f"(activations={None if module.activation_qtype is None else module.activation_qtype.name})"
        )
    for key in sorted(expected):
        current = getattr(module, key)
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise DiffquantError(f"quanto state {key!r} must be a one-element tensor")
        setattr(
            module, key, value.detach().reshape(current.shape).to(current.device, current.dtype, copy=True)
        )
