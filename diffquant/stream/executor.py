"""The layer-streamed run: a model larger than memory, executed one decoder layer at a time.

The model is built on the meta device (a skeleton: module tree, taps, config, no weights). Stages run in
order: the embedding over every batch of windows, then for each decoder layer its weights are read from
the safetensors file(s) (each tensor's bytes at its offset, no file mapped; HF checkpoints re-laid out by
the converter's transforms), every batch's hidden states go through it, and its weights are released; the
final norm and LM head come last. Hidden states wait between stages in a :class:`HiddenStore` (CPU
tensors, or files past a byte budget). Peak memory is one layer's weights plus the hidden states of all
windows.

Everything the whole-model run attaches works unchanged, because the skeleton holds the same modules under
the same names: a :class:`~diffquant.profile.profiler.Profiler` hooks the same taps (each batch begun with
:meth:`~diffquant.profile.profiler.Profiler.begin_batch`, so sample indices and tokens are the whole-model
run's), a :class:`~diffquant.quant.plan.QuantPlan` is applied to the skeleton by the same pipeline
(:mod:`diffquant.quant.pipeline`): each stage's sections run when its weights are read
(:meth:`StreamedModel.read_stage`: a rotating plan's rotation with the matrices the whole model uses,
data-free codes), and the calibration runs stage by stage through the same
:func:`~diffquant.quant.pipeline.calibrate_stage` the whole-model calibration takes (data-driven weight
codes, then the static quantizers observe, values passing through), and only then do the evaluated windows
go through the quantized stage. Each site sees the
same tensors in the same batch order as in the whole-model run, so statistics, scales and logits are the
whole-model run's, bit for bit on a deterministic device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffquant.data.scoring import head_slice
from diffquant.data.tokenizer import ByteTokenizer
from diffquant.errors import DiffquantError
from diffquant.heap import map_blocks_from, release_freed_memory
from diffquant.io.artifacts import read_json
from diffquant.io.assemble import FLOAT_DTYPES, check_float_dtype, check_layer_count, check_source
from diffquant.io.checkpoint import meta_skeleton, read_config, read_tokenizer, read_trained_seq_len
from diffquant.io.convert_gguf import CHUNK_ELEMENTS, GGUF_LAYER_PATTERN, GGUFTensors
from diffquant.io.convert_hf import (
    _folder_tokenizer,
    _import_transforms,
    config_from_hf,
)
from diffquant.io.fetch import resolve_fetch
from diffquant.io.gguf_source import GGUFCheckpoint, read_gguf_checkpoint
from diffquant.io.load import (  # noqa: F401 (the memory helpers: public here too)
    _address_space_left,
    _cgroup_left,
    _meminfo,
    available_bytes,
    peek_config,
)
from diffquant.io.quantized import is_quantized
from diffquant.io.safetensors_source import TensorSource, checkpoint_folder, open_tensors
from diffquant.models.config import ModelConfig
from diffquant.models.hf_names import hf_key_map
from diffquant.models.taps import Tap
from diffquant.names import CONFIG_FILE
from diffquant.profile.profiler import Profiler
from diffquant.progress import progress as show_progress
from diffquant.quant.caches import drop_weight_cache
from diffquant.quant.methods import WeightStats
from diffquant.quant.pipeline import (
    Calibration,
    Stage,
    apply_plan,
    calibrate_stage,
    check_streams,
    read_stage,
    rotate_stage,
)
from diffquant.quant.plan import QuantPlan
from diffquant.quant.rotate import RotateSpec, StageRotation, drop_online, prepare_rotation
from diffquant.quant.weights import model_stages
from diffquant.zoo import zoo_path

Transform = Callable[[torch.Tensor], torch.Tensor]
# Hidden states kept in memory before the store spills batches to files (None: never spill).
DEFAULT_HIDDEN_BUDGET: int | None = None
# Blocks this large get their own mapping in a streamed run (see open_streamed); quantize's threshold too.
STAGE_BLOCK_THRESHOLD = 1 << 20


# ============================================================================================ sources
# Per format, the tensor-name regex whose group 1 is the decoder layer index.
LAYER_PATTERNS = {"native": r"layers\.(\d+)\.", "hf": r"model\.layers\.(\d+)\.", "gguf": GGUF_LAYER_PATTERN}


class NotStreamable(DiffquantError):
    """A specifier of a form a streamed run does not read (init:, unilm:, a quantized checkpoint): such a
    model runs whole. A broken streamable checkpoint (a missing shard, a truncated file) is a plain
    DiffquantError instead, so that it is reported, not quietly loaded another way."""


@dataclass
class StreamSpec:
    """What a streamable specifier resolves to: the folder (for ``gguf``: the file), its format, config,
    key map (native key -> file key) and re-layouts, read from the config or header alone (no tensor
    opened). ``gguf``: the parsed GGUF header of a ``gguf`` spec (its tensor table sizes the weights and
    opens the source); None for the safetensors formats."""

    spec: str
    folder: Path
    format: str  # "native", "hf" or "gguf"
    config: ModelConfig
    key_map: dict[str, str]
    transforms: dict[str, Transform] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()
    tokenizer: Any = None
    trained_seq_len: int | None = None
    gguf: GGUFCheckpoint | None = None

    @property
    def layer_pattern(self) -> str:
        return LAYER_PATTERNS[self.format]

    def open_source(
        self, dtype: torch.dtype | None = None
    ) -> contextlib.AbstractContextManager[TensorSource | GGUFTensors]:
        """The checkpoint's tensors, header-only until read: the safetensors files of :attr:`folder` (their
        own dtypes; no shard stays mapped, each stage maps its files while it is read), or the GGUF's
        tensors dequantized into ``dtype`` on read (None: float32, what ``load_model('gguf:...')`` gives),
        so that the streamed weights are the whole-model load's, bit for bit."""
        if self.gguf is not None:
            return self.gguf.open(dtype)
        return open_tensors(self.folder, headers_only=True)


