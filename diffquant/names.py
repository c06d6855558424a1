"""Plain names that layers which cannot import each other share: the files of a checkpoint folder and the
compute dtypes. Torch-free and importing nothing, so the zoo (low in the layers) and the CLI's parser (which
must not import torch) read the very strings the loaders and writers use.
"""

# A native checkpoint folder (diffquant.io.checkpoint): the model config and its weights.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Hugging Face's sharded weights: the index naming each tensor's shard (read by diffquant.io.convert_hf).
INDEX_FILE = "model.safetensors.index.json"
# A training card: how the weights were made (the final/ folder of `diffquant train`, every zoo model).
CARD_FILE = "card.json"
# A learned tokenizer, in Hugging Face's layout (diffquant.data.tokenizer reads and writes these).
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# What a quantized checkpoint (diffquant.io.quantized) adds to a native one.
PLAN_FILE = "quant_plan.json"
STATE_FILE = "quant_state.safetensors"

# Compute / storage dtypes by name (--dtype, recipe `dtype:` keys); diffquant.io.options maps them to torch.
DTYPE_NAMES = ("float32", "bfloat16", "float16")

# Every form a model can be named by, for every command's help (diffquant.io.load_model reads them all; here,
# not in diffquant.io.artifacts, which re-exports it, so the CLI's parser reads it without importing yaml).
MODEL_FORMS = (
    "a native checkpoint folder (quantized or not), zoo:NAME, init:KIND:PRESET[:SEED], hf:FOLDER (a Hugging "
    "Face Llama, DiffLlama, Qwen2, Qwen3, Mistral or Gemma 3 text folder), gguf:FILE (llama, qwen2, qwen3 "
    "or gemma3), unilm:FOLDER or fetch:NAME (e.g. fetch:smollm2)"
)

# A plain name: what a user may call a model, a seed group, a task or a recipe (a run's default folder) where
# the name becomes a file or folder name in a run folder (profile/NAME.json, quantized/NAME--PLAN/,
# runs/NAME). ASCII letters and digits, '.', '_' and '-', starting with a letter, a digit or '_' (so never
# '.', '..', a hidden file or something read as an option), at most MAX_NAME_LENGTH characters: no '/' or
# '\\' (a path, absolute or climbing out with '..'), no NUL, no space or control character, no ':' (a
# specifier's separator, and a drive on Windows).
MAX_NAME_LENGTH = 100
_NAME_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_NAME_REST = _NAME_FIRST | frozenset(".-")
PLAIN_NAME_RULE = (
    f"letters, digits, '.', '_', '-' only, starting with a letter, a digit or '_', at most {MAX_NAME_LENGTH} "
    "characters"
)


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain name (:data:`PLAIN_NAME_RULE`): safe as one file or folder name."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_NAME_LENGTH
        and name[0] in _NAME_FIRST
        and all(c in _NAME_REST for c in name)
    )


def plain_name_from(text: str, fallback: str = "model") -> str:
    """A plain name made from ``text`` (a model specifier's last part, say): every run of other characters
    becomes '_', a leading '.' or '-' is dropped, the length is cut to the limit; ``fallback`` when nothing
    is left."""
    out: list[str] = []
    for c in text:
        if c in _NAME_REST:
            out.append(c)
        elif not out or out[-1] != "_":
            out.append("_")
    name = "".join(out).lstrip(".-")[:MAX_NAME_LENGTH]
    return name if is_plain_name(name) else fallback
