"""A CPU-only check for device mistakes: tensors that say "cuda:0" but hold real CPU data (issue 45).

A CPU-only test suite cannot see a CPU tensor meeting a CUDA tensor (``index_add_`` with a CPU index table and
a CUDA source, ``s / n`` with ``n`` built on the host): on a GPU that raises "Expected all tensors to be on the
same device", on a CPU every tensor is on the CPU. Inside :func:`fake_cuda`:

* ``FakeCuda`` tensors report ``device == cuda:0`` (``is_cuda``, ``.device.type == "cuda"``) and hold a real
  CPU tensor, so every computation runs for real on the CPU with real values (``.item()``, ``.tolist()``,
  ``nonzero``, ``bincount`` and every other data-dependent op work, unlike torch's FakeTensorMode, and the
  numbers equal a CPU run's);
* every aten op that gets a FakeCuda tensor (``__torch_dispatch__``) checks its tensor arguments by CUDA's
  rule and raises CUDA's error text when a FakeCuda tensor meets a CPU tensor of one or more dims (0-dim CPU
  tensors are allowed, as CUDA allows CPU scalars; the cross-device copies ``copy_`` / ``.to`` and CPU index
  tensors in ``x[idx]`` / ``x[idx] = v`` are allowed, as on CUDA); then it runs the op on the CPU data and
  wraps its tensor results again, unless the op was asked for the CPU (``.cpu()``, ``.to("cpu")``);
* a ``TorchFunctionMode`` turns ``device="cuda"`` (``torch.zeros / empty / full / arange / tensor / ...``,
  ``x.new_zeros(device=...)``), ``x.to("cuda")``, ``x.cuda()`` and ``module.to("cuda")`` (parameters swapped
  in place: tied weights stay tied) into FakeCuda tensors, and routes the few Python bindings that would ask
  a CPU build for a CUDA device guard (indexing, ``copy_``, ``~``, ``contiguous`` ...) through the dispatcher;
  tensors torch's C++ allocates on CUDA (a Python scalar in ``torch.where``, SDPA's temporaries) come from
  Python kernels for the CUDA key of ``empty`` / ``empty_strided``; a CUDA factory given a CPU ``generator``
  raises, ``.numpy()`` of a FakeCuda tensor raises, as on CUDA;
* ``torch.cuda.is_available()`` says True (``device_count`` 1, ``synchronize`` / ``empty_cache`` no-ops,
  ``mem_get_info`` a fixed 64 GiB) so code that branches on CUDA takes its CUDA branch, and
  ``torch.autocast("cuda")`` acts on FakeCuda tensors (their key set holds AutocastCUDA: bf16 for real);
* safetensors reads ``device="cuda"`` onto FakeCuda tensors and writes them from their CPU data; Triton's
  interpreter launches kernels on their CPU data (a CPU tensor among CUDA ones raises, as a launch would);
* the native C passes (``diffquant/kernels/native.py``, CPU pointers through ctypes) refuse FakeCuda tensors:
  a caller that does not test the device first fails here, as it would crash on a GPU.

Host syncs: inside :func:`host_syncs` every operation that would make the host wait for the GPU is recorded
(a scalar read: ``.item()``, ``float(x)``, ``bool(x)``, ``.tolist()``, ``torch.equal``; an output sized by
the data: ``nonzero``, ``masked_select``, ``x[mask]``, ``unique``; a copy between the host and the device that
is not asynchronous: any device-to-host copy without ``non_blocking``, and a host-to-device copy unless it is
``non_blocking`` from pinned memory, ``torch.tensor(data, device="cuda")`` included, as
``torch.cuda.set_sync_debug_mode`` counts them). ``pin_memory()`` of a host tensor gives a copy the check
remembers as pinned (a CPU build has no pinned memory).

What it cannot see: CUDA numerics (TF32, the fp8 tensor cores' accumulation, atomics' summation order,
SDPA's CUDA kernels: a "cuda" tensor on a CPU build takes SDPA's math kernel, so a CPU reference must too),
compiled Triton or flash-attn kernels, streams and asynchrony (a missing ``synchronize``), memory (sizes,
fragmentation, out-of-memory), several GPUs (one logical device, cuda:0; a cuda:0 / cuda:1 mix is not
checked), ops that reach a real CUDA device without a tensor argument (``torch.cuda.Stream``, CUDA
generators, ``torch.cuda.*`` calls other than the ones above), and autograd: recording a graph on a CUDA
tensor asks the device for a stream, which aborts a CPU build, so FakeCuda tensors never require grad and an
op that would record one raises (a training step's backward pass is not checked).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")

# Ops that move data between devices: a CPU / CUDA mix is their purpose.
_CROSS_DEVICE = {
    torch.ops.aten.copy_.default,
    torch.ops.aten.copy.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._copy_from.default,
    torch.ops.aten._copy_from_and_resize.default,
}
# Advanced indexing: CUDA accepts CPU index tensors (it moves them), not a CPU tensor indexed on CUDA.
_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten._index_put_impl_.default,
    torch.ops.aten._unsafe_index.Tensor,
    torch.ops.aten._unsafe_index_put.default,
}


# Ops whose result the host must wait for: a scalar read, or an output whose size depends on the values.
_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default: "a scalar read (.item() / float / int / bool)",
    torch.ops.aten.is_nonzero.default: "bool(tensor)",
    torch.ops.aten.equal.default: "torch.equal",
    torch.ops.aten.nonzero.default: "nonzero",
    torch.ops.aten.masked_select.default: "masked_select",
    torch.ops.aten._unique2.default: "unique",
    torch.ops.aten.unique_dim.default: "unique",
    torch.ops.aten.unique_consecutive.default: "unique_consecutive",
    torch.ops.aten.repeat_interleave.Tensor: "repeat_interleave by a tensor",
}
_syncs: list[str] | None = None  # the recording of host_syncs(), when one is active
# host tensors made by pin_memory() inside fake_cuda, by id (a WeakSet would compare tensors with ==)
_PINNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _pinned(t: torch.Tensor) -> bool:
    return _PINNED.get(id(t)) is t


def _sync(what: str) -> None:
    if _syncs is not None:
        _syncs.append(what)


def _host_copy(what: str, host: torch.Tensor, non_blocking: bool) -> None:
    """Record a copy between ``host`` and the device unless it is asynchronous: non_blocking, and for a
    host-to-device copy from pinned memory (a pageable source is staged by the host, as torch does)."""
    if not (non_blocking and (what == "device-to-host" or _pinned(host))):
        _sync(f"{what} copy{'' if non_blocking else ' (blocking)'} of {tuple(host.shape)}")


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Inside :func:`fake_cuda`: a list that collects every host sync the block makes (see the module
    docstring), one description per operation."""
    global _syncs
    saved, _syncs = _syncs, []
    try:
        yield _syncs
    finally:
        _syncs = saved


