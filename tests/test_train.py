"""Training: the schedule, logs, checkpoints, and resume to bit-identical weights."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.train import TrainConfig, lr_at, train
from diffquant.train.data import TrainData

RECIPES = Path(__file__).parents[1] / "recipes"


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
    out = train(_cfg(tmp_path, "c", kind="baseline", save_dtype="bfloat16"), log=lambda m: None)
    import json

    from diffquant.io.artifacts import sha256_file

    card = json.loads((out / "final" / "card.json").read_text())
    assert card["sha256"] == sha256_file(out / "final" / "model.safetensors")
    assert card["tokens"] == 6 * 3 * 160 and card["steps"] == 6
    assert 0 < card["val_bpb"] < 12 and 0 <= card["retrieval"]["acc_rank"] <= 1
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}


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
    assert (
        TrainConfig.load(RECIPES / "train-gpu.yaml").tokens
        > 10 * TrainConfig.load(RECIPES / "zoo-baseline.yaml").tokens
    )
