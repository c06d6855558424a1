"""Training speed accounting (issue 46): model FLOPs per token, the device peak, and the trainer's ``mfu``.

The FLOPs formula (diffquant.train.flops) is checked against torch's own counter,
:class:`torch.utils.flop_counter.FlopCounterMode`, counting a real forward and backward of each attention
kind, and its causal key count against the causal / windowed mask enumerated entry by entry. No timing is
measured here: the trainer's clock is replaced by one the test advances.
"""

from __future__ import annotations

import csv
import io

import pytest
import torch
from conftest import ALL_KINDS, tiny_model
from torch.utils.flop_counter import FlopCounterMode

from diffquant.io import load_model
from diffquant.train import TrainConfig, train
from diffquant.train import trainer as trainer_mod
from diffquant.train.data import TrainData
from diffquant.train.flops import (
    keys_per_query,
    matmul_parameters,
    peak_flops,
    peak_flops_of,
    training_flops_per_token,
)

B, T = 2, 40


def _counted(model, recompute: bool = False) -> int:
    """FLOPs torch's counter sees in one forward + backward of a (B, T) batch on the explicit path (whose
    matmuls the counter sees on CPU; it has no formula for the CPU flash kernel of the fused path)."""
    model.train().set_attention_path("explicit")
    for attn in model.attention_modules():
        attn.recompute_maps = recompute
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).float().square().mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", [*ALL_KINDS, "gated-headwise", "diff_v2-mha", "baseline-tied"])
def test_formula_equals_torchs_flop_counter(kind):
    """6 N_mm + 3 A per token (full T x T square: the explicit path computes the masked entries too, and the
    counter counts what runs) equals the counter's matmul FLOPs exactly: DIFF's two query components and
    V1's 2d-wide values, the gate / lambda projections, GQA, a tied head all included. The counter, like the
    formula, leaves out softmax, norms, RoPE and other elementwise work."""
    name = kind.removesuffix("-mha").removesuffix("-tied")
    extra = {"n_kv_heads": 4} if kind.endswith("-mha") else {"tie_embeddings": True} if "tied" in kind else {}
    model = tiny_model(name, **extra)
    assert training_flops_per_token(model, T, causal=False) * B * T == _counted(model)


@pytest.mark.parametrize("kind", ["clipped", "diff_v1"])
def test_recomputed_maps_add_only_their_logits_matmul(kind):
    """With recomputation the counter sees one more QK^T per chunk (rematerialisation: hardware FLOPs, not
    model FLOPs, so the formula leaves it out): backward replays a chunk up to the last tensor it saved, the
    map PV reads, so the PV product itself is not run again."""
    model = tiny_model(kind)
    c = model.config
    qk = c.n_layers * T * (2 * c.head_dim * c.n_q_heads) * B * T  # full-square QK^T forward, all layers
    assert _counted(model, recompute=True) == training_flops_per_token(model, T, causal=False) * B * T + qk


def test_matmul_parameters_from_the_config():
    """N_mm written out from the widths: q / k / v / o, the SwiGLU FFN and the head, per kind's extras."""
    for kind in ("baseline", "diff_v1", "diff_v2", "gated"):
        model = tiny_model(kind)
        c = model.config
        e, h, kv, d, dv = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.value_dim
        k_heads = 2 * kv if kind == "diff_v1" else kv
        attn = e * c.n_q_heads * d + e * k_heads * d + e * kv * dv + h * dv * e
        attn += {"diff_v2": e * h, "gated": e * h * dv}.get(kind, 0)
        expected = c.n_layers * (attn + 3 * e * c.ffn_dim) + c.vocab_size * e
        assert matmul_parameters(model) == expected, kind


