"""Tokenizers: the byte tokenizer of the native and zoo models, and Hugging Face ``tokenizers`` for real
checkpoints.

Every stage turns text into ids through the model's own tokenizer, because a profile, a perplexity or a
multiple-choice score computed on the wrong ids is silently meaningless (a 49k-vocabulary Llama fed UTF-8
bytes reads sub-word ids 0..255). The interface is small on purpose: what the stages need is

- ``encode(text)`` without any special token, ``decode(ids)``;
- ``bos_id`` / ``eos_id`` / ``pad_id`` (None where the tokenizer has none) and ``add_bos``, whether the model
  expects its sequences to start with BOS (the byte models were trained with it, SmolLM2 without);
- ``frame(text)``: one document as the stream carries it (``[BOS] + ids + [EOS]`` where those exist);
- ``byte_lengths()``: how many UTF-8 bytes each id stands for (0 for specials), which makes bits per byte
  comparable across tokenizers;
- ``vocab_size`` (largest id + 1: what must fit the model's embedding) and ``fingerprint()``.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.names import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from diffquant.textfiles import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, read_json, read_text_bounded

BYTE = "byte"


class Tokenizer(ABC):
    """What every stage needs from a tokenizer (see the module docstring)."""

    name: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Largest id this tokenizer can produce, plus one."""

    @abstractmethod
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Text -> ids with no special token, optionally framed by BOS / EOS."""

    @abstractmethod
    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (no specials) and, per id, the [start, end) character span of ``text`` it covers,
        so a stage can find the tokens of a piece of text (a needle's digits) in any tokenizer."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (specials skipped)."""

    @abstractmethod
    def byte_lengths(self) -> torch.Tensor:
        """(vocab_size,) int64: UTF-8 bytes each id stands for in decoded text; 0 for special tokens."""

    @abstractmethod
    def fingerprint(self) -> str:
        """sha256 naming the exact mapping text -> ids (recorded next to results)."""

    def frame(self, text: str, bos: bool = True) -> list[int]:
        """One document of a stream: ``[BOS]`` (when the model expects it and ``bos``) + ids + ``[EOS]``
        (when there is one), so documents stay separated as in pretraining."""
        bos = bos and self.add_bos and self.bos_id is not None
        return self.encode(text, bos=bos, eos=self.eos_id is not None)

    def describe(self) -> str:
        return f"{self.name} ({self.vocab_size:,} ids)"

    @property
    def prefix_bytes(self) -> int:
        """Bytes the tokenizer puts in front of every text it encodes and that are not the text's: 1 for
        SentencePiece's dummy prefix (``"river"`` -> ``"\u2581river"``, Llama / Mistral) or a byte-level BPE
        with ``add_prefix_space``, else 0. The first token of a document carries them, so the bytes of
        scored text subtract them there (see :func:`text_bytes`)."""
        return 0


