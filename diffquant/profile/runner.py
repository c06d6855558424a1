"""Profile a model over token windows, sharded over torchrun ranks and merged exactly on rank 0."""

from __future__ import annotations

import contextlib
import json
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from diffquant.data import count_bytes, iter_documents, model_tokenizer, token_windows
from diffquant.data.corpus import default_text
from diffquant.distributed import gather_to_rank0, rank_and_world
from diffquant.errors import DiffquantError
from diffquant.kernels.dispatch import path_summary
from diffquant.models.taps import select_taps
from diffquant.models.transformer import DecoderLM
from diffquant.options import DEFAULT_TOPK
from diffquant.profile.maps import capture_maps, save_maps
from diffquant.profile.profiler import Profile, Profiler, merge_profiles
from diffquant.profile.sinks import (
    SINK_PROBE_LEN,
    SINK_PROBE_SEQUENCES,
    format_sink_rates,
    sink_rate_summary,
    sink_rates,
)
from diffquant.profile.tables import format_table5, layerwise, table5
from diffquant.progress import progress as show_progress
from diffquant.progress import step as show_step
from diffquant.textfiles import write_json_atomic, write_text_atomic

# (windows, (rank, world)) -> (the profile of that rank's batches, attention paths): a streamed profile.
StreamedProfile = Callable[[torch.Tensor, tuple[int, int]], tuple[Profile, dict[str, int]]]


# A profile discards the model's output: while it runs, the LM head fires its input tap but skips the
# (B, T, vocab) logits (403 MB for a 4 x 512-token SmolLM2 batch, the peak of its every-site profile).
SKIP_LOGITS = True


@contextlib.contextmanager
def _logits_skipped(model) -> Iterator[None]:
    """Within the block, ``model.lm_head`` runs its input path (rotation, the ``lm_head.input`` tap) and
    returns an empty (..., 0) tensor instead of the logits; anything else (no tap to keep) is left alone."""
    head = getattr(model, "lm_head", None)
    if not SKIP_LOGITS or head is None or not hasattr(head, "input") or "forward" in vars(head):
        yield
        return

    def tap_only(self, x):
        if getattr(self, "input_rotation", None) is not None:
            x = self.input_rotation(x)
        return self.input(x)[..., :0]

    head.forward = types.MethodType(tap_only, head)
    try:
        yield
    finally:
        del head.forward


def profile_json(profile: Profile) -> str:
    """``json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\\n"``, the same text, built one site at a
    time: the whole profile as Python dicts and lists (per-site histograms, top-k locations, abs-max lists)
    took ~600 MB for an every-site SmolLM2 profile, more than its forward pass."""
    head = Profile(sites={}, attention=profile.attention, meta=profile.meta).to_dict()
    text = json.dumps(head, indent=1, allow_nan=False) + "\n"
    if not profile.sites:
        return text
    parts = [
        f"\n  {json.dumps(name)}: "
        + json.dumps(stats.to_dict(), indent=1, allow_nan=False).replace("\n", "\n  ")
        for name, stats in profile.sites.items()
    ]
    marker = '\n "sites": {},'
    assert text.count(marker) == 1
    return text.replace(marker, '\n "sites": {' + ",".join(parts) + "\n },")


def profile_model(
    model: DecoderLM,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    sites: str | Sequence[str] = "*",
    topk: int = DEFAULT_TOPK,
    attention: bool | None = None,
    progress: bool = False,
    desc: str = "profile",
) -> Profile | None:
    """Run ``model`` over ``windows`` (N, L) under a Profiler; the merged Profile on rank 0, else None.

    Batch i holds windows [i*batch_size, (i+1)*batch_size) and goes to rank i % world, with its global
    sample indices kept, so any number of ranks yields the same statistics as one process.
    """
    rank, world = rank_and_world()
    mine = shard_starts(windows.shape[0], batch_size, rank, world)
    profiler = Profiler(model, sites=sites, topk=topk, attention=attention)
    with torch.no_grad(), _logits_skipped(model), profiler as prof:
        # A bar on a terminal (or when asked), else a line when it starts (one batch can take minutes) and
        # every few seconds while it runs (off with --quiet).
        batches = show_progress(
            mine, desc, "batch", bar=progress or None, enabled=rank == 0, leave=False, announce=True
        )
        for start in batches:
            prof.start_samples_at(start)
            model(windows[start : start + batch_size])
    return gather_profile(prof.take())  # the profiler is done: its statistics are handed over, not copied


