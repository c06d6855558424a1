"""The GPU kit's last stage: a parameter-matched trio (baseline / DIFF V1 / DIFF V2) trained to the size the
time allows, then its Table 5 view and the attention-logit int8/6/4, W8A8 and W4A8 sweep, figures and report.

Sizing (issue 31): ~50M parameters each on ~1e8 tokens, or the largest model the budget trains on ~1e8 tokens.
A short probe measures training tokens/s of the largest size on the machine itself (the trainer's own step:
bf16 autocast, AdamW, the data mixer), for all three kinds (DIFF's extra query heads make it slower); a size
that is not measured is projected from a measured one by training FLOPs per token and then measured before it
is chosen. The time for the three runs is what is left of the stage after the probe and a reserve for the
sweep; each run's fixed costs (data, the final evaluation the trainer does on the CPU, the export) are
estimated and taken off first. If no size reaches the token target, the smallest trains on what fits.

Text: the standard library's sources (``stdlib:train``, ~12M bytes); when a run needs more tokens than that,
a corpus of stdlib:train followed by the installed packages' Python sources (site-packages: torch,
transformers, numpy, ... on the GPU machine), written once as JSONL, so the models do not see the same bytes
several times. Evaluation text is always ``stdlib:validation`` (files the split keeps out of training).
"""

from __future__ import annotations

import json
import os
import site
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit_stages import _sweep, _table5
from kit_util import Context, Recorder, diffquant, last_error, read_json, run_timed

KINDS = ("baseline", "diff_v1", "diff_v2")
PLANS = ("attn-logits-int8", "attn-logits-int6", "attn-logits-int4", "w8a8", "w4a8")

