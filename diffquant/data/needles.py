"""Synthetic needle-retrieval prompts (DIFF paper, key information retrieval; arXiv 2410.05258).

A context of filler text holds N "needles", sentences that give a city a magic number ("The magic number of
Paris is 4721."); the prompt asks for the number of one of R queried cities, whose needle sits at a given
depth of the context (0/25/50/75/100 %). Everything is seeded, so two models (or a model before and after
quantization) see identical prompts. Samples are text; each model reads them through its own tokenizer
(:func:`encode_prompt` finds the tokens of the needle's digits from character offsets).

Used by the retrieval evaluation (:mod:`diffquant.eval.retrieval`, which scores the samples) and by the
trainer, whose batches mix in needle documents (:mod:`diffquant.train.data`).
"""

from __future__ import annotations

import random
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from diffquant.data.tokenizer import ByteTokenizer, Tokenizer
from diffquant.errors import DiffquantError

__all__ = [
    "CITIES",
    "FILLER_SENTENCES",
    "NeedleSample",
    "RetrievalConfig",
    "encode_prompt",
    "make_samples",
    "prompt_ids",
]

BYTES = ByteTokenizer()

# Single-word ASCII names, none a suffix of another ("York" would hide inside "New York"), so a needle's
# city is unambiguous for the model and for the test doubles that parse prompts.
CITIES: tuple[str, ...] = (
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Warsaw", "Lisbon",
    "Dublin", "Oslo", "Stockholm", "Helsinki", "Copenhagen", "Amsterdam", "Brussels", "Athens", "Istanbul",
    "Cairo", "Nairobi", "Lagos", "Johannesburg", "Mumbai", "Delhi", "Bangkok", "Singapore", "Jakarta",
    "Manila", "Seoul", "Beijing", "Shanghai", "Sydney", "Melbourne", "Auckland", "Toronto", "Montreal",
    "Chicago", "Boston", "Denver", "Seattle", "Houston", "Lima", "Santiago", "Bogota", "Havana",
    "Reykjavik", "Budapest", "Zurich", "Munich",
)  # fmt: skip

# The built-in haystack: plain, digit-free sentences (digits would be decoys for the magic numbers), varied
# enough that a byte-level model cannot find the needle just by spotting the one non-repeating sentence.
FILLER_SENTENCES: tuple[str, ...] = (
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Most of the orchard was planted by a family who left long before anyone can remember.",
    "On quiet mornings the fog rolls down from the hills and settles over the fields.",
    "A good notebook is worth more than a clever memory when the details start to pile up.",
    "The library keeps its maps in wide drawers that squeak whenever someone opens them.",
    "Bakers in the market square start work while the streets are still dark and empty.",
    "Every spring the swallows return to the same beams under the roof of the barn.",
    "Nobody could explain why the clock in the tower always ran a little fast in winter.",
    "The ferry crosses the lake slowly, and most passengers spend the trip watching the water.",
    "Learning a new language feels hopeless for a while and then suddenly begins to click.",
    "The museum moved its oldest paintings to a cooler room to protect the fading colours.",
    "Children along the coast learn early to read the tide from the colour of the sand.",
    "A long walk after dinner tends to settle the mind better than any argument does.",
    "The carpenter insisted that a table is only finished when nobody notices the joints.",
    "Rain on a tin roof makes an afternoon feel longer and somehow more comfortable.",
    "Old railway lines across the valley have been turned into paths for cyclists and walkers.",
    "The committee argued for hours about the colour of the new benches in the park.",
    "Some gardeners swear that plants grow better when someone talks to them each morning.",
    "The lighthouse keeper wrote letters every evening, although few of them were ever sent.",
    "In the mountains the weather can change from sunshine to snow within a single hour.",
    "A well-made soup needs patience more than it needs any rare or expensive ingredient.",
    "The students kept a small telescope on the roof and took turns watching the planets.",
    "Traders once carried salt, wool and spices along the narrow road through the pass.",
    "The choir practised in the cold church because the acoustics there were beyond compare.",
    "Foxes have become bold enough to wander through the gardens in the middle of the day.",
    "Her grandfather repaired radios in a workshop that smelled of solder and dust.",
    "The annual fair brings jugglers, musicians and a great deal of noise to the village.",
    "Reading aloud is a habit that slows the reader down and makes the story last longer.",
    "The bridge was painted a bright shade of red so that ships could see it through the mist.",
    "After the harvest the farmers gather in the hall to share food and tell old stories.",
    "A stray cat adopted the bookshop and now sleeps on the poetry shelf every afternoon.",
    "The canal freezes only in the hardest winters, and then the whole town goes skating.",
)


