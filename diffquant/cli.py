"""The ``diffquant`` command line.

User errors (a :class:`DiffquantError`) print one line on stderr and exit with code 2; heavy imports
happen inside the commands so ``diffquant --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence

from diffquant import __version__
from diffquant.errors import DiffquantError


def _cmd_info(args: argparse.Namespace) -> int:
    from diffquant.io import load_model
    from diffquant.models.taps import SITE_KINDS

    model = load_model(args.checkpoint)
    cfg = model.config
    groups = model.parameter_groups()
    per_kind = Counter(model.sites().values())
    sites = {k: per_kind[k] for k in SITE_KINDS if per_kind[k]}
    if args.json:
        plan = getattr(model, "quant_plan", None)
        info = {
            "checkpoint": str(args.checkpoint),
            "quant_plan": None if plan is None else plan.to_dict(),
            "config": cfg.to_dict(),
            "parameters": {**groups, "total": sum(groups.values())},
            "sites": {**sites, "total": sum(sites.values())},
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
    print(f"parameters   {total:,}")
    for name, count in groups.items():
        if count:
            print(f"  {name:<11}{count:>12,}  {100 * count / total:5.1f} %")
    print(f"sites        {sum(sites.values())} ({', '.join(f'{k} {n}' for k, n in sites.items())})")
    plan = getattr(model, "quant_plan", None)
    if plan is not None:
        print(f"quantized    plan {plan.name}: {plan.description or 'custom'}")
        for rule in plan.rules:
            targets = ", ".join(rule.sites + rule.weights)
            print(f"  {rule.scheme.label():<22}{rule.scheme.calibration:<10} {targets}")
        if plan.backend is not None:
            print(f"  backend {plan.backend.name}: {plan.backend.to_dict()}")
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    import torch

    from diffquant.io import save_checkpoint
    from diffquant.models import DecoderLM, preset_config

    config = preset_config(args.preset, args.kind)
    torch.manual_seed(args.seed)
    model = DecoderLM(config)
    save_checkpoint(model, args.out, overwrite=args.force)
    print(
        f"wrote {args.out}: {config.attention} ({args.preset}), {model.num_parameters():,} parameters, seed {args.seed}"
    )
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffquant.data import ByteTokenizer, fingerprint, token_windows
    from diffquant.distributed import init_from_env, shutdown
    from diffquant.io import load_model
    from diffquant.io.artifacts import manifest, sha256_file, write_json_atomic, write_text_atomic
    from diffquant.profile.runner import profile_model
    from diffquant.profile.tables import format_table5, layerwise, table5

    rank, world = init_from_env()
    try:
        _positive(args, "tokens", "seq_len", "batch_size", "topk")
        models = {}
        for spec in args.checkpoints:
            model = load_model(spec)
            cfg = model.config
            if args.seq_len > cfg.max_seq_len:
                raise DiffquantError(
                    f"--seq-len {args.seq_len} exceeds the max_seq_len {cfg.max_seq_len} of {spec}"
                )
            if cfg.vocab_size < ByteTokenizer.vocab_size:
                raise DiffquantError(
                    f"{spec}: vocab_size {cfg.vocab_size} cannot hold the byte tokenizer's "
                    f"{ByteTokenizer.vocab_size} ids"
                )
            models[_unique_name(spec, models)] = (spec, model)
        windows = token_windows(args.data, args.tokens, args.seq_len)
        n_tokens = windows.numel()
        if n_tokens < args.tokens and rank == 0:
            print(f"note: data source {args.data!r} holds only {n_tokens:,} tokens", file=sys.stderr)
        out = Path(args.out)
        tables, summaries = {}, {}
        for name, (spec, model) in models.items():
            profile = profile_model(
                model,
                windows,
                batch_size=args.batch_size,
                sites=args.sites,
                topk=args.topk,
                attention=False if args.no_attention_metrics else None,
                progress=sys.stderr.isatty(),
                desc=name,
            )
            if profile is None:  # not rank 0
                continue
            profile.meta.update(
                model=name,
                checkpoint=str(spec),
                attention=model.config.attention,
                config=model.config.to_dict(),
            )
            write_json_atomic(out / "profile" / f"{name}.json", profile.to_dict())
            tables[name] = table5(profile)
            summaries[name] = {"table5": tables[name], "layerwise_hidden": layerwise(profile, "resid")}
        if rank != 0:
            return 0
        text = format_table5(tables)
        header = (
            f"Table 5 view: k-th largest |x| and median |x| over {n_tokens:,} tokens "
            f"({windows.shape[0]} windows of {args.seq_len}) from {args.data}"
        )
        write_text_atomic(out / "table5.txt", header + "\n" + text + "\n")
        write_json_atomic(out / "table5.json", summaries)
        write_json_atomic(
            out / "manifest.json",
            manifest(
                "profile",
                checkpoints={
                    n: {"spec": str(s), "sha256": _checkpoint_hash(s, sha256_file)}
                    for n, (s, _) in models.items()
                },
                data={"source": args.data, "fingerprint": fingerprint(args.data), "tokens": n_tokens},
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                sites=args.sites,
                topk=args.topk,
                world_size=world,
            ),
        )
        print(header)
        print(text)
        print(f"wrote {out}/profile/*.json, table5.txt, table5.json, manifest.json")
        return 0
    finally:
        shutdown()


def _cmd_quantize(args: argparse.Namespace) -> int:
    from collections import Counter as _Counter
    from pathlib import Path

    import torch

    from diffquant.data import fingerprint, token_windows
    from diffquant.io import load_model
    from diffquant.io.artifacts import library_versions, write_json_atomic
    from diffquant.io.quantized import is_quantized, save_quantized
    from diffquant.quant.plan import QuantPlan, apply_plan, calibrate, nan_counts
    from diffquant.quant.report import compare_models, format_report

    _positive(args, "calib_tokens", "eval_tokens", "seq_len", "batch_size")
    if is_quantized(args.checkpoint):
        raise DiffquantError(f"{args.checkpoint}: already quantized; quantize its base checkpoint instead")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise DiffquantError(f"{out}: already exists (pass --force to replace it)")
    plan = QuantPlan.load(args.plan)
    reference = load_model(args.checkpoint)
    if args.seq_len > reference.config.max_seq_len:
        raise DiffquantError(
            f"--seq-len {args.seq_len} exceeds the max_seq_len {reference.config.max_seq_len} of {args.checkpoint}"
        )
    model = load_model(args.checkpoint)
    applied = apply_plan(model, plan)
    windows = token_windows(args.calib_data, args.calib_tokens + args.eval_tokens, args.seq_len)
    n_calib = max(1, min(windows.shape[0] - 1, -(-args.calib_tokens // args.seq_len)))
    calib, held_out = windows[:n_calib], windows[n_calib:]
    if held_out.shape[0] == 0:
        held_out = calib  # a tiny source: report on the calibration text itself (said below)
    with torch.no_grad():
        calibrated = calibrate(model, calib, batch_size=args.batch_size)
        report = compare_models(reference, model, held_out, batch_size=args.batch_size)
    meta = {
        "base": str(args.checkpoint),
        "plan_source": str(args.plan),
        "calibration": {
            "source": args.calib_data,
            "fingerprint": fingerprint(args.calib_data),
            "tokens": calibrated,
            "seq_len": args.seq_len,
        },
        "report_tokens": held_out.numel(),
        "nan_counts": nan_counts(model),
        "versions": library_versions(),
    }
    save_quantized(model, out, meta=meta, overwrite=args.force)
    write_json_atomic(
        out / "quant_report.json", {"plan": plan.to_dict(), "applied": applied, "report": report}
    )
    counts = _Counter(target for target, _, _ in applied)
    print(f"plan {plan.name}: {plan.description}" if plan.description else f"plan {plan.name}")
    calibration = (
        f"calibrated on {calibrated:,} tokens" if calibrated else "dynamic scales, no calibration needed"
    )
    print(
        f"quantized {counts['site']} sites, {counts['weight']} weights, {counts['linear']} backend Linears; "
        f"{calibration}"
    )
    same = (
        " (the calibration windows: the source is too small for a held-out part)" if held_out is calib else ""
    )
    print(f"error vs the unquantized model on {held_out.numel():,} held-out tokens{same}:")
    print(format_report(report))
    if meta["nan_counts"]:
        print(f"NaN seen by quantizers: {meta['nan_counts']}")
    print(f"wrote {out} (load it like any checkpoint: diffquant profile {out} ...)")
    return 0


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise DiffquantError(
                f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}"
            )


def _unique_name(spec: str, taken: dict) -> str:
    from pathlib import Path

    base = Path(str(spec).rstrip("/")).name or "model"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


def _checkpoint_hash(spec: str, sha256_file) -> str | None:
    from pathlib import Path

    weights = Path(spec) / "model.safetensors"
    return sha256_file(weights) if weights.is_file() else None


def _cmd_presets(args: argparse.Namespace) -> int:
    from diffquant.quant.plan import PRESETS, preset

    width = max(len(p) for p in PRESETS)
    for name in PRESETS:
        print(f"{name:<{width}}  {preset(name).description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffquant",
        description="Quantization and activation-outlier analysis of Differential Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"diffquant {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="show a checkpoint's config, parameter counts and probe sites")
    info.add_argument("checkpoint", help="a native checkpoint folder")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=_cmd_info)

    init = sub.add_parser("init", help="write a randomly initialised checkpoint (to try every command)")
    init.add_argument("out", help="output folder")
    init.add_argument("--kind", choices=("baseline", "diff_v1", "diff_v2"), default="baseline")
    init.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--force", action="store_true", help="replace an existing folder")
    init.set_defaults(func=_cmd_init)

    prof = sub.add_parser(
        "profile",
        help="outlier statistics of one or more checkpoints (the DIFF paper's Table 5 and more)",
        description="Profile activations at every site; prints the Table-5 view side by side and writes "
        "the full per-site profile as JSON. Runs sharded under torchrun --nproc_per_node N.",
    )
    prof.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="native checkpoint folders")
    prof.add_argument("--data", default="stdlib", help="'stdlib', a text file or a folder (default: stdlib)")
    prof.add_argument("--tokens", type=int, default=16384, help="tokens to profile (default: 16384)")
    prof.add_argument("--seq-len", type=int, default=256, help="window length (default: 256)")
    prof.add_argument("--batch-size", type=int, default=8)
    prof.add_argument("--sites", nargs="+", default=["*"], help="site globs or kind:NAME (default: all)")
    prof.add_argument("--topk", type=int, default=100, help="largest magnitudes kept per site")
    prof.add_argument("--no-attention-metrics", action="store_true", help="skip per-head attention metrics")
    prof.add_argument("--out", default="runs/profile", help="run folder (default: runs/profile)")
    prof.set_defaults(func=_cmd_profile)

    quant = sub.add_parser(
        "quantize",
        help="apply a quantization plan (preset or YAML) and write a quantized checkpoint",
        description="Fake-quantize sites and weights, or swap Linears for optimum-quanto / bitsandbytes "
        "layers; calibrate static scales; report the error per site against the unquantized model.",
    )
    quant.add_argument("checkpoint", help="an unquantized native checkpoint folder")
    quant.add_argument("--plan", required=True, help="a preset name (see --list-presets) or a YAML plan file")
    quant.add_argument("--calib-data", default="stdlib", help="'stdlib', a text file or a folder")
    quant.add_argument("--calib-tokens", type=int, default=4096)
    quant.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens for the error report")
    quant.add_argument("--seq-len", type=int, default=256)
    quant.add_argument("--batch-size", type=int, default=8)
    quant.add_argument("--out", required=True, help="output folder")
    quant.add_argument("--force", action="store_true", help="replace an existing output folder")
    quant.set_defaults(func=_cmd_quantize)

    presets = sub.add_parser("presets", help="list the quantization plan presets")
    presets.set_defaults(func=_cmd_presets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except DiffquantError as err:
        print(f"diffquant {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diffquant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