def shard_starts(n_windows: int, batch_size: int, rank: int = 0, world: int = 1) -> list[int]:
    """The first window of each batch rank ``rank`` of ``world`` runs: batch i (windows [i*batch_size,
    (i+1)*batch_size)) goes to rank i % world. One rule for the whole-model and the streamed profile, so
    both shard alike and their merged profiles are equal."""
    if world < 1 or not 0 <= rank < world:
        raise DiffquantError(f"shard: expected 0 <= rank < world, got rank {rank} of world {world}")
    return list(range(rank * batch_size, n_windows, world * batch_size))


def gather_profile(local: Profile) -> Profile | None:
    """The ranks' profiles merged exactly on rank 0 (in rank order), None on the other ranks; ``local``
    itself in one process. Shared by :func:`profile_model` and the streamed profile of
    :func:`profile_stage`, so a sharded run merges the same way whichever way its ranks computed."""
    if rank_and_world()[1] == 1:
        return local
    parts = gather_to_rank0(local.to_dict())
    if parts is None:
        return None
    return merge_profiles((Profile.from_dict(p) for p in parts), consume=True)


def check_profile(
    models: dict[str, tuple[str, DecoderLM]],
    seq_len: int,
    data: str | None,
    sites: str | Sequence[str] = "*",
    key_name: Callable[[str], str] = lambda key: "--" + key.replace("_", "-"),
) -> dict:
    """What a profile would refuse, refused before it writes anything: each model's tokenizer (and its
    fit), the site patterns, the window length, the text source. Returns the tokenizers by model name.
    ``key_name`` says how the user wrote a key (``--seq-len`` on the command line, ``profile.seq_len`` in a recipe).
    """
    tokenizers = {}
    for model_name, (spec, model) in models.items():
        tokenizers[model_name] = model_tokenizer(model, str(spec))
        select_taps(model, sites)  # a pattern that matches nothing is a one-line error
        cfg = model.config
        if seq_len > cfg.max_seq_len:
            raise DiffquantError(
                f"{key_name('seq_len')} {seq_len} exceeds the max_seq_len {cfg.max_seq_len} of {spec}"
            )
    if data:
        iter_documents(data)  # a missing source fails here
    return tokenizers


