"""Profile a model over token windows, sharded over torchrun ranks and merged exactly on rank 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm import tqdm

from diffquant.distributed import gather_to_rank0, rank_and_world
from diffquant.models.transformer import DecoderLM
from diffquant.profile.profiler import Profile, Profiler, merge_profiles


def profile_model(
    model: DecoderLM,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    sites: str | Sequence[str] = "*",
    topk: int = 100,
    attention: bool | None = None,
    progress: bool = False,
    desc: str = "profile",
) -> Profile | None:
    """Run ``model`` over ``windows`` (N, L) under a Profiler; the merged Profile on rank 0, else None.

    Batch i holds windows [i*batch_size, (i+1)*batch_size) and goes to rank i % world, with its global
    sample indices kept, so any number of ranks yields the same statistics as one process.
    """
    rank, world = rank_and_world()
    starts = list(range(0, windows.shape[0], batch_size))
    mine = [s for i, s in enumerate(starts) if i % world == rank]
    with torch.no_grad(), Profiler(model, sites=sites, topk=topk, attention=attention) as prof:
        for start in tqdm(mine, desc=desc, unit="batch", disable=not progress or rank != 0, leave=False):
            prof.start_samples_at(start)
            model(windows[start : start + batch_size])
        local = prof.result()
    parts = gather_to_rank0(local.to_dict())
    if parts is None:
        return None
    return merge_profiles(Profile.from_dict(p) for p in parts)
