"""A whole model spread over several devices (``--device-map``): accelerate's big-model inference for ``hf:``
and native safetensors checkpoints.

The model is built on the meta device, a device map is chosen (``auto`` / ``balanced`` / ``sequential``:
:func:`accelerate.infer_auto_device_map` over the free memory or ``--max-memory``; or an explicit mapping of
module names to devices), each tensor is read from the checkpoint file(s) straight onto its device (the
streamed run's key map and re-layouts, :func:`~diffquant.stream.executor.resolve_stream_spec`, so HF folders
are converted on the way), and :func:`accelerate.dispatch_model` hooks move the activations between devices.
Modules mapped to ``disk`` are written once to an offload folder (accelerate's format) and loaded by their
hooks for each forward, a block at a time; a ``cpu`` module of a map whose embedding is on a GPU is kept in
CPU memory and run on that GPU (accelerate's CPU offload).

The unit of placement is a decoder block (``layers.N``), the embedding, the final norm and the LM head: a
block is never split (its residual additions would cross devices), and a tied LM head stays with the
embedding. The embedding is never offloaded: it is the first parameter, whose device the runs send their
token ids to (``next(model.parameters()).device``), and the map's main device.

Modules compute exactly what they compute on one device, in the same order, so profiles, logits and
metrics are the single-device run's (bit for bit where the devices compute alike: ``cpu`` and ``disk``
both run on the CPU).

Lives above :mod:`diffquant.io` (beside the streamed run) because it reuses the streamed run's checkpoint
resolution; accelerate is optional and imported only when a map needs it.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diffquant.data.tokenizer import model_tokenizer
from diffquant.distributed import rank_and_world
from diffquant.errors import DiffquantError
from diffquant.io.assemble import check_float_dtype, check_source
from diffquant.io.checkpoint import meta_skeleton
from diffquant.io.fetch import resolve_fetch
from diffquant.io.options import Placement
from diffquant.io.quantized import is_quantized
from diffquant.io.safetensors_source import open_tensors
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import Block, DecoderLM
from diffquant.progress import progress as show_progress
from diffquant.stream.executor import resolve_stream_spec
from diffquant.textfiles import parse_yaml, read_yaml_file

STRATEGIES = ("auto", "balanced", "sequential")  # accelerate's names (auto = balanced)
DISK = "disk"
_UNITS = ("embed", "norm", "lm_head")  # with layers.N: the modules a map places
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?$", re.IGNORECASE)
_UNIT_BYTES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNIT_BYTES |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
Namer = Callable[[str], str]


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


# ================================================================================================ options
def parse_device_map(value: Any, what: str = "--device-map") -> str | dict[str, str] | None:
    """``auto`` / ``balanced`` / ``sequential``, or a mapping of module names to devices: a JSON / YAML
    text, a .json / .yaml file holding one, or (in a recipe) a mapping. Devices are checked here (module
    names need the model's config: :func:`expand_map`)."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        text = value.strip()
        if text in STRATEGIES:
            return text
        if _is_file(text):
            value = read_yaml_file(text, "device map")  # the project's one YAML reader (strict, bounded)
        else:
            try:
                value = parse_yaml(text, what)
            except DiffquantError:
                value = None  # garbled inline text: the message below shows the expected form
    if not isinstance(value, Mapping) or not value:
        raise DiffquantError(
            f"{what}: expected {', '.join(STRATEGIES)} or a JSON / YAML mapping of module -> device "
            f"(e.g. '{{embed: 0, layers.0: 0, layers.1: 1, norm: 1, lm_head: 1}}'), "
            f"got {given!r}"
        )
    return {
        str(module): device_name(device, f"{what}: {module or repr('')}") for module, device in value.items()
    }


def _is_file(text: str) -> bool:
    """Whether ``text`` names a file (False for an inline map too long or too odd to be a path)."""
    try:
        return bool(text) and Path(text).is_file()
    except (OSError, ValueError):
        return False


def device_name(value: Any, where: str) -> str:
    """A device of a map as ``cpu``, ``disk`` or ``cuda:N`` (from ``cpu``, ``disk``, ``cuda``, ``cuda:N``
    or a GPU index ``N``), checked against this machine's GPUs."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is not None and text.isdigit():
        text = f"cuda:{text}"
    if text == "cuda":
        text = "cuda:0"
    if text in ("cpu", DISK):
        return text
    if text is None or not (text.startswith("cuda:") and text[5:].isdigit()):
        raise DiffquantError(f"{where}: device {value!r}: expected cpu, disk, cuda:N or a GPU index N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DiffquantError(f"{where}: device {value!r}: CUDA is not available on this machine")
    if int(text[5:]) >= count:
        raise DiffquantError(f"{where}: device {value!r}: this machine has {count} CUDA device(s)")
    return text


def parse_max_memory(value: Any, what: str = "--max-memory") -> dict[int | str, int] | None:
    """accelerate's ``max_memory``: ``0=20GiB,1=20GiB,cpu=60GiB`` (or a recipe mapping); keys a GPU index
    (or ``cuda:N``), ``cpu`` or ``disk``; sizes in bytes or with a unit (KB, MB, GB, KiB, MiB, GiB, ...)."""
    if value is None:
        return None
    pairs: list[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str) and value.strip():
        pairs = []
        for part in value.split(","):
            key, sep, size = part.partition("=")
            if not sep:
                raise DiffquantError(
                    f"{what}: expected DEVICE=SIZE[,DEVICE=SIZE...] (e.g. 0=20GiB,cpu=60GiB), got {value!r}"
                )
            pairs.append((key.strip(), size.strip()))
    else:
        raise DiffquantError(
            f"{what}: expected DEVICE=SIZE[,DEVICE=SIZE...] (e.g. 0=20GiB,cpu=60GiB), got {value!r}"
        )
    out: dict[int | str, int] = {}
    for key, size in pairs:
        device = str(key).strip()
        if device.startswith("cuda:"):
            device = device[5:]
        if device not in ("cpu", DISK) and not device.isdigit():
            raise DiffquantError(f"{what}: device {key!r}: expected a GPU index N, cuda:N, cpu or disk")
        out[int(device) if device.isdigit() else device] = _size(size, f"{what}: {key}")
    return out


def _size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(str(value).strip()) if isinstance(value, (str, float)) else None
    if match is None:
        raise DiffquantError(
            f"{where}: size {value!r}: expected bytes or a number with a unit (e.g. 20GiB, 500MB)"
        )
    return int(float(match.group(1)) * _UNIT_BYTES[(match.group(2) or "B").upper()])


def placement_options(env: Mapping[str, Any], name: Namer = _flag) -> Placement | None:
    """The ``device_map`` / ``max_memory`` of checked ModelOptions (``env``), checked against the other
    options: None when no map is asked for. A map places the whole model itself, so ``device`` stays
    ``cpu`` (the default), and it is the alternative to a layer-streamed run, so ``stream`` stays off;
    ``max_memory`` sizes the devices of a strategy and means nothing for an explicit map. One process
    places a model over every device, so not under torchrun (ranks would each place a copy)."""
    device_map = parse_device_map(env.get("device_map"), name("device_map"))
    max_memory = parse_max_memory(env.get("max_memory"), name("max_memory"))
    if device_map is None:
        if max_memory is not None:
            raise DiffquantError(
                f"{name('max_memory')} sizes the devices of {name('device_map')} {' / '.join(STRATEGIES)}; "
                f"give {name('device_map')} too"
            )
        return None
    if max_memory is not None and not isinstance(device_map, str):
        raise DiffquantError(
            f"{name('max_memory')}: an explicit {name('device_map')} places every module itself; "
            f"max_memory applies to {', '.join(STRATEGIES)}"
        )
    stream = env.get("stream", "off")
    if stream not in ("off", False, None):
        word = "on" if stream is True else stream
        raise DiffquantError(
            f"{name('device_map')} with {name('stream')} {word}: two ways to run a model larger than one "
            f"device (a device map with disk offload, or the layer-streamed run); use one"
        )
    device = env.get("device") or "cpu"
    if device != "cpu":
        raise DiffquantError(
            f"{name('device_map')} places each module on its own device; leave {name('device')} at cpu "
            f"(got {device!r})"
        )
    if rank_and_world()[1] > 1:
        raise DiffquantError(
            f"{name('device_map')} spreads one model over this machine's devices in one process; run it "
            "without torchrun"
        )
    return Placement(device_map, max_memory, name("device_map"))


# ================================================================================================== maps
def units(config: ModelConfig) -> list[str]:
    """The modules a map places, in execution order: embed, layers.0 .. layers.N-1, norm, lm_head."""
    return ["embed", *(f"layers.{i}" for i in range(config.n_layers)), "norm", "lm_head"]


def unit_of(key: str) -> str:
    """The placed module a state-dict key (or a finer module name) belongs to."""
    head, _, rest = key.partition(".")
    if head == "layers" and rest:
        return "layers." + rest.partition(".")[0]
    return head


def expand_map(mapping: Mapping[str, str], config: ModelConfig, what: str) -> dict[str, str]:
    """An explicit map as one device per placed module (:func:`units`): an entry names a module or a group
    of them (``''`` the whole model, ``layers`` every block); the most specific entry wins. Unknown or finer
    module names, a module left without a device, an embedding on disk and a tied LM head away from the
    embedding are one-line errors."""
    n = config.n_layers
    allowed = {"", "layers", *_UNITS, *(f"layers.{i}" for i in range(n))}
    for module in mapping:
        if module not in allowed:
            finer = (
                " (a decoder block is never split)"
                if unit_of(module) in allowed and module != unit_of(module)
                else ""
            )
            raise DiffquantError(
                f"{what}: unknown module {module!r}{finer}; expected embed, layers, layers.N (N < {n}), norm, "
                f"lm_head or '' (the whole model)"
            )
    tied = config.tie_embeddings
    out: dict[str, str] = {}
    for unit in units(config):
        if tied and unit == "lm_head" and "lm_head" not in mapping:
            out[unit] = out["embed"]  # a tied head shares the embedding's weight: it goes where that goes
            continue
        candidates = [m for m in mapping if m == unit or m == "" or unit.startswith(m + ".")]
        if not candidates:
            raise DiffquantError(
                f"{what}: no device for {unit} (a map places every module: embed, layers.N, norm, lm_head; "
                f"'' covers the rest)"
            )
        out[unit] = mapping[max(candidates, key=len)]
    if out["embed"] == DISK:
        raise DiffquantError(
            f"{what}: embed on disk: the embedding must be on cpu or a GPU (token ids go to its device)"
        )
    if tied and out["lm_head"] != out["embed"]:
        raise DiffquantError(
            f"{what}: lm_head on {out['lm_head']}, embed on {out['embed']}: the LM head shares the embedding's "
            f"weight (tied embeddings), so both go on one device"
        )
    return out


def infer_map(model: DecoderLM, placement: Placement, dtype: torch.dtype) -> dict[str, str]:
    """A strategy's map (accelerate's :func:`~accelerate.infer_auto_device_map`, blocks unsplit, over the
    free memory of every GPU and the CPU, or ``max_memory``). Without CUDA and without ``max_memory``,
    everything goes on the CPU (said on stderr)."""
    what, strategy = placement.what, placement.device_map
    if (not torch.cuda.is_available() or torch.cuda.device_count() == 0) and placement.max_memory is None:
        print(
            f"diffquant: {what} {strategy}: no CUDA device on this machine; the whole model is placed on cpu",
            file=sys.stderr,
        )
        return dict.fromkeys(units(model.config), "cpu")
    accelerate = _accelerate(what)
    no_split = [Block.__name__]
    max_memory = None if placement.max_memory is None else dict(placement.max_memory)
    if strategy != "sequential":
        max_memory = accelerate.utils.get_balanced_memory(
            model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype
        )
    raw = accelerate.infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype
    )
    mapping: dict[str, str] = {}
    for module, device in raw.items():
        # a leaf module too large for a device may come back as its parameter ("embed.weight")
        name = unit_of(module) if unit_of(module) in _UNITS else module
        if model.config.tie_embeddings and name == "lm_head":
            continue  # follows the embedding
        mapping[name] = device_name(device, f"{what} {strategy}: {name}")
    return expand_map(mapping, model.config, f"{what} {strategy}")


def describe_map(device_map: Mapping[str, str]) -> str:
    """``embed, layers.0-1 -> cuda:0; layers.2-3, norm, lm_head -> cuda:1``: runs of modules per device."""
    runs: list[tuple[str, list[str]]] = []
    for unit, device in device_map.items():
        if runs and runs[-1][0] == device:
            runs[-1][1].append(unit)
        else:
            runs.append((device, [unit]))
    parts = []
    for device, names in runs:
        layers = [int(u.split(".")[1]) for u in names if u.startswith("layers.")]
        words = [u for u in names if not u.startswith("layers.")]
        if layers:
            span = f"layers.{layers[0]}" if len(layers) == 1 else f"layers.{layers[0]}-{layers[-1]}"
            words.insert(1 if names[0] == "embed" else 0, span)
        parts.append(f"{', '.join(words)} -> {device}")
    return "; ".join(parts)


# ================================================================================================ loading
def load_placed(
    spec: str | Path,
    placement: Placement,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
) -> DecoderLM:
    """The model of ``spec`` (``hf:FOLDER``, a native folder, ``zoo:NAME``) placed by ``placement``: what
    :func:`diffquant.io.load_model` gives, spread over devices. Each tensor is read once, straight onto its
    device (or into the offload folder, a temporary folder removed with the model); the whole model is
    never held on one device. The chosen map is said on stderr and kept as ``model.device_map``."""
    what = placement.what
    text = resolve_fetch(spec)
    scheme = text.split(":", 1)[0] if ":" in text else ""
    if scheme in ("init", "gguf", "unilm"):
        raise DiffquantError(
            f"{what}: {text}: places hf:FOLDER and native safetensors checkpoints (zoo:NAME too); load "
            f"{scheme}: models without {what}"
        )
    if scheme not in ("hf", "zoo") and is_quantized(text):
        raise DiffquantError(
            f"{what}: {text}: a quantized checkpoint; place its unquantized base (or load it without {what})"
        )
    resolved = resolve_stream_spec(text)
    if resolved.format not in ("hf", "native"):
        raise DiffquantError(f"{what}: {text}: places hf:FOLDER and native safetensors checkpoints")
    check_float_dtype(dtype, "requested dtype")
    config = resolved.config
    # Headers only: each tensor maps its file for its own read, so no shard stays mapped (a checkpoint
    # larger than the process's address-space limit can still be placed).
    with open_tensors(resolved.folder, headers_only=True) as source:
        model = meta_skeleton(config)
        dtype = check_source(model, source, resolved.key_map, dtype, resolved.optional)
        model = model.to(dtype).eval()  # meta: the sizes a strategy weighs are the loaded dtype's
        if isinstance(placement.device_map, str):
            device_map = infer_map(model, placement, dtype)
        else:
            device_map = expand_map(placement.device_map, config, what)
        devices = set(device_map.values())
        # hooks (and accelerate) only for a model over several devices or with offloaded modules; checked
        # before a tensor is read
        accelerate = _accelerate(what) if len(devices) > 1 or DISK in devices else None
        offload_dir = _materialise(
            model, source, resolved.key_map, resolved.transforms, device_map, dtype, accelerate
        )
    if accelerate is not None:
        _dispatch(accelerate, model, device_map, offload_dir)
    model.device_map = device_map
    model.tokenizer = resolved.tokenizer
    model.trained_seq_len = resolved.trained_seq_len
    if tokenizer is not None:
        model.tokenizer = model_tokenizer(model, str(spec), override=tokenizer)
    where = f" (offload folder {offload_dir})" if offload_dir is not None else ""
    how = f"{what} {placement.device_map}" if isinstance(placement.device_map, str) else what
    print(f"diffquant: {text} placed by {how}: {describe_map(device_map)}{where}", file=sys.stderr)
    return model


def _materialise(
    model: DecoderLM,
    source: Any,
    key_map: Mapping[str, str],
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    device_map: Mapping[str, str],
    dtype: torch.dtype,
    accelerate: Any,
) -> Path | None:
    """Read every tensor (re-laid out, cast) onto its module's device, or for ``disk`` modules into a new
    offload folder (accelerate's files and index.json), returned (None: nothing offloaded)."""
    state: dict[str, torch.Tensor] = {}
    offload_dir: Path | None = None
    index: dict[str, Any] = {}
    for native, src in show_progress(list(key_map.items()), "load", "tensor"):
        device = device_map[unit_of(native)]
        tensor = source.get(src)
        if native in transforms:
            tensor = transforms[native](tensor)
        if device == DISK:
            if offload_dir is None:
                offload_dir = Path(tempfile.mkdtemp(prefix="diffquant-offload-"))
                weakref.finalize(model, shutil.rmtree, str(offload_dir), True)
            accelerate.utils.offload_weight(tensor.to(dtype).contiguous(), native, str(offload_dir), index)
        else:
            state[native] = tensor.to(device=device, dtype=dtype).contiguous()
        del tensor
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    left = [n for n, p in model.named_parameters() if p.is_meta and device_map[unit_of(n)] != DISK]
    if left:  # a key map that misses a parameter is a bug in the converter, not a user error
        raise AssertionError(f"placement left parameters unassigned: {left}")
    if offload_dir is not None:
        accelerate.utils.save_offload_index(index, str(offload_dir))
    return offload_dir


def _dispatch(
    accelerate: Any, model: DecoderLM, device_map: dict[str, str], offload_dir: Path | None
) -> None:
    """accelerate's hooks on a model placed over more than one device (or with offloaded modules): inputs
    of each block move to its device, offloaded blocks load their weights for their forward. The main
    device is the embedding's (never offloaded)."""
    # accelerate warns that offloaded parameters sit on the meta device (and counts cpu modules run on the
    # CPU as offloaded); load_placed says where each module is instead.
    logger = logging.getLogger("accelerate.big_modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        accelerate.dispatch_model(
            model,
            device_map=device_map,
            main_device=device_map["embed"],
            offload_dir=None if offload_dir is None else str(offload_dir),
            preload_module_classes=[Block.__name__],  # an offloaded block loads all its weights at once
        )
    finally:
        logger.setLevel(level)


def _accelerate(what: str):
    """The optional accelerate package, or a one-line error saying how to install it."""
    try:
        import accelerate  # noqa: PLC0415 (optional: only device maps need it)
        import accelerate.utils  # noqa: PLC0415
    except ImportError:
        raise DiffquantError(
            f"{what}: needs the accelerate package (pip install 'diffquant[multi-gpu]')"
        ) from None
    return accelerate


__all__ = [
    "STRATEGIES",
    "Placement",
    "describe_map",
    "expand_map",
    "infer_map",
    "load_placed",
    "parse_device_map",
    "parse_max_memory",
    "placement_options",
    "units",
]
