"""Recipes: one YAML file that chains the stages (profile -> quantize -> eval / sweep -> plots) into a run.

The schema is strict: an unknown or misspelled key is an error naming its path and the allowed keys, since
a silently ignored key is a silently wrong experiment. ``--set path=value`` overrides any key (the value is
parsed as YAML), e.g. ``--set models.baseline=init:baseline:tiny --set eval.tasks[0].tokens=2048``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffquant.data import fingerprint
from diffquant.data.corpus import iter_documents
from diffquant.errors import DiffquantError
from diffquant.eval.multiple_choice import load_mc_jsonl
from diffquant.eval.sweep import SweepSpec, format_results, run_sweep
from diffquant.eval.tasks import default_text, parse_task
from diffquant.io import check_model_spec, load_model
from diffquant.io.artifacts import checkpoint_sha256, manifest, write_json_atomic
from diffquant.io.options import parse_device, parse_dtype
from diffquant.io.quantize import quantize_checkpoint
from diffquant.io.runfolder import claim_run_folder
from diffquant.plots import render_run
from diffquant.profile.runner import profile_stage
from diffquant.quant.plan import QuantPlan
from diffquant.report import write_report
from diffquant.textfiles import apply_override, read_yaml  # noqa: F401 (public here too)

# Schema: key -> (python types, default[, minimum]) or a nested dict schema. REQUIRED keys have no default;
# integers with a minimum are checked against it (and against 2**63, what torch and numpy take).
_REQUIRED = object()
_CALIB = {"source": ((str, type(None)), None), "tokens": ((int,), 4096, 1), "seq_len": ((int,), 256, 2)}
SCHEMA: dict[str, Any] = {
    "name": ((str,), _REQUIRED),
    "description": ((str,), ""),
    "seed": ((int,), 0, 0),
    "models": ((dict,), _REQUIRED),
    # Where and how models run, and which tokenizer they read: a path for all models, or {model: path}.
    "device": ((str,), "cpu"),
    "dtype": ((str, type(None)), None),
    "tokenizer": ((str, dict, type(None)), None),
    "data": {"calib": _CALIB},
    "profile": {
        "enabled": ((bool,), True),
        "data": ((str, type(None)), None),
        "tokens": ((int,), 16384, 1),
        "seq_len": ((int,), 256, 1),
        "batch_size": ((int,), 8, 1),
        "sites": ((list, str), ["*"]),
        "topk": ((int,), 100, 1),
        "attention_metrics": ((bool,), True),
    },
    "quantize": {"plans": ((list,), []), "eval_tokens": ((int,), 2048, 1), "batch_size": ((int,), 8, 1)},
    "eval": {"tasks": ((list,), [{"type": "bpb"}]), "batch_size": ((int,), 8, 1)},
    "sweep": {"plans": ((list,), [])},
    "plots": {"enabled": ((bool,), True), "formats": ((list,), ["png"]), "dpi": ((int,), 150, 1)},
    "output": {"dir": ((str, type(None)), None)},
}
_INT_LIMIT = 2**63
_OPTIONAL_STAGES = ("profile", "quantize", "eval", "sweep", "plots")


def validate(raw: Any, source: str = "recipe") -> dict[str, Any]:
    """The recipe with defaults filled in; raises a one-line DiffquantError naming the bad key's path."""
    if not isinstance(raw, dict):
        raise DiffquantError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    recipe = _check(raw, SCHEMA, source, "")
    for name, spec in recipe["models"].items():
        if not isinstance(spec, str):
            raise DiffquantError(f"{source}: models.{name}: expected a model specifier string, got {spec!r}")
    tokenizer = recipe["tokenizer"]
    if isinstance(tokenizer, dict):
        for name, path in tokenizer.items():
            if name not in recipe["models"] or not isinstance(path, str):
                raise DiffquantError(
                    f"{source}: tokenizer.{name}: expected a model name from 'models' mapped to a tokenizer "
                    f"path, got {name!r}: {path!r}"
                )

    try:
        parse_dtype(recipe["dtype"])
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {err}") from None

    for i, task in enumerate(recipe["eval"]["tasks"]):
        parse_task(task, where=f"{source}: eval.tasks[{i}]")
    for stage in ("quantize", "sweep"):
        for i, plan in enumerate(recipe[stage]["plans"]):
            if not isinstance(plan, str):
                raise DiffquantError(
                    f"{source}: {stage}.plans[{i}]: expected a preset name or a plan file path"
                )
            if plan != "none":
                QuantPlan.load(plan)
    recipe["_present"] = [s for s in _OPTIONAL_STAGES if s in raw]
    return recipe


