"""Training: the schedule, logs, checkpoints, and resume to bit-identical weights."""

import csv
import json
import pickle
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.train import TrainConfig, lr_at, train
from diffquant.train.data import TrainData

RECIPES = Path(__file__).parents[1] / "recipes"


def _log_rows(out: Path) -> list[dict[str, str]]:
    """The run's log.csv rows by column."""
    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def _cfg(tmp_path, name="t", **kw):
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("".join(f"def g{i}(a, b):\n    return a * {i} + b\n" for i in range(300)))
    base = dict(
        name=name,
        kind="diff_v2",
        preset="tiny",
        data=str(text),
        data_tokens=None,
        needle_fraction=0.3,
        seq_len=160,
        batch_size=3,
        steps=6,
        lr=3e-3,
        min_lr=3e-4,
        warmup=2,
        log_every=1,
        eval_every=3,
        eval_data=str(text),
        eval_tokens=256,
        retrieval_samples=1,
        checkpoint_every=3,
        threads=1,
        out=str(tmp_path / name),
    )
    base.update(kw)
    return TrainConfig(**base)


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig(name="s", steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_data_is_a_function_of_the_step(tmp_path):
    cfg = _cfg(tmp_path)
    a = TrainData(cfg.data, seq_len=160, max_tokens=None, needle_fraction=0.5, seed=1)
    b = TrainData(cfg.data, seq_len=160, max_tokens=None, needle_fraction=0.5, seed=1)
    assert torch.equal(a.batch(7, 4), b.batch(7, 4))
    assert not torch.equal(a.batch(7, 4), a.batch(8, 4))
    mixed = torch.cat([a.batch(s, 8) for s in range(10)])
    assert (mixed == 258).any(), "needle documents are padded with PAD"


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_resume_is_bit_identical(tmp_path, kind):
    straight = train(_cfg(tmp_path, "straight", kind=kind), log=lambda m: None)
    split_cfg = _cfg(tmp_path, "split", kind=kind)
    train(split_cfg, stop_after=4, log=lambda m: None)  # checkpoints at 3 and 4, then stops
    assert not (Path(split_cfg.out) / "final").exists()
    train(split_cfg, resume=True, log=lambda m: None)
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(Path(split_cfg.out) / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = (straight / "log.csv").read_text().splitlines()
    header = log[0].split(",")
    assert {"step", "loss", "grad_norm", "tokens_per_second", "lr", "val_bpb"} <= set(header)
    lam = [c for c in header if c.startswith("lambda_L")]
    assert lam and (all("_H" in c for c in lam) if kind == "diff_v2" else all("_H" not in c for c in lam))
    assert len(log) == 1 + 6


def test_card_measures_the_exported_weights(tmp_path):
    held_out = tmp_path / "held_out.txt"  # other text than the training data, so the two bpb differ
    held_out.write_text("".join(f"class C{i}:\n    x = {i} ** 2\n" for i in range(200)))
    kw = dict(kind="baseline", save_dtype="bfloat16", eval_data=str(held_out))
    out = train(_cfg(tmp_path, "c", **kw), log=lambda m: None)
    from diffquant.io.artifacts import sha256_file

    card = json.loads((out / "final" / "card.json").read_text())
    assert card["sha256"] == sha256_file(out / "final" / "model.safetensors")
    assert card["tokens"] == 6 * 3 * 160 and card["steps"] == 6
    assert 0 <= card["retrieval"]["acc_rank"] <= 1
    # the card's bits per byte are what the exported (bf16, upcast) weights measure on the recipe's data
    from diffquant.eval.perplexity import evaluate_bpb
    from diffquant.io import load_checkpoint

    shipped = load_checkpoint(out / "final", dtype=torch.float32)
    cfg = _cfg(tmp_path, "c", **kw)
    assert card["val_bpb"] != card["train_bpb"]
    for field_, data in (("val_bpb", cfg.eval_data), ("train_bpb", cfg.data)):
        got = evaluate_bpb(shipped, data, max_tokens=cfg.eval_tokens, seq_len=cfg.seq_len)["bits_per_byte"]
        assert card[field_] == pytest.approx(got, rel=1e-9), field_
    assert shipped.trained_seq_len == card["seq_len"] == cfg.seq_len
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}


def test_card_records_the_seed_and_the_overrides(tmp_path):
    """A zoo seed is trained from the shipped recipe with --set seed=N: its card says so (the recipe text
    alone would claim the file's seed)."""
    recipe, out = _recipe(tmp_path, "s", kind="baseline", steps=2, eval_every=2, checkpoint_every=2)
    assert main(["--quiet", "train", str(recipe), "--set", "seed=3", "--set", "lr=0.002"]) == 0
    card = json.loads((out / "final" / "card.json").read_text())
    assert card["seed"] == 3 and card["overrides"] == ["seed=3", "lr=0.002"]
    assert json.loads(card["recipe_text"])["seed"] == 0  # the file's, unchanged


def test_train_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: diff_v3\n")
    assert main(["train", str(bad)]) == 2
    assert "'kind' = 'diff_v3', expected one of baseline, diff_v1, diff_v2" in capsys.readouterr().err
    bad.write_text("name: x\nstepz: 4\n")
    assert main(["train", str(bad)]) == 2
    assert "unknown key 'stepz'" in capsys.readouterr().err
    cfg = _cfg(tmp_path, "twice", steps=2, eval_every=2, checkpoint_every=2)
    train(cfg, log=lambda m: None)
    with pytest.raises(DiffquantError, match="pass --resume"):
        train(cfg, log=lambda m: None)


def test_zoo_recipes_differ_only_in_kind():
    texts = {k: (RECIPES / f"zoo-{k}.yaml").read_text() for k in ("baseline", "diff_v1", "diff_v2")}
    norm = {k: t.replace(k, "KIND") for k, t in texts.items()}
    assert norm["baseline"] == norm["diff_v1"] == norm["diff_v2"]
    # the rivals' recipes (issue 30): the same keys and values but 'kind' (their comments say what they are)
    keys = {
        k: [line.replace(k, "KIND") for line in (RECIPES / f"zoo-{k}.yaml").read_text().splitlines()]
        for k in ("baseline", "gated", "sink", "clipped")
    }
    body = {k: [line for line in lines if not line.startswith("#")] for k, lines in keys.items()}
    assert body["baseline"] == body["gated"] == body["sink"] == body["clipped"]
    assert (
        TrainConfig.load(RECIPES / "train-gpu.yaml").tokens
        > 10 * TrainConfig.load(RECIPES / "zoo-baseline.yaml").tokens
    )


def _recipe(tmp_path, name, **kw) -> tuple[Path, Path]:
    """A recipe file (JSON is YAML) for the CLI, and the run folder it trains into."""
    cfg = _cfg(tmp_path, name, **kw)
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(asdict(cfg)))
    return path, Path(cfg.out)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


