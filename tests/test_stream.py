"""The layer-streamed run (diffquant.stream) equals the whole-model run: profiles, logits, perplexity,
quantization plans with static calibration; native and sharded hf: folders; a missing shard fails up front."""

import math

import pytest
import torch
from conftest import ALL_KINDS, shard_safetensors

from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import evaluate_stream
from diffquant.io import load_model, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.profile.runner import profile_model
from diffquant.quant import QuantPlan, apply_plan, calibrate
from diffquant.stream import (
    evaluate_streamed,
    logits_streamed,
    profile_streamed,
    weights_bytes,
    would_stream,
)

KINDS = ALL_KINDS  # the rivals (gated, sink, clipped) stream like the three DIFF-paper kinds


def _windows(vocab: int, n: int = 5, length: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def _close(a, b, rel=1e-6):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close(a[k], b[k], rel)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _close(x, y, rel)
    elif isinstance(a, float) and isinstance(b, float):
        assert a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(abs(a), abs(b))
    else:
        assert a == b


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return {k: save_checkpoint(load_model(f"init:{k}:tiny"), root / k) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_profile_equals_whole_model(folders, kind):
    model = load_model(str(folders[kind]))
    windows = _windows(model.config.vocab_size)
    for sites in ("*", "kind:resid"):
        whole = profile_model(model, windows, batch_size=2, sites=sites, topk=8).to_dict()
        streamed = profile_streamed(str(folders[kind]), windows, batch_size=2, sites=sites, topk=8).to_dict()
        assert whole["meta"] == streamed["meta"]
        assert whole == streamed  # same tensors, same order per site: bit for bit
        _close(whole, streamed)


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_logits_and_perplexity_equal_whole_model(folders, kind):
    model = load_model(str(folders[kind]))
    windows = _windows(model.config.vocab_size, n=4, length=20)
    with torch.no_grad():
        whole = torch.cat([model(windows[i : i + 3]) for i in range(0, 4, 3)])
    streamed = logits_streamed(str(folders[kind]), windows, batch_size=3)
    assert torch.equal(whole, streamed)
    stream = _windows(model.config.vocab_size, n=1, length=150, seed=3).flatten()
    a = evaluate_stream(model, stream, seq_len=32, batch_size=2)
    b = evaluate_streamed(str(folders[kind]), stream, seq_len=32, batch_size=2)
    _close(a, b)


def test_sharded_hf_folder_streams_like_whole_and_a_missing_shard_fails_first(tmp_path):
    model = load_model("init:diff_v1:tiny")
    out = export_hf(model, tmp_path / "hf")
    shard_safetensors(out, 3)
    spec = f"hf:{out}"
    whole_model = load_model(spec)
    windows = _windows(model.config.vocab_size)
    whole = profile_model(whole_model, windows, batch_size=2, sites="kind:resid", topk=8).to_dict()
    assert whole == profile_streamed(spec, windows, batch_size=2, sites="kind:resid", topk=8).to_dict()
    with torch.no_grad():
        assert torch.equal(whole_model(windows[:2]), logits_streamed(spec, windows[:2], batch_size=2))
    assert weights_bytes(spec) == sum(p.numel() * 4 for p in whole_model.state_dict().values())
    assert would_stream(spec, budget_bytes=10)[0] and not would_stream(spec, budget_bytes=1 << 40)[0]
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(DiffquantError, match="model-00002-of-00003.safetensors is missing") as err:
        profile_streamed(spec, windows, batch_size=2, sites="kind:resid")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["baseline", "diff_v2", "gated"])
def test_static_plan_streamed_equals_whole(folders, kind):
    plan = QuantPlan.load("w8a8-tensor")
    model = load_model(str(folders[kind]))
    windows = _windows(model.config.vocab_size, n=4, length=20)
    apply_plan(model, plan)
    calibrate(model, windows, batch_size=2)
    with torch.no_grad():
        whole = torch.cat([model(windows[i : i + 2]) for i in range(0, 4, 2)])
    streamed = logits_streamed(str(folders[kind]), windows, batch_size=2, plan=plan, calibration=windows)
    assert torch.equal(whole, streamed)


def test_unstreamable_specs_and_plans_are_refused(folders):
    windows = _windows(61)
    with pytest.raises(DiffquantError, match="load init: models whole"):
        profile_streamed("init:baseline:tiny", windows)
    with pytest.raises(DiffquantError, match="not supported in a streamed run"):
        profile_streamed(str(folders["baseline"]), windows, plan="w8a8-smoothquant")


def test_streamed_perplexity_slices_a_large_vocabularys_head_like_the_whole_model(folders, monkeypatch):
    """Above LOGITS_WHOLE_BYTES the streamed head stage runs a slice of positions at a time (Gemma 3's 262k
    vocabulary): the head sees only slices within LOGITS_SLICE_BYTES, and perplexity and bits per byte equal
    the whole model's (which slices alike) and the unsliced run's; a quantizer on the head's input keeps
    one call per batch (it may scale per tensor)."""
    from diffquant.data import scoring
    from diffquant.stream.executor import StreamedModel

    spec = str(folders["diff_v1"])
    model = load_model(spec)
    stream = _windows(model.config.vocab_size, n=1, length=150, seed=3).flatten()
    plain = evaluate_streamed(spec, stream, seq_len=32, batch_size=2)
    row = 2 * 4 * model.config.vocab_size
    monkeypatch.setattr(scoring, "LOGITS_WHOLE_BYTES", row * 31)  # a full (2, 32) batch slices, (1, 32) not
    monkeypatch.setattr(scoring, "LOGITS_SLICE_BYTES", row * 7)
    widths = []
    real_slices = StreamedModel._head_slices

    def watched(self, k, x, fn, profiler, on_slice):
        return real_slices(
            self, k, x, fn, profiler, lambda k, s, y: (widths.append(y.shape), on_slice(k, s, y))
        )

    monkeypatch.setattr(StreamedModel, "_head_slices", watched)
    sliced = evaluate_streamed(spec, stream, seq_len=32, batch_size=2)
    whole = evaluate_stream(model, stream, seq_len=32, batch_size=2)
    assert all(w[1] <= 7 or w[0] * w[1] <= 2 * 31 for w in widths)  # a slice, or a batch that fits whole
    assert any(w[:2] == (2, 4) for w in widths)  # a full batch: 7 + 7 + 7 + 7 + 4 = 32 positions
    _close(sliced, plain, rel=1e-6)
    _close(sliced, whole, rel=1e-6)
    assert sliced["tokens"] == plain["tokens"] == whole["tokens"]
    widths.clear()
    head_quant = QuantPlan.from_dict({"rules": [{"sites": ["lm_head.input"], "scheme": "int8:tensor"}]})
    quantized = evaluate_streamed(spec, stream, seq_len=32, batch_size=2, plan=head_quant)
    assert widths and all(w[1] == 32 or w[0] == 1 for w in widths)  # whole batches: the scale is per tensor
    monkeypatch.undo()
    _close(quantized, evaluate_streamed(spec, stream, seq_len=32, batch_size=2, plan=head_quant), rel=0)
