"""Mutation check: plant plausible bugs one at a time and see whether the tests that guard them fail.

Each mutant is (module, exact text, replacement, the tests that should catch it). The committed tree is
exported (``git archive HEAD``) into a temporary folder; for every mutant one file there is edited, the
listed tests run against that copy (``PYTHONPATH`` puts it ahead of the installed package, checked), and
the file is restored. A mutant is *killed* when a test fails (pytest exit 1), *survived* when they pass, an
*error* when pytest could not run them (collection error: fix the test list); a mutant whose
text is no longer in the source is reported as *stale* (fix the list, not the code). Prints a table and
writes results.json beside this file.

    python analysis/mutation/check.py [--only SUBSTRING] [--jobs 1]

The mutants are the ones the tests-that-bite issue listed (each had survived once) plus the numerical core:
DIFF attention, rounding, scales, statistics, merges, perplexity, resume, smoothing. Set
OMP_WAIT_POLICY=PASSIVE on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


M = Mutant
MUTANTS = [
    # --- calibration (issue: percentile replaced by absmax, worst MSE clip, wrong percentile tail)
    M(
        "percentile clip -> absmax",
        "diffquant/quant/observers.py",
        "        return _percentile_clip(self.hist, self.percentile).to(amax.dtype).reshape(amax.shape)",
        "        return amax",
        ("tests/test_quant.py::test_percentile_clip_is_the_exact_quantile_within_one_bin",),
    ),
    M(
        "MSE search picks the worst clip",
        "diffquant/quant/observers.py",
        "torch.argmin(err)",
        "torch.argmax(err)",
        ("tests/test_quant.py::test_mse_clip_is_near_the_brute_force_optimum_on_the_data",),
    ),
    M(
        "percentile from the wrong tail",
        "diffquant/quant/observers.py",
        "rank = torch.ceil(total * percentile / 100.0)",
        "rank = torch.ceil(total * (100.0 - percentile) / 100.0)",
        ("tests/test_quant.py::test_percentile_clip_is_the_exact_quantile_within_one_bin",),
    ),
    # --- presets at model level (issue: contents of fp8 / w4a16 / mxfp4 / nvfp4, NVFP4 / E8M0 scales)
    M(
        "fp8 preset weights per tensor",
        "diffquant/quant/presets.py",
        '{"weights": ["layers.*"], "scheme": "fp8_e4m3:channel"}',
        '{"weights": ["layers.*"], "scheme": "fp8_e4m3:tensor"}',
        ("tests/test_presets_reference.py",),
    ),
    M(
        "w4a16 groups of 64",
        "diffquant/quant/presets.py",
        '"rules": [{"weights": ["layers.*"], "scheme": "int4:group(32)"}],',
        '"rules": [{"weights": ["layers.*"], "scheme": "int4:group(64)"}],',
        ("tests/test_presets_reference.py",),
    ),
    M(
        "mxfp4 preset activations in mxfp6",
        "diffquant/quant/presets.py",
        '{"sites": ["layers.*.input"], "scheme": "mxfp4"}',
        '{"sites": ["layers.*.input"], "scheme": "mxfp6_e2m3"}',
        ("tests/test_presets_reference.py",),
    ),
    M(
        "nvfp4 preset activations in mxfp4",
        "diffquant/quant/presets.py",
        '{"sites": ["layers.*.input"], "scheme": "nvfp4"}',
        '{"sites": ["layers.*.input"], "scheme": "mxfp4"}',
        ("tests/test_presets_reference.py",),
    ),
    M(
        "NVFP4 block scale rounded up",
        "diffquant/formats.py",
        "scales = _E4M3.round(amax / (elem.max_value * s_t))",
        "scales = e4m3_round_up(amax / (elem.max_value * s_t))",
        ("tests/test_presets_reference.py", "tests/test_formats.py"),
    ),
    M(
        "E8M0 shared exponent one too high",
        "diffquant/formats.py",
        "k = (_floor_log2(amax) - elem.emax)",
        "k = (_floor_log2(amax) - elem.emax + 1)",
        ("tests/test_presets_reference.py", "tests/test_formats.py"),
    ),
    M(
        "asymmetric scale: subnormal step kept",
        "diffquant/formats.py",
        "scale = torch.where(scale >= _MIN_NORMAL, scale, torch.ones_like(scale))\n    zero_point",
        "scale = torch.where(scale > 0, scale, torch.ones_like(scale))\n    zero_point",
        ("tests/test_formats.py",),
    ),
    M(
        "integer rounding floors",
        "diffquant/quant/schemes.py",
        "q = torch.div(xf, scale).round_()",
        "q = torch.div(xf, scale).floor_()",
        ("tests/test_quant.py", "tests/test_presets_reference.py"),
    ),
    M(
        "causal mask ignored in dynamic scales",
        "diffquant/quant/schemes.py",
        "        mag.masked_fill_(~valid.to(device=mag.device, dtype=torch.bool).expand_as(mag), 0.0)",
        "        pass",
        ("tests/test_quant.py::test_per_tensor_int4_zeroes_small_logits_per_row_keeps_them",),
    ),
    M(
        "fast path drops the clamp of saturated scales",
        "diffquant/quant/schemes.py",
        'in_range=scheme.scale_format == "fp32")',
        "in_range=True)",
        ("tests/test_quant.py::test_fake_quant_fast_path_is_bit_identical",),
    ),
    # --- attention
    M(
        "DIFF V1 lambda: + instead of -",
        "diffquant/models/attention.py",
        "return lam1 - lam2 + self.lambda_init",
        "return lam1 + lam2 + self.lambda_init",
        ("tests/test_attention_reference.py",),
    ),
    M(
        "DIFF V1 lambda_init schedule",
        "diffquant/models/config.py",
        "return 0.8 - 0.6 * math.exp(-0.3 * depth)",
        "return 0.8 - 0.6 * math.exp(-0.3 * (depth + 1))",
        ("tests/test_attention_reference.py",),
    ),
    M(
        "RoPE positions ignore the cache",
        "diffquant/models/attention.py",
        "positions = torch.arange(pos0, pos0 + t, device=x.device)",
        "positions = torch.arange(0, t, device=x.device)",
        ("tests/test_attention_reference.py",),
    ),
    M(
        "Triton kernel: lambda sign",
        "diffquant/kernels/dispatch.py",
        "q, k, v, lam.squeeze(-1), quant=core",
        "q, k, v, -lam.squeeze(-1), quant=core",
        ("tests/test_attention_reference.py::test_triton_kernel_matches_reference",),
    ),
    # --- statistics
    M(
        "top-k merge keeps arrival order",
        "diffquant/profile/accumulators.py",
        "return sorted(a + b, key=entry_key)[:cap]",
        "return (a + b)[:cap]",
        ("tests/test_stats.py",),
    ),
    M(
        "moments merge: M2 without the mean shift",
        "diffquant/profile/accumulators.py",
        "m2 = m2a + m2b + d * d * fa * fb / fn",
        "m2 = m2a + m2b",
        ("tests/test_stats.py",),
    ),
    M(
        "gathered map index not mapped back",
        "diffquant/profile/stats.py",
        "* (t * s) + visible[ci % width]",
        "* (t * s) + ci % width",
        ("tests/test_stats.py",),
    ),
    M(
        "Table 5 hidden states from the MLP activations",
        "diffquant/profile/tables.py",
        '"hidden states": "resid"',
        '"hidden states": "mlp_act"',
        ("tests/test_profiler.py",),
    ),
    # --- evaluation, data, training, resume
    M(
        "bits per byte divides by tokens",
        "diffquant/data/scoring.py",
        '"bits_per_byte": nats / math.log(2) / self.n_bytes,',
        '"bits_per_byte": nats / math.log(2) / self.n_scored,',
        ("tests/test_perplexity.py",),
    ),
    M(
        "default seq_len ignores the trained context",
        "diffquant/data/scoring.py",
        "seq_len = min(max_seq_len, DEFAULT_SEQ_LEN, trained or max_seq_len)",
        "seq_len = min(max_seq_len, DEFAULT_SEQ_LEN)",
        ("tests/test_perplexity.py",),
    ),
    M(
        "fingerprint without document names",
        "diffquant/data/corpus.py",
        "        h.update(name)\n",
        "",
        ("tests/test_data.py",),
    ),
    M(
        "card val bpb measured on the training data",
        "diffquant/train/trainer.py",
        'val = _val_bpb(shipped, cfg, streams["eval_data"])',
        'val = _val_bpb(shipped, cfg, streams["data"])',
        ("tests/test_train.py::test_card_measures_the_exported_weights",),
    ),
    M(
        "sweep resume ignores the content key",
        "diffquant/eval/sweep.py",
        'if key in idents and record.get("ident") == idents[key][0]:',
        "if key in idents:",
        ("tests/test_sweep.py",),
    ),
    # --- figures: the plotted values (issue: never checked for hist, layerwise, degradation, act-scales)
    M(
        "layerwise plots top-1 for every statistic",
        "diffquant/plots/layers.py",
        'pts = [(r["layer"], r[stat]) for r in rows if r[stat] is not None and r[stat] > 0]',
        'pts = [(r["layer"], r["top1"]) for r in rows if r[stat] is not None and r[stat] > 0]',
        ("tests/test_plots.py::test_layerwise_plots_the_profile_values",),
    ),
    M(
        "histogram bins shifted by one group",
        "diffquant/plots/hist.py",
        "acc[j // group] = acc.get(j // group, 0) + c",
        "acc[j // group + 1] = acc.get(j // group + 1, 0) + c",
        ("tests/test_plots.py::test_histogram_plots_the_profile_counts",),
    ),
    M(
        "degradation curves plot the unquantized value at every bit width",
        "diffquant/plots/degradation.py",
        '(bits, value[(name, plan)]["value"])',
        '(bits, value[(name, "none")]["value"])',
        ("tests/test_plots.py::test_degradation_plots_the_results",),
    ),
    M(
        "act-scales sorted ascending",
        "diffquant/plots/channels.py",
        "sorted(pos, reverse=True)",
        "sorted(pos)",
        ("tests/test_plots.py::test_act_scales_plot_the_channel_absmax",),
    ),
    # --- smoothing
    M(
        "smoothing divides the weight columns",
        "diffquant/quant/smoothquant.py",
        "lw.copy_((lw.to(torch.float64) * s.to(lw.device)[None, :]).to(lw.dtype))",
        "lw.copy_((lw.to(torch.float64) / s.to(lw.device)[None, :]).to(lw.dtype))",
        ("tests/test_smoothquant.py",),
    ),
    M(
        "smoothing exponents swapped",
        "diffquant/quant/smoothquant.py",
        "s = (amax.pow(alpha) / wmax.pow(1.0 - alpha))",
        "s = (amax.pow(1.0 - alpha) / wmax.pow(alpha))",
        ("tests/test_smoothquant.py",),
    ),
    # --- streamed runs (issue 17): exact against the whole model, limits read, headers checked
    M(
        "stream: batches profiled at their local sample index",
        "diffquant/stream/executor.py",
        'profiler.begin_batch(ids.to(self.device), sample_offsets[k], count=name == "embed")',
        'profiler.begin_batch(ids.to(self.device), k, count=name == "embed")',
        ("tests/test_stream.py",),
    ),
    M(
        "stream: a stage's static scales never fixed",
        "diffquant/stream/executor.py",
        "        for q in quantizers:\n            q.finish_calibration()\n",
        "",
        ("tests/test_stream.py::test_static_plan_streamed_equals_whole",),
    ),
    M(
        "stream: GGUF q/k not un-permuted per layer",
        "diffquant/stream/executor.py",
        "        if native in self.spec.transforms:",
        "        if False:",
        ("tests/test_stream_gguf.py::test_streamed_logits_and_profile_equal_whole_model",),
    ),
    M(
        "stream: torchrun ranks run every batch",
        "diffquant/profile/runner.py",
        "return list(range(rank * batch_size, n_windows, world * batch_size))",
        "return list(range(rank * batch_size, n_windows, batch_size))",
        ("tests/test_stream_torchrun.py::test_static_plan_shards_calibrate_on_all_windows",),
    ),
    M(
        "stream: quantized stream fed the reference hidden states",
        "diffquant/stream/quantize.py",
        "                q_store.put(k, y_q)",
        "                q_store.put(k, y_ref)",
        ("tests/test_stream_quantize.py::test_streamed_quantize_equals_whole",),
    ),
    M(
        "stream: ulimit -v ignored",
        "diffquant/stream/executor.py",
        "    if soft == resource.RLIM_INFINITY:",
        "    if True:",
        ("tests/test_stream_memory.py::test_address_space_limit_caps_available_bytes",),
    ),
    M(
        "stream: page cache counted as used in a cgroup",
        "diffquant/stream/executor.py",
        "        return max(0, limit - max(0, usage - cache))",
        "        return max(0, limit - usage)",
        ("tests/test_stream_memory.py::test_cgroup_limit_minus_unreclaimable_usage",),
    ),
    M(
        "stream: truncated safetensors header accepted",
        "diffquant/io/safetensors_source.py",
        "            if not 0 <= start <= end <= size - 8 - n:",
        "            if not 0 <= start <= end:",
        ("tests/test_stream_memory.py::test_streamed_run_maps_no_shard_it_is_not_reading",),
    ),
    M(
        "stream: a model that cannot fit loaded whole anyway",
        "diffquant/stream/api.py",
        "    if size > room:",
        "    if size > 2 * room:",
        ("tests/test_stream_memory.py::test_whole_load_that_cannot_fit_is_refused_and_auto_streams",),
    ),
]


def run(args: argparse.Namespace) -> list[dict]:
    chosen = [m for m in MUTANTS if not args.only or args.only in m.name]
    results = []
    with tempfile.TemporaryDirectory(prefix="diffquant-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x"], cwd=copy, input=archive, check=True)
        env = {
            **os.environ,
            "PYTHONPATH": str(copy),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
        where = subprocess.run(
            [sys.executable, "-c", "import diffquant; print(diffquant.__file__)"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(copy)):
            raise SystemExit(f"the copy is not what Python imports ({where}); cannot run mutants")
        for mutant in chosen:
            path = copy / mutant.path
            original = path.read_text()
            old, new = mutant.old, mutant.new
            if original.count(old) != 1:
                results.append({"mutant": mutant.name, "status": "stale", "seconds": 0.0})
                print(f"{'stale':<9} {mutant.name}", flush=True)
                continue
            path.write_text(original.replace(old, new, 1))
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - start
            path.write_text(original)
            # pytest exits 1 when a test failed; 2-5 (collection error, usage, nothing collected) kill nothing.
            status = {0: "survived", 1: "killed"}.get(proc.returncode, "error")
            results.append({"mutant": mutant.name, "status": status, "seconds": round(seconds, 1)})
            print(f"{status:<9} {mutant.name} ({seconds:.0f} s)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=None, help="run the mutants whose name contains this")
    args = parser.parse_args()
    results = run(args)
    killed = sum(r["status"] == "killed" for r in results)
    scored = sum(r["status"] in ("killed", "survived") for r in results)
    stale = sum(r["status"] == "stale" for r in results)
    errors = sum(r["status"] == "error" for r in results)
    print(f"killed {killed}/{scored} ({100 * killed / max(scored, 1):.0f} %), stale {stale}, errors {errors}")
    if not args.only:
        out = Path(__file__).with_name("results.json")
        out.write_text(
            json.dumps(
                {"killed": killed, "scored": scored, "stale": stale, "errors": errors, "mutants": results},
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {out}")
    if killed < scored or stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
