"""The GPU kit (issue 31): one prepared command that turns a lent GPU's minutes into results.

    python analysis/gpu/kit.py run [--rehearse] [--out DIR] [--stages env,trio] [--budget trio=480]
    python analysis/gpu/kit.py size [--carry analysis/gpu/wheels] [--limit-mib 64] [--json]
    python analysis/gpu/kit.py trim-bnb WHEEL_DIR        (prepare.sh: the CUDA 13 libraries only)
    python analysis/gpu/kit.py install-wheels WHEEL_DIR SITE   (run.sh: the carried wheels, offline)
    python analysis/gpu/kit.py manifest WHEEL_DIR       (prepare.sh: what was prepared, from which commit)
    python analysis/gpu/kit.py trio-merge OUT_A OUT_B --out DIR   (trio parts' studies joined: kit_merge.py)

`run.sh` calls `run`; the driver runs the stages (env, gpu_tests, kernels_bench, cli, trio) one after the other,
each in its own process group under its own time budget, so a stage that fails or runs out of time is recorded
and the next one runs. Every stage writes its result as it goes; the driver writes `summary.json` into $OUT
after every stage (a kill of the whole command still leaves the stages done so far) and, at the end, zips the
results into $OUT (at most 8 files of 16 MiB come back from the GPU machine). Time left by a stage that ends
early goes to the trio, which sizes its models from the time it has. `--rehearse` runs the same stages on CPU
at toy sizes: the GPU-only stages record `skipped` with the reason, the others run for real.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kit_util import REPO, Context, Recorder, kill_group, last_error, read_json, start, write_json  # noqa: E402

STAGES = ("env", "gpu_tests", "kernels_bench", "kernels_tune", "train_compile", "autocast_gap", "cli", "trio")
# kernels_tune (time every clean launch configuration of the Triton kernels) and train_compile (every kind's
# training step eager and torch.compile'd), both issue 46, run only when named (--stages kernels_tune
# --budget kernels_tune=420): each needs a device call of its own.
ONLY_WHEN_NAMED = ("kernels_tune", "train_compile")
DEFAULT_STAGES = tuple(s for s in STAGES if s not in ONLY_WHEN_NAMED)
# the stages whose question only a GPU answers: in the rehearsal they run what a CPU can and say "skipped"
GPU_ONLY = ("gpu_tests", "kernels_bench", "kernels_tune", "train_compile", "autocast_gap")
# Seconds per stage on the GPU: 30 + 100 + 90 + 40 + 90 + 170 = 520, and the driver's deadline is 520 s from
# run.sh's start (wheel install included), under the 9 minutes the issue allows and the device's 10 per
# command. Time a stage leaves unused goes to the trio, so generous early budgets cost nothing when those
# stages end early. Why these: env imports torch, triton and the carried libraries on a cold machine; the GPU
# tests compile a Triton kernel variant per case (56 cases, 4 parallel shards); the benchmark compiles per
# shape (5 shapes x 2 distributions); autocast_gap trains four 3M models for 12 steps; the CLI is 5
# commands, each ~5 s of start-up, on the zoo and a 189M model; the trio trains three models and studies them.
BUDGETS = {
    "gpu": {
        "env": 30,
        "gpu_tests": 100,
        "kernels_bench": 90,
        "kernels_tune": 420,
        "train_compile": 420,
        "autocast_gap": 40,
        "cli": 90,
        "trio": 170,
    },
    # The rehearsal's budgets are ceilings for a slow shared CPU, not targets: it takes 1-2 minutes.
    "rehearse": {
        "env": 60,
        "gpu_tests": 90,
        "kernels_bench": 60,
        "kernels_tune": 60,
        "train_compile": 300,
        "autocast_gap": 120,
        "cli": 180,
        "trio": 240,
    },
}
DEADLINE_S = {"gpu": 520, "rehearse": 900}  # from run.sh's start, wheel install included
FINALIZE_S = 10  # kept back for the zips and the last summary
ABSORBS_SLACK = ("trio",)
GRACE_S = 8  # a stage past its deadline by this much is killed
MIB = 2**20
LIMIT_MIB = 64
ZIP_CAP = 15 * MIB  # each file from $OUT may be 16 MiB


# ------------------------------------------------------------------------------------------- sizes
def tree_files(root: Path) -> list[Path]:
    """The files the device tool copies: tracked and untracked-but-not-ignored (git ls-files -co
    --exclude-standard), those that exist."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    names = sorted({n for n in out.decode().split("\0") if n})
    return [root / n for n in names if (root / n).is_file() and not (root / n).is_symlink()]


