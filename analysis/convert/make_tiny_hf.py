"""Write tiny random Hugging Face checkpoints (DiffLlama and Llama) to try the `hf:` converters offline.

    python analysis/convert/make_tiny_hf.py runs/hf     # -> runs/hf/tiny-diffllama, runs/hf/tiny-llama

Needs transformers (the `hf` extra). The models are random: they exercise the import, not DIFF's effect.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    import torch
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/hf")
    common = dict(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    for name, cfg, cls in (
        ("tiny-diffllama", DiffLlamaConfig(**common), DiffLlamaForCausalLM),
        ("tiny-llama", LlamaConfig(**common), LlamaForCausalLM),
    ):
        cls(cfg).save_pretrained(out / name)
        print(out / name)


if __name__ == "__main__":
    main()
