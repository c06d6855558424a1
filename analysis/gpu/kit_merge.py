"""A trio in parts (issue 46, goal 6): the studies of kit calls that each trained some kinds of one matched trio
(`run.sh --stages trio --trio-kinds diff_v1 --trio-size 52M`), joined here, on any machine, into the run
folder the whole trio's study would have written, then its figures and report drawn.

    python analysis/gpu/kit.py trio-merge OUT_A OUT_B [OUT_C] --out DIR

Why: a 50M model's checkpoint (fp32 weights, ~200 MB) cannot travel between device calls (64 MiB carried,
16 MiB per file back), but its study can: every number of the study (profile, Table 5 view, the sweep's
cells with their per-window tallies) is a model's own, computed from that model and the shared data alone.
So parts trained in separate calls, each studying its own models, give the whole trio's numbers, provided the
parts are one matched trio: the same ladder size, config, batch, steps, tokens, learning rate, data (the
corpus by its SHA-256) and study settings. The trio stage records these as ``match``; parts whose records
differ are refused, naming the field. What differs between parts is recorded, not hidden: each part's
machine, torch and commit go into the manifest (``parts``, beside the shared ``match``).

Left out of the joined folder: the sweep's cell records (a joined folder has no models to resume with). The
attention maps' tensors come back last in results.zip, where its 16 MiB cap leaves room; a model whose maps
did not is listed in the manifest's ``maps_left_out``, and the figures skip its maps.
"""

from __future__ import annotations

import csv
import io
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from kit_trio import KINDS
from kit_util import read_json, write_json


class MergeError(Exception):
    """A part that cannot join the others: one line naming the part and what is wrong."""


# ------------------------------------------------------------------------------------------ one part
def read_part(folder: Path, into: Path) -> dict[str, Any]:
    """A kit output folder's trio: its ``match`` record, the kinds its study covers, its env, and its study's
    run folder unpacked under ``into`` (results.zip and profiles.zip)."""
    summary = read_json(folder / "summary.json")
    if not isinstance(summary, dict):
        raise MergeError(f"{folder}: no summary.json (expected a kit output folder)")
    entry = summary.get("stages", {}).get("trio")
    if entry is None:
        raise MergeError(f"{folder}: the kit call ran no trio stage")
    numbers = entry.get("numbers", {})
    match = numbers.get("match")
    study = numbers.get("study") or {}
    if match is None:
        raise MergeError(f"{folder}: its trio recorded no match record (a kit from before trio parts?)")
    if study.get("rc") != 0:
        raise MergeError(f"{folder}: its trio's study did not finish (trio stage: {entry.get('status')})")
    kinds = [k for k, run in numbers.get("runs", {}).items() if run.get("status") == "ok"]
    if not kinds:
        raise MergeError(f"{folder}: its trio trained no model")
    for name in ("results.zip", "profiles.zip"):
        path = folder / name
        if not path.is_file():
            raise MergeError(f"{folder}: {name} is missing")
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                if member.startswith("trio/") and ".." not in Path(member).parts:
                    z.extract(member, into)
    run = into / "trio" / "run"
    for need in ("manifest.json", "table5.json", "sweep/sweep.json", "sweep/results.json"):
        if not (run / need).is_file():
            raise MergeError(f"{folder}: its study lacks {need} (was results.zip cut at its size cap?)")
    env = summary.get("stages", {}).get("env", {}).get("numbers", {})
    return {
        "folder": folder,
        "match": match,
        "kinds": kinds,
        "run": run,
        "train": into / "trio" / "train",
        "recipes": into / "trio" / "recipes",
        "env": {k: env.get(k) for k in ("gpu", "torch", "torch_cuda", "commit", "dirty")},
    }


def check_matched(parts: list[dict[str, Any]]) -> None:
    """Every part's match record equals the first's, and no kind is in two parts."""
    first = parts[0]
    for part in parts[1:]:
        for key in sorted(set(first["match"]) | set(part["match"])):
            mine, theirs = part["match"].get(key), first["match"].get(key)
            if mine != theirs:
                raise MergeError(
                    f"{part['folder']}: its trio's {key} {mine!r} differs from {first['folder']}'s {theirs!r}: "
                    "not parts of one matched trio"
                )
    seen: dict[str, Path] = {}
    for part in parts:
        for kind in part["kinds"]:
            if kind in seen:
                raise MergeError(f"{part['folder']}: {kind} is trained in {seen[kind]} too")
            seen[kind] = part["folder"]


