"""Training: AdamW with linear warmup and cosine decay, gradient clipping, periodic checkpoints, resume.

Written nanoGPT-style: one loop, no framework. Determinism is the point: batches are a function of
(seed, step), checkpoints hold the fp32 weights, the optimizer state and the step, so a run resumed from a
checkpoint reaches bit-identical weights on CPU. fp32 on CPU; bf16 autocast on CUDA (``precision``).

Speed: each log row has ``tokens_per_second`` (training steps only: the evaluation and checkpoint time in the
interval is left out) and ``mfu``, model FLOPs utilisation (:mod:`diffquant.train.flops`: the model's
training FLOPs per second over the device's dense bf16 peak; empty where the peak is unknown, as on a CPU).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
import os
import pickle
import re
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from diffquant.data import ByteTokenizer, token_stream
from diffquant.errors import DiffquantError
from diffquant.eval import retrieval as retrieval_mod  # tests patch the module attribute
from diffquant.eval.perplexity import evaluate_stream
from diffquant.eval.retrieval import RetrievalConfig, _check_samples, make_samples
from diffquant.io import load_checkpoint, read_config, save_checkpoint
from diffquant.io.artifacts import sha256_file, write_json_atomic, write_text_atomic
from diffquant.models import ATTENTION_KINDS, PRESETS, DecoderLM, ModelConfig, preset_config
from diffquant.models.config import VARIANT_FIELDS
from diffquant.names import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE
from diffquant.progress import outside_bars, progress
from diffquant.schema import AssignStyle, check, key, plain_name
from diffquant.shipped import resolve as resolve_shipped
from diffquant.textfiles import read_yaml
from diffquant.train.data import TrainData
from diffquant.train.flops import peak_flops, row_flops_per_token, utilisation

PRECISIONS = ("auto", "fp32", "bf16")
RETRIEVAL_RESERVE = 128  # tokens of seq_len the final retrieval evaluation keeps for question and answer
_clock = time.perf_counter  # the clock tokens_per_second is measured with (tests put a fake one here)


@dataclass
class TrainConfig:
    """A training recipe (``recipes/zoo-*.yaml``): every field is a YAML key, all validated."""

    name: str = key(check=lambda v: _run_name(v))
    kind: str = key("baseline", check=lambda v: _one_of(v, ATTENTION_KINDS))
    preset: str = key("small", check=lambda v: _one_of(v, PRESETS))
    # ModelConfig overrides applied to the preset
    model: dict[str, Any] = key({}, what="a mapping of model config keys (or {})")
    data: str = key("stdlib:train", check=lambda v: _data_source(v))
    data_tokens: int | None = key(4_000_000, min=1, what="an integer >= 1 or null (all of the data)")
    needle_fraction: float = key(0.2, min=0, max=1)
    seq_len: int = key(256, min=1)
    batch_size: int = key(16, min=1)
    steps: int = key(500, min=1)
    lr: float = key(3e-3, check=lambda v: _positive_number(v))
    min_lr: float = key(3e-4)  # in [0, lr]: validate()
    warmup: int = key(50)  # in [0, steps]: validate()
    weight_decay: float = key(0.1, check=lambda v: None if _is_number(v) and v >= 0 else "a number >= 0")
    beta1: float = key(0.9, check=lambda v: _fraction(v))
    beta2: float = key(0.95, check=lambda v: _fraction(v))
    grad_clip: float = key(1.0, check=lambda v: _positive_number(v))
    seed: int = key(0, min=0)
    log_every: int = key(10, min=1)
    eval_every: int = key(100, min=1)
    eval_data: str = key("stdlib:validation", check=lambda v: _data_source(v))
    eval_tokens: int = key(16384, min=2)
    retrieval_samples: int = key(4, min=1)  # per depth (5 depths) in the final evaluation
    checkpoint_every: int = key(100, min=1)
    # dtype of the final exported weights
    save_dtype: str = key(
        "bfloat16", check=lambda v: _one_of(v, ("bfloat16", "float32"), "bfloat16 or float32")
    )
    threads: int | None = key(None, min=1, what="an integer >= 1 or null")
    device: str = key("auto", check=lambda v: _one_of(v, ("auto", "cpu", "cuda"), "auto, cpu or cuda"))
    # torch.compile the training forward (and through AOTAutograd its backward); evaluation stays eager
    torch_compile: bool = key(False)
    # the training forward's precision: auto = bf16 autocast on CUDA, fp32 on the CPU; fp32 = no autocast
    # anywhere; bf16 = bf16 autocast on either device (weights, optimizer and loss stay fp32 in all three)
    precision: str = key("auto", check=lambda v: _one_of(v, PRECISIONS, "auto, fp32 or bf16"))
    out: str | None = key(None, check=lambda v: _folder(v))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range, and what the end of the run will need of them (the final
        evaluation's context, the model's max_seq_len), so that a bad recipe fails before the first step.
        Called on construction and again by :func:`train` (fields may be set after construction)."""

        def need(ok: bool, key: str, expected: str) -> None:
            if not ok:
                raise DiffquantError(f"train recipe: '{key}' = {getattr(self, key)!r}, expected {expected}")

        # types and ranges: the schema checker (diffquant.schema); then how the fields agree
        check(TrainConfig, {f.name: getattr(self, f.name) for f in fields(self)}, "train recipe", style=_KEYS)
        need(0 <= self.warmup <= self.steps, "warmup", f"an integer in [0, steps={self.steps}]")
        need(
            _is_number(self.min_lr) and 0 <= self.min_lr <= self.lr,
            "min_lr",
            f"a number in [0, lr={self.lr}]",
        )
        model = self.model_config()
        need(
            model.vocab_size == ByteTokenizer.vocab_size,
            "model",
            f"vocab_size {ByteTokenizer.vocab_size} (training reads bytes), got vocab_size {model.vocab_size}",
        )
        # Training feeds seq_len - 1 tokens and evaluation windows of seq_len; the final retrieval evaluation
        # puts seq_len - RETRIEVAL_RESERVE bytes of context before its question and answer.
        need(
            RETRIEVAL_RESERVE <= self.seq_len <= model.max_seq_len,
            "seq_len",
            f"an integer in [{RETRIEVAL_RESERVE}, {model.max_seq_len}] (at least the {RETRIEVAL_RESERVE} tokens "
            f"of the final retrieval evaluation's question and answer, at most the model's max_seq_len)",
        )

    @property
    def out_folder(self) -> Path:
        """The run folder: ``out``, else runs/train/NAME (what train() writes and the CLI locks)."""
        return Path(self.out or f"runs/train/{self.name}")

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
        """A training recipe file, or a shipped one by name (``zoo-diff_v2``; :func:`diffquant.shipped.resolve`)."""
        path = resolve_shipped(path, "train")
        raw = read_yaml(path, overrides)
        if not isinstance(raw, dict):
            raise DiffquantError(f"{path}: expected a mapping at the top level")
        check(cls, raw, str(path), style=_KEYS)  # unknown keys, a missing name, types and ranges
        try:
            return cls(**raw)
        except DiffquantError as err:
            raise DiffquantError(f"{path}: {str(err).removeprefix('train recipe: ')}") from None

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def model_config(self):
        """The preset's ``kind`` model, matched in the variant ``model`` names (``gate: headwise`` re-matches
        the FFN width to the head-wise gate), then ``model``'s other keys as overrides."""
        variant = {f: v for f, v in self.model.items() if VARIANT_FIELDS.get(f, ("",))[0] == self.kind}
        try:
            base = preset_config(self.preset, self.kind, **variant).to_dict()
        except DiffquantError as err:
            raise DiffquantError(f"train recipe 'model': {str(err).removeprefix('model config: ')}") from None
        base.update(self.model)
        return ModelConfig.from_dict(base, source="train recipe 'model'")


