"""Sweeps: models x plans x tasks -> cells, resumable and spread over torchrun ranks.

Each finished cell is appended as one JSON line (flushed and fsynced) to ``cells-rank{R}.jsonl`` in the run
folder, so a killed sweep restarts where it stopped and never recomputes a finished cell. Results
(``results.csv`` / ``results.json``) are rebuilt from the cells in a fixed order and hold no timing, so an
interrupted-and-resumed sweep writes the same results file as an uninterrupted one; timings go to
``timing.csv``. Under ``torchrun`` cell i runs on rank i % world and rank 0 writes the results.

Resuming is by content, not by name: each cell record carries an ``ident``, the sha256 of what decides its
numbers: the model's files (:func:`diffquant.io.artifacts.model_content_sha256`; ``init:`` models by their
specifier), the resolved plan, the task's parameters and the sweep's settings (calibration, batch size,
device, dtype, tokenizer override, by the fingerprint of the tokenizer it loads). A checkpoint replaced at the same
path or a plan file edited in place therefore recomputes exactly the cells it touches (said in the log),
while a plain resume recomputes nothing. The folder is claimed
(:func:`diffquant.io.runfolder.claim_run_folder`) for the sweep's *specifiers* (model specs, plan names,
tasks, settings): another sweep in the same folder, or any other run, is refused; a concurrent run into the
folder is refused while this one holds it.

A record only counts once its line is complete (ends in a newline). A last line cut short (a SIGKILL or a
full disk during the write) is dropped, said in the log with its file and line, truncated away before the
next append, and its cell recomputed. Any other line that is not a cell record means the file was damaged
(not an interrupted append, which can only tear the last line): that is a one-line error naming the file
and line, rather than a guess at which cells are safe to keep.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffquant.data import token_windows
from diffquant.data.tokenizer import ByteTokenizer, load_tokenizer, model_tokenizer
from diffquant.distributed import rank_and_world
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import keep_per_window
from diffquant.eval.tasks import TaskSpec, default_text, kv_cache_refusal, parse_task, run_task
from diffquant.io import load_model, peek_tokenizer
from diffquant.io.artifacts import (
    model_content_sha256,
    read_json,
    write_json_atomic,
    write_text_atomic,
)
from diffquant.io.options import RunOptions, run_options
from diffquant.io.quantize import check_model_calibration
from diffquant.io.runfolder import claim_run_folder
from diffquant.kernels.dispatch import path_summary
from diffquant.names import PLAN_FILE
from diffquant.progress import outside_bars
from diffquant.progress import progress as show_progress
from diffquant.quant.pipeline import apply_plan, calibrate
from diffquant.quant.plan import QuantPlan
from diffquant.stream import choose_stream, evaluate_streamed, stream_mode, stream_skeleton
from diffquant.stream.placement import Placement, load_placed
from diffquant.textfiles import MAX_JSON_BYTES, read_bytes_bounded

NONE_PLAN = "none"
# A sweep loads each model once and runs every cell on a copy of it (:class:`_Runner`); False reloads the
# model for every cell (the old path, kept so tests can show both give the same bytes).
REUSE_LOADED = True
RESULT_COLUMNS = ("model", "attention", "plan", "task", "metric", "value", "unquantized", "delta")


@dataclass(frozen=True)
class Cell:
    model: str
    plan: str
    task: str

    @property
    def key(self) -> str:
        return f"{self.model}|{self.plan}|{self.task}"


@dataclass
class SweepSpec:
    """What a sweep runs. ``calib_data`` None and text tasks without ``data`` read the default text for the
    models' tokenizers (:func:`diffquant.eval.tasks.default_text`); ``tokenizers`` overrides a model's
    tokenizer by model name; ``device`` / ``dtype`` say where and in what precision models run, as written
    (the sweep's identity records them); ``options`` holds them parsed (:meth:`parsed`)."""

    models: dict[str, str]
    plans: list[str] = field(default_factory=lambda: [NONE_PLAN])
    tasks: list[TaskSpec] = field(default_factory=lambda: [parse_task("bpb")])
    calib_data: str | None = None
    calib_tokens: int = 4096
    calib_seq_len: int = 256
    batch_size: int = 8
    device: str = "cpu"
    dtype: str | None = None
    tokenizers: dict[str, str] = field(default_factory=dict)
    # off / on / auto: text tasks run layer-streamed (diffquant.stream). Not in to_dict: the same numbers.
    stream: str | bool = "off"
    # --device-map: models spread over devices (diffquant.stream.placement). Not in to_dict: the same numbers.
    placement: Placement | None = None
    # device / dtype / stream / placement parsed (diffquant.io.options.RunOptions): given by whoever parsed
    # them already (diffquant.stages.sweep_spec), else parsed from the fields above once, when first needed
    options: RunOptions | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.models:
            raise DiffquantError("sweep: no models")
        if NONE_PLAN not in self.plans:  # every delta is measured against the unquantized cell
            self.plans = [NONE_PLAN, *self.plans]
        labels = [t.label for t in self.tasks]
        if len(set(labels)) != len(labels):
            raise DiffquantError(f"sweep: task names must be unique, got {labels} (give tasks a 'name')")
        if not self.tasks:
            raise DiffquantError("sweep: no tasks")

    def cells(self) -> list[Cell]:
        return [Cell(m, p, t.label) for m in self.models for p in self.plans for t in self.tasks]

    def parsed(self) -> RunOptions:
        """The run options parsed: ``options``, or (once, at the first call) ``device`` / ``dtype`` /
        ``stream`` / ``placement`` through :func:`diffquant.io.options.run_options`."""
        if self.options is None:
            self.options = run_options(
                self.device, self.dtype, stream=stream_mode(self.stream), placement=self.placement
            )
        return self.options

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": dict(self.models),
            "plans": {p: None if p == NONE_PLAN else QuantPlan.load(p).to_dict() for p in self.plans},
            "tasks": [t.to_dict() for t in self.tasks],
            "calib": {"data": self.calib_data, "tokens": self.calib_tokens, "seq_len": self.calib_seq_len},
            "batch_size": self.batch_size,
            "device": self.device,
            "dtype": self.dtype,
            "tokenizers": dict(self.tokenizers),
        }

    def fingerprint(self) -> str:
        return spec_fingerprint(self.to_dict())

    def identity(self) -> dict[str, Any]:
        """The sweep by its specifiers (plans by name, not content): what its run folder is claimed for.
        Content behind a specifier (weights, a plan file) is keyed per cell instead (:func:`cell_idents`),
        so changing it recomputes the cells it touches rather than making the folder another sweep's."""
        return {**self.to_dict(), "plans": list(self.plans)}


