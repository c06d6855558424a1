"""The layer-streamed run: a model larger than memory, executed one decoder layer at a time.

The model is built on the meta device (a skeleton: module tree, taps, config, no weights). Stages run in
order: the embedding over every batch of windows, then for each decoder layer its weights are read from
the safetensors file(s) (memory-mapped by ``safe_open``; HF checkpoints re-laid out by the converter's
transforms), every batch's hidden states go through it, and its weights are released; the final norm and
LM head come last. Hidden states wait between stages in a :class:`HiddenStore` (CPU tensors, or files past
a byte budget). Peak memory is one layer's weights plus the hidden states of all windows.

Everything the whole-model run attaches works unchanged, because the skeleton holds the same modules under
the same names: a :class:`~diffquant.profile.profiler.Profiler` hooks the same taps (each batch begun with
:meth:`~diffquant.profile.profiler.Profiler.begin_batch`, so sample indices and tokens are the whole-model
run's), a :class:`~diffquant.quant.plan.QuantPlan` is applied to the skeleton, and static scales are
calibrated stage by stage: the calibration windows go through stage i with its static quantizers observing
(passing values through, as :func:`~diffquant.quant.calibrate.calibrate` does on the whole model), the
scales are fixed, and only then do the evaluated windows go through the quantized stage. Each site sees the
same tensors in the same batch order as in the whole-model run, so statistics, scales and logits are the
whole-model run's, bit for bit on a deterministic device.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json
from diffquant.io.assemble import FLOAT_DTYPES, check_float_dtype, check_layer_count, check_source
from diffquant.io.checkpoint import read_config, read_tokenizer, read_trained_seq_len
from diffquant.io.convert_hf import (
    _folder_tokenizer,
    _import_transforms,
    config_from_hf,
)
from diffquant.io.fetch import resolve_fetch
from diffquant.io.load import peek_config
from diffquant.io.quantized import is_quantized
from diffquant.io.safetensors_source import TensorSource, checkpoint_folder, open_tensors
from diffquant.models.config import ModelConfig
from diffquant.models.hf_names import hf_key_map
from diffquant.models.transformer import DecoderLM
from diffquant.names import CONFIG_FILE
from diffquant.profile.profiler import Profiler
from diffquant.quant.fake import FakeQuant
from diffquant.quant.plan import QuantPlan, apply_plan
from diffquant.zoo import zoo_path

Transform = Callable[[torch.Tensor], torch.Tensor]
# Hidden states kept in memory before the store spills batches to files (None: never spill).
DEFAULT_HIDDEN_BUDGET: int | None = None


# ============================================================================================ sources
@dataclass
class StreamSpec:
    """What a streamable specifier resolves to: the folder, its format, config, key map (native key ->
    file key) and re-layouts, read from the config alone (no tensor opened)."""

    spec: str
    folder: Path
    format: str  # "native" or "hf"
    config: ModelConfig
    key_map: dict[str, str]
    transforms: dict[str, Transform] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()
    tokenizer: Any = None
    trained_seq_len: int | None = None

    @property
    def layer_pattern(self) -> str:
        return r"model\.layers\.(\d+)\." if self.format == "hf" else r"layers\.(\d+)\."


def resolve_stream_spec(spec: str | Path) -> StreamSpec:
    """The streamable checkpoint a specifier names: a native folder (``zoo:NAME`` too) or ``hf:FOLDER``
    (one ``model.safetensors`` or shards with ``model.safetensors.index.json``). Anything else is a
    one-line DiffquantError saying what to do instead."""
    text = resolve_fetch(spec)
    scheme, _, rest = text.partition(":")
    if scheme == "hf" and rest:
        folder = checkpoint_folder(rest)
        config = config_from_hf(read_json(folder / CONFIG_FILE), str(folder / CONFIG_FILE))
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
    if scheme in ("init", "gguf", "unilm"):
        raise DiffquantError(
            f"{text}: a streamed run reads safetensors checkpoints (a native folder, zoo:NAME or hf:FOLDER); "
            f"load {scheme}: models whole"
        )
    folder = zoo_path(rest) if scheme == "zoo" else Path(text)
    if is_quantized(folder):
        raise DiffquantError(
            f"{folder}: a quantized checkpoint; a streamed run reads the unquantized weights and applies the "
            "plan itself (pass plan=...)"
        )
    config = read_config(folder)
    with torch.device("meta"):
        skeleton = DecoderLM(config)
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


def weights_bytes(spec: str | Path) -> int:
    """Bytes of the weights a specifier names, from the safetensors headers (no tensor read); for specifiers
    a streamed run cannot read (init:, gguf:, unilm:), the parameter count of the config times 4 (fp32)."""
    try:
        resolved = resolve_stream_spec(spec)
    except DiffquantError:
        config = peek_config(spec)  # a bad specifier: the loader's one-line error
        with torch.device("meta"):
            return DecoderLM(config).num_parameters() * 4
    with open_tensors(resolved.folder) as source:
        return sum(_tensor_bytes(source, key) for key in source.keys())  # noqa: SIM118


def _tensor_bytes(source: TensorSource, key: str) -> int:
    numel = 1
    for n in source.shape(key):
        numel *= n
    return numel * _TAG_BYTES.get(source.dtype_tag(key), 4)


_TAG_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def available_bytes(device: str | torch.device = "cpu") -> int:
    """Memory a model could use on ``device`` now: free CUDA memory, or MemAvailable of /proc/meminfo."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: never stream by default


