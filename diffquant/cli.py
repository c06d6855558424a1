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