class _Planted:
    """Unpickling this opens (creates) ``marker``: a stand-in for any code a planted pickle could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_resume_refuses_a_planted_pickle(tmp_path, capsys, writer):
    recipe, out = _recipe(tmp_path, "planted")
    assert main(["train", str(recipe), "--stop-after", "3"]) == 0
    state = out / "checkpoints" / "step-0000003" / "train_state.pt"
    assert state.is_file()
    marker = tmp_path / "pwned"
    payload = {"optimizer": _Planted(marker), "step": 3}
    if writer == "torch.save":
        torch.save(payload, state)
    else:
        state.write_bytes(pickle.dumps(payload))
    capsys.readouterr()
    assert main(["train", str(recipe), "--resume"]) == 2
    assert not marker.exists(), "resume unpickled the planted file: its code ran"
    err = _one_line_error(capsys)
    assert f"{state}: refused" in err
    assert not (out / "final").exists()
    # The payload is live: an unrestricted load does run it (this is what resume must never do).
    with open(state, "rb") as f:
        torch.load(f, weights_only=False) if writer == "torch.save" else pickle.load(f)
    assert marker.exists()


def test_resume_ignores_a_save_killed_half_way(tmp_path, monkeypatch):
    kw = dict(steps=8, checkpoint_every=2, eval_every=4)
    straight = train(_cfg(tmp_path, "straight", **kw), log=lambda m: None)
    cfg = _cfg(tmp_path, "killed", **kw)
    out = Path(cfg.out)
    real_save, saves = torch.save, []

    def killed_on_third(obj, f, *a, **k):  # a kill while the third checkpoint (step 6) is being written
        saves.append(f)
        if len(saves) == 3:
            Path(f).write_bytes(b"PK\x03\x04 half a zip")
            raise KeyboardInterrupt
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, log=lambda m: None)
    monkeypatch.setattr(torch, "save", real_save)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000002", "step-0000004", "step-0000006.tmp"]
    with pytest.raises(DiffquantError, match="pass --resume"):
        train(cfg, log=lambda m: None)
    (out / ".final.k1ll3d").mkdir()  # and what a kill while writing final/ leaves
    messages = []
    train(cfg, resume=True, stop_after=5, log=messages.append)
    assert any("resumed from" in m and m.endswith("step-0000004 at step 4") for m in messages), messages
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000002", "step-0000004", "step-0000005"]
    assert not (out / ".final.k1ll3d").exists()
    train(cfg, resume=True, log=lambda m: None)
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-000000{s}" for s in (2, 4, 5, 6)]
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert steps == [str(s) for s in range(1, 9)], "rows after the checkpoint resumed from are logged once"
    assert (out / "final" / "card.json").is_file()


def test_stop_after_must_be_a_step_ahead(tmp_path, capsys):
    recipe, out = _recipe(tmp_path, "stop")
    for bad in ("0", "-1"):
        assert main(["train", str(recipe), "--stop-after", bad]) == 2
        assert f"stop_after (--stop-after) = {bad}, expected an integer >= 1" in _one_line_error(capsys)
    assert not out.exists(), "nothing is written for a refused run"
    cfg = _cfg(tmp_path, "stop")
    with pytest.raises(DiffquantError, match="expected an integer >= 1"):
        train(cfg, stop_after=0, log=lambda m: None)
    train(cfg, stop_after=3, log=lambda m: None)  # a checkpoint step: saved once, not twice
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000003"]
    with pytest.raises(DiffquantError, match="at step 3 already"):
        train(cfg, resume=True, stop_after=2, log=lambda m: None)


@pytest.mark.parametrize(("value", "expected"), [("64", "an integer in [128, 256]"), ("512", "[128, 256]")])
def test_seq_len_the_run_cannot_finish_with_fails_before_training(tmp_path, capsys, value, expected):
    recipe, out = _recipe(tmp_path, "short")
    assert main(["train", str(recipe), "--set", f"seq_len={value}"]) == 2
    err = _one_line_error(capsys)
    assert f"'seq_len' = {value}, expected" in err and expected in err
    assert not out.exists(), "a recipe that cannot finish fails before the first write"


def test_final_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import diffquant.eval.retrieval as retrieval

    cfg = _cfg(tmp_path, "whole")
    out = Path(cfg.out)

    def broken(*a, **k):
        raise RuntimeError("retrieval failed")

    monkeypatch.setattr(retrieval, "evaluate_retrieval", broken)
    with pytest.raises(RuntimeError, match="retrieval failed"):
        train(cfg, log=lambda m: None)
    assert not (out / "final").exists() and not list(out.glob(".final*"))
    monkeypatch.undo()
    train(cfg, resume=True, log=lambda m: None)
    assert sorted(p.name for p in (out / "final").iterdir()) == [
        "card.json",
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\nsteps: true\n", "'steps' = True, expected an integer >= 1"),
        ("name: x\nlr: '0.003'\n", "'lr' = '0.003', expected a number > 0"),
        ("name: x\nmodel: {tie_embeddings: 'no'}\n", "tie_embeddings"),
        ("name: x\nmodel: [1]\n", "'model' = [1], expected a mapping"),
        ("kind: baseline\n", "missing required key 'name'"),
        ("name: null\n", "'name' = None, expected a plain name"),
        ("name: ../../x\n", "'name' = '../../x', expected a plain name"),
        ("name: x\ndata_tokens: 1.5\n", "'data_tokens' = 1.5"),
        ("name: x\neval_tokens: 1\n", "'eval_tokens' = 1, expected an integer >= 2"),
    ],
)
def test_recipe_values_have_their_types(tmp_path, text, expected):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(DiffquantError, match=re.escape(expected)) as err:
        TrainConfig.load(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_second_train_into_a_folder_in_use_is_refused(tmp_path, capsys):
    """Every writer of a run folder takes the claims' lock: a train into a folder another process holds is
    refused in one line (pid named) and writes nothing; once free, the same command runs."""
    import fcntl
    import os

    from diffquant.io.runfolder import LOCK_FILE

    recipe, out = _recipe(tmp_path, "locked")
    out.mkdir(parents=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"4242\n", 0)
        assert main(["train", str(recipe), "--stop-after", "1"]) == 2
        assert "in use by another run (pid 4242)" in _one_line_error(capsys)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert main(["train", str(recipe), "--stop-after", "1"]) == 0


@pytest.mark.slow
def test_torch_compile_trains_the_eager_steps(tmp_path):
    """``torch_compile: true`` (issue 46, goal 5): the training forward runs through TorchDynamo (graphs are
    compiled: dynamo's own counter), and the run is the eager run's up to float rounding: the same losses and
    DIFF V2's lambda columns (its hooks still fire inside the compiled forward) at every step, the same final
    weights, saved under the module's own names (no ``_orig_mod.`` prefix of the compiled wrapper)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kw = dict(steps=3, eval_every=3, checkpoint_every=3, eval_tokens=192)
    eager = train(_cfg(tmp_path, "eager", **kw), log=lambda m: None)
    assert not counters["stats"]["unique_graphs"]
    compiled = train(_cfg(tmp_path, "compiled", torch_compile=True, **kw), log=lambda m: None)
    # one graph: no graph break, and no recompile after the first step (a cache the forward fills, such as
    # RoPE's inverse frequencies, would trip a guard and compile the forward again)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()

    a, b = _log_rows(eager), _log_rows(compiled)
    assert len(a) == len(b) == 3
    lam = [c for c in a[0] if c.startswith("lambda_L")]
    assert lam and set(lam) == {c for c in b[0] if c.startswith("lambda_L")}
    for x, y in zip(a, b, strict=True):
        for column in ("loss", "grad_norm", *lam):
            assert float(y[column]) == pytest.approx(float(x[column]), rel=1e-4, abs=1e-5), column
    wa = load_file(str(eager / "final" / "model.safetensors"))
    wb = load_file(str(compiled / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k].float(), wb[k].float(), rtol=1e-2, atol=1e-4) for k in wa)