def would_stream(
    spec: str | Path, device: str | torch.device = "cpu", budget_bytes: int | None = None
) -> tuple[bool, int, str]:
    """For ``--stream auto``: (stream?, weight bytes, reason in words). A model streams when its weights
    do not fit in ``budget_bytes`` (default: 80 % of :func:`available_bytes` of ``device``) and its
    specifier is streamable."""
    size = weights_bytes(spec)
    budget = budget_bytes if budget_bytes is not None else int(0.8 * available_bytes(device))
    if size <= budget:
        return False, size, f"weights {size / 2**30:.2f} GiB fit the budget {budget / 2**30:.2f} GiB"
    try:
        resolve_stream_spec(spec)
    except DiffquantError as err:
        return False, size, f"weights {size / 2**30:.2f} GiB exceed the budget, but: {err}"
    return True, size, f"weights {size / 2**30:.2f} GiB exceed the budget {budget / 2**30:.2f} GiB: streamed"


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

    def __init__(self, resolved: StreamSpec, source: TensorSource, device: torch.device, dtype) -> None:
        self.spec = resolved
        self.source = source
        self.device = device
        with torch.device("meta"):
            self.model = DecoderLM(resolved.config).eval()
        self.dtype = check_source(self.model, source, resolved.key_map, dtype, resolved.optional)
        self.model.tokenizer = resolved.tokenizer
        self.model.trained_seq_len = resolved.trained_seq_len
        self.peak_stage_bytes = 0
        self.stage_bytes: dict[str, int] = {}

    @property
    def config(self) -> ModelConfig:
        return self.spec.config

    # ---------------------------------------------------------------------------- materialise
    def _keys(self, prefixes: Sequence[str]) -> dict[str, str]:
        return {n: s for n, s in self.spec.key_map.items() if n.startswith(tuple(prefixes))}

    def materialise(self, prefixes: Sequence[str]) -> int:
        """Read the weights under ``prefixes`` (``layers.3.``, ``embed.``) onto the device; their bytes."""
        state = {}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for native, src in self._keys(prefixes).items():
            by_file.setdefault(self.source.file(src), []).append((native, src))
        for file, keys in by_file.items():
            # A short-lived mapping per stage: pages read through the long-lived handles would stay
            # resident (file-backed RSS) until the run ends, growing the peak to the whole checkpoint.
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for native, src in keys:
                    state[native] = self._read(handle, file, native, src)
        self.model.load_state_dict(state, strict=False, assign=True)
        if self.config.tie_embeddings:
            self.model.lm_head.weight = self.model.embed.weight
        size = sum(t.numel() * t.element_size() for t in state.values())
        return size

    def _read(self, handle: Any, file: Path, native: str, src: str) -> torch.Tensor:
        try:
            tensor = handle.get_tensor(src)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise DiffquantError(f"{file}: tensor {src} is unreadable ({err})") from None
        if native in self.spec.transforms:
            tensor = self.spec.transforms[native](tensor)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def release(self, modules: Sequence[nn.Module]) -> None:
        """Put the parameters of ``modules`` back on the meta device (quantizer scales stay)."""
        for module in modules:
            for sub in module.modules():
                for name, p in list(sub.named_parameters(recurse=False)):
                    setattr(sub, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
                quantizer = getattr(sub, "weight_quantizer", None)
                if isinstance(quantizer, FakeQuant):
                    quantizer._weight_cache = None  # the quantized copy of the released weight
        if self.config.tie_embeddings:
            self.model.lm_head.weight = self.model.embed.weight

    # ------------------------------------------------------------------------------------ stages
    def stages(self) -> list[tuple[str, list[str], list[nn.Module], Callable]]:
        """(name, weight prefixes, modules, hidden -> hidden) in execution order."""
        m = self.model
        out: list[tuple[str, list[str], list[nn.Module], Callable]] = []
        out.append(("embed", ["embed."], [m.embed], m.embed))
        for i, block in enumerate(m.layers):
            out.append((f"layers.{i}", [f"layers.{i}."], [block], block))
        head = ["norm.", "lm_head."] + (["embed."] if self.config.tie_embeddings else [])
        out.append(("head", head, [m.norm, m.lm_head], lambda h: m.lm_head(m.norm(h))))
        return out

    @torch.no_grad()
    def run(
        self,
        batches: Sequence[torch.Tensor],
        *,
        profiler: Profiler | None = None,
        sample_offsets: Sequence[int] | None = None,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        calibration: Sequence[torch.Tensor] | None = None,
        hidden_budget: int | None = DEFAULT_HIDDEN_BUDGET,
    ) -> dict[str, Any]:
        """Stream ``batches`` (token ids (B, T) each) through every stage.

        ``profiler``: a Profiler on :attr:`model`; batch k is begun at global sample index
        ``sample_offsets[k]`` (default: the running count of windows). ``on_logits(k, logits)`` receives
        each batch's logits (the head stage runs only when it is given or the profiler watches a head site).
        ``calibration``: batches that calibrate the static quantizers of each stage before the stage runs
        (the whole-model :func:`~diffquant.quant.calibrate.calibrate` over them, stage by stage).
        Returns timings and memory numbers.
        """
        if sample_offsets is None:
            sample_offsets, seen = [], 0
            for ids in batches:
                sample_offsets.append(seen)
                seen += ids.shape[0]
        need_head = on_logits is not None or (
            profiler is not None and any(not n.startswith("layers.") for n in profiler.taps)
        )
        stages = self.stages()
        if not need_head:
            stages = stages[:-1]
        hidden = HiddenStore(hidden_budget)
        calib = HiddenStore(hidden_budget) if calibration is not None else None
        info: dict[str, Any] = {"stages": len(stages), "batches": len(batches)}
        try:
            for name, prefixes, modules, fn in stages:
                size = self.materialise(prefixes)
                self.stage_bytes[name] = size
                self.peak_stage_bytes = max(self.peak_stage_bytes, size)
                if calib is not None:
                    self._calibrate_stage(name, modules, fn, calibration, calib, profiler)
                for k, ids in enumerate(batches):
                    x = ids.to(self.device) if name == "embed" else hidden.get(k, self.device)
                    if profiler is not None:
                        profiler.begin_batch(ids.to(self.device), sample_offsets[k], count=name == "embed")
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

    def _calibrate_stage(self, name, modules, fn, calibration, store, profiler) -> None:
        """Calibration batches through one stage, static quantizers observing (values pass through); then
        the stage's scales are fixed. The calibration hidden states advance with the stage."""
        quantizers = [
            q for mod in modules for q in mod.modules() if isinstance(q, FakeQuant) and q.scheme.is_static
        ]
        for q in quantizers:
            q.start_calibration()
        if profiler is not None:
            profiler.paused = True
        try:
            for k, ids in enumerate(calibration):
                x = ids.to(self.device) if name == "embed" else store.get(k, self.device)
                y = fn(x)
                if name == "head":
                    store.drop(k)
                else:
                    store.put(k, y)
        finally:
            if profiler is not None:
                profiler.paused = False
        for q in quantizers:
            q.finish_calibration()


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
    if plan is not None and (plan.smooth is not None or plan.backend is not None):
        what = "smooth (SmoothQuant)" if plan.smooth is not None else f"backend {plan.backend.name}"
        raise DiffquantError(
            f"plan {plan.name}: {what} is not supported in a streamed run (fake-quant rules only)"
        )
    device = torch.device(device)
    with open_tensors(resolved.folder, device if device.type == "cpu" else "cpu") as source:
        check_layer_count(
            resolved.config.n_layers, source.keys(), resolved.layer_pattern, str(resolved.folder)
        )
        streamed = StreamedModel(resolved, source, device, dtype)
        if plan is not None:
            apply_plan(streamed.model, plan)
        yield streamed


__all__ = [
    "FLOAT_DTYPES",
    "HiddenStore",
    "StreamSpec",
    "StreamedModel",
    "available_bytes",
    "open_streamed",
    "resolve_stream_spec",
    "weights_bytes",
    "would_stream",
]
