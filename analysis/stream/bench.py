"""Memory benchmark of the layer-streamed run (diffquant.stream), under a real memory limit.

Writes a random Llama (bf16) as a sharded hf: folder, one shard per layer, never holding the whole model.
Then runs the command line, each command a child process under an address-space limit (``ulimit -v``,
RLIMIT_AS; default 2 GiB, smaller than the weights):

* ``diffquant info``: weights bytes and the ``--stream auto`` decision, from the headers (no weights read);
* ``diffquant profile --sites kind:resid kind:logits --stream on`` and ``diffquant eval --task bpb
  --stream on``: peak RSS (the child's ru_maxrss) against the largest layer's bytes plus the hidden
  states of all windows plus 600 MB;
* the same profile with ``--stream off`` (must fail cleanly: one line, exit 2) and ``--stream auto``
  (must stream, and say so).

Prints a table and writes bench.json next to this file.

    python analysis/stream/bench.py                 # ~0.3B parameters
    python analysis/stream/bench.py --size 1.5b     # ~1.5B parameters, ~2.7 GiB bf16 (the README's table)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def run_limited(cmd: list[str], limit: int) -> dict:
    """Run ``cmd`` under RLIMIT_AS = ``limit``; its exit code, wall time, peak RSS and output."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=cap, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "cmd": " ".join(cmd[2:]),
            "rc": proc.returncode,
            "wall_s": time.perf_counter() - t0,
            "peak_rss": usage.ru_maxrss * 1024,  # kB on Linux
            "stdout": out.read(),
            "stderr": err.read(),
        }


def layer_bytes(config: ModelConfig) -> int:
    """Bytes of one decoder layer in bf16 (attention + MLP + two norms)."""
    d, q, kv, f = (
        config.d_model,
        config.n_heads * config.head_dim,
        config.n_kv_heads * config.head_dim,
        config.ffn_dim,
    )
    return 2 * (d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.3b")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--limit-gib", type=float, default=2.0, help="address-space limit of each command")
    args = ap.parse_args()
    limit = int(args.limit_gib * 2**30)
    cli = [sys.executable, "-m", "diffquant.cli"]
    with tempfile.TemporaryDirectory(prefix="diffquant-stream-bench-") as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        config, total = write_model(folder, args.size)
        t_write = time.perf_counter() - t0
        spec = f"hf:{folder}"
        window = ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
        profile = [
            *cli,
            "profile",
            spec,
            "--sites",
            "kind:resid",
            "kind:logits",
            "--tokens",
            str(args.tokens),
        ]
        profile += [*window, "--topk", "8"]
        runs = {
            "info": run_limited([*cli, "info", spec], limit),
            "profile_on": run_limited([*profile, "--stream", "on", "--out", f"{tmp}/p-on"], limit),
            "eval_on": run_limited(
                [*cli, "eval", spec, "--task", f"bpb:tokens={args.tokens},seq_len={args.seq_len}"]
                + ["--batch-size", str(args.batch_size), "--stream", "on", "--out", f"{tmp}/e-on"],
                limit,
            ),
            "profile_off": run_limited([*profile, "--stream", "off", "--out", f"{tmp}/p-off"], limit),
            "profile_auto": run_limited([*profile, "--stream", "auto", "--out", f"{tmp}/p-auto"], limit),
        }
    for name in ("info", "profile_on", "eval_on", "profile_auto"):
        if runs[name]["rc"] != 0:
            sys.exit(f"{name} failed (rc {runs[name]['rc']}):\n{runs[name]['stderr'][-3000:]}")
    off = runs["profile_off"]
    off_lines = [line for line in off["stderr"].splitlines() if line.strip()]
    auto_said = [line for line in runs["profile_auto"]["stderr"].splitlines() if "--stream auto" in line]
    hidden = (args.tokens // args.seq_len) * args.seq_len * config.d_model * 2  # bf16, every window held
    layer = layer_bytes(config)
    bound = layer + hidden + 600 * MB
    peak = max(runs["profile_on"]["peak_rss"], runs["eval_on"]["peak_rss"])
    r = {
        "size": args.size,
        "parameters": total // 2,
        "weights_bytes": total,
        "limit_bytes": limit,
        "largest_layer_bytes": layer,
        "hidden_bytes": hidden,
        "bound_bytes": bound,
        "peak_rss_profile": runs["profile_on"]["peak_rss"],
        "peak_rss_eval": runs["eval_on"]["peak_rss"],
        "within_bound": peak <= bound,
        "write_s": t_write,
        "profile_s": runs["profile_on"]["wall_s"],
        "eval_s": runs["eval_on"]["wall_s"],
        "off": {"rc": off["rc"], "stderr_lines": off_lines},
        "auto": {"rc": runs["profile_auto"]["rc"], "said": auto_said},
        "info_stream_line": next(
            (line for line in runs["info"]["stdout"].splitlines() if line.startswith("stream")), ""
        ),
        "eval_stdout": runs["eval_on"]["stdout"].strip().splitlines()[-3:],
    }
    rows = [
        ("parameters", f"{total // 2 / 1e6:,.0f} M"),
        ("weights (bf16)", f"{total / MB:,.0f} MB"),
        ("address-space limit (ulimit -v)", f"{limit / MB:,.0f} MB"),
        ("largest layer", f"{layer / MB:,.1f} MB"),
        ("hidden states (all windows)", f"{hidden / MB:,.1f} MB"),
        ("bound: layer + hidden + 600 MB", f"{bound / MB:,.0f} MB"),
        ("peak RSS, profile --stream on", f"{r['peak_rss_profile'] / MB:,.0f} MB ({r['profile_s']:.1f} s)"),
        ("peak RSS, eval bpb --stream on", f"{r['peak_rss_eval'] / MB:,.0f} MB ({r['eval_s']:.1f} s)"),
        ("within the bound", "yes" if r["within_bound"] else "NO"),
        ("profile --stream off", f"exit {off['rc']}, {len(off_lines)} line(s) on stderr"),
        ("profile --stream auto", f"exit {r['auto']['rc']}, streamed: {'yes' if auto_said else 'NO'}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in off_lines + auto_said + [r["info_stream_line"]]:
        print(line)
    (Path(__file__).parent / "bench.json").write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
