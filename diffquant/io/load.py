"""Loading any model a specifier names (native, quantized, zoo:, init:, hf:, gguf:, fetch:, unilm:), with
its tokenizer, and peeking at a specifier's config and tokenizer without loading weights."""

from __future__ import annotations

from pathlib import Path

import torch

try:
    import resource  # POSIX: the address-space limit
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

from diffquant.data.tokenizer import ByteTokenizer, load_tokenizer, model_tokenizer, resolve_tokenizer
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json
from diffquant.io.checkpoint import load_checkpoint, read_config, read_tokenizer
from diffquant.io.convert_cli import CONVERTER_SCHEMES, load_converted
from diffquant.io.convert_gguf import config_from_gguf, read_gguf, read_gguf_tokenizer
from diffquant.io.convert_hf import CONFIG_FILE, _folder, _folder_tokenizer, config_from_hf
from diffquant.io.convert_unilm import config_from_unilm
from diffquant.io.fetch import FETCHABLE, resolve_fetch  # noqa: F401 (public here too)
from diffquant.io.quantized import is_quantized, load_quantized
from diffquant.io.quantized import save_quantized as _save
from diffquant.models import ATTENTION_KINDS, PRESETS, preset_config
from diffquant.models.transformer import DecoderLM
from diffquant.zoo import zoo_path


def save_quantized(*args, **kwargs):
    """See :func:`diffquant.io.quantized.save_quantized` (imported lazily: it needs diffquant.quant)."""
    return _save(*args, **kwargs)


KNOWN_SCHEMES = CONVERTER_SCHEMES  # the specifiers a converter reads


def load_model(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
) -> DecoderLM:
    """Load a model from a specifier: a native checkpoint folder (quantized or not), ``zoo:NAME`` (the
    models shipped with diffquant), ``init:KIND:PRESET[:SEED]`` (a randomly initialised model),
    ``hf:PATH`` (a local Hugging Face Llama, DiffLlama, Qwen2, Qwen3, Mistral or Gemma 3 text folder),
    ``gguf:FILE`` (a llama, qwen2, qwen3 or gemma3 GGUF file),
    ``fetch:NAME`` (a real checkpoint downloaded into the cache on first use, e.g. ``fetch:smollm2``) or
    ``unilm:PATH`` (a unilm-layout decoder).

    The model comes with the tokenizer it reads as ``model.tokenizer`` (None where the checkpoint names
    none; :func:`diffquant.data.model_tokenizer` then decides); ``tokenizer`` ('byte', a tokenizer.json or
    its folder) replaces it, after checking that its ids fit the embedding.
    """
    model = _load(spec, device, dtype)
    if not hasattr(model, "tokenizer"):
        model.tokenizer = None
    if tokenizer is not None:
        model.tokenizer = model_tokenizer(model, str(spec), override=tokenizer)
    return model


def _load(spec: str | Path, device: str | torch.device, dtype: torch.dtype | None) -> DecoderLM:
    text = resolve_fetch(spec)
    scheme = text.split(":", 1)[0]
    if scheme == "init":
        return init_model(text, device=device, dtype=dtype)
    if scheme == "zoo":
        return load_checkpoint(zoo_path(text[4:]), device=device, dtype=dtype or torch.float32)
    if ":" in text and scheme in KNOWN_SCHEMES:
        return load_converted(text, device=device, dtype=dtype)

    if is_quantized(text):
        return load_quantized(text, device=device, dtype=dtype)
    return load_checkpoint(text, device=device, dtype=dtype)


