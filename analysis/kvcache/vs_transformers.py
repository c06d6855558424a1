"""diffquant's 4-bit KV cache against transformers' ``QuantizedCache`` (quanto backend) on SmolLM2-135M: which
difference makes transformers' default cache lose about as little as diffquant's KIVI ``kv4`` (issue 47).

Decode-mode perplexity as ``diffquant run kv-cache`` measures it, on the first 2 of its 4 disjoint windows of
1,024 tokens of WikiText-2 test (``token_stream("wikitext2:test", 4096, tokenizer)``): each window's first 256
tokens are prefilled in one forward, then one token per forward through the cache, and the 767 targets at
positions 257..1023 are scored. The references are whole-window forwards (an unquantized cache gives the same
values within 1e-6), once in diffquant and once in transformers, which must agree.

Configurations (each is 767 forwards of a batch of the 2 windows):

- ``hf-quanto``: ``QuantizedCache("quanto", nbits=4)`` with transformers' defaults (axis_key 0, axis_value 0,
  q_group_size 64, residual_length 128): keys and values in groups of 64 channels of one token (one group per
  head and token, SmolLM2's heads are 64 wide);
- ``hf-quanto-k-1``: axis_key -1 (keys in groups of 64 tokens of one channel);
- ``hf-quanto-k-1-g32``: axis_key -1 and q_group_size 32: KIVI's grouping, diffquant's ``kv4``;
- ``dq-kv4``: diffquant's ``kv4`` (keys per channel, values per token, groups of 32, a 128-token window);
- ``dq-token-g64``: keys and values per token in groups of 64 (transformers' default grouping);
- ``dq-channel-g64``: keys per channel, values per token, groups of 64 (``hf-quanto-k-1``'s grouping);
- ``dq-token-keys``: ``kv4-token-keys`` (keys and values per token, groups of 32).

Each line prints the perplexity of the 2 x 767 targets, its change against the unquantized model, the change
per window, and two paired standard errors of the change from the per-token NLL differences (sd / sqrt(n),
through exp: tokens of one text are not independent, so this understates the noise somewhat). Pairs of
configurations that compute the same cache are compared token by token, and fed the same K / V to show that
what differs between them is the two models' float rounding, not the caches.

    nice -n 10 python analysis/kvcache/vs_transformers.py [--json analysis/kvcache/vs_transformers.json]

writes that JSON and the printed table beside it (vs_transformers.txt).

Per-token results are kept in --work (default /tmp/diffquant-vs-transformers) so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PREFILL = 256
SEQ_LEN = 1024
WINDOWS = 2

# name -> (engine, settings): quanto QuantizedCache arguments, or a diffquant kv_cache section
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf-quanto": ("hf", {"axis_key": 0, "axis_value": 0, "q_group_size": 64}),
    "hf-quanto-k-1": ("hf", {"axis_key": -1, "axis_value": 0, "q_group_size": 64}),
    "hf-quanto-k-1-g32": ("hf", {"axis_key": -1, "axis_value": 0, "q_group_size": 32}),
    "dq-kv4": ("dq", {"keys": "channel", "values": "token", "group": 32}),
    "dq-token-g64": ("dq", {"keys": "token", "values": "token", "group": 64}),
    "dq-channel-g64": ("dq", {"keys": "channel", "values": "token", "group": 64}),
    "dq-token-keys": ("dq", {"keys": "token", "values": "token", "group": 32}),
}
# configurations that quantize the same groups on the same schedule, so should give the same NLLs
SAME = (("hf-quanto-k-1-g32", "dq-kv4"), ("hf-quanto", "dq-token-g64"), ("hf-quanto-k-1", "dq-channel-g64"))
# configurations that differ in one thing: keys per token vs per channel, groups of 64 vs 32
COMPARE = (
    ("hf-quanto", "hf-quanto-k-1"),
    ("hf-quanto-k-1", "hf-quanto-k-1-g32"),
    ("dq-token-keys", "dq-kv4"),
    ("dq-token-g64", "dq-token-keys"),
)


def windows(tokenizer, seq_len: int = SEQ_LEN) -> Any:
    """The first WINDOWS disjoint windows of kv-cache's ppl-decode stream, cut to their first ``seq_len``
    tokens (a shorter length only for a quick check of the script): (WINDOWS, seq_len)."""
    from diffquant.data import token_stream

    stream = token_stream("wikitext2:test", 4096, tokenizer)
    return stream[: WINDOWS * SEQ_LEN].view(WINDOWS, SEQ_LEN)[:, :seq_len]


def nll_of(logits, targets):
    """Per-target negative log-likelihood (nats, float64) of ``targets`` under ``logits`` (B, T, V)."""
    import torch

    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def hf_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def hf_full(model, ids):
    """Targets 257..1023 from one forward over each whole window (no cache)."""
    return nll_of(model(input_ids=ids).logits[:, PREFILL:-1], ids[:, PREFILL + 1 :])


def hf_decode(model, ids, settings: dict[str, Any]):
    """Targets 257..1023 decoded one token a step through transformers' QuantizedCache (quanto, 4 bits)."""
    import torch
    from transformers import QuantizedCache

    cache = QuantizedCache("quanto", model.config, nbits=4, residual_length=128, **settings)
    model(input_ids=ids[:, :PREFILL], past_key_values=cache, use_cache=True)
    out = []
    for t in range(PREFILL, ids.shape[1] - 1):
        logits = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
        out.append(nll_of(logits[:, -1:], ids[:, t + 1 : t + 2]))
    return torch.cat(out, dim=1)


