"""SentencePiece-style GGUF tokenizers (``tokenizer.ggml.model = llama``) as a ``tokenizers.Tokenizer``.

llama.cpp's ``convert_hf_to_gguf.py`` writes Gemma, Llama-2, Mistral-v0.1 (any SentencePiece BPE model) as
``llama`` vocabularies: ``tokenizer.ggml.tokens`` with one ``scores`` entry and one ``token_type`` entry per
token, byte-fallback tokens ``<0x00>`` .. ``<0xFF>``, and usually no merges. This module rebuilds the
tokenizer those arrays describe as a BPE ``tokenizers.Tokenizer``, so it is the same
:class:`~diffquant.data.tokenizer.HFTokenizer` the byte-level (``gpt2``) GGUF path gives and every stage
(encode, offsets, byte lengths, framing, fingerprint, tokenizer.json) works unchanged.

What it follows, written from the rules rather than from either implementation:

- llama.cpp's ``llm_tokenizer_spm`` (SentencePiece's BPE encoding): spaces become U+2581, the text starts
  as one symbol per character, and the adjacent pair whose concatenation is a token with the highest score
  is merged until none is left; a character that is no token becomes its UTF-8 byte tokens. A BPE whose
  merge list holds every split ``(left, right)`` of every token whose halves are both tokens, ranked by the
  merged token's score, does exactly that. User-defined tokens (type 4) are matched whole before any of
  this (llama.cpp's ``tokenizer_st_partition``) and control tokens (type 3) are special.
- ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default when absent: true) puts a U+2581 in front of each
  stretch of text, which llama.cpp does at the start and after every special / user-defined token; the
  normalizer runs once per such stretch, so ``Prepend`` does the same.
- transformers' GGUF Gemma converter (``integrations/gguf/gguf_tokenizer_mapping.py``) for two things Gemma
  files need: tokens that are runs of real spaces (type 4, ids 138..167 in Gemma-3) are respelled as U+2581
  runs, since the text they must match has had its spaces replaced; and those respelled runs merge before
  anything else (transformers ranks Gemma merges by file position, where they come first; here they rank
  first as user-defined tokens, which llama.cpp matches before any merge). The other user-defined tokens
  (runs of newlines and tabs, ``<table>``, ...) become added tokens, as transformers adds them.

Decoding reverses it: U+2581 -> space, byte tokens -> their bytes (fused into UTF-8), and the one leading
space the prefix added is stripped only when ``add_space_prefix`` is true.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diffquant.data.tokenizer import HFTokenizer
from diffquant.errors import DiffquantError
from diffquant.io.gguf_vocab import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    special_ids,
    token_types,
    vocabulary_tokens,
)

SPACE = "\u2581"  # SentencePiece's visible space
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def sentencepiece_tokenizer(read: Callable[[str], Any], source: str) -> HFTokenizer:
    """The tokenizer of a ``tokenizer.ggml.model = llama`` GGUF; ``read(key)`` is a metadata value or None.

    BOS / EOS / PAD ids come from the metadata; ``add_bos`` defaults to true (llama.cpp's default for
    SentencePiece vocabularies). Scores are required: they are the merge order, without them there is no
    tokenizer. A vocabulary with some but not all 256 byte tokens is refused (byte fallback would turn the
    missing bytes into ``<unk>`` silently); one with none encodes unknown characters as its unknown token.
    """
    tokens = vocabulary_tokens(read, source)
    scores = read("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise DiffquantError(
            f"{source}: tokenizer.ggml.scores has {len(scores) if isinstance(scores, list) else 'no'} entries, "
            f"expected one per token ({len(tokens)}): a SentencePiece vocabulary merges by score"
        )
    types = token_types(read, len(tokens), source)
    if types is None:  # absent: all normal
        types = [TOKEN_NORMAL] * len(tokens)
    add_prefix = read("tokenizer.ggml.add_space_prefix")
    add_prefix = True if not isinstance(add_prefix, bool) else add_prefix  # llama.cpp's default for llama
    ids = special_ids(read)
    unk = ids["unk"]
    if unk is not None and not 0 <= unk < len(tokens):
        raise DiffquantError(
            f"{source}: tokenizer.ggml.unknown_token_id {unk} is outside its {len(tokens)} tokens"
        )
    backend = build_spm(tokens, scores, types, add_prefix, None if unk is None else tokens[unk], source)
    add_bos = read("tokenizer.ggml.add_bos_token")
    return HFTokenizer(
        backend,
        name=f"{source} (GGUF llama/sentencepiece)",
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        add_bos=add_bos if isinstance(add_bos, bool) else True,
    )


def respell(tokens: list[str]) -> list[str]:
    """Tokens that are runs of real spaces, spelled as U+2581 runs (what the escaped text holds).

    A run whose U+2581 spelling is already a token keeps its own spelling, so no id loses its token."""
    present = set(tokens)
    out = []
    for token in tokens:
        spelled = SPACE * len(token) if token and not token.strip(" ") else token
        out.append(token if spelled != token and spelled in present else spelled)
    return out


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose halves and concatenation are tokens, in the order BPE must try them.

    Order: user-defined tokens first (llama.cpp matches them whole before merging), then by the merged
    token's score, highest first (llm_tokenizer_spm's rule), then file position; the splits of one token
    longest left piece first (as transformers orders them). One dict lookup per split point: Gemma-3's
    262,144 tokens give 514,906 merges in about 1 s of plain Python."""
    vocab = dict.fromkeys(tokens)
    ranked: list[tuple[int, float, int, int, str, str]] = []
    for position, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if len(token) < 2:
            continue
        group = 0 if kind == TOKEN_USER_DEFINED else 1
        for cut in range(len(token) - 1, 0, -1):  # longest left first
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    ranked.append((group, -score, position, len(token) - cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    add_prefix: bool,
    unk_token: str | None,
    source: str,
) -> Any:
    """The ``tokenizers.Tokenizer``: byte-fallback BPE over the respelled vocabulary and derived merges,
    ' ' -> U+2581 (and a U+2581 in front when ``add_prefix``), control tokens special, user-defined added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers  # noqa: PLC0415 (imported on use: slow import)

    present = set(tokens)
    have = [t in present for t in BYTE_TOKENS]
    if any(have) and not all(have):
        missing = BYTE_TOKENS[have.index(False)]
        raise DiffquantError(
            f"{source}: tokenizer.ggml.tokens has byte tokens but not {missing} "
            "(byte fallback needs all 256, <0x00> .. <0xFF>)"
        )
    fallback = all(have)
    if not fallback and unk_token is None:
        raise DiffquantError(
            f"{source}: tokenizer.ggml.tokens has no byte tokens and tokenizer.ggml.unknown_token_id is missing "
            "(no way to encode a character outside the vocabulary)"
        )
    spelled = respell(tokens)
    vocab = {token: i for i, token in enumerate(spelled)}  # a repeated token keeps its last id, as llama.cpp
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(spelled, [float(s) for s in scores], types),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=fallback,
    )
    tok = Tokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    control = [t for t, kind in zip(spelled, types, strict=True) if kind == TOKEN_CONTROL]
    # Respelled space runs stay in the BPE vocabulary (their merges rank first); the rest match whole.
    user = [
        t
        for t, orig, kind in zip(spelled, tokens, types, strict=True)
        if kind == TOKEN_USER_DEFINED and t == orig
    ]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok
