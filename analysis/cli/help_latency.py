"""How long ``diffquant --help``, ``--version`` and every ``diffquant COMMAND --help`` take, end to end.

Wall time of a fresh process (the installed ``diffquant`` console script next to this interpreter, or
``python -c 'from diffquant.cli import main; main()'`` without one), median of ``--runs`` runs per command.
The goals: ``--help`` and ``--version`` under 0.3 s, a subcommand's ``--help`` under 0.5 s (building the
parser must not import torch). Prints a table with each goal's pass / fail; exit 1 when one fails.

    OMP_WAIT_POLICY=PASSIVE python analysis/cli/help_latency.py [--runs 7] > analysis/cli/help_latency.txt

The subcommands are read from the parser itself, so a new command is measured without editing this file.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOP_GOAL_S = 0.3  # diffquant --help, diffquant --version
COMMAND_GOAL_S = 0.5  # diffquant COMMAND --help


def diffquant_command() -> list[str]:
    """The command a user types: the console script beside this interpreter when installed."""
    script = Path(sys.executable).with_name("diffquant")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from diffquant.cli import main; sys.exit(main())"]


def subcommands() -> list[str]:
    """Every subcommand, in the parser's order."""
    from diffquant.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def wall_time(argv: list[str], runs: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (user + system) of ``argv`` (output discarded; a non-zero
    exit is an error, not a number). CPU time says what the command costs when other processes share the
    cores; the goals are on wall time, what a user waits."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs", type=int, default=7, help="runs per command, the median is reported (default: 7)"
    )
    args = ap.parse_args()
    base = diffquant_command()
    baseline, _ = wall_time([sys.executable, "-c", "pass"], args.runs)
    rows = [("--help", ["--help"], TOP_GOAL_S), ("--version", ["--version"], TOP_GOAL_S)]
    rows += [(f"{name} --help", [name, "--help"], COMMAND_GOAL_S) for name in subcommands()]
    print(f"diffquant help latency: median of {args.runs} runs, {' '.join(base)}")
    print(f"(python -c pass on this machine: {baseline:.3f} s; load average {os.getloadavg()[0]:.2f})")
    print(f"{'command':<24}{'wall s':>8}{'cpu s':>8}{'goal s':>8}  result")
    failed = 0
    for label, argv, goal in rows:
        seconds, cpu = wall_time(base + argv, args.runs)
        ok = seconds < goal
        failed += not ok
        print(f"{label:<24}{seconds:>8.3f}{cpu:>8.3f}{goal:>8.1f}  {'pass' if ok else 'FAIL'}")
    print(f"{len(rows) - failed}/{len(rows)} within their goal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