def _run_name(value: Any) -> str | None:
    """The run folder's name (runs/train/NAME): a plain name, the rule every recipe name follows."""
    return plain_name(value)


def _one_of(value: Any, names: tuple[str, ...], words: str | None = None) -> str | None:
    return None if isinstance(value, str) and value in names else words or f"one of {', '.join(names)}"


def _data_source(value: Any) -> str | None:
    return None if isinstance(value, str) and value != "" else "a data source"


def _folder(value: Any) -> str | None:
    return None if value is None or (isinstance(value, str) and value != "") else "a folder path or null"


def _positive_number(value: Any) -> str | None:
    return None if _is_number(value) and value > 0 else "a number > 0"


def _fraction(value: Any) -> str | None:
    return None if _is_number(value) and 0 <= value < 1 else "a number in [0, 1)"


_KEYS = AssignStyle()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return adamw(model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def adamw(
    model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only (not norms, lambda vectors); the trainer's and the GPU kit's probe's.

    On CUDA the fused implementation: one kernel updates every parameter, where the per-tensor loop launches
    about ten kernels per tensor (the kit's 52M configs hold 111-171 tensors: over a thousand launches of a few
    microseconds each per step). Elsewhere the per-tensor loop, the one the zoo's weights and the CPU runs'
    bit-identical resume were made with (torch's fused CPU AdamW differs in the last bits: 6e-8 after five
    steps on N(0, 1) weights)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    implementation = {"fused": True} if on_cuda else {"foreach": False}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **implementation)


def forward_precision(precision: str, device: torch.device):
    """The context the training forward runs in: bf16 autocast (``bf16``, or ``auto`` on CUDA), else none.
    Only the forward: the loss is taken on fp32 logits, and backward, clipping and AdamW run outside it."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def training_forward(model: torch.nn.Module, compile_model: bool):
    """What the training step calls: the model, or ``torch.compile(model)`` (TorchDynamo + Inductor: the
    step's small operations fused into few kernels, the same mathematics; the first step pays the compile).
    The module itself stays the one evaluated, hooked and saved: the compiled wrapper shares its parameters
    and its state dict keys would carry an ``_orig_mod.`` prefix."""
    return torch.compile(model) if compile_model else model


def batch_to(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch built on the host, on ``device``. To CUDA from pinned memory without blocking: a copy from
    pageable memory makes the host wait for every kernel queued before it, so the GPU would idle while the
    host builds the next batch (the pinned buffer is held until the copy is done: torch's host allocator)."""
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def train_step(model, forward, optimizer, autocast, ids: torch.Tensor, pad: int, grad_clip: float):
    """One optimizer step on ``ids`` (B, T + 1): the loss on fp32 logits of the next tokens (``pad`` ignored),
    backward, gradients clipped to ``grad_clip``, the optimizer's step. Returns (loss, grad_norm) as tensors
    on the device, the norm before clipping: reading one (``float``) makes the host wait for the step, so
    the loop reads them only when it logs. ``forward`` is the model or its compiled wrapper."""
    with autocast:
        logits = forward(ids[:, :-1])
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), ignore_index=pad
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach(), grad_norm


def host_scalars(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Each one-element tensor of ``values`` as a Python float, read in one transfer per device (each
    ``float(tensor)`` of a CUDA tensor is a wait for the device: a DIFF V2 log row has 2 per layer and head).
    The values are those ``float`` gives: each tensor is widened to float64 exactly before the transfer."""
    out = {name: value for name, value in values.items() if not isinstance(value, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        read = torch.stack([values[n].detach().reshape(()).double() for n in names]).tolist()
        out.update(zip(names, read, strict=True))
    return {name: out[name] for name in values}


def _lambda_columns(model) -> dict[str, torch.Tensor]:
    """DIFF V1: lambda per layer; DIFF V2: lambda mean and spread (std) per layer and head, last batch; the
    rivals' learned numbers: sink logits per layer and head, gate mean and spread per layer (last batch).
    One-element tensors where the model holds them (:func:`host_scalars` reads them together)."""
    out = {}
    for i, attn in enumerate(model.attention_modules()):
        if attn.kind == "diff_v1":
            out[f"lambda_L{i}"] = attn.lambda_value().detach()
        elif attn.kind == "diff_v2" and getattr(attn, "_last_lambda", None) is not None:
            lam = attn._last_lambda  # (B, T, H)
            for h in range(lam.shape[-1]):
                out[f"lambda_L{i}_H{h}_mean"] = lam[..., h].mean()
                out[f"lambda_L{i}_H{h}_std"] = lam[..., h].std()
        elif attn.kind == "sink" and attn.sinks is not None:
            for h, value in enumerate(attn.sinks.detach()):
                out[f"sink_L{i}_H{h}"] = value
        elif attn.kind == "gated" and getattr(attn, "_last_gate", None) is not None:
            out[f"gate_L{i}_mean"] = attn._last_gate.mean()
            out[f"gate_L{i}_std"] = attn._last_gate.std()
    return out


def _watch_lambda(model) -> list:
    """Hooks keeping the last batch's DIFF V2 lambda and gated attention's gates (for the log columns)."""
    handles = []
    for attn in model.attention_modules():
        if attn.kind in ("diff_v2", "gated"):
            tap, attr = (
                (getattr(attn, "lambda"), "_last_lambda")
                if attn.kind == "diff_v2"
                else (attn.gate, "_last_gate")
            )

            def keep(module, args, out, attn=attn, attr=attr):
                setattr(attn, attr, out.detach())

            handles.append(tap.register_forward_hook(keep))
    return handles


_CHECKPOINT = re.compile(r"step-(\d{7,})")
_CHECKPOINT_FILES = ("train_state.pt", f"model/{CONFIG_FILE}", f"model/{WEIGHTS_FILE}")


def _latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint of the highest step. A checkpoint is written into ``step-N.tmp`` and renamed
    to ``step-N`` once all its files are there, so a ``.tmp`` folder (a save that was killed) or a folder
    missing one of the files does not count."""
    folder = out / "checkpoints"
    found = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _CHECKPOINT.fullmatch(path.name)
            if match and path.is_dir() and all((path / f).is_file() for f in _CHECKPOINT_FILES):
                found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def _stale_temporaries(out: Path) -> list[Path]:
    """What a killed run leaves behind: checkpoint saves (``step-N.tmp``) and the temporary folders and
    files of atomic writes (``.final.*``, ``.log.csv.*``)."""
    stale = [*out.glob(".final.*"), *out.glob(".log.csv.*"), *out.glob("checkpoints/step-*.tmp")]
    return sorted(stale)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _save_state(path: Path, model, optimizer, step: int, cfg: TrainConfig) -> None:
    """A checkpoint folder, written whole into ``step-N.tmp`` and then renamed, so that a save that is
    killed leaves only a ``.tmp`` folder, which resume ignores and removes."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_checkpoint(model, tmp / "model", overwrite=True)
    # Tensors and plain data only: resume reads it with torch.load(weights_only=True).
    torch.save(
        {"optimizer": optimizer.state_dict(), "step": step, "config": asdict(cfg)}, tmp / "train_state.pt"
    )
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def _load_state(latest: Path, cfg: TrainConfig, device: torch.device):
    """(model, optimizer, step) of a checkpoint folder. ``train_state.pt`` is unpickled with
    ``weights_only=True``: tensors and plain data only, so a planted pickle cannot run code."""
    where = latest / "train_state.pt"
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error below says it all
            warnings.simplefilter("ignore")
            state = torch.load(where, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line.strip() for line in str(err).splitlines()]
        refused = [line for line in lines if line.startswith("WeightsUnpickler error:")]
        detail = (
            refused[0].removeprefix("WeightsUnpickler error:").split(" was not ")[0].strip()
            if refused
            else ""
        )
        raise DiffquantError(
            f"{where}: refused, it holds more than tensors and plain data (unpickling it could run code"
            + (f"; {detail[:120]})" if detail else ")")
        ) from None
    except Exception as err:  # a truncated zip, a file that is no pickle at all, ...
        first = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:120]
        raise DiffquantError(
            f"{where}: not a readable training state ({type(err).__name__}: {first}); remove {latest} to "
            "resume from an earlier checkpoint"
        ) from None
    step = state.get("step") if isinstance(state, dict) else None
    expected_step = int(_CHECKPOINT.fullmatch(latest.name).group(1))
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict) or step != expected_step:
        raise DiffquantError(
            f"{where}: expected a mapping with 'optimizer' and 'step' = {expected_step}, got "
            + (
                f"keys {sorted(map(str, state))}, step {step!r}"
                if isinstance(state, dict)
                else type(state).__name__
            )
        )
    if not step < cfg.steps:
        raise DiffquantError(f"{where}: step {step}, expected a step < the recipe's steps = {cfg.steps}")
    saved = read_config(latest / "model").to_dict()
    if saved != cfg.model_config().to_dict():
        raise DiffquantError(
            f"{latest / 'model'}: its model config differs from the recipe's (kind, preset and model must "
            "not change across a resume)"
        )
    model = load_checkpoint(latest / "model").train().to(device)
    optimizer = _optimizer(model, cfg)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise DiffquantError(f"{where}: optimizer state does not fit the model ({err})") from None
    return model, optimizer, step


def _kept_log(path: Path, step: int) -> str | None:
    """log.csv cut back to the rows of steps <= ``step`` (the rows a resume from ``step`` would otherwise
    log twice; a row half-written by a kill goes too): the text to write, "" to remove the file, None to
    leave it as it is."""
    if not path.exists():
        return None
    try:
        rows = list(csv.reader(io.StringIO(path.read_text())))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DiffquantError(f"{path}: not a readable training log ({err})") from None
    if not rows:
        return ""
    header, body = rows[0], rows[1:]
    if "step" not in header:
        raise DiffquantError(f"{path}: not a training log (no 'step' column in its header)")
    col = header.index("step")
    keep = [r for r in body if len(r) == len(header) and r[col].isdigit() and int(r[col]) <= step]
    if len(keep) == len(body):
        return None
    if not keep:
        return ""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *keep])
    return buf.getvalue()


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise DiffquantError("device cuda requested but CUDA is not available")
    return torch.device(cfg.device)


def _retrieval_config(cfg: TrainConfig):
    return RetrievalConfig(
        samples_per_depth=cfg.retrieval_samples, context_bytes=cfg.seq_len - RETRIEVAL_RESERVE, seed=12345
    )


def _eval_streams(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The token streams of the evaluations (validation during and after the run, train bpb at the end),
    read once, before the first step, so a bad source fails before any work is done."""
    streams = {}
    for name, source in (("eval_data", cfg.eval_data), ("data", cfg.data)):
        stream = token_stream(source, cfg.eval_tokens)
        if stream.numel() < 2:
            raise DiffquantError(
                f"train recipe: '{name}' = {source!r} has {stream.numel()} token(s); evaluation needs at least 2"
            )
        streams[name] = stream
    return streams


def _check_retrieval(cfg: TrainConfig) -> None:
    """The final retrieval evaluation's prompts must fit the model: checked on the prompts themselves."""
    _check_samples(
        SimpleNamespace(config=cfg.model_config()), make_samples(_retrieval_config(cfg)), ByteTokenizer()
    )


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    log=print,
    recipe_text: str = "",
    overrides: Sequence[str] = (),
) -> Path:
    """Train (or resume) into ``cfg.out``; returns the run folder. ``stop_after`` ends the run early
    (after that many steps in total) without changing the schedule, e.g. to split a run across jobs.

    Everything that can be checked (the recipe, the data, the checkpoint to resume from, what the final
    evaluation needs) is checked before the first write; ``final/`` appears whole (weights and card) or
    not at all."""
    cfg.validate()  # again: fields may have been set after construction (the CLI sets out)
    if stop_after is not None and not (_is_int(stop_after) and stop_after >= 1):
        raise DiffquantError(f"stop_after (--stop-after) = {stop_after!r}, expected an integer >= 1")
    out = cfg.out_folder
    if out.exists() and not out.is_dir():
        raise DiffquantError(f"{out}: exists and is not a folder; expected a run folder")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg)
    latest = _latest_checkpoint(out) if resume else None
    if not resume and (
        (out / "log.csv").exists() or _latest_checkpoint(out) is not None or (out / "final").exists()
    ):
        raise DiffquantError(
            f"{out}: holds a training run already; pass --resume to continue it or remove it"
        )
    start_step = 0
    if latest is not None:
        model, optimizer, start_step = _load_state(latest, cfg, device)
    if stop_after is not None and stop_after <= start_step:
        raise DiffquantError(
            f"stop_after (--stop-after) = {stop_after}: the run in {out} is at step {start_step} already; "
            f"expected a step > {start_step}"
        )
    data = TrainData(
        cfg.data,
        seq_len=cfg.seq_len,
        max_tokens=cfg.data_tokens,
        needle_fraction=cfg.needle_fraction,
        seed=cfg.seed,
    )
    streams = _eval_streams(cfg)
    _check_retrieval(cfg)
    log_path = out / "log.csv"
    kept_log = _kept_log(log_path, start_step) if resume else None

    # The first write.
    out.mkdir(parents=True, exist_ok=True)
    for path in _stale_temporaries(out):
        log(f"removing {path}, left by an interrupted run")
        _remove(path)
    if kept_log == "":
        log_path.unlink()
    elif kept_log is not None:
        write_text_atomic(log_path, kept_log)
    if resume and latest is None:
        log(f"resume: no checkpoint in {out}/checkpoints, starting from step 0")
    if latest is not None:
        log(f"resumed from {latest} at step {start_step}")
    else:
        torch.manual_seed(cfg.seed)
        model = DecoderLM(cfg.model_config()).to(device).train()
        optimizer = _optimizer(model, cfg)
    pad = data.tok.pad_id
    handles = _watch_lambda(model)
    rows: list[dict[str, Any]] = []
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    saved = start_step
    peak = peak_flops(device)
    flops_per_token = row_flops_per_token(model, cfg.seq_len)  # MFU: per token as tokens_per_second counts
    tick = _clock()
    paused = 0.0  # seconds since ``tick`` spent evaluating, logging and checkpointing, not training
    autocast = forward_precision(cfg.precision, device)
    forward = training_forward(model, cfg.torch_compile)
    # A start line and one at least every 10 s off a terminal (a large model's log_every steps can take
    # minutes); on a terminal a bar, the log lines printed above it.
    steps = progress(range(start_step, end), desc="train", unit="step", announce=True)
    for step in steps:
        ids = batch_to(data.batch(step, cfg.batch_size), device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, grad_norm = train_step(model, forward, optimizer, autocast, ids, pad, cfg.grad_clip)
        done = step + 1
        evaluate = done % cfg.eval_every == 0 or done == cfg.steps
        if done % cfg.log_every == 0 or done == end or evaluate:
            # the one wait for the device between logs: the clock is read after it, so the steps counted
            # are the steps the device has finished
            read = host_scalars({"loss": loss, "grad_norm": grad_norm, **_lambda_columns(model)})
            now = _clock()
            steps_done = done - (rows[-1]["step"] if rows else start_step)
            tokens_per_second = steps_done * cfg.batch_size * cfg.seq_len / max(1e-9, now - tick - paused)
            mfu = utilisation(flops_per_token, tokens_per_second, peak)
            loss_value = read.pop("loss")
            row = {
                "step": done,
                "loss": loss_value,
                "bits_per_token": loss_value / math.log(2),
                "lr": lr_at(step, cfg),
                "grad_norm": read.pop("grad_norm"),
                "tokens_per_second": tokens_per_second,
                "val_bpb": "",
                **read,
                "mfu": "" if mfu is None else mfu,  # last: a log from before the column still lines up
            }
            tick, paused = now, 0.0
            if evaluate:
                row["val_bpb"] = _val_bpb(model, cfg, streams["eval_data"])
                model.train()
            rows.append(row)
            _append_log(log_path, row)
            with outside_bars(sys.stdout):
                log(
                    f"step {done}/{cfg.steps} loss {row['loss']:.4f} grad {row['grad_norm']:.3f} lr {row['lr']:.2e} "
                    f"{row['tokens_per_second']:.0f} tok/s"
                    + (f" mfu {mfu:.1%}" if mfu is not None else "")
                    + (f" val bpb {row['val_bpb']:.4f}" if row["val_bpb"] != "" else "")
                )
            paused += _clock() - now
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            if device.type == "cuda":
                # the queued steps finish first: saving waits for them, and they are training, not pause
                torch.cuda.synchronize(device)
            begin = _clock()
            _save_state(out / "checkpoints" / f"step-{done:07d}", model, optimizer, done, cfg)
            saved = done
            paused += _clock() - begin
    for h in handles:
        h.remove()
    if end < cfg.steps:
        if saved != end:
            _save_state(out / "checkpoints" / f"step-{end:07d}", model, optimizer, end, cfg)
        log(f"stopped after step {end}; resume with --resume")
        return out
    _finish(model, cfg, out, recipe_text, log, streams, overrides)
    return out


def _append_log(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the log, under the header the file already has: a run resumed from a log written
    before a column existed (``mfu``) keeps that log's columns, so every line has its header's length
    (which :func:`_kept_log` relies on); a new log gets the row's columns."""
    new = not path.exists()
    fieldnames = list(row)
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        fieldnames = header or fieldnames
        new = header is None
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=fieldnames, lineterminator="\n", extrasaction="ignore", restval=""
    )
    if new:
        writer.writeheader()
    writer.writerow(row)
    with open(path, "a") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())