def size_report(root: Path, carry: list[str], limit_mib: float = LIMIT_MIB) -> dict[str, Any]:
    """What travels to the GPU machine: the tree's bytes, each carried path's, the total against the limit.
    A carried path inside the tree that git does not ignore would be counted twice; it is counted once."""
    files = tree_files(root)
    tree = sum(p.stat().st_size for p in files)
    tracked = {p.resolve() for p in files}
    carried = {}
    for rel in carry:
        path = root / rel
        if not path.exists():
            carried[rel] = 0
            continue
        inside = [p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()]
        carried[rel] = sum(p.stat().st_size for p in inside if p.resolve() not in tracked)
    total = tree + sum(carried.values())
    wheels = {}
    for rel in carry:
        for whl in sorted((root / rel).glob("*.whl")) if (root / rel).is_dir() else []:
            wheels[whl.name] = whl.stat().st_size
    return {
        "tree_files": len(files),
        "tree_bytes": tree,
        "carried_bytes": carried,
        "wheels": wheels,
        "total_bytes": total,
        "total_mib": round(total / MIB, 2),
        "limit_mib": limit_mib,
        "fits": total <= limit_mib * MIB,
    }


def print_size(report: dict[str, Any]) -> None:
    print(
        f"tree        {report['tree_bytes'] / MIB:8.2f} MiB  ({report['tree_files']} files: git ls-files -co --exclude-standard)"
    )
    for rel, n in report["carried_bytes"].items():
        print(f"carried     {n / MIB:8.2f} MiB  {rel}")
    for name, n in report["wheels"].items():
        print(f"  wheel     {n / MIB:8.2f} MiB  {name}")
    verdict = "fits" if report["fits"] else "DOES NOT FIT"
    print(f"total       {report['total_mib']:8.2f} MiB  of {report['limit_mib']} MiB: {verdict}")