def spec_fingerprint(spec: dict[str, Any]) -> str:
    """A sweep's fingerprint: the SHA-256 of its spec (:meth:`Sweep.to_dict`, as sweep.json holds it) in
    canonical JSON; also what a run folder joined from parts of one study is stamped with."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def read_cells(out: Path, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Cell records in a run folder by cell key (the last one of a key wins; :func:`run_sweep` picks by
    content instead). An incomplete last line (an interrupted append) is skipped and said through ``log``;
    any other line that is not a cell record is a one-line DiffquantError naming file and line."""
    return {record["key"]: record for record in _read_records(Path(out), log)}


def _read_records(out: Path, log: Callable[[str], None] | None) -> list[dict[str, Any]]:
    records = []
    for path in sorted(out.glob("cells-rank*.jsonl")):
        lines = read_bytes_bounded(path, MAX_JSON_BYTES, "file of cell records").split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, else a record cut short
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problem = None if _is_record(record) else "not a cell record"
            except ValueError as err:
                problem = f"invalid JSON: {getattr(err, 'msg', None) or type(err).__name__}"
            except RecursionError:
                problem = "nested too deep"
            if problem is not None:
                raise DiffquantError(
                    f"{path}:{lineno}: damaged cell record ({problem}); an interrupted write only cuts the "
                    "last line, so the file was changed or damaged: delete that line (its cell is "
                    "recomputed) or rerun with --force to start clean"
                )
            records.append(record)
        if tail.strip() and log is not None:
            log(
                f"sweep: {path}:{len(lines) + 1}: incomplete last line (an interrupted write, "
                f"{len(tail)} bytes); dropping it, its cell will be recomputed"
            )
    return records