def _val_bpb(model, cfg: TrainConfig, stream: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return evaluate_stream(model, stream, seq_len=cfg.seq_len)["bits_per_byte"]


def _finish(
    model,
    cfg: TrainConfig,
    out: Path,
    recipe_text: str,
    log,
    streams: dict[str, torch.Tensor],
    overrides: Sequence[str] = (),
) -> None:
    """Export the final weights (in save_dtype) with a card of what they measure as exported: all of
    ``final/`` is written into a temporary folder and renamed, so a failure never leaves a ``final/``."""
    card: dict[str, Any] = {}

    def measure(folder: Path) -> None:
        shipped = load_checkpoint(
            folder, dtype=torch.float32
        )  # measure what ships, upcast as `zoo:` loads it
        val = _val_bpb(shipped, cfg, streams["eval_data"])
        train_bpb = _val_bpb(shipped, cfg, streams["data"])
        with torch.no_grad():
            retrieval = retrieval_mod.evaluate_retrieval(shipped, _retrieval_config(cfg), attention=False)
        card.update(
            {
                "name": cfg.name,
                "kind": cfg.kind,
                "parameters": shipped.num_parameters(),
                "config": shipped.config.to_dict(),
                "recipe": cfg.name,
                "recipe_text": recipe_text,
                # what the run changed in that text (train --set), and the seed it trained with
                "overrides": list(overrides),
                "seed": cfg.seed,
                "steps": cfg.steps,
                "tokens": cfg.tokens,
                "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len,
                "train_bpb": train_bpb,
                "train_bpb_data": f"{cfg.data} (first {cfg.eval_tokens} tokens)",
                "val_bpb": val,
                "val_bpb_data": f"{cfg.eval_data} (first {cfg.eval_tokens} tokens)",
                "retrieval": {k: retrieval[k] for k in ("acc_rank", "acc_greedy", "chance_rank", "n")},
                "retrieval_setup": "4 needles, 1 query, depths 0/25/50/75/100 %, candidates = the 4 numbers in "
                "context, seed 12345",
                "save_dtype": cfg.save_dtype,
                "sha256": sha256_file(folder / WEIGHTS_FILE),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
        write_json_atomic(folder / CARD_FILE, card)

    export = copy.deepcopy(model).cpu().to(getattr(torch, cfg.save_dtype))
    save_checkpoint(export, out / "final", overwrite=True, extra=measure)
    log(
        json.dumps(
            {k: card[k] for k in ("name", "parameters", "tokens", "train_bpb", "val_bpb", "retrieval")}
        )
    )