def resolve_stream_spec(spec: str | Path) -> StreamSpec:
    """The streamable checkpoint a specifier names: a native folder (``zoo:NAME`` too), ``hf:FOLDER``
    (one ``model.safetensors`` or shards with ``model.safetensors.index.json``) or ``gguf:FILE`` (and
    ``fetch:NAME``, which names a GGUF; dequantized one stage at a time). Anything else is a one-line
    DiffquantError saying what to do instead."""
    text = resolve_fetch(spec)
    scheme, _, rest = text.partition(":")
    if scheme == "gguf":
        gguf = read_gguf_checkpoint(rest)
        return StreamSpec(
            text,
            gguf.file,
            "gguf",
            gguf.config,
            gguf.key_map,
            gguf.transforms,
            tokenizer=gguf.tokenizer,
            gguf=gguf,
        )
    if scheme == "hf" and rest:
        folder = checkpoint_folder(rest)
        config = config_from_hf(read_json(folder / CONFIG_FILE), str(folder / CONFIG_FILE))
        _check_layers(folder, config, "hf")
        optional = frozenset({"lm_head.weight"}) if config.tie_embeddings else frozenset()
        return StreamSpec(
            text,
            folder,
            "hf",
            config,
            hf_key_map(config),
            _import_transforms(config),
            optional,
            tokenizer=_folder_tokenizer(folder),
        )
    if scheme in ("init", "unilm"):
        raise NotStreamable(
            f"{text}: a streamed run reads safetensors checkpoints (a native folder, zoo:NAME or hf:FOLDER) "
            f"and GGUF files (gguf:FILE, fetch:NAME); load {scheme}: models whole"
        )
    folder = zoo_path(rest) if scheme == "zoo" else Path(text)
    if is_quantized(folder):
        raise NotStreamable(
            f"{folder}: a quantized checkpoint; a streamed run reads the unquantized weights and applies the "
            "plan itself (pass plan=...)"
        )
    config = read_config(folder)
    _check_layers(folder, config, "native")
    skeleton = meta_skeleton(config)
    keys = [k for k in skeleton.state_dict() if not (config.tie_embeddings and k == "lm_head.weight")]
    return StreamSpec(
        text,
        folder,
        "native",
        config,
        {k: k for k in keys},
        tokenizer=read_tokenizer(folder),
        trained_seq_len=read_trained_seq_len(folder),
    )


def _check_layers(folder: Path, config: ModelConfig, format: str) -> None:
    """The config's layer count against the layers the safetensors headers hold, before any per-layer
    structure (key map, skeleton) is built: a config claiming a billion layers is one line, not minutes of
    building. (A GGUF's count is checked by :func:`~diffquant.io.convert_gguf.gguf_tensors` when it opens.)
    Every resolved spec has passed it, so later steps need not repeat it."""
    with open_tensors(folder, headers_only=True) as source:
        check_layer_count(config.n_layers, source.keys(), LAYER_PATTERNS[format], str(folder))


