"""Training batches: stdlib text windows mixed with generated needle-retrieval documents.

Every batch is a pure function of (seed, step): resuming at step s draws exactly the batches an
uninterrupted run would have, so a resumed run reaches the same weights.
"""

from __future__ import annotations

import torch

from diffquant.data import ByteTokenizer, token_stream
from diffquant.data.needles import RetrievalConfig, make_samples
from diffquant.errors import DiffquantError


class TrainData:
    """Windows of ``seq_len`` tokens from a text source, a fraction replaced by needle documents.

    A needle document (DIFF paper, Sec. 3.3 retrieval protocol) is a context with 1-4 "magic number"
    sentences, a question and its answer, padded with PAD (which the loss ignores); it teaches in-context
    retrieval so that the zoo's retrieval accuracy, and its degradation under quantization, are measurable.
    """

    def __init__(
        self,
        source: str,
        *,
        seq_len: int,
        max_tokens: int | None,
        needle_fraction: float,
        seed: int,
    ) -> None:
        if not 0 <= needle_fraction <= 1:
            raise DiffquantError(f"needle_fraction {needle_fraction}: expected a number in [0, 1]")
        self.tok = ByteTokenizer()
        self.stream = token_stream(source, max_tokens)
        if self.stream.numel() <= seq_len + 1:
            raise DiffquantError(
                f"data source {source!r} has {self.stream.numel()} tokens, fewer than one window"
            )
        self.seq_len = seq_len
        self.needle_fraction = needle_fraction
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        """Token ids (batch_size, seq_len) for ``step``; PAD marks positions outside a needle document."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = []
        for _ in range(batch_size):
            if float(torch.rand((), generator=g)) < self.needle_fraction:
                rows.append(self._needle(int(torch.randint(0, 2**31 - 1, (), generator=g))))
            else:
                start = int(torch.randint(0, self.stream.numel() - self.seq_len, (), generator=g))
                rows.append(self.stream[start : start + self.seq_len])
        return torch.stack(rows)

    def _needle(self, seed: int) -> torch.Tensor:
        rng = torch.Generator().manual_seed(seed)
        n = int(torch.randint(1, 5, (), generator=rng))
        depth = float(torch.randint(0, 101, (), generator=rng))
        cfg = RetrievalConfig(
            n_needles=n,
            n_queries=1,
            depths=(depth,),
            samples_per_depth=1,
            context_bytes=max(64, self.seq_len - 112),
            seed=seed,
        )
        sample = make_samples(cfg)[0]
        ids = self.tok.encode(sample.prompt + sample.answer + ".", bos=True, eos=True)[: self.seq_len]
        out = torch.full((self.seq_len,), self.tok.pad_id, dtype=torch.long)
        out[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out
