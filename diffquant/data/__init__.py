"""Text sources and the byte-level tokenizer that turn them into deterministic token streams and windows."""

from diffquant.data.corpus import (
    STDLIB_SPLITS,
    TEXT_SUFFIXES,
    Document,
    fingerprint,
    iter_documents,
    stdlib_split,
    token_stream,
    token_windows,
)
from diffquant.data.tokenizer import ByteTokenizer

__all__ = [
    "STDLIB_SPLITS",
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "Document",
    "fingerprint",
    "iter_documents",
    "stdlib_split",
    "token_stream",
    "token_windows",
]
