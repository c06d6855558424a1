"""The ``tokenizer.ggml.*`` metadata every GGUF tokenizer reads the same way, whatever its model (byte-level
BPE in :mod:`diffquant.io.convert_gguf`, SentencePiece in :mod:`diffquant.io.gguf_spm`): the token list, llama.cpp's
token types and the special ids, checked with the same one-line errors for both.

``read(key)`` is a metadata value (decoded) or None, as :func:`diffquant.io.convert_gguf.metadata` gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diffquant.errors import DiffquantError

# Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

Read = Callable[[str], Any]


def vocabulary_tokens(read: Read, source: str) -> list[str]:
    """``tokenizer.ggml.tokens``, which must be a non-empty list."""
    tokens = read("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise DiffquantError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    return tokens


def token_types(read: Read, n_tokens: int, source: str) -> list[int] | None:
    """``tokenizer.ggml.token_type`` (None when absent), which must hold one type per token."""
    types = read("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != n_tokens):
        raise DiffquantError(
            f"{source}: tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 'no'} entries, "
            f"expected one per token ({n_tokens})"
        )
    return types


def special_ids(read: Read) -> dict[str, int | None]:
    """bos / eos / pad / unk ids from the metadata; a value that is not one integer is None."""
    ids: dict[str, int | None] = {}
    for what, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        value = read("tokenizer.ggml." + key)
        ids[what] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return ids