def weights_bytes(spec: str | Path, *, in_memory: bool = False) -> int:
    """Bytes of the weights a specifier names, from the file headers (no tensor read).

    Safetensors: the bytes of the tensors in the file(s), which is also what they take in memory (a load
    with ``dtype=None`` keeps the file's dtypes). GGUF: by default the bytes in the file, i.e. the
    quantized blocks read from disk; with ``in_memory=True`` the bytes of the weights dequantized to
    float32 (what ``load_model('gguf:...')`` holds, and the sum of what the stages of a streamed run hold
    one at a time), several times more for a 4-bit file: that is what must fit, so :func:`would_stream`
    asks for it. Specifiers a streamed run cannot read (init:, unilm:): the config's parameter count times
    4 (fp32) either way.
    """
    try:
        resolved = resolve_stream_spec(spec)
    except NotStreamable:
        config = peek_config(spec)  # a bad specifier: the loader's one-line error
        return meta_skeleton(config).num_parameters() * 4
    if resolved.gguf is not None:
        return resolved.gguf.memory_bytes() if in_memory else resolved.gguf.file_bytes()
    with open_tensors(resolved.folder, headers_only=True) as source:
        return sum(_tensor_bytes(source, key) for key in source.keys())  # noqa: SIM118


def _tensor_bytes(source: TensorSource, key: str) -> int:
    numel = 1
    for n in source.shape(key):
        numel *= n
    return numel * _TAG_BYTES.get(source.dtype_tag(key), 4)


_TAG_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# A GGUF load parses the header again and rebuilds the tokenizer from its metadata: measured on SmolLM2-135M
# (1.7 MiB of metadata, a 49k-token vocabulary and its merges), the address space grows by 37 MiB, ~22x.
GGUF_METADATA_FACTOR = 24


def whole_load_bytes(
    spec: str | Path, device: str | torch.device = "cpu", *, weights: int | None = None
) -> int:
    """Address space a whole-model load of ``spec`` onto ``device`` takes at its peak, beyond what this
    process holds now: what :func:`~diffquant.stream.api.choose_stream` must compare with :func:`available_bytes`.

    Not the weights alone (under ``ulimit -v`` a check of the weights passes and the load dies in an
    allocator abort): on the CPU the weights (:func:`weights_bytes` ``in_memory``) plus the load's own
    temporaries, from the file headers:

    * safetensors (native, ``hf:``): the loaders map each file whole while they copy its tensors out, so the
      files' bytes count a second time;
    * GGUF: the header parsed again with the tokenizer rebuilt from it (:data:`GGUF_METADATA_FACTOR` x the
      metadata bytes), the dequantization's chunk temporaries (the raw rows and ``dequantize``'s two float32
      copies of a chunk) and the Q/K re-layout's copy of the largest tensor;
    * specifiers that do not stream (``init:``, ``unilm:``): the weights, which the model's own
      initialisation writes in place.

    The one-time cost of building a model (the meta-device initialisation imports torch's kernels: ~260 MiB
    of address space with Triton installed) is not counted: :func:`prepare_whole_load` pays it before the
    room is measured. On CUDA only the weights go to the device. ``weights``: the weights' in-memory bytes
    when the caller has them already."""
    size = weights_bytes(spec, in_memory=True) if weights is None else weights
    if torch.device(device).type != "cpu":
        return size
    try:
        resolved = resolve_stream_spec(spec)
    except NotStreamable:
        return size
    if resolved.gguf is not None:
        header = resolved.gguf.header
        metadata = min((t.offset for t in header.tensors), default=0)
        largest = max((t.n_elements * 4 for t in header.tensors), default=0)
        chunk = CHUNK_ELEMENTS * (1 + 4 + 4)  # raw bytes (<= 1 per value) + two float32 copies
        return size + GGUF_METADATA_FACTOR * metadata + chunk + largest
    with open_tensors(resolved.folder, headers_only=True) as source:
        files = {source.file(key) for key in source.keys()}  # noqa: SIM118
    return size + sum(f.stat().st_size for f in files)


# Kept free for a learned tokenizer's encoding of one document of the text in a streamed run: measured,
# 35 MB at once for a WikiText-2 test article with SmolLM2's tokenizer, an allocation its Rust library
# cannot fail without aborting the process (SIGABRT, no message), so it is reserved with room to spare.
# (A byte-level tokenizer allocates in Python and torch, whose failures are one line.)
TOKENIZER_RESERVE_BYTES = 128 << 20