def _check(raw: dict[str, Any], schema: dict[str, Any], source: str, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in raw:
        if key not in schema:
            path = f"{prefix}{key}"
            raise DiffquantError(
                f"{source}: unknown key '{path}'; allowed keys{' under ' + prefix[:-1] if prefix else ''}: "
                f"{', '.join(schema)}"
            )
    for key, rule in schema.items():
        path = f"{prefix}{key}"
        if isinstance(rule, dict):
            value = raw.get(key)
            if value is None:
                value = {}
            if not isinstance(value, dict):
                hint = f" (to turn the stage off: {path}: {{enabled: false}})" if "enabled" in rule else ""
                raise DiffquantError(f"{source}: {path}: expected a mapping, got {value!r}{hint}")
            out[key] = _check(value, rule, source, f"{path}.")
            continue
        types, default, *minimum = rule
        if key not in raw:
            if default is _REQUIRED:
                raise DiffquantError(f"{source}: missing required key '{path}'")
            out[key] = copy.deepcopy(default)
            continue
        value = raw[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise DiffquantError(f"{source}: {path}: expected {names}, got {value!r}")
        if minimum and isinstance(value, int) and not minimum[0] <= value < _INT_LIMIT:
            raise DiffquantError(
                f"{source}: {path}: expected an integer in [{minimum[0]}, 2**63), got {value!r}"
            )
        out[key] = value
    return out


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    return validate(read_yaml(path, overrides), source=str(path))


def run_recipe(
    recipe: dict[str, Any],
    out: str | Path | None = None,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
    force: bool = False,
) -> Path:
    """Run every stage the recipe names into a run folder; returns the folder.

    The folder belongs to this recipe (:func:`diffquant.io.runfolder.claim_run_folder`): the same recipe
    may run into it again, another run's folder is refused unless ``force`` starts it clean.
    """
    out = Path(out or recipe["output"]["dir"] or f"runs/{recipe['name']}")
    present = recipe["_present"]
    clean = {k: v for k, v in recipe.items() if k != "_present"}
    # Everything checkable is checked before the first write: models, tokenizers, window lengths, texts.
    texts = _preflight(recipe)
    sources = {recipe["data"]["calib"]["source"] or texts["calib"]}
    if "profile" in present and recipe["profile"]["enabled"]:
        sources.add(recipe["profile"]["data"] or texts["profile"])
    for task in recipe["eval"]["tasks"]:
        if isinstance(task, dict) and task.get("type", "bpb") in ("bpb", "ppl"):
            sources.add(task.get("data") or texts["eval"])
    record = manifest(
        "run",
        recipe=clean,
        seed=recipe["seed"],
        checkpoints={
            name: {"spec": spec, "sha256": checkpoint_sha256(spec)} for name, spec in recipe["models"].items()
        },
        corpora={s: fingerprint(s) for s in sorted(sources)},
        status="running",
    )

    # What decides the results; cosmetic keys (description, plots, output) may change between reruns.
    identity = {k: v for k, v in clean.items() if k not in ("description", "plots", "output")}
    with claim_run_folder(out, "run", identity, force=force):
        torch.manual_seed(recipe["seed"])
        write_json_atomic(out / "manifest.json", record)
        try:
            _run_stages(recipe, out, progress, log)
        except BaseException as err:  # the run folder says it is incomplete, whatever stopped it
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            write_json_atomic(out / "manifest.json", {**record, "status": f"failed: {message}"})
            raise
        write_json_atomic(out / "manifest.json", {**record, "status": "complete"})
        _finish(recipe, out, log)
    return out


def _finish(recipe: dict[str, Any], out: Path, log: Callable[[str], None]) -> None:
    # Figures and the report are views of the finished artifacts (`diffquant plot` / `report` redo them).
    figures: list = []
    if recipe["plots"]["enabled"]:
        figures = render_run(out, formats=tuple(recipe["plots"]["formats"]), dpi=recipe["plots"]["dpi"])
        log(f"plots: {len(figures)} figures in {out / 'figures'}")

    md, page = write_report(out, figures=figures)
    log(f"report: {md}, {page}")
    log(f"done: {out}")


def _preflight(recipe: dict[str, Any]) -> dict[str, str]:
    """Check every model (config, tokenizer fit, window lengths) and every text source before a run
    writes anything; returns the default texts for the models' tokenizers."""
    parse_device(recipe["device"])
    present = recipe["_present"]
    seq_lens = [("data.calib.seq_len", recipe["data"]["calib"]["seq_len"])]
    if "profile" in present and recipe["profile"]["enabled"]:
        seq_lens.append(("profile.seq_len", recipe["profile"]["seq_len"]))
    tasks = (
        [parse_task(t) for t in recipe["eval"]["tasks"]] if ("eval" in present or "sweep" in present) else []
    )
    seq_lens += [(f"task {t.label} seq_len", t.params.get("seq_len")) for t in tasks]
    paths = model_tokenizer_paths(recipe)
    tokenizers = [
        check_model_spec(spec, name, paths.get(name), seq_lens)[1] for name, spec in recipe["models"].items()
    ]
    texts = {purpose: default_text(tokenizers, purpose) for purpose in ("calib", "profile", "eval")}
    for source in {
        recipe["data"]["calib"]["source"] or texts["calib"],
        recipe["profile"]["data"] or texts["profile"],
    }:
        iter_documents(source)  # raises at once for a missing source
    for t in tasks:
        if t.type in ("bpb", "ppl") and t.params["data"]:
            iter_documents(t.params["data"])
        if t.type == "mc":
            load_mc_jsonl(t.params["path"])
    return texts


def _run_stages(recipe: dict[str, Any], out: Path, progress: bool, log: Callable[[str], None]) -> None:
    present = recipe["_present"]
    log(f"run {recipe['name']} -> {out}")
    if "profile" in present and recipe["profile"]["enabled"]:
        _stage_profile(recipe, out, progress, log)
    if "quantize" in present and recipe["quantize"]["plans"]:
        _stage_quantize(recipe, out, log)
    if "eval" in present or "sweep" in present:
        _stage_sweep(recipe, out, progress, log)


def model_tokenizer_paths(recipe: dict[str, Any]) -> dict[str, str]:
    """The recipe's ``tokenizer`` key as {model name: path} (one path applies to every model)."""
    tokenizer = recipe["tokenizer"]
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, str):
        return dict.fromkeys(recipe["models"], tokenizer)
    return dict(tokenizer)


def _load_models(recipe: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    paths = model_tokenizer_paths(recipe)
    device, dtype = parse_device(recipe["device"]), parse_dtype(recipe["dtype"])
    return {
        name: (spec, load_model(spec, device=device, dtype=dtype, tokenizer=paths.get(name)))
        for name, spec in recipe["models"].items()
    }


def _stage_profile(recipe: dict[str, Any], out: Path, progress: bool, log: Callable[[str], None]) -> None:
    cfg = recipe["profile"]
    models = _load_models(recipe)
    header, table, _ = profile_stage(
        models,
        data=cfg["data"],
        tokens=cfg["tokens"],
        seq_len=cfg["seq_len"],
        batch_size=cfg["batch_size"],
        sites=cfg["sites"],
        topk=cfg["topk"],
        attention=None if cfg["attention_metrics"] else False,
        out=out,
        progress=progress,
    )
    if header:
        log(header)
        log(table)


def _stage_quantize(recipe: dict[str, Any], out: Path, log: Callable[[str], None]) -> None:
    cfg, calib = recipe["quantize"], recipe["data"]["calib"]
    for name, spec in recipe["models"].items():
        for plan in cfg["plans"]:
            target = out / "quantized" / f"{name}--{Path(plan).stem}"
            summary = quantize_checkpoint(
                spec,
                plan,
                calib_data=calib["source"],
                calib_tokens=calib["tokens"],
                eval_tokens=cfg["eval_tokens"],
                seq_len=calib["seq_len"],
                batch_size=cfg["batch_size"],
                out=target,
                force=True,
                device=recipe["device"],
                dtype=recipe["dtype"],
                tokenizer=model_tokenizer_paths(recipe).get(name),
            )
            log(f"quantize {name} with {plan}: model logits SQNR {summary['logits_sqnr_db']} dB -> {target}")


def _stage_sweep(recipe: dict[str, Any], out: Path, progress: bool, log: Callable[[str], None]) -> None:
    calib = recipe["data"]["calib"]
    spec = SweepSpec(
        models=dict(recipe["models"]),
        plans=list(recipe["sweep"]["plans"]),
        tasks=[parse_task(t) for t in recipe["eval"]["tasks"]],
        calib_data=calib["source"],
        calib_tokens=calib["tokens"],
        calib_seq_len=calib["seq_len"],
        batch_size=recipe["eval"]["batch_size"],
        device=recipe["device"],
        dtype=recipe["dtype"],
        tokenizers=model_tokenizer_paths(recipe),
    )
    results = run_sweep(spec, out / "sweep", progress=progress, log=log)
    if results is not None:
        log(format_results(spec, results))