@dataclass(frozen=True)
class RetrievalConfig:
    """One retrieval task: N needles, R queried cities, the depths to test and the context size.

    The defaults are the paper's 1/1 cell at a size a small byte-level model can hold (``context_bytes``
    plus ~80 bytes of question must fit the model's ``max_seq_len``).
    """

    n_needles: int = 1  # N: needle sentences (city -> number) in the context
    n_queries: int = 1  # R: cities asked about, each scored as its own prompt over the same context
    depths: tuple[float, ...] = (0, 25, 50, 75, 100)  # % depth of the queried needle in the context
    samples_per_depth: int = 10
    context_bytes: int = 1024  # approximate size of the filler + needles context
    digits: int = 4  # magic numbers have this many digits (first digit non-zero)
    seed: int = 0
    filler: str | None = None  # filler text; None = the built-in FILLER_SENTENCES

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(self.depths))  # a list from YAML would be unhashable

        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise DiffquantError(f"retrieval {name}: expected {expected}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.n_needles) and 1 <= self.n_needles <= len(CITIES), "n_needles", f"1..{len(CITIES)}")
        need(is_int(self.n_queries) and 1 <= self.n_queries <= self.n_needles, "n_queries", "1..n_needles")
        need(
            len(self.depths) > 0
            and all(
                isinstance(d, int | float) and not isinstance(d, bool) and 0 <= d <= 100 for d in self.depths
            ),
            "depths",
            "a non-empty list of percentages in [0, 100]",
        )
        need(
            is_int(self.samples_per_depth) and self.samples_per_depth >= 1,
            "samples_per_depth",
            "an integer >= 1",
        )
        need(is_int(self.context_bytes) and self.context_bytes >= 0, "context_bytes", "an integer >= 0")
        need(is_int(self.digits) and self.digits >= 1, "digits", "an integer >= 1")
        need(
            9 * 10 ** (self.digits - 1) >= self.n_candidates,
            "digits",
            f"enough {self.digits}-digit numbers for {self.n_candidates} distinct candidates",
        )
        need(is_int(self.seed), "seed", "an integer")
        need(self.filler is None or isinstance(self.filler, str), "filler", "a string or None")

    @property
    def n_candidates(self) -> int:
        """Candidates per prompt: every needle's number, plus distractors up to 4 (chance <= 25 %)."""
        return max(self.n_needles, 4)


@dataclass(frozen=True)
class NeedleSample:
    """One scored prompt, as text: every model reads it through its own tokenizer."""

    prompt: str  # context + question, ends right before the answer
    answer: str  # e.g. " 4721": what should follow the prompt
    digits: tuple[int, int]  # [start, end) character offsets of the queried needle's number in ``prompt``
    candidates: tuple[str, ...]  # answer strings to rank, sorted (so the position leaks nothing)
    label: int  # index of ``answer`` in ``candidates``
    depth: float
    city: str

    @property
    def answer_span(self) -> tuple[int, int]:
        """[start, end) token indices of the needle's digits for the byte tokenizer (BOS at index 0)."""
        return encode_prompt(self, BYTES)[1]

    @property
    def query_pos(self) -> int:
        """Index of the last prompt token for the byte tokenizer, where the answer is predicted."""
        return encode_prompt(self, BYTES)[2]


def encode_prompt(sample: NeedleSample, tokenizer: Tokenizer) -> tuple[list[int], tuple[int, int], int]:
    """(prompt ids, [start, end) token span of the needle's digits, index of the last prompt token).

    BOS leads where the model expects it; the span holds every token that overlaps the digits' characters
    (a BPE token may join a digit to its neighbours).
    """
    ids, offsets = tokenizer.encode_offsets(sample.prompt)
    lead = 1 if tokenizer.add_bos and tokenizer.bos_id is not None else 0
    lo, hi = sample.digits
    inside = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    if not inside:
        raise DiffquantError(f"needle sample for {sample.city!r}: the tokenizer gives the digits no token")
    ids = ([tokenizer.bos_id] if lead else []) + ids
    return ids, (inside[0] + lead, inside[-1] + 1 + lead), len(ids) - 1


def _filler_sentences(text: str | None) -> list[str]:
    """The haystack as sentences, whitespace-normalised; long runs without punctuation are wrapped so the
    needle can still be placed at a fine-grained depth."""
    if text is None:
        return list(FILLER_SENTENCES)
    if "magic number" in text.lower():
        raise DiffquantError(
            "retrieval filler: must not contain 'magic number' (it would plant fake needles)"
        )
    sentences = []
    for piece in re.split(r"(?<=[.!?])\s+|\n+", text):
        piece = " ".join(piece.split())
        sentences.extend(textwrap.wrap(piece, width=200, break_long_words=True))
    if not sentences:
        raise DiffquantError("retrieval filler: no text left after splitting into sentences")
    return sentences


def _needle(city: str, number: int) -> str:
    return f"The magic number of {city} is {number}."


def _question(city: str) -> str:
    return f"\nWhat is the magic number of {city}? The magic number of {city} is"


def make_samples(cfg: RetrievalConfig) -> list[NeedleSample]:
    """The prompts of ``cfg``: for each depth, sample index and query, one NeedleSample.

    Seeding is paired across depths: sample i draws its cities, numbers, distractors and filler from a
    generator seeded by (seed, i) only, and only the placement of the non-queried needles depends on the
    depth. So depth effects are measured on the same haystacks, not confounded with a different draw per
    depth; a different seed gives different samples.

    Placement: the context is a sequence of sentence slots (filler plus needles). The R queried needles
    occupy consecutive slots starting at slot round(depth/100 * (M - R)) of M, so 0 % puts the first
    queried needle in the first sentence and 100 % puts the last one in the last sentence before the
    question; the other needles take random other slots.
    """
    sentences = _filler_sentences(cfg.filler)
    n, r = cfg.n_needles, cfg.n_queries
    lo, hi = 10 ** (cfg.digits - 1), 10**cfg.digits
    samples: list[NeedleSample] = []
    contents = []
    for i in range(cfg.samples_per_depth):
        rng = random.Random(f"diffquant-retrieval:{cfg.seed}:{i}")
        cities = rng.sample(CITIES, n)
        numbers = rng.sample(range(lo, hi), cfg.n_candidates)  # needles first, then distractors
        needles = [_needle(c, x) for c, x in zip(cities, numbers, strict=False)]
        budget = cfg.context_bytes - sum(len(s.encode()) + 1 for s in needles)
        start = rng.randrange(len(sentences))
        filler: list[str] = []
        used = 0
        while True:
            s = sentences[(start + len(filler)) % len(sentences)]
            if used + len(s.encode()) + 1 > budget:
                break
            filler.append(s)
            used += len(s.encode()) + 1
        candidates = tuple(sorted(f" {x}" for x in numbers))
        contents.append((cities, numbers[:n], needles, filler, candidates))
    for depth in cfg.depths:
        for i, (cities, numbers, needles, filler, candidates) in enumerate(contents):
            rng = random.Random(f"diffquant-retrieval:{cfg.seed}:{i}:{float(depth)!r}")
            m = len(filler) + n
            base = round(float(depth) / 100 * (m - r))
            slots: list[int | None] = [None] * m  # needle index per slot, None = filler
            for q in range(r):
                slots[base + q] = q
            free = [k for k in range(m) if slots[k] is None]
            for j, k in zip(range(r, n), rng.sample(free, n - r), strict=True):
                slots[k] = j
            parts: list[str] = []
            digit_start: dict[int, int] = {}
            offset = 0  # character offset in the prompt
            fill = iter(filler)
            for k, j in enumerate(slots):
                text = next(fill) if j is None else needles[j]
                if k:
                    offset += 1  # the joining space
                if j is not None:
                    digit_start[j] = offset + len(f"The magic number of {cities[j]} is ")
                parts.append(text)
                offset += len(text)
            context = " ".join(parts)
            for q in range(r):
                prompt = context + _question(cities[q])
                answer = f" {numbers[q]}"
                samples.append(
                    NeedleSample(
                        prompt=prompt,
                        answer=answer,
                        digits=(digit_start[q], digit_start[q] + cfg.digits),
                        candidates=candidates,
                        label=candidates.index(answer),
                        depth=float(depth),
                        city=cities[q],
                    )
                )
    return samples


def prompt_ids(sample: NeedleSample, tokenizer: Tokenizer = BYTES) -> torch.Tensor:
    """The prompt's ids (1-D long) in ``tokenizer`` (default: bytes, BOS first): what the model reads."""
    return torch.tensor(encode_prompt(sample, tokenizer)[0], dtype=torch.long)