# ------------------------------------------------------------------------------------------- wheels
# bitsandbytes ships one library per CUDA / ROCm release (41 MiB in all); the GPU machine's torch is built for
# CUDA 13, and bitsandbytes loads libbitsandbytes_cuda{major}{minor}.so for torch.version.cuda, so every
# CUDA 13 library is kept (any choice the full wheel could make there) and the CPU one; the rest is dropped.
BNB_DROP = re.compile(r"^bitsandbytes/libbitsandbytes_(cuda1[0-2]\d|rocm\d+)\.(so|dll|dylib)$")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def trim_wheel(wheel: Path, drop: re.Pattern) -> dict[str, Any]:
    """Rewrite ``wheel`` without the members ``drop`` matches, with a RECORD that lists what is left (hashes
    and sizes recomputed), so it stays a valid wheel for pip. Idempotent: nothing to drop, nothing written."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        dropped = [i.filename for i in infos if drop.match(i.filename)]
        if not dropped:
            return {"wheel": wheel.name, "dropped": [], "bytes": wheel.stat().st_size}
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        tmp = wheel.with_name(wheel.name + ".tmp")
        rows = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if info.filename in dropped or info.filename == record:
                    continue
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                rows.append(f"{info.filename},{_record_hash(data)},{len(data)}")
            rows.append(f"{record},,")
            dst.writestr(record, "\n".join(rows) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    before = wheel.stat().st_size
    tmp.replace(wheel)
    return {"wheel": wheel.name, "dropped": dropped, "bytes_before": before, "bytes": wheel.stat().st_size}


def install_wheels(folder: Path, site: Path, use_pip: bool = True) -> dict[str, Any]:
    """The carried wheels into ``site`` without a network: `pip install --no-deps --no-index --target`, or,
    where pip is missing, the wheels unpacked (a wheel is a zip whose root is the site folder's layout; file
    modes kept, so ninja's binary stays executable)."""
    wheels = sorted(folder.glob("*.whl"))
    site.mkdir(parents=True, exist_ok=True)
    if not wheels:
        return {"wheels": [], "how": "none"}
    begin = time.time()
    how = "pip"
    if use_pip:
        pip = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-index",
                "--no-compile",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
                str(site),
                *map(str, wheels),
            ],
            capture_output=True,
            text=True,
        )
        failed = pip.returncode != 0
        why = (pip.stderr.strip().splitlines() or ["?"])[-1][:200]
    else:
        failed, why = True, "not used"
    if failed:
        how = f"unzip (pip: {why})"
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    target = z.extract(info, site)
                    mode = info.external_attr >> 16
                    if mode and not info.is_dir():
                        os.chmod(target, mode & 0o777)
    return {"wheels": [w.name for w in wheels], "how": how, "seconds": round(time.time() - begin, 1)}


def write_manifest(folder: Path) -> dict[str, Any]:
    """What prepare.sh prepared, from which commit: read back by the env stage on the GPU machine, whose
    copy of the tree may have no .git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = None, None
    data = {
        "commit": commit,
        "dirty": dirty,
        "prepared": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "wheels": {w.name: w.stat().st_size for w in sorted(folder.glob("*.whl"))},
    }
    write_json(folder / "MANIFEST.json", data)
    return data


# ------------------------------------------------------------------------------------------- zips
def zip_capped(path: Path, members: list[tuple[str, Path]], cap: int = ZIP_CAP) -> dict[str, Any]:
    """A zip of ``members`` (in priority order) that stays under ``cap`` bytes: a member whose compressed
    size would pass the cap is left out and named, and the next ones are still tried."""
    kept, dropped = [], []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for arc, src in members:
            before = path.stat().st_size if path.exists() else 0
            info = zipfile.ZipInfo.from_file(src, arc)
            info.compress_type = zipfile.ZIP_DEFLATED
            data = src.read_bytes()
            # estimated before writing: a member cannot be taken out of a zip once it is in
            size = len(zlib.compress(data, 6)) + len(arc) * 2 + 100
            if before + size > cap:
                dropped.append(arc)
                continue
            z.writestr(info, data)
            kept.append(arc)
            z.fp.flush()
    return {"file": path.name, "bytes": path.stat().st_size, "members": len(kept), "left_out": dropped}


SMALL = (".json", ".csv", ".txt", ".md", ".html", ".yaml", ".jsonl", ".log", ".png")


def result_members(work: Path) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(results, profiles): what goes into results.zip, most important first, and the per-site profile JSONs
    (large) into profiles.zip. The trio's attention-map tensors go last, kept where the cap leaves room (a
    trio joined from parts draws its map figures from them); weights, checkpoints and the corpus stay behind."""
    first = [
        "stages",
        "logs",
        "trio/run/report.html",
        "trio/run/report.md",
        "trio/run/table5",
        "trio/run/sweep",
        "trio/train",
        "trio/recipes",
        "bench",
        "cli",
        "trio/run/figures",
        "trio/run",
    ]

    def rank(rel: str) -> int:
        return next((i for i, p in enumerate(first) if rel.startswith(p)), len(first))

    results, profiles, maps = [], [], []
    for path in sorted(p for p in work.rglob("*") if p.is_file()):
        rel = path.relative_to(work).as_posix()
        if rel.startswith("trio/run/profile/") and rel.endswith(".maps.safetensors"):
            maps.append((rel, path))  # last: the map figures of a trio joined from parts, where they fit
            continue
        if "/checkpoints/" in rel or rel.endswith((".safetensors", ".tmp")) or rel.endswith("corpus.jsonl"):
            continue
        if "/profile/" in rel and rel.endswith(".json"):
            profiles.append((rel, path))
        elif path.suffix in SMALL:
            results.append((rel, path))
    results.sort(key=lambda m: (rank(m[0]), m[0]))
    return results + maps, profiles