def _note_sync(func: Any, args: tuple, kwargs: dict) -> None:
    """Record ``func`` (reaching FakeCuda's dispatch) when it would make the host wait for the device."""
    if func in _SYNC_OPS:
        _sync(_SYNC_OPS[func])
    elif func in _INDEXING and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in tree_flatten(args[1:2])[0]
    ):
        _sync("a boolean-mask index (its size is the count of True)")
    elif func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        if isinstance(dst, FakeCuda) and isinstance(src, torch.Tensor) and not isinstance(src, FakeCuda):
            _host_copy("host-to-device", src, non_blocking)
        elif isinstance(src, FakeCuda) and not isinstance(dst, FakeCuda):
            _host_copy("device-to-host", dst, non_blocking)
    elif func is torch.ops.aten._to_copy.default and isinstance(args[0], FakeCuda):
        device = kwargs.get("device")
        if device is not None and not _is_cuda_device(device):
            _host_copy("device-to-host", args[0], bool(kwargs.get("non_blocking", False)))


def tree_flatten(obj: Any) -> tuple[list[Any], None]:
    """The leaves of nested tuples / lists / dicts (op arguments hold nothing else; torch's pytree is general
    and several times slower, which every op here pays)."""
    out: list[Any] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        else:
            out.append(item)
    return out, None


def tree_map(fn: Any, obj: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples / lists / dicts (namedtuples such as torch.return_types
    come back as plain tuples, which unpack alike)."""
    if isinstance(obj, (tuple, list)):
        mapped = [tree_map(fn, item) for item in obj]
        return mapped if isinstance(obj, list) else tuple(mapped)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device
    return torch.device(device).type == "cuda"


def _same_device_error(func: Any) -> RuntimeError:
    """CUDA's error text for a CPU / CUDA mix (what a test expecting a GPU failure matches)."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        f"(when checking arguments for {func}) [tests/devicecheck.py]"
    )