@pytest.mark.parametrize("window", [None, 1, 5, 17, 40, 100])
@pytest.mark.parametrize("t", [1, 17, 40])
def test_causal_keys_count_the_mask(t, window):
    """K: the (query, key) pairs the causal / sliding-window mask lets through, over the queries."""
    seen = sum(1 for i in range(t) for j in range(t) if j <= i and (window is None or j > i - window))
    assert keys_per_query(t, window) * t == pytest.approx(seen, rel=1e-12)
    assert keys_per_query(t, window, causal=False) == t


def test_causal_formula_per_layer_window():
    """Each layer's own window counts (Gemma 3's layer_types): the attention term is the sum over layers."""
    model = tiny_model(
        "baseline", n_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    )
    c = model.config
    per_key = 2 * c.head_dim * c.n_q_heads + 2 * c.value_dim * c.n_heads
    pairs = (sum(min(i + 1, 8) for i in range(T)) + T * (T + 1) // 2) / T
    expected = 6 * matmul_parameters(model) + 3 * per_key * pairs
    assert training_flops_per_token(model, T) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 SXM5 80GB", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA H100 NVL", None),  # lower clocks, not in the table: unknown, not an SXM part's peak
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_table(name, peak):
    assert peak_flops_of(name) == peak


def test_no_peak_on_cpu():
    assert peak_flops("cpu") is None and peak_flops(torch.device("cpu")) is None


def test_peak_of_a_cuda_device_by_its_name(monkeypatch):
    """A CUDA device is looked up by the name torch reports; one that cannot report it (a CPU build under
    tests/devicecheck.py's fake CUDA) has no peak instead of failing the run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops("cuda") == 989e12 and peak_flops("cuda:0") == 989e12

    def broken(device=None):
        raise NameError("name '_get_device_properties' is not defined")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert peak_flops("cuda") is None


# ----------------------------------------------------------------------------------------------------
# the trainer's columns
# ----------------------------------------------------------------------------------------------------
def _cfg(tmp_path, name: str = "t", **kw) -> TrainConfig:
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("".join(f"def g{i}(a, b):\n    return a * {i} + b\n" for i in range(300)))
    base = dict(
        name=name, kind="diff_v2", preset="tiny", data=str(text), data_tokens=None, needle_fraction=0.3,
        seq_len=160, batch_size=3, steps=6, lr=3e-3, min_lr=3e-4, warmup=2, log_every=2, eval_every=3,
        eval_data=str(text), eval_tokens=256, retrieval_samples=1, checkpoint_every=3, threads=1,
        out=str(tmp_path / name),
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _fake_clock(monkeypatch) -> list[float]:
    """The trainer's clock advances 1 s per training batch and 1000 s per evaluation or checkpoint."""
    now = [0.0]
    batch, val_bpb, save_state = TrainData.batch, trainer_mod._val_bpb, trainer_mod._save_state

    def advance(seconds: float, fn):
        def wrapped(*args, **kwargs):
            now[0] += seconds
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(trainer_mod, "_clock", lambda: now[0])
    monkeypatch.setattr(TrainData, "batch", advance(1.0, batch))
    monkeypatch.setattr(trainer_mod, "_val_bpb", advance(1000.0, val_bpb))
    monkeypatch.setattr(trainer_mod, "_save_state", advance(1000.0, save_state))
    return now


def _rows(out) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO((out / "log.csv").read_text())))