def stream_load_bytes(spec: str | Path, device: str | torch.device = "cpu") -> tuple[int, str]:
    """(bytes, stage name): the address space a streamed run of ``spec`` needs at its peak beyond what this
    process holds now, and the stage that sets it, from the file headers: the largest stage's weights in
    memory (as :func:`weights_bytes` ``in_memory`` counts them: the files' dtypes, a GGUF dequantized to
    float32) plus its read temporaries (the largest tensor once more: a re-layout or cast copy; GGUF: the
    dequantization's chunk temporaries, and the tokenizer rebuilt from the header when the run opens the
    file, :data:`GGUF_METADATA_FACTOR` x its metadata) plus, for a learned tokenizer,
    :data:`TOKENIZER_RESERVE_BYTES`. Activations (batch x window, set by the task) are not counted: their
    allocation failures are torch's, one line. On CUDA, the largest stage's weights (what goes to the
    device). What :func:`~diffquant.stream.api.choose_stream` compares with :func:`available_bytes` before
    a streamed run starts."""
    resolved = resolve_stream_spec(spec)
    per_tensor = _tensor_memory_bytes(resolved)
    stages: dict[str, int] = {}
    largest: dict[str, int] = {}
    for native, size in per_tensor.items():
        name = _stage_of(native, resolved.config)
        for stage in name:
            stages[stage] = stages.get(stage, 0) + size
            largest[stage] = max(largest.get(stage, 0), size)
    top = max(stages, key=lambda k: stages[k] + largest[k])
    if torch.device(device).type != "cpu":
        return stages[top], top
    learned = resolved.tokenizer is not None and not isinstance(resolved.tokenizer, ByteTokenizer)
    extra = largest[top] + (TOKENIZER_RESERVE_BYTES if learned else 0)
    if resolved.gguf is not None:
        metadata = min((t.offset for t in resolved.gguf.header.tensors), default=0)
        extra += CHUNK_ELEMENTS * (1 + 4 + 4) + GGUF_METADATA_FACTOR * metadata
    return stages[top] + extra, top


def _tensor_memory_bytes(resolved: StreamSpec) -> dict[str, int]:
    """Native key -> bytes in memory of the tensor it reads (float32 for a GGUF's dequantized tensors)."""
    if resolved.gguf is not None:
        by_name = {t.name: t for t in resolved.gguf.header.tensors}
        return {n: by_name[s].n_elements * 4 for n, s in resolved.key_map.items() if s in by_name}
    with open_tensors(resolved.folder, headers_only=True) as source:
        present = set(source.keys())
        return {n: _tensor_bytes(source, s) for n, s in resolved.key_map.items() if s in present}


def _stage_of(native: str, config: ModelConfig) -> tuple[str, ...]:
    """The stages that read tensor ``native`` (a tied embedding: the embedding and the head)."""
    layer = re.match(r"layers\.(\d+)\.", native)
    if layer is not None:
        return (f"layers.{layer[1]}",)
    if native.startswith("embed."):
        return ("embed", "head") if config.tie_embeddings else ("embed",)
    return ("head",)


def prepare_whole_load(spec: str | Path | None = None) -> None:
    """Pay the one-time cost of building a model before the room for a load is measured: the first random
    initialisation on the meta device imports torch's meta kernels (with Triton installed, ~260 MiB of
    address space: measured on this project's environment), which :func:`available_bytes` would otherwise
    count as room the load then does not find. ``spec``: nothing to pay when its whole load builds no
    initialised meta skeleton (a native or quantized folder, ``zoo:``: :func:`~diffquant.io.checkpoint.
    meta_skeleton`; ``init:`` initialises on the device itself), so such a run never imports them."""
    if spec is not None and str(spec).partition(":")[0] not in META_INIT_SCHEMES:
        return
    with torch.device("meta"):
        nn.init.normal_(torch.empty(1))


# The specifiers whose loaders assemble a model initialised on the meta device (io/assemble.py).
META_INIT_SCHEMES = ("hf", "gguf", "fetch", "unilm")


