"""Native checkpoints: a folder holding ``config.json`` (ModelConfig), ``model.safetensors`` and, for models
with a learned vocabulary, the tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, HF's layout).

``config.json`` records which tokenizer the model reads (``"tokenizer": "byte"`` or ``"tokenizer.json"``),
so every stage feeds it the ids it was trained on.

Writes are atomic (a temporary sibling folder renamed into place), so an interrupted save never leaves a
half-written checkpoint. Loads validate everything a user can get wrong and say so in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.overrides import TorchFunctionMode

from diffquant.data.tokenizer import BYTE, ByteTokenizer, HFTokenizer, load_tokenizer
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json, save_tensors, write_folder_atomic
from diffquant.io.convert_hf import check_layer_count
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import DecoderLM
from diffquant.names import CARD_FILE, CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from diffquant.textfiles import MAX_CONFIG_BYTES

FORMAT = "diffquant-native"
FORMAT_VERSION = 1
META_KEYS = ("config", "format", "format_version", "tokenizer")  # what write_config writes, all it reads
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")


class _NoMetaInit(TorchFunctionMode):
    """Random initialisation of meta tensors skipped: ``normal_`` on a meta tensor runs torch's Python
    decomposition, whose first use imports dynamo, inductor, sympy and Triton (~340 MB of address space,
    measured with Triton installed) to compute nothing. A loaded model never keeps an initialised weight
    (each is read from the files), and under an address-space limit that is room the weights need."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if func in _INIT_OPS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


_INIT_OPS = frozenset({torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.Tensor.normal_})


def meta_skeleton(config: ModelConfig) -> DecoderLM:
    """A :class:`DecoderLM` of ``config`` on the meta device (module tree, taps, no weights), in eval mode,
    built without running any initialisation (:class:`_NoMetaInit`)."""
    with _NoMetaInit(), torch.device("meta"):
        return DecoderLM(config).eval()


