"""The run report: ``report.md`` and a self-contained ``report.html`` built from a run folder's artifacts.

Everything comes from files the stages wrote (manifest, Table 5 summary, profiles, sweep results, figures);
nothing re-runs a model. The HTML inlines every figure as a data URI, so the one file can be mailed or
archived and opens with no missing resources.

The report reads top down: the command that made the run, a table of contents with an index of the
figures, a summary of findings in sentences computed from the numbers (:mod:`diffquant.report.summary`),
then the models, the Table 5 view, the quantization results as the model x plan grid the command line
prints (:func:`diffquant.eval.sweep.format_results`), the figures and the provenance.
"""

from __future__ import annotations

import base64
import html
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffquant.errors import DiffquantError
from diffquant.eval.sweep import SweepSpec, format_results
from diffquant.eval.tasks import parse_task
from diffquant.io.artifacts import read_json, write_text_atomic
from diffquant.models.config import ModelConfig
from diffquant.models.transformer import DecoderLM
from diffquant.plots import render_run
from diffquant.plots.common import KIND_TITLES
from diffquant.plots.run import _sweep_files, load_run
from diffquant.profile.tables import describe_location
from diffquant.quant.schemes import Scheme, describe
from diffquant.report.seeds import seed_sentences
from diffquant.report.summary import summarize

PAPER_SCALE = (
    "The DIFF paper's models had 3B parameters and were trained on 350B tokens; small models often do not "
    "show the outliers the paper reports, so read these numbers at the scale of the models here."
)


@dataclass
class Section:
    title: str
    text: str = ""
    tables: list[tuple[str, list[str], list[list[str]]]] = field(
        default_factory=list
    )  # caption, header, rows
    figures: list[tuple[str, Path, str]] = field(default_factory=list)  # caption, path, anchor
    bullets: list[tuple[str, list[str]]] = field(default_factory=list)  # sub-heading, sentences
    blocks: list[tuple[str, str]] = field(default_factory=list)  # caption, preformatted text
    anchor: str = ""

    @property
    def id(self) -> str:
        return self.anchor or _slug(self.title)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


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


def format_column(values: list[Any]) -> list[str]:
    """One number format for a whole table column: fixed decimals chosen so the smallest non-zero value
    keeps 3 significant digits (at most 4 decimals), or scientific notation for every entry when the
    column spans five decades or more; '-' for a missing value. Integers stay integers."""
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if numbers and all(isinstance(v, int) for v in numbers):
        return ["-" if v is None else f"{v:,}" if isinstance(v, int) else str(v) for v in values]
    finite = [abs(float(v)) for v in numbers if math.isfinite(v)]
    nonzero = [v for v in finite if v > 0]
    small, big = (min(nonzero), max(nonzero)) if nonzero else (1.0, 1.0)
    if big >= 1e7 or small < 1e-4 or big / small >= 1e5:

        def fmt(v: float) -> str:
            return f"{v:.3e}"

    else:
        decimals = max(0, min(4, 2 - math.floor(math.log10(small))))

        def fmt(v: float) -> str:
            return f"{v:,.{decimals}f}"

    out = []
    for v in values:
        if v is None:
            out.append("-")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(fmt(float(v)) if math.isfinite(v) else str(v))
        else:
            out.append(str(v))
    return out


def _table(columns: list[list[Any]]) -> list[list[str]]:
    """Rows of strings from columns of values, each numeric column in one format."""
    formatted = [format_column(col) for col in columns]
    return [list(row) for row in zip(*formatted, strict=True)] if formatted else []


def command_line(manifest: dict[str, Any]) -> str:
    """The command that made the run, from the manifest's argv: 'diffquant demo --out X', 'diffquant run
    recipes/r.yaml'; a stage called from Python (argv of another program) is said as such."""
    argv = manifest.get("argv")
    stage = manifest.get("command")
    if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
        prog = Path(argv[0])
        if prog.name == "diffquant" or (prog.name == "__main__.py" and prog.parent.name == "diffquant"):
            return "diffquant " + shlex.join(argv[1:])
        return f"stage `{stage or '?'}` called from Python (process `{shlex.join([prog.name, *argv[1:]])}`)"
    return f"stage `{stage}` (the manifest records no command line)" if stage else "not recorded"