def would_stream(
    spec: str | Path, device: str | torch.device = "cpu", budget_bytes: int | None = None
) -> tuple[bool, int, str]:
    """For ``--stream auto``: (stream?, weight bytes, reason in words). A model streams when a whole load's
    peak (:func:`whole_load_bytes`: the weights in memory, for a GGUF dequantized to float32, plus the
    load's temporaries) does not fit in ``budget_bytes`` (default: 80 % of :func:`available_bytes` of
    ``device``, measured after :func:`prepare_whole_load` where the load may fit: a model that streams
    anyway is not made to pay it) and its specifier is streamable. The bytes
    returned are the weights' in memory (``weights_bytes(in_memory=True)``)."""
    weights = weights_bytes(spec, in_memory=True)
    peak = whole_load_bytes(spec, device, weights=weights)
    if budget_bytes is None:
        budget_bytes = int(0.8 * available_bytes(device))
        if peak <= budget_bytes:  # paying the one-time cost can only lower the room: only when it may fit
            prepare_whole_load(spec)
            budget_bytes = int(0.8 * available_bytes(device))
    size = f"weights {weights / 2**30:.2f} GiB (a whole load {peak / 2**30:.2f} GiB)"
    if peak <= budget_bytes:
        return False, weights, f"{size} fit the budget {budget_bytes / 2**30:.2f} GiB"
    try:
        resolve_stream_spec(spec)
    except NotStreamable as err:
        return False, weights, f"{size} exceed the budget, but: {err}"
    return True, weights, f"{size} exceed the budget {budget_bytes / 2**30:.2f} GiB: streamed"


def return_freed_memory() -> None:
    """Hand the heap pages freed by a released stage back to the system.

    glibc serves the stage's many mid-sized tensors (activations, per-batch temporaries) from its heaps and
    keeps the freed pages: measured on a 28-layer 1.5B model, the resident set grew ~6 MB per layer (peak
    654 MB -> 572 MB with a trim after each stage). ``malloc_trim(0)`` releases them; it costs well under a
    millisecond per stage.
    """
    release_freed_memory()


# ======================================================================================= hidden store
class HiddenStore:
    """Hidden states per batch between stages: CPU tensors, and past ``budget_bytes`` files in a temporary
    folder (torch.save), removed on :meth:`close`."""

    def __init__(self, budget_bytes: int | None = DEFAULT_HIDDEN_BUDGET) -> None:
        self.budget = budget_bytes
        self._items: dict[int, torch.Tensor | Path] = {}
        self._held = 0
        self._dir: Path | None = None
        self.peak_bytes = 0
        self.spilled = 0

    def put(self, key: int, tensor: torch.Tensor) -> None:
        self.drop(key)
        tensor = tensor.detach().to("cpu")
        size = tensor.numel() * tensor.element_size()
        if self.budget is not None and self._held + size > self.budget:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="diffquant-hidden-"))
            path = self._dir / f"{key}.pt"
            torch.save(tensor, path)
            self._items[key] = path
            self.spilled += 1
            return
        self._items[key] = tensor
        self._held += size
        self.peak_bytes = max(self.peak_bytes, self._held)

    def get(self, key: int, device: str | torch.device = "cpu") -> torch.Tensor:
        item = self._items[key]
        if isinstance(item, Path):
            return torch.load(item, map_location=device, weights_only=True)
        return item.to(device)

    def drop(self, key: int) -> None:
        item = self._items.pop(key, None)
        if isinstance(item, Path):
            item.unlink(missing_ok=True)
        elif item is not None:
            self._held -= item.numel() * item.element_size()

    def close(self) -> None:
        self._items.clear()
        self._held = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# ========================================================================================== executor