class FakeCuda(torch.Tensor):
    """A tensor that reports device cuda:0 and holds a real CPU tensor (``elem``) with the same metadata."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool | None = None) -> Any:
        if (
            requires_grad is not None
        ):  # type(param)(data, requires_grad=...) (accelerate): a Parameter of data
            return torch.nn.Parameter(elem, requires_grad)
        assert not isinstance(elem, FakeCuda) and elem.device.type == "cpu", elem.device
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=CUDA,
            requires_grad=False,  # never: see _check_grad
        )
        out.elem = elem
        return out

    # A traceable wrapper subclass (torch.utils.swap_tensors, which fake_cuda's module.to uses, accepts it).
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: None, outer_size: Any, outer_stride: Any) -> FakeCuda:  # noqa: ARG004
        return FakeCuda(inner["elem"])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 (torch's signature)
        return f"FakeCuda({self.elem!r})"

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickled as its CPU data, unpickled as FakeCuda again (a CUDA tensor comes back on CUDA)."""
        extra = {k: v for k, v in self.__dict__.items() if k != "elem"}
        return _unpickle, (self.elem, extra)

    def data_ptr(self) -> int:
        """The CPU data's address (identity checks such as tied weights and caches keyed by pointer work);
        the native passes refuse FakeCuda tensors before reading it."""
        return self.elem.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ARG003 (torch's signature)
        kwargs = dict(kwargs or {})
        _check_devices(func, args, kwargs)
        _check_grad(func, args, kwargs)
        if _syncs is not None:
            _note_sync(func, args, kwargs)
        to_cpu = "device" in kwargs and kwargs["device"] is not None and not _is_cuda_device(kwargs["device"])
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU
        originals = {}

        def unwrap(t: Any) -> Any:
            if isinstance(t, FakeCuda):
                originals[id(t.elem)] = t
                return t.elem
            if isinstance(t, torch.Tensor):
                originals[id(t)] = t
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def rewrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in originals:  # in-place and out= ops return their argument itself
                return originals[id(t)]
            if to_cpu or t.device.type != "cpu":
                return t
            return FakeCuda(t)

        return tree_map(rewrap, out)


def _unpickle(elem: torch.Tensor, extra: dict) -> FakeCuda:
    out = FakeCuda(elem)
    out.__dict__.update(extra)
    return out


def _check_devices(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise CUDA's error when ``func`` mixes a FakeCuda tensor with a CPU tensor of one or more dims."""
    if func in _CROSS_DEVICE:
        return
    check = (args, kwargs)
    if func in _INDEXING and args and isinstance(args[0], FakeCuda):
        check = (args[:1], args[2:], kwargs)  # CPU indices are fine on a CUDA tensor
    leaves, _ = tree_flatten(check)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, FakeCuda) for t in tensors):
        if func in _INDEXING and any(isinstance(t, FakeCuda) for t in tree_flatten(args)[0]):
            raise _same_device_error(func)  # a CPU tensor indexed with CUDA indices
        return
    for t in tensors:
        if not isinstance(t, FakeCuda) and t.device.type == "cpu" and t.dim() > 0:
            raise _same_device_error(func)


