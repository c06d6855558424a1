"""Benchmark: what profiling and fake quantization cost next to a plain forward, and that profiling's
memory does not grow with the tokens profiled.

Two models: `small` (a randomly initialised DIFF V2 of preset small, 8 windows x 256 byte ids) and
`smollm2` (the real 135M Llama, `fetch:smollm2`, 4 windows x 256 tokens of WikiText-2 test; skipped with
--no-real). Modes, each timed as the wall time of a pass over the windows:

  plain         forward passes only (the denominator)
  resid         Profiler on the residual stream (`kind:resid`)
  logits+resid  Profiler on attention logits and the residual stream
  all           Profiler on every site, maps and per-head metrics (`*`)
  w8a8          the w8a8 fake-quant plan applied (a copy of the model)
  lean          a hand-written hook on the residual stream (channel abs-max, top-1, median): a floor

Peer columns (SmolLM2 only; the small DIFF model has no transformers twin), what a user would write instead:

  hf            the transformers forward of LlamaForCausalLM loaded from the same GGUF file
                (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``)
  hf+hook       that forward with a forward hook on each decoder layer keeping the residual stream's
                abs-max per channel (what ``lean`` keeps, minus the median)

Their ratios are against the same median plain forward of diffquant's model; the table also prints each mode's
ratio against the hf forward (``vs hf``).

Rounds interleave the modes (plain, resid, ..., plain, resid, ...) so that machine load hits all of them
alike; the ratio of a mode is median(mode) / median(plain) over >= 5 rounds. Then the `all` profile of the
small model runs at N and 10 x N tokens in fresh subprocesses to compare their peak RSS. Prints a table and
writes bench.json beside this file. Set OMP_WAIT_POLICY=PASSIVE (the CLI does): busy-waiting threads on a
shared machine made every ratio meaningless.

    python analysis/profile/bench.py [--rounds 5] [--threads 2] [--no-real]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODES = ("plain", "resid", "logits+resid", "all", "w8a8", "lean")
PEERS = ("hf", "hf+hook")  # SmolLM2 only: the transformers twin
SITES = {"resid": ["kind:resid"], "logits+resid": ["kind:logits", "kind:resid"], "all": ["*"]}
# Targets of the speed issue: (small, smollm2) ratio ceilings.
TARGETS = {"resid": (1.10, 1.05), "logits+resid": (2.5, 1.3), "all": (5.0, 2.0), "w8a8": (1.15, 1.10)}


def _models(real: bool):
    import torch

    from diffquant.data import token_windows
    from diffquant.io import load_model

    out = {}
    torch.manual_seed(0)
    small = load_model("init:diff_v2:small")
    ids = torch.randint(0, 256, (8, 256), generator=torch.Generator().manual_seed(0))
    out["small"] = (small, ids, None)
    if real:
        smol = load_model("fetch:smollm2")
        out["smollm2"] = (smol, token_windows("wikitext2:test", 4 * 256, 256, smol.tokenizer), _hf_twin())
    return out


def _hf_twin():
    """transformers' LlamaForCausalLM from the GGUF file that `fetch:smollm2` loads (float32, eval)."""
    import torch
    import transformers

    from diffquant.io.fetch import fetch_smollm2

    path = fetch_smollm2(quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _hf_hook(model):
    """The peer of `lean` on the transformers model: residual stream abs-max per channel, one hook per
    decoder layer (its output is a tuple whose first element is the hidden state, in transformers < 4.56)."""
    import torch

    state = {"absmax": None}

    def hook(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        amax = h.detach().abs().amax(dim=(0, 1))
        state["absmax"] = amax if state["absmax"] is None else torch.maximum(state["absmax"], amax)

    return [layer.register_forward_hook(hook) for layer in model.model.layers]


def _lean_hook(model):
    """The floor: one hook per layer output keeping channel abs-max, the top-1 magnitude and a median."""
    import torch

    state = {"absmax": None, "top": 0.0, "medians": []}

    def hook(module, args, out):
        a = out.detach().abs().float()
        amax = a.amax(dim=(0, 1))
        state["absmax"] = amax if state["absmax"] is None else torch.maximum(state["absmax"], amax)
        state["top"] = max(state["top"], float(amax.max()))
        state["medians"].append(float(a.flatten()[:: max(1, a.numel() // 4096)].median()))

    return [block.resid.register_forward_hook(hook) for block in model.layers]


def _time_mode(mode: str, model, quantized, ids, batch: int, twin=None) -> float:
    import torch

    from diffquant.profile.runner import profile_model

    start = time.perf_counter()
    with torch.no_grad():
        if mode in PEERS:
            handles = _hf_hook(twin) if mode == "hf+hook" else []
            for i in range(0, ids.shape[0], batch):
                twin(input_ids=ids[i : i + batch], use_cache=False)
            for h in handles:
                h.remove()
        elif mode in SITES:
            profile_model(model, ids, batch_size=batch, sites=SITES[mode])
        else:
            target = quantized if mode == "w8a8" else model
            handles = _lean_hook(model) if mode == "lean" else []
            for i in range(0, ids.shape[0], batch):
                target(ids[i : i + batch])
            for h in handles:
                h.remove()
    return time.perf_counter() - start


def speed(args: argparse.Namespace) -> dict:
    import copy

    import torch

    from diffquant.quant import QuantPlan, apply_plan

    torch.set_num_threads(args.threads)
    results = {}
    for name, (model, ids, twin) in _models(not args.no_real).items():
        quantized = copy.deepcopy(model)
        apply_plan(quantized, QuantPlan.load("w8a8"))
        quantized.eval()
        modes = MODES + (PEERS if twin is not None else ())
        for mode in modes:  # warm-up: first calls allocate and import
            _time_mode(mode, model, quantized, ids[:2], args.batch, twin)
        times = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                times[mode].append(_time_mode(mode, model, quantized, ids, args.batch, twin))
        plain = statistics.median(times["plain"])
        results[name] = {
            "tokens": ids.numel(),
            "seconds": {m: statistics.median(t) for m, t in times.items()},
            "ratio": {m: statistics.median(t) / plain for m, t in times.items()},
            "all_rounds": times,
        }
        if twin is not None:
            hf = statistics.median(times["hf"])
            results[name]["ratio_vs_hf"] = {m: statistics.median(t) / hf for m, t in times.items()}
        del quantized, twin
    return results


def memory_child(args: argparse.Namespace) -> None:
    import torch

    from diffquant.io import load_model
    from diffquant.profile.runner import profile_model

    torch.set_num_threads(args.threads)
    model = load_model("init:diff_v2:small")
    ids = torch.randint(0, 256, (args.windows, 256), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    profile_model(model, ids, batch_size=args.batch, sites=["*"])
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child of a parent that held
    # SmolLM2 would report the parent's peak.
    status = Path("/proc/self/status").read_text()
    hwm_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    rss = hwm_kib / 1024
    print(json.dumps({"tokens": ids.numel(), "seconds": time.perf_counter() - start, "peak_rss_mib": rss}))


def memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for windows in (8, 80):
        cmd = [sys.executable, __file__, "--memory-child", "--windows", str(windows)]
        cmd += ["--threads", str(args.threads), "--batch", str(args.batch)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-real", action="store_true", help="skip SmolLM2")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--windows", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args)
        return
    results = speed(args)
    mem = memory(args)
    names = list(results)
    print(
        f"ratio = median time / median plain forward, {args.rounds} interleaved rounds, {args.threads} threads"
    )
    peers = [n for n in names if "ratio_vs_hf" in results[n]]
    print(
        f"{'mode':<14}"
        + "".join(f"{n:>12}{'target':>9}" for n in names)
        + "".join(f"{n + ' vs hf':>16}" for n in peers)
    )
    for mode in MODES + PEERS:
        cells = ""
        for n in names:
            target = TARGETS.get(mode, (None, None))[0 if n == "small" else 1]
            ratio = results[n]["ratio"].get(mode)
            cells += (f"{ratio:>12.2f}" if ratio is not None else f"{'-':>12}") + (
                f"{'<= ' + str(target):>9}" if target else f"{'':>9}"
            )
        cells += "".join(f"{results[n]['ratio_vs_hf'][mode]:>16.2f}" for n in peers)
        print(f"{mode:<14}{cells}")
    for n in names:
        print(
            f"{n}: plain forward {results[n]['seconds']['plain']:.3f} s for {results[n]['tokens']:,} tokens"
        )
    print(
        "profile `*` of small, peak RSS: "
        + ", ".join(f"{r['tokens']:,} tokens {r['peak_rss_mib']:.0f} MiB" for r in mem)
    )
    out = Path(__file__).with_name("bench.json")
    out.write_text(
        json.dumps({"args": vars(args), "speed": results, "memory": mem, "targets": TARGETS}, indent=1) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