class StreamedModel:
    """A meta-device skeleton of a checkpoint whose stages are materialised one at a time from the file(s).

    Use :func:`open_streamed`. ``model`` is the skeleton (attach a Profiler, apply a plan to it);
    :meth:`run` streams batches of token ids through every stage.
    """

    def __init__(
        self, resolved: StreamSpec, source: TensorSource | GGUFTensors, device: torch.device, dtype
    ) -> None:
        self.spec = resolved
        self.source = source
        self.device = device
        self.model = meta_skeleton(resolved.config)
        self.dtype = check_source(self.model, source, resolved.key_map, dtype, resolved.optional)
        self.model.tokenizer = resolved.tokenizer
        self.model.trained_seq_len = resolved.trained_seq_len
        self.peak_stage_bytes = 0
        self.stage_bytes: dict[str, int] = {}
        self.applied: list[tuple[str, str, str]] = []  # apply_plan's record (target, name, scheme)
        # an unplanned run's rotation (the float reference of a streamed quantize); a plan's rotation is a
        # section of its pipeline
        self.rotation: StageRotation | None = None
        self.gptq_stats = WeightStats()  # what the data-driven weight methods did, over the run

    def apply_plan(self, plan: QuantPlan) -> list[tuple[str, str, str]]:
        """:func:`~diffquant.quant.pipeline.apply_plan` on the skeleton (``skeleton=True``: a section a
        streamed run cannot carry is refused in one line), its record as the whole model's. Each stage's
        sections run when :meth:`materialise` reads it (a rotating plan: that stage's weights rotated with
        the matrices the whole model uses; data-free codes). A rotating plan unties a tied LM head: the head
        stage then reads the embedding's tensor from the files again, as its own weight."""
        applied = apply_plan(self.model, plan, skeleton=True)
        self._follow_untie()
        return applied

    def rotate(self, spec: RotateSpec, weights: bool = True) -> list[tuple[str, str]]:
        """Rotate this (unplanned) run per ``spec``, one stage at a time as the stages are read
        (``weights=False``: only the online modules, for weights rotated already: the float reference of a
        streamed quantize, which shares the planned run's rotated weights). Returns the rotation's report."""
        report = prepare_rotation(self.model, spec, weights)
        self.rotation = StageRotation(spec, weights)
        self._follow_untie()
        return report

    def _follow_untie(self) -> None:
        if self.spec.config.tie_embeddings and not self.model.config.tie_embeddings:
            self.spec = _untied(self.spec, self.model.config)
            check_source(self.model, self.source, self.spec.key_map, self.dtype, self.spec.optional)

    def read_stage(self, prefixes: Sequence[str]) -> None:
        """The sections' work on the stage whose weights under ``prefixes`` were just read
        (:func:`~diffquant.quant.pipeline.read_stage`), or an unplanned run's rotation of it."""
        modules = [self.model.get_submodule(p.rstrip(".")) for p in prefixes]
        stage = Stage("", list(prefixes), modules, lambda x: x)
        if self.rotation is not None:
            rotate_stage(self.model, self.rotation, stage.prefixes)
        read_stage(self.model, stage)

    @property
    def config(self) -> ModelConfig:
        return self.spec.config

    # ---------------------------------------------------------------------------- materialise
    def _keys(self, prefixes: Sequence[str]) -> dict[str, str]:
        return {n: s for n, s in self.spec.key_map.items() if n.startswith(tuple(prefixes))}

    def materialise(self, prefixes: Sequence[str]) -> int:
        """Read the weights under ``prefixes`` (``layers.3.``, ``embed.``) onto the device; their bytes.

        Only the stage's own tensors are read, each into a tensor of its own, at its offset in its file: no
        shard is mapped (a whole 500 MB shard mapped to read one 100 MB layer out of it does not fit under
        an address-space limit that holds the layer), and file pages read stay in the page cache, not in
        this process's resident set. GGUF: each tensor's byte range, dequantized a chunk at a time."""
        state = {}
        keys = self._keys(prefixes)
        if isinstance(self.source, GGUFTensors):
            for native, src in keys.items():
                # get reads and dequantizes only this tensor's byte range, through a file it opens and
                # closes itself (plain reads, nothing mapped); its errors are one line naming the file.
                state[native] = self._place(native, self.source.get(src))
        else:
            # A shard gone, cut short or replaced since the run began: named, and the run writes nothing.
            read = self.source.read(sorted(set(keys.values())), " in the middle of the run")
            used: set[str] = set()
            for native, src in keys.items():
                tensor = read[src] if src not in used else read[src].clone()  # two weights, two tensors
                used.add(src)
                state[native] = self._place(native, tensor)
            del read
        self.model.load_state_dict(state, strict=False, assign=True)
        if self.config.tie_embeddings:
            self.model.lm_head.weight = self.model.embed.weight
        self.read_stage(prefixes)  # rotated, weight quantizers checked, data-free codes
        size = sum(t.numel() * t.element_size() for t in state.values())
        return size

    def _place(self, native: str, tensor: torch.Tensor) -> torch.Tensor:
        """Re-laid out (the converter's transform), cast and moved, as the whole-model load does it."""
        if native in self.spec.transforms:
            tensor = self.spec.transforms[native](tensor)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def release(self, modules: Sequence[nn.Module]) -> None:
        """Put the parameters of ``modules`` back on the meta device (quantizer scales stay)."""
        for module in modules:
            for sub in module.modules():
                for name, p in list(sub.named_parameters(recurse=False)):
                    setattr(sub, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
                drop_weight_cache(
                    getattr(sub, "weight_quantizer", None)
                )  # the released weight's quantized copy
            if self.rotation is not None or self.model.rotation is not None:
                drop_online(module)  # the stage's rotation matrices: attached again when it is read
        if self.config.tie_embeddings:
            self.model.lm_head.weight = self.model.embed.weight
        return_freed_memory()

    # ------------------------------------------------------------------------------------ stages
    def stages(self) -> list[tuple[str, list[str], list[nn.Module], Callable]]:
        """(name, weight prefixes, modules, hidden -> hidden) in execution order: the whole model's stages
        (:func:`~diffquant.quant.weights.model_stages`, which GPTQ walks too), each with the tensors it reads."""
        head = ["norm.", "lm_head."] + (["embed."] if self.config.tie_embeddings else [])
        return [
            (name, head if name == "head" else [f"{name}."], modules, fn)
            for name, modules, fn in model_stages(self.model)
        ]

    @torch.no_grad()
    def run(
        self,
        batches: Sequence[torch.Tensor],
        *,
        profiler: Profiler | None = None,
        sample_offsets: Sequence[int] | None = None,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        on_logit_slice: Callable[[int, int, torch.Tensor], None] | None = None,
        calibration: Sequence[torch.Tensor] | None = None,
        hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
        progress: bool = True,
    ) -> dict[str, Any]:
        """Stream ``batches`` (token ids (B, T) each) through every stage.

        ``profiler``: a Profiler on :attr:`model`; batch k is begun at global sample index
        ``sample_offsets[k]`` (default: the running count of windows). ``on_logits(k, logits)`` receives
        each batch's logits (the head stage runs only when it is given or the profiler watches a head site).
        ``on_logit_slice(k, start, logits)`` instead receives them a slice of positions at a time, from
        position ``start``, when they are large (:func:`~diffquant.data.scoring.head_slice`) and the head is
        position-wise (:meth:`head_slices_exactly`), else in one call from 0: a 262k vocabulary's logits of a
        whole batch are never held.
        ``calibration``: batches that calibrate the static quantizers of each stage before the stage runs
        (the whole-model :func:`~diffquant.quant.pipeline.calibrate` over them, stage by stage).
        Returns timings and memory numbers.
        """
        if sample_offsets is None:
            sample_offsets, seen = [], 0
            for ids in batches:
                sample_offsets.append(seen)
                seen += ids.shape[0]
        if on_logits is not None and on_logit_slice is not None:
            raise ValueError("run: on_logits or on_logit_slice, not both")
        need_head = (
            on_logits is not None
            or on_logit_slice is not None
            or (profiler is not None and any(not n.startswith("layers.") for n in profiler.taps))
        )
        stages = self.stages()
        if not need_head:
            stages = stages[:-1]
        hidden = HiddenStore(hidden_budget)
        calib = self.calibration(calibration, hidden_budget, profiler) if calibration is not None else None
        info: dict[str, Any] = {"stages": len(stages), "batches": len(batches)}
        try:
            # One line every few seconds on a pipe (a bar on a terminal): a streamed 70B run takes hours.
            desc = f"streamed {Path(self.spec.spec).name or self.spec.spec}"
            for name, prefixes, modules, fn in show_progress(
                stages, desc, "stage", enabled=progress, leave=False, announce=True
            ):
                size = self.materialise(prefixes)
                self.stage_bytes[name] = size
                self.peak_stage_bytes = max(self.peak_stage_bytes, size)
                if calib is not None:
                    self.calibrate_stage(calib, name, modules, fn)
                for k, ids in enumerate(batches):
                    x = ids.to(self.device) if name == "embed" else hidden.get(k, self.device)
                    if profiler is not None:
                        profiler.begin_batch(ids.to(self.device), sample_offsets[k], count=name == "embed")
                    if name == "head" and on_logit_slice is not None:
                        self._head_slices(k, x, fn, profiler, on_logit_slice)
                        hidden.drop(k)
                        del x
                        continue
                    y = fn(x)
                    if profiler is not None:
                        profiler.end_batch()
                    if name == "head":
                        hidden.drop(k)
                        if on_logits is not None:
                            on_logits(k, y)
                    else:
                        hidden.put(k, y)
                    del x, y
                self.release(modules)
        finally:
            info.update(hidden_peak_bytes=hidden.peak_bytes, hidden_spilled=hidden.spilled)
            hidden.close()
            if calib is not None:
                calib.close()
        info["peak_stage_bytes"] = self.peak_stage_bytes
        return info

    def head_slices_exactly(self, profiler: Profiler | None) -> bool:
        """Whether the head stage (final norm, then LM head: both position-wise) gives the same logits run
        a slice of positions at a time: not when a quantizer or a hook acts on either (a quantizer may scale
        per tensor, a profiler counts positions)."""
        head = (self.model.norm, self.model.lm_head)
        if profiler is not None and any(not n.startswith("layers.") for n in profiler.taps):
            return False
        return not any(
            m._forward_hooks or m._forward_pre_hooks or (isinstance(m, Tap) and m.active)
            for unit in head
            for m in unit.modules()
        )

    def _head_slices(self, k: int, x: torch.Tensor, fn: Callable, profiler, on_slice: Callable) -> None:
        """Batch k's head stage a slice of positions at a time (one call when its logits are small)."""
        batch, length = x.shape[:2]
        step = head_slice(batch, length, self.config.vocab_size)
        if step is None or not self.head_slices_exactly(profiler):
            step = length
        for start in range(0, length, step):
            on_slice(k, start, fn(x[:, start : start + step]))
        if profiler is not None:
            profiler.end_batch()

    def calibration(
        self, batches: Sequence[torch.Tensor], hidden_budget: int | None, profiler: Profiler | None = None
    ) -> Calibration:
        """The run's calibration over ``batches`` (token ids): its hidden streams spill past ``hidden_budget``
        bytes each; ``profiler`` (a streamed profile's) is paused while calibration batches run."""
        return Calibration(
            self.model,
            batches,
            self.device,
            new_store=lambda: HiddenStore(hidden_budget),
            profiler=profiler,
            stats=self.gptq_stats,
        )

    def calibrate_stage(
        self, calib: Calibration, name: str, modules: Sequence[nn.Module], fn: Callable
    ) -> None:
        """One stage of the plan's calibration (:func:`~diffquant.quant.pipeline.calibrate_stage`, the step
        the whole-model :func:`~diffquant.quant.pipeline.calibrate` takes per stage): the data-driven weight
        methods' codes, then the static scales; each calibration stream advances through the stage."""
        if self.model.quant is None:
            return
        stage = Stage(name, [], list(modules), fn)
        calibrate_stage(calib, stage, first=name == "embed", last=name == "head")


@contextlib.contextmanager
def open_streamed(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    plan: QuantPlan | None = None,
) -> Iterator[StreamedModel]:
    """Open a streamable checkpoint: every shard and every tensor header is checked up front (a missing
    shard, tensor, wrong shape or dtype is a one-line DiffquantError before any tensor is read), the
    skeleton is built on the meta device and ``plan`` applied to it."""
    check_float_dtype(dtype, "requested dtype")
    resolved = resolve_stream_spec(spec)
    if plan is not None:
        check_streams(plan)  # before any file is opened
    device = torch.device(device)
    # Each stage's weights, freed when the next is read, are blocks of tens of MB: glibc's default would serve
    # them from its heaps after the first free (its threshold for own mappings rises to 32 MiB), and a
    # thread's heap grows by a 64 MiB reservation per stage it cannot reuse (measured on a 20-layer 1B model:
    # +67 MB of address space per layer, 2.34 GB by the head under a 2.5 GB limit). Mapped, each is
    # returned whole when freed.
    map_blocks_from(STAGE_BLOCK_THRESHOLD)
    # Headers only: no shard stays mapped (under ``ulimit -v`` a checkpoint larger than the limit could
    # not map all its shards at once); each stage maps its own files while it is read.
    with resolved.open_source(dtype) as source:  # layer counts: checked by resolve / the GGUF's open
        streamed = StreamedModel(resolved, source, device, dtype)
        if plan is not None:
            streamed.applied = streamed.apply_plan(plan)
        yield streamed


def _untied(spec: StreamSpec, config: ModelConfig) -> StreamSpec:
    """``spec`` with its LM head untied (``config``): the head's weight read from the embedding's tensor
    (and re-laid out as it is), as the whole model's untied head is a copy of the embedding."""
    key_map = {**spec.key_map, "lm_head.weight": spec.key_map["embed.weight"]}
    transforms = dict(spec.transforms)
    if "embed.weight" in transforms:
        transforms["lm_head.weight"] = transforms["embed.weight"]
    return dataclasses.replace(spec, config=config, key_map=key_map, transforms=transforms)


__all__ = [
    "FLOAT_DTYPES",
    "HiddenStore",
    "NotStreamable",
    "StreamSpec",
    "StreamedModel",
    "available_bytes",
    "open_streamed",
    "resolve_stream_spec",
    "prepare_whole_load",
    "stream_load_bytes",
    "weights_bytes",
    "whole_load_bytes",
    "would_stream",
]