# ------------------------------------------------------------------------------------------- digest
def _note(name: str, n: dict[str, Any]) -> str:
    """One line of a stage's headline numbers."""
    if name == "env":
        return f"{n.get('gpu', 'no GPU')}, torch {n.get('torch')} (CUDA {n.get('torch_cuda')}), triton {n.get('libraries', {}).get('triton')}"
    if name == "gpu_tests":
        if "passed" not in n:
            return f"{n.get('collected', '?')} collected"
        return f"{n.get('collected')} collected: {n['passed']} passed, {n['failed']} failed, {n['errors']} errors, {n['skipped']} skipped, {n['not_run']} not run"
    if name == "kernels_bench":
        goals = n.get("goals", {})
        if not goals.get("assessable"):
            return (
                f"{n.get('rows', n.get('smoke_rows', 0))} rows; goals: {goals.get('reason', 'not assessed')}"
            )
        met = "; ".join(
            f"{v}: " + ", ".join(f"{g} {'yes' if ok else 'NO'}" for g, ok in m.items())
            for v, m in goals["met"].items()
        )
        return f"{n.get('rows')} rows; {met}" + _where_time_goes(goals["rows"])
    if name == "kernels_tune":
        return f"{n.get('rows', 0)} configurations timed; best for {len(n.get('best', {}))} variants"
    if name == "train_compile":
        speedup = ", ".join(f"{kind} {x:.2f}x" for kind, x in n.get("speedup", {}).items())
        return f"size {n.get('size')}, compiled / eager tokens/s: {speedup or '-'}"
    if name == "autocast_gap":
        gap = n.get("gap", {})
        return f"{n.get('size')}, DIFF V2 - baseline loss at step {n.get('steps')}: " + ", ".join(
            f"{p} {g:+.3f}" for p, g in gap.items()
        )
    if name == "cli":
        topk = n.get("profile_topk", {}).get("rows", [])
        syncs = n.get("profile_syncs", {}).get("rows", [])
        return (
            ", ".join(
                f"{c} {r.get('wall_s', '-')} s {r.get('status')}" for c, r in n.get("commands", {}).items()
            )
            + (
                "; a site update's packed / host top-k: "
                + ", ".join(f"{r['entries']:,} {r['packed_over_host']:.2f}x" for r in topk)
                if topk
                else ""
            )
            + (
                "; a tiny profile's host syncs (stand-in: 69): "
                + ", ".join(f"{r['kind']} {r['syncs']} ({r['counted_by']})" for r in syncs)
                if syncs
                else ""
            )
        )
    if name == "trio":
        runs = n.get("runs", {})
        bpb = "/".join(
            f"{r['val_bpb']:.3f}" if isinstance(r.get("val_bpb"), float) else "-" for r in runs.values()
        )
        tokens = n.get("tokens")
        return (
            f"size {n.get('size')}, {tokens:,} tokens each, val bpb {bpb} ({'/'.join(runs)})"
            if tokens
            else ""
        )
    return ""