# ------------------------------------------------------------------------------------------ the study
def _same(parts: list[dict[str, Any]], what: str, values: list[Any]) -> Any:
    for part, value in zip(parts[1:], values[1:], strict=True):
        if value != values[0]:
            raise MergeError(f"{part['folder']}: its study's {what} differs from {parts[0]['folder']}'s")
    return values[0]


def merge_sweep(parts: list[dict[str, Any]], order: list[str], out: Path) -> None:
    """sweep.json (the spec with every part's models, stamped with the sweep's own fingerprint of it),
    results.json (rows, tallies and dtypes of every model) and the two CSV tables, models in order."""
    from diffquant.eval.sweep import spec_fingerprint

    specs = [read_json(p["run"] / "sweep" / "sweep.json")["spec"] for p in parts]
    for key in sorted(set(specs[0]) - {"models", "tokenizers"}):
        _same(parts, f"sweep {key}", [s.get(key) for s in specs])
    spec = dict(specs[0])
    spec["models"] = {m: s["models"][m] for m in order for s in specs if m in s["models"]}
    spec["tokenizers"] = {m: t for s in specs for m, t in s.get("tokenizers", {}).items()}
    fingerprint = spec_fingerprint(spec)
    (out / "sweep").mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep" / "sweep.json", {"fingerprint": fingerprint, "spec": spec})

    results = [read_json(p["run"] / "sweep" / "results.json") for p in parts]
    merged: dict[str, Any] = {"fingerprint": fingerprint, "complete": all(r.get("complete") for r in results)}
    merged["primary"] = _same(parts, "primary metrics", [r.get("primary") for r in results])
    rows = [row for r in results for row in r.get("rows", [])]
    merged["rows"] = sorted(rows, key=lambda row: order.index(row["model"]))  # stable: each part's order
    merged["dtypes"] = {m: d for r in results for m, d in r.get("dtypes", {}).items()}
    windows: dict[str, dict[str, Any]] = {}
    for r in results:
        for task, by_model in r.get("per_window", {}).items():
            windows.setdefault(task, {}).update(by_model)
    merged["per_window"] = {t: {m: w[m] for m in order if m in w} for t, w in windows.items()}
    extra = sorted(set(results[0]) - set(merged))
    for key in extra:
        merged[key] = _same(parts, f"results {key}", [r.get(key) for r in results])
    write_json(out / "sweep" / "results.json", merged)
    for name in ("results.csv", "timing.csv"):
        _merge_csv(parts, name, order, out / "sweep" / name)


def _merge_csv(parts: list[dict[str, Any]], name: str, order: list[str], path: Path) -> None:
    having, tables = [], []
    for part in parts:
        src = part["run"] / "sweep" / name
        if src.is_file():
            with open(src, newline="") as f:
                having.append(part)
                tables.append(list(csv.reader(f)))
    if not tables:
        return
    header = _same(having, f"{name} columns", [t[0] for t in tables])
    col = header.index("model")
    rows = sorted((row for t in tables for row in t[1:]), key=lambda row: order.index(row[col]))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows([header, *rows])
    path.write_text(buf.getvalue())


def merge_profiles(parts: list[dict[str, Any]], order: list[str], out: Path) -> None:
    """profile/NAME.json of every model, and table5.json / table5.txt with every model's view."""
    from diffquant.profile.sinks import format_sink_rates
    from diffquant.profile.tables import format_table5

    (out / "profile").mkdir(parents=True, exist_ok=True)
    for part in parts:
        for path in sorted((part["run"] / "profile").glob("*.json")):
            shutil.copyfile(path, out / "profile" / path.name)
            maps = path.with_name(f"{path.stem}.maps.safetensors")
            if maps.is_file():
                shutil.copyfile(maps, out / "profile" / maps.name)
    tables = [read_json(p["run"] / "table5.json") for p in parts]
    for key in ("tokens", "data", "sites"):
        _same(parts, f"Table 5 view's {key}", [t.get(key) for t in tables])
    models = {m: t["models"][m] for m in order for t in tables if m in t["models"]}
    write_json(out / "table5.json", {**tables[0], "models": models})
    header = (parts[0]["run"] / "table5.txt").read_text().splitlines()[0]
    sinks = format_sink_rates({n: s.get("sink_rate") for n, s in models.items()})
    text = "\n".join([format_table5({n: s["table5"] for n, s in models.items()}), *sinks])
    (out / "table5.txt").write_text(header + "\n" + text + "\n")