def _model_scale(profiles: dict[str, Any]) -> list[list[str]]:
    """Parameters and config per model, from the profiles' metadata."""
    rows = []
    for name, profile in profiles.items():
        meta = profile.meta
        config = meta.get("config")
        if not config:
            continue
        cfg = ModelConfig.from_dict(config, source=str(name))
        rows.append(
            [
                name,
                cfg.attention,
                f"{_count_parameters(cfg):,}",
                f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads",
                f"{meta.get('tokens', 0):,}",
            ]
        )
    return rows


def _count_parameters(cfg) -> int:
    with torch.device("meta"):
        return DecoderLM(cfg).num_parameters()


def results_grid(results: dict[str, Any], sweep: dict[str, Any] | None) -> str | None:
    """The model x plan grid per task, exactly as ``diffquant eval`` and ``diffquant run`` print it
    (:func:`diffquant.eval.sweep.format_results`), or None when the sweep description cannot be read."""
    spec = (sweep or {}).get("spec", sweep or {})
    try:
        sweep_spec = SweepSpec(
            models=dict(spec["models"]),
            plans=list(spec["plans"]),
            tasks=[parse_task(t, where="sweep.json task") for t in spec["tasks"]],
        )
        return format_results(sweep_spec, results)
    except (DiffquantError, KeyError, TypeError, ValueError, AttributeError):
        return None


def describe_task(task: dict[str, Any]) -> list[str]:
    """[label, type, its settings as 'key value'] of a task as sweep.json records it (every key, defaults
    included: which windows start with BOS, how windows are cut, what data is read are part of a number's
    meaning)."""
    kind = str(task.get("type", "?"))
    settings = ", ".join(f"{k} {v}" for k, v in task.items() if k not in ("type", "name") and v is not None)
    return [str(task.get("name") or kind), kind, settings or "defaults"]


def describe_plan(name: str, plan: dict[str, Any] | None) -> str:
    """What a plan does, in words, from the plan itself (sweep.json holds each plan's content): its own
    description, then each rule as 'SITES -> scheme' (:func:`diffquant.quant.schemes.describe`), weight
    rules and a backend named as such. ``none`` is the unquantized model."""
    if plan is None:
        return "the unquantized model (the reference every change is measured against)"
    parts = []
    for rule in plan.get("rules") or []:
        try:
            scheme = describe(Scheme.parse(rule.get("scheme"), where=f"plan {name!r}"))
        except DiffquantError:
            scheme = str(rule.get("scheme"))
        if rule.get("modules"):
            parts.append(f"weights of {', '.join(map(str, rule['modules']))} to {scheme}")
        if rule.get("sites"):
            parts.append(f"{', '.join(_site_words(str(p)) for p in rule['sites'])} to {scheme}")
    backend = plan.get("backend")
    if isinstance(backend, dict):
        settings = ", ".join(f"{k} {v}" for k, v in backend.items() if k not in ("name", "modules"))
        modules = ", ".join(map(str, backend.get("modules") or []))
        parts.append(f"{backend.get('name')} layers for {modules}" + (f" ({settings})" if settings else ""))
    for transform in ("rotate", "weights"):
        if plan.get(transform):
            parts.append(f"{transform} transform first")
    cache = plan.get("kv_cache")
    if isinstance(cache, dict):
        defaults = {"scale_dtype": "model"}  # said only when a plan changes it
        settings = ", ".join(f"{k} {v}" for k, v in cache.items() if defaults.get(k, object()) != v)
        parts.append(f"a quantized KV cache when the model decodes ({settings})")
    text = str(plan.get("description") or "").strip().rstrip(".")
    rules = "; ".join(parts)
    if text and rules:
        return f"{text}. In detail: {rules}."
    return f"{text or rules}." if text or rules else "no rules"


def _site_words(pattern: str) -> str:
    """A site pattern, with the kind's title where it names one (``attention logits (kind:logits)``)."""
    kind = pattern.removeprefix("kind:")
    return (
        f"{KIND_TITLES[kind]} ({pattern})" if pattern.startswith("kind:") and kind in KIND_TITLES else pattern
    )