def test_log_rows_report_tokens_per_second_and_mfu(tmp_path, monkeypatch):
    """tokens_per_second counts training time only (one fake second a step here, evaluations and checkpoints
    left out), and mfu = the model FLOPs per logged token x tokens_per_second / the peak, with the peak
    monkeypatched (a CPU has none). The model reads seq_len - 1 positions of each seq_len-token row."""
    _fake_clock(monkeypatch)
    monkeypatch.setattr(trainer_mod, "peak_flops", lambda device: 1e12)
    cfg = _cfg(tmp_path)
    printed = []
    out = train(cfg, log=printed.append)
    rows = _rows(out)
    assert [int(r["step"]) for r in rows] == [2, 3, 4, 6]
    model = load_model(out / "final")
    per_token = training_flops_per_token(model, cfg.seq_len - 1) * (cfg.seq_len - 1) / cfg.seq_len
    for row in rows:
        assert float(row["tokens_per_second"]) == pytest.approx(cfg.batch_size * cfg.seq_len, rel=1e-12)
        assert float(row["mfu"]) == pytest.approx(per_token * cfg.batch_size * cfg.seq_len / 1e12, rel=1e-12)
    assert list(rows[0])[-1] == "mfu"  # a trailing column: older logs' columns keep their places
    steps = [m for m in printed if m.startswith("step ")]
    assert len(steps) == 4 and all(f"mfu {float(rows[0]['mfu']):.1%}" in m for m in steps), steps


def test_tokens_per_second_counts_the_wait_for_the_device(tmp_path, monkeypatch):
    """The step only queues work on a GPU: the one wait per log row (reading its scalars) is where the
    device finishes the steps queued since the last row, so the clock is read after it. Here the wait takes
    half a fake second: each row's interval is its steps plus that half second (read before the wait, the
    half second fell into the logging time left out, and tokens/s overstated the device's speed)."""
    now = _fake_clock(monkeypatch)
    read = trainer_mod.host_scalars

    def wait_then_read(values):
        now[0] += 0.5
        return read(values)

    monkeypatch.setattr(trainer_mod, "host_scalars", wait_then_read)
    cfg = _cfg(tmp_path)
    rows = _rows(train(cfg, log=lambda m: None))
    steps = [int(r["step"]) for r in rows]
    assert steps == [2, 3, 4, 6]
    for row, before in zip(rows, [0, *steps], strict=False):
        n = int(row["step"]) - before
        expected = n * cfg.batch_size * cfg.seq_len / (n + 0.5)
        assert float(row["tokens_per_second"]) == pytest.approx(expected, rel=1e-12), row["step"]


def test_mfu_is_empty_without_a_peak(tmp_path):
    """On a CPU (no peak) the column is there and empty, and the progress line shows no mfu."""
    printed = []
    out = train(_cfg(tmp_path, steps=2, eval_every=2, log_every=1), log=printed.append)
    rows = _rows(out)
    assert rows and all(r["mfu"] == "" for r in rows)
    assert not any("mfu" in m for m in printed)


def test_resume_onto_a_log_without_the_mfu_column(tmp_path):
    """A run resumed from a log written before ``mfu`` existed keeps that log's header: every line has the
    header's length (a longer line would be dropped as half-written by the next resume)."""
    cfg = _cfg(tmp_path, log_every=1)
    train(cfg, stop_after=3, log=lambda m: None)
    path = tmp_path / "t" / "log.csv"
    lines = list(csv.reader(io.StringIO(path.read_text())))
    assert lines[0][-1] == "mfu"
    old = [r[:-1] for r in lines]  # the log as the trainer wrote it before the column
    path.write_text("".join(",".join(r) + "\n" for r in old))
    train(cfg, resume=True, log=lambda m: None)
    lines = list(csv.reader(io.StringIO(path.read_text())))
    assert lines[0] == old[0] and [int(r[0]) for r in lines[1:]] == [1, 2, 3, 4, 5, 6]
    assert all(len(r) == len(lines[0]) for r in lines)


def test_training_flops_rejects_an_empty_sequence():
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(tiny_model("baseline"), 0)


def test_formula_counts_the_causal_half_by_default():
    """The default (causal) attention term is the full-square one scaled by (T + 1) / (2 T)."""
    model = tiny_model("diff_v1")
    full = training_flops_per_token(model, T, causal=False) - 6 * matmul_parameters(model)
    causal = training_flops_per_token(model, T) - 6 * matmul_parameters(model)
    assert causal == pytest.approx(full * (T + 1) / (2 * T), rel=1e-12)