def test_adamw_is_fused_on_cuda_and_the_per_tensor_loop_elsewhere():
    """The trainer's AdamW: one fused kernel for every parameter on CUDA (the per-tensor loop launches ~10
    kernels per tensor); on the CPU the per-tensor loop the zoo and the bit-identical resume were made with.
    Weight decay on matrices only."""
    from devicecheck import fake_cuda

    from diffquant.models import DecoderLM, preset_config
    from diffquant.train.trainer import adamw

    model = DecoderLM(preset_config("tiny", kind="diff_v1"))
    opt = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is False
    decay, other = opt.param_groups
    assert decay["weight_decay"] == 0.1 and other["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in other["params"])
    assert len(decay["params"]) + len(other["params"]) == len(list(model.parameters()))
    with fake_cuda():
        opt = adamw(model.to("cuda"), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


def test_precision_picks_the_forward_autocast(tmp_path):
    """``precision``: auto = bf16 autocast on CUDA only (the trainer's behaviour before the key), fp32 = none
    anywhere, bf16 = bf16 autocast on either device."""
    import contextlib
    import warnings

    from diffquant.train.trainer import forward_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(forward_precision("auto", cpu), contextlib.nullcontext)
    assert isinstance(forward_precision("fp32", cuda), contextlib.nullcontext)
    assert isinstance(forward_precision("fp32", cpu), contextlib.nullcontext)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "CUDA is not available" on a CPU build
        for precision, device in (("auto", cuda), ("bf16", cuda), ("bf16", cpu)):
            ctx = forward_precision(precision, device)
            assert isinstance(ctx, torch.autocast) and ctx.device == device.type
            assert ctx.fast_dtype == torch.bfloat16
    with pytest.raises(DiffquantError, match="'precision' = 'fp16', expected auto, fp32 or bf16"):
        _cfg(tmp_path, precision="fp16")


def test_precision_bf16_runs_the_forward_in_bf16_and_keeps_fp32_weights(tmp_path):
    """``precision: bf16`` on the CPU: every Linear of the training forward returns bf16 (the census counts
    only grad-mode calls: evaluation is fp32), the losses move off the fp32 run's by bf16 rounding but stay
    near it, and the checkpointed weights are fp32."""
    from collections import Counter

    counts: dict[str, Counter] = {}

    def run(name, precision):
        counts[name] = Counter()

        def hook(module, args, out):
            if torch.is_grad_enabled() and isinstance(module, torch.nn.Linear):
                counts[name][out.dtype] += 1

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            cfg = _cfg(tmp_path, name, precision=precision, steps=6)
            train(cfg, stop_after=2, log=lambda m: None)
        finally:
            handle.remove()
        return [float(row["loss"]) for row in _log_rows(tmp_path / name)]

    fp32, bf16 = run("fp32", "fp32"), run("bf16", "bf16")
    assert set(counts["fp32"]) == {torch.float32} and set(counts["bf16"]) == {torch.bfloat16}
    assert counts["bf16"][torch.bfloat16] == counts["fp32"][torch.float32] > 0
    assert all(1e-5 < abs(a - b) < 0.05 for a, b in zip(fp32, bf16, strict=True)), (fp32, bf16)
    weights = load_file(
        str(tmp_path / "bf16" / "checkpoints" / "step-0000002" / "model" / "model.safetensors")
    )
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_host_scalars_are_the_floats_of_each_tensor_in_order():
    """The log row's one transfer gives what ``float`` of each tensor gives (bf16, fp16, fp32 and fp64 values,
    widened exactly), Python numbers pass through, and the columns keep their order."""
    from diffquant.train.trainer import host_scalars

    g = torch.Generator().manual_seed(0)
    values = {
        "loss": torch.randn((), generator=g),
        "lr": 3e-4,
        "bf16": torch.randn(1, generator=g).bfloat16(),
        "fp16": torch.randn((), generator=g).half(),
        "fp64": torch.tensor(1 / 3, dtype=torch.float64),
        "tiny": torch.tensor(1e-40),  # an fp32 subnormal
    }
    read = host_scalars(values)
    assert list(read) == list(values)
    for name, value in values.items():
        expected = float(value)
        assert read[name] == expected and type(read[name]) is float, name