def dq_full(model, ids):
    from diffquant.eval.perplexity import target_logprobs

    return -target_logprobs(model, ids)[:, PREFILL:].double()


def dq_decode(settings: dict[str, Any], ids):
    """Targets 257..1023 through diffquant's quantized cache (a plan with only a kv_cache section)."""
    from diffquant.eval.perplexity import decode_logprobs
    from diffquant.io import load_model
    from diffquant.quant import QuantPlan, apply_plan

    model = load_model("fetch:smollm2").eval()
    section = {"format": "int4", "window": 128, **settings}
    apply_plan(model, QuantPlan.from_dict({"name": "vs-hf", "kv_cache": section}))
    return -decode_logprobs(model, ids, PREFILL)[:, PREFILL:].double()


def cached(work: Path, name: str, compute: Callable[[], Any] | None = None) -> list[list[float]]:
    """Per-window per-token NLLs of ``name``, computed once and kept in ``work`` (read only: no compute)."""
    path = work / f"{name}.json"
    if path.exists() or compute is None:
        return json.loads(path.read_text())
    nll = compute().tolist()
    path.write_text(json.dumps(nll))
    return nll


def change(nll: list[list[float]], base: list[list[float]]) -> dict[str, Any]:
    """Perplexity, its change, the change per window and 2 paired s.e. from per-token NLL differences."""
    flat = [x for row in nll for x in row]
    ref = [x for row in base for x in row]
    diffs = [a - b for a, b in zip(flat, ref, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    ppl, ppl0 = math.exp(sum(flat) / n), math.exp(sum(ref) / n)
    per_window = [
        math.exp(sum(a) / len(a)) - math.exp(sum(b) / len(b)) for a, b in zip(nll, base, strict=True)
    ]
    return {
        "perplexity": ppl,
        "change": ppl - ppl0,
        "two_se": 2 * ppl * sd / math.sqrt(n),
        "per_window": per_window,
        "n_tokens": n,
    }


def same_inputs_gap(hf_settings: dict[str, Any], dq_settings: dict[str, Any], seed: int = 0) -> float:
    """The largest difference between the keys / values the two caches return at any step when both are fed
    the same K / V (random, SmolLM2's 3 heads of 64, one outlier channel and a large first token), prefill
    256 then 767 single tokens: what is left when the two models' float differences are taken away."""
    import torch
    from transformers.cache_utils import QuantoQuantizedLayer

    from diffquant.quant.kv_cache import KVCacheSpec, QuantizedLayerKV

    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 1, 3, SEQ_LEN, 64, generator=gen)
    k[..., 5] *= 20
    k[:, :, 0] *= 10
    hf = QuantoQuantizedLayer(nbits=4, residual_length=128, **hf_settings)
    dq = QuantizedLayerKV(KVCacheSpec(format="int4", window=128, **dq_settings))
    gap = 0.0
    for a, b in [(0, PREFILL), *((t, t + 1) for t in range(PREFILL, SEQ_LEN - 1))]:
        pairs = zip(hf.update(k[:, :, a:b], v[:, :, a:b]), dq.append(k[:, :, a:b], v[:, :, a:b]), strict=True)
        gap = max(gap, *(float((x - y).abs().max()) for x, y in pairs))
    return gap


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def paired(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    """Two configurations on the same targets: the largest per-token NLL difference, and the mean NLL
    difference (a - b) with two paired standard errors, in nats and as a perplexity difference."""
    d = [x - y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    n = len(d)
    mean = sum(d) / n
    two_se = 2 * math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    ppl_a = math.exp(sum(map(sum, a)) / n)
    ppl_b = math.exp(sum(map(sum, b)) / n)
    # the first flush quantizes the window at the step that feeds token 383; targets up to 384 never read it
    before = max_gap([r[: 384 - PREFILL] for r in a], [r[: 384 - PREFILL] for r in b])
    return {
        "max_nll_gap": max_gap(a, b),
        "max_nll_gap_before_first_flush": before,
        "mean_nll_diff": mean,
        "two_se": two_se,
        "ppl_diff": ppl_a - ppl_b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("vs_transformers.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/diffquant-vs-transformers"))
    parser.add_argument("--only", nargs="*", default=None, help="configurations to run (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="a shorter window for a quick check")
    args = parser.parse_args()

    from importlib.metadata import version

    import torch

    from diffquant.io import load_model
    from diffquant.io.fetch import fetch_smollm2

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = fetch_smollm2(quiet=True)
    dq = load_model("fetch:smollm2").eval()
    ids = windows(dq.tokenizer, args.seq_len)
    hf = hf_model(gguf)
    with torch.no_grad():
        base = cached(args.work, "dq-none", lambda: dq_full(dq, ids))
        hf_base = cached(args.work, "hf-none", lambda: hf_full(hf, ids))
        results: dict[str, Any] = {}
        for name, (engine, settings) in CONFIGS.items():
            if args.only is not None and name not in args.only:
                continue
            if engine == "hf":
                nll = cached(args.work, name, lambda s=settings: hf_decode(hf, ids, s))
            else:
                nll = cached(args.work, name, lambda s=settings: dq_decode(s, ids))
            results[name] = {"engine": engine, "settings": settings, **change(nll, base)}
            print(name, {k: v for k, v in results[name].items() if k != "settings"}, flush=True)
        same = {
            f"{a} vs {b}": paired(cached(args.work, a), cached(args.work, b))
            for a, b in SAME + COMPARE
            if (args.work / f"{a}.json").exists() and (args.work / f"{b}.json").exists()
        }
        for a, b in SAME:
            if f"{a} vs {b}" in same:
                same[f"{a} vs {b}"]["same_inputs_max_gap"] = same_inputs_gap(CONFIGS[a][1], CONFIGS[b][1])
    doc = {
        "what": "SmolLM2-135M decode perplexity, wikitext2:test windows 0-1 of 4 x 1024, 256 prefilled, "
        "targets 257..1023 (2 x 767), 4-bit KV caches; change vs the unquantized whole-window forward",
        "versions": {name: version(name) for name in ("torch", "transformers", "optimum-quanto")},
        "unquantized": {
            "perplexity": math.exp(sum(map(sum, base)) / sum(map(len, base))),
            "per_window": [math.exp(sum(row) / len(row)) for row in base],
            "transformers_max_nll_gap": max_gap(base, hf_base),
        },
        "configs": results,
        "pairs": same,
    }
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    args.json.with_suffix(".txt").write_text(table(doc) + "\n")
    print(table(doc))


def table(doc: dict[str, Any]) -> str:
    """The printed table (vs_transformers.txt): one row per configuration."""
    none = doc["unquantized"]
    lines = [
        f"unquantized perplexity {none['perplexity']:.4f} (windows {', '.join(f'{p:.4f}' for p in none['per_window'])}); "
        f"transformers' whole-window NLLs within {none['transformers_max_nll_gap']:.1e}",
        f"{'config':<19} {'perplexity':>10} {'change':>8} {'2 s.e.':>7}  per window",
    ]
    for name, r in doc["configs"].items():
        windows_ = " ".join(f"{c:+.4f}" for c in r["per_window"])
        lines.append(
            f"{name:<19} {r['perplexity']:>10.4f} {r['change']:>+8.4f} {r['two_se']:>7.4f}  {windows_}"
        )
    for pair, r in doc["pairs"].items():
        line = (
            f"{pair}: perplexity {r['ppl_diff']:+.4f}, mean NLL {r['mean_nll_diff']:+.5f} ± {r['two_se']:.5f} "
            f"(2 paired s.e.), largest per-token {r['max_nll_gap']:.2e} ({r['max_nll_gap_before_first_flush']:.1e} "
            "before the first flush)"
        )
        if "same_inputs_max_gap" in r:
            line += f"; the same K / V fed to both caches: largest difference {r['same_inputs_max_gap']:.1e}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
