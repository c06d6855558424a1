"""Bit packing of integer weight codes into int32 words, as compressed-tensors' ``pack-quantized`` and the GPTQ
checkpoint layout store them (written here from the two formats' descriptions, torch only: neither library is
needed to write an export).

Both formats pack along one dimension, least significant bits first: word ``w`` of a row holds values
``w * (32 / bits) .. (w + 1) * (32 / bits) - 1``, value ``j`` of the word at bits ``bits * j``. For 2, 4 and 8
bits no value straddles two words, and every version of both formats agrees on this layout (widths that do
not divide 32 are packed differently by compressed-tensors before and after 0.20 and by AutoGPTQ, so they are
not written: :data:`PACKABLE_BITS`).
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 4, 8)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values`` [rows, cols] (each in 0 .. 2^bits - 1) packed along the last dimension into int32
    [rows, ceil(cols * bits / 32)], least significant bits first; a last word not filled is padded with 0."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"pack_rows: bits {bits} not in {PACKABLE_BITS}")
    per_word = 32 // bits
    rows, cols = values.shape
    words = -(-cols // per_word)
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"pack_rows: values outside 0..{(1 << bits) - 1}")
    v = torch.nn.functional.pad(v, (0, words * per_word - cols)).reshape(rows, words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (v << shifts).sum(dim=-1)  # < 2^32: disjoint bit fields
    return to_int32(packed)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64 in 0 .. 2^32 - 1) as the int32 with the same bits (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