def merge_manifest(parts: list[dict[str, Any]], order: list[str], out: Path) -> None:
    """The first part's manifest with every part's models and checkpoints, the parts' shared ``match``, and
    each part's own command, versions, platform and env under ``parts``."""
    manifests = [read_json(p["run"] / "manifest.json") for p in parts]
    merged = dict(manifests[0])
    recipe = dict(merged.get("recipe", {}))
    recipe["models"] = {
        m: mf["recipe"]["models"][m] for m in order for mf in manifests if m in mf["recipe"]["models"]
    }
    merged["recipe"] = recipe
    merged["checkpoints"] = {
        m: mf["checkpoints"][m] for m in order for mf in manifests if m in mf.get("checkpoints", {})
    }
    merged["status"] = "complete" if all(mf.get("status") == "complete" for mf in manifests) else "partial"
    # maps that did not come back (results.zip's cap): the figures skip them, as for a layer-streamed model
    absent = [m for m in order if not (out / "profile" / f"{m}.maps.safetensors").is_file()]
    if absent:
        merged["maps_left_out"] = absent
    merged["match"] = parts[0]["match"]  # what every part shares (check_matched)
    merged["parts"] = [
        {
            "from": str(p["folder"]),
            "kinds": p["kinds"],
            "env": p["env"],
            **{k: mf.get(k) for k in ("argv", "versions", "platform")},
        }
        for p, mf in zip(parts, manifests, strict=True)
    ]
    write_json(out / "manifest.json", merged)


def merge(folders: list[Path], out: Path, draw: bool = True) -> dict[str, Any]:
    """Join the parts in ``folders`` into the run folder ``out`` (written whole, or not at all), then draw its
    figures and write its report (``draw``). Returns {out, kinds, parts, report_error (None: written)}."""
    if out.exists():
        raise MergeError(f"{out}: exists already (the joined study goes into a new folder)")
    with tempfile.TemporaryDirectory(prefix="diffquant-trio-merge-") as tmp:
        parts = [read_part(folder, Path(tmp) / f"part{i}") for i, folder in enumerate(folders)]
        check_matched(parts)
        order = [k for k in KINDS if any(k in p["kinds"] for p in parts)]  # the trio's order
        build = Path(tmp) / "joined"
        build.mkdir()
        merge_profiles(parts, order, build)
        merge_sweep(parts, order, build)
        merge_manifest(parts, order, build)
        for part in parts:
            for kind in part["kinds"]:
                if (part["train"] / kind).is_dir():
                    shutil.copytree(part["train"] / kind, build / "train" / kind)
                recipe = part["recipes"] / f"{kind}.yaml"
                if recipe.is_file():
                    (build / "recipes").mkdir(exist_ok=True)
                    shutil.copyfile(recipe, build / "recipes" / recipe.name)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(build, out)
    result: dict[str, Any] = {"out": str(out), "kinds": order, "parts": [str(f) for f in folders]}
    if draw:  # as `diffquant run` ends: the report draws the figures that are not current, then writes itself
        from diffquant.errors import DiffquantError
        from diffquant.report import write_report

        try:
            write_report(out)
            result["report_error"] = None
        except DiffquantError as err:
            result["report_error"] = str(err)
    return result


def main(folders: list[str], out: str) -> int:
    """kit.py trio-merge: one line per problem, exit code 2 for parts that cannot join."""
    try:
        result = merge([Path(f) for f in folders], Path(out))
    except MergeError as err:
        print(f"kit.py trio-merge: {err}", file=sys.stderr)
        return 2
    print(
        f"joined {', '.join(result['kinds'])} from {len(folders)} parts into {result['out']}"
        + (f"; its report failed: {result['report_error']}" if result["report_error"] else "")
    )
    return 1 if result["report_error"] else 0