def _artifacts(run: Path):
    """The run's profiles and sweep results (plots.load_run without attention maps), or None."""
    if not ((run / "profile").is_dir() and any((run / "profile").glob("*.json"))) and not _sweep_files(run):
        return None
    return load_run(run, maps=False)


def build_sections(run: Path, figures: list[Any]) -> list[Section]:
    sections = []
    manifest_path = run / "manifest.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    recipe = manifest.get("recipe") or {}
    art = _artifacts(run)
    profiles = art.profiles if art is not None else {}
    t5_path = run / "table5.json"
    t5 = read_json(t5_path) if t5_path.is_file() else None
    status = run_status(manifest)

    overview = Section("Run")
    lines = [
        f"Command: `{command_line(manifest)}`" if manifest else "Command: not recorded (no manifest.json)",
        f"Folder: `{run}`",
    ]
    if status is not None:
        lines.insert(0, f"**INCOMPLETE RUN** ({status}): the results below are partial.")
    if recipe:
        lines.append(f"Recipe **{recipe.get('name')}**: {recipe.get('description', '')}")
    overview.text = "\n\n".join(lines)
    sections.append(overview)
    scale_section = Section("Models", PAPER_SCALE)
    scale = _model_scale(profiles)
    if scale:
        scale_section.tables.append(
            (
                "Models and their scale",
                ["model", "attention", "parameters", "shape", "tokens profiled"],
                scale,
            )
        )

    results = art.results if art is not None else None
    seed_lines = []
    for path, kind in ((run / "table5_seeds.json", "t5"), (run / "sweep" / "results_seeds.json", "sweep")):
        if path.is_file():
            comparisons = read_json(path).get("comparisons", [])
            seed_lines += seed_sentences(
                comparisons if kind == "t5" else [], comparisons if kind == "sweep" else []
            )
    topics = summarize(t5, results, art.sweep if art is not None else None, profiles, status, seed_lines)
    if topics:
        sections.append(
            Section(
                "Summary",
                "Findings computed from this run's numbers; 2 standard errors is the line between a "
                "difference and noise.",
                bullets=topics,
            )
        )

    if scale:
        sections.append(scale_section)
    else:  # no profile metadata: the scale warning stays in the header
        overview.text += "\n\n" + PAPER_SCALE

    if t5 is not None:
        models = t5.get("models", {})
        sec = Section("Activation outliers (DIFF paper, Table 5 view)", anchor="outliers")
        sec.text = (
            f"k-th largest |x| and median |x| over {t5.get('tokens', 0):,} tokens of {t5.get('data', '?')}"
            + "".join(
                f"; {name}: {m['tokens']:,} tokens = {m['bytes']:,} bytes"
                for name, m in models.items()
                if "bytes" in m
            )
            + "."
        )
        sites = t5.get("sites")
        if isinstance(sites, list) and sites != ["*"]:  # a subset must not read as the whole model
            sec.text += f" Only the sites matching {', '.join(f'`{p}`' for p in sites)}, not the whole model."
        cols = ["top1", "top2", "top3", "top10", "top100", "median"]
        found = [
            (name, label, row)
            for label in ("attention logits", "hidden states")
            for name, m in models.items()
            if (row := m.get("table5", {}).get(label))
        ]
        if found:
            columns = [
                [n for n, _, _ in found],
                [label for _, label, _ in found],
                *([row.get(c) for _, _, row in found] for c in cols),
                [describe_location(row.get("top1_at")) for _, _, row in found],
                [_nonfinite(row.get("nonfinite")) for _, _, row in found],
            ]
            sec.tables.append(
                ("Table 5 view", ["model", "activation", *cols, "top1 at", "non-finite"], _table(columns))
            )
        per_layer = {name: m.get("layerwise_hidden", []) for name, m in models.items()}
        per_layer = {n: {r["layer"]: r for r in rows} for n, rows in per_layer.items() if rows}
        if per_layer:
            layers = sorted({layer for rows in per_layer.values() for layer in rows})
            stats = ("top1", "median", "kurtosis", "channel_rms_kurtosis")
            header = ["layer"] + [f"{n} {s}" for s in stats for n in per_layer]
            columns = [layers] + [
                [per_layer[n].get(layer, {}).get(s) for layer in layers] for s in stats for n in per_layer
            ]
            sec.tables.append(("Hidden states per layer", header, _table(columns)))
        sections.append(sec)

    if results is not None:
        sec = Section("Quantization results", anchor="quantization")
        sec.text = (
            "Primary metric per task, one column per model and one row per plan; in brackets the change "
            "against the same model unquantized (plan none). Every metric of every cell is in "
            f"`{art.results_path.relative_to(run).with_suffix('.csv')}`."
        )
        grid = results_grid(results, art.sweep)
        if grid is not None:
            sec.blocks.append(("Model x plan grid (as `diffquant eval` prints it)", grid))
        else:
            sec.text += " (The sweep description could not be read, so no grid is shown.)"
        tasks = ((art.sweep or {}).get("spec") or {}).get("tasks")
        if isinstance(tasks, list) and tasks:
            rows = [describe_task(t) for t in tasks if isinstance(t, dict)]
            sec.tables.append(("The tasks: what each one reads", ["task", "type", "settings"], rows))
        plans = ((art.sweep or {}).get("spec") or {}).get("plans")
        if isinstance(plans, dict) and plans:
            rows = [[name, describe_plan(name, plan)] for name, plan in plans.items()]
            sec.tables.append(("The plans: what each one quantizes", ["plan name", "what it does"], rows))
        sections.append(sec)

    if figures:
        sec = Section("Figures")
        for number, record in enumerate(figures, start=1):
            for path in _paths(record):
                if Path(path).suffix == ".png":
                    caption = getattr(record, "caption", "") or Path(path).stem
                    sec.figures.append((f"Figure {number}. {caption}", Path(path), _fig_anchor(record)))
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