def _check_grad(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse to record autograd history on a FakeCuda result: autograd asks the CUDA device for a stream,
    which aborts the process on a CPU build (not an exception: the test run would die)."""
    leaves = tree_flatten((args, kwargs))[0] if torch.is_grad_enabled() else []
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        raise RuntimeError(
            f"tests/devicecheck.py: {func} on CUDA tensors with autograd (run the check under no_grad)"
        )


def fake(t: torch.Tensor) -> FakeCuda:
    """``t`` (a CPU tensor) as a FakeCuda copy, as ``t.to("cuda")`` makes one."""
    return t if isinstance(t, FakeCuda) else FakeCuda(t.detach().clone())


def real(t: Any) -> Any:
    """The CPU data of a FakeCuda tensor (anything else unchanged)."""
    return t.elem if isinstance(t, FakeCuda) else t


def _numpy(x: FakeCuda, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
        "first. [tests/devicecheck.py]"
    )


def _nonzero(x: FakeCuda, *, as_tuple: bool = False) -> Any:
    idx = torch.ops.aten.nonzero.default(x)
    return idx.unbind(1) if as_tuple else idx


def _contiguous(x: FakeCuda, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    if x.is_contiguous(memory_format=memory_format):
        return x
    return torch.ops.aten.clone.default(x, memory_format=memory_format)


def _new_tensor(x: FakeCuda, data: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> FakeCuda:
    return FakeCuda(torch.tensor(real(data), dtype=dtype or x.dtype))


def _deepcopy(x: FakeCuda, memo: dict) -> FakeCuda:
    new = FakeCuda(x.elem.clone())
    memo[id(x)] = new
    extra = {k: v for k, v in x.__dict__.items() if k != "elem"}  # _is_param, Python attributes
    new.__dict__.update(copy.deepcopy(extra, memo))
    return new


def _tolist(x: FakeCuda) -> list:
    _sync(".tolist()")
    return x.elem.tolist()


def _format(x: FakeCuda, spec: str) -> str:
    return format(x.item(), spec) if x.dim() == 0 else format(repr(x), spec)


# Methods whose Python bindings set a CUDA device guard in C++ (which a CPU build does not have) or refuse
# subclasses: the same computation through the dispatcher, so the device checks still run. Keyed by the
# function torch passes to __torch_function__; each takes (self, *args, **kwargs), self a FakeCuda tensor.
_METHODS: dict[Any, Any] = {
    torch.Tensor.__getitem__: lambda x, index: _getitem(x, index),
    torch.Tensor.__setitem__: lambda x, index, value: _setitem(x, index, value),
    torch.Tensor.copy_: lambda x, src, non_blocking=False: torch.ops.aten.copy_.default(x, src, non_blocking),
    torch.Tensor.contiguous: _contiguous,
    torch.Tensor.nonzero: _nonzero,
    torch.nonzero: _nonzero,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.tolist: _tolist,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _numpy,
    torch.Tensor.__invert__: lambda x: torch.ops.aten.bitwise_not.default(x),
    torch.Tensor.__float__: lambda x: float(x.item()),
    torch.Tensor.__int__: lambda x: int(x.item()),
    torch.Tensor.__index__: lambda x: int(x.item()),
    torch.Tensor.__format__: _format,
    torch.Tensor.__deepcopy__: _deepcopy,
    torch.Tensor.requires_grad_: lambda x, requires_grad=True: x,  # never (see _check_grad)
    torch.unravel_index: lambda x, shape: tuple(FakeCuda(t) for t in torch.unravel_index(x.elem, shape)),
}


_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor whose __set__ is ``x.data = value``


def _set_data(x: torch.Tensor, value: Any) -> None:
    """``x.data = value`` with FakeCuda tensors: the metadata as torch sets it, and the CPU data held beside it
    (torch's set_data copies the wrapper's metadata only, so the write would be lost)."""
    if isinstance(x, FakeCuda) and isinstance(value, FakeCuda):
        _DATA.__set__(x, value)
        x.elem = value.elem
    elif isinstance(x, FakeCuda) or isinstance(value, FakeCuda):
        raise NotImplementedError("tests/devicecheck.py: x.data = value across devices (use module.to)")
    else:
        _DATA.__set__(x, value)


# Factories that copy host data to the device when given device="cuda" (the others allocate there).
_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


class _Mode(TorchFunctionMode):
    """Turns CUDA placements into FakeCuda tensors and routes :data:`_METHODS` (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return _to(func, args, kwargs)
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            return _set_data(*args)
        if func in _METHODS and args and isinstance(args[0], FakeCuda):
            return _METHODS[func](*args, **kwargs)
        if func is torch.Tensor.pin_memory and not isinstance(args[0], FakeCuda):
            pinned = args[0].clone()  # a CPU build has no pinned memory: a copy remembered as pinned
            _PINNED[id(pinned)] = pinned
            return pinned
        if func is torch.Tensor.is_pinned and not isinstance(args[0], FakeCuda):
            return _pinned(args[0])
        if _is_cuda_device(kwargs.get("device")):
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type != "cuda":
                raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu'")
            if func in _DATA_FACTORIES and args:
                if isinstance(args[0], FakeCuda):
                    del kwargs["device"]  # data already on the device stays there (as_tensor: no copy at all)
                    return func(*args, **kwargs)
                _sync(f"{func.__name__}(data, device=cuda): a host-to-device copy (blocking)")
            kwargs["device"] = CPU
            out = func(*args, **kwargs)
            return tree_map(lambda t: fake(t) if type(t) is torch.Tensor else t, out)
        return func(*args, **kwargs)


def _basic_index(x: torch.Tensor, index: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``x[index]``'s basic part (ints, slices, None, Ellipsis) as aten views of ``x``, and the advanced
    indices left for ``aten.index`` (one entry per remaining dim, None where a dim is taken whole).

    Python's ``x[index]`` on a CUDA tensor sets a CUDA device guard in C++, which a CPU build cannot; these
    are the same ops (views through the dispatcher, so every device check above still runs)."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [torch.tensor(i) if isinstance(i, list) else i for i in items]
    if any(isinstance(i, bool) for i in items):
        raise NotImplementedError("tests/devicecheck.py: a bool as an index")

    def width(i: Any) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            return i.dim()
        return 1

    out, dim, adv = x, 0, []
    for i in items:
        if i is None:
            out = out.unsqueeze(dim)
            adv.append(None)
            dim += 1
        elif i is Ellipsis:
            n = x.dim() - sum(width(j) for j in items)
            adv.extend([None] * n)
            dim += n
        elif isinstance(i, torch.Tensor):
            adv.append(i)
            dim += width(i)
        elif isinstance(i, slice):
            out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, 1 if i.step is None else i.step)
            adv.append(None)
            dim += 1
        else:
            out = out.select(dim, int(i))
    while adv and adv[-1] is None:
        adv.pop()
    return out, adv


def _getitem(x: FakeCuda, index: Any) -> torch.Tensor:
    out, adv = _basic_index(x, index)
    return torch.ops.aten.index.Tensor(out, adv) if adv else out


def _setitem(x: FakeCuda, index: Any, value: Any) -> None:
    out, adv = _basic_index(x, index)
    if adv:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=x.dtype)
        torch.ops.aten.index_put_.default(out, adv, value)
    elif isinstance(value, torch.Tensor):
        torch.ops.aten.copy_.default(out, value)
    else:
        out.fill_(value)


def _to(func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.to(...)`` / ``x.cuda()``: a CUDA target makes a FakeCuda copy (or keeps ``x`` if it is one)."""
    x, rest = args[0], args[1:]
    if func is torch.Tensor.cuda:
        device, dtype, copy = CUDA, None, False
        non_blocking = kwargs.get("non_blocking", False)
        memory_format = torch.preserve_format
    else:
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    if device is None or device.type != "cuda":
        return func(*args, **kwargs) if func is torch.Tensor.to else func(x, *rest, **kwargs)
    dtype = dtype or x.dtype
    if isinstance(x, FakeCuda):
        same = dtype == x.dtype and not copy
        return x if same else x.to(dtype=dtype, copy=copy, memory_format=memory_format)
    _host_copy("host-to-device", x, non_blocking)
    moved = x.to(dtype=dtype, copy=True, non_blocking=non_blocking, memory_format=memory_format)
    return FakeCuda(moved.detach())


def _refuse_fake(fn: Any) -> Any:
    """``fn`` (a native pass) raising when given a FakeCuda tensor: its C code reads CPU pointers."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if any(isinstance(t, FakeCuda) for t in tree_flatten((args, kwargs))[0]):
            raise RuntimeError(f"native.{fn.__name__} got a CUDA tensor (the native passes are CPU only)")
        return fn(*args, **kwargs)

    return guarded


_CUDA_STUBS: dict[str, Any] = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda: None,
    "mem_get_info": lambda *a, **k: (64 << 30, 80 << 30),
    "is_bf16_supported": lambda *a, **k: True,
}


class _SafeOpen:
    """``safetensors.safe_open`` that reads a ``device="cuda"`` file on the CPU and hands out FakeCuda tensors
    (safetensors copies to CUDA in Rust, through pinned memory, which a CPU build has not)."""

    def __init__(
        self, opener: Any, filename: Any, framework: str, device: Any = "cpu", **kwargs: Any
    ) -> None:
        self._cuda = _is_cuda_device(device)
        self._file = opener(filename, framework=framework, device="cpu" if self._cuda else device, **kwargs)

    def __enter__(self) -> _SafeOpen:
        self._file.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._file.__exit__(*exc)

    def _wrap(self, t: Any) -> Any:
        return FakeCuda(t) if self._cuda and isinstance(t, torch.Tensor) else t

    def get_tensor(self, name: str) -> Any:
        return self._wrap(self._file.get_tensor(name))

    def get_tensors(self) -> dict[str, Any]:
        return {k: self._wrap(v) for k, v in self._file.get_tensors().items()}

    def get_slice(self, name: str) -> Any:
        part = self._file.get_slice(name)
        wrap = self._wrap

        class _Slice:
            def __getitem__(self, index: Any) -> Any:
                return wrap(part[index])

            def __getattr__(self, attr: str) -> Any:
                return getattr(part, attr)

        return _Slice()

    def __getattr__(self, attr: str) -> Any:  # keys, metadata, offset_keys
        return getattr(self._file, attr)


def _patch_safetensors(stack: contextlib.ExitStack) -> None:
    """Every imported ``safe_open`` / ``load_file`` / ``save_file`` (safetensors' own and the names modules
    imported) replaced, for the block of ``stack``, by one that reads CUDA placements as FakeCuda tensors or
    writes FakeCuda tensors from their CPU data (safetensors reads CUDA storage pointers, which these lack)."""
    import safetensors
    import safetensors.torch

    opener = safetensors.safe_open

    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> _SafeOpen:
        return _SafeOpen(opener, filename, framework, device, **kwargs)

    def load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> dict[str, Any]:
        with safe_open(filename, framework="pt", device=device, **kwargs) as f:
            return f.get_tensors()

    saver = safetensors.torch.save_file

    def save_file(tensors: dict[str, Any], filename: Any, *args: Any, **kwargs: Any) -> None:
        return saver({k: real(v) for k, v in tensors.items()}, filename, *args, **kwargs)  # copies CUDA ones

    originals = {
        "safe_open": (opener, safe_open),
        "load_file": (safetensors.torch.load_file, load_file),
        "save_file": (saver, save_file),
    }
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("diffquant", "safetensors")):
            continue
        for attr, (old, new) in originals.items():
            if getattr(module, attr, None) is old:
                stack.enter_context(_patched(module, attr, new))


