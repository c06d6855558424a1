"""A byte-level tokenizer: no vocabulary file, no dependency, any text in any language.

Ids 0..255 are the UTF-8 bytes themselves and three specials follow (BOS 256, EOS 257, PAD 258), so a model
with ``vocab_size = 259`` trains on raw text without a learned tokenizer. That keeps profiles reproducible
from nothing but the text, which matters more here than tokens-per-character efficiency.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS / EOS / PAD."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259

    def __post_init__(self) -> None:
        specials = (self.bos_id, self.eos_id, self.pad_id)
        if len(set(specials)) != 3 or not all(256 <= s < self.vocab_size for s in specials):
            raise ValueError(
                f"ByteTokenizer: special ids {specials} must be distinct, >= 256 and < vocab_size "
                f"{self.vocab_size}"
            )

    @property
    def special_ids(self) -> tuple[int, int, int]:
        return (self.bos_id, self.eos_id, self.pad_id)

    def encode_bytes(self, data: bytes, bos: bool = False, eos: bool = False) -> list[int]:
        """Raw bytes -> ids, optionally framed by BOS / EOS."""
        ids = list(data)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Text -> ids of its UTF-8 bytes, optionally framed by BOS / EOS."""
        return self.encode_bytes(text.encode("utf-8"), bos=bos, eos=eos)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. Non-byte ids (specials, or ids of a larger model vocabulary) are skipped, and byte
        sequences that are not valid UTF-8 (a window cut inside a character, a model's output) decode with
        U+FFFD instead of failing, because decoding is for reading, not for round-tripping."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"ByteTokenizer.decode: negative id {i}")
            if i < 256:
                data.append(i)
        return data.decode("utf-8", errors="replace")