def _is_record(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("key"), str)
        and isinstance(record.get("metrics"), dict)
        and "attention" in record
    )


def _drop_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline, so the next record starts on its own line."""
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "ab") as f:
        f.write((json.dumps(record, allow_nan=False) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def cell_idents(spec: SweepSpec, plans: dict[str, Any]) -> dict[str, tuple[str, dict[str, str]]]:
    """Cell key -> (ident, {"model", "plan", "task", "settings": sha256}) for every cell: the content key
    a finished record must carry to count as done. Each model's files are hashed once."""
    settings = _hash(
        {
            "calib": {"data": spec.calib_data, "tokens": spec.calib_tokens, "seq_len": spec.calib_seq_len},
            "batch_size": spec.batch_size,
            "device": spec.device,
            "dtype": spec.dtype,
        }
    )
    by_spec: dict[str, str] = {}
    models = {}
    for name, model_spec in spec.models.items():
        if model_spec not in by_spec:
            by_spec[model_spec] = model_content_sha256(model_spec)
        models[name] = _hash(
            {"weights": by_spec[model_spec], "tokenizer": _tokenizer_key(spec.tokenizers.get(name))}
        )
    plan_keys = {name: _hash(None if plan is None else plan.to_dict()) for name, plan in plans.items()}
    task_keys = {t.label: _hash(t.to_dict()) for t in spec.tasks}
    out = {}
    for cell in spec.cells():
        inputs = {
            "model": models[cell.model],
            "plan": plan_keys[cell.plan],
            "task": task_keys[cell.task],
            "settings": settings,
        }
        out[cell.key] = (_hash(inputs), inputs)
    return out


def _tokenizer_key(override: str | None) -> Any:
    """A tokenizer override by what it encodes: the fingerprint of the tokenizer it loads (vocabulary,
    merges, pre-tokenizer, special ids, BOS rule). Not the file's hash alone: the special tokens of a
    tokenizer.json come from the tokenizer_config.json / generation_config.json / config.json beside it,
    so editing those changes the numbers too, and a resumed sweep must recompute the cells."""
    if override is None:
        return None
    return {"fingerprint": load_tokenizer(override).fingerprint()}


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def load_plans(spec: SweepSpec) -> dict[str, Any]:
    """Each plan of the sweep, read once (None for the unquantized cell)."""
    return {p: None if p == NONE_PLAN else QuantPlan.load(p) for p in spec.plans}