@contextlib.contextmanager
def _patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, saved)


def _patch_triton(stack: contextlib.ExitStack) -> None:
    """Triton's interpreter (TRITON_INTERPRET=1) copies each argument's storage to the host and back; a
    FakeCuda argument goes in as its CPU data (the same storage, so the kernel's writes land in it). A CPU
    tensor among CUDA ones raises, as a launch on a GPU fails on a host pointer."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # no Triton: kernels are never launched
        return
    call = GridExecutor.__call__

    @functools.wraps(call)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeCuda) for t in tensors) and not all(
            isinstance(t, FakeCuda) for t in tensors
        ):
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return call(self, *tree_map(real, args), **tree_map(real, kwargs))

    stack.enter_context(_patched(GridExecutor, "__call__", launch))


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None) -> FakeCuda:
    return FakeCuda(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None) -> FakeCuda:
    return FakeCuda(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _cuda_factories() -> torch.library.Library:
    """Python kernels for the CUDA dispatch key of the two allocators every factory ends in, so tensors
    that torch's C++ creates on the CUDA device (a Python scalar in ``torch.where(m, x, 0.0)``, SDPA's
    temporaries) are FakeCuda tensors. A CPU build has no other CUDA kernels; ``_destroy`` removes these."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (a test double for a missing backend)
    lib.impl("empty.memory_format", _empty, "CUDA")
    lib.impl("empty_strided", _empty_strided, "CUDA")
    return lib