def save_checkpoint(
    model: DecoderLM,
    path: str | Path,
    overwrite: bool = False,
    state: dict[str, torch.Tensor] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``model`` to the folder ``path``; refuse to replace an existing one unless ``overwrite``.

    ``state`` replaces the model's state dict (quantized models save their base weights) and ``extra``
    writes further files into the folder before it is renamed into place.
    """
    if state is None and getattr(model, "quant_plan", None) is not None:
        raise DiffquantError("model is quantized: save it with diffquant.io.save_quantized")

    def write(tmp: Path) -> None:
        write_config(tmp, model)
        tensors = {k: v.detach().contiguous() for k, v in (state or model.state_dict()).items()}
        if model.config.tie_embeddings:
            tensors.pop("lm_head.weight", None)  # safetensors stores no aliases; tied on load
        save_tensors(tensors, tmp / WEIGHTS_FILE)  # a full disk: the one-line refusal names the weights file
        if extra is not None:
            extra(tmp)

    return write_folder_atomic(path, write, overwrite)


def write_config(folder: Path, model: DecoderLM) -> None:
    """A native checkpoint's ``config.json`` for ``model`` in ``folder``, with the tokenizer it records: the
    tokenizer files of a learned vocabulary, or ``"byte"``."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    tokenizer = getattr(model, "tokenizer", None)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(folder)
        meta["tokenizer"] = TOKENIZER_FILE
    elif isinstance(tokenizer, ByteTokenizer) or model.config.vocab_size == ByteTokenizer.vocab_size:
        meta["tokenizer"] = BYTE
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a native checkpoint folder, validated."""
    return ModelConfig.from_dict(
        _read_meta(path)["config"], source=f"{Path(path) / CONFIG_FILE} 'config'", complete=True
    )


def read_tokenizer(path: str | Path):
    """The tokenizer a native checkpoint records (None when it records none: older checkpoints)."""
    folder = Path(path)
    recorded = _read_meta(folder).get("tokenizer")
    if recorded is None:
        return None
    if recorded == BYTE:
        return ByteTokenizer()
    if recorded == TOKENIZER_FILE:
        return load_tokenizer(folder)
    raise DiffquantError(
        f"{folder / CONFIG_FILE}: 'tokenizer' = {recorded!r}, expected {BYTE!r} or {TOKENIZER_FILE!r}"
    )


def _read_meta(path: str | Path) -> dict:
    folder = _checkpoint_folder(path)
    cfg_path = folder / CONFIG_FILE
    meta = read_json(cfg_path, "config", limit=MAX_CONFIG_BYTES)
    if (
        isinstance(meta, dict)
        and meta.get("format") != FORMAT
        and ("model_type" in meta or "architectures" in meta)
    ):
        kind = meta.get("model_type") or ", ".join(map(str, meta.get("architectures") or []))
        raise DiffquantError(
            f"{cfg_path}: a Hugging Face config ({kind}), not a native checkpoint: load it as hf:{folder}"
        )
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "config" not in meta:
        raise DiffquantError(
            f"{cfg_path}: not a diffquant config (expected keys 'format': '{FORMAT}' and 'config')"
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DiffquantError(
            f"{cfg_path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
        )
    unknown = [k for k in meta if k not in META_KEYS]
    if unknown:  # a key this version does not read (a typo, a hand edit) would be silently ignored
        raise DiffquantError(
            f"{cfg_path}: unknown top-level key {unknown[0]!r}; allowed keys: {', '.join(META_KEYS)}"
        )
    return meta


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """Load a native checkpoint into a DecoderLM in eval mode.

    The model is built on the meta device and the tensors are assigned straight from the file, so the
    weights are held once, not twice.
    """
    folder = _checkpoint_folder(path)
    config = read_config(folder)
    weights = folder / WEIGHTS_FILE
    tokenizer = read_tokenizer(folder)
    try:
        with safe_open(str(weights), framework="pt", device=str(device)) as f:
            keys = list(f.keys())
            # Everything checkable from the header is checked before a module is built or a tensor read.

            check_layer_count(config.n_layers, keys, r"layers\.(\d+)\.", f"{folder / CONFIG_FILE}")
            for key in keys:
                kind = f.get_slice(key).get_dtype()
                if kind not in _FLOAT_TAGS:
                    raise DiffquantError(
                        f"{weights}: tensor {key} has dtype {kind}, expected a floating dtype "
                        f"({', '.join(_FLOAT_TAGS)})"
                    )
            model = meta_skeleton(config)
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            if config.tie_embeddings:
                expected.pop("lm_head.weight", None)
            state = {}
            for key in keys:
                tensor = f.get_tensor(key)
                # Cast tensor by tensor: the weights are never held in two dtypes at once.
                state[key] = tensor.to(dtype) if dtype is not None else tensor
    except DiffquantError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise DiffquantError(
            f"{weights}: not a readable safetensors file (truncated or corrupt: {err})"
        ) from None
    check_state_keys(state, expected, str(weights))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.tokenizer = tokenizer
    model.trained_seq_len = read_trained_seq_len(folder)
    return model.eval()


def read_trained_seq_len(folder: Path) -> int | None:
    """The context the weights were trained at, from a training card (``card.json`` of ``diffquant train``
    and the zoo: ``seq_len``); None when unknown. Evaluating beyond it measures extrapolation, not the
    model (a zoo model trained at 256 reads 1.89 bits per byte at 512 against 1.34 at 256), so text tasks
    default to it and warn past it."""
    card = folder / CARD_FILE
    if not card.is_file():
        return None
    try:
        value = json.loads(card.read_text()).get("seq_len")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def check_state_keys(
    state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str
) -> None:
    """One error listing every missing, unexpected and wrongly shaped tensor, by name."""
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing tensors {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_names(unexpected)}")
    wrong = [
        f"{k} has shape {list(state[k].shape)}, expected {list(shape)}"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    if wrong:
        problems.append("; ".join(wrong[:5]) + (f"; ... ({len(wrong)} in all)" if len(wrong) > 5 else ""))
    if problems:
        raise DiffquantError(f"{source}: " + "; ".join(problems))


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _checkpoint_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise DiffquantError(f"{folder}: checkpoint folder not found")
    if not folder.is_dir():
        raise DiffquantError(
            f"{folder}: not a checkpoint folder (expected a folder with {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise DiffquantError(
                f"{folder}: missing {name} (a native checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    return folder