# Baseline configs, largest first (the DIFF kinds are derived by matched_config). Byte-level vocabulary (259).
LADDER = {
    "gpu": {
        "52M": {
            "d_model": 640,
            "n_layers": 12,
            "n_heads": 10,
            "n_kv_heads": 2,
            "head_dim": 64,
            "ffn_dim": 1728,
        },
        "30M": {
            "d_model": 512,
            "n_layers": 10,
            "n_heads": 8,
            "n_kv_heads": 4,
            "head_dim": 64,
            "ffn_dim": 1408,
        },
        "13M": {
            "d_model": 384,
            "n_layers": 8,
            "n_heads": 6,
            "n_kv_heads": 2,
            "head_dim": 64,
            "ffn_dim": 1024,
        },
        "6M": {"d_model": 256, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "ffn_dim": 768},
        "3M": {"d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "head_dim": 32, "ffn_dim": 768},
    },
    "rehearse": {
        "toy-b": {
            "d_model": 96,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 24,
            "ffn_dim": 256,
        },
        # head_dim 24 (not 16): the matched DIFF V2's SwiGLU then lands on 160, a multiple of the study's
        # W4A8 groups of 32 (with 16 it was 168, and the smallest rehearsal size could not run the sweep)
        "toy-a": {
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 24,
            "ffn_dim": 192,
        },
    },
}

SETTINGS = {
    "gpu": {
        "seq_len": 512,
        # sequences per step by size: small models take larger batches, or their steps are bound by kernel
        # launches and the tokens/s that sizes the run is lost to them (~1-2e8 tokens/step-count stays sane)
        "batch_size": {"52M": 64, "30M": 64, "13M": 128, "6M": 256, "3M": 256},
        "target_tokens": 100_000_000,
        "min_steps": 50,
        "probe_warmup": 2,
        "probe_steps": 6,
        "probe_data_tokens": 2_000_000,
        "stdlib_data_tokens": None,  # all of stdlib:train
        "post_reserve_s": 100.0,  # profile + 36-cell sweep + 21 figures + report
        "eval_tokens": 8192,  # the trainer's validation and final card (the card's on the CPU)
        "retrieval_samples": 2,
        "profile_tokens": 32768,
        "bpb_tokens": 32768,
        "calib_tokens": 4096,
        "retrieval_eval_samples": 10,
        "margin": 0.85,  # of the predicted training time actually planned
        # the trainer's torch_compile for the probe and the three runs: off until the train_compile stage
        # has measured on the GPU that compiled steps, compile time included, train more tokens (issue 46)
        "torch_compile": False,
    },
    "rehearse": {
        "seq_len": 256,  # the trainer's retrieval check wants 128 tokens of question and answer in the context
        "batch_size": {"toy-b": 4, "toy-a": 4},
        "target_tokens": 12288,
        "min_steps": 4,
        "probe_warmup": 1,
        "probe_steps": 2,
        "probe_data_tokens": 200_000,
        "stdlib_data_tokens": 200_000,
        "post_reserve_s": 40.0,
        "eval_tokens": 1024,
        "retrieval_samples": 1,
        "profile_tokens": 1024,
        "bpb_tokens": 1024,
        "calib_tokens": 512,
        "retrieval_eval_samples": 1,
        "margin": 0.85,
        "torch_compile": False,
    },
}
NEEDLE_FRACTION = 0.2
# the settings of the study a part of a trio must share with the other parts (the study recipe's amounts)
STUDY_SETTINGS = (
    "seq_len",
    "eval_tokens",
    "retrieval_samples",
    "profile_tokens",
    "bpb_tokens",
    "calib_tokens",
    "retrieval_eval_samples",
)
CORPUS_SKIP = frozenset({"test", "tests", "__pycache__", "site-packages", "dist-packages"})


# ------------------------------------------------------------------------------------------ sizing
def trio_configs(base: dict[str, int], seq_len: int) -> dict[str, Any]:
    """The three matched ModelConfigs of one ladder entry, with a context of ``seq_len``."""
    from diffquant.models import ModelConfig, matched_configs

    return matched_configs(ModelConfig(**base, max_seq_len=seq_len))


def size_facts(base: dict[str, int], seq_len: int) -> dict[str, Any]:
    """Parameters per kind and training FLOPs per token of the kind that needs most (both counted on the meta
    device: nothing allocated), for projecting tokens/s between sizes: diffquant.train.flops's count, the
    one the probe's and the trainer's mfu divide, over rows of ``seq_len`` tokens."""
    import torch

    from diffquant.models import DecoderLM
    from diffquant.train import flops

    params, per_token = {}, {}
    for kind, config in trio_configs(base, seq_len).items():
        with torch.device("meta"):
            model = DecoderLM(config)
        params[kind] = model.num_parameters()
        per_token[kind] = flops.row_flops_per_token(model, seq_len)
    return {"params": params, "flops_per_token": max(per_token.values())}


def overhead_s(params: int, settings: dict[str, Any], cpu_flops: float, data_tokens: int) -> float:
    """A run's seconds outside the training steps: reading the data, the in-loop validation, and the trainer's
    final card, which it measures on the CPU (validation and train bits per byte on eval_tokens each, needle
    retrieval), plus the export. A rough estimate with a factor 3 for the CPU's efficiency on these shapes."""
    read = 2.0 + data_tokens / 5e6
    tokens = 2 * settings["eval_tokens"] + 5 * settings["retrieval_samples"] * settings["seq_len"]
    finish = 3.0 + 3 * 2 * params * tokens / cpu_flops + params * 8 / 2e8
    return read + finish


def choose_size(
    facts: dict[str, dict[str, Any]],
    measured: dict[str, float],
    seconds_per_model: float,
    settings: dict[str, Any],
    overhead: dict[str, float],
) -> dict[str, Any]:
    """The largest size (``facts`` is ordered largest first) whose predicted tokens in ``seconds_per_model``
    reach the target, else the smallest with what fits. Unmeasured sizes are projected from the measured one
    nearest in FLOPs per token; ``measured`` says whether the choice rests on a measurement.

    Returns {size, tokens, tokens_per_s, measured, reaches_target, predicted: {size: tokens}}."""
    assert measured, "choose_size needs at least one measured size"
    target, margin = settings["target_tokens"], settings["margin"]
    predicted: dict[str, dict[str, Any]] = {}
    for name, fact in facts.items():
        if name in measured:
            tps = measured[name]
        else:
            ref = min(measured, key=lambda m: abs(facts[m]["flops_per_token"] - fact["flops_per_token"]))
            tps = measured[ref] * facts[ref]["flops_per_token"] / fact["flops_per_token"]
        train_s = max(0.0, seconds_per_model - overhead[name])
        predicted[name] = {"tokens_per_s": tps, "train_s": train_s, "tokens": int(tps * train_s * margin)}
    names = list(facts)
    pick = next((n for n in names if predicted[n]["tokens"] >= target), names[-1])
    tokens = min(target, predicted[pick]["tokens"])
    return {
        "size": pick,
        "tokens": tokens,
        "tokens_per_s": predicted[pick]["tokens_per_s"],
        "measured": pick in measured,
        "reaches_target": predicted[pick]["tokens"] >= target,
        "predicted": {n: p["tokens"] for n, p in predicted.items()},
    }


def plan_steps(tokens: int, settings: dict[str, Any], size: str) -> int:
    """Optimizer steps for ``tokens`` at the size's batch, at least min_steps."""
    return max(settings["min_steps"], tokens // (settings["batch_size"][size] * settings["seq_len"]))


def cpu_flops() -> float:
    """fp32 matmul FLOP/s of this CPU (torch's threads): what the trainer's final evaluation runs at."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    begin = time.perf_counter()
    for _ in range(8):
        a @ b
    return 8 * 2 * 512**3 / max(1e-9, time.perf_counter() - begin)


def probe(
    base: dict[str, int],
    bsz: int,
    settings: dict[str, Any],
    device: str,
    data,
    every_kind: bool = True,
    compile_model: bool | None = None,
    record: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Training tokens/s of every attention kind at one size (the trio's and the rivals'): the trainer's step
    (its forward, eager or ``torch.compile``d as ``compile_model`` says, else as the settings' ``torch_compile``;
    bf16 autocast on CUDA; its AdamW, fused on CUDA; clipping; the data mixer's batches), after warm-up steps,
    with the model FLOPs utilisation the trainer reports (``mfu``: model FLOPs per token x tokens/s over the
    chip's dense bf16 peak, diffquant.train.flops; None off the known GPUs). Clipped softmax is measured
    twice: recomputing its maps in backward (the default) and keeping them (``clipped-keep-maps``: faster,
    T x T maps per head in memory). ``warmup_s`` is the warm-up steps' seconds: with compilation, mostly the
    compile. ``record`` gets the results so far after each kind (a stage cut at its budget keeps them)."""
    import torch

    from diffquant.models import DecoderLM
    from diffquant.train import flops
    from diffquant.train.trainer import adamw, batch_to, forward_precision, train_step, training_forward

    if compile_model is None:
        compile_model = settings["torch_compile"]
    seq = settings["seq_len"]
    peak = flops.peak_flops(torch.device(device))
    autocast = forward_precision("auto", torch.device(device))
    out: dict[str, Any] = {}
    runs = [
        (kind, config, True)
        for kind, config in trio_configs(base, seq).items()
        if every_kind or kind in KINDS
    ]
    runs += [("clipped-keep-maps", config, False) for kind, config, _ in runs if kind == "clipped"]
    for kind, config, recompute in runs:
        if compile_model:
            # each kind compiles afresh: TorchDynamo counts recompiles of a function across models, and past
            # its limit (8) it runs that function eagerly without saying so
            torch._dynamo.reset()
        torch.manual_seed(0)
        model = DecoderLM(config).to(device).train()
        for attn in model.attention_modules():
            attn.recompute_maps = recompute
        opt = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        forward = training_forward(model, compile_model)

        def step(i: int, model=model, forward=forward, opt=opt, autocast=autocast) -> None:
            # the trainer's own step and batch transfer (no wait for the device inside either)
            ids = batch_to(data.batch(i, bsz), torch.device(device))
            train_step(model, forward, opt, autocast, ids, data.tok.pad_id, 1.0)

        begin = time.perf_counter()
        for i in range(settings["probe_warmup"]):
            step(i)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        warmup_s = time.perf_counter() - begin
        begin = time.perf_counter()
        for i in range(settings["probe_steps"]):
            step(1000 + i)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        tokens_per_s = settings["probe_steps"] * bsz * seq / seconds
        per_token = flops.row_flops_per_token(model, seq)  # as the trainer's mfu column counts
        out[kind] = {
            "mfu": flops.utilisation(per_token, tokens_per_s, peak),
            "tokens_per_s": tokens_per_s,
            "step_s": seconds / settings["probe_steps"],
            "warmup_s": round(warmup_s, 2),
            "compiled": compile_model,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        }
        if device == "cuda":  # what the CPU device check cannot see: syncs inside CUDA's own ops, backward's
            syncs = step_syncs(step, 2000)
            out[kind].update(host_syncs_per_step=len(syncs), host_syncs=sorted(set(syncs))[:8])
        del model, forward, opt
        if device == "cuda":
            torch.cuda.empty_cache()
        if record is not None:
            record(out)
    return out


def step_syncs(step: Callable[[int], None], i: int) -> list[str]:
    """The host syncs of ``step(i)`` on CUDA as ``torch.cuda.set_sync_debug_mode("warn")`` reports them (a
    warning per synchronizing call: a scalar read, a blocking copy, a data-sized output), each as "file:line:
    message" of the Python line that made it; the mode is restored whatever happens."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}: {w.message}" for w in caught]


def probe_data(settings: dict[str, Any]):
    """The probe's batches: the trainer's data mixer over the first probe_data_tokens of stdlib:train."""
    from diffquant.train.data import TrainData

    return TrainData(
        "stdlib:train",
        seq_len=settings["seq_len"],
        max_tokens=settings["probe_data_tokens"],
        needle_fraction=NEEDLE_FRACTION,
        seed=0,
    )


# ------------------------------------------------------------------------------------------ corpus
def corpus_roots() -> list[Path]:
    """The installed packages' folders (site-packages / dist-packages) of this Python."""
    paths = set(site.getsitepackages()) | {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(Path(p) for p in paths if Path(p).is_dir())


def build_corpus(
    path: Path, need: int, roots: list[Path], lead: str | None = "stdlib:train"
) -> dict[str, Any]:
    """A JSONL corpus (one record per file) of ``lead`` (stdlib:train), then the Python sources under ``roots``
    in path order (test folders and caches skipped), until ``need`` byte tokens are there. Written once by the
    stage so the three runs read one file, the same text in the same order."""
    from diffquant.data import iter_documents

    tmp = path.with_name(path.name + ".tmp")
    have = files_stdlib = files_packages = 0
    with open(tmp, "w") as out:

        def add(text: str) -> None:
            nonlocal have
            out.write(json.dumps({"text": text}) + "\n")
            have += len(text.encode("utf-8", errors="replace")) + 2  # BOS + EOS

        for doc in iter_documents(lead) if lead else ():
            add(doc.text)
            files_stdlib += 1
            if have >= need:
                break
        for root in roots:
            if have >= need:
                break
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d not in CORPUS_SKIP and not d.startswith("."))
                for name in sorted(filenames):
                    if not name.endswith(".py"):
                        continue
                    try:
                        text = (Path(dirpath) / name).read_text(encoding="utf-8", errors="replace")
                    except OSError:
                        continue
                    if text.strip():
                        add(text)
                        files_packages += 1
                    if have >= need:
                        break
                if have >= need:
                    break
    tmp.replace(path)
    return {
        "path": str(path),
        "tokens": have,
        "files_stdlib": files_stdlib,
        "files_packages": files_packages,
        "roots": [str(r) for r in roots],
        "short": have < need,
    }


# ------------------------------------------------------------------------------------------ recipes
def train_recipe(
    kind: str,
    batch: int,
    config,
    settings: dict[str, Any],
    steps: int,
    lr: float,
    data: str,
    data_tokens,
    device: str,
) -> dict[str, Any]:
    """A `diffquant train` recipe for one kind: the matched config given whole under ``model`` (every key,
    so the preset named does not matter), one validation at the end, no intermediate checkpoints."""
    return {
        "name": f"gpu-trio-{kind}",
        "kind": kind,
        "preset": "small",
        "model": config.to_dict(),
        "data": data,
        "data_tokens": data_tokens,
        "needle_fraction": NEEDLE_FRACTION,
        "seq_len": settings["seq_len"],
        "batch_size": batch,
        "steps": steps,
        "lr": lr,
        "min_lr": lr / 10,
        "warmup": min(200, max(1, steps // 10)),
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "seed": 0,
        "log_every": max(1, steps // 40),
        "eval_every": steps,
        "eval_data": "stdlib:validation",
        "eval_tokens": settings["eval_tokens"],
        "retrieval_samples": settings["retrieval_samples"],
        "checkpoint_every": steps,
        "save_dtype": "float32",
        "device": device,
        "torch_compile": settings["torch_compile"],
    }


def train_from_recipe(
    recipe: dict[str, Any], path: Path, out: Path, *, stop_after: int | None = None, log=print
):
    """Write ``recipe`` to ``path`` as YAML (the run's record), load it as ``diffquant train`` would and train
    into ``out``; returns the loaded TrainConfig. The trio, the autocast_gap stage and analysis/autocast."""
    import yaml

    from diffquant.train import TrainConfig, train

    text = yaml.safe_dump(recipe, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    cfg = TrainConfig.load(path)
    cfg.out = str(out)
    train(cfg, stop_after=stop_after, recipe_text=text, log=log)
    return cfg


def learning_rate(params: int) -> float:
    """Smaller models take larger steps (the zoo: 3e-3 at 0.9M; train-gpu.yaml: 2e-3 at 3.3M)."""
    return 2e-3 if params < 10e6 else (1.5e-3 if params < 35e6 else 1e-3)


def study_recipe(
    models: dict[str, str], settings: dict[str, Any], device: str, out: Path, plots: bool = True
) -> dict[str, Any]:
    """The `diffquant run` recipe of the study: the demo's (diffquant/zoo/demo.yaml) at the trained context,
    in float32 on the device (quantization errors are measured against fp32, as in the demo). A part of a
    trio draws no figures (``plots`` False): the join draws them for the whole trio."""
    seq = settings["seq_len"]
    return {
        "name": "gpu-trio",
        "description": "the kit's trio: Table 5 view, attention logits int8/6/4, W8A8, W4A8",
        "models": models,
        "device": device,
        "dtype": "float32",
        "data": {"calib": {"source": "stdlib:train", "tokens": settings["calib_tokens"], "seq_len": seq}},
        "profile": {
            "data": "stdlib:validation",
            "tokens": settings["profile_tokens"],
            "seq_len": seq,
            "sink_rate": True,
        },
        "eval": {
            "tasks": [
                {
                    "type": "bpb",
                    "data": "stdlib:validation",
                    "tokens": settings["bpb_tokens"],
                    "seq_len": seq,
                },
                {
                    "type": "retrieval",
                    "needles": 4,
                    "queries": 1,
                    "samples_per_depth": settings["retrieval_eval_samples"],
                    "context_bytes": seq - 128,  # as the trainer's own retrieval check (RETRIEVAL_RESERVE)
                    "seed": 7,
                },
            ]
        },
        "sweep": {"plans": list(PLANS)},
        "plots": {"enabled": plots},
        "output": {"dir": str(out)},
    }


# ------------------------------------------------------------------------------------------ compile probe
def stage_train_compile(ctx: Context, rec: Recorder) -> None:
    """Does ``torch.compile`` raise training's share of the chip (issue 46, goal 5)? The probe at the ladder's
    largest size (52M on the GPU) for every kind, eager and then compiled, each kind recorded as it ends
    (``eager`` / ``compiled``: tokens/s, mfu, warmup_s: with compilation mostly the compile, peak memory);
    ``speedup``: compiled over eager tokens/s per kind. If compiled steps win by more than their compile time
    costs a run, SETTINGS["gpu"]["torch_compile"] is what to turn on for the trio. Runs only when named."""
    settings = SETTINGS[ctx.mode]
    ladder = LADDER[ctx.mode]
    size = next(iter(ladder))
    data = probe_data(settings)
    rec.set(size=size, batch=settings["batch_size"][size], seq_len=settings["seq_len"])
    results: dict[str, dict[str, Any]] = {}
    for label, compiled in (("eager", False), ("compiled", True)):
        results[label] = probe(
            ladder[size],
            settings["batch_size"][size],
            settings,
            ctx.device,
            data,
            compile_model=compiled,
            record=lambda out, label=label: rec.set(**{label: out}),
        )
    rec.set(
        speedup={
            kind: round(results["compiled"][kind]["tokens_per_s"] / row["tokens_per_s"], 3)
            for kind, row in results["eager"].items()
        }
    )
    if not ctx.cuda:
        rec.finish("skipped", "no CUDA: probed on CPU at the toy size (CPU times, not the GPU's)")
        return
    rec.finish("ok")


# ------------------------------------------------------------------------------------------ the stage
def stage_trio(ctx: Context, rec: Recorder) -> None:
    """The trio, sized from the time it has (a probe of the ladder's sizes), or, with ``ctx.trio`` (run.sh
    --trio-kinds / --trio-size / --trio-tokens), a part of one: the kinds named, at the size and token count
    named, no probe; parts of several calls with equal ``match`` records make one matched trio when
    kit_merge.py joins their studies."""
    import torch
    import yaml

    from diffquant.data import token_stream
    from diffquant.io.artifacts import sha256_file

    settings = SETTINGS[ctx.mode]
    ladder = LADDER[ctx.mode]
    trio = ctx.work / "trio"
    trio.mkdir(parents=True, exist_ok=True)
    begin = time.time()
    stage_left = ctx.left()
    flops = cpu_flops()
    data = None if ctx.trio else probe_data(settings)
    stdlib_tokens = token_stream("stdlib:train").numel()
    facts = {name: size_facts(base, settings["seq_len"]) for name, base in ladder.items()}
    rec.set(
        stage_budget_s=round(stage_left, 1),
        cpu_gflops=round(flops / 1e9, 1),
        stdlib_train_tokens=stdlib_tokens,
        ladder={n: {"config": ladder[n], **facts[n]} for n in ladder},
    )

    def overheads(read_tokens: int) -> dict[str, float]:
        """Each size's fixed seconds per run; reading more than the stdlib means building the corpus once
        (a third of it charged to each run) and every run reading it."""
        build = max(0, read_tokens - stdlib_tokens) / 5e6 / len(KINDS)
        return {
            n: build + overhead_s(max(f["params"].values()), settings, flops, read_tokens)
            for n, f in facts.items()
        }

    def decide(per_model: float) -> dict[str, Any]:
        """The choice with the stdlib's reading costs, and again with the corpus's when it needs more text."""
        read = settings["stdlib_data_tokens"] or stdlib_tokens
        choice = choose_size(facts, measured, per_model, settings, overheads(read))
        if choice["tokens"] > stdlib_tokens:
            read = choice["tokens"]
            choice = choose_size(facts, measured, per_model, settings, overheads(read))
        return {**choice, "overhead_s": round(overheads(read)[choice["size"]], 1)}

    part = ctx.trio  # a trio in parts: these kinds only, at a size and token count the caller fixed
    kinds = tuple(part["kinds"]) if part else KINDS
    measured: dict[str, float] = {}
    probes: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    while not part:
        name = next(iter(ladder)) if not measured else choice["size"]
        # the first (largest) size: every kind, for the training-speed report (issue 46); later sizes: the trio
        result = probe(ladder[name], settings["batch_size"][name], settings, ctx.device, data, not measured)
        probes[name] = result
        # the slowest of the three trained kinds sets the pace (the rivals are probed, not trained here)
        measured[name] = min(result[kind]["tokens_per_s"] for kind in KINDS)
        per_model = (ctx.left() - settings["post_reserve_s"]) / len(KINDS)
        choice = decide(per_model)
        rec.set(probe=probes, choice=choice, probe_s=round(time.time() - begin, 1))
        if choice["measured"]:
            break
    size = part["size"] if part else choice["size"]
    batch = settings["batch_size"][size]
    steps = plan_steps(part["tokens"] if part else choice["tokens"], settings, size)
    tokens = steps * batch * settings["seq_len"]
    if part:
        per_model = (ctx.left() - settings["post_reserve_s"]) / len(kinds)
        why = f"a part of a trio: {', '.join(kinds)} at {size} on {tokens:,} tokens, as the call asked"
    elif choice["reaches_target"]:
        why = (
            f"{size} is the largest size predicted to train on {settings['target_tokens']:,} tokens in "
            f"{per_model:.0f} s per model"
        )
    else:
        why = (
            f"no size reaches {settings['target_tokens']:,} tokens in {per_model:.0f} s per model; the "
            f"smallest, {size}, trains on the {tokens:,} tokens that fit"
        )
    rec.set(
        size=size,
        batch=batch,
        steps=steps,
        tokens=tokens,
        why=why,
        seconds_per_model=round(per_model, 1),
        kinds=list(kinds),
    )
    del data
    if tokens <= stdlib_tokens:
        source, data_tokens, corpus = "stdlib:train", settings["stdlib_data_tokens"], None
    else:
        corpus = build_corpus(trio / "corpus.jsonl", tokens, corpus_roots())
        source, data_tokens = corpus["path"], corpus["tokens"]
        corpus["sha256"] = sha256_file(corpus["path"])
        rec.set(corpus={k: v for k, v in corpus.items() if k != "path"})
    configs = trio_configs(ladder[size], settings["seq_len"])
    lr = learning_rate(max(facts[size]["params"].values()))
    # what two calls' parts must share to make one matched trio (kit_merge.py compares it)
    rec.set(
        match={
            "mode": ctx.mode,
            "size": size,
            "config": ladder[size],
            "batch": batch,
            "steps": steps,
            "tokens": tokens,
            "lr": lr,
            "data": source if corpus is None else f"corpus sha256 {corpus['sha256']}",
            "data_tokens": data_tokens,
            "study": {k: settings[k] for k in STUDY_SETTINGS},
            "torch_compile": settings["torch_compile"],
        }
    )
    runs: dict[str, Any] = {}
    finals: dict[str, str] = {}
    for kind in kinds:
        if ctx.left() < settings["post_reserve_s"] * 0.5:
            runs[kind] = {"status": "not run", "reason": "the stage's time was spent"}
            rec.set(runs=runs)
            continue
        recipe = train_recipe(
            kind, batch, configs[kind], settings, steps, lr, source, data_tokens, ctx.device
        )
        out = trio / "train" / kind
        start = time.time()
        try:
            train_from_recipe(recipe, trio / "recipes" / f"{kind}.yaml", out)
        except Exception as err:  # noqa: BLE001 - recorded; the other kinds still train
            runs[kind] = {
                "status": "failed",
                "reason": f"{type(err).__name__}: {err}"[:400],
                "wall_s": round(time.time() - start, 1),
            }
            rec.set(runs=runs)
            continue
        finally:
            if ctx.cuda:
                torch.cuda.empty_cache()
        card = read_json(out / "final" / "card.json") or {}
        log_rows = (out / "log.csv").read_text().splitlines() if (out / "log.csv").is_file() else []
        runs[kind] = {
            "status": "ok",
            "wall_s": round(time.time() - start, 1),
            "parameters": card.get("parameters"),
            "tokens": card.get("tokens"),
            "val_bpb": card.get("val_bpb"),
            "train_bpb": card.get("train_bpb"),
            "retrieval": card.get("retrieval"),
            "log_rows": max(0, len(log_rows) - 1),
        }
        finals[kind] = str(out / "final")
        rec.set(runs=runs)
    if not finals:
        rec.finish("failed", "no model of the trio finished training")
        return
    run_dir = trio / "run"
    recipe_path = trio / "recipes" / "study.yaml"
    recipe_path.write_text(
        yaml.safe_dump(study_recipe(finals, settings, ctx.device, run_dir, plots=not part), sort_keys=False)
    )
    log = ctx.work / "logs" / "trio-run.log"
    res = run_timed(diffquant("run", str(recipe_path)), log, ctx.left() - 2)
    rec.set(
        study={
            **res,
            "table5": _table5(run_dir / "table5.json"),
            "bpb": _sweep(run_dir / "sweep"),
            "retrieval": _sweep(run_dir / "sweep", "acc_rank"),
            "report": (run_dir / "report.html").is_file(),
            "figures": len(list((run_dir / "figures").glob("*.png")))
            if (run_dir / "figures").is_dir()
            else 0,
        }
    )
    missing = [k for k in kinds if k not in finals]
    if res["timed_out"]:
        rec.finish("timeout", "the study (profile, sweep, figures, report) ran past the stage's time")
    elif res["rc"] != 0:
        rec.finish("failed", f"diffquant run: {last_error(log)}")
    elif missing:
        rec.finish(
            "failed",
            f"trained and studied without {', '.join(missing)}: "
            + "; ".join(runs[k].get("reason", "") for k in missing),
        )
    else:
        rec.finish("ok")
