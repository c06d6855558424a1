"""The Profiler: forward hooks on taps feeding streaming statistics, and the Profile they produce.

``with Profiler(model, sites=["*"]) as prof: model(batch)`` attaches hooks to the selected taps, and
removes them on exit (also on exceptions). Hooks only read: the model's output is bit-identical with and
without a profiler. Observing a map tap (logits, probs, diff_map) switches attention to its explicit path,
which computes the same output (to float rounding) while materialising the maps chunk by chunk.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffquant.errors import DiffquantError
from diffquant.heap import release_freed_memory
from diffquant.models.sites import KIND_LAYOUTS, MAP_KINDS, SHARING_KINDS, layout_of
from diffquant.models.taps import Tap, model_taps, select_taps
from diffquant.options import DEFAULT_TOPK, MAX_TOPK  # --topk's default and bound, torch-free for --help
from diffquant.profile.attention_metrics import DiffMapStats, LambdaStats, MapStats, SpanMassStats
from diffquant.profile.stats import SiteStats, forget_mask_positions
from diffquant.textfiles import read_json

# Speed-ups that leave every statistic unchanged (one snapshot copy, one statistics pass per distinct tensor,
# attention metrics only for the selected map sites, fast paths of the map metrics). Tests turn this off to
# compare a profile with the plain path's.
FAST = True
# Hand the C heap's freed pages back after each large map's statistics (glibc malloc_trim): a profile
# allocates map-sized temporaries between small long-lived states, and the heap kept the freed ones resident
# (a 2,048-token every-site SmolLM2 profile grew by ~460 MB, 1.9 GB peak). DIFFQUANT_PROFILE_TRIM=0: off.
TRIM = os.environ.get("DIFFQUANT_PROFILE_TRIM", "1") != "0"
TRIM_MIN_BYTES = 1 << 24  # only maps of at least 16 MiB count towards a trim
# A trim is not free: the pages it hands back fault in again (zeroed) when the next map is allocated, which
# cost an every-site profile of the small preset 0.7 s of 1.9 s when it ran after every map. So trim once
# the large maps whose statistics ran since the last trim add up to TRIM_EVERY_BYTES: the heap still never
# holds more than about that much freed map memory, and a forward of the small preset trims twice, not 32x.
TRIM_EVERY_BYTES = 1 << 28


PROFILE_FORMAT = "diffquant-profile"
PROFILE_VERSION = 1
_METRIC_TYPES: dict[str, Any] = {
    "map": MapStats,
    "diff_map": DiffMapStats,
    "lambda": LambdaStats,
    "span": SpanMassStats,
}


@dataclass
class Profile:
    """Statistics of one model: per site (``sites``) and per attention map (``attention``), plus metadata.

    ``attention`` here is the per-head attention *metrics*: a dict from metric key (a map site such as
    ``layers.0.attn.probs``, or its ``...span`` / lambda site) to ``(metric type, accumulator)``. It is not
    the model's attention kind (``ModelConfig.attention``) nor the Profiler's on/off flag of that name.
    """

    sites: dict[str, SiteStats] = field(default_factory=dict)
    attention: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def kinds(self) -> dict[str, str]:
        return {name: s.kind for name, s in self.sites.items()}

    def pooled(self, kind: str) -> SiteStats | None:
        """One SiteStats over every site of ``kind`` (e.g. all logit taps: the DIFF paper's Table 5 pool)."""
        chosen = [s for s in self.sites.values() if s.kind == kind]
        return SiteStats.merged(chosen, site=f"kind:{kind}") if chosen else None

    def merge(self, other: Profile) -> Profile:
        """Add ``other``'s statistics (same model, other data) into this profile, exactly."""
        if set(other.sites) != set(self.sites) or set(other.attention) != set(self.attention):
            raise DiffquantError("profiles to merge observe different sites")
        for name, stats in other.sites.items():
            self.sites[name].merge(stats)
        for name, stats in other.attention.items():
            self.attention[name][1].merge(stats[1])
        for key in ("tokens", "samples"):
            if key in self.meta and key in other.meta:
                self.meta[key] += other.meta[key]
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "format_version": PROFILE_VERSION,
            "meta": self.meta,
            "sites": {name: s.to_dict() for name, s in self.sites.items()},
            "attention": {name: {"type": t, **acc.to_dict()} for name, (t, acc) in self.attention.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise DiffquantError(f"{source}: not a diffquant profile (expected 'format': '{PROFILE_FORMAT}')")
        if data.get("format_version") != PROFILE_VERSION:
            raise DiffquantError(
                f"{source}: profile format_version {data.get('format_version')!r} is not supported "
                f"(expected {PROFILE_VERSION})"
            )
        metrics = {}
        for name, d in data["attention"].items():
            d = dict(d)
            metric_type = d.pop("type")
            metrics[name] = (metric_type, _METRIC_TYPES[metric_type].from_dict(d))
        sites = {name: SiteStats.from_dict(d) for name, d in data["sites"].items()}
        return cls(sites=sites, attention=metrics, meta=data.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(read_json(path, "profile"), source=str(path))


def _clone(obj: Any) -> Any:
    """A deep copy of statistics state (plain Python data and tensors), several times faster than
    ``copy.deepcopy`` or a to_dict / from_dict round trip."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _share_scope(name: str) -> str:
    """Taps that may see one tensor (q/k/v_proj inputs, gate/up inputs, mlp.act and down's input): the
    module that owns the tap's module (``layers.0.attn`` for ``layers.0.attn.q_proj.input``)."""
    return name.removesuffix(".input").rpartition(".")[0]


class Profiler:
    """Collect statistics at the selected sites of ``model`` while it runs.

    Args:
        sites: glob patterns over site names (``layers.*.attn.logits*``) or ``kind:NAME``; ``*`` = all.
        topk: how many largest magnitudes each site keeps, with their locations (1 .. :data:`MAX_TOPK`).
        attention: a flag: collect per-head attention metrics (entropy, sink mass, DIFF cancellation,
            lambda) into ``Profile.attention``. None = on when a map site (logits/probs/diff_map) is
            selected, since maps are then materialised anyway. (Not the attention kind of the model.)
        sample_offset: global index of the first sample of the first batch (set per batch when sharding).
        massive_cap: massive-activation candidates (|x| > 100) kept per site with locations; the count
            stays exact beyond it.

    ``prof.spans`` may be set before a forward call to a list with, per batch row, (start, end, query) or
    None: the attention mass on the answer span [start, end) seen from query position ``query``
    (DIFF paper, Table 3) is then measured on that batch.
    """

    def __init__(
        self,
        model: nn.Module,
        sites: str | Sequence[str] = "*",
        topk: int = DEFAULT_TOPK,
        attention: bool | None = None,
        sample_offset: int = 0,
        massive_cap: int = 100,
    ) -> None:
        if not 1 <= topk <= MAX_TOPK:
            raise DiffquantError(f"topk: expected an integer in [1, {MAX_TOPK}], got {topk}")
        self.model = model
        self.taps: dict[str, Tap] = select_taps(model, sites)
        self.topk = topk
        # None: metrics for the selected map / lambda sites (their maps are materialised anyway); True: for
        # every map site of the model, selected or not.
        self._metric_sites: set[str] | None = None
        metrics_on = attention
        if metrics_on is None:
            metrics_on = any(t.kind in MAP_KINDS for t in self.taps.values())
            if FAST:
                self._metric_sites = set(self.taps)
        self.attention_enabled = metrics_on
        self.sample_offset = sample_offset
        self.spans: list[tuple[int, int, int] | None] | None = None
        self.tokens_seen = 0
        self.samples_seen = 0
        # True: the hooks stay attached but record nothing (a streamed run's calibration passes).
        self.paused = False
        self._pending_bytes = 0  # bytes of large maps whose statistics ran since the last heap trim
        # the batch's token ids on the host, copied once per batch: each site's located entries read their
        # tokens from it (read on the GPU, that was three waits for the device per site and batch)
        self._tokens: torch.Tensor | None = None
        self._pos_offset = 0
        self._last_batch = 0
        self._next_offset: int | None = None
        self._handles: list[Any] = []
        self._stats = {
            name: SiteStats(name, tap.kind, topk=topk, massive_cap=massive_cap)
            for name, tap in self.taps.items()
        }
        # metric key -> (metric type, accumulator): becomes Profile.attention
        self._attention: dict[str, tuple[str, Any]] = {}
        self.massive_cap = massive_cap
        # Taps that may share a tensor: per scope (see _share_scope) and layout, the selected sites; a forward's
        # statistics of a tensor are computed once and copied to every site that sees it.
        self._groups: dict[str, tuple[str, int]] = {}  # site -> (group key, group size)
        if FAST:
            members: dict[str, list[str]] = {}
            for name, tap in self.taps.items():
                if tap.kind in SHARING_KINDS:
                    members.setdefault(f"{_share_scope(name)}|{KIND_LAYOUTS[tap.kind]}", []).append(name)
            for key, names in members.items():
                if len(names) > 1:
                    for name in names:
                        self._groups[name] = (key, len(names))
        self._shared: dict[str, list[tuple[tuple, torch.Tensor, SiteStats | None]]] = {}
        self._fired: dict[str, int] = {}

    # --------------------------------------------------------------------------------- context
    def __enter__(self) -> Profiler:
        self._handles.append(self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._after_forward))
        for name, tap in self.taps.items():
            self._handles.append(tap.register_forward_hook(self._site_hook(self._stats[name])))
        if self.attention_enabled:
            self._attach_attention_metrics()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        forget_mask_positions()  # what the last mask's read left on the device (64 MiB at 4,096 tokens)

    # ----------------------------------------------------------------------------------- hooks
    def start_samples_at(self, offset: int) -> None:
        """Give the next new batch global sample indices offset, offset + 1, ... (for sharded data)."""
        self._next_offset = offset

    def begin_batch(self, input_ids: torch.Tensor, sample_offset: int, count: bool = True) -> None:
        """Start a batch of new sequences without a whole-model forward: for runs that call the model's
        modules themselves (the layer-streamed run of :mod:`diffquant.stream` calls one layer at a time
        over every batch). The taps that fire until :meth:`end_batch` see ``input_ids`` (B, T) as the
        tokens and ``sample_offset`` as the global index of row 0, as in a forward after
        :meth:`start_samples_at`; ``count`` adds the batch to the tokens and samples seen (once per batch,
        not once per layer)."""
        self._tokens = input_ids.cpu()
        self._pos_offset = 0
        self.sample_offset, self._next_offset = sample_offset, None
        self._last_batch = input_ids.shape[0]
        if count:
            self.samples_seen += input_ids.shape[0]
            self.tokens_seen += input_ids.numel()
        self._shared.clear()
        self._fired.clear()

    def end_batch(self) -> None:
        """End a batch begun with :meth:`begin_batch` (what the end of a whole-model forward does)."""
        self._after_forward(None, None, None)

    def _before_forward(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs.get("input_ids")
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        self._pos_offset = cache.length if cache is not None else 0
        previous = self._tokens
        input_ids = input_ids.cpu()
        if self._pos_offset and previous is not None and previous.shape[1] == self._pos_offset:
            input_ids = torch.cat([previous, input_ids], dim=1)  # token ids by absolute position
        self._tokens = input_ids
        if self._pos_offset == 0:  # new sequences (a cached decode step continues the previous ones)
            if self._next_offset is not None:
                self.sample_offset, self._next_offset = self._next_offset, None
            else:
                self.sample_offset += self._last_batch
            self._last_batch = input_ids.shape[0]
            self.samples_seen += input_ids.shape[0]
        self.tokens_seen += input_ids.shape[0] * (input_ids.shape[1] - self._pos_offset)
        self._shared.clear()
        self._fired.clear()

    def _trim_after(self, x: torch.Tensor) -> None:
        """Count a large CPU map whose statistics are done; release freed heap pages every TRIM_EVERY_BYTES
        of them (this profiler's count: two profilers do not share it)."""
        nbytes = x.numel() * x.element_size()
        if not TRIM or x.device.type != "cpu" or nbytes < TRIM_MIN_BYTES:
            return
        self._pending_bytes += nbytes
        if self._pending_bytes >= TRIM_EVERY_BYTES:
            self._pending_bytes = 0
            release_freed_memory()

    def _after_forward(self, module, args, output):
        self.spans = None
        self._shared.clear()
        self._fired.clear()

    def _site_hook(self, stats: SiteStats):
        group = self._groups.get(stats.site)
        is_map = stats.kind in MAP_KINDS

        def hook(module, args, output):
            if self.paused:
                return
            valid = args[1] if len(args) > 1 else None
            with torch.no_grad():
                if group is not None and valid is None:
                    self._shared_update(stats, output.detach(), *group)
                    return
                stats.update(
                    output.detach(),
                    valid=valid,
                    tokens=self._tokens,
                    sample_offset=self.sample_offset,
                    pos_offset=self._pos_offset,
                )
            if is_map:
                self._trim_after(output)

        return hook

    def _shared_update(self, stats: SiteStats, x: torch.Tensor, group: str, size: int) -> None:
        """Update ``stats`` with ``x``, computing a tensor's statistics once per forward for the taps of a
        group that see the same tensor (q/k/v inputs): the first computes them into a fresh SiteStats, merged
        into its own; the others merge it relabelled with their site. Merging one forward's statistics
        into a site equals updating it with the tensor, exactly (counts, top-k, moments: the fresh state's
        moments are the chunk's own)."""
        fired = self._fired.get(group, 0) + 1
        self._fired[group] = fired
        seen = self._shared.setdefault(group, [])
        layout = layout_of(stats.kind, x)
        inference = x.is_inference()  # no version counter: ask for the very same tensor object instead
        version = None if inference else x._version
        key = (x.data_ptr(), x.shape, x.stride(), version, x.dtype, x.device, layout, self.sample_offset)
        found = next((e for e in seen if e[0] == key and (not inference or e[1] is x)), None)
        kwargs = {"tokens": self._tokens, "sample_offset": self.sample_offset, "pos_offset": self._pos_offset}
        if found is not None and found[2] is not None:
            stats.merge(found[2], relabel=True)
        elif found is None and fired < size:  # others of the group may still see this tensor
            fresh = SiteStats(stats.site, stats.kind, topk=self.topk, massive_cap=self.massive_cap)
            fresh.update(x, **kwargs)
            stats.merge(fresh)
            seen.append((key, x, fresh))  # holding x keeps its memory from being reused within the forward
        else:
            stats.update(x, **kwargs)
        if fired >= size:  # every tap of the group has fired: release its tensors
            self._shared.pop(group, None)

    def _attach_attention_metrics(self) -> None:
        for name, tap in model_taps(self.model).items():
            if self._metric_sites is not None and name not in self._metric_sites:
                continue
            heads = None
            if tap.kind in ("probs", "diff_map"):
                heads = self.model.config.n_heads if hasattr(self.model, "config") else None
            if tap.kind == "probs":
                self._add_metric(name, tap, "map", MapStats(heads))
                if name.endswith(".probs"):  # baseline: the answer-span metric reads the softmax map
                    self._add_metric(name.removesuffix("probs") + "span", tap, "span", SpanMassStats(heads))
            elif tap.kind == "diff_map":
                self._add_metric(name, tap, "diff_map", DiffMapStats(heads))
                self._add_metric(name.removesuffix("diff_map") + "span", tap, "span", SpanMassStats(heads))
            elif tap.kind == "lambda":
                self._add_metric(name, tap, "lambda", LambdaStats())

    def _add_metric(self, key: str, tap: Tap, kind: str, acc: Any) -> None:
        self._attention[key] = (kind, acc)

        def hook(module, args, output):
            if self.paused:
                return
            with torch.no_grad():
                if kind == "lambda":
                    acc.update(output.detach())
                elif kind == "span":
                    if self.spans is not None:
                        acc.update(output.detach(), args[1], self.spans)
                else:
                    acc.update(output.detach(), args[1])
                    self._trim_after(output)

        self._handles.append(tap.register_forward_hook(hook))

    # ---------------------------------------------------------------------------------- result
    def result(self, **meta: Any) -> Profile:
        """The statistics so far as a Profile (a snapshot: the profiler can keep running)."""
        if FAST:
            sites, metrics = _clone((self._stats, self._attention))
        else:
            sites = {name: SiteStats.from_dict(s.to_dict()) for name, s in self._stats.items()}
            metrics = {
                name: (kind, type(acc).from_dict(acc.to_dict()))
                for name, (kind, acc) in self._attention.items()
            }
        return self._profile(sites, metrics, meta)

    def take(self, **meta: Any) -> Profile:
        """The statistics as a Profile without copying them: the profiler's hooks are removed and it must
        not be used again (for callers that are done with it, e.g. :func:`profile_model`)."""
        if not FAST:
            return self.result(**meta)
        self.remove()
        sites, metrics = self._stats, self._attention
        self._stats, self._attention = {}, {}
        return self._profile(sites, metrics, meta)

    def _profile(self, sites: dict[str, SiteStats], metrics: dict[str, Any], meta: dict) -> Profile:
        info = {"tokens": self.tokens_seen, "samples": self.samples_seen, "topk": self.topk, **meta}
        return Profile(sites=sites, attention=metrics, meta=info)


def merge_profiles(profiles: Iterable[Profile], *, consume: bool = False) -> Profile:
    """One profile with the statistics of all ``profiles`` (same model, disjoint data), exactly.

    The inputs are left untouched (the first is copied), unless ``consume``: then the first one is merged into
    in place and returned (for callers that own the inputs).
    """
    profiles = list(profiles)
    if not profiles:
        raise DiffquantError("no profiles to merge")
    if consume and FAST:
        merged = profiles[0]
    elif FAST:
        merged = Profile(*_clone((profiles[0].sites, profiles[0].attention)), meta=dict(profiles[0].meta))
    else:
        merged = Profile.from_dict(profiles[0].to_dict())
        merged.meta = dict(merged.meta)  # from_dict keeps the input's meta dict: do not add into it
    for other in profiles[1:]:
        merged.merge(other)
    return merged
