"""Mutation check: plant plausible bugs one at a time and see whether the tests that guard them fail.

Each mutant is (module, exact text, replacement, the tests that should catch it). The committed tree is
exported (``git archive HEAD``) into a temporary folder; for every mutant one file there is edited, the
listed tests run against that copy (``PYTHONPATH`` puts it ahead of the installed package, checked), and
the file is restored. A mutant is *killed* when a test fails (pytest exit 1), *survived* when they pass, an
*error* when pytest could not run them (collection error: fix the test list); a mutant whose
text is no longer in the source is reported as *stale* (fix the list, not the code). Prints a table and
writes results.json beside this file.

    python analysis/mutation/check.py [--only SUBSTRING ...] [--jobs 1]

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
    # --- issue 23 (hardening, round 2): lm-eval task code, data files, unknown names
    M(
        "lm-eval task code refusal skipped",
        "diffquant/eval/lmeval.py",
        "    if not trust_task_code:\n        _refuse_task_code(local.found)",
        "    if False:\n        _refuse_task_code(local.found)",
        ("tests/test_lmeval_hardening.py::test_task_code_is_refused_without_trust[function]",),
    ),
    M(
        "lm-eval include chain not scanned",
        "diffquant/eval/lmeval.py",
        "inc_cfg = _read_task_yaml(inc_path, trusted, found, seen | {path})",
        "inc_cfg = _read_task_yaml(inc_path, trusted, [], seen | {path})",
        ("tests/test_lmeval_hardening.py::test_task_code_is_refused_without_trust[include]",),
    ),
    M(
        "lm-eval class key not flagged",
        "diffquant/eval/lmeval.py",
        '_CODE_KEYS = ("class",)',
        "_CODE_KEYS = ()",
        ("tests/test_lmeval_hardening.py::test_task_code_is_refused_without_trust[class]",),
    ),
    M(
        "lm-eval unknown names left to TaskManager",
        "diffquant/eval/lmeval.py",
        "    _refuse_unknown(names, local)\n",
        "",
        ("tests/test_lmeval_hardening.py::test_unknown_task_is_refused_without_a_task_manager",),
    ),
    M(
        "lm-eval data file field not checked",
        "diffquant/eval/lmeval.py",
        "            if field not in record:",
        "            if False:",
        ("tests/test_lmeval_hardening.py::test_bad_data_file_is_one_line[notext.jsonl]",),
    ),
    M(
        "lm-eval templates not sandboxed",
        "diffquant/eval/lmeval.py",
        "    untrusted = not trust_task_code and any(",
        "    untrusted = False and any(",
        ("tests/test_lmeval_hardening.py::test_templates_of_an_include_path_render_sandboxed",),
    ),
    M(
        "eval CLI skips task preflight",
        "diffquant/cli.py",
        "            task.preflight()",
        "            pass",
        ("tests/test_lmeval_hardening.py::test_cli_refuses_task_code_before_the_run_folder",),
    ),
    # --- issue 23: GGUF tensor ranges, block_count, head widths, string lengths, 10+ layers
    M(
        "gguf: overlapping tensor ranges accepted",
        "diffquant/io/convert_gguf.py",
        "        _check_disjoint(self.tensors)\n",
        "",
        (
            "tests/test_gguf.py::test_overlapping_or_misaligned_tensor_data_is_refused_by_every_reader",
            "tests/test_gguf.py::test_overlapping_tensors_refused_by_info_and_profile_writing_nothing",
        ),
    ),
    M(
        "gguf: overlap compared with the wrong end",
        "diffquant/io/convert_gguf.py",
        "        if next_start < end:",
        "        if next_start < start:",
        ("tests/test_gguf.py::test_overlapping_or_misaligned_tensor_data_is_refused_by_every_reader",),
    ),
    M(
        "gguf: tensor alignment not checked",
        "diffquant/io/convert_gguf.py",
        "            if offset % alignment:",
        "            if False:",
        ("tests/test_gguf.py::test_overlapping_or_misaligned_tensor_data_is_refused_by_every_reader",),
    ),
    M(
        "gguf: default alignment instead of the header's",
        "diffquant/io/convert_gguf.py",
        "            if offset % alignment:",
        "            if offset % 32:",
        ("tests/test_gguf.py::test_overlapping_or_misaligned_tensor_data_is_refused_by_every_reader",),
    ),
    M(
        "gguf: block_count checked only when the tensors open",
        "diffquant/io/convert_gguf.py",
        '    check_layer_count(config.n_layers, names, GGUF_LAYER_PATTERN, f"{source} (llama.block_count)")\n',
        "",
        ("tests/test_gguf.py::test_block_count_beyond_the_tensors_is_refused_before_any_layer_is_built",),
    ),
    M(
        "gguf: rope.dimension_count taken as the head width",
        "diffquant/io/convert_gguf.py",
        "    head_dim = default if key is None else key",
        "    head_dim = key if key is not None else rope if rope is not None else default",
        ("tests/test_gguf.py::test_head_widths_default_as_llama_cpp_reads_them",),
    ),
    M(
        "gguf: value width defaults to the key width",
        "diffquant/io/convert_gguf.py",
        "    value_dim = default if value is None else value",
        "    value_dim = head_dim if value is None else value",
        ("tests/test_gguf.py::test_head_widths_default_as_llama_cpp_reads_them",),
    ),
    M(
        "gguf: rope.freq_base default not llama.cpp's",
        "diffquant/io/convert_gguf.py",
        '"rope_theta": 10000.0 if theta is None else float(theta),',
        '"rope_theta": 500000.0 if theta is None else float(theta),',
        ("tests/test_gguf.py::test_rope_keys_alone_default_the_rest_as_llama_cpp",),
    ),
    M(
        "gguf: string value read with the key's length",
        "diffquant/io/convert_gguf.py",
        "            return self._take(self._u64())",
        "            return self._take(self._u64() * 0 + len(key.encode()))",
        ("tests/test_gguf.py::test_string_values_are_read_with_their_own_lengths",),
    ),
    M(
        "gguf: layer index one digit (blk.1 vs blk.10)",
        "diffquant/io/convert_gguf.py",
        'GGUF_LAYER_PATTERN = r"blk\\.(\\d+)\\."',
        'GGUF_LAYER_PATTERN = r"blk\\.(\\d)"',
        (
            "tests/test_gguf.py::test_twelve_layers_each_read_from_its_own_block",
            "tests/test_stream_gguf.py::test_twelve_layers_each_stage_reads_its_own_block",
        ),
    ),
    M(
        "stream: layer stage prefix without its dot (layers.1 reads layers.10)",
        "diffquant/stream/executor.py",
        'head if name == "head" else [f"{name}."]',
        'head if name == "head" else [f"{name}"]',
        ("tests/test_stream_gguf.py::test_twelve_layers_each_stage_reads_its_own_block",),
    ),
    # --- issue 23: tokenizers, text, scoring
    M(
        "bos_token outside the vocabulary read as no BOS",
        "diffquant/data/tokenizer.py",
        "if text is not None and ids[key] is None:",
        "if False:",
        ("tests/test_sentencepiece.py::test_bos_token_not_in_the_vocabulary_is_refused",),
    ),
    M(
        "empty tokenizer path read as the working folder",
        "diffquant/data/tokenizer.py",
        "if not str(path).strip():",
        "if False:",
        ("tests/test_tokenizers.py::test_empty_tokenizer_path_is_refused",),
    ),
    M(
        "profile ignores --tokenizer ''",
        "diffquant/cli.py",
        "tokenizers = dict.fromkeys(specs, args.tokenizer) if args.tokenizer is not None else {}",
        "tokenizers = dict.fromkeys(specs, args.tokenizer) if args.tokenizer else {}",
        ("tests/test_tokenizers.py::test_empty_tokenizer_path_is_refused",),
    ),
    M(
        "eval checks --tokenizer only after claiming its folder",
        "diffquant/cli.py",
        "            load_tokenizer(args.tokenizer)\n",
        "            pass\n",
        ("tests/test_tokenizers.py::test_empty_tokenizer_path_is_refused",),
    ),
    M(
        "info calls an unusable tokenizer none",
        "diffquant/cli.py",
        "'unusable' if getattr(model, 'tokenizer', None) is not None else 'none'",
        "'none'",
        ("tests/test_tokenizers.py::test_info_reports_a_tokenizer_that_does_not_fit_the_embedding",),
    ),
    M(
        "byte-order marks ignored",
        "diffquant/data/corpus.py",
        "    for bom, encoding in _BOMS:",
        "    for bom, encoding in ():",
        ("tests/test_data.py::test_text_with_a_byte_order_mark_is_decoded_as_it_says",),
    ),
    M(
        "NUL bytes read as text",
        "diffquant/data/corpus.py",
        '    if b"\\0" in data:',
        "    if False:",
        ("tests/test_data.py::test_utf16_without_a_mark_or_binary_is_refused",),
    ),
    M(
        "a request beyond the source passes silently",
        "diffquant/data/corpus.py",
        "    if have >= wanted or key in _SHORT_WARNED:",
        "    if True:",
        ("tests/test_data.py::test_a_request_beyond_the_source_says_how_many_tokens_it_has",),
    ),
    M(
        "eval scores a text shorter than one window",
        "diffquant/eval/perplexity.py",
        "    if stream.numel() < min(window, max_tokens):",
        "    if False:",
        ("tests/test_perplexity.py::test_text_shorter_than_one_window_is_refused_as_profile_refuses_it",),
    ),
    M(
        "dummy-prefix space counted as a byte of the text",
        "diffquant/data/tokenizer.py",
        "(lengths - prefix).clamp(min=0)",
        "lengths",
        (
            "tests/test_sentencepiece.py::test_bits_per_byte_divides_by_the_bytes_of_the_text",
            "tests/test_sentencepiece.py::test_text_bytes_per_position_match_the_decoded_text",
        ),
    ),
    M(
        "scorer counts bytes per id, not per position",
        "diffquant/data/scoring.py",
        "target_bytes = torch.stack([self.position_bytes[start + 1 : end] for start, end, _ in batch])",
        "target_bytes = self.byte_len[ids[:, 1:]]",
        ("tests/test_sentencepiece.py::test_bits_per_byte_divides_by_the_bytes_of_the_text",),
    ),
    M(
        "bare tokenizer.json: BOS of the post-processor ignored",
        "diffquant/data/tokenizer.py",
        'ids["bos"] = _post_processor_bos(backend)',
        'ids["bos"] = None',
        ("tests/test_sentencepiece.py::test_bare_tokenizer_json_folder_takes_bos_from_its_post_processor",),
    ),
    M(
        "eos_token_id list: last entry taken",
        "diffquant/data/tokenizer.py",
        "return value[0] if isinstance(value, list) else value",
        "return value[-1] if isinstance(value, list) else value",
        ("tests/test_sentencepiece.py::test_eos_and_bos_ids_given_as_lists",),
    ),
    M(
        "malformed special id read as none",
        "diffquant/data/tokenizer.py",
        '    raise DiffquantError(f"{file}: {key} must be a token id or a list of ids, got {value!r}")',
        "    return None",
        ("tests/test_sentencepiece.py::test_malformed_special_ids_are_refused",),
    ),
    M(
        "half-precision logits scored in their own dtype",
        "diffquant/data/scoring.py",
        "logits = logits.float()",
        "logits = logits",
        ("tests/test_perplexity.py::test_half_precision_logits_are_scored_in_float32",),
    ),
    # --- issue 23: run and checkpoint folders, memory, streamed stages, sweeps
    M(
        "stream quantize claim",
        "diffquant/stream/quantize.py",
        "with claim_checkpoint_folder(out, force):",
        "with torch.no_grad():",
        ("tests/test_stream_quantize.py::test_a_second_quantize_into_the_same_new_out_is_refused",),
    ),
    M(
        "whole quantize claim",
        "diffquant/io/quantize.py",
        "with claim_checkpoint_folder(out, force):",
        "with torch.no_grad():",
        ("tests/test_stream_quantize.py::test_a_second_quantize_into_the_same_new_out_is_refused",),
    ),
    M(
        "run target check",
        "diffquant/io/runfolder.py",
        "    check_run_target(out, inputs)\n",
        "    pass\n",
        ("tests/test_runfolder.py::test_profile_refuses_a_link_a_checkpoint_or_an_input_as_out",),
    ),
    M(
        "foreign manifest",
        "diffquant/io/runfolder.py",
        ' and "diffquant" in versions',
        "",
        ("tests/test_runfolder.py::test_a_foreign_manifest_with_a_command_key_is_not_a_run_folder",),
    ),
    M(
        "tokenizer key",
        "diffquant/eval/sweep.py",
        'return {"fingerprint": load_tokenizer(override).fingerprint()}',
        "return override",
        ("tests/test_sweep.py::test_resumed_sweep_recomputes_cells_of_a_changed_tokenizer_override",),
    ),
    M(
        "load peak mapped file",
        "diffquant/stream/executor.py",
        "return size + sum(f.stat().st_size for f in files)",
        "return size",
        ("tests/test_stream_memory.py::test_whole_load_counts_the_load_peak_under_an_address_space_limit",),
    ),
    M(
        "hidden drop frees",
        "diffquant/stream/executor.py",
        "            self._held -= item.numel() * item.element_size()",
        "            pass",
        ("tests/test_stream_memory.py::test_a_finite_spill_budget_puts_drops_and_puts_again",),
    ),
    # --- issue 23: attention masks with fewer queries than keys, first-batch extremes, booleans, report
    M(
        "SDPA causal top-left when q_len < k_len",
        "diffquant/models/attention.py",
        "        if t == s:\n            causal = t > 1",
        "        if t <= s:\n            causal = t > 1",
        (
            "tests/test_attention_reference.py::test_cached_chunks_with_fewer_queries_than_keys_match_brute_force",
        ),
    ),
    M(
        "cached mask not offset by pos0",
        "diffquant/models/attention.py",
        "q_pos = torch.arange(pos0, pos0 + t, device=device)[:, None]",
        "q_pos = torch.arange(0, t, device=device)[:, None]",
        (
            "tests/test_attention_reference.py::test_cached_chunks_with_fewer_queries_than_keys_match_brute_force",
        ),
    ),
    M(
        "reference mask not offset by k_len - q_len",
        "diffquant/kernels/reference.py",
        "q_pos = torch.arange(s_len - t, s_len, device=q.device)[:, None]",
        "q_pos = torch.arange(0, t, device=q.device)[:, None]",
        (
            "tests/test_attention_reference.py::test_reference_cores_offset_the_mask_for_fewer_queries_than_keys",
        ),
    ),
    M(
        "absmax observer keeps the last batch",
        "diffquant/quant/observers.py",
        "        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)",
        "        self.amax = amax",
        ("tests/test_quant.py::test_calibration_remembers_an_extreme_of_the_first_batch",),
    ),
    M(
        "histogram observer keeps the last batch",
        "diffquant/quant/observers.py",
        "        self.hist = counts if self.hist is None else self.hist + counts",
        "        self.hist = counts",
        ("tests/test_quant.py::test_calibration_remembers_an_extreme_of_the_first_batch",),
    ),
    M(
        "channel abs-max keeps the last batch",
        "diffquant/profile/accumulators.py",
        "            torch.maximum(self.amax, amax, out=self.amax)",
        "            self.amax.copy_(amax)",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        "max keeps the last batch",
        "diffquant/profile/accumulators.py",
        "        self.max = hi if self.max is None else max(self.max, hi)",
        "        self.max = hi",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        "histogram keeps the last batch",
        "diffquant/profile/accumulators.py",
        "        self._pending = dense if self._pending is None else self._pending.add_(dense)",
        "        self._pending = dense",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        "top-k keeps the last batch",
        "diffquant/profile/accumulators.py",
        "        self.entries = _merge_entries(self.entries, entries, self.cap)",
        "        self.entries = _merge_entries([], entries, self.cap)",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        "massive count restarts",
        "diffquant/profile/accumulators.py",
        "    def add_count(self, n: int) -> None:\n        self.count += n",
        "    def add_count(self, n: int) -> None:\n        self.count = n",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        ">= 6 count restarts",
        "diffquant/profile/accumulators.py",
        "    def add(self, ge6: int) -> None:\n        self.ge6 += ge6",
        "    def add(self, ge6: int) -> None:\n        self.ge6 = ge6",
        ("tests/test_stats.py::test_every_statistic_keeps_an_extreme_of_the_first_batch",),
    ),
    M(
        "schema float accepts True",
        "diffquant/schema.py",
        "        elif t is float:\n            if isinstance(value, (int, float)) and not isinstance(value, bool):",
        "        elif t is float:\n            if isinstance(value, (int, float)):",
        (
            "tests/test_schema.py::test_true_is_never_a_number_in_any_schema",
            "tests/test_schema.py::test_true_is_refused_through_each_entry_point",
        ),
    ),
    M(
        "model config number accepts True",
        "diffquant/models/config.py",
        "    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)",
        "    return isinstance(value, (int, float)) and math.isfinite(value)",
        ("tests/test_schema.py::test_true_is_never_a_number_in_any_schema",),
    ),
    M(
        "train config number accepts True",
        "diffquant/train/trainer.py",
        "    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)",
        "    return isinstance(value, int | float) and math.isfinite(value)",
        ("tests/test_schema.py::test_true_is_never_a_number_in_any_schema",),
    ),
    M(
        "retrieval depths accept True",
        "diffquant/eval/task_params.py",
        "isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 100",
        "isinstance(d, (int, float)) and 0 <= d <= 100",
        (
            "tests/test_schema.py::test_true_is_never_a_number_in_any_schema",
            "tests/test_schema.py::test_true_is_refused_through_each_entry_point",
        ),
    ),
    M(
        "pooled accuracy unweighted",
        "diffquant/report/summary.py",
        "            p = (a.value * a.n + b.value * b.n) / (a.n + b.n)",
        "            p = (a.value + b.value) / 2",
        ("tests/test_report.py::test_noise_between_results_of_different_sample_sizes_pools_by_items",),
    ),
    M(
        "lambda sums keep NaN",
        "diffquant/profile/attention_metrics.py",
        "            xs = torch.where(finite, x, 0.0)",
        "            xs = x",
        (
            "tests/test_profiler.py::test_lambda_stats_count_non_finite_values_and_stay_json",
            "tests/test_hardening.py::test_profile_of_a_nan_diff_v2_model_counts_the_lambda_and_keeps_valid_json",
        ),
    ),
    M(
        "lambda counts non-finite",
        "diffquant/profile/attention_metrics.py",
        '            state["count"] += n_finite',
        '            state["count"] += x.shape[0]',
        (
            "tests/test_profiler.py::test_lambda_stats_count_non_finite_values_and_stay_json",
            "tests/test_hardening.py::test_profile_of_a_nan_diff_v2_model_counts_the_lambda_and_keeps_valid_json",
        ),
    ),
    M(
        "scalar lambda keeps NaN",
        "diffquant/profile/attention_metrics.py",
        "            if not math.isfinite(value):\n                self.nonfinite += 1\n                return",
        "            if False:\n                return",
        ("tests/test_profiler.py::test_lambda_stats_count_non_finite_values_and_stay_json",),
    ),
    M(
        "act-scales of a NaN model accepted",
        "diffquant/quant/smoothquant.py",
        "    _refuse_nonfinite(profile, list(linears))",
        "    pass",
        ("tests/test_hardening.py::test_act_scales_of_a_nan_model_name_the_linears_and_write_nothing",),
    ),
    M(
        "init full disk (weights) traceback",
        "diffquant/cli.py",
        "    except SafetensorError as err:  # a full disk while writing the weights: safetensors' own error type",
        "    except ZeroDivisionError as err:",
        ("tests/test_hardening.py::test_init_on_a_full_disk_is_one_line_naming_the_file",),
    ),
    M(
        "init full disk (config) unnamed",
        "diffquant/cli.py",
        "        if err.filename:  # names its file already (the one-line OSError handler of main says it)\n            raise",
        "        raise",
        ("tests/test_hardening.py::test_init_on_a_full_disk_is_one_line_naming_the_file",),
    ),
    M(
        "init seed unbounded",
        "diffquant/cli.py",
        '    check_value(args.seed, int, seed.metadata, "", "seed", FlagStyle())',
        "    pass",
        ("tests/test_hardening.py::test_init_seed_is_bounded_as_a_recipe_seed",),
    ),
    M(
        "huge int message says >= 0",
        "diffquant/schema.py",
        "        what = describe(tp, meta) if huge else style.words(tp, meta)",
        "        what = style.words(tp, meta)",
        ("tests/test_hardening.py::test_init_seed_is_bounded_as_a_recipe_seed",),
    ),
    M(
        "recipe without models accepted",
        "diffquant/recipes.py",
        '    if not recipe["models"]:',
        "    if False:",
        ("tests/test_hardening.py::test_recipe_without_models_is_one_line_before_any_write",),
    ),
    M(
        "topk unbounded (schema)",
        "diffquant/options.py",
        "        max=MAX_TOPK,",
        "",
        ("tests/test_hardening.py::test_topk_is_bounded_instead_of_running_forever",),
    ),
    M(
        "topk unbounded (Profiler)",
        "diffquant/profile/profiler.py",
        "        if not 1 <= topk <= MAX_TOPK:",
        "        if not 1 <= topk:",
        ("tests/test_hardening.py::test_topk_is_bounded_instead_of_running_forever",),
    ),
    # --- issue 23: one lock for train, init specifier seeds, progress interval, the suite's quiet fixture
    M(
        "train takes no lock",
        "diffquant/cli.py",
        "    with lock_folder(cfg.out):",
        "    with open(__file__):",
        ("tests/test_train.py::test_a_second_train_into_a_folder_in_use_is_refused",),
    ),
    M(
        "init specifier seed unbounded",
        "diffquant/io/load.py",
        "    if not 0 <= seed < 2**63:",
        "    if False:",
        ("tests/test_hardening.py::test_init_specifier_seed_is_bounded",),
    ),
    M(
        "progress interval from the environment ignored",
        "diffquant/progress.py",
        "        interval = default_interval()",
        "        interval = INTERVAL",
        ("tests/test_progress.py::test_interval_from_the_environment",),
    ),
    M(
        "the suite prints progress on a busy machine",
        "tests/conftest.py",
        '        monkeypatch.setenv(progress.QUIET_ENV, "1")',
        "        pass",
        ("tests/test_progress.py::test_output_comparisons_hold_on_a_busy_machine",),
    ),
    # --- issue 24: rotation (Hadamard matrices, R1-R4, DIFF-aware folds, checkpoints, reports)
    M(
        "Paley I skew part with the wrong sign",
        "diffquant/quant/hadamard.py",
        "    s[1:, 0] = -1\n",
        "    s[1:, 0] = 1\n",
        ("tests/test_rotate.py::test_every_base_matrix_is_hadamard_exactly",),
    ),
    M(
        "fast Hadamard applies H_K transposed",
        "diffquant/quant/hadamard.py",
        "        y = torch.matmul(base, y)",
        "        y = torch.matmul(base.T, y)",
        ("tests/test_rotate.py::test_dense_hadamard_is_orthogonal_and_the_fast_transform_equals_it",),
    ),
    M(
        "fast Hadamard butterfly a + b twice",
        "diffquant/quant/hadamard.py",
        "        y = torch.stack((a + b, a - b), dim=2)",
        "        y = torch.stack((a + b, a + b), dim=2)",
        ("tests/test_rotate.py::test_dense_hadamard_is_orthogonal_and_the_fast_transform_equals_it",),
    ),
    M(
        "R1 without folding the attention norm",
        "diffquant/quant/rotate.py",
        "            _fold_norm(block.attn_norm, first)\n",
        "",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "tied head not untied before folding",
        "diffquant/quant/rotate.py",
        "            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())\n",
        "",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "DIFF V1 head norm weight not folded into O",
        "diffquant/quant/rotate.py",
        '    if getattr(attn, "norm", None) is not None and attn.norm.weight is not None:',
        "    if False:",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "DIFF V2 lambda_proj not rotated with the readers",
        "diffquant/models/attention.py",
        '    input_readers = (*Attention.input_readers, "lambda_proj")  # lambda = sigmoid(lambda_proj(x))',
        "    input_readers = Attention.input_readers",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "R2 undoes only the first query head of a GQA group",
        "diffquant/quant/rotate.py",
        "        for h in range(j * n_rep, (j + 1) * n_rep):",
        "        for h in range(j * n_rep, j * n_rep + 1):",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "R3 DIFF V1 query sub-head reads the wrong key matrix",
        "diffquant/quant/rotate.py",
        "        return [2 * ((qi // 2) // n_rep) + qi % 2 for qi in range(n_q)]",
        "        return [(qi // 2) // n_rep for qi in range(n_q)]",
        ("tests/test_rotate.py::test_rotated_logits_equal_the_original",),
    ),
    M(
        "reload rotates the saved weights again",
        "diffquant/io/quantized.py",
        'rotated_weights="rotate" in transforms,',
        "rotated_weights=False,",
        ("tests/test_rotate.py::test_rotated_quantized_checkpoint_reloads_exactly",),
    ),
    M(
        "quantize report against an unrotated reference",
        "diffquant/io/quantize.py",
        "        rotate_model(reference, plan.rotate)\n",
        "        pass\n",
        ("tests/test_rotate.py::test_rotation_alone_is_no_error_in_the_quantize_report",),
    ),
    M(
        "a size without Hadamard found only mid-rotation",
        "diffquant/quant/rotate.py",
        "    _check_sizes(model, spec)\n",
        "",
        ("tests/test_rotate.py::test_a_size_without_hadamard_is_refused_before_anything_changes",),
    ),
    M(
        "streamed head stage not rotated",
        "diffquant/stream/executor.py",
        "self.rotation.head(self.model)",
        "pass",
        ("tests/test_rotate_stream.py::test_rotated_streamed_logits_and_bpb_equal_whole",),
    ),
    M(
        "streamed layer stage not rotated",
        "diffquant/stream/executor.py",
        "self.rotation.layer(self.model, int(layer[1]))",
        "pass",
        ("tests/test_rotate_stream.py::test_rotated_streamed_profile_equals_whole",),
    ),
    M(
        "tied head not untied in the stream",
        "diffquant/stream/executor.py",
        "self.spec = _untied(self.spec, self.model.config)",
        "pass",
        ("tests/test_rotate_stream.py::test_tied_hf_shards_and_gguf_untie_and_stream_like_whole",),
    ),
    M(
        "streamed reference without online rotations",
        "diffquant/stream/quantize.py",
        "reference.rotate_stage(prefixes)",
        "pass",
        ("tests/test_rotate_stream.py::test_rotated_streamed_quantize_writes_the_whole_checkpoint",),
    ),
    # ---- the weights section (issue 25): GPTQ against its paper, sequential calibration, checkpoints, streams
    M(
        "gptq-damp-nomean",
        "diffquant/quant/gptq.py",
        "H += damp * torch.mean(torch.diagonal(H)) * torch.eye(n",
        "H += damp * torch.eye(n",
        ("tests/test_gptq.py::test_matches_reference", "tests/test_gptq.py::test_dead_columns"),
    ),
    M(
        "gptq-actorder-dynamic-groups",
        "diffquant/quant/gptq.py",
        "if not act_order and col % size == 0:",
        "if col % size == 0:",
        ("tests/test_gptq.py::test_act_order_matches_reference", "tests/test_gptq.py::test_dead_columns"),
    ),
    M(
        "gptq-no-lazy-batch",
        "diffquant/quant/gptq.py",
        "        WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)",
        "        pass",
        ("tests/test_gptq.py::test_matches_reference", "tests/test_gptq.py::test_block_size_invariant"),
    ),
    M(
        "gptq-sym-zero",
        "diffquant/quant/weightcodes.py",
        "float((self.maxq + 1) // 2)",
        "float((self.maxq + 1) // 2 - 1)",
        ("tests/test_gptq.py::test_matches_reference", "tests/test_gptq.py::test_rtn_grid_details"),
    ),
    M(
        "gptq-dead-not-zeroed",
        "diffquant/quant/gptq.py",
        "    W[:, dead] = 0.0\n",
        "",
        ("tests/test_gptq.py::test_dead_columns",),
    ),
    M(
        "gptq-groups-from-original",
        "diffquant/quant/gptq.py",
        "values = W1[i : i + size]",
        "values = WT[i1 + i : i1 + i + size] * 0 + weight.detach().to(dtype).T[col : col + size]",
        ("tests/test_gptq.py::test_matches_reference",),
    ),
    M(
        "gptq-pending-updates-dropped",
        "diffquant/quant/gptq.py",
        "rest = WT[i2 : col + size] - U[i1:col, i2 : col + size].T @ E1[:i]",
        "rest = WT[i2 : col + size]",
        ("tests/test_gptq.py::test_block_size_invariant",),
    ),
    M(
        "partial last group dropped from the dequantized weight",
        "diffquant/quant/weightcodes.py",
        "s = scale.repeat_interleave(group, dim=1)[:, :n]",
        "s = scale[:, : n // group].repeat_interleave(group, dim=1)[:, :n]",
        (
            "tests/test_gptq.py::test_matches_reference",
            "tests/test_weights.py::test_rtn_weights_are_the_grid_of_the_float_weights",
        ),
    ),
    M(
        "gptq with activation quantizers on",
        "diffquant/quant/weights.py",
        "    with taps_detached(model):\n        chosen",
        "    with torch.no_grad():\n        chosen",
        ("tests/test_weights.py::test_gptq_is_sequential_and_beats_rtn_on_every_linear",),
    ),
    M(
        "gptq not sequential: the next layer reads the float layer's outputs",
        "diffquant/quant/weights.py",
        "                    fn(get(k))\n",
        "                    put(k, fn(get(k))) if put is not None else fn(get(k))\n",
        ("tests/test_weights.py::test_gptq_is_sequential_and_beats_rtn_on_every_linear",),
    ),
    M(
        "every Linear of a layer shares the first Hessian",
        "diffquant/quant/weights.py",
        "alias[index] = seen.setdefault(ident, (index, x))[0]",
        "alias[index] = 0",
        ("tests/test_weights.py::test_gptq_is_sequential_and_beats_rtn_on_every_linear",),
    ),
    M(
        "data-free codes before smoothing",
        "diffquant/quant/plan.py",
        "fill = plan.smooth is None and not saved_codes",
        "fill = not saved_codes",
        ("tests/test_weights.py::test_smoothing_then_weights",),
    ),
    M(
        "codes not saved",
        "diffquant/io/quantized.py",
        '                state[f"{name}.{buf}"] = getattr(q, buf).detach().contiguous()',
        "                pass",
        ("tests/test_weights.py::test_checkpoint_stores_codes_and_reloads_bit_for_bit",),
    ),
    M(
        "reload ignores the stored codes",
        "diffquant/io/quantized.py",
        '        q.set_codes(GroupCodes(given["codes"], given["scale"], given["zero"], q.grid))',
        "        pass",
        ("tests/test_weights.py::test_checkpoint_stores_codes_and_reloads_bit_for_bit",),
    ),
    M(
        "streamed gptq with the activation quantizers on",
        "diffquant/stream/executor.py",
        "        with taps_detached(self.model):\n            gptq_stage(",
        "        with contextlib.nullcontext():\n            gptq_stage(",
        ("tests/test_stream_quantize.py::test_streamed_quantize_equals_whole",),
    ),
    M(
        "hqq-shrink-sign",
        "diffquant/quant/hqq.py",
        "return torch.sign(x) * torch.relu(mag - mag.pow(p - 1) / beta)",
        "return torch.relu(mag - mag.pow(p - 1) / beta)",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-shrink-l1-sign",
        "diffquant/quant/hqq.py",
        "return torch.sign(x) * torch.relu(mag - 1.0 / beta)",
        "return torch.relu(mag - 1.0 / beta)",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-shrink-exp",
        "diffquant/quant/hqq.py",
        "mag.pow(p - 1) / beta",
        "mag.pow(p) / beta",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-lp-fixed",
        "diffquant/quant/hqq.py",
        "shrink_lp(v - r, b, lp_norm)",
        "shrink_lp(v - r, b, 0.7)",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-beta-fixed",
        "diffquant/quant/hqq.py",
        "b *= kappa",
        "b *= 1.0",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-zero-uses-w",
        "diffquant/quant/hqq.py",
        "torch.mean(q - (v - shrink_lp(v - r, b, lp_norm)) / s",
        "torch.mean(q - v / s",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-zero-inv-scale",
        "diffquant/quant/hqq.py",
        "torch.mean(q - (v - shrink_lp(v - r, b, lp_norm)) / s",
        "torch.mean(q - (v - shrink_lp(v - r, b, lp_norm)) * s",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-keep-last",
        "diffquant/quant/hqq.py",
        "            break\n        zeros, qs, w_rs, best",
        "            zeros, qs = new_zeros, new_qs\n            break\n        zeros, qs, w_rs, best",
        (
            "tests/test_hqq.py::test_early_stop_keeps_best",
            "tests/test_hqq.py::test_matches_quanto_hqq_optimizer",
        ),
    ),
    M(
        "hqq-no-early-stop",
        "diffquant/quant/hqq.py",
        "if early_stop and not err < best",
        "if False and not err < best",
        ("tests/test_hqq.py::test_stop_case_stops", "tests/test_hqq.py::test_early_stop_keeps_best"),
    ),
    M(
        "hqq-init-round-zero",
        "diffquant/quant/hqq.py",
        "zeros.append(-lo / scale)",
        "zeros.append(torch.round(-lo / scale))",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-init-include-zero",
        "diffquant/quant/hqq.py",
        "lo = view.amin(dim=1, keepdim=True)",
        "lo = torch.clamp(view.amin(dim=1, keepdim=True), max=0)",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-scale-levels",
        "diffquant/quant/hqq.py",
        "scale = (hi - lo) / maxq",
        "scale = (hi - lo) / (maxq + 1)",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-error-rms",
        "diffquant/quant/hqq.py",
        "float((v - r).abs().sum(dtype=torch.float64))",
        "float((v - r).pow(2).sum(dtype=torch.float64))",
        ("tests/test_hqq.py::test_early_stop_keeps_best",),
    ),
    M(
        "hqq-no-clamp",
        "diffquant/quant/hqq.py",
        "qs = [torch.clamp(torch.round(v / s + z), 0, maxq) for",
        "qs = [torch.round(v / s + z) for",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "hqq-sym-allowed",
        "diffquant/quant/hqq.py",
        "if grid.sym:",
        "if False:",
        ("tests/test_hqq.py::test_sym_refused",),
    ),
    M(
        "hqq-no-check",
        "diffquant/quant/hqq.py",
        "    grid.check(tuple(weight.shape), what)\n",
        "",
        ("tests/test_hqq.py::test_group_wider_than_weight_refused",),
    ),
    M(
        "hqq-tail-dropped",
        "diffquant/quant/hqq.py",
        "[w[:, full:]] if full < n else []",
        "[]",
        ("tests/test_hqq.py::test_partial_last_group",),
    ),
    M(
        "hqq-tail-error-ignored",
        "diffquant/quant/hqq.py",
        "for v, r in zip(views, rs, strict=True)",
        "for v, r in zip(views[:1], rs[:1], strict=True)",
        ("tests/test_hqq.py::test_early_stop_keeps_best",),
    ),
    M(
        "hqq-group-order",
        "diffquant/quant/hqq.py",
        "[w[:, :full].reshape(out * (full // size), size)]",
        "[w[:, :full].T.reshape(out * (full // size), size)]",
        ("tests/test_hqq.py::test_matches_quanto_hqq_optimizer",),
    ),
    M(
        "quanto-codes-shift-sign",
        "diffquant/quant/backends/quanto_codes.py",
        "offset = (zero * codes.scale",
        "offset = (-zero * codes.scale",
        (
            "tests/test_quanto_codes.py::test_float_shift_hqq",
            "tests/test_quanto_codes.py::test_float_shift_forced",
        ),
    ),
    M(
        "quanto-codes-scale-layout",
        "diffquant/quant/backends/quanto_codes.py",
        "scale = codes.scale.reshape(rows, 1).to(torch.float32).contiguous()",
        "scale = codes.scale.t().reshape(rows, 1).to(torch.float32).contiguous()",
        ("tests/test_quanto_codes.py::test_int4_codes_match",),
    ),
    M(
        "quanto-codes-int8-centre",
        "diffquant/quant/backends/quanto_codes.py",
        "data = (codes.codes.to(torch.int16) - codes.zero.to(torch.int16)).to(torch.int8).contiguous()",
        "data = codes.codes.to(torch.int8).contiguous()",
        ("tests/test_quanto_codes.py::test_int8_symmetric_per_channel",),
    ),
    M(
        "quanto-codes-partial-group",
        "diffquant/quant/backends/quanto_codes.py",
        "(grid.group_size > n or n % grid.group_size)",
        "grid.group_size > n",
        ("tests/test_quanto_codes.py::test_refusals",),
    ),
    # --- issue 26: figures and the report
    M(
        "act_scales_first_linear",
        "diffquant/plots/channels.py",
        "return max(pool, key=pool.__getitem__) if pool else None",
        "return next(iter(pool)) if pool else None",
        ("tests/test_plots.py::test_act_scales_default_is_the_largest_linear",),
    ),
    M(
        "maps_title_unwrapped",
        "diffquant/plots/maps.py",
        'one sample)", wrap=True',
        'one sample)"',
        ("tests/test_plots.py::test_attention_maps_of_one_real_sized_model_fit_the_canvas",),
    ),
    M(
        "bars_legend_best",
        "diffquant/plots/degradation.py",
        'ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)',
        'ax.legend(loc="best")',
        ("tests/test_plots.py::test_degradation_bars_legend_beside_the_bars_and_dtype_label",),
    ),
    M(
        "fp32_at_16_bits",
        "diffquant/plots/degradation.py",
        'DTYPE_BITS = {"float32": ("fp32", 32.0),',
        'DTYPE_BITS = {"float32": ("fp32", 16.0),',
        ("tests/test_plots.py::test_degradation",),
    ),
    M(
        "reuse_ignores_inputs",
        "diffquant/plots/run.py",
        'recorded.get("inputs") != stamp or ',
        "",
        ("tests/test_report.py::test_report_reuses_current_figures_and_redraws_changed_ones",),
    ),
    M(
        "ratio_stderr_no_bessel",
        "diffquant/data/scoring.py",
        "math.sqrt(len(rows) / (len(rows) - 1) * squares)",
        "math.sqrt(squares)",
        ("tests/test_report.py::test_scorer_standard_error_is_the_spread_of_the_windows",),
    ),
    M(
        "noise_windows_branch",
        "diffquant/report/summary.py",
        "                if windows:  # bpb / ppl: the spread of the run",
        "                if not windows:  # bpb / ppl: the spread of the run",
        ("tests/test_report.py::test_summary_uses_the_spread_of_the_windows_for_bits_per_byte",),
    ),
    M(
        "plan_weights_unnamed",
        "diffquant/report/__init__.py",
        '            parts.append(f"weights of {',
        '            parts.append(f"{',
        ("tests/test_report.py::test_plans_explained_from_the_plans_themselves",),
    ),
    # --- issue 26: progress
    M(
        "progress-announce",
        "diffquant/progress.py",
        "        if announce:\n            self._write(self.line(self.start, started=True))",
        "        if announce and interval == 0:\n            self._write(self.line(self.start, started=True))",
        ("tests/test_progress.py::test_a_long_step_says_when_it_starts_and_at_least_every_interval",),
    ),
    M(
        "progress-tick-last",
        "diffquant/progress.py",
        "            if not self.closed and self.interval > 0 and now - self.last >= self.interval:\n                self._write(self.line(now))\n                self.last = now",
        "            if not self.closed and self.interval > 0 and now - self.last >= self.interval:\n                self._write(self.line(now))",
        ("tests/test_progress.py::test_a_long_step_says_when_it_starts_and_at_least_every_interval",),
    ),
    M(
        "progress-innermost",
        "diffquant/progress.py",
        "    inner = live[-1] if live else None",
        "    inner = live[0] if live else None",
        ("tests/test_progress.py::test_the_heartbeat_speaks_for_the_innermost_step_only",),
    ),
    M(
        "progress-abandoned",
        "diffquant/progress.py",
        '        except GeneratorExit:  # the loop stopped early (break, an error): no heartbeat, no "done" line\n            self._close()',
        '        except GeneratorExit:  # the loop stopped early (break, an error): no heartbeat, no "done" line\n            self.close()',
        ("tests/test_progress.py::test_an_abandoned_loop_stops_its_heartbeat",),
    ),
    M(
        "progress-exit-failed",
        "diffquant/progress.py",
        '        else:  # the step failed: no "done" line after its error\n            self._close()',
        '        else:  # the step failed: no "done" line after its error\n            self.close()',
        ("tests/test_progress.py::test_an_abandoned_loop_stops_its_heartbeat",),
    ),
    M(
        "progress-realtime",
        "diffquant/progress.py",
        "        self.realtime = clock is time.monotonic",
        "        self.realtime = True",
        ("tests/test_progress.py::test_the_heartbeat_thread_lives_while_a_real_time_step_is_open",),
    ),
    M(
        "progress-tty-lines",
        "diffquant/progress.py",
        "    if bar or (isatty and isatty()):",
        "    if bar or (bar is None and isatty and isatty()):",
        ("tests/test_progress.py::test_a_terminal_gets_bars_only",),
    ),
    M(
        "progress-nested-leave",
        "diffquant/progress.py",
        "        leave = leave and not _bars_open()\n",
        "",
        ("tests/test_progress.py::test_a_terminal_gets_bars_only",),
    ),
    M(
        "progress-write-print",
        "diffquant/progress.py",
        "        tqdm.write(line, file=file)",
        "        print(line, file=file)",
        ("tests/test_progress.py::test_a_terminal_gets_bars_only",),
    ),
    M(
        "progress-interval",
        "diffquant/progress.py",
        "INTERVAL = 10.0",
        "INTERVAL = 5.0",
        ("tests/test_progress.py::test_a_long_step_says_when_it_starts_and_at_least_every_interval",),
    ),
    M(
        "progress-step-quiet",
        "diffquant/progress.py",
        "    if is_quiet():\n        yield\n        return\n    stream = file if file is not None else sys.stderr\n    isatty",
        "    stream = file if file is not None else sys.stderr\n    isatty",
        ("tests/test_progress.py::test_quiet_silences_start_lines_and_heartbeats",),
    ),
    M(
        "report-announce",
        "diffquant/quant/report.py",
        '"error report", "batch", leave=False, announce=True',
        '"error report", "batch", leave=False',
        ("tests/test_progress.py::test_quantize_says_when_each_long_step_starts",),
    ),
    M(
        "profile-announce",
        "diffquant/profile/runner.py",
        "enabled=rank == 0, leave=False, announce=True",
        "enabled=rank == 0, leave=False",
        ("tests/test_progress.py::test_a_one_batch_profile_says_when_it_starts",),
    ),
    M(
        "lmeval-contexts",
        "diffquant/eval/lmeval.py",
        "    if saved is not None:\n        task_module.tqdm = contexts",
        "    if saved is None:\n        task_module.tqdm = contexts",
        ("tests/test_lmeval.py::test_an_lmeval_run_reports_its_start_and_batches",),
    ),
    M(
        "lmeval-batches",
        "diffquant/eval/lmeval.py",
        "                    bar.update(len(chunk))\n",
        "",
        ("tests/test_lmeval.py::test_an_lmeval_run_reports_its_start_and_batches",),
    ),
    M(
        "training starts silently",
        "diffquant/train/trainer.py",
        'desc="train", unit="step", announce=True)',
        'desc="train", unit="step")',
        ("tests/test_progress.py::test_training_says_when_it_starts_and_keeps_its_log_on_stdout",),
    ),
    # --- issue 26: shipped files, the torch-free parser, help texts
    M(
        "task table order differs from the registry",
        "diffquant/eval/task_params.py",
        '    "retrieval": RetrievalParams,\n    "mc": MCParams,',
        '    "mc": MCParams,\n    "retrieval": RetrievalParams,',
        ("tests/test_cli_help.py::test_eval_help_lists_exactly_the_task_types_that_run",),
    ),
    M(
        "existing path loses to a shipped name",
        "diffquant/shipped/__init__.py",
        "    if path.exists():\n        return path",
        "    if path.exists() and shipped_file(spec, kind) is None:\n        return path",
        ("tests/test_shipped.py::test_an_existing_path_wins_over_a_shipped_name",),
    ),
    M(
        "clone recipes/ prefix not understood",
        "diffquant/shipped/__init__.py",
        ".removeprefix(_CLONE_PREFIX[kind])",
        "",
        ("tests/test_shipped.py::test_names_resolve_from_any_folder",),
    ),
    M(
        "run/train split only at the file start",
        "diffquant/shipped/__init__.py",
        're.compile(r"^models\\s*:", re.MULTILINE)',
        're.compile(r"^models\\s*:")',
        ("tests/test_shipped.py::test_each_kind_is_what_its_loader_accepts",),
    ),
    M(
        "unclosed parenthesis kept in a description",
        "diffquant/shipped/__init__.py",
        'if first.count("(") > first.count(")"):',
        "if False:",
        ("tests/test_shipped.py::test_recipes_lists_every_shipped_file_with_a_description",),
    ),
    M(
        "shipped plans not looked up",
        "diffquant/quant/plan.py",
        '            path = shipped_file(text, "plan")',
        "            path = None",
        ("tests/test_shipped.py::test_names_resolve_from_any_folder",),
    ),
    M(
        "training recipes not resolved by name",
        "diffquant/train/trainer.py",
        '        path = resolve_shipped(path, "train")',
        "        path = Path(path)",
        ("tests/test_shipped.py::test_names_resolve_from_any_folder",),
    ),
    M(
        "lm-eval tasks read from the clone's path",
        "diffquant/eval/lmeval.py",
        "RECIPE_TASKS = LMEVAL_DIR",
        'RECIPE_TASKS = Path(__file__).resolve().parents[2] / "recipes" / "lmeval"',
        ("tests/test_shipped.py::test_a_clones_recipes_folder_is_the_shipped_one",),
    ),
    M(
        "parser built from stages (imports torch)",
        "diffquant/cli.py",
        "    from diffquant.options import (  # torch-free: --help must stay instant",
        "    from diffquant.stages import (  # torch-free: --help must stay instant",
        ("tests/test_cli_help.py::test_help_and_version_import_no_heavy_library",),
    ),
    M(
        "task help from the runners' registry (imports torch)",
        "diffquant/cli.py",
        "    from diffquant.eval.task_params import TASK_TYPE_PARAMS  # torch-free",
        "    from diffquant.eval.tasks import TASK_TYPES as TASK_TYPE_PARAMS  # torch-free",
        ("tests/test_cli_help.py::test_help_and_version_import_no_heavy_library",),
    ),
    M(
        "an option's default unstated",
        "diffquant/act_scales_cli.py",
        'help="windows per forward pass (default: 8)"',
        'help="windows per forward pass"',
        ("tests/test_cli_help.py::test_every_option_has_a_help_that_states_its_default",),
    ),
    M(
        "topk default unstated",
        "diffquant/options.py",
        "(default: 100; at most {MAX_TOPK})",
        "(at most {MAX_TOPK})",
        ("tests/test_cli_help.py::test_profile_topk_help_shows_its_default",),
    ),
    # --- issue 27: quantize memory
    M(
        "stats-fast-path-or",
        "diffquant/quant/report.py",
        "if valid is None and bool(finite.all()):",
        "if valid is None or bool(finite.all()):",
        ("tests/test_quantize_memory.py::test_error_stats_are_the_all_at_once_float64_sums",),
    ),
    M(
        "stats-abs-err-no-abs",
        "diffquant/quant/report.py",
        '_chunked(buf.copy_(q), "sub_", r).abs_().sum())',
        '_chunked(buf.copy_(q), "sub_", r).sum())',
        ("tests/test_quantize_memory.py::test_error_stats_are_the_all_at_once_float64_sums",),
    ),
    M(
        "chunk-skips-last",
        "diffquant/quant/report.py",
        "for start in range(0, buf.numel(), CHUNK):",
        "for start in range(0, buf.numel() - CHUNK, CHUNK):",
        ("tests/test_quantize_memory.py::test_error_stats_are_the_all_at_once_float64_sums",),
    ),
    M(
        "stages-head-no-norm",
        "diffquant/quant/report.py",
        "return model.lm_head(model.norm(x))",
        "return model.lm_head(x)",
        ("tests/test_quantize_memory.py::test_layer_by_layer_report_equals_the_whole_models_report",),
    ),
    M(
        "lockstep-first-prefix-only",
        "diffquant/quant/report.py",
        "names = [n for n in stats if n.startswith(ref_stage.prefixes)]",
        "names = [n for n in stats if n.startswith(ref_stage.prefixes[0])]",
        ("tests/test_quantize_memory.py::test_layer_by_layer_report_equals_the_whole_models_report",),
    ),
    M(
        "copy-shares-smoothed",
        "diffquant/io/quantize.py",
        "if plan.rotate is None and plan.smooth is None:",
        "if plan.rotate is None:",
        ("tests/test_quantize_memory.py::test_a_plan_that_rewrites_weights_gets_weights_of_its_own",),
    ),
    M(
        "copy-same-parameter",
        "diffquant/io/quantize.py",
        "memo[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)",
        "memo[id(p)] = p",
        ("tests/test_quantize_memory.py::test_the_quantized_model_shares_the_weights_the_plan_leaves_alone",),
    ),
    M(
        "cache-not-dropped",
        "diffquant/quant/caches.py",
        "        quantizer._weight_cache = None",
        "        pass",
        (
            "tests/test_quantize_memory.py::test_the_report_drops_each_layers_cached_weights_and_the_model_still_gives_its_logits",
        ),
    ),
    M(
        "calibrate-keeps-caches",
        "diffquant/quant/calibrate.py",
        "with context, weight_caches_dropped(model):",
        "with context:",
        ("tests/test_quantize_memory.py::test_calibration_holds_one_quantized_weight_at_a_time",),
    ),
    M(
        "peak-in-mib",
        "diffquant/cli.py",
        "/ 2**30:.2f} GiB",
        "/ 2**20:.2f} GiB",
        ("tests/test_quantize_memory.py::test_quantize_prints_its_peak_memory_last",),
    ),
    # --- issue 27: a sweep loads each model once; lm-eval scores only what it needs
    M(
        "sweep-no-copy",
        "diffquant/eval/sweep.py",
        "        return copy.deepcopy(loaded, memo={id(loaded.tokenizer): loaded.tokenizer})",
        "        return loaded",
        ("tests/test_sweep.py::test_sweep_loads_each_model_once_and_matches_per_cell_loading",),
    ),
    M(
        "sweep-cell-copy-kept",
        "diffquant/eval/sweep.py",
        "            del model  # the cell's copy goes before the next cell makes its own (else two are held)\n",
        "",
        ("tests/test_sweep.py::test_sweep_loads_each_model_once_and_matches_per_cell_loading",),
    ),
    M(
        "lmeval-scored-half",
        "diffquant/eval/lmeval.py",
        "    return (logits if logits.dtype == torch.float64 else logits.float()).cpu()",
        "    return (logits if logits.dtype == torch.float64 else logits.half().float()).cpu()",
        ("tests/test_lmeval.py::test_metrics_equal_hflm",),
    ),
    # --- issue 27: profiling every site
    M(
        "row-blocks-tail",
        "diffquant/profile/stats.py",
        "    if n_rows - starts[-1] == 1:\n",
        "    if n_rows - starts[-1] == 0:\n",
        ("tests/test_stats.py::test_row_blocks_never_leave_a_one_row_block",),
    ),
    M(
        "row-sums-mask",
        "diffquant/profile/stats.py",
        "        blk = rows[a:b] if ok is None else torch.where(ok[a:b], rows[a:b], 0.0)\n",
        "        blk = rows[a:b]\n",
        ("tests/test_stats.py::test_fused_pass_equals_the_plain_path_bit_for_bit",),
    ),
    M(
        "hist-merge-replace",
        "diffquant/profile/accumulators.py",
        "pending.clone() if self._pending is None else self._pending.add_(pending)",
        "pending.clone()",
        (
            "tests/test_stats.py::test_fused_pass_equals_the_plain_path_bit_for_bit",
            "tests/test_stats.py::test_fused_histogram_merge_adds_pending_and_folded_counts",
        ),
    ),
    M(
        "hist-merge-alias",
        "diffquant/profile/accumulators.py",
        "pending.clone() if self._pending is None else",
        "pending if self._pending is None else",
        ("tests/test_stats.py::test_fused_histogram_merge_adds_pending_and_folded_counts",),
    ),
    M(
        "hist-merge-folded",
        "diffquant/profile/accumulators.py",
        "            _add_counts(self._pos, other._pos)\n            _add_counts(self._neg, other._neg)\n            return\n",
        "            return\n",
        ("tests/test_stats.py::test_fused_histogram_merge_adds_pending_and_folded_counts",),
    ),
    M(
        "entr-sign",
        "diffquant/profile/attention_metrics.py",
        "entropy = torch.special.entr(p).sum(-1) if FUSED",
        "entropy = -torch.special.entr(p).sum(-1) if FUSED",
        ("tests/test_attention_metrics.py::test_fused_metrics_equal_the_plain_ones_bit_for_bit",),
    ),
    M(
        "neg-mass-sign",
        "diffquant/profile/attention_metrics.py",
        "d.clamp(max=0).sum(-1).neg_().sum((0, 2))",
        "d.clamp(max=0).sum(-1).sum((0, 2))",
        ("tests/test_attention_metrics.py::test_fused_metrics_equal_the_plain_ones_bit_for_bit",),
    ),
    M(
        "trim-size-cmp",
        "diffquant/profile/profiler.py",
        "or nbytes < TRIM_MIN_BYTES:",
        "or nbytes <= TRIM_MIN_BYTES:",
        ("tests/test_profiler.py::test_freed_heap_released_after_large_maps_only_and_profile_unchanged",),
    ),
    M(
        "trim-metrics-hook",
        "diffquant/profile/profiler.py",
        "                    acc.update(output.detach(), args[1])\n                    self._trim_after(output)\n",
        "                    acc.update(output.detach(), args[1])\n",
        ("tests/test_profiler.py::test_freed_heap_released_after_large_maps_only_and_profile_unchanged",),
    ),
    M(
        "trim-every-no-reset",
        "diffquant/profile/profiler.py",
        "            self._pending_bytes = 0\n            release_freed_memory()\n",
        "            release_freed_memory()\n",
        ("tests/test_profiler.py::test_freed_heap_released_after_large_maps_only_and_profile_unchanged",),
    ),
    M(
        "trim-every-cmp",
        "diffquant/profile/profiler.py",
        "        if self._pending_bytes >= TRIM_EVERY_BYTES:",
        "        if self._pending_bytes > TRIM_EVERY_BYTES:",
        ("tests/test_profiler.py::test_freed_heap_released_after_large_maps_only_and_profile_unchanged",),
    ),
    M(
        "skip-logits-no-tap",
        "diffquant/profile/runner.py",
        "        return self.input(x)[..., :0]\n",
        "        return x[..., :0]\n",
        ("tests/test_profiler.py::test_profile_model_skips_the_logits_but_not_the_lm_head_tap",),
    ),
    M(
        "profile-json-indent",
        "diffquant/profile/runner.py",
        '.replace("\\n", "\\n  ")',
        '.replace("\\n", "\\n ")',
        ("tests/test_profiler.py::test_profile_json_is_json_dumps_of_to_dict_byte_for_byte",),
    ),
    # --- issue 27: the fake-quant hot path and its weight cache
    M(
        "weight cache lets a freed storage's address be reused",
        "diffquant/quant/fake.py",
        "self._weight_cache = cache = (key, self.quantize(source), source)",
        "self._weight_cache = cache = (key, self.quantize(source), None)",
        ("tests/test_quant.py::test_cached_weight_is_requantized_when_the_weight_changes",),
    ),
    M(
        "weight cache key ignores shape and strides",
        "diffquant/quant/fake.py",
        "weight.dtype, weight.device, weight.shape, weight.stride())",
        "weight.dtype, weight.device)",
        ("tests/test_quant.py::test_cached_weight_is_requantized_when_the_weight_changes",),
    ),
    M(
        "weight cache key ignores the version counter",
        "diffquant/quant/fake.py",
        "key = (weight.data_ptr(), weight._version,",
        "key = (weight.data_ptr(), 0,",
        ("tests/test_quant.py::test_cached_weight_is_requantized_when_the_weight_changes",),
    ),
    M(
        "fast path takes the max for the min",
        "diffquant/quant/schemes.py",
        "lo, hi = xf.amin(dim=dims, keepdim=True), xf.amax(dim=dims, keepdim=True)",
        "lo, hi = xf.amax(dim=dims, keepdim=True), xf.amax(dim=dims, keepdim=True)",
        ("tests/test_quant.py::test_fake_quant_equals_a_reference_implementation",),
    ),
    # --- the rotation papers' kurtosis (channel RMS over tokens, kurtosis over channels; issue 29)
    M(
        "rms-kurtosis-mean-square",
        "diffquant/profile/accumulators.py",
        "        return torch.where(self.n > 0, self.sumsq / self.n.clamp_min(1), math.nan).sqrt()",
        "        return torch.where(self.n > 0, self.sumsq / self.n.clamp_min(1), math.nan)",
        ("tests/test_stats.py::test_exact_against_brute_force",),
    ),
    M(
        "rms-kurtosis-counts-masked-entries",
        "diffquant/profile/stats.py",
        "            okv = ok.view(x.shape).to(torch.float64)",
        "            okv = torch.ones(x.shape, dtype=torch.float64)",
        ("tests/test_stats.py::test_exact_against_brute_force",),
    ),
    M(
        "rms-kurtosis-merge-overwrites",
        "diffquant/profile/accumulators.py",
        "            self.sumsq += sumsq",
        "            self.sumsq = sumsq.clone()",
        ("tests/test_stats.py::test_split_merge_equals_one_pass_resid",),
    ),
    # --- Gu et al.'s attention-sink rate (diffquant/profile/attention_metrics.py, sinks.py; issue 29)
    M(
        "sink-rate-alpha-over-t-minus-1",
        "diffquant/profile/attention_metrics.py",
        "            alpha = self._open / s",
        "            alpha = self._open / max(1, s - 1)",
        ("tests/test_attention_metrics.py::test_sink_rate_matches_gu_et_al_by_loops_over_chunked_forwards",),
    ),
    M(
        "sink-rate-key-1",
        "diffquant/profile/attention_metrics.py",
        "torch.where(valid[..., 0], attn_map[..., 0].to(torch.float64), 0.0)",
        "torch.where(valid[..., 1], attn_map[..., 1].to(torch.float64), 0.0)",
        ("tests/test_attention_metrics.py::test_sink_rate_matches_gu_et_al_by_loops_over_chunked_forwards",),
    ),
    M(
        "sink-rate-counts-a-gap",
        "diffquant/profile/attention_metrics.py",
        "        elif self._open is None or first != self._next or self._open.shape != attn_map.shape[:2]:",
        "        elif self._open is None or self._open.shape != attn_map.shape[:2]:",
        ("tests/test_attention_metrics.py::test_sink_rate_counts_only_sequences_seen_from_their_first_row",),
    ),
    M(
        "sink-rate-model-rate-from-a-component",
        "diffquant/profile/sinks.py",
        '        "rate": rate(effective),',
        '        "rate": rate(next((k for k in _COMPONENTS if k in by_kind), effective)),',
        (
            "tests/test_attention_metrics.py::test_sink_probe_on_a_model_equals_the_definition_on_its_captured_maps",
        ),
    ),
    # --- Sun et al.'s massive-activation interventions (diffquant/eval/interventions.py; issue 29)
    M(
        "massive-mean-not-median",
        "diffquant/eval/interventions.py",
        "    median = magnitude.reshape(magnitude.shape[0], -1).float().median(dim=1).values",
        "    median = magnitude.reshape(magnitude.shape[0], -1).float().mean(dim=1)",
        ("tests/test_interventions.py::test_massive_mask_is_sun_et_als_criterion",),
    ),
    M(
        "massive-median-of-the-batch",
        "diffquant/eval/interventions.py",
        "    median = magnitude.reshape(magnitude.shape[0], -1).float().median(dim=1).values",
        "    median = magnitude.reshape(1, -1).float().median(dim=1).values",
        ("tests/test_interventions.py::test_massive_mask_is_sun_et_als_criterion",),
    ),
    M(
        "massive-last-layer",
        "diffquant/eval/interventions.py",
        "        layer = next((i for i, n in enumerate(counts) if n), None)",
        "        layer = next((i for i, n in reversed(list(enumerate(counts))) if n), None)",
        (
            "tests/test_interventions.py::test_the_finding_pass_locates_the_planted_activations_and_their_means",
        ),
    ),
    M(
        "massive-roles-swapped",
        "diffquant/eval/interventions.py",
        "torch.where(_first_rows(args, out)[:, None], value[0], value[1])",
        "torch.where(_first_rows(args, out)[:, None], value[1], value[0])",
        ("tests/test_interventions.py",),
    ),
    M(
        "massive-cache-ignored",
        "diffquant/eval/interventions.py",
        "    start = 0 if cache is None else cache.length - x.shape[1]",
        "    start = 0",
        ("tests/test_interventions.py::test_cached_decoding_knows_the_first_token_from_the_cache",),
    ),
    M(
        "massive-zero-keeps-value",
        "diffquant/eval/interventions.py",
        "            return out.masked_fill(chosen, 0.0)",
        "            return out",
        ("tests/test_interventions.py::test_ppl_under_the_intervention_equals_editing_the_entries_by_hand",),
    ),
    # --- the quantized KV cache (diffquant/quant/kv_cache.py, issue 28)
    M(
        "kv-levels",
        "diffquant/quant/kv_cache.py",
        "    scale = stored((hi - lo) / (2**bits - 1))",
        "    scale = stored((hi - lo) / (2**bits))",
        ("tests/test_kv_cache.py::test_groups_follow_the_min_max_definition",),
    ),
    M(
        "kv-floor",
        "diffquant/quant/kv_cache.py",
        "    codes = torch.round((g - lo.unsqueeze(-1))",
        "    codes = torch.floor((g - lo.unsqueeze(-1))",
        ("tests/test_kv_cache.py::test_groups_follow_the_min_max_definition",),
    ),
    M(
        "kv-pack-shift",
        "diffquant/quant/kv_cache.py",
        "        out |= planes[..., i, :] << (bits * i)",
        "        out |= planes[..., i, :] << (bits * i - 1)",
        ("tests/test_kv_cache.py::test_pack_round_trips_every_code",),
    ),
    M(
        "kv-window-off-by-one",
        "diffquant/quant/kv_cache.py",
        "        if n == 0 or n < self.spec.residual:",
        "        if n == 0 or n <= self.spec.residual:",
        (
            "tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",
            "tests/test_kv_cache.py::test_decode_logits_equal_transformers_quantized_cache",
        ),
    ),
    M(
        "kv-sinks-grow",
        "diffquant/quant/kv_cache.py",
        "        free = self.spec.sinks - self._len(self.sink)",
        "        free = self.spec.sinks",
        ("tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",),
    ),
    M(
        "kv-prerope-unrotated",
        "diffquant/models/attention.py",
        "            k = apply_rope(keys, cos_all, sin_all)",
        "            k = keys",
        ("tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",),
    ),
    M(
        "kv-branch-drops-body",
        "diffquant/quant/kv_cache.py",
        '        for name in ("sink", "window", "codes", "scale", "zero"):',
        '        for name in ("sink", "window"):',
        ("tests/test_kv_cache.py::test_a_quantized_cache_branches_by_rows",),
    ),
    M(
        "kv-bytes-no-sinks",
        "diffquant/quant/kv_cache.py",
        '            "full": size(self.sink) + size(self.window),',
        '            "full": size(self.window),',
        ("tests/test_kv_cache.py::test_packed_bytes_equal_the_formula",),
    ),
    M(
        "kv-decode-scores-prefill-target",
        "diffquant/eval/perplexity.py",
        "first_scored=decode + 1)",
        "first_scored=decode)",
        ("tests/test_kv_cache.py::test_decode_mode_perplexity_scores_the_decoded_targets",),
    ),
    M(
        "kv-fp8-max",
        "diffquant/quant/kv_cache.py",
        "FP8_MAX = 448.0",
        "FP8_MAX = 240.0",
        ("tests/test_kv_cache.py::test_fp8_groups_are_torch_float8_casts_of_absmax_scaled_values",),
    ),
    M(
        "kv-unpack-plane-shift",
        "diffquant/quant/kv_cache.py",
        "        plane = packed if i == 0 else packed >> (bits * i)",
        "        plane = packed if i == 0 else packed >> (bits * (i - 1))",
        (
            "tests/test_kv_cache.py::test_pack_round_trips_every_code",
            "tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",
        ),
    ),
    M(
        "kv-window-over-the-sinks",
        "diffquant/quant/kv_cache.py",
        "                out[:, :, window_start:].copy_(self.window)",
        "                out[:, :, : self.length - window_start].copy_(self.window)",
        ("tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",),
    ),
    M(
        "kv-scale-dtype-ignored",
        "diffquant/quant/kv_cache.py",
        "        scale_dtype = SCALE_DTYPES.get(self.spec.scale_dtype)",
        "        scale_dtype = None",
        (
            "tests/test_kv_cache.py::test_packed_bytes_equal_the_formula",
            "tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",
        ),
    ),
    M(
        "kv-codes-from-unrounded-scales",
        "diffquant/quant/kv_cache.py",
        "        return t if scale_dtype is None else t.to(scale_dtype).to(x.dtype)",
        "        return t",
        ("tests/test_kv_cache.py::test_quantized_decode_equals_a_float64_brute_force",),
    ),
    M(
        "kv-step-tensor-float32",
        "diffquant/quant/kv_cache.py",
        "out = torch.empty(b, h, self.length, d, dtype=like.dtype, device=like.device)",
        "out = torch.empty(b, h, self.length, d, dtype=torch.float32, device=like.device)",
        ("tests/test_kv_cache.py::test_a_bfloat16_model_decodes_through_its_cache_in_bfloat16",),
    ),
    M(
        "kv-every-text-task-decodes",
        "diffquant/eval/tasks.py",
        '            return self.params.get("decode") is not None',
        "            return True",
        ("tests/test_kv_cache.py::test_a_kv_cache_plan_on_a_task_that_never_decodes_says_so",),
    ),
    # --- decoder families (Qwen2 biases, Qwen3 qk-norm, Mistral / Qwen sliding window)
    M(
        "family-window-off-by-one",
        "diffquant/models/attention.py",
        "        valid = valid & (k_pos > q_pos - window)",
        "        valid = valid & (k_pos >= q_pos - window)",
        (
            "tests/test_families.py::test_valid_mask_window",
            "tests/test_families.py::test_import_matches_transformers",
        ),
    ),
    M(
        "family-decode-step-forgets-window",
        "diffquant/models/attention.py",
        "        elif self.window is not None and s > self.window:",
        "        elif self.window is not None and t > self.window:",
        ("tests/test_families.py::test_cached_decoding_matches_full_forward",),
    ),
    M(
        "family-linear-drops-bias",
        "diffquant/models/attention.py",
        "        return F.linear(self.input(x), weight, self.bias)",
        "        return F.linear(self.input(x), weight)",
        ("tests/test_families.py::test_import_matches_transformers",),
    ),
    M(
        "family-qk-norm-after-rope",
        "diffquant/models/attention.py",
        """        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 (transformers' Qwen3Attention): normalise each head over its d channels, then RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, -1, self.value_dim).transpose(1, 2)
        positions = torch.arange(pos0, pos0 + t, device=x.device)
        inv_freq = self.rope_inv_freq(x.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype, inv_freq)
        k_unrotated = k
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
""",
        """        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, -1, self.value_dim).transpose(1, 2)
        positions = torch.arange(pos0, pos0 + t, device=x.device)
        inv_freq = self.rope_inv_freq(x.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype, inv_freq)
        k_unrotated = k
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
""",
        ("tests/test_families.py::test_import_matches_transformers",),
    ),
    M(
        "family-qk-norm-default-eps",
        "diffquant/models/attention.py",
        "        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, unit_offset=offset) if c.qk_norm else None",
        "        self.q_norm = RMSNorm(c.head_dim, unit_offset=offset) if c.qk_norm else None",
        ("tests/test_families.py::test_import_matches_transformers",),
    ),
    M(
        "family-rotation-leaves-v-bias",
        "diffquant/quant/rotate.py",
        "            vb.data[rows] = (r.T @ vb.data[rows].double()).to(vb.dtype)",
        "            pass",
        ("tests/test_families.py::test_rotation_keeps_logits",),
    ),
    # --- Gemma 3 model features (issue 29)
    M(
        "gemma-norm-offset-dropped",
        "diffquant/models/attention.py",
        "            y = y * (1.0 + w) if self.unit_offset else y * w",
        "            y = y * w",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-qk-norm-without-offset",
        "diffquant/models/attention.py",
        "        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, unit_offset=offset) if c.qk_norm else None",
        "        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-attn-post-norm-skipped",
        "diffquant/models/transformer.py",
        "        x = x + (a if self.attn_post_norm is None else self.attn_post_norm(a))",
        "        x = x + a",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-mlp-post-norm-skipped",
        "diffquant/models/transformer.py",
        "        x = x + (m if self.mlp_post_norm is None else self.mlp_post_norm(m))",
        "        x = x + m",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-embed-scale-dropped",
        "diffquant/models/transformer.py",
        "        if self.scale == 1.0:\n            return out",
        "        if True:\n            return out",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-gelu-not-tanh",
        "diffquant/models/transformer.py",
        'g = F.gelu(g, approximate="tanh") if',
        "g = F.gelu(g) if",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-layer-type-window-inverted",
        "diffquant/models/config.py",
        '        if self.layer_types is not None and self.layer_types[depth] == "full_attention":',
        '        if self.layer_types is not None and self.layer_types[depth] == "sliding_attention":',
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-local-rope-base-ignored",
        "diffquant/models/config.py",
        "            return (self.rope_local_theta or self.rope_theta), None",
        "            return self.rope_theta, None",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-rope-from-the-global-fields",
        "diffquant/models/attention.py",
        "        theta, rope_scaling = self.rope_theta, self.rope_scaling",
        "        theta, rope_scaling = self.config.rope_theta, self.config.rope_scaling",
        ("tests/test_gemma3.py::test_import_matches_transformers",),
    ),
    M(
        "gemma-smoothing-fold-without-offset",
        "diffquant/quant/smoothquant.py",
        "        norm.set_gain(norm.gain() / s)",
        "        norm.weight.copy_((norm.weight.double() / s.to(norm.weight.device)).to(norm.weight.dtype))",
        ("tests/test_gemma3.py::test_smoothing_folds_into_the_unit_offset_gain",),
    ),
    M(
        "gemma-rotation-fold-leaves-ones",
        "diffquant/models/attention.py",
        "            nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)",
        "            nn.init.constant_(self.weight, 1.0)",
        ("tests/test_gemma3.py::test_residual_rotation_folds_unit_offset_norms",),
    ),
    M(
        "gemma-r1-rotates-across-post-norms",
        "diffquant/quant/rotate.py",
        '    if weights and spec.residual != "none" and config.sandwich_norms:',
        "    if False:",
        ("tests/test_gemma3.py::test_residual_rotation_refused_with_sandwich_norms",),
    ),
    M(
        "gemma-pattern-off-by-one",
        "diffquant/io/convert_hf.py",
        '"full_attention" if (i + 1) % pattern == 0 else',
        '"full_attention" if i % pattern == 0 else',
        ("tests/test_gemma3.py::test_transformers_4_config_keys",),
    ),
    M(
        "gemma-embed-scale-not-rounded",
        "diffquant/models/transformer.py",
        "        return out * torch.tensor(self.scale, dtype=torch.float32, device=out.device).to(out.dtype)",
        "        return out * self.scale",
        ("tests/test_gemma3.py::test_embed_scale_is_rounded_like_transformers",),
    ),
    # --- GGUF SentencePiece tokenizer (issue 29)
    M(
        "spm-add-space-prefix-default-false",
        "diffquant/io/gguf_spm.py",
        "    add_prefix = True if not isinstance(add_prefix, bool) else add_prefix",
        "    add_prefix = False if not isinstance(add_prefix, bool) else add_prefix",
        ("tests/test_gguf_spm.py::test_missing_add_space_prefix_is_llama_default",),
    ),
    M(
        "spm-merges-lowest-score-first",
        "diffquant/io/gguf_spm.py",
        "ranked.append((group, -score, position,",
        "ranked.append((group, score, position,",
        (
            "tests/test_gguf_spm.py::test_merges_follow_scores_not_file_order",
            "tests/test_gguf_spm.py::test_ids_equal_the_sentencepiece_reference[no-prefix]",
        ),
    ),
    M(
        "spm-merges-by-file-position",
        "diffquant/io/gguf_spm.py",
        "ranked.append((group, -score, position,",
        "ranked.append((group, 0.0, position,",
        (
            "tests/test_gguf_spm.py::test_merges_follow_scores_not_file_order",
            "tests/test_gguf_spm.py::test_ids_equal_the_sentencepiece_reference[no-prefix]",
        ),
    ),
    M(
        "spm-byte-fallback-off",
        "diffquant/io/gguf_spm.py",
        "        byte_fallback=fallback,",
        "        byte_fallback=False,",
        ("tests/test_gguf_spm.py::test_byte_fallback_for_characters_outside_the_vocabulary",),
    ),
    M(
        "spm-user-defined-tokens-dropped",
        "diffquant/io/gguf_spm.py",
        "    if user:\n        tok.add_tokens(",
        "    if False:\n        tok.add_tokens(",
        ("tests/test_gguf_spm.py::test_user_defined_tokens_stay_whole",),
    ),
    M(
        "spm-space-runs-not-respelled",
        "diffquant/io/gguf_spm.py",
        '        spelled = SPACE * len(token) if token and not token.strip(" ") else token',
        "        spelled = token",
        ("tests/test_gguf_spm.py::test_space_runs_are_respelled_and_merge_first",),
    ),
    M(
        "spm-user-defined-merges-not-first",
        "diffquant/io/gguf_spm.py",
        "        group = 0 if kind == TOKEN_USER_DEFINED else 1",
        "        group = 1",
        ("tests/test_gguf_spm.py::test_space_runs_are_respelled_and_merge_first",),
    ),
    M(
        "spm-no-prefix-normalizer",
        "diffquant/io/gguf_spm.py",
        "    steps = [normalizers.Prepend(SPACE)] if add_prefix else []",
        "    steps = []",
        ("tests/test_gguf_spm.py::test_ids_equal_the_sentencepiece_reference[prefix]",),
    ),
    M(
        "spm-decoder-keeps-prefix-space",
        "diffquant/io/gguf_spm.py",
        "    if add_prefix:\n        steps.append(decoders.Strip(",
        "    if False:\n        steps.append(decoders.Strip(",
        ("tests/test_gguf_spm.py::test_missing_add_space_prefix_is_llama_default",),
    ),
    M(
        "spm-scores-length-unchecked",
        "diffquant/io/gguf_spm.py",
        "    if not isinstance(scores, list) or len(scores) != len(tokens):",
        "    if not isinstance(scores, list):",
        ("tests/test_gguf_spm.py::test_bad_files_are_one_line_errors[short-scores]",),
    ),
    M(
        "spm-partial-byte-set-accepted",
        "diffquant/io/gguf_spm.py",
        "    if any(have) and not all(have):",
        "    if False:",
        ("tests/test_gguf_spm.py::test_bad_files_are_one_line_errors[missing-byte]",),
    ),
    M(
        "spm-add-bos-default-false",
        "diffquant/io/gguf_spm.py",
        "        add_bos=add_bos if isinstance(add_bos, bool) else True,",
        "        add_bos=add_bos if isinstance(add_bos, bool) else False,",
        ("tests/test_gguf_spm.py::test_special_ids_frame_save_and_reload",),
    ),
    M(
        "spm-dispatch-misses-llama",
        "diffquant/io/convert_gguf.py",
        '    if model == "llama":  # SentencePiece BPE',
        '    if model == "sentencepiece":  # SentencePiece BPE',
        ("tests/test_gguf_spm.py::test_ids_equal_the_sentencepiece_reference[no-prefix]",),
    ),
    # --- GGUF architectures: qwen2 / qwen3 / gemma3 (issue 29)
    M(
        "gguf-gemma-norm-shift-dropped",
        "diffquant/io/convert_gguf.py",
        "    if not config.norm_unit_offset:\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_gguf_families.py::test_gemma3_gguf_matches_transformers",),
    ),
    M(
        "gguf-neox-rows-permuted",
        "diffquant/io/convert_gguf.py",
        "    if not ARCHITECTURES[arch].permuted_qk:\n        return out",
        "    if False:\n        return out",
        ("tests/test_gguf_families.py::test_qwen_gguf_matches_transformers",),
    ),
    M(
        "gguf-gemma-global-layer-off-by-one",
        "diffquant/io/convert_gguf.py",
        "    full = [(i + 1) % GEMMA3_SLIDING_PATTERN == 0 for i in range(n_layers)]",
        "    full = [i % GEMMA3_SLIDING_PATTERN == 0 for i in range(n_layers)]",
        ("tests/test_gguf_families.py::test_gemma3_gguf_matches_transformers",),
    ),
    M(
        "gguf-gemma-local-rope-base-global",
        "diffquant/io/convert_gguf.py",
        '        "rope_local_theta": GEMMA3_LOCAL_ROPE_BASE,',
        '        "rope_local_theta": None,',
        ("tests/test_gguf_families.py::test_gemma3_gguf_matches_transformers",),
    ),
    M(
        "gguf-qwen2-biases-off",
        "diffquant/io/convert_gguf.py",
        '        GGUFArchitecture("qwen2", attention_bias=True),',
        '        GGUFArchitecture("qwen2"),',
        ("tests/test_gguf_families.py::test_qwen_gguf_matches_transformers",),
    ),
    M(
        "logits-slice-drops-last-position",
        "diffquant/eval/perplexity.py",
        "        b = min(a + step, length - 1)",
        "        b = min(a + step, length - 2)",
        ("tests/test_perplexity.py::test_large_vocabulary_batches_score_the_head_a_slice_at_a_time",),
    ),
    M(
        "logits-slice-ignores-head-quantizer",
        "diffquant/eval/perplexity.py",
        " or model.lm_head.input.active)",
        ")",
        ("tests/test_perplexity.py::test_large_vocabulary_batches_score_the_head_a_slice_at_a_time",),
    ),
    M(
        "intervene-none-found-picks-layer-0",
        "diffquant/eval/interventions.py",
        "            return MassiveSites(None, {}, 0)",
        "            layer = 0",
        ("tests/test_interventions.py::test_a_model_without_massive_activations_reports_none_found",),
    ),
    M(
        "stream-slice-scores-last-position",
        "diffquant/stream/api.py",
        "            end = min(start + logits.shape[1], ids.shape[1] - 1)",
        "            end = min(start + logits.shape[1], ids.shape[1])",
        (
            "tests/test_stream.py::"
            "test_streamed_perplexity_slices_a_large_vocabularys_head_like_the_whole_model",
        ),
    ),
    M(
        "stream-slice-ignores-head-quantizer",
        "diffquant/stream/executor.py",
        " or (isinstance(m, Tap) and m.active)",
        "",
        (
            "tests/test_stream.py::"
            "test_streamed_perplexity_slices_a_large_vocabularys_head_like_the_whole_model",
        ),
    ),
    M(
        "gguf-qwen2-pre-is-llama3",
        "diffquant/io/convert_gguf.py",
        '    "qwen2": "qwen2",',
        '    "qwen2": "llama3",',
        ("tests/test_gguf_families.py::test_qwen2_tokenizer_equals_transformers_gguf_loader",),
    ),
    M(
        "sink-probe-never-puts-bos-first",
        "diffquant/profile/runner.py",
        '    bos = tok.bos_id if getattr(tok, "add_bos", False) and seq_len > 1 else None',
        "    bos = None",
        (
            "tests/test_attention_metrics.py::"
            "test_sink_probe_reads_text_as_the_model_does_bos_first_when_its_tokenizer_adds_one",
        ),
    ),
    M(
        "sink-probe-bos-window-too-long",
        "diffquant/profile/runner.py",
        "    body = seq_len - (bos is not None)",
        "    body = seq_len",
        (
            "tests/test_attention_metrics.py::"
            "test_sink_probe_reads_text_as_the_model_does_bos_first_when_its_tokenizer_adds_one",
        ),
    ),
    # --- the native statistics pass (issue 27): C source recompiled per mutant (its cache key is the source)
    M(
        "native: histogram slot one bin low",
        "diffquant/kernels/_native.c",
        "int64_t slot = e ? 1 + (e - 1) * BINS_PER_OCTAVE + k_of_m[m] : 0;",
        "int64_t slot = e ? (e - 1) * BINS_PER_OCTAVE + k_of_m[m] : 0;",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: negatives binned as positives",
        "diffquant/kernels/_native.c",
        "dense[slot + (neg && slot ? slots : 0)] += c;",
        "dense[slot] += c;",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: row sum drops a lane",
        "diffquant/kernels/_native.c",
        "    return (s[0] + s[1]) + (s[2] + s[3]);\n}",
        "    return (s[0] + s[1]) + s[2];\n}",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: |x| >= 100 misses 100's fine interval",
        "diffquant/kernels/_native.c",
        "ge100 += mag >= CODE_100 ? c : 0;",
        "ge100 += mag > CODE_100 ? c : 0;",
        ("tests/test_stats.py::test_thresholds_exact_at_6_and_100",),
    ),
    M(
        "native: |x| >= 6 misses 6's fine interval",
        "diffquant/kernels/_native.c",
        "ge6 += mag >= CODE_6 ? c : 0;",
        "ge6 += mag > CODE_6 ? c : 0;",
        ("tests/test_stats.py::test_thresholds_exact_at_6_and_100",),
    ),
    M(
        "native: top-k candidates strictly above the bar",
        "diffquant/kernels/_native.c",
        "if (a >= bar && push(top, base + j)) return -1;",
        "if (a > bar && push(top, base + j)) return -1;",
        ("tests/test_stats.py::test_top_k_ties_at_a_bin_edge",),
    ),
    M(
        "native: map row candidates without the range offset",
        "diffquant/kernels/_native.c",
        "if (want && row_candidates(row, n, r * width + a, bar, want_massive, &tops[s], &mass[s]))\n                failed = 1;\n        }",
        "if (want && row_candidates(row, n, r * width, bar, want_massive, &tops[s], &mass[s]))\n                failed = 1;\n        }",
        ("tests/test_stats.py::test_native_pass_equals_the_torch_path",),
    ),
    M(
        "native: kept head index ignores inner rows",
        "diffquant/kernels/_native.c",
        "int64_t g = (r / inner) % groups;",
        "int64_t g = r % groups;",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: a NaN row's values all counted",
        "diffquant/kernels/_native.c",
        "        if (m >= 0x7F800000u) { bad++; continue; }",
        "        if (m >= 0x7F800000u) { bad++; }",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: pass 2 mean over the row width",
        "diffquant/kernels/_native.c",
        "row_moments_finite(row, n, cnt > 0 ? row_sum[r] / cnt : 0.0,",
        "row_moments_finite(row, n, cnt > 0 ? row_sum[r] / (double)n : 0.0,",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: channel sums of squares keep one segment",
        "diffquant/kernels/_native.c",
        "for (int s = 0; s < NSEG; s++) acc += part[(size_t)s * nkeep + i];",
        "for (int s = 0; s < 1; s++) acc += part[(size_t)s * nkeep + i];",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    M(
        "native: map ranges one key short",
        "diffquant/kernels/native.py",
        "    return torch.stack([first, first + count], -1).contiguous()",
        "    return torch.stack([first, first + count - 1], -1).contiguous()",
        (
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
            "tests/test_stats.py::test_exact_against_brute_force",
        ),
    ),
    M(
        "native: squares of non-finite rows counted per channel as whole",
        "diffquant/profile/stats.py",
        "                    count = (okv.sum(dim=reduce) if reduce else okv).reshape(-1)",
        "                    count = torch.full_like(sumsq, float(okv.numel() // sumsq.numel()))",
        (
            "tests/test_stats.py::test_exact_against_brute_force",
            "tests/test_stats.py::test_native_pass_equals_the_torch_path",
        ),
    ),
    # --- the shared dynamic input quantization (issue 27 item 4)
    M(
        "shared input quantization ignores in-place edits",
        "diffquant/quant/fake.py",
        "        version = None if x.is_inference() else x._version",
        "        version = None",
        ("tests/test_quant.py::test_linears_reading_one_tensor_quantize_it_once",),
    ),
    M(
        "shared input quantization across schemes",
        "diffquant/quant/fake.py",
        "        return (version, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, scheme, layout)",
        "        return (version, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, layout)",
        ("tests/test_quant.py::test_linears_reading_one_tensor_quantize_it_once",),
    ),
    M(
        "shared input quantization by address only",
        "diffquant/quant/fake.py",
        "if self.source is None or self.source() is not x or self.key != self._key(x, scheme, layout):",
        "if self.source is None or self.key != self._key(x, scheme, layout):",
        ("tests/test_quant.py::test_linears_reading_one_tensor_quantize_it_once",),
    ),
    M(
        "native map rows: key 0 read when the window hides it",
        "diffquant/kernels/_native.c",
        "o[1] = (a == 0 && n > 0) ? (double)row[0] : 0.0;",
        "o[1] = n > 0 ? (double)(row - a)[0] : 0.0;",
        (
            "tests/test_attention_metrics.py::test_native_metrics_equal_the_torch_path",
            "tests/test_attention_metrics.py::test_map_stats_match_brute_force",
        ),
    ),
    M(
        "native map rows: signed sum for |D|",
        "diffquant/kernels/_native.c",
        "s1[j & 3] += fabs((double)d);",
        "s1[j & 3] += (double)d;",
        (
            "tests/test_attention_metrics.py::test_native_metrics_equal_the_torch_path",
            "tests/test_attention_metrics.py::test_map_stats_match_brute_force",
        ),
    ),
    M(
        "native map rows: entropy sign",
        "diffquant/kernels/_native.c",
        "if (p > 0.0f) s0[j & 3] -= (double)p * (double)logf(p);",
        "if (p > 0.0f) s0[j & 3] += (double)p * (double)logf(p);",
        (
            "tests/test_attention_metrics.py::test_native_metrics_equal_the_torch_path",
            "tests/test_attention_metrics.py::test_map_stats_match_brute_force",
        ),
    ),
    M(
        "native map rows: the whole row, not its visible keys",
        "diffquant/profile/attention_metrics.py",
        "    return None if ranges is None else native.map_rows(x, ranges, differential)",
        "    return None if ranges is None else native.map_rows(x, torch.stack([ranges[:, 0] * 0, ranges[:, 1] * 0 + x.shape[-1]], -1), differential)",
        (
            "tests/test_attention_metrics.py::test_native_metrics_equal_the_torch_path",
            "tests/test_attention_metrics.py::test_map_stats_match_brute_force",
        ),
    ),
    M(
        "native fake quant: round half away from zero",
        "diffquant/kernels/_native.c",
        "for (int64_t j = 0; j < width; j++) o[j] = rintf(row[j] / s) * s;",
        "for (int64_t j = 0; j < width; j++) o[j] = roundf(row[j] / s) * s;",
        ("tests/test_quant.py::test_native_per_token_int_fake_quant_is_the_torch_one",),
    ),
    M(
        "native fake quant: multiply by the reciprocal scale",
        "diffquant/kernels/_native.c",
        "for (int64_t j = 0; j < width; j++) o[j] = rintf(row[j] / s) * s;",
        "for (int64_t j = 0; j < width; j++) o[j] = rintf(row[j] * (1.0f / s)) * s;",
        ("tests/test_quant.py::test_native_per_token_int_fake_quant_is_the_torch_one",),
    ),
    M(
        "native fake quant: zero rows keep a zero scale",
        "diffquant/kernels/_native.c",
        "        if (!(s > 0.0f)) s = 1.0f;\n        float *o = out + r * width;",
        "        float *o = out + r * width;",
        ("tests/test_quant.py::test_native_per_token_int_fake_quant_is_the_torch_one",),
    ),
    # --- issue 30: the rival attention kinds (gated, sink, clipped)
    M(
        "rival-gate-without-sigmoid",
        "diffquant/models/attention.py",
        "        g = torch.sigmoid(z.to(compute_dtype(z.dtype)))",
        "        g = z.to(compute_dtype(z.dtype))",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-gate-reads-the-previous-token",
        "diffquant/models/attention.py",
        "        gate = self._gate(x)",
        "        gate = self._gate(x.roll(1, dims=1))",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-gate-heads-and-channels-swapped",
        "diffquant/models/attention.py",
        "        return self.gate(g.view(*x.shape[:2], self.n_heads, self.gate_width))",
        "        return self.gate(g.view(*x.shape[:2], self.gate_width, self.n_heads).transpose(-1, -2))",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-sink-not-in-the-denominator",
        "diffquant/models/attention.py",
        "        return torch.softmax(torch.cat([column, logits], dim=-1), dim=-1)[..., 1:]",
        "        return torch.softmax(logits, dim=-1)",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-sink-key-logit-scaled-the-wrong-way",
        "diffquant/models/attention.py",
        "/ self.scale).to(kc.dtype)",
        "* self.scale).to(kc.dtype)",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-sink-hidden-by-the-window",
        "diffquant/models/attention.py",
        "        mask = torch.cat([valid.new_ones(t, 1), valid], dim=1)",
        "        mask = torch.cat([valid[:, :1], valid], dim=1)",
        ("tests/test_rival_kinds.py::test_cached_decoding_equals_the_papers_formula",),
    ),
    M(
        "rival-clipped-gamma-sign",
        "diffquant/models/attention.py",
        "        return ((self.clip_zeta - self.clip_gamma) * p + self.clip_gamma).clamp(0.0, 1.0)",
        "        return ((self.clip_zeta + self.clip_gamma) * p - self.clip_gamma).clamp(0.0, 1.0)",
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-clipped-takes-sdpa",
        "diffquant/models/attention.py",
        '    kind = "clipped"\n    fused = False',
        '    kind = "clipped"\n    fused = True',
        ("tests/test_rival_kinds.py::test_prefill_equals_the_papers_formula",),
    ),
    M(
        "rival-r2-across-an-elementwise-gate",
        "diffquant/quant/rotate.py",
        '    return getattr(attn, "gate_width", 1) == 1',
        "    return True",
        ("tests/test_rival_kinds.py::test_rotation_is_exact",),
    ),
    M(
        "rival-gate-proj-not-a-stream-reader",
        "diffquant/models/attention.py",
        '    input_readers = (*Attention.input_readers, "gate_proj")',
        "    input_readers = Attention.input_readers",
        ("tests/test_rival_kinds.py::test_rotation_is_exact",),
    ),
    M(
        "rival-gate-matched-as-head-wise",
        "diffquant/models/config.py",
        '        return c.d_model * c.n_heads * (c.head_dim if c.gate == "elementwise" else 1)',
        "        return c.d_model * c.n_heads",
        ("tests/test_rival_kinds.py::test_every_preset_is_matched_within_half_a_percent",),
    ),
    M(
        "rival-kernel-takes-the-rivals",
        "diffquant/kernels/dispatch.py",
        '_KERNEL_KINDS = ("diff_v1", "diff_v2")',
        '_KERNEL_KINDS = ("diff_v1", "diff_v2", "gated", "sink", "clipped")',
        ("tests/test_rival_kinds.py::test_dispatch_never_sends_a_rival_to_a_kernel",),
    ),
    M(
        "rival-reference-core-drops-the-sink",
        "diffquant/kernels/reference.py",
        "        p = torch.softmax(torch.cat([column, logits], dim=-1), dim=-1)[..., 1:]",
        "        p = torch.softmax(logits, dim=-1)",
        ("tests/test_rival_kinds.py::test_reference_cores_equal_the_formulas_with_fewer_queries_than_keys",),
    ),
    M(
        "rival-variant-field-of-another-kind-accepted",
        "diffquant/models/config.py",
        "                self.attention == reader or getattr(self, field) == default,",
        "                True,",
        ("tests/test_rival_kinds.py::test_variant_fields_are_checked_in_one_line_each",),
    ),
    # --- seed groups (issue 30)
    M(
        "seed spread: population sd",
        "diffquant/report/seeds.py",
        "sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None",
        "sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n) if n > 1 else None",
        ("tests/test_seeds.py",),
    ),
    M(
        "seed noise: one standard error",
        "diffquant/report/seeds.py",
        "        beyond = None if se is None else abs(diff) > Z * se",
        "        beyond = None if se is None else abs(diff) > se",
        ("tests/test_seeds.py",),
    ),
    M(
        "seed noise: pooled without degrees of freedom",
        "diffquant/report/seeds.py",
        "            num += (s.n - 1) * s.sd**2\n            den += s.n - 1",
        "            num += s.sd**2\n            den += 1",
        ("tests/test_seeds.py",),
    ),
    M(
        "seed groups: a seed model alone",
        "diffquant/report/seeds.py",
        '            groups.setdefault(match.group("group") if match else m, []).append(m)',
        "            groups.setdefault(m, []).append(m)",
        ("tests/test_seeds.py",),
    ),
    M(
        "sink rate over seeds: a share, not percent",
        "diffquant/report/seeds.py",
        "            out[group] = Spread.of([100.0 * r for r in rates]).to_dict()",
        "            out[group] = Spread.of(rates).to_dict()",
        ("tests/test_seeds.py",),
    ),
    M(
        "zoo table: fixed column widths",
        "diffquant/cli.py",
        "    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]",
        "    widths = [len(h) + 8 for h in header]",
        ("tests/test_readme.py::test_zoo_table_is_what_the_cards_say",),
    ),
    M(
        "zoo table: every model seed 0",
        "diffquant/cli.py",
        '                str(c["seed"]),',
        '                "0",',
        ("tests/test_readme.py::test_zoo_table_is_what_the_cards_say",),
    ),
    M(
        "sink rate over seeds: a group from its probed seeds only",
        "diffquant/report/seeds.py",
        "        if rates and all(isinstance(r, (int, float)) for r in rates):",
        "        rates = [r for r in rates if isinstance(r, (int, float))]\n        if rates:",
        ("tests/test_seeds.py",),
    ),
    M(
        "seed comparisons: the spread of the reference alone",
        "diffquant/report/seeds.py",
        "    pooled = pooled_sd(spreads.values())\n    r = spreads[ref]",
        "    pooled = pooled_sd([spreads[ref]])\n    r = spreads[ref]",
        ("tests/test_seeds.py",),
    ),
    M(
        "seed tables: fixed column width",
        "diffquant/report/seeds.py",
        "        widths = [max(len(heads[i]), *(len(c[i]) for c in table.values())) + 2 for i in range(len(groups))]",
        "        widths = [max(24, len(heads[i]) + 2) for i in range(len(groups))]",
        ("tests/test_seeds.py",),
    ),
    # --- native library loader (issue 44: ownership / mode, hash, entry points, compile budget, 0700 / 0600)
    M(
        "native library: folder owner not checked",
        "diffquant/kernels/native.py",
        '    if st.st_uid != os.geteuid():\n        raise _Untrusted(f"{what} is owned by uid',
        '    if False:\n        raise _Untrusted(f"{what} is owned by uid',
        ("tests/test_native_security.py::test_a_cache_folder_others_can_write_is_not_used",),
    ),
    M(
        "native library: group-writable folders trusted",
        "diffquant/kernels/native.py",
        '    if st.st_mode & 0o022:\n        raise _Untrusted(f"{what} is writable',
        '    if st.st_mode & 0o002:\n        raise _Untrusted(f"{what} is writable',
        ("tests/test_native_security.py::test_a_cache_folder_others_can_write_is_not_used",),
    ),
    M(
        "native library: shared parent folders trusted",
        "diffquant/kernels/native.py",
        "    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:",
        "    if False:",
        ("tests/test_native_security.py::test_a_folder_above_the_cache_may_be_shared_only_when_sticky",),
    ),
    M(
        "native library: sticky parent folders refused",
        "diffquant/kernels/native.py",
        "    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:",
        "    if st.st_mode & 0o022:",
        ("tests/test_native_security.py::test_a_folder_above_the_cache_may_be_shared_only_when_sticky",),
    ),
    M(
        "native library: sha256 not compared",
        "diffquant/kernels/native.py",
        "        if _sha256(fd) != expected:",
        "        if False:",
        (
            "tests/test_native_security.py::test_a_planted_library_in_the_cache_is_not_loaded_but_rebuilt",
            "tests/test_native_security.py::test_a_truncated_library_is_rebuilt_not_mapped",
        ),
    ),
    M(
        "native library: entry points not required",
        "diffquant/kernels/native.py",
        "    if missing:\n        _dlclose(lib)",
        "    if False:\n        _dlclose(lib)",
        ("tests/test_native_security.py::test_a_library_without_the_entry_points_is_rebuilt",),
    ),
    M(
        "native library: 120 s per variant, no overall budget",
        "diffquant/kernels/native.py",
        "        left = deadline - time.monotonic()",
        "        left = 120.0",
        ("tests/test_native_security.py::test_a_hung_compiler_is_abandoned_within_the_budget",),
    ),
    M(
        "native library: the compiler killed, not its process group",
        "diffquant/kernels/native.py",
        "os.killpg(proc.pid, signal.SIGKILL)",
        "proc.kill()",
        ("tests/test_native_security.py::test_a_hung_compiler_is_abandoned_within_the_budget",),
    ),
    M(
        "native library: folders not chmod 0700",
        "diffquant/kernels/native.py",
        "    os.chmod(folder, 0o700)",
        "    pass",
        ("tests/test_native_security.py::test_folders_are_0700_and_files_0600_under_any_umask",),
    ),
    M(
        "native library: library not chmod 0600",
        "diffquant/kernels/native.py",
        "        os.chmod(tmp, 0o600)",
        "        pass",
        ("tests/test_native_security.py::test_folders_are_0700_and_files_0600_under_any_umask",),
    ),
    M(
        "native library: sidecar not chmod 0600",
        "diffquant/kernels/native.py",
        "        os.fchmod(fd, 0o600)",
        "        pass",
        ("tests/test_native_security.py::test_folders_are_0700_and_files_0600_under_any_umask",),
    ),
    # --- issue 47: docs numbers tied to committed run outputs (tests/docpages.py, tests/test_docs_numbers.py)
    M(
        "docs numbers: the last cell of a row not compared",
        "tests/docpages.py",
        "        for c, (cell, value) in enumerate(zip(got, row, strict=True)):",
        "        for c, (cell, value) in enumerate(zip(got[:-1], row[:-1], strict=True)):",
        ("tests/test_docs_numbers.py::test_differences_name_every_cell_and_row_that_differs",),
    ),
    M(
        "docs numbers: a number within one unit of its last digit agrees",
        "tests/docpages.py",
        "    return shown == text\n",
        '    return abs(float(shown.replace(",", "")) - value) <= 10.0**-digits\n',
        (
            "tests/test_docs_numbers.py::test_agrees_rounds_to_the_digits_shown_and_keeps_the_sign_and_grouping",
        ),
    ),
    M(
        "docs numbers: a table's first row never counts as measured",
        "tests/docpages.py",
        "for row in item.rows[1:] for cell in row)",
        "for row in item.rows[2:] for cell in row)",
        ("tests/test_docs_numbers.py::test_a_block_is_compared_number_by_number_commands_aside",),
    ),
    M(
        "docs numbers: a past measurement's commit not looked up",
        "tests/test_docs_numbers.py",
        "        if not known or _git(",
        "        if False and _git(",
        ("tests/test_docs_numbers.py::test_a_made_up_commit_is_reported",),
    ),
]


def run(args: argparse.Namespace) -> list[dict]:
    chosen = [m for m in MUTANTS if not args.only or any(s in m.name or s in m.path for s in args.only)]
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
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="SUBSTRING",
        help="run the mutants whose name or file contains one of these",
    )
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
