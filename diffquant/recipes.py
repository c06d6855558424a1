"""Recipes: one YAML file that chains the stages (profile -> quantize -> eval / sweep -> plots) into a run.

The schema is strict: an unknown or misspelled key is an error naming its path and the allowed keys, since
a silently ignored key is a silently wrong experiment. ``--set path=value`` overrides any key (the value is
parsed as YAML), e.g. ``--set models.baseline=init:baseline:tiny --set eval.tasks[0].tokens=2048``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffquant.data import fingerprint
from diffquant.data.corpus import iter_documents
from diffquant.errors import DiffquantError
from diffquant.eval.sweep import format_results, run_sweep
from diffquant.eval.tasks import check_kv_cache_windows, default_text, parse_task
from diffquant.io import check_model_spec
from diffquant.io.artifacts import checkpoint_sha256, manifest, read_json, write_json_atomic
from diffquant.io.options import RunOptions, parse_dtype
from diffquant.io.runfolder import claim_run_folder
from diffquant.plots import render_run
from diffquant.quant.plan import QuantPlan
from diffquant.report import seeds, write_report
from diffquant.report.seeds import seed_groups
from diffquant.schema import check, require_plain_name
from diffquant.shipped import resolve as resolve_shipped
from diffquant.stages import Recipe, load_models, parse_run_options, run_profile, run_quantize, sweep_spec
from diffquant.textfiles import apply_override, read_yaml  # noqa: F401 (public here too)

_OPTIONAL_STAGES = ("profile", "quantize", "eval", "sweep", "plots")


def validate(raw: Any, source: str = "recipe") -> dict[str, Any]:
    """The recipe with defaults filled in; raises a one-line DiffquantError naming the bad key's path.

    The schema is :class:`diffquant.stages.Recipe` (one dataclass per stage, shared with the command line)."""
    recipe = check(Recipe, raw, source)
    if not recipe["models"]:  # every stage runs over the models: an empty run would write a hollow folder
        raise DiffquantError(
            f"{source}: models: expected at least one model (name: specifier, e.g. baseline: "
            f"init:baseline:tiny), got {recipe['models']!r}"
        )
    for name in recipe["models"]:  # profile/NAME.json, quantized/NAME--PLAN/: never a path
        require_plain_name(name, source, "models")
    _check_seed_groups(recipe, source)
    tokenizer = recipe["tokenizer"]
    if isinstance(tokenizer, dict):
        for name, path in tokenizer.items():
            if name not in recipe["models"]:
                raise DiffquantError(
                    f"{source}: tokenizer.{name}: expected a model name from 'models' mapped to a tokenizer "
                    f"path, got {name!r}: {path!r}"
                )

    try:
        parse_dtype(recipe["dtype"])
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {err}") from None

    tasks = [
        parse_task(task, where=f"{source}: eval.tasks[{i}]") for i, task in enumerate(recipe["eval"]["tasks"])
    ]
    plans = {}
    for stage in ("quantize", "sweep"):
        for plan in recipe[stage]["plans"]:
            if plan != "none":
                plans[plan] = QuantPlan.load(plan)
    check_kv_cache_windows(plans, tasks, source)  # a kv_cache that no decode window would ever fill
    recipe["_present"] = [s for s in _OPTIONAL_STAGES if s in raw]
    return recipe


def _check_seed_groups(recipe: dict[str, Any], source: str) -> None:
    """The ``seeds`` key as :func:`diffquant.report.seeds.seed_groups` checks it (plain group names, each
    group at least one of the recipe's models, none in two groups), refused before anything runs."""
    try:
        seed_groups(recipe["models"], recipe["seeds"])
    except DiffquantError as err:
        raise DiffquantError(f"{source}: {err}") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """A recipe file, or a shipped one by name (``smollm2``; :func:`diffquant.shipped.resolve`), validated."""
    path = resolve_shipped(path, "run")
    recipe = validate(read_yaml(path, overrides), source=str(path))
    # The description is the recipe's as written: after --set replaced its plans or models it may describe
    # another experiment, so it says what was changed (what the report and the manifest then show).
    changed = list(dict.fromkeys(item.partition("=")[0].strip() for item in overrides or []))
    if changed and "description" not in changed:
        note = f"--set changed {', '.join(changed)}"
        text = str(recipe["description"] or "").strip()
        recipe["description"] = (
            f"{text} ({note}; the description is the recipe's as written)" if text else note
        )
    return recipe


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
    # Everything checkable is checked before the first write: device, dtype, device map (parsed once, here,
    # and passed to every stage), models, tokenizers, window lengths, texts.
    options = parse_run_options(recipe, name=lambda key: key)
    texts = _preflight(recipe)
    sources = {recipe["data"]["calib"]["source"] or texts["calib"]}
    if "profile" in present and recipe["profile"]["enabled"]:
        sources.add(recipe["profile"]["data"] or texts["profile"])
    for task in recipe["eval"]["tasks"]:
        spec = parse_task(task)
        if spec.reads_text:
            sources.add(spec.params["data"] or texts["eval"])
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
    # (stream: how models run, not what they give: a streamed run gives the whole-model numbers)
    identity = {k: v for k, v in clean.items() if k not in ("description", "plots", "output", "stream")}
    with claim_run_folder(out, "run", identity, force=force, inputs=list(recipe["models"].values())):
        torch.manual_seed(recipe["seed"])
        write_json_atomic(out / "manifest.json", record)
        try:
            _run_stages(recipe, options, out, progress, log, record)
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
    writes anything; returns the default texts for the models' tokenizers (the device and dtype:
    :func:`run_recipe` parses them first)."""
    present = recipe["_present"]
    seq_lens = [("data.calib.seq_len", recipe["data"]["calib"]["seq_len"])]
    if "profile" in present and recipe["profile"]["enabled"]:
        seq_lens.append(("profile.seq_len", recipe["profile"]["seq_len"]))
    tasks = (
        [parse_task(t) for t in recipe["eval"]["tasks"]] if ("eval" in present or "sweep" in present) else []
    )
    seq_lens += [(f"task {t.label} seq_len", t.params.get("seq_len")) for t in tasks]
    seed_groups(recipe["models"], recipe["seeds"])  # every member a model, none in two groups
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
        t.preflight()
    return texts


def _run_stages(
    recipe: dict[str, Any],
    options: RunOptions,
    out: Path,
    progress: bool,
    log: Callable[[str], None],
    record: dict[str, Any],
) -> None:
    present = recipe["_present"]
    log(f"run {recipe['name']} -> {out}")
    if "profile" in present and recipe["profile"]["enabled"]:
        streamed = _stage_profile(recipe, options, out, progress, log)
        if streamed:  # the manifest says which profiles have no attention maps (plots skip them)
            record["streamed"] = streamed
    if "quantize" in present and recipe["quantize"]["plans"]:
        _stage_quantize(recipe, options, out, log)
    if "eval" in present or "sweep" in present:
        _stage_sweep(recipe, options, out, progress, log)


def model_tokenizer_paths(recipe: dict[str, Any]) -> dict[str, str]:
    """The recipe's ``tokenizer`` key as {model name: path} (one path applies to every model)."""
    tokenizer = recipe["tokenizer"]
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, str):
        return dict.fromkeys(recipe["models"], tokenizer)
    return dict(tokenizer)


