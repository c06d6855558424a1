"""Text sources and the tokenizers that turn them into deterministic token streams and windows."""

from diffquant.data.corpus import (
    STDLIB_SPLITS,
    TEXT_SUFFIXES,
    WIKITEXT2,
    Document,
    fingerprint,
    iter_documents,
    stdlib_split,
    token_stream,
    token_windows,
)
from diffquant.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_fits,
    count_bytes,
    load_tokenizer,
    model_tokenizer,
)

__all__ = [
    "STDLIB_SPLITS",
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "Tokenizer",
    "check_fits",
    "count_bytes",
    "load_tokenizer",
    "model_tokenizer",
    "fingerprint",
    "iter_documents",
    "stdlib_split",
    "token_stream",
    "token_windows",
    "WIKITEXT2",
]
