"""Recipes: one YAML file that chains the stages (profile -> quantize -> eval / sweep -> plots) into a run.

The schema is strict: an unknown or misspelled key is an error naming its path and the allowed keys, since
a silently ignored key is a silently wrong experiment. ``--set path=value`` overrides any key (the value is
parsed as YAML), e.g. ``--set models.baseline=init:baseline:tiny --set eval.tasks[0].tokens=2048``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from diffquant.errors import DiffquantError

# Schema: key -> (python types, default) or a nested dict schema. REQUIRED keys have no default.
_REQUIRED = object()
_CALIB = {"source": ((str, type(None)), None), "tokens": ((int,), 4096), "seq_len": ((int,), 256)}
SCHEMA: dict[str, Any] = {
    "name": ((str,), _REQUIRED),
    "description": ((str,), ""),
    "seed": ((int,), 0),
    "models": ((dict,), _REQUIRED),
    # Where and how models run, and which tokenizer they read: a path for all models, or {model: path}.
    "device": ((str,), "cpu"),
    "dtype": ((str, type(None)), None),
    "tokenizer": ((str, dict, type(None)), None),
    "data": {"calib": _CALIB},
    "profile": {
        "enabled": ((bool,), True),
        "data": ((str, type(None)), None),
        "tokens": ((int,), 16384),
        "seq_len": ((int,), 256),
        "batch_size": ((int,), 8),
        "sites": ((list, str), ["*"]),
        "topk": ((int,), 100),
        "attention_metrics": ((bool,), True),
    },
    "quantize": {"plans": ((list,), []), "eval_tokens": ((int,), 2048), "batch_size": ((int,), 8)},
    "eval": {"tasks": ((list,), [{"type": "bpb"}]), "batch_size": ((int,), 8)},
    "sweep": {"plans": ((list,), [])},
    "plots": {"enabled": ((bool,), True), "formats": ((list,), ["png"]), "dpi": ((int,), 150)},
    "output": {"dir": ((str, type(None)), None)},
}
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
    from diffquant.io.options import parse_dtype

    try:
        parse_dtype(recipe["dtype"])
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {err}") from None
    from diffquant.eval.tasks import parse_task
    from diffquant.quant.plan import QuantPlan

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
            value = raw.get(key) or {}
            if not isinstance(value, dict):
                raise DiffquantError(f"{source}: {path}: expected a mapping, got {type(value).__name__}")
            out[key] = _check(value, rule, source, f"{path}.")
            continue
        types, default = rule
        if key not in raw:
            if default is _REQUIRED:
                raise DiffquantError(f"{source}: missing required key '{path}'")
            out[key] = copy.deepcopy(default)
            continue
        value = raw[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise DiffquantError(f"{source}: {path}: expected {names}, got {value!r}")
        out[key] = value
    return out


def read_yaml(path: str | Path, overrides: list[str] | None = None) -> Any:
    """A recipe file's YAML with ``--set`` overrides applied (run and train recipes alike)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise DiffquantError(f"{path}: recipe file not found") from None
    except yaml.YAMLError as err:
        raise DiffquantError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    for item in overrides or []:
        raw = apply_override(raw, item)
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    return validate(read_yaml(path, overrides), source=str(path))


_INDEX = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def apply_override(raw: Any, item: str) -> Any:
    """Set ``a.b[0].c=value`` (value parsed as YAML) in a copy of ``raw``."""
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise DiffquantError(f"--set {item!r}: expected PATH=VALUE")
    raw = copy.deepcopy(raw) if isinstance(raw, dict) else {}
    node: Any = raw
    parts: list[Any] = []
    for part in key.split("."):
        match = _INDEX.match(part)
        if not match:
            raise DiffquantError(f"--set {item!r}: bad path element {part!r}")
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        try:
            if isinstance(part, int):
                node = node[part]
            else:
                if part not in node or node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        except (IndexError, KeyError, TypeError):
            raise DiffquantError(f"--set {item!r}: path {key!r} does not exist in the recipe") from None
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except (IndexError, TypeError):
        raise DiffquantError(f"--set {item!r}: path {key!r} does not exist in the recipe") from None
    return raw