class _Runner:
    """Loads models, applies plans and calibrates, with each tokenizer's calibration windows read once.

    Models with different tokenizers read the same text, each cut into windows of its own tokens.

    Each model is loaded once (:func:`load_for_sweep`) and kept while its cells run (a rank's cells come
    model by model); every cell runs on a deep copy of it, to which the cell's plan is applied and
    calibrated as on a fresh load, so a cell's numbers are those of loading it for the cell alone (a plan
    rewrites weights in place: smoothing, rotation, GPTQ; a task may leave state behind: the kernel path
    each attention ran last). The copy is the caller's, freed after its cell; the kept model goes when the
    next model's cells start (:meth:`release`). Peak: the loaded model plus one cell's copy. Models spread
    over devices (``placement``: accelerate's hooks) and models whose text tasks stream (chosen because
    they need not fit in memory) are loaded per cell as before.
    """

    def __init__(
        self,
        spec: SweepSpec,
        tokenizers: dict[str, Any],
        plans: dict[str, Any],
        streams: dict[str, bool] | None = None,
    ) -> None:
        self.spec = spec
        self.plans = plans
        self.tokenizers = tokenizers
        self._calib: dict[str, torch.Tensor] = {}
        self._streams: dict[str, bool] = dict(streams or {})
        self._loaded: tuple[str, Any] | None = None  # (model name, the model as loaded) kept for reuse
        self.calib_data = spec.calib_data or default_text(tokenizers.values(), "calib")
        self.eval_data = default_text(tokenizers.values(), "eval")

    def calibration_windows(self, tokenizer) -> torch.Tensor:
        key = tokenizer.fingerprint()
        if key not in self._calib:
            self._calib[key] = token_windows(
                self.calib_data, self.spec.calib_tokens, self.spec.calib_seq_len, tokenizer
            )
        return self._calib[key]

    def streams(self, name: str) -> bool:
        """Whether model ``name``'s text tasks run layer-streamed (decided once, see ``choose_stream``)."""
        if name not in self._streams:
            path = self.spec.models[name]
            self._streams[name] = choose_stream(
                path, self.spec.stream, self.spec.parsed().device, what="stream"
            )
        return self._streams[name]

    def streamed_model(self, cell: Cell):
        """A weightless skeleton of the cell's model whose ``stream_eval`` scores a token stream
        layer-streamed, under the cell's plan (static scales calibrated as :meth:`model` calibrates)."""
        spec, path = self.spec, self.spec.models[cell.model]
        model = stream_skeleton(path)
        model.tokenizer = model_tokenizer(model, cell.model, spec.tokenizers.get(cell.model))
        plan = None if cell.plan == NONE_PLAN else copy.deepcopy(self.plans[cell.plan])
        calib = self.calibration_windows(model.tokenizer) if plan is not None and plan.uses_static else None

        def stream_eval(_model, stream, *, progress=False, **settings):
            stats: dict[str, Any] = {}
            result = evaluate_streamed(
                path,
                stream,
                plan=plan,
                calibration=calib,
                device=spec.parsed().device,
                dtype=spec.parsed().dtype,
                stats=stats,
                **settings,
            )
            model.stream_paths = stats["attention_paths"]
            return result

        model.stream_eval = stream_eval
        return model

    def model(self, cell: Cell, task: TaskSpec | None = None):
        if task is not None and task.streams and self.streams(cell.model):
            return self.streamed_model(cell)
        model = self._fresh(cell.model)
        if cell.plan != NONE_PLAN:
            plan = copy.deepcopy(self.plans[cell.plan])  # the plan the cell's ident was computed from
            apply_plan(model, plan)
            if plan.uses_static:
                windows = self.calibration_windows(model.tokenizer)
                check_model_calibration(plan, model, windows)  # one line, not the OOM killer, past memory
                calibrate(model, windows, batch_size=self.spec.batch_size)
        return model.eval()

    def _fresh(self, name: str):
        """Model ``name`` as a fresh load gives it: a deep copy of the kept load (the tokenizer shared: it
        holds no per-run state), or a load of its own where reuse does not apply."""
        if not REUSE_LOADED or self.spec.placement is not None or self.streams(name):
            self.release()
            return load_for_sweep(self.spec, name)
        if self._loaded is None or self._loaded[0] != name:
            self.release()  # the previous model goes before the next one loads
            self._loaded = (name, load_for_sweep(self.spec, name))
        loaded = self._loaded[1]
        return copy.deepcopy(loaded, memo={id(loaded.tokenizer): loaded.tokenizer})

    def release(self) -> None:
        """Drop the kept model (the next cell that needs one loads it)."""
        self._loaded = None


def load_for_sweep(spec: SweepSpec, name: str):
    """Model ``name`` of the sweep on its device (or its placement), in its dtype, with its tokenizer resolved
    and checked."""
    options = spec.parsed()
    if spec.placement is not None:
        model = load_placed(spec.models[name], spec.placement, dtype=options.dtype)
    else:
        model = load_model(spec.models[name], device=options.device, dtype=options.dtype)
    model.tokenizer = model_tokenizer(model, name, spec.tokenizers.get(name))
    return model


def sweep_tokenizers(spec: SweepSpec) -> dict[str, Any]:
    """Each model's tokenizer, read from the checkpoint files without loading weights (the byte tokenizer
    where none is recorded; a model that cannot read bytes fails when it is loaded, with its own message)."""
    return {
        name: peek_tokenizer(path, spec.tokenizers.get(name)) or ByteTokenizer()
        for name, path in spec.models.items()
    }


