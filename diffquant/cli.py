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
        info = {
            "checkpoint": str(args.checkpoint),
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