def _where_time_goes(rows: list[dict[str, Any]]) -> str:
    """The quantized cores' time split (the bench's profile, N(0,1) rows): event ms, device ms, host ms to
    issue a call. In the digest because the device call's output tail may be all that comes back, and it
    answers goal 2's "host-bound or the kernels?" on its own."""
    parts = [
        f"{r['variant'].removesuffix('-triton')} T={r['T']} d={r['d']}: {r['ms']:.3f} ms, device "
        f"{r['kernel_ms']:.3f}, host {r['host_ms']:.3f}"
        for r in rows
        if r["dist"] == "normal" and r.get("kernel_ms") is not None and r.get("host_ms") is not None
    ]
    return "; where the time goes: " + "; ".join(parts[:6]) if parts else ""


def _compile_lines(n: dict[str, Any]) -> list[str]:
    """train_compile's table: per kind, eager and compiled tokens/s, model FLOPs utilisation, warm-up s, and
    the host syncs of one step (CUDA only)."""
    eager, compiled = n.get("eager", {}), n.get("compiled", {})
    if not eager:
        return []

    def cell(row: dict[str, Any] | None) -> str:
        if not row:
            return f"{'-':>28}"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-"
        syncs = row.get("host_syncs_per_step", "-")
        return f"{row['tokens_per_s']:>10,.0f} {mfu:>6} {row['warmup_s']:>6.1f} {syncs:>3}"

    lines = [f"train_compile, {n.get('size')} (tokens/s, mfu, warm-up s, host syncs a step):"]
    lines.append(f"  {'kind':<18}{'eager':>28}{'compiled':>28}")
    for kind, row in eager.items():
        lines.append(f"  {kind:<18}{cell(row):>28}{cell(compiled.get(kind)):>28}")
    return lines


def digest(summary: dict[str, Any]) -> str:
    """The results in a few lines of text: printed last (the device tool returns a command's output tail even
    when no file comes back) and written as digest.txt."""
    lines = [
        f"diffquant GPU kit, {summary['mode']}, started {summary['started']}, {summary.get('wall_s', '?')} s"
    ]
    lines.append(f"{'stage':<14}{'status':<9}{'wall s':>7}{'budget':>7}  notes")
    for name, e in summary["stages"].items():
        try:
            note = _note(name, e.get("numbers", {}))
        except (KeyError, TypeError, ValueError) as err:
            note = f"(no digest: {err})"
        lines.append(f"{name:<14}{e['status']:<9}{e['wall_s']:>7.0f}{e.get('budget_s', 0):>7.0f}  {note}")
        if e.get("reason"):
            lines.append(f"{'':<14}{e['reason'][:300]}")
    lines += _compile_lines(summary["stages"].get("train_compile", {}).get("numbers", {}))
    trio = summary["stages"].get("trio", {}).get("numbers", {}).get("study", {})
    if trio.get("table5"):
        lines.append("trio, Table 5 view (top1 / median |x|):")
        for model, acts in trio["table5"].items():
            cells = "  ".join(f"{a}: {v['top1']:.1f} / {v['median']:.3f}" for a, v in acts.items())
            lines.append(f"  {model:<10}{cells}")
    if trio.get("bpb"):
        models = list(trio["bpb"])
        lines.append("trio, bits per byte (change vs unquantized):")
        lines.append(f"  {'plan':<18}" + "".join(f"{m:>20}" for m in models))
        plans = list(next(iter(trio["bpb"].values())))
        for plan in plans:
            cells = []
            for m in models:
                cell = trio["bpb"][m].get(plan)
                cells.append(f"{cell['value']:>10.4f} ({cell['delta']:+.4f})" if cell else f"{'-':>20}")
            lines.append(f"  {plan:<18}" + "".join(f"{c:>20}" for c in cells))
    for f in summary.get("files", []):
        lines.append(
            f"{f['file']}: {f['bytes'] / MIB:.2f} MiB, {f['members']} files"
            + (f", left out: {', '.join(f['left_out'])}" if f["left_out"] else "")
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- driver
def run_stage(name: str, ctx: Context, budget: float) -> dict[str, Any]:
    """One stage in its own process (its own group, so a kill takes its children): its result file read back
    whether it finished, failed or was killed at ``budget`` + grace."""
    result_path = ctx.work / "stages" / f"{name}.json"
    log = ctx.work / "logs" / f"{name}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "stage",
        name,
        "--mode",
        ctx.mode,
        "--work",
        str(ctx.work),
        "--deadline",
        str(ctx.deadline),
        "--cuda",
        "1" if ctx.cuda else "0",
    ]
    if ctx.trio is not None:
        cmd += ["--trio", json.dumps(ctx.trio)]
    env = {"TRITON_INTERPRET": "0"} if ctx.mode == "gpu" else {}
    begin = time.time()
    proc = start(cmd, log, env)
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, budget + GRACE_S))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
    wall = round(time.time() - begin, 1)
    data = read_json(result_path) or {"status": "running", "reason": "", "numbers": {}}
    if timed_out and data.get("status") in (None, "running"):
        data["status"], data["reason"] = "timeout", f"ran past its {budget:.0f} s budget and was killed"
    elif timed_out:  # it had written its result, then did not exit (a hung teardown)
        data["reason"] = (data.get("reason") or "") + " (its process did not exit and was killed)"
    elif data.get("status") in (None, "running"):
        data["status"] = "failed"
        data["reason"] = f"exit code {proc.returncode}: {last_error(log)}"
    return {
        "status": data["status"],
        "reason": data.get("reason", ""),
        "wall_s": wall,
        "budget_s": round(budget, 1),
        "numbers": data.get("numbers", {}),
    }