def run_sweep(
    spec: SweepSpec,
    out: str | Path,
    *,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    force: bool = False,
) -> dict[str, Any] | None:
    """Run (or resume) a sweep into ``out``; the results on rank 0, None on other ranks.

    The folder is claimed for this sweep (:func:`diffquant.io.runfolder.claim_run_folder`, command
    ``"sweep"``): another run's folder is refused, ``force`` starts it clean, a concurrent run into it is
    refused. Cells whose records match their content key are kept; all others run.
    """
    out = Path(out)
    rank, world = rank_and_world()
    say = log if log is not None and rank == 0 else None
    streams = _check_stream(spec)  # before the folder is claimed
    _check_kv_cache(spec)
    inputs = list(spec.models.values())
    with claim_run_folder(out, "sweep", spec.identity(), force=force, inputs=inputs):
        plans = load_plans(spec)
        if rank == 0:
            _check_marker(out / "sweep.json")
            write_json_atomic(out / "sweep.json", {"fingerprint": spec.fingerprint(), "spec": spec.to_dict()})
        _barrier(world)
        idents = cell_idents(spec, plans)
        records = _read_records(out, say)
        done = _current(records, idents)
        cells = spec.cells()
        if say is not None:
            say(f"sweep: {len(cells)} cells, {len(done)} already done, {len(cells) - len(done)} to run")
            stale = _stale(records, idents, done)
            if stale:
                say(f"sweep: {stale}")
        _drop_torn_tail(out / f"cells-rank{rank}.jsonl")  # so the next record starts on its own line
        if rank == 0:  # and the files of ranks an earlier, wider run had
            for extra in out.glob("cells-rank*.jsonl"):
                index = extra.stem.removeprefix("cells-rank")
                if index.isdigit() and int(index) >= world:
                    _drop_torn_tail(extra)
        mine = [c for i, c in enumerate(cells) if i % world == rank and c.key not in done]
        runner = _Runner(spec, sweep_tokenizers(spec), plans, streams)
        if say is not None:
            for name, tok in runner.tokenizers.items():
                say(f"sweep: {name} reads tokenizer {tok.describe()}")
            if any(t.reads_text and not t.params.get("data") for t in spec.tasks):
                say(
                    f"sweep: text tasks without 'data' read {runner.eval_data} (the default for these tokenizers)"
                )
        tasks = {t.label: t for t in spec.tasks}
        path = out / f"cells-rank{rank}.jsonl"
        # a bar on a terminal (or on request), else a line when it starts and every few seconds on stderr,
        # naming the cell (rank 0 only); each cell's own steps (loading, plan, task) report inside it
        bar = show_progress(mine, "sweep", "cell", bar=progress or None, enabled=rank == 0, announce=True)
        for cell in bar:
            bar.set_postfix_str(cell.key)
            start = time.perf_counter()
            with torch.no_grad(), keep_per_window() as per_window:
                model = runner.model(cell, tasks[cell.task])
                metrics = run_task(
                    model, tasks[cell.task], batch_size=spec.batch_size, default_data=runner.eval_data
                )
            ident, inputs = idents[cell.key]
            record = {
                "key": cell.key,
                "ident": ident,
                "inputs": inputs,
                "model": cell.model,
                "attention": model.config.attention,
                "dtype": _float_dtype(model),  # what "unquantized" was: the figures label it so
                "plan": cell.plan,
                "task": cell.task,
                "metrics": _clean(metrics),
                "attention_paths": getattr(model, "stream_paths", None) or path_summary(model),
                "seconds": time.perf_counter() - start,
            }
            if len(per_window) == 1 and per_window[0] is not None:  # a text task's windows (paired noise)
                record["per_window"] = per_window[0]
            del model  # the cell's copy goes before the next cell makes its own (else two are held)
            _append(path, record)
            broken = _non_finite(record["metrics"])
            if broken and log is not None:
                with outside_bars():  # not over the bar on a terminal
                    log(
                        f"sweep: NON-FINITE result in {cell.key}: {', '.join(broken)} (the model's output is not finite)"
                    )
        runner.release()
        _barrier(world)
        if rank != 0:
            return None
        done = _current(_read_records(out, say), idents)
        results = write_results(spec, out, done)
        missing = [c.key for c in cells if c.key not in done]
        if missing:  # never report a missing cell as done
            raise DiffquantError(
                f"{out}: {len(missing)} of {len(cells)} cells have no result after the sweep "
                f"(first: {missing[0]}); run the sweep again to compute them"
            )
        return results