def _load_models(recipe: dict[str, Any], options: RunOptions) -> dict[str, tuple[str, Any]]:
    """The recipe's models; those its ``stream`` key streams as skeletons (see :func:`stages.load_models`)."""
    return load_models(recipe["models"], options, model_tokenizer_paths(recipe), name=lambda key: key)


def _stage_profile(
    recipe: dict[str, Any], options: RunOptions, out: Path, progress: bool, log: Callable[[str], None]
) -> list[str]:
    """Profile the recipe's models; returns the names of those profiled layer-streamed."""
    models = _load_models(recipe, options)
    header, table, _ = run_profile(
        models, recipe["profile"], out, progress=progress, name=_key_name("profile"), options=options
    )
    if header:
        log(header)
        log(table)
        groups = seed_groups(recipe["models"], recipe["seeds"])
        if groups:  # the same view over each group's seeds, and which differences exceed their spread
            profiled = read_json(out / "table5.json")["models"]
            agg = seeds.table5_seeds(profiled, groups)
            comparisons = seeds.table5_comparisons(agg)
            sinks = seeds.sink_rate_seeds(profiled, groups)  # when the profile measured it
            comparisons += seeds.scalar_comparisons(sinks, "attention-sink rate", "% of heads")
            doc = {"groups": groups, "table5": agg, "comparisons": comparisons}
            write_json_atomic(out / "table5_seeds.json", doc | ({"sink_rate": sinks} if sinks else {}))
            log(seeds.format_table5_seeds(agg))
            if sinks:
                log(seeds.format_sink_rate_seeds(sinks))
            for line in seeds.seed_sentences(comparisons, []):
                log(line)
    return [n for n, (_, m) in models.items() if getattr(m, "streamed", None) is not None]


def _key_name(section: str) -> Callable[[str], str]:
    """How a recipe names a stage's key in an error: ``profile.seq_len``."""
    return lambda key: f"{section}.{key}"


def _stage_quantize(
    recipe: dict[str, Any], options: RunOptions, out: Path, log: Callable[[str], None]
) -> None:
    cfg, calib = recipe["quantize"], recipe["data"]["calib"]
    for name, spec in recipe["models"].items():
        for plan in cfg["plans"]:
            target = out / "quantized" / f"{name}--{Path(plan).stem}"
            summary = run_quantize(
                spec,
                plan,
                calib,
                cfg,
                target,
                options,
                force=True,
                tokenizer=model_tokenizer_paths(recipe).get(name),
                name=lambda key: key,
            )
            log(f"quantize {name} with {plan}: model logits SQNR {summary['logits_sqnr_db']} dB -> {target}")


def recipe_sweep_spec(recipe: dict[str, Any], options: RunOptions | None = None) -> Any:
    """The SweepSpec of a validated recipe's sweep stage: its models, plans, eval tasks, calibration data,
    batch size and tokenizers (what ``diffquant run`` sweeps; tests shrink a recipe and build the same), on
    the run's parsed ``options`` (parsed from the recipe here when not given)."""
    return sweep_spec(
        recipe["models"],
        recipe["sweep"]["plans"],
        [parse_task(t) for t in recipe["eval"]["tasks"]],
        recipe["data"]["calib"],
        recipe["eval"]["batch_size"],
        recipe,
        model_tokenizer_paths(recipe),
        options or parse_run_options(recipe, name=lambda key: key),
    )


def _stage_sweep(
    recipe: dict[str, Any], options: RunOptions, out: Path, progress: bool, log: Callable[[str], None]
) -> None:
    spec = recipe_sweep_spec(recipe, options)
    results = run_sweep(spec, out / "sweep", progress=progress, log=log)
    if results is not None:
        log(format_results(spec, results))
        groups = seed_groups(recipe["models"], recipe["seeds"])
        if groups:
            rows = seeds.sweep_seeds(results, groups)
            comparisons = seeds.sweep_comparisons(rows)
            write_json_atomic(
                out / "sweep" / "results_seeds.json",
                {"groups": groups, "rows": rows, "comparisons": comparisons},
            )
            log(seeds.format_sweep_seeds(rows))
            for line in seeds.seed_sentences([], comparisons):
                log(line)
