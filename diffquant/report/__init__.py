"""The run report: ``report.md`` and a self-contained ``report.html`` built from a run folder's artifacts.

Everything comes from files the stages wrote (manifest, Table 5 summary, profiles, sweep results, figures);
nothing re-runs a model. The HTML inlines every figure as a data URI, so the one file can be mailed or
archived and opens with no missing resources.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.io.artifacts import read_json, write_text_atomic
from diffquant.profile.tables import describe_location

PAPER_SCALE = (
    "The DIFF paper's models had 3B parameters and were trained on 350B tokens; small models often do not "
    "show the outliers the paper reports, so read these numbers at the scale stated above."
)


@dataclass
class Section:
    title: str
    text: str = ""
    tables: list[tuple[str, list[str], list[list[str]]]] = field(
        default_factory=list
    )  # caption, header, rows
    figures: list[tuple[str, Path]] = field(default_factory=list)  # caption, path


def _nonfinite(counts: dict[str, Any] | None) -> str:
    """'0', or 'N NaN, M Inf (first at ...)': a broken model's profile says so in the report too."""
    if not counts:
        return "-"
    total = counts.get("nan", 0) + counts.get("posinf", 0) + counts.get("neginf", 0)
    if not total:
        return "0"
    first = counts.get("first") or {}
    return (
        f"{counts.get('nan', 0):,} NaN, {counts.get('posinf', 0) + counts.get('neginf', 0):,} Inf "
        f"(first at {describe_location(first.get('loc'))})"
    )


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.{digits}g}"
    return str(value)


def _model_scale(run: Path) -> list[list[str]]:
    """Parameters and config per model, from the profiles' metadata."""
    from diffquant.models.config import ModelConfig

    rows = []
    for path in sorted((run / "profile").glob("*.json")):
        meta = read_json(path).get("meta", {})
        config = meta.get("config")
        if not config:
            continue
        cfg = ModelConfig.from_dict(config, source=str(path))
        rows.append(
            [
                meta.get("model", path.stem),
                cfg.attention,
                f"{_count_parameters(cfg):,}",
                f"{cfg.n_layers} x d_model {cfg.d_model}, {cfg.n_heads} heads",
                f"{meta.get('tokens', 0):,}",
            ]
        )
    return rows


def _count_parameters(cfg) -> int:
    import torch

    from diffquant.models.transformer import DecoderLM

    with torch.device("meta"):
        return DecoderLM(cfg).num_parameters()