def refuse(message: str) -> None:
    """A wrong option: one line on stderr and exit code 2, before anything is written."""
    print(f"kit.py: {message}", file=sys.stderr)
    sys.exit(2)


def trio_part(args: argparse.Namespace, mode: str) -> dict[str, Any] | None:
    """The part of a trio this call trains (--trio-kinds, --trio-size, --trio-tokens), checked against the
    kinds and the mode's ladder; None without --trio-kinds. A wrong one exits 2 with one line."""
    import kit_trio

    if args.trio_kinds is None:
        if args.trio_size is not None or args.trio_tokens is not None:
            refuse("--trio-size and --trio-tokens go with --trio-kinds (a part of a trio)")
        return None
    kinds = [k.strip() for k in args.trio_kinds.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in kit_trio.KINDS]
    if not kinds or wrong or len(set(kinds)) != len(kinds):
        refuse(f"--trio-kinds {args.trio_kinds}: expected distinct kinds of {','.join(kit_trio.KINDS)}")
    ladder = kit_trio.LADDER[mode]
    if args.trio_size not in ladder:
        refuse(f"--trio-size {args.trio_size}: expected one of {', '.join(ladder)} ({mode})")
    tokens = kit_trio.SETTINGS[mode]["target_tokens"] if args.trio_tokens is None else args.trio_tokens
    if tokens <= 0:
        refuse(f"--trio-tokens {tokens}: expected a positive number of tokens")
    return {"kinds": [k for k in kit_trio.KINDS if k in kinds], "size": args.trio_size, "tokens": tokens}