def init_model(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DecoderLM:
    """``init:KIND:PRESET[:SEED]``: a seeded random model, the same as ``diffquant init`` writes."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[1] not in ATTENTION_KINDS or parts[2] not in PRESETS:
        raise DiffquantError(
            f"model specifier {spec!r}: expected init:KIND:PRESET[:SEED] with KIND one of "
            f"{', '.join(ATTENTION_KINDS)} and PRESET one of {', '.join(PRESETS)}"
        )
    try:
        seed = int(parts[3]) if len(parts) == 4 else 0
    except ValueError:
        raise DiffquantError(f"model specifier {spec!r}: seed {parts[3]!r} is not an integer") from None
    # what torch.manual_seed takes; `diffquant init --seed` and recipes bound it alike
    if not 0 <= seed < 2**63:
        raise DiffquantError(f"model specifier {spec!r}: seed {seed} is not in [0, 2**63 - 1]")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DecoderLM(preset_config(parts[2], parts[1]))
    finally:
        torch.random.set_rng_state(generator_state)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def peek_tokenizer(spec: str | Path, override: str | Path | None = None):
    """The tokenizer a model specifier brings, read without loading its weights (None: none recorded, so
    the byte tokenizer if the model has the byte vocabulary). Lets a run pick its default text and cut
    windows before any model is in memory."""
    if override is not None:
        return load_tokenizer(override)
    text = resolve_fetch(spec)
    scheme, _, rest = text.partition(":")
    if scheme in ("init", "zoo"):
        return ByteTokenizer()
    if scheme == "hf" and rest:
        return _folder_tokenizer(Path(rest)) if Path(rest).is_dir() else None
    if scheme == "gguf" and rest:
        return read_gguf_tokenizer(rest)
    if scheme == "unilm" and rest:
        return None

    return read_tokenizer(text)


def peek_config(spec: str | Path):
    """The ModelConfig a model specifier names, read from its config alone (no weights, no model built):
    what a run checks before its first write (sequence lengths, vocabulary, tokenizer fit)."""
    text = resolve_fetch(spec)
    scheme, _, rest = text.partition(":")
    if scheme == "init":
        parts = text.split(":")
        if len(parts) in (3, 4) and parts[2] in PRESETS:
            return preset_config(parts[2], parts[1])
        return init_model(text, device="meta").config  # the one-line error of init_model
    if scheme == "zoo":
        return read_config(zoo_path(rest))
    if scheme == "hf" and rest:
        return config_from_hf(read_json(_folder(rest) / CONFIG_FILE), str(Path(rest) / CONFIG_FILE))
    if scheme == "unilm" and rest:
        return config_from_unilm(read_json(_folder(rest) / CONFIG_FILE), str(Path(rest) / CONFIG_FILE))
    if scheme == "gguf" and rest:
        return config_from_gguf(read_gguf(Path(rest)), rest)
    return read_config(text)


def check_model_spec(spec: str | Path, name: str, tokenizer: str | Path | None = None, seq_lens=()):
    """Fail early, in one line, for a model a run cannot use: unreadable config, no tokenizer that fits,
    or a window longer than its context. Returns (config, tokenizer)."""
    config = peek_config(spec)
    tok = resolve_tokenizer(peek_tokenizer(spec, tokenizer), config.vocab_size, name)
    for what, length in seq_lens:
        if length is not None and length > config.max_seq_len:
            raise DiffquantError(
                f"{what} {length} exceeds the max_seq_len {config.max_seq_len} of {name} ({spec})"
            )
    return config, tok


# ============================================================ memory this process may still use
def available_bytes(device: str | torch.device = "cpu") -> int:
    """Memory a model could use on ``device`` now: free CUDA memory; on the CPU the least of MemAvailable
    (/proc/meminfo), the room left under this process's address-space limit (RLIMIT_AS minus VmSize) and
    under its memory cgroup's limit (v1 or v2, minus the usage that is not reclaimable page cache). A
    container or ``ulimit -v`` caps a run long before the machine's free memory does."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    found = [n for n in (_meminfo("MemAvailable"), _address_space_left(), _cgroup_left()) if n is not None]
    return min(found) if found else 1 << 62  # unknown: never stream by default


def _meminfo(field: str, path: str = "/proc/meminfo") -> int | None:
    """A ``kB`` field of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _meminfo("VmSize", "/proc/self/status") or 0
    return max(0, soft - used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_left(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Limit minus non-reclaimable usage of this process's memory cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``; v1's "no limit" is a huge number, taken as none)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            folder, limit_file, usage_file, cache_key = (
                root / path.lstrip("/"),
                "memory.max",
                "memory.current",
                "inactive_file",
            )
        elif "memory" in controllers.split(","):
            folder, limit_file, usage_file = (
                root / "memory" / path.lstrip("/"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
            cache_key = "total_inactive_file"
        else:
            continue
        if not (folder / limit_file).exists():  # a container sees its own cgroup at the mount's root
            folder = root if controllers == "" else root / "memory"
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        cache = 0
        try:
            for stat in (folder / "memory.stat").read_text().splitlines():
                name, _, value = stat.partition(" ")
                if name == cache_key and value.strip().isdigit():
                    cache = int(value)
        except OSError:
            pass
        return max(0, limit - max(0, usage - cache))
    return None
