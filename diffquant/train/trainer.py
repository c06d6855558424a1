"""Training: AdamW with linear warmup and cosine decay, gradient clipping, periodic checkpoints, resume.

Written nanoGPT-style: one loop, no framework. Determinism is the point: batches are a function of
(seed, step), checkpoints hold the fp32 weights, the optimizer state and the step, so a run resumed from a
checkpoint reaches bit-identical weights on CPU. fp32 on CPU; bf16 autocast on CUDA.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffquant.errors import DiffquantError


@dataclass
class TrainConfig:
    """A training recipe (``recipes/zoo-*.yaml``): every field is a YAML key, all validated."""

    name: str
    kind: str = "baseline"
    preset: str = "small"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides applied to the preset
    data: str = "stdlib:train"
    data_tokens: int | None = 4_000_000
    needle_fraction: float = 0.2
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 500
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_data: str = "stdlib:validation"
    eval_tokens: int = 16384
    retrieval_samples: int = 4  # per depth (5 depths) in the final evaluation
    checkpoint_every: int = 100
    save_dtype: str = "bfloat16"  # dtype of the final exported weights
    threads: int | None = None
    device: str = "auto"
    out: str | None = None

    def __post_init__(self) -> None:
        from diffquant.models import ATTENTION_KINDS, PRESETS

        def need(ok: bool, key: str, expected: str) -> None:
            if not ok:
                raise DiffquantError(f"train recipe: '{key}' = {getattr(self, key)!r}, expected {expected}")

        need(self.kind in ATTENTION_KINDS, "kind", f"one of {', '.join(ATTENTION_KINDS)}")
        need(self.preset in PRESETS, "preset", f"one of {', '.join(PRESETS)}")
        for key in (
            "seq_len",
            "batch_size",
            "steps",
            "log_every",
            "eval_every",
            "eval_tokens",
            "checkpoint_every",
        ):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, key, "an integer >= 1")
        need(0 <= self.warmup <= self.steps, "warmup", f"an integer in [0, steps={self.steps}]")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, "min_lr", f"a number in [0, lr={self.lr}]")
        need(self.grad_clip > 0, "grad_clip", "a number > 0")
        need(self.save_dtype in ("bfloat16", "float32"), "save_dtype", "bfloat16 or float32")
        need(self.device in ("auto", "cpu", "cuda"), "device", "auto, cpu or cuda")

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
        from diffquant.recipes import read_yaml

        path = Path(path)
        raw = read_yaml(path, overrides)
        if not isinstance(raw, dict):
            raise DiffquantError(f"{path}: expected a mapping at the top level")
        allowed = [f.name for f in fields(cls)]
        for key in raw:
            if key not in allowed:
                raise DiffquantError(f"{path}: unknown key '{key}'; allowed keys: {', '.join(allowed)}")
        if "name" not in raw:
            raise DiffquantError(f"{path}: missing required key 'name'")
        try:
            return cls(**raw)
        except DiffquantError as err:
            raise DiffquantError(f"{path}: {str(err).removeprefix('train recipe: ')}") from None

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def model_config(self):
        from diffquant.models import ModelConfig, preset_config

        base = preset_config(self.preset, self.kind).to_dict()
        base.update(self.model)
        return ModelConfig.from_dict(base, source="train recipe 'model'")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, lambda vectors)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def _lambda_columns(model) -> dict[str, float]:
    """DIFF V1: lambda per layer; DIFF V2: lambda mean and spread (std) per layer and head, last batch."""
    out = {}
    for i, attn in enumerate(model.attention_modules()):
        if attn.kind == "diff_v1":
            out[f"lambda_L{i}"] = float(attn.lambda_value().detach())
        elif attn.kind == "diff_v2" and getattr(attn, "_last_lambda", None) is not None:
            lam = attn._last_lambda  # (B, T, H)
            for h in range(lam.shape[-1]):
                out[f"lambda_L{i}_H{h}_mean"] = float(lam[..., h].mean())
                out[f"lambda_L{i}_H{h}_std"] = float(lam[..., h].std())
    return out


def _watch_lambda(model) -> list:
    handles = []
    for attn in model.attention_modules():
        if attn.kind == "diff_v2":
            tap = getattr(attn, "lambda")

            def keep(module, args, out, attn=attn):
                attn._last_lambda = out.detach()

            handles.append(tap.register_forward_hook(keep))
    return handles


def _latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-*"))
    return found[-1] if found else None


def _save_state(path: Path, model, optimizer, step: int, cfg: TrainConfig) -> None:
    from diffquant.io import save_checkpoint

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    save_checkpoint(model, tmp / "model", overwrite=True)
    torch.save(
        {"optimizer": optimizer.state_dict(), "step": step, "config": asdict(cfg)}, tmp / "train_state.pt"
    )
    tmp.rename(path)


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise DiffquantError("device cuda requested but CUDA is not available")
    return torch.device(cfg.device)


def train(
    cfg: TrainConfig, *, resume: bool = False, stop_after: int | None = None, log=print, recipe_text: str = ""
) -> Path:
    """Train (or resume) into ``cfg.out``; returns the run folder. ``stop_after`` ends the run early
    (after that many steps in total) without changing the schedule, e.g. to split a run across jobs."""
    from diffquant.io import load_checkpoint
    from diffquant.models import DecoderLM
    from diffquant.train.data import TrainData

    out = Path(cfg.out or f"runs/train/{cfg.name}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg)
    start_step = 0
    latest = _latest_checkpoint(out) if resume else None
    if resume and latest is None:
        log(f"resume: no checkpoint in {out}/checkpoints, starting from step 0")
    if not resume and (out / "log.csv").exists():
        raise DiffquantError(
            f"{out}: holds a training run already; pass --resume to continue it or remove it"
        )
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if latest is not None:
        model = load_checkpoint(latest / "model").train().to(device)
        state = torch.load(latest / "train_state.pt", weights_only=False)
        optimizer = _optimizer(model, cfg)
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        log(f"resumed from {latest} at step {start_step}")
    else:
        model = DecoderLM(cfg.model_config()).to(device).train()
        optimizer = _optimizer(model, cfg)
    data = TrainData(
        cfg.data,
        seq_len=cfg.seq_len,
        max_tokens=cfg.data_tokens,
        needle_fraction=cfg.needle_fraction,
        seed=cfg.seed,
    )
    pad = data.tok.pad_id
    handles = _watch_lambda(model)
    log_path = out / "log.csv"
    rows: list[dict[str, Any]] = []
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tick = time.perf_counter()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _Null()
    for step in range(start_step, end):
        ids = data.batch(step, cfg.batch_size).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast:
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), ignore_index=pad
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        optimizer.step()
        done = step + 1
        evaluate = done % cfg.eval_every == 0 or done == cfg.steps
        if done % cfg.log_every == 0 or done == end or evaluate:
            now = time.perf_counter()
            steps_done = done - (rows[-1]["step"] if rows else start_step)
            row = {
                "step": done,
                "loss": float(loss.detach()),
                "bits_per_token": float(loss.detach()) / math.log(2),
                "lr": lr_at(step, cfg),
                "grad_norm": grad_norm,
                "tokens_per_second": steps_done * cfg.batch_size * cfg.seq_len / max(1e-9, now - tick),
                "val_bpb": "",
                **_lambda_columns(model),
            }
            tick = now
            if evaluate:
                row["val_bpb"] = _val_bpb(model, cfg)
                model.train()
            rows.append(row)
            _append_log(log_path, row)
            log(
                f"step {done}/{cfg.steps} loss {row['loss']:.4f} grad {grad_norm:.3f} lr {row['lr']:.2e} "
                f"{row['tokens_per_second']:.0f} tok/s"
                + (f" val bpb {row['val_bpb']:.4f}" if row["val_bpb"] != "" else "")
            )
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            _save_state(out / "checkpoints" / f"step-{done:07d}", model, optimizer, done, cfg)
    for h in handles:
        h.remove()
    if end < cfg.steps:
        _save_state(out / "checkpoints" / f"step-{end:07d}", model, optimizer, end, cfg)
        log(f"stopped after step {end}; resume with --resume")
        return out
    _finish(model, cfg, out, recipe_text, log)
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _append_log(path: Path, row: dict[str, Any]) -> None:
    new = not path.exists()
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(row), lineterminator="\n")
    if new:
        writer.writeheader()
    writer.writerow(row)
    with open(path, "a") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())


def _val_bpb(model, cfg: TrainConfig, data: str | None = None) -> float:
    from diffquant.eval.perplexity import evaluate_bpb

    model.eval()
    with torch.no_grad():
        return evaluate_bpb(model, data or cfg.eval_data, max_tokens=cfg.eval_tokens, seq_len=cfg.seq_len)[
            "bits_per_byte"
        ]


def _finish(model, cfg: TrainConfig, out: Path, recipe_text: str, log) -> None:
    """Export the final weights (in save_dtype) with a card of what they measure as exported."""
    from diffquant.eval.retrieval import RetrievalConfig, evaluate_retrieval
    from diffquant.io import load_checkpoint, save_checkpoint
    from diffquant.io.artifacts import sha256_file, write_json_atomic

    final = out / "final"
    export = copy.deepcopy(model).cpu().to(getattr(torch, cfg.save_dtype))
    save_checkpoint(export, final, overwrite=True)
    shipped = load_checkpoint(final, dtype=torch.float32)  # measure what ships, upcast as `zoo:` loads it
    val = _val_bpb(shipped, cfg)
    train_bpb = _val_bpb(shipped, cfg, data=cfg.data)
    with torch.no_grad():
        retrieval = evaluate_retrieval(
            shipped,
            RetrievalConfig(
                samples_per_depth=cfg.retrieval_samples, context_bytes=cfg.seq_len - 128, seed=12345
            ),
            attention=False,
        )
    card = {
        "name": cfg.name,
        "kind": cfg.kind,
        "parameters": shipped.num_parameters(),
        "config": shipped.config.to_dict(),
        "recipe": cfg.name,
        "recipe_text": recipe_text,
        "steps": cfg.steps,
        "tokens": cfg.tokens,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "train_bpb": train_bpb,
        "train_bpb_data": f"{cfg.data} (first {cfg.eval_tokens} tokens)",
        "val_bpb": val,
        "val_bpb_data": f"{cfg.eval_data} (first {cfg.eval_tokens} tokens)",
        "retrieval": {k: retrieval[k] for k in ("acc_rank", "acc_greedy", "chance_rank", "n")},
        "retrieval_setup": "4 needles, 1 query, depths 0/25/50/75/100 %, candidates = the 4 numbers in context, seed 12345",
        "save_dtype": cfg.save_dtype,
        "sha256": sha256_file(final / "model.safetensors"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    write_json_atomic(final / "card.json", card)
    log(
        json.dumps(
            {k: card[k] for k in ("name", "parameters", "tokens", "train_bpb", "val_bpb", "retrieval")}
        )
    )