def _fig_anchor(record: Any) -> str:
    return "fig-" + _slug(str(getattr(record, "name", "") or Path(_paths(record)[0]).stem))


def _fig_title(record: Any) -> str:
    title = getattr(record, "title", "") or ""
    return title or str(getattr(record, "name", "") or Path(_paths(record)[0]).stem)


def contents(
    sections: list[Section], figures: list[Any]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(section title, anchor)], [(figure title, anchor)]): the table of contents and figure index."""
    toc = [(s.title, s.id) for s in sections]
    index = [
        (f"Figure {n}. {_fig_title(r)}", _fig_anchor(r))
        for n, r in enumerate(figures or [], start=1)
        if any(Path(p).suffix == ".png" for p in _paths(r))
    ]
    return toc, index


def to_markdown(sections: list[Section], run: Path, figures: list[Any] | None = None) -> str:
    out = ["# diffquant run report", ""]
    toc, index = contents(sections, figures or [])
    out += ["**Contents:** " + " · ".join(f"[{t}](#{a})" for t, a in toc), ""]
    if index:
        out += ["**Figures:**", ""] + [
            f"{i}. [{t.split('. ', 1)[1]}](#{a})" for i, (t, a) in enumerate(index, 1)
        ]
        out.append("")
    for sec in sections:
        out += [f'<a id="{sec.id}"></a>', "", f"## {sec.title}", ""]
        if sec.text:
            out += [sec.text, ""]
        for heading, sentences in sec.bullets:
            out += [f"### {heading}", ""] + [f"- {s}" for s in sentences] + [""]
        for caption, text in sec.blocks:
            out += [f"**{caption}**", "", "```", text, "```", ""]
        for caption, header, rows in sec.tables:
            out += [f"**{caption}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(row) + " |" for row in rows]
            out.append("")
        for caption, path, anchor in sec.figures:
            out += [
                f'<a id="{anchor}"></a>',
                "",
                f"![{caption}]({path.relative_to(run) if path.is_relative_to(run) else path})",
                f"*{caption}*",
                "",
            ]
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;
line-height:1.45}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-variant-numeric:tabular-nums}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child,td.t{text-align:left}caption{text-align:left;font-weight:600;padding:.2em 0}
figure{margin:1.5em 0}img{max-width:100%;height:auto}figcaption{font-style:italic;color:#555}
.wide{overflow-x:auto;max-width:100%}th{overflow-wrap:anywhere}
pre{background:#f6f6f6;border:1px solid #ddd;padding:.7em;overflow-x:auto;font-size:13px;line-height:1.35}
.command code{font-size:15px;background:#f3f3f3;padding:.1em .3em}
nav{background:#fafafa;border:1px solid #ddd;padding:.5em 1em;margin:1em 0}
nav ol{margin:.3em 0;columns:2;column-gap:2em}
.summary li{margin:.35em 0}h3{margin-bottom:.3em}"""