def build_sections(run: Path, figures: list[Any]) -> list[Section]:
    sections = []
    manifest_path = run / "manifest.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    recipe = manifest.get("recipe") or {}
    overview = Section("Run")
    lines = [f"Folder `{run}`; command `{manifest.get('command', '?')}`."]
    status = run_status(manifest)
    if status is not None:
        lines.insert(0, f"**INCOMPLETE RUN** ({status}): the results below are partial.")
    if recipe:
        lines.append(f"Recipe **{recipe.get('name')}**: {recipe.get('description', '')}")
    overview.text = "\n\n".join(lines)
    scale = _model_scale(run)
    if scale:
        overview.tables.append(
            (
                "Models and their scale",
                ["model", "attention", "parameters", "shape", "tokens profiled"],
                scale,
            )
        )
    overview.text += "\n\n" + PAPER_SCALE
    sections.append(overview)

    t5_path = run / "table5.json"
    if t5_path.is_file():
        t5 = read_json(t5_path)
        models = t5.get("models", {})
        sec = Section("Activation outliers (DIFF paper, Table 5 view)")
        sec.text = (
            f"k-th largest |x| and median |x| over {t5.get('tokens', 0):,} tokens of {t5.get('data', '?')}"
            + "".join(
                f"; {name}: {m['tokens']:,} tokens = {m['bytes']:,} bytes"
                for name, m in models.items()
                if "bytes" in m
            )
            + "."
        )
        cols = ["top1", "top2", "top3", "top10", "top100", "median"]
        rows = [
            [
                name,
                label,
                *(_num(row.get(c)) for c in cols),
                describe_location(row.get("top1_at")),
                _nonfinite(row.get("nonfinite")),
            ]
            for label in ("attention logits", "hidden states")
            for name, m in models.items()
            if (row := m.get("table5", {}).get(label))
        ]
        sec.tables.append(("Table 5 view", ["model", "activation", *cols, "top1 at", "non-finite"], rows))
        layer_rows = [
            [name, str(r["layer"]), *(_num(r.get(c)) for c in ("top1", "top2", "top3", "median", "kurtosis"))]
            for name, m in models.items()
            for r in m.get("layerwise_hidden", [])
        ]
        if layer_rows:
            sec.tables.append(
                (
                    "Hidden states per layer",
                    ["model", "layer", "top1", "top2", "top3", "median", "kurtosis"],
                    layer_rows,
                )
            )
        sections.append(sec)

    for results_path in (run / "sweep" / "results.json", run / "results.json"):
        if results_path.is_file():
            results = read_json(results_path)
            sec = Section("Quantization sweep")
            sec.text = (
                "Primary metric per task; the change is against the same model unquantized (plan none)."
            )
            for task, info in results.get("primary", {}).items():
                metric = info["metric"]
                rows = [
                    [r["model"], r["attention"], r["plan"], _num(r["value"]), _num(r["delta"])]
                    for r in results.get("rows", [])
                    if r["task"] == task and r["metric"] == metric
                ]
                better = "higher" if info["higher_is_better"] else "lower"
                sec.tables.append(
                    (
                        f"{task}: {metric} ({better} is better)",
                        ["model", "attention", "plan", metric, "change"],
                        rows,
                    )
                )
            sections.append(sec)
            break

    if figures:
        sec = Section("Figures")
        for record in figures:
            for path in _paths(record):
                if Path(path).suffix == ".png":
                    sec.figures.append((getattr(record, "caption", "") or Path(path).stem, Path(path)))
        sections.append(sec)

    if manifest:
        versions = manifest.get("versions", {})
        sec = Section("Provenance")
        sec.tables.append(("Versions", ["package", "version"], [[k, str(v)] for k, v in versions.items()]))
        sec.text = (
            "The full manifest (recipe, seeds, checkpoint hashes, corpus fingerprints) is in manifest.json."
        )
        sections.append(sec)
    return sections


def _paths(record: Any) -> list[Path]:
    return [Path(p) for p in record.paths]


def to_markdown(sections: list[Section], run: Path) -> str:
    out = ["# diffquant run report", ""]
    for sec in sections:
        out += [f"## {sec.title}", ""]
        if sec.text:
            out += [sec.text, ""]
        for caption, header, rows in sec.tables:
            out += [f"**{caption}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(row) + " |" for row in rows]
            out.append("")
        for caption, path in sec.figures:
            out += [
                f"![{caption}]({path.relative_to(run) if path.is_relative_to(run) else path})",
                f"*{caption}*",
                "",
            ]
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}figure{margin:1em 0}
img{max-width:100%}figcaption{font-style:italic;color:#555}"""


def to_html(sections: list[Section]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>diffquant run report</title>"]
    parts.append(f"<style>{_CSS}</style></head><body><h1>diffquant run report</h1>")
    for sec in sections:
        parts.append(f"<h2>{html.escape(sec.title)}</h2>")
        for para in filter(None, sec.text.split("\n\n")):
            text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(para))
            text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
            parts.append(f"<p>{text}</p>")
        for caption, header, rows in sec.tables:
            parts.append(f"<table><caption>{html.escape(caption)}</caption><tr>")
            parts.append("".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            for row in rows:
                parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
            parts.append("</table>")
        for caption, path in sec.figures:
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(
                f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def run_status(manifest: dict[str, Any]) -> str | None:
    """None for a finished run (or one written before runs recorded a status), else its status."""
    status = manifest.get("status")
    return None if status in (None, "complete") else str(status)


def write_report(run_dir: str | Path, figures: list[Any] | None = None, dpi: int = 150) -> tuple[Path, Path]:
    """Render missing figures (from artifacts), then write report.md and report.html into the run folder."""
    run = Path(run_dir)
    if not run.is_dir():
        raise DiffquantError(f"{run}: run folder not found")
    if figures is None:
        from diffquant.plots import render_run

        figures = render_run(run, dpi=dpi)
    sections = build_sections(run, figures)
    if len(sections) <= 1 and not figures:
        raise DiffquantError(
            f"{run}: no run artifacts found (expected manifest.json, table5.json, profile/ or results)"
        )
    md = write_text_atomic(run / "report.md", to_markdown(sections, run))
    page = write_text_atomic(run / "report.html", to_html(sections))
    return md, page
