"""The ``diffquant`` command line.

User errors (a :class:`DiffquantError`) print one line on stderr and exit with code 2; heavy imports
happen inside the commands so ``diffquant --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Sequence
from typing import NoReturn

from diffquant import __version__
from diffquant.cli_options import add_model_options as _add_model_options
from diffquant.cli_options import load_for_args as _load
from diffquant.cli_options import run_options_for
from diffquant.errors import DiffquantError
from diffquant.models.config import ATTENTION_KINDS
from diffquant.models.config import PRESETS as SIZE_PRESETS  # model sizes (not quant.plan.PRESETS)
from diffquant.names import MODEL_FORMS, plain_name_from
from diffquant.schema import Extend


def _cmd_info(args: argparse.Namespace) -> int:
    from diffquant.models.taps import SITE_KINDS
    from diffquant.stream import stream_skeleton

    options = run_options_for(args)  # --device / --dtype, parsed once
    try:
        # A streamable checkpoint is described from its config and headers on the meta device (checked as
        # a load would check them): `info` must answer for a model larger than memory (that is when its
        # "would stream" line matters).
        model = stream_skeleton(args.checkpoint, args.tokenizer)
    except DiffquantError:
        # other forms load whole (or give the loader's own error)
        model = _load(args, args.checkpoint, options)
    cfg = model.config
    groups = model.parameter_groups()
    per_kind = Counter(model.sites().values())
    sites = {k: per_kind[k] for k in SITE_KINDS if per_kind[k]}
    from diffquant.kernels.dispatch import planned_paths

    tokenizer = _tokenizer_line(model, args.checkpoint)
    from diffquant.stream import weights_bytes, would_stream

    device = options.device
    streams, size, reason = would_stream(args.checkpoint, device)  # size: in memory (GGUF dequantized)
    on_disk = weights_bytes(args.checkpoint)
    if args.json:
        plan = getattr(model, "quant_plan", None)
        info = {
            "checkpoint": str(args.checkpoint),
            "tokenizer": tokenizer,
            "quant_plan": None if plan is None else plan.to_dict(),
            "config": cfg.to_dict(),
            "parameters": {**groups, "total": sum(groups.values())},
            "weights_bytes": size,
            "weights_file_bytes": on_disk,
            "stream": {"device": str(device), "would_stream": streams, "reason": reason},
            "sites": {**sites, "total": sum(sites.values())},
            "attention_paths": {
                "cuda": planned_paths(model, cuda=True),
                "cpu": planned_paths(model, cuda=False),
            },
        }
        print(json.dumps(info, indent=2))
        return 0
    total = sum(groups.values())
    print(f"checkpoint   {args.checkpoint}")
    print(f"attention    {cfg.attention}")
    print("config       " + " ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if k != "attention"))
    heads = f"{cfg.n_heads} output heads, {cfg.n_q_heads} query heads of width {cfg.head_dim}, "
    heads += f"{cfg.n_kv_heads} kv heads, value width {cfg.value_dim}"
    print(f"heads        {heads}")
    print(f"tokenizer    {tokenizer}")
    print(f"parameters   {total:,}")
    for name, count in groups.items():
        if count:
            print(f"  {name:<11}{count:>12,}  {100 * count / total:5.1f} %")
    stored = f"; {on_disk / 2**20:.1f} MiB in the file" if on_disk != size else ""
    print(f"weights      {size:,} bytes ({size / 2**20:.1f} MiB{stored})")
    reason = reason.removesuffix(": streamed")
    print(f"stream       --stream auto on {device}: {'streamed' if streams else 'whole'} ({reason})")
    print(f"sites        {sum(sites.values())} ({', '.join(f'{k} {n}' for k, n in sites.items())})")
    from diffquant.kernels.dispatch import planned_paths

    cuda = ", ".join(f"{k} {n}" for k, n in planned_paths(model, cuda=True).items())
    cpu = ", ".join(f"{k} {n}" for k, n in planned_paths(model, cuda=False).items())
    print(f"attention    layers per path: on CUDA {cuda}; on CPU {cpu}")
    plan = getattr(model, "quant_plan", None)
    if plan is not None:
        print(f"quantized    plan {plan.name}: {plan.description or 'custom'}")
        for rule in plan.rules:
            targets = ", ".join(rule.sites + rule.modules)
            print(f"  {rule.scheme.label():<22}{rule.scheme.calibration:<10} {targets}")
        if plan.backend is not None:
            print(f"  backend {plan.backend.name}: {plan.backend.to_dict()}")
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from safetensors import SafetensorError

    from diffquant.io import init_model, save_checkpoint
    from diffquant.io.runfolder import claim_checkpoint_folder
    from diffquant.names import WEIGHTS_FILE
    from diffquant.schema import FlagStyle, check_value, fields_of
    from diffquant.stages import Recipe

    # The seed is bounded as a recipe's is (its field's metadata: an integer in [0, 2**63 - 1]).
    seed = next(f for f, _ in fields_of(Recipe) if f.name == "seed")
    check_value(args.seed, int, seed.metadata, "", "seed", FlagStyle())
    model = init_model(f"init:{args.kind}:{args.preset}:{args.seed}")
    try:
        with claim_checkpoint_folder(args.out, args.force):  # one writer per output folder
            save_checkpoint(model, args.out, overwrite=True)
    except SafetensorError as err:  # a full disk while writing the weights: safetensors' own error type
        reason = str(err).rpartition("I/O error: ")[2] or str(err)
        raise DiffquantError(f"{Path(args.out) / WEIGHTS_FILE}: {reason} (nothing was written)") from None
    except OSError as err:
        if err.filename:  # names its file already (the one-line OSError handler of main says it)
            raise
        raise DiffquantError(
            f"{args.out}: {err.strerror or err} while writing the checkpoint (nothing was written)"
        ) from None
    print(
        f"wrote {args.out}: {args.kind} ({args.preset}), {model.num_parameters():,} parameters, seed {args.seed}"
    )
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffquant.distributed import init_from_env, shutdown
    from diffquant.io.options import ModelOptions
    from diffquant.io.runfolder import claim_run_folder
    from diffquant.profile.runner import check_profile
    from diffquant.schema import check_args
    from diffquant.stages import ProfileStage, load_models, parse_run_options

    _, world = init_from_env()
    try:
        cfg = check_args(ProfileStage, args)
        env = check_args(ModelOptions, args)
        specs: dict = {}
        for spec in args.checkpoints:
            specs[_unique_name(spec, specs)] = spec
        tokenizers = dict.fromkeys(specs, args.tokenizer) if args.tokenizer is not None else {}
        options = parse_run_options(env)  # --device, --dtype, --stream, --device-map: parsed once, here
        models = load_models(specs, options, tokenizers)
        out = Path(args.out)
        identity = {
            "checkpoints": {n: str(s) for n, (s, _) in models.items()},
            **{k: cfg[k] for k in ("data", "tokens", "seq_len", "batch_size", "sites", "topk")},
            "no_attention_metrics": not cfg["attention_metrics"],
            **{k: getattr(args, k) for k in ("device", "dtype", "tokenizer")},
        }
        check_profile(models, cfg["seq_len"], cfg["data"], cfg["sites"])  # before the folder is claimed
        inputs = [s for s, _ in models.values()]
        with claim_run_folder(out, "profile", identity, force=args.force, inputs=inputs):
            return _profile_into(args, cfg, models, out, world, options)
    finally:
        shutdown()


def _profile_into(args: argparse.Namespace, cfg: dict, models: dict, out, world: int, options) -> int:
    """Profile into a claimed run folder (the recipes' profile stage) with the command's parsed ``options``;
    the manifest is written last, once the profiles exist."""
    from diffquant.data import fingerprint
    from diffquant.io.artifacts import checkpoint_sha256, manifest, write_json_atomic
    from diffquant.stages import run_profile

    header, text, n_tokens = run_profile(models, cfg, out, progress=sys.stderr.isatty(), options=options)
    if not header:  # not rank 0
        return 0
    data = header.rsplit(" from ", 1)[1]
    streamed = [n for n, (_, m) in models.items() if getattr(m, "streamed", None) is not None]
    write_json_atomic(
        out / "manifest.json",
        manifest(
            "profile",
            checkpoints={
                n: {
                    "spec": str(s),
                    "sha256": checkpoint_sha256(s),
                    "tokenizer": m.tokenizer.name if m.tokenizer else "byte",
                }
                for n, (s, m) in models.items()
            },
            data={"source": data, "fingerprint": fingerprint(data), "tokens": n_tokens},
            device=args.device,
            dtype=args.dtype,
            seq_len=cfg["seq_len"],
            batch_size=cfg["batch_size"],
            sites=cfg["sites"],
            topk=cfg["topk"],
            world_size=world,
            **({"streamed": streamed} if streamed else {}),
        ),
    )
    print(header)
    print(text)
    print(f"wrote {out}/profile/*.json, table5.txt, table5.json, manifest.json")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from diffquant.schema import check_args
    from diffquant.stages import (
        QUANTIZE_CALIB_FLAGS,
        CalibData,
        QuantizeStage,
        parse_run_options,
        run_quantize,
    )

    calib = check_args(CalibData, args, flags=QUANTIZE_CALIB_FLAGS)
    cfg = check_args(QuantizeStage, args)
    options = parse_run_options({"device": args.device, "dtype": args.dtype, "stream": args.stream})
    _refuse_overwriting_input(args.checkpoint, args.out)
    summary = run_quantize(
        args.checkpoint, args.plan, calib, cfg, args.out, options, force=args.force, tokenizer=args.tokenizer
    )
    print(f"{summary['text']}; peak memory {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffquant.distributed import init_from_env, shutdown
    from diffquant.eval.sweep import format_results, run_sweep
    from diffquant.eval.tasks import check_kv_cache_windows, parse_task
    from diffquant.quant.plan import QuantPlan
    from diffquant.schema import check_args
    from diffquant.stages import CALIB_FLAGS, CalibData, EvalStage, parse_run_options, sweep_spec

    init_from_env()
    try:
        calib = check_args(CalibData, args, flags=CALIB_FLAGS)
        batch_size = check_args(EvalStage, args)["batch_size"]
        models: dict = {}
        for spec in args.models:
            models[_unique_name(spec, models)] = spec
        tasks = [parse_task(t, where=f"--task {t!r}") for t in args.task]
        for task in tasks:  # what a task refuses (its files, lm-eval task code) before the folder is claimed
            task.preflight()
        plans = {p: QuantPlan.load(p) for p in args.plan if p != "none"}
        check_kv_cache_windows(plans, tasks)  # a kv_cache no decode window would fill: refused now
        if args.tokenizer is not None:  # refused (a bad or empty path) before the run folder is claimed
            from diffquant.data import load_tokenizer

            load_tokenizer(args.tokenizer)
        env = {k: getattr(args, k) for k in ("device", "dtype", "stream", "device_map", "max_memory")}
        spec = sweep_spec(
            models,
            args.plan,
            tasks,
            calib,
            batch_size,
            env,
            {name: args.tokenizer for name in models} if args.tokenizer is not None else {},
            parse_run_options(env),  # --device, --dtype, --stream, --device-map: parsed once, here
        )
        out = Path(args.out)
        results = run_sweep(
            spec, out, progress=sys.stderr.isatty(), log=lambda m: print(m, file=sys.stderr), force=args.force
        )
        if results is None:
            return 0
        print(format_results(spec, results))
        print(f"wrote {out}/results.csv, results.json, timing.csv (cells in {out}/cells-rank*.jsonl)")
        return 0
    finally:
        shutdown()


def _cmd_run(args: argparse.Namespace) -> int:
    from diffquant.distributed import init_from_env, shutdown
    from diffquant.recipes import load_recipe, run_recipe

    rank, _ = init_from_env()
    try:
        recipe = load_recipe(args.recipe, args.set)
        log = print if rank == 0 else (lambda message: None)
        run_recipe(recipe, args.out, progress=sys.stderr.isatty(), log=log, force=args.force)
        return 0
    finally:
        shutdown()


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffquant.plots import render_run

    what = [w for item in args.what for w in item.split(",")] if args.what else None
    records = render_run(
        Path(args.run_dir),
        what=what,
        formats=tuple(args.format),
        dpi=args.dpi,
        layer=args.layer,
        head=args.head,
        linear=args.linear,
        layers=args.layers,
    )
    if not records:
        raise DiffquantError(f"{args.run_dir}: no figure could be drawn from its artifacts")
    for record in records:
        print(f"{record.name:<28} {', '.join(str(p) for p in record.paths)}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffquant.io.artifacts import read_json
    from diffquant.report import run_status, write_report

    md, page = write_report(args.run_dir, dpi=args.dpi)
    manifest = Path(args.run_dir) / "manifest.json"
    status = run_status(read_json(manifest)) if manifest.is_file() else None
    if status is not None:
        print(f"diffquant report: warning: {args.run_dir} is an incomplete run ({status})", file=sys.stderr)
    print(f"wrote {md} and {page}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from diffquant.io.runfolder import lock_folder
    from diffquant.shipped import resolve
    from diffquant.textfiles import MAX_YAML_BYTES, read_text_bounded
    from diffquant.train.trainer import TrainConfig, train

    recipe = resolve(args.recipe, "train")  # a file, or a shipped training recipe by name
    cfg = TrainConfig.load(recipe, args.set)
    if args.out:
        cfg.out = args.out
    with lock_folder(cfg.out_folder):  # one writer per output folder (runs/train/NAME by default)
        train(
            cfg,
            resume=args.resume,
            stop_after=args.stop_after,
            recipe_text=read_text_bounded(recipe, MAX_YAML_BYTES, "recipe"),
            overrides=list(args.set or []),
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from diffquant.recipes import load_recipe, run_recipe
    from diffquant.zoo import ZOO_DIR

    start = time.perf_counter()
    recipe = load_recipe(ZOO_DIR / "demo.yaml")
    out = run_recipe(recipe, args.out, progress=sys.stderr.isatty())
    print(f"demo finished in {time.perf_counter() - start:.0f} s; open {Path(out) / 'report.html'}")
    return 0


def _cmd_zoo(args: argparse.Namespace) -> int:
    from diffquant.zoo import card, zoo_names

    names = zoo_names()
    if not names:
        raise DiffquantError("no zoo models are shipped with this installation")
    rows = []
    for name in names:
        c = card(name)
        cfg = c["config"]
        variant = {"gated": cfg.get("gate"), "sink": cfg.get("sink")}.get(c["kind"])
        attention = f"{c['kind']} ({variant})" if variant else c["kind"]
        rows.append(
            (
                f"zoo:{name}",
                attention,
                str(c["seed"]),
                f"{c['parameters']:,}",
                f"{c['tokens']:,}",
                f"{c['train_bpb']:.3f}",
                f"{c['val_bpb']:.3f}",
                f"{c['retrieval']['acc_rank']:.2f}",
            )
        )
    header = ("model", "attention", "seed", "params", "tokens", "train bpb", "val bpb", "retrieval")
    # Columns as wide as their longest entry: names grow with seeds and variants (zoo:baseline-s1, gated (headwise)).
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        left = "  ".join(f"{v:<{w}}" for v, w in zip(r[:2], widths[:2], strict=True))
        right = "".join(f"{v:>{w + 2}}" for v, w in zip(r[2:], widths[2:], strict=True))
        print(left + right)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from diffquant.io import save_checkpoint
    from diffquant.io.convert_hf import export_hf, hf_model_type
    from diffquant.io.runfolder import claim_checkpoint_folder

    if args.scale_dtype is not None and args.to not in ("compressed-tensors", "gptq"):
        raise DiffquantError(f"--scale-dtype: only with --to compressed-tensors or gptq, not --to {args.to}")
    _refuse_overwriting_input(args.model, args.out)
    model = _load(args, args.model)
    if args.to in ("compressed-tensors", "gptq"):
        return _export_quantized(args, model)
    with claim_checkpoint_folder(args.out, args.force):  # one writer per output folder
        if args.to == "native":
            out = save_checkpoint(model, args.out, overwrite=True)
            target = "native"
        else:
            out = export_hf(model, args.out, overwrite=True)
            target = "HF " + hf_model_type(
                model.config
            )  # llama, diffllama, qwen2, qwen3, mistral, gemma3_text
    print(
        f"wrote {out}: {target} ({model.config.attention}), {model.num_parameters():,} parameters, "
        f"{str(model.embed.weight.dtype).removeprefix('torch.')}, tokenizer {_tokenizer_line(model, args.model)}"
    )
    return 0


def _export_quantized(args: argparse.Namespace, model) -> int:
    """``export --to compressed-tensors / gptq``: a weight-quantized model's codes packed for other tools."""
    from diffquant.io.export_quant import export_quantized, folder_bytes
    from diffquant.io.runfolder import claim_checkpoint_folder

    with claim_checkpoint_folder(args.out, args.force):
        res = export_quantized(model, args.out, args.to, scale_dtype=args.scale_dtype, overwrite=True)
    group = "per channel" if res.group_size is None else f"groups of {res.group_size}"
    if res.group_size != res.plan_group_size:
        group += f" (the plan's {res.plan_group_size}, each scale repeated: a width it does not divide)"
    print(
        f"wrote {res.path}: {res.to}, int{res.bits} {'sym' if res.sym else 'asym'} in {group}, "
        f"{res.linears} Linears packed, scales {res.scale_dtype}, {folder_bytes(res.path) / 2**20:.1f} MiB"
    )
    return 0


def _unique_name(spec: str, taken: dict) -> str:
    """The name a model given on the command line is known by (its profile/NAME.json, its rows): made
    from the specifier, as a plain name (:func:`diffquant.names.plain_name_from`: a specifier like
    ``hf:..`` or ``fetch:../x`` never names a path), numbered when two models would share one."""
    text = str(spec)
    scheme, _, rest = text.partition(":")
    if scheme == "init":  # init:KIND:PRESET[:SEED] -> KIND-PRESET
        base = "-".join(text.split(":")[1:3])
    elif scheme in ("zoo", "fetch"):  # zoo:NAME, fetch:NAME -> NAME
        base = rest
    else:  # a folder or file, with or without hf: / gguf: / unilm: -> its name (a file without suffix)
        from diffquant.io.artifacts import spec_path

        path = spec_path(text.rstrip("/"))
        base = (path.stem if path.suffix == ".gguf" else path.name) or "model"
    base = plain_name_from(base)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


def _refuse_overwriting_input(spec: str, out: str) -> None:
    """--force replaces the output folder; it must never be the model being read (or hold it)."""
    from pathlib import Path

    from diffquant.io.artifacts import spec_path

    source = spec_path(spec).expanduser().resolve()
    target = Path(out).expanduser().resolve()
    if source == target or target in source.parents:
        raise DiffquantError(f"{out}: is the model being read ({spec}); write the output elsewhere")


def _tokenizer_line(model, spec: str) -> str:
    """What ``info`` says about the tokenizer: the one every stage will use, or why there is none."""
    from diffquant.data import model_tokenizer

    try:
        return model_tokenizer(model, str(spec)).describe()
    except DiffquantError as err:
        # a tokenizer the model brings (or --tokenizer names) but every stage would refuse is not "none"
        return f"{'unusable' if getattr(model, 'tokenizer', None) is not None else 'none'} ({err})"


def _cmd_presets(args: argparse.Namespace) -> int:
    from diffquant.quant.plan import PRESETS, preset

    width = max(len(p) for p in PRESETS)
    for name in PRESETS:
        print(f"{name:<{width}}  {preset(name).description}")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from diffquant.shipped import shipped

    heads = {
        "run": "recipes (diffquant run NAME)",
        "train": "training recipes (diffquant train NAME)",
        "plan": "plans (--plan NAME)",
        "lmeval": "lm-eval tasks (--task lmeval:tasks=NAME)",
    }
    files = shipped()
    width = max(len(f.name) for f in files)
    for kind, head in heads.items():
        print(f"{head}:")
        for f in (f for f in files if f.kind == kind):
            print(f"  {f.name:<{width}}  {f.description}")
    return 0


def _task_help() -> str:
    """The --task help: every task type with its keys, from the task registry itself (so it cannot drift)."""
    from diffquant.eval.task_params import TASK_TYPE_PARAMS  # torch-free (the runners are not imported)
    from diffquant.schema import fields_of, is_required

    types = "; ".join(
        f"{name} ({', '.join(f.name + (' [required]' if is_required(f) else '') for f, _ in fields_of(params))})"
        for name, params in TASK_TYPE_PARAMS.items()
    )
    return (
        "a task TYPE or TYPE:key=value,key=value (repeatable), e.g. ppl:data=wikitext2:test,seq_len=1024; "
        f"types and their keys: {types}. Text tasks default seq_len to the context the model was trained at "
        "(from its card) or min(max_seq_len, 2048)"
    )


def build_parser() -> argparse.ArgumentParser:
    from diffquant.options import (  # torch-free: --help must stay instant
        CALIB_FLAGS,
        QUANTIZE_CALIB_FLAGS,
        CalibData,
        EvalStage,
        ProfileStage,
        QuantizeStage,
    )
    from diffquant.schema import add_options
    from diffquant.shipped import shipped_names

    parser = _Parser(
        prog="diffquant",
        description="Quantization and activation-outlier analysis of Differential Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"diffquant {__version__}")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress output on stderr (bars, periodic lines); also DIFFQUANT_QUIET=1",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="show a checkpoint's config, parameter counts and probe sites")
    info.add_argument(
        "checkpoint",
        help=f"the model: {MODEL_FORMS}",
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_model_options(info)
    info.set_defaults(func=_cmd_info)

    init = sub.add_parser("init", help="write a randomly initialised checkpoint (to try every command)")
    init.add_argument("out", help="output folder")
    init.add_argument(
        "--kind", choices=ATTENTION_KINDS, default="baseline", help="attention kind (default: baseline)"
    )
    init.add_argument(
        "--preset", choices=tuple(SIZE_PRESETS), default="tiny", help="model size preset (default: tiny)"
    )
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    init.add_argument("--force", action="store_true", help="replace an existing folder")
    init.set_defaults(func=_cmd_init)

    prof = sub.add_parser(
        "profile",
        help="outlier statistics of one or more checkpoints (the DIFF paper's Table 5 and more)",
        description="Profile activations at every site; prints the Table-5 view side by side and writes "
        "the full per-site profile as JSON. Runs sharded under torchrun --nproc_per_node N.",
    )
    prof.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help=f"one or more models, each {MODEL_FORMS}",
    )
    add_options(prof, ProfileStage)
    prof.add_argument("--out", default="runs/profile", help="run folder (default: runs/profile)")
    prof.add_argument("--force", action="store_true", help="start clean in a folder of another run")
    _add_model_options(prof, stream=True, device_map=True)
    prof.set_defaults(func=_cmd_profile)

    quant = sub.add_parser(
        "quantize",
        help="apply a quantization plan (preset or YAML) and write a quantized checkpoint",
        description="Fake-quantize sites and weights, or swap Linears for optimum-quanto / bitsandbytes "
        "layers; calibrate static scales; report the error per site against the unquantized model.",
    )
    quant.add_argument("checkpoint", help=f"the unquantized model: {MODEL_FORMS}")
    quant.add_argument(
        "--plan",
        required=True,
        action=_OnePlan,
        help="a preset name (list them with `diffquant presets`), a YAML plan file or a shipped plan by name "
        "(list them with `diffquant recipes`); one per run (to compare plans: diffquant eval --plan A B)",
    )
    add_options(quant, CalibData, flags=QUANTIZE_CALIB_FLAGS)
    add_options(quant, QuantizeStage)
    quant.add_argument("--out", required=True, help="output folder")
    quant.add_argument("--force", action="store_true", help="replace an existing output folder")
    _add_model_options(quant, stream=True)
    quant.set_defaults(func=_cmd_quantize)

    ev = sub.add_parser(
        "eval",
        help="evaluate models (optionally under quantization plans) on tasks: a resumable sweep",
        description="Runs every model x plan x task cell (plan 'none' = unquantized is always included), "
        "appending finished cells so a killed run resumes; prints the primary metric and its change.",
    )
    ev.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help=f"one or more models, each {MODEL_FORMS}",
    )
    ev.add_argument(
        "--task",
        action="append",
        required=True,
        help=_task_help(),
    )
    ev.add_argument(
        "--plan",
        nargs="+",
        action=Extend,
        default=["none"],
        help="plans: none, preset names, YAML files or shipped plan names; --plan a b and --plan a --plan b "
        "alike (default: none, the unquantized model, which is always included)",
    )
    add_options(ev, CalibData, flags=CALIB_FLAGS)
    add_options(ev, EvalStage)
    ev.add_argument("--out", default="runs/eval", help="run folder (default: runs/eval); resumes if present")
    ev.add_argument("--force", action="store_true", help="start clean in a folder of another run")
    _add_model_options(ev, stream=True, device_map=True)
    ev.set_defaults(func=_cmd_eval)

    run = sub.add_parser(
        "run",
        help="run a YAML recipe (profile, quantize, eval, sweep) into a run folder",
        description="Run a recipe: one YAML file that chains the stages (profile -> quantize -> eval / sweep "
        "-> plots -> report) over its models into one run folder (a killed sweep resumes from its finished "
        "cells). Its keys are documented in docs/recipes.md. Shipped recipes (by name): "
        f"{', '.join(shipped_names('run'))}; `diffquant recipes` describes them.",
    )
    run.add_argument("recipe", help="a recipe file, or a shipped recipe's name (e.g. paper-fig8)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a recipe key, repeatable, e.g. --set models.baseline=init:baseline:tiny (default: none)",
    )
    run.add_argument("--out", default=None, help="run folder (default: the recipe's output.dir)")
    run.add_argument("--force", action="store_true", help="start clean in a folder of another run")
    run.set_defaults(func=_cmd_run)

    plot = sub.add_parser("plot", help="draw the figures of a run folder (from its artifacts only)")
    plot.add_argument("run_dir", help="a run folder written by profile / eval / run")
    plot.add_argument(
        "--what",
        nargs="+",
        action=Extend,
        help="figure families: hist, hist-layers, layerwise, maps, degradation, act-scales, lambda",
    )
    plot.add_argument(
        "--format",
        nargs="+",
        action=Extend,
        default=["png"],
        choices=("png", "svg", "pdf"),
        help="image formats, each figure written once per format (default: png)",
    )
    plot.add_argument(
        "--dpi", type=int, default=150, help="raster resolution; a PNG is figsize x dpi pixels (default: 150)"
    )
    plot.add_argument(
        "--layer",
        type=int,
        default=None,
        help="layer of the attention-map figure (default: the middle layer that every model's profile has)",
    )
    plot.add_argument("--head", type=int, default=0, help="head of the attention-map figure (default: 0)")
    plot.add_argument(
        "--layers",
        default=None,
        metavar="LIST",
        help="layers of the per-layer figures (hist-layers, layerwise, lambda): numbers and ranges, e.g. 3-5 "
        "or 0,4,8-11 (default: every layer)",
    )
    plot.add_argument(
        "--linear",
        default=None,
        metavar="NAME",
        help="the Linear of the act-scales figure, e.g. layers.11.mlp.down (default: the Linear whose input "
        "has the largest act scale in any profile)",
    )
    plot.set_defaults(func=_cmd_plot)

    report = sub.add_parser(
        "report", help="write report.md and a self-contained report.html for a run folder"
    )
    report.add_argument("run_dir")
    report.add_argument("--dpi", type=int, default=150)
    report.set_defaults(func=_cmd_report)

    tr = sub.add_parser(
        "train",
        help="train a model from a training recipe (e.g. zoo-diff_v2)",
        description="Train a model from a training recipe (its keys: diffquant.train.TrainConfig, documented "
        "in docs/recipes.md), checkpointing into a run folder that --resume continues. Its kind: one of "
        f"{', '.join(ATTENTION_KINDS)} (a variant through its model mapping, e.g. --set kind=gated --set "
        "model.gate=headwise). Shipped training "
        f"recipes (by name): {', '.join(shipped_names('train'))}.",
    )
    tr.add_argument("recipe", help="a training recipe file, or a shipped one's name (e.g. zoo-diff_v2)")
    tr.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    tr.add_argument("--stop-after", type=int, default=None, help="stop after this step (schedule unchanged)")
    tr.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a recipe key, repeatable, e.g. --set steps=100 (default: none)",
    )
    tr.add_argument("--out", default=None, help="run folder (default: the recipe's out or runs/train/NAME)")
    tr.set_defaults(func=_cmd_train)

    demo = sub.add_parser(
        "demo", help="the whole study on the zoo: Table 5, quantization sweep, retrieval, figures, report"
    )
    demo.add_argument("--out", default="runs/demo", help="run folder (default: runs/demo)")
    demo.set_defaults(func=_cmd_demo)

    zoo = sub.add_parser("zoo", help="list the zoo models with their cards")
    zoo.set_defaults(func=_cmd_zoo)

    export = sub.add_parser(
        "export",
        help="write a model as a Hugging Face folder (diff_v1 -> diffllama; baseline -> llama, or qwen2 / qwen3 "
        "/ mistral / gemma3_text when its config needs that family), or a weight-quantized one as "
        "compressed-tensors / GPTQ (docs/checkpoints.md)",
    )
    export.add_argument("model", metavar="MODEL", help=f"the model: {MODEL_FORMS}")
    export.add_argument(
        "--to",
        required=True,
        choices=("hf", "native", "compressed-tensors", "gptq"),
        help="target format: a HF folder, a native one, or a quantized checkpoint's codes packed for vLLM / "
        "transformers (compressed-tensors) or GPTQ loaders (gptq)",
    )
    export.add_argument(
        "--scale-dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="dtype of the scales in a compressed-tensors / gptq export (default: float32 for "
        "compressed-tensors, the scales diffquant computed with; float16 for gptq, the format's own)",
    )
    export.add_argument("out", metavar="OUT", help="output folder")
    export.add_argument("--force", action="store_true", help="replace an existing output folder")
    _add_model_options(export)
    export.set_defaults(func=_cmd_export)

    from diffquant.act_scales_cli import add_parser as add_act_scales_parser
    from diffquant.io.fetch import add_fetch_parser

    add_fetch_parser(sub)
    add_act_scales_parser(sub)

    presets = sub.add_parser("presets", help="list the quantization plan presets")
    presets.set_defaults(func=_cmd_presets)

    recipes = sub.add_parser(
        "recipes",
        help="list the shipped recipes, training recipes, plans and lm-eval tasks, one line each",
        description="The YAML files installed with diffquant, each usable by name from any folder: "
        "`diffquant run NAME`, `diffquant train NAME`, `--plan NAME`, `--task lmeval:tasks=NAME`.",
    )
    recipes.set_defaults(func=_cmd_recipes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point (``diffquant``): :func:`_main`, with a library that cannot even be loaded
    for lack of memory (``ulimit -v``: torch's shared libraries do not map) said in one line, exit code 2,
    wherever the import happens (a command's own imports, or before the command is known)."""
    try:
        return _main(argv)
    except (ImportError, MemoryError) as err:
        if not _import_out_of_memory(err):
            raise
        return _fail("", _import_oom_message(err))


def _import_out_of_memory(err: BaseException) -> bool:
    """A MemoryError, or an ImportError whose shared library could not be mapped (the dynamic loader's
    "failed to map segment" / "cannot allocate memory": an address-space limit, not a missing package)."""
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return any(w in text for w in ("failed to map segment", "cannot allocate memory", "out of memory"))


def _import_oom_message(err: BaseException) -> str:
    return (
        f"cannot load its libraries: out of memory ({_first_line(err)}); the process's memory or "
        "address-space limit (ulimit -v, a cgroup) is too small for diffquant and torch: raise it"
    )


def _main(argv: Sequence[str] | None = None) -> int:
    # Passive OpenMP threads unless the user chose: torch's busy-waiting (active) default burns the cores
    # that the other threads (or other processes) need between parallel regions. libgomp reads this once,
    # when torch is first imported, so it must be set first (build_parser imports torch).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    _route_warnings()
    if args.command is None:
        parser.print_help()
        return 0
    from diffquant.progress import quiet

    with quiet(args.quiet):  # --quiet: no progress output, here and in the workers this run starts
        # One handler for every expected failure: a user error, the file system refusing (read-only disk, full
        # disk, --out under a file), undecodable input, a closed pipe, Ctrl-C. Anything else is a bug and keeps
        # its traceback.
        try:
            return args.func(args)
        except DiffquantError as err:
            return _fail(args.command, str(err))
        except ImportError as err:  # torch's libraries not mapped under a small ulimit -v: not a bug
            if not _import_out_of_memory(err):
                raise
            return _fail(args.command, _import_oom_message(err))
        except (MemoryError, RuntimeError) as err:
            # An allocation the machine (or its ulimit / cgroup) refuses is the input's size, not a bug.
            if not _out_of_memory(err):
                raise
            return _fail(args.command, f"out of memory ({_first_line(err)}); {_OOM_HINT}")
        except BrokenPipeError:
            # `diffquant zoo | head -1`: the reader left; point stdout at /dev/null so the final flush is quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            return _fail(args.command, f"{where}{err.strerror or err}")
        except UnicodeDecodeError as err:
            return _fail(args.command, f"input is not UTF-8 text (byte {err.start}: {err.reason})")
        except KeyboardInterrupt:
            print("diffquant: interrupted", file=sys.stderr)
            return 130


class _StderrLine(logging.Handler):
    """Library warnings (a non-UTF-8 text file, ...) as one line each on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"diffquant: warning: {' '.join(record.getMessage().split())}", file=sys.stderr)


def _route_warnings() -> None:
    logger = logging.getLogger("diffquant")
    if not any(isinstance(h, _StderrLine) for h in logger.handlers):
        logger.addHandler(_StderrLine(logging.WARNING))
        logger.propagate = False


_OOM_HINT = "smaller --batch-size or --seq-len, or --stream on to hold one decoder layer at a time"


def _out_of_memory(err: BaseException) -> bool:
    """MemoryError, torch.OutOfMemoryError (CUDA) or the CPU allocator's refusal (a RuntimeError)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _first_line(err: BaseException) -> str:
    """The allocator's own sentence (torch's CPU message starts with an "[enforce fail at ...]" location)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text[text.index("can't allocate") :] if "can't allocate" in text else text


def _fail(command: str, message: str) -> int:
    prog = f"diffquant {command}" if command else "diffquant"
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


class _OnePlan(argparse.Action):
    """``quantize --plan``: one plan per run. A second ``--plan`` is refused in one line (argparse would keep
    the last and drop the first without a word; the run would look complete)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        current = getattr(namespace, self.dest, None)
        if current is not None:
            parser.error(
                f"{option_string} given twice ({current!r}, {values!r}): a quantized checkpoint holds one "
                "plan; quantize once per plan, or compare plans with diffquant eval MODEL --plan A B"
            )
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a usage error in one line and exit code 2 like every other user error
    (argparse prints its whole usage block first: 2 to 12 lines for ``presets foo``, ``init --kind x``);
    the line points at ``--help``. Subparsers are made of this class too (argparse's parser_class)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


if __name__ == "__main__":
    sys.exit(main())
