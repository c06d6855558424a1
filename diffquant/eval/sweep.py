"""Sweeps: models x plans x tasks -> cells, resumable and spread over torchrun ranks.

Each finished cell is appended as one JSON line (flushed and fsynced) to ``cells-rank{R}.jsonl`` in the run
folder, so a killed sweep restarts where it stopped and never recomputes a finished cell. Results
(``results.csv`` / ``results.json``) are rebuilt from the cells in a fixed order and hold no timing, so an
interrupted-and-resumed sweep writes the same results file as an uninterrupted one; timings go to
``timing.csv``. Under ``torchrun`` cell i runs on rank i % world and rank 0 writes the results.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from diffquant.distributed import rank_and_world
from diffquant.errors import DiffquantError
from diffquant.eval.tasks import TaskSpec, default_text, parse_task, run_task
from diffquant.io.artifacts import write_json_atomic, write_text_atomic
from diffquant.kernels.dispatch import path_summary

NONE_PLAN = "none"
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
    tokenizer by model name; ``device`` / ``dtype`` say where and in what precision models run."""

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

    def to_dict(self) -> dict[str, Any]:
        from diffquant.quant.plan import QuantPlan

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
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def read_cells(out: Path) -> dict[str, dict[str, Any]]:
    """Finished cells in a run folder (a torn last line from a killed writer is ignored)."""
    done: dict[str, dict[str, Any]] = {}
    for path in sorted(out.glob("cells-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[record["key"]] = record
    return done


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


class _Runner:
    """Loads models, applies plans and calibrates, with each tokenizer's calibration windows read once.

    Models with different tokenizers read the same text, each cut into windows of its own tokens.
    """

    def __init__(self, spec: SweepSpec, tokenizers: dict[str, Any]) -> None:
        self.spec = spec
        self.tokenizers = tokenizers
        self._calib: dict[str, torch.Tensor] = {}
        self.calib_data = spec.calib_data or default_text(tokenizers.values(), "calib")
        self.eval_data = default_text(tokenizers.values(), "eval")

    def calibration_windows(self, tokenizer) -> torch.Tensor:
        key = tokenizer.fingerprint()
        if key not in self._calib:
            from diffquant.data import token_windows

            self._calib[key] = token_windows(
                self.calib_data, self.spec.calib_tokens, self.spec.calib_seq_len, tokenizer
            )
        return self._calib[key]

    def model(self, cell: Cell):
        from diffquant.quant.plan import QuantPlan, apply_plan, calibrate

        model = load_for_sweep(self.spec, cell.model)
        if cell.plan != NONE_PLAN:
            plan = QuantPlan.load(cell.plan)
            apply_plan(model, plan)
            if plan.uses_static:
                calibrate(model, self.calibration_windows(model.tokenizer), batch_size=self.spec.batch_size)
        return model.eval()


def load_for_sweep(spec: SweepSpec, name: str):
    """Model ``name`` of the sweep on its device, in its dtype, with its tokenizer resolved and checked."""
    from diffquant.data.tokenizer import model_tokenizer
    from diffquant.io import load_model
    from diffquant.io.options import parse_device, parse_dtype

    model = load_model(spec.models[name], device=parse_device(spec.device), dtype=parse_dtype(spec.dtype))
    model.tokenizer = model_tokenizer(model, name, spec.tokenizers.get(name))
    return model


def sweep_tokenizers(spec: SweepSpec) -> dict[str, Any]:
    """Each model's tokenizer, read from the checkpoint files without loading weights (the byte tokenizer
    where none is recorded; a model that cannot read bytes fails when it is loaded, with its own message)."""
    from diffquant.data.tokenizer import ByteTokenizer
    from diffquant.io import peek_tokenizer

    return {
        name: peek_tokenizer(path, spec.tokenizers.get(name)) or ByteTokenizer()
        for name, path in spec.models.items()
    }


def run_sweep(
    spec: SweepSpec, out: str | Path, *, progress: bool = False, log: Callable[[str], None] | None = None
) -> dict[str, Any] | None:
    """Run (or resume) a sweep into ``out``; the results on rank 0, None on other ranks."""
    out = Path(out)
    rank, world = rank_and_world()
    fingerprint = spec.fingerprint()
    marker = out / "sweep.json"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if marker.exists():
            previous = json.loads(marker.read_text()).get("fingerprint")
            if previous != fingerprint:
                raise DiffquantError(
                    f"{out}: holds a different sweep (spec changed); use another output folder or remove it"
                )
        else:
            write_json_atomic(marker, {"fingerprint": fingerprint, "spec": spec.to_dict()})
    _barrier(world)
    done = read_cells(out)
    cells = spec.cells()
    mine = [c for i, c in enumerate(cells) if i % world == rank and c.key not in done]
    if log is not None and rank == 0:
        log(f"sweep: {len(cells)} cells, {len(done)} already done, {len(cells) - len(done)} to run")
    runner = _Runner(spec, sweep_tokenizers(spec))
    if log is not None and rank == 0:
        for name, tok in runner.tokenizers.items():
            log(f"sweep: {name} reads tokenizer {tok.describe()}")
        if any(t.type in ("bpb", "ppl") and not t.params.get("data") for t in spec.tasks):
            log(
                f"sweep: text tasks without 'data' read {runner.eval_data} (the default for these tokenizers)"
            )
    tasks = {t.label: t for t in spec.tasks}
    path = out / f"cells-rank{rank}.jsonl"
    for cell in tqdm(mine, desc="sweep", unit="cell", disable=not progress or rank != 0):
        start = time.perf_counter()
        with torch.no_grad():
            model = runner.model(cell)
            metrics = run_task(
                model, tasks[cell.task], batch_size=spec.batch_size, default_data=runner.eval_data
            )
        record = {
            "key": cell.key,
            "model": cell.model,
            "attention": model.config.attention,
            "plan": cell.plan,
            "task": cell.task,
            "metrics": _clean(metrics),
            "attention_paths": path_summary(model),
            "seconds": time.perf_counter() - start,
        }
        _append(path, record)
    _barrier(world)
    if rank != 0:
        return None
    return write_results(spec, out, read_cells(out))


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe metrics: numbers as float / int, non-finite numbers as None."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = value if value == value and abs(value) != float("inf") else None
        elif isinstance(value, (str, list, dict)):
            out[key] = value
    return out


def result_rows(spec: SweepSpec, records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cell in spec.cells():
        record = records.get(cell.key)
        if record is None:
            continue
        base = records.get(Cell(cell.model, NONE_PLAN, cell.task).key, {}).get("metrics", {})
        for metric, value in record["metrics"].items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            ref = base.get(metric)
            delta = value - ref if isinstance(ref, (int, float)) and not isinstance(ref, bool) else None
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
                    cells.append(f"{row['value']:>{width}.4f}")
                else:
                    cells.append(f"{row['value']:.4f} ({row['delta']:+.4f})".rjust(width))
            lines.append(f"{plan:<24}" + "".join(cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