def profile_stage(
    models: dict[str, tuple[str, DecoderLM]],
    *,
    data: str | None,
    tokens: int,
    seq_len: int,
    batch_size: int,
    sites: str | Sequence[str],
    topk: int,
    attention: bool | None,
    out: Path,
    progress: bool = False,
    map_len: int = 64,
    key_name: Callable[[str], str] = lambda key: "--" + key.replace("_", "-"),
    streamed: Mapping[str, StreamedProfile] | None = None,
    sink_rate: bool = False,
) -> tuple[str, str, int]:
    """Profile each (spec, model) on the same text; write profile/NAME.json, table5.{txt,json}.

    Every model reads ``data`` (None: :func:`diffquant.eval.tasks.default_text`) through its own tokenizer
    (``model.tokenizer`` or the byte tokenizer, see :func:`diffquant.data.model_tokenizer`), so models with
    different tokenizers see the same text cut into windows of their own tokens; each profile records its
    tokenizer, tokens and bytes. Also saves the attention maps of the first ``map_len`` positions of the
    first window (profile/NAME.maps.safetensors) for figures. Returns (header, table, tokens of the first
    model) on rank 0 and ("", "", tokens) elsewhere. Shared by `diffquant profile` and recipes.

    ``streamed`` maps a model name (its model a weightless skeleton) to a function profiling the windows
    layer-streamed (:func:`diffquant.stream.profile_streamed`): ``fn(windows, (rank, world))`` profiles the
    batches :func:`shard_starts` gives that rank and returns (profile, attention paths); the ranks' profiles
    are merged by :func:`gather_profile`, as :func:`profile_model` merges. Its attention maps need the whole
    model and are not captured (said on stderr). ``sink_rate``: also run Gu et al.'s sink probe
    (:func:`sink_probe`) on whole models, into the profile's meta, table5.json and the printed table.
    """
    streamed = streamed or {}
    tokenizers = check_profile(models, seq_len, data, sites, key_name)
    data = data or default_text(tokenizers.values(), "profile")
    by_tokenizer: dict[str, torch.Tensor] = {}
    rank, world = rank_and_world()
    tables, summaries, counts = {}, {}, {}
    for name, (spec, model) in models.items():
        tokenizer = tokenizers[name]
        key = tokenizer.fingerprint()
        if key not in by_tokenizer:
            by_tokenizer[key] = token_windows(data, tokens, seq_len, tokenizer)
        windows = by_tokenizer[key]
        counts[name] = {
            "tokenizer": tokenizer.name,
            "tokens": windows.numel(),
            "windows": windows.shape[0],
            "bytes": count_bytes(windows, tokenizer),
        }
        if name in streamed:
            local, paths = streamed[name](windows, (rank, world))
            profile = gather_profile(local)
        else:
            device = next(model.parameters()).device
            profile = profile_model(
                model,
                windows.to(device),
                batch_size=batch_size,
                sites=sites,
                topk=topk,
                attention=attention,
                progress=progress,
                desc=name,
            )
            paths = path_summary(model)
        if profile is None:
            continue
        if sink_rate and attention is not False and name not in streamed:
            profile.meta["sink_rate"] = sink_probe(
                model, data, tokenizer, batch_size, desc=f"{name}: sink probe"
            )
        profile.meta.update(
            model=name,
            checkpoint=str(spec),
            attention=model.config.attention,
            config=model.config.to_dict(),
            data=data,
            attention_paths=paths,
            **counts[name],
        )
        # ~15 s for two real models' every-site profiles (the JSON text is built in Python): a line then
        with show_step(f"{name}: write {out / 'profile' / name}.json", announce=False):
            write_text_atomic(out / "profile" / f"{name}.json", profile_json(profile))
        if name in streamed:
            print(
                f"diffquant: profile {name}: streamed; attention maps not captured (they need the whole model)",
                file=sys.stderr,
            )
        else:
            sample = windows[0, :map_len].to(device)
            save_maps(
                out / "profile" / f"{name}.maps.safetensors",
                capture_maps(model, sample),
                model=name,
                attention=model.config.attention,
                tokens=sample.tolist(),
            )
        tables[name] = table5(profile)
        summaries[name] = {
            "table5": tables[name],
            **({"sink_rate": profile.meta["sink_rate"]} if profile.meta.get("sink_rate") else {}),
            "layerwise_hidden": layerwise(profile, "resid"),
            **counts[name],
        }
    first = next(iter(counts.values()))
    if rank != 0:
        return "", "", first["tokens"]
    if len({(c["tokens"], c["tokenizer"]) for c in counts.values()}) == 1:
        what = (
            f"{first['tokens']:,} tokens ({first['windows']} windows of {seq_len}, {first['bytes']:,} bytes)"
        )
        if first["tokens"] < tokens:
            what += f" (the source holds only {first['tokens']:,} tokens)"
    else:
        what = (
            "the same text, each model in its own tokens ("
            + "; ".join(
                f"{n}: {c['tokens']:,} tokens of {c['tokenizer']} = {c['bytes']:,} bytes"
                for n, c in counts.items()
            )
            + f"; windows of {seq_len})"
        )
    chosen = [sites] if isinstance(sites, str) else list(sites)
    if chosen != ["*"]:  # a subset reads as the whole model unless the view says which sites it covers
        what += f" at only the sites matching {' '.join(chosen)} ({key_name('sites')})"
    header = f"Table 5 view: k-th largest |x| and median |x| over {what} from {data}"
    sinks = format_sink_rates({n: s.get("sink_rate") for n, s in summaries.items()})
    text = "\n".join([format_table5(tables), *sinks])
    write_text_atomic(out / "table5.txt", header + "\n" + text + "\n")
    write_json_atomic(
        out / "table5.json",
        {"tokens": first["tokens"], "data": data, "sites": chosen, "models": summaries},
    )
    return header, text, first["tokens"]


def sink_probe(
    model: DecoderLM, data: str, tokenizer, batch_size: int = 8, desc: str = "sink probe"
) -> dict | None:
    """Gu et al.'s attention-sink rate (:mod:`diffquant.profile.sinks`) on their probe: the first 100 disjoint
    64-token sequences of ``data`` (shorter when the model's context is) as the model reads text, a BOS first
    when its tokenizer adds one; None when the text has none. The summary's ``first_token`` says which."""
    seq_len = min(SINK_PROBE_LEN, model.config.max_seq_len)
    tok = tokenizer or model_tokenizer(model)
    bos = tok.bos_id if getattr(tok, "add_bos", False) and seq_len > 1 else None
    body = seq_len - (bos is not None)
    windows = token_windows(data, SINK_PROBE_SEQUENCES * body, body, tokenizer, quiet=True)
    if bos is not None:
        windows = torch.cat([torch.full((windows.shape[0], 1), bos, dtype=windows.dtype), windows], dim=1)
    device = next(model.parameters()).device
    with _logits_skipped(model):
        stats = sink_rates(model, windows.to(device), batch_size=max(batch_size, 16), desc=desc)
    summary = sink_rate_summary(stats)
    if summary is not None:
        summary["first_token"] = "text" if bos is None else "bos"
    return summary