def _check_stream(spec: SweepSpec) -> dict[str, bool]:
    """Which models' text tasks stream, decided before anything is written: ``stream: on`` with a task
    that needs the whole model, or a model that cannot stream, is a one-line error now."""
    mode = stream_mode(spec.stream)
    if mode == "on":
        whole = [t.label for t in spec.tasks if not t.streams]
        if whole:
            raise DiffquantError(
                f"stream on: task {whole[0]} needs the whole model; a streamed eval runs the text tasks "
                "(bpb, ppl) only"
            )
    if mode == "off" or not any(t.streams for t in spec.tasks):
        return {}
    device = spec.parsed().device
    return {name: choose_stream(path, mode, device, what="stream") for name, path in spec.models.items()}


def _check_kv_cache(spec: SweepSpec) -> None:
    """A plan with a ``kv_cache`` section and a task that never decodes: a one-line error before anything is
    written (the cell would silently measure the unquantized cache)."""
    owners = [f"plan {name}" for name, plan in load_plans(spec).items() if plan and plan.kv_cache]
    for name, path in spec.models.items():  # a quantized checkpoint carries its plan
        plan_file = Path(str(path)) / PLAN_FILE
        if plan_file.is_file() and "kv_cache" in read_json(plan_file, "quantization plan").get("plan", {}):
            owners.append(f"model {name}")
    for owner in owners:
        for task in spec.tasks:
            if not task.decodes:
                raise DiffquantError(kv_cache_refusal(task, owner))


def _check_marker(path: Path) -> None:
    """A sweep.json already in the folder must be readable: a damaged one is a one-line error."""
    if not path.exists():
        return
    try:
        data = read_json(path, "sweep description")
    except DiffquantError as err:
        raise DiffquantError(f"{err} (use another --out, or --force to start clean)") from None
    if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), str):
        raise DiffquantError(
            f"{path}: expected a sweep description (a JSON object with 'fingerprint'), got "
            f"{type(data).__name__}{'' if not isinstance(data, dict) else ' without it'} "
            "(use another --out, or --force to start clean)"
        )


def _current(
    records: list[dict[str, Any]], idents: dict[str, tuple[str, dict[str, str]]]
) -> dict[str, dict[str, Any]]:
    """Cell key -> the record computed from the cell's current content (stale records are ignored)."""
    done = {}
    for record in records:
        key = record["key"]
        if key in idents and record.get("ident") == idents[key][0]:
            done[key] = record
    return done


def _stale(
    records: list[dict[str, Any]],
    idents: dict[str, tuple[str, dict[str, str]]],
    done: dict[str, dict[str, Any]],
) -> str | None:
    """A line naming what changed for cells whose records were all computed from other content."""
    changed: dict[str, None] = {}
    stale = set()
    for record in records:
        key = record["key"]
        if key not in idents or key in done:
            continue
        stale.add(key)
        old = record.get("inputs") if isinstance(record.get("inputs"), dict) else {}
        for part, now in idents[key][1].items():
            if old.get(part) != now:
                label = record.get(part) if part in ("model", "plan", "task") else None
                changed[f"{part} {label} changed" if label else f"{part} changed"] = None
    if not stale:
        return None
    n = len(stale)
    return f"{n} finished cell{'s' if n > 1 else ''} out of date, recomputed ({'; '.join(changed)})"


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


