"""Text sources and the byte-level tokenizer that turn them into deterministic token windows."""

from diffquant.data.corpus import TEXT_SUFFIXES, Document, fingerprint, iter_documents, token_windows
from diffquant.data.tokenizer import ByteTokenizer

__all__ = ["TEXT_SUFFIXES", "ByteTokenizer", "Document", "fingerprint", "iter_documents", "token_windows"]