def _drop_fakes(cache: dict) -> None:
    for key in [k for k, v in cache.items() if isinstance(v, FakeCuda)]:
        del cache[key]


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Inside: ``"cuda"`` placements make FakeCuda tensors, CPU / CUDA mixes raise, torch.cuda says there is
    one device, and the native passes refuse CUDA tensors (see the module docstring)."""
    from diffquant.kernels import native
    from diffquant.profile import stats

    with contextlib.ExitStack() as stack:
        # caches keyed by device keep no FakeCuda tensor past the block (a real cuda:0 would find it there)
        stack.callback(_drop_fakes, stats._FOLDS)
        for name, stub in _CUDA_STUBS.items():
            stack.enter_context(_patched(torch.cuda, name, stub))
        # CUDA factories reach the dispatcher, and there _cuda_factories
        stack.enter_context(_patched(torch.cuda, "_lazy_init", lambda: None))
        stack.callback(_cuda_factories()._destroy)
        for name in native.__all__:
            stack.enter_context(_patched(native, name, _refuse_fake(getattr(native, name))))
        _patch_safetensors(stack)
        _patch_triton(stack)
        # module.to(...) swaps each parameter's contents (torch.utils.swap_tensors) both ways: tied weights stay
        # one Parameter, and a FakeCuda parameter moved back to the CPU becomes a plain one
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        stack.callback(torch.__future__.set_swap_module_params_on_conversion, swap)
        stack.enter_context(_Mode())
        yield