NON_FINITE = ("nan", "inf", "-inf")


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe metrics: numbers as float / int; a non-finite number as the string "nan" / "inf" /
    "-inf" (JSON has no NaN, and a null would read as "not measured" when the model's output was broken)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = value if math.isfinite(value) else ("nan" if value != value else str(float(value)))
        elif isinstance(value, (str, list, dict)):
            out[key] = value
    return out


def _non_finite(metrics: dict[str, Any]) -> list[str]:
    return [f"{k} = {v}" for k, v in metrics.items() if isinstance(v, str) and v in NON_FINITE]


def _float_dtype(model: Any) -> str | None:
    """The dtype of the model's floating-point weights (``float32``), None if it shows none."""
    params = getattr(model, "parameters", None)
    for p in params() if callable(params) else ():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return None


def result_rows(spec: SweepSpec, records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cell in spec.cells():
        record = records.get(cell.key)
        if record is None:
            continue
        base = records.get(Cell(cell.model, NONE_PLAN, cell.task).key, {}).get("metrics", {})
        for metric, value in record["metrics"].items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number and value not in NON_FINITE:
                continue
            ref = base.get(metric)
            ref_number = isinstance(ref, (int, float)) and not isinstance(ref, bool)
            delta = value - ref if number and ref_number else None
            rows.append(
                {
                    "model": cell.model,
                    "attention": record["attention"],
                    "plan": cell.plan,
                    "task": cell.task,
                    "metric": metric,
                    "value": value,
                    "unquantized": ref,
                    "delta": delta,
                }
            )
    return rows


def write_results(spec: SweepSpec, out: Path, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = result_rows(spec, records)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {
                k: "" if row[k] is None else (repr(row[k]) if isinstance(row[k], float) else row[k])
                for k in RESULT_COLUMNS
            }
        )
    write_text_atomic(out / "results.csv", buf.getvalue())
    results = {
        "fingerprint": spec.fingerprint(),
        "complete": all(c.key in records for c in spec.cells()),
        "primary": {t.label: {"metric": t.primary[0], "higher_is_better": t.primary[1]} for t in spec.tasks},
        "rows": rows,
    }
    dtypes = {
        c.model: records[c.key]["dtype"]
        for c in spec.cells()
        if c.plan == NONE_PLAN and c.key in records and records[c.key].get("dtype")
    }
    if dtypes:  # each model's unquantized precision (records written before it was kept have none)
        results["dtypes"] = dtypes
    windows = per_window_results(spec, records)
    if windows:  # text tasks' per-window tallies (records written before they were kept have none)
        results["per_window"] = windows
    write_json_atomic(out / "results.json", results)
    timing = io.StringIO()
    timing.write("model,plan,task,seconds,attention_paths\n")
    for cell in spec.cells():
        if cell.key in records:
            rec = records[cell.key]
            paths = " ".join(f"{k}:{n}" for k, n in rec.get("attention_paths", {}).items())
            timing.write(f"{cell.model},{cell.plan},{cell.task},{rec['seconds']:.3f},{paths}\n")
    write_text_atomic(out / "timing.csv", timing.getvalue())
    return results


def per_window_results(spec: SweepSpec, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{task: {model: {plan: per-window tally}}} of the cells whose records keep one (whole-model text
    tasks: :func:`diffquant.eval.perplexity.per_window_record`), for standard errors paired over windows."""
    out: dict[str, Any] = {}
    for cell in spec.cells():
        kept = records.get(cell.key, {}).get("per_window")
        if isinstance(kept, dict):
            out.setdefault(cell.task, {}).setdefault(cell.model, {})[cell.plan] = kept
    return out


def format_results(spec: SweepSpec, results: dict[str, Any]) -> str:
    """One table per task: plans as rows, models as columns, the primary metric and its change."""
    by = {(r["model"], r["plan"], r["task"], r["metric"]): r for r in results["rows"]}
    blocks = []
    for task in spec.tasks:
        metric, higher = task.primary
        width = max(20, *(len(m) + 2 for m in spec.models))
        head = f"{task.label}: {metric} ({'higher' if higher else 'lower'} is better; change vs unquantized)"
        lines = [head, f"{'plan':<24}" + "".join(f"{m:>{width}}" for m in spec.models)]
        for plan in spec.plans:
            cells = []
            for model in spec.models:
                row = by.get((model, plan, task.label, metric))
                if row is None:
                    cells.append(f"{'-':>{width}}")
                elif plan == NONE_PLAN or row["delta"] is None:
                    value = row["value"]
                    cells.append(
                        f"{value:>{width}.4f}" if not isinstance(value, str) else f"{value:>{width}}"
                    )
                else:
                    cells.append(f"{row['value']:.4f} ({row['delta']:+.4f})".rjust(width))
            lines.append(f"{plan:<24}" + "".join(cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