def run_recipe(
    recipe: dict[str, Any],
    out: str | Path | None = None,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Run every stage the recipe names into a run folder; returns the folder."""
    import torch

    from diffquant.data import fingerprint
    from diffquant.io.artifacts import checkpoint_sha256, manifest, write_json_atomic

    out = Path(out or recipe["output"]["dir"] or f"runs/{recipe['name']}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe["seed"])
    present = recipe["_present"]
    clean = {k: v for k, v in recipe.items() if k != "_present"}
    texts = _default_texts(recipe)
    sources = {recipe["data"]["calib"]["source"] or texts["calib"]}
    if "profile" in present and recipe["profile"]["enabled"]:
        sources.add(recipe["profile"]["data"] or texts["profile"])
    for task in recipe["eval"]["tasks"]:
        if isinstance(task, dict) and task.get("type", "bpb") in ("bpb", "ppl"):
            sources.add(task.get("data") or texts["eval"])
    write_json_atomic(
        out / "manifest.json",
        manifest(
            "run",
            recipe=clean,
            seed=recipe["seed"],
            checkpoints={
                name: {"spec": spec, "sha256": checkpoint_sha256(spec)}
                for name, spec in recipe["models"].items()
            },
            corpora={s: fingerprint(s) for s in sorted(sources)},
        ),
    )
    log(f"run {recipe['name']} -> {out}")
    if "profile" in present and recipe["profile"]["enabled"]:
        _stage_profile(recipe, out, progress, log)
    if "quantize" in present and recipe["quantize"]["plans"]:
        _stage_quantize(recipe, out, log)
    if "eval" in present or "sweep" in present:
        _stage_sweep(recipe, out, progress, log)
    figures: list = []
    if recipe["plots"]["enabled"]:
        from diffquant.plots import render_run

        figures = render_run(out, formats=tuple(recipe["plots"]["formats"]), dpi=recipe["plots"]["dpi"])
        log(f"plots: {len(figures)} figures in {out / 'figures'}")
    from diffquant.report import write_report

    md, page = write_report(out, figures=figures)
    log(f"report: {md}, {page}")
    log(f"done: {out}")
    return out


def model_tokenizer_paths(recipe: dict[str, Any]) -> dict[str, str]:
    """The recipe's ``tokenizer`` key as {model name: path} (one path applies to every model)."""
    tokenizer = recipe["tokenizer"]
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, str):
        return dict.fromkeys(recipe["models"], tokenizer)
    return dict(tokenizer)


def _default_texts(recipe: dict[str, Any]) -> dict[str, str]:
    """The texts stages read when the recipe names none, decided by the models' tokenizers."""
    from diffquant.data.tokenizer import ByteTokenizer
    from diffquant.eval.tasks import default_text
    from diffquant.io import peek_tokenizer

    paths = model_tokenizer_paths(recipe)
    tokenizers = [
        peek_tokenizer(spec, paths.get(name)) or ByteTokenizer() for name, spec in recipe["models"].items()
    ]
    return {purpose: default_text(tokenizers, purpose) for purpose in ("calib", "profile", "eval")}


def _load_models(recipe: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    from diffquant.io import load_model
    from diffquant.io.options import parse_device, parse_dtype

    paths = model_tokenizer_paths(recipe)
    device, dtype = parse_device(recipe["device"]), parse_dtype(recipe["dtype"])
    return {
        name: (spec, load_model(spec, device=device, dtype=dtype, tokenizer=paths.get(name)))
        for name, spec in recipe["models"].items()
    }


def _stage_profile(recipe: dict[str, Any], out: Path, progress: bool, log: Callable[[str], None]) -> None:
    from diffquant.profile.runner import profile_stage

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
    from diffquant.quant.run import quantize_checkpoint

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
    from diffquant.eval.sweep import SweepSpec, format_results, run_sweep
    from diffquant.eval.tasks import parse_task

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