def drive(args: argparse.Namespace) -> int:
    mode = "rehearse" if args.rehearse else "gpu"
    trio = trio_part(args, mode)  # the options are checked before anything is written
    started = args.started or time.time()
    deadline = started + (args.deadline or DEADLINE_S[mode])
    budgets = dict(BUDGETS[mode])
    for item in args.budget:
        key, _, value = item.partition("=")
        if key not in budgets:
            refuse(f"--budget {item}: unknown stage; expected one of {', '.join(STAGES)}")
        budgets[key] = float(value)
    asked = set(args.stages.split(",")) if args.stages else set(DEFAULT_STAGES)
    if asked - set(STAGES):
        refuse(f"--stages: unknown {', '.join(sorted(asked - set(STAGES)))}; expected {','.join(STAGES)}")
    chosen = [s for s in STAGES if s in asked]
    if trio is not None and "trio" not in chosen:
        refuse("--trio-kinds: the trio stage is not among --stages")
    if "env" not in chosen:
        chosen.insert(0, "env")  # the others need to know whether CUDA is there
    out = Path(args.out or tempfile.mkdtemp(prefix="diffquant-kit-out-"))
    work = Path(args.work or tempfile.mkdtemp(prefix="diffquant-kit-work-"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "kit": "diffquant GPU kit (issue 31)",
        "mode": mode,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
        "argv": sys.argv,
        "setup": read_json(Path(args.setup)) if args.setup else None,
        "budgets_s": {s: budgets[s] for s in chosen},
        "deadline_s": round(deadline - started),
        "trio_part": trio,
        "stages": {},
    }
    write_json(out / "summary.json", summary)
    cuda = False
    slack = 0.0
    for name in chosen:
        left = deadline - FINALIZE_S - time.time()
        if name != "env" and mode == "gpu" and not cuda:
            entry = {
                "status": "skipped",
                "reason": "no CUDA device (see the env stage)",
                "wall_s": 0.0,
                "numbers": {},
            }
        elif left < 5:
            entry = {
                "status": "skipped",
                "reason": "the kit's deadline left no time",
                "wall_s": 0.0,
                "numbers": {},
            }
        else:
            budget = min(left, budgets[name] + (slack if name in ABSORBS_SLACK else 0.0))
            ctx = Context(mode=mode, work=work, deadline=time.time() + budget - 2, cuda=cuda, trio=trio)
            print(f"[kit] {name}: budget {budget:.0f} s", flush=True)
            entry = run_stage(name, ctx, budget)
            if name not in ABSORBS_SLACK:
                slack += max(0.0, budgets[name] - entry["wall_s"])
        if name == "env":
            cuda = bool(entry["numbers"].get("cuda_available"))
        summary["stages"][name] = entry
        print(f"[kit] {name}: {entry['status']} in {entry['wall_s']} s {entry['reason']}", flush=True)
        write_json(out / "summary.json", summary)
    try:
        results, profiles = result_members(work)
        summary["files"] = [zip_capped(out / "results.zip", results)]
        if profiles:
            summary["files"].append(zip_capped(out / "profiles.zip", profiles))
    except Exception as err:  # the summary, written already, must not be lost to a failed zip
        summary["files_error"] = f"{type(err).__name__}: {err}"
    summary["wall_s"] = round(time.time() - started, 1)
    write_json(out / "summary.json", summary)
    text = digest(summary)
    (out / "digest.txt").write_text(text)
    print(text, end="", flush=True)
    print(f"[kit] summary: {out / 'summary.json'}", flush=True)
    expected = dict.fromkeys(GPU_ONLY, "skipped") if mode == "rehearse" else {}
    bad = [n for n, e in summary["stages"].items() if e["status"] != expected.get(n, "ok")]
    return 1 if bad else 0


def stage_main(args: argparse.Namespace) -> int:
    """One stage, in the process the driver started for it."""
    import kit_autocast
    import kit_stages
    import kit_trio

    ctx = Context(
        mode=args.mode,
        work=Path(args.work),
        deadline=args.deadline,
        cuda=args.cuda == "1",
        trio=json.loads(args.trio) if args.trio else None,
    )
    rec = Recorder(ctx.work / "stages" / f"{args.name}.json")
    rec.set()
    fn = {
        "env": kit_stages.stage_env,
        "gpu_tests": kit_stages.stage_gpu_tests,
        "kernels_bench": kit_stages.stage_kernels_bench,
        "kernels_tune": kit_stages.stage_kernels_tune,
        "train_compile": kit_trio.stage_train_compile,
        "autocast_gap": kit_autocast.stage_autocast_gap,
        "cli": kit_stages.stage_cli,
        "trio": kit_trio.stage_trio,
    }[args.name]
    try:
        fn(ctx, rec)
    except Exception as err:  # recorded for the summary, then raised for the log's traceback
        rec.finish("failed", f"{type(err).__name__}: {err}"[:500])
        raise
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the stages (run.sh calls this)")
    p.add_argument("--rehearse", action="store_true", help="on CPU at toy sizes")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or None,
        help="results folder (default: $OUT, else a temporary one)",
    )
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    p.add_argument(
        "--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (env always runs)"
    )
    p.add_argument(
        "--budget", action="append", default=[], metavar="STAGE=SECONDS", help="override a stage's budget"
    )
    p.add_argument("--deadline", type=float, default=None, help="seconds from --started by which all is done")
    p.add_argument("--started", type=float, default=None, help="epoch seconds the command started (run.sh)")
    p.add_argument("--setup", default=None, help="run.sh's record of the wheels it installed (JSON)")
    p.add_argument(
        "--trio-kinds",
        default=None,
        help="train only these kinds of the trio (comma-separated), a part that kit.py trio-merge joins",
    )
    p.add_argument("--trio-size", default=None, help="the part's ladder size, e.g. 52M (with --trio-kinds)")
    p.add_argument(
        "--trio-tokens", type=int, default=None, help="the part's training tokens (default: the target, 1e8)"
    )
    s = sub.add_parser("stage", help=argparse.SUPPRESS)
    s.add_argument("name", choices=STAGES)
    s.add_argument("--mode", choices=("gpu", "rehearse"), required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--deadline", type=float, required=True)
    s.add_argument("--cuda", choices=("0", "1"), required=True)
    s.add_argument("--trio", default=None, help="the part of a trio (JSON)")
    z = sub.add_parser("size", help="the bytes that travel to the GPU machine, against the limit")
    z.add_argument("--carry", action="append", default=[], help="a carried (ignored) path, repeatable")
    z.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    z.add_argument("--json", action="store_true")
    t = sub.add_parser("trim-bnb", help="drop bitsandbytes' non-CUDA-13 libraries from its wheel")
    t.add_argument("folder")
    i = sub.add_parser("install-wheels", help="install the carried wheels into a site folder, offline")
    i.add_argument("folder")
    i.add_argument("site")
    i.add_argument("--record", default=None, help="write what was installed to this JSON file")
    m = sub.add_parser("manifest", help="write WHEEL_DIR/MANIFEST.json")
    m.add_argument("folder")
    j = sub.add_parser("trio-merge", help="join the studies of trio parts (--trio-kinds calls) into one")
    j.add_argument("parts", nargs="+", help="the kit output folders of the parts ($OUT of each call)")
    j.add_argument("--out", required=True, help="the joined run folder (new)")
    args = parser.parse_args(argv)
    if args.command == "run":
        return drive(args)
    if args.command == "stage":
        return stage_main(args)
    if args.command == "size":
        report = size_report(REPO, args.carry, args.limit_mib)
        print(json.dumps(report, indent=1)) if args.json else print_size(report)
        return 0 if report["fits"] else 1
    if args.command == "trim-bnb":
        for whl in sorted(Path(args.folder).glob("bitsandbytes-*.whl")):
            r = trim_wheel(whl, BNB_DROP)
            print(f"{r['wheel']}: {len(r['dropped'])} libraries dropped, {r['bytes'] / MIB:.2f} MiB")
        return 0
    if args.command == "install-wheels":
        r = install_wheels(Path(args.folder), Path(args.site))
        if args.record:
            write_json(Path(args.record), r)
        print(f"installed {len(r['wheels'])} wheels into {args.site} ({r['how']})")
        return 0
    if args.command == "manifest":
        print(json.dumps(write_manifest(Path(args.folder)), indent=1))
        return 0
    if args.command == "trio-merge":
        import kit_merge

        return kit_merge.main(args.parts, args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