@dataclass(frozen=True)
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 plus BOS / EOS / PAD: no vocabulary file, no dependency, any language.

    A model with ``vocab_size = 259`` trains on raw text without a learned tokenizer, which keeps profiles
    reproducible from nothing but the text.
    """

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259  # type: ignore[assignment]  (a field here, a property in the interface)
    name: str = field(default=BYTE)
    add_bos: bool = True

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

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            data = char.encode("utf-8")
            ids.extend(data)
            offsets.extend([(i, i + 1)] * len(data))
        return ids, offsets

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

    def byte_lengths(self) -> torch.Tensor:
        lengths = torch.zeros(self.vocab_size, dtype=torch.long)
        lengths[:256] = 1
        return lengths

    def fingerprint(self) -> str:
        return hashlib.sha256(f"diffquant-byte-tokenizer:{self.special_ids}".encode()).hexdigest()


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Character -> byte of the GPT-2 byte-level alphabet (Radford et al. 2019, ``bytes_to_unicode``):
    printable Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onwards in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (a ``tokenizer.json``) with the special ids the model uses.

    ``encode`` never lets the tokenizer's post-processor add specials (lm-evaluation-harness encodes the
    same way for causal models); BOS / EOS are added explicitly where a stage wants them.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.bos_id, self.eos_id, self.pad_id, self.add_bos = bos_id, eos_id, pad_id, bool(add_bos)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        for what, value in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
            if value is not None and not 0 <= value < self._vocab_size:
                raise DiffquantError(
                    f"tokenizer {name}: {what} id {value} is outside its vocabulary of {self._vocab_size} ids"
                )
        self._lengths: torch.Tensor | None = None
        self._prefix: int | None = None

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos:
            ids.insert(0, self._need(self.bos_id, "BOS"))
        if eos:
            ids.append(self._need(self.eos_id, "EOS"))
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def _need(self, value: int | None, what: str) -> int:
        if value is None:
            raise DiffquantError(f"tokenizer {self.name}: has no {what} token")
        return value

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def byte_lengths(self) -> torch.Tensor:
        """Bytes per id: from the byte-level alphabet for byte-level BPE (exact), else from the token's
        text with SentencePiece's U+2581 as a space and ``<0xNN>`` byte-fallback tokens as one byte."""
        if self._lengths is None:
            spec = json.loads(self._tok.to_str())
            byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(
                spec.get("pre_tokenizer")
            )
            alphabet = _gpt2_byte_alphabet()
            special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
            lengths = torch.zeros(self._vocab_size, dtype=torch.long)
            for token, i in self._tok.get_vocab(with_added_tokens=True).items():
                if i in special:
                    continue
                fallback = _BYTE_FALLBACK.match(token)
                if fallback:
                    lengths[i] = 1
                elif byte_level and all(c in alphabet for c in token):
                    lengths[i] = len(token)
                else:
                    lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
            self._lengths = lengths
        return self._lengths

    @property
    def prefix_bytes(self) -> int:
        """Measured, not read from the normalizer / pre-tokenizer settings (they are spelled in several ways
        across tokenizer.json versions): the bytes the tokens of ``"a"`` stand for, less the one byte of
        ``"a"``."""
        if self._prefix is None:
            ids = self._tok.encode("a", add_special_tokens=False).ids
            self._prefix = max(0, int(self.byte_lengths()[ids].sum()) - 1)
        return self._prefix

    def fingerprint(self) -> str:
        h = hashlib.sha256(b"diffquant-hf-tokenizer\0")
        h.update(self._tok.to_str().encode("utf-8"))
        h.update(json.dumps([self.bos_id, self.eos_id, self.pad_id, self.add_bos]).encode())
        return h.hexdigest()

    def special_config(self) -> dict[str, Any]:
        """The special tokens as ``tokenizer_config.json`` states them (written next to tokenizer.json)."""

        def token(i: int | None) -> str | None:
            return None if i is None else self._tok.id_to_token(i)

        return {
            "bos_token": token(self.bos_id),
            "eos_token": token(self.eos_id),
            "pad_token": token(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (HF's layout)."""
        folder = Path(folder)
        self._tok.save(str(folder / TOKENIZER_FILE))
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(self.special_config(), indent=2) + "\n")


# ============================================================================================= loading
def _read_json_optional(path: Path) -> dict[str, Any]:
    """A tokenizer's config file (tokenizer_config.json, generation_config.json, config.json) as a dict;
    {} when there is none. One that is there is read bounded (a regular file of at most 16 MiB:
    :func:`diffquant.textfiles.read_json`): a FIFO or a device in its place is refused, not read forever."""
    if not path.exists():
        return {}
    data = read_json(path, "tokenizer config", limit=MAX_CONFIG_BYTES)
    return data if isinstance(data, dict) else {}


_TOKEN_FORMS = 'a string or an AddedToken object ({"content": "<s>", ...}) or null'


def _token_text(value: Any, file: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken object whose
    ``content`` is one (what Hugging Face writes); null is none. Anything else (``["<s>"]``, ``5``) is a
    one-line error: read as "no such token", it would silently drop BOS / EOS."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DiffquantError(f"{file}: {key} must be {_TOKEN_FORMS}, got {value!r}")


def _flag(cfg: dict[str, Any], file: Path, key: str) -> bool | None:
    """``add_bos_token`` / ``add_eos_token``: true, false or absent (None); ``"yes"`` or ``1`` is refused
    rather than read as "not given" (which would fall back to the post-processor's choice)."""
    value = cfg.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise DiffquantError(f"{file}: {key} must be true or false, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _first_id(value: Any, file: Path, key: str) -> int | None:
    """An id from config.json / generation_config.json: an int, or a list of them (``eos_token_id: [1, 2]``,
    the ids generation stops at) whose first entry frames documents; null, an empty list or a negative id
    (``pad_token_id: -1`` in early Llama configs) is none. Anything else is refused: taking it as "no such
    token" would silently drop BOS / EOS."""
    if value is None or value == [] or (_is_int(value) and value < 0):
        return None
    if _is_id(value) or (isinstance(value, list) and all(_is_id(v) for v in value)):
        return value[0] if isinstance(value, list) else value
    raise DiffquantError(f"{file}: {key} must be a token id or a list of ids, got {value!r}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """``'byte'``, a ``tokenizer.json`` file, or a folder holding one (a Hugging Face checkpoint folder).

    Special tokens come from ``tokenizer_config.json`` (bos_token / eos_token / pad_token /
    add_bos_token), else ``generation_config.json`` / ``config.json`` (bos_token_id, eos_token_id,
    pad_token_id), whichever the folder has; where none names BOS, the token the tokenizer's own
    post-processor puts in front (a bare Llama tokenizer.json: ``<s>``). A named token that is not in
    the vocabulary, or an id that is not an id, is a one-line error.
    """
    if str(path) == BYTE:
        return ByteTokenizer()
    if not str(path).strip():  # Path('') is '.', which would quietly read whatever the working folder holds
        raise DiffquantError(
            f"tokenizer {str(path)!r}: empty path (expected 'byte', a tokenizer.json or its folder)"
        )
    path = Path(path).expanduser()
    if path.is_dir():
        folder, file = path, path / TOKENIZER_FILE
        if not file.is_file():
            raise DiffquantError(
                f"{path}: no {TOKENIZER_FILE} in the folder (expected a Hugging Face tokenizer)"
            )
    elif path.is_file():
        folder, file = path.parent, path
    else:
        raise DiffquantError(
            f"tokenizer {str(path)!r}: no such file or folder (expected 'byte', a tokenizer.json or its folder)"
        )
    backend = parse_tokenizer_json(file)
    tok_cfg = (
        _read_json_optional(folder / TOKENIZER_CONFIG_FILE)
        if path.is_dir() or file.name == TOKENIZER_FILE
        else {}
    )
    cfg_file = folder / TOKENIZER_CONFIG_FILE
    ids: dict[str, int | None] = {}
    for key in ("bos", "eos", "pad"):
        text = _token_text(tok_cfg.get(f"{key}_token"), cfg_file, f"{key}_token")
        ids[key] = backend.token_to_id(text) if text is not None else None
        if text is not None and ids[key] is None:  # a typo or another model's token: no silent "no BOS"
            raise DiffquantError(
                f"{folder / TOKENIZER_CONFIG_FILE}: {key}_token {text!r} is not in the vocabulary of {file}"
            )
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json_optional(folder / name)
        for key in ("bos", "eos", "pad"):
            if ids[key] is None:
                ids[key] = _first_id(cfg.get(f"{key}_token_id"), folder / name, f"{key}_token_id")
    if ids["bos"] is None:  # a bare tokenizer.json: its post-processor still says which token opens a text
        ids["bos"] = _post_processor_bos(backend)
    add_bos = _flag(tok_cfg, cfg_file, "add_bos_token")
    _flag(
        tok_cfg, cfg_file, "add_eos_token"
    )  # not read (documents end with EOS): its type still must be right
    if add_bos is None:
        add_bos = _post_processor_adds_bos(backend, ids["bos"])
    return HFTokenizer(
        backend, name=str(file), bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], add_bos=add_bos
    )


def parse_tokenizer_json(file: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a file; a file that does not parse is a one-line error."""
    from tokenizers import Tokenizer as Backend  # noqa: PLC0415 (imported on use: slow import)

    text = read_text_bounded(file, MAX_TOKENIZER_BYTES, "tokenizer.json")  # not a FIFO, not unbounded
    try:
        return Backend.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DiffquantError(f"{file}: not a valid tokenizer.json ({first})") from None


def _post_processor_bos(backend: Any) -> int | None:
    """The special token the tokenizer's post-processor puts in front of a single text (``<s>`` in a
    Llama tokenizer.json's TemplateProcessing), or None: what names BOS when no config file does."""
    bare = backend.encode("a", add_special_tokens=False).ids
    framed = backend.encode("a", add_special_tokens=True).ids
    if len(framed) > len(bare) and framed[len(framed) - len(bare) :] == bare:
        lead = framed[: len(framed) - len(bare)]
        return lead[0] if len(lead) == 1 else None
    return None


def _post_processor_adds_bos(backend: Any, bos_id: int | None) -> bool:
    """Whether the tokenizer's own post-processor puts BOS in front (Llama-2 / Llama-3 style), the way a
    tokenizer.json without a tokenizer_config.json says the model expects BOS."""
    if bos_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def check_fits(tokenizer: Tokenizer, vocab_size: int, model: str) -> None:
    """A tokenizer whose ids do not fit the model's embedding would fail deep inside it (or worse, index
    the wrong rows of a larger one): refuse it in one line."""
    if tokenizer.vocab_size > vocab_size:
        raise DiffquantError(
            f"{model}: tokenizer {tokenizer.describe()} produces ids up to {tokenizer.vocab_size - 1}, "
            f"but the model's embedding has vocab_size {vocab_size}"
        )


def model_tokenizer(
    model: Any, name: str = "model", override: Tokenizer | str | Path | None = None
) -> Tokenizer:
    """The tokenizer a stage must feed ``model`` through, checked against its embedding.

    ``override`` (``--tokenizer`` / the recipe key) wins; then the tokenizer the model was loaded with
    (``model.tokenizer``: a checkpoint's saved tokenizer, an ``hf:`` folder's tokenizer.json, a GGUF's
    vocabulary); a model with exactly the byte vocabulary (259 ids) reads bytes. Anything else would be
    fed byte ids that mean other tokens to it, so it is an error rather than a silently wrong number.
    """
    if override is not None:
        tokenizer = override if isinstance(override, Tokenizer) else load_tokenizer(override)
    else:
        tokenizer = getattr(model, "tokenizer", None)
    return resolve_tokenizer(tokenizer, int(model.config.vocab_size), name)


def resolve_tokenizer(tokenizer: Tokenizer | None, vocab: int, name: str = "model") -> Tokenizer:
    """``tokenizer``, or the byte tokenizer for a model of exactly the byte vocabulary when it is None,
    checked against an embedding of ``vocab`` rows (see :func:`model_tokenizer`)."""
    if tokenizer is None:
        if vocab != ByteTokenizer.vocab_size:
            raise DiffquantError(
                f"{name}: vocab_size {vocab} is not the byte vocabulary ({ByteTokenizer.vocab_size} ids) and "
                "the model brings no tokenizer; give one with --tokenizer PATH (a tokenizer.json or its "
                "folder; 'byte' for raw bytes) or the recipe key 'tokenizer'"
            )
        tokenizer = ByteTokenizer()
    check_fits(tokenizer, vocab, name)
    return tokenizer


def text_bytes(stream: torch.Tensor, tokenizer: Tokenizer) -> torch.Tensor:
    """(n,) int64: the UTF-8 bytes of text each position of a token stream (1-D, as
    :func:`diffquant.data.token_stream` frames it) stands for; 0 for specials.

    A token's :meth:`Tokenizer.byte_lengths`, except that the first token of each document (the stream's
    first, and the first after a BOS or EOS) loses the tokenizer's :attr:`Tokenizer.prefix_bytes`: the
    dummy-prefix space a SentencePiece tokenizer adds is not a byte of the text, and counting it would
    make bits per byte depend on how many documents the text is split into."""
    stream = stream.flatten().long()
    lengths = tokenizer.byte_lengths()[stream]
    prefix = tokenizer.prefix_bytes
    if prefix and stream.numel():
        marks = torch.zeros_like(stream, dtype=torch.bool)
        for special in (tokenizer.bos_id, tokenizer.eos_id):
            if special is not None:
                marks |= stream == special
        starts = torch.ones_like(marks)
        starts[1:] = marks[:-1]
        starts &= lengths > 0
        lengths = torch.where(starts, (lengths - prefix).clamp(min=0), lengths)
    return lengths


def count_bytes(ids: torch.Tensor, tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of text that ``ids`` (a token stream, or windows cut from it in order) stand for
    (specials count 0; see :func:`text_bytes`)."""
    return int(text_bytes(ids, tokenizer).sum())