_NUMERIC = re.compile(r"^(-|[-+]?[\d,]*\.?\d+(e[-+]?\d+)?|nan|inf|-inf)$")


def _inline(text: str) -> str:
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def to_html(sections: list[Section], figures: list[Any] | None = None) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>diffquant run report</title>"]
    parts.append(f"<style>{_CSS}</style></head><body><h1>diffquant run report</h1>")
    toc, index = contents(sections, figures or [])
    nav = ["<nav><b>Contents:</b> " + " · ".join(f"<a href='#{a}'>{html.escape(t)}</a>" for t, a in toc)]
    if index:
        nav.append("<br><b>Figures:</b><ol>")
        nav += [f"<li><a href='#{a}'>{html.escape(t.split('. ', 1)[1])}</a></li>" for t, a in index]
        nav.append("</ol>")
    nav.append("</nav>")
    for k, sec in enumerate(sections):
        if k == 1:  # the contents right after the run's header (command, folder, recipe)
            parts += nav
        parts.append(f"<h2 id='{sec.id}'>{html.escape(sec.title)}</h2>")
        for para in filter(None, sec.text.split("\n\n")):
            cls = " class='command'" if para.startswith("Command:") else ""
            parts.append(f"<p{cls}>{_inline(para)}</p>")
        for heading, sentences in sec.bullets:
            parts.append(f"<h3>{html.escape(heading)}</h3><ul class='summary'>")
            parts += [f"<li>{_inline(s)}</li>" for s in sentences]
            parts.append("</ul>")
        for caption, text in sec.blocks:
            parts.append(f"<p><b>{_inline(caption)}</b></p><pre>{html.escape(text)}</pre>")
        for caption, header, rows in sec.tables:
            # a table wider than the window (a column per model and statistic) scrolls in its own box, so
            # the page never scrolls sideways (tests/test_report.py opens it in Chromium)
            parts.append(f"<div class='wide'><table><caption>{html.escape(caption)}</caption><tr>")
            parts.append("".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            text = [not all(_NUMERIC.match(r[i]) for r in rows if i < len(r)) for i in range(len(header))]
            for row in rows:
                cells = (
                    f"<td{' class=t' if t else ''}>{html.escape(c)}</td>"
                    for c, t in zip(row, text, strict=False)
                )
                parts.append("<tr>" + "".join(cells) + "</tr>")
            parts.append("</table></div>")
        for caption, path, anchor in sec.figures:
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(
                f"<figure id='{anchor}'><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def run_status(manifest: dict[str, Any]) -> str | None:
    """None for a finished run (or one written before runs recorded a status), else its status."""
    status = manifest.get("status")
    return None if status in (None, "complete") else str(status)


def write_report(run_dir: str | Path, figures: list[Any] | None = None, dpi: int = 150) -> tuple[Path, Path]:
    """Draw the figures that are not current (from artifacts), then write report.md and report.html into
    the run folder. Figures ``diffquant plot`` (or an earlier report) drew from the same artifacts at the same
    dpi are reused as they are, not drawn again (:func:`diffquant.plots.render_run`'s ``reuse``)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise DiffquantError(f"{run}: run folder not found")
    if figures is None:
        figures = render_run(run, dpi=dpi, reuse=True, command="report")
    sections = build_sections(run, figures)
    if len(sections) <= 1 and not figures:
        raise DiffquantError(
            f"{run}: no run artifacts found (expected manifest.json, table5.json, profile/ or results)"
        )
    md = write_text_atomic(run / "report.md", to_markdown(sections, run, figures))
    page = write_text_atomic(run / "report.html", to_html(sections, figures))
    return md, page
