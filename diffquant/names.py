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
    "Face llama / diffllama folder), gguf:FILE, unilm:FOLDER or fetch:NAME (e.g. fetch:smollm2)"
)
