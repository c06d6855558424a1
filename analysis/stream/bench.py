"""Memory benchmark of the layer-streamed run (diffquant.stream).

Writes a random Llama (bf16) as a sharded hf: folder, one shard per layer, never holding the whole model;
then, in a child process, profiles it (sites kind:resid and kind:logits) and evaluates it streamed, and
reports the child's peak RSS (VmHWM of /proc/self/status) against the largest stage's weight bytes plus
the hidden states. The whole-model load is refused by :func:`diffquant.stream.would_stream` under a budget
smaller than the weights. Prints a table and writes bench.json next to this file.

    python analysis/stream/bench.py                 # ~0.3B parameters (CPU: a few minutes)
    python analysis/stream/bench.py --size 1.5b     # ~1.5B parameters, ~3 GB bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from diffquant.io.convert_hf import hf_config  # noqa: E402
from diffquant.models.config import ModelConfig  # noqa: E402
from diffquant.models.hf_names import hf_key_map  # noqa: E402

SIZES = {
    "tiny": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, ffn_dim=704, vocab_size=259),
    "0.3b": dict(
        d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=64, ffn_dim=2816, vocab_size=259
    ),
    "1.5b": dict(
        d_model=2048, n_layers=28, n_heads=16, n_kv_heads=16, head_dim=128, ffn_dim=5632, vocab_size=259
    ),
}
MB = 2**20


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def write_model(folder: Path, size: str, seed: int = 0) -> tuple[ModelConfig, int]:
    """A random Llama in bf16 as config.json + one shard per layer + index; returns (config, bytes)."""
    config = ModelConfig(max_seq_len=512, **SIZES[size])
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf_config(config, torch.bfloat16), indent=2))
    keys = hf_key_map(config)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        from diffquant.models.transformer import DecoderLM

        shapes = {k: tuple(v.shape) for k, v in DecoderLM(config).state_dict().items()}
    groups: dict[str, list[str]] = {}
    for native in keys:
        stage = ".".join(native.split(".")[:2]) if native.startswith("layers.") else native.split(".")[0]
        groups.setdefault(stage, []).append(native)
    weight_map, total = {}, 0
    for n, natives in enumerate(groups.values()):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for native in natives:
            shape = shapes[native]
            if native.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                t = torch.randn(shape, generator=g) * 0.02
            part[keys[native]] = t.to(torch.bfloat16)
            total += part[keys[native]].numel() * 2
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return config, total


def child(folder: str, windows: int, seq_len: int, batch_size: int) -> None:
    from diffquant.stream import evaluate_streamed, profile_streamed, would_stream

    spec = f"hf:{folder}"
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (windows, seq_len), generator=g)
    before = vm_hwm()
    t0 = time.perf_counter()
    stats: dict = {}
    prof = profile_streamed(
        spec, ids, sites=["kind:resid", "kind:logits"], batch_size=batch_size, topk=8, stats=stats
    )
    t_profile = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev_stats: dict = {}
    result = evaluate_streamed(spec, ids, batch_size=batch_size, stats=ev_stats)
    t_eval = time.perf_counter() - t0
    weights = sum(stats["stage_bytes"].values()) - stats["stage_bytes"].get("head", 0)
    refused = would_stream(spec, budget_bytes=weights // 2)
    print(
        json.dumps(
            {
                "peak_rss": vm_hwm(),
                "rss_after_import": before,
                "largest_stage_bytes": max(stats["stage_bytes"].values()),
                "largest_layer_bytes": max(
                    v for k, v in stats["stage_bytes"].items() if k.startswith("layers.")
                ),
                "hidden_peak_bytes": max(stats["hidden_peak_bytes"], ev_stats["hidden_peak_bytes"]),
                "profile_s": t_profile,
                "eval_s": t_eval,
                "sites": len(prof.sites),
                "perplexity": result["perplexity"],
                "bits_per_byte": result["bits_per_byte"],
                "whole_load_under_half_budget": {"stream": refused[0], "reason": refused[2]},
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.3b")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.windows, args.seq_len, args.batch_size)
        return
    with tempfile.TemporaryDirectory(prefix="diffquant-stream-bench-") as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        config, total = write_model(folder, args.size)
        t_write = time.perf_counter() - t0
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(folder),
            "--windows",
            str(args.windows),
            "--seq-len",
            str(args.seq_len),
            "--batch-size",
            str(args.batch_size),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        out = proc.stdout.strip().splitlines()[-1]
        r = json.loads(out)
    params = total // 2
    r.update(
        size=args.size,
        parameters=params,
        weights_bytes=total,
        write_s=t_write,
        windows=args.windows,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    # Peak RSS minus the process's baseline (torch + diffquant imported) against the stage + hidden budget.
    bound = r["largest_stage_bytes"] + r["hidden_peak_bytes"] + 600 * MB
    r["bound_bytes"] = bound
    r["peak_over_baseline"] = r["peak_rss"] - r["rss_after_import"]
    r["within_bound"] = r["peak_over_baseline"] <= bound
    rows = [
        ("parameters", f"{params / 1e6:,.0f} M"),
        ("weights (bf16)", f"{total / MB:,.0f} MB"),
        ("largest layer", f"{r['largest_layer_bytes'] / MB:,.1f} MB"),
        ("largest stage (embed / head)", f"{r['largest_stage_bytes'] / MB:,.1f} MB"),
        ("hidden states (peak held)", f"{r['hidden_peak_bytes'] / MB:,.1f} MB"),
        ("peak RSS (VmHWM)", f"{r['peak_rss'] / MB:,.0f} MB"),
        ("RSS after imports", f"{r['rss_after_import'] / MB:,.0f} MB"),
        ("peak - baseline", f"{r['peak_over_baseline'] / MB:,.0f} MB"),
        (
            "bound: stage + hidden + 600 MB",
            f"{bound / MB:,.0f} MB ({'ok' if r['within_bound'] else 'EXCEEDED'})",
        ),
        ("write / profile / eval", f"{t_write:.1f} s / {r['profile_s']:.1f} s / {r['eval_s']:.1f} s"),
        (
            "whole load, budget = weights / 2",
            "refused -> stream" if r["whole_load_under_half_budget"]["stream"] else "allowed",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    (Path(__file__).parent / "bench.json").write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
