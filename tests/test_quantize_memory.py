"""What the whole-model quantize holds (issue 27): the quantized model shares the reference's weights where
the plan leaves them alone, the error report runs both models layer by layer and forms its float64 sums one
temporary at a time, and the numbers are the ones of the all-at-once computation it replaces.

The peak itself is measured by analysis/memory/quantize.py (a table, not a test: resident memory depends on
the allocator and the machine)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open

import diffquant.io.quantize as whole_quantize
import diffquant.quant.report as report
from diffquant.cli import main
from diffquant.io import load_model, save_checkpoint
from diffquant.io.quantize import quantize_checkpoint, quantized_copy
from diffquant.models.taps import select_taps
from diffquant.quant import apply_plan, calibrate, preset
from diffquant.quant.fake import FakeQuant
from diffquant.quant.plan import QuantPlan
from diffquant.quant.report import ErrorStats, compare_batch, compare_models, model_stages

KINDS = ["baseline", "diff_v1", "diff_v2"]


def _windows(n=5, t=24, vocab=61, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


class AllAtOnce(ErrorStats):
    """ErrorStats.update as it was written before issue 27: every float64 temporary formed at once."""

    def update(self, ref, quant, valid=None):
        r, q = ref.detach().double(), quant.detach().double()
        finite = torch.isfinite(r) & torch.isfinite(q)
        considered = torch.ones_like(finite) if valid is None else valid.expand_as(finite)
        self.nonfinite += int((considered & ~finite).sum())
        ok = considered & finite
        r, q = r[ok], q[ok]
        e = q - r
        self.n += r.numel()
        self.ref2 += float((r * r).sum())
        self.err2 += float((e * e).sum())
        self.dot += float((r * q).sum())
        self.q2 += float((q * q).sum())
        self.abs_err += float(e.abs().sum())
        self.abs_ref += float(r.abs().sum())


def all_at_once_report(reference, quantized, windows, batch_size):
    """compare_models as it was before issue 27: each whole model run once per batch, every site of the
    reference captured, then the quantized model compared call by call, into AllAtOnce sums."""
    ref_taps, q_taps = select_taps(reference, "*"), select_taps(quantized, "*")
    stats = {n: AllAtOnce() for n in ref_taps if n in q_taps}
    logits = AllAtOnce()
    for model in (reference, quantized):
        model.set_attention_path("auto", chunk_size=windows.shape[1])
    with torch.no_grad():
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size]
            logits.update(*compare_batch(reference, quantized, batch, ref_taps, q_taps, stats))
    for model in (reference, quantized):
        model.set_attention_path("auto")
    return {**{n: s.summary() for n, s in stats.items()}, "logits": logits.summary()}


def _cases():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3, 257, 401, generator=g)  # past torch's reduction grain: the threads split the sum
    yield "big", big, big + 0.01 * torch.randn(big.shape, generator=g), None
    bad = torch.randn(4, 50, generator=g)
    noisy = bad + 0.1 * torch.randn(bad.shape, generator=g)
    bad[0, 3], noisy[1, 4], noisy[2, 5] = float("nan"), float("inf"), float("-inf")
    yield "non-finite", bad, noisy, None
    maps = torch.randn(2, 3, 16, 16, generator=g)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    yield "masked", maps, maps * 1.01, causal
    yield "masked non-finite", bad.reshape(2, 2, 5, 10), noisy.reshape(2, 2, 5, 10), torch.rand(5, 10) > 0.5
    yield "bf16", big.bfloat16(), (big * 1.02).bfloat16(), None
    yield "float64 reference", big.double(), big * 0.99, None
    yield "nothing valid", maps, maps, torch.zeros(16, 16, dtype=torch.bool)


@pytest.mark.parametrize("chunk", [None, 777])
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_error_stats_are_the_all_at_once_float64_sums(case, chunk, monkeypatch):
    _, ref, quant, valid = case
    if chunk is not None:  # mixed-dtype ops converted a chunk at a time, the last chunk short
        monkeypatch.setattr(report, "CHUNK", chunk)
    new, old = ErrorStats(), AllAtOnce()
    for _ in range(2):  # and they add up over batches alike
        new.update(ref, quant, valid)
        old.update(ref, quant, valid)
    assert vars(new) == vars(old)  # bit for bit, not close
    assert new.summary() == old.summary()


def _quantized_pair(kind, plan, seed=0):
    reference = tiny_model(kind, seed=seed)
    model = tiny_model(kind, seed=seed)
    plan = preset(plan) if isinstance(plan, str) else plan
    apply_plan(model, plan)
    calibrate(model, _windows(4, 24, seed=9), batch_size=3)
    for _, factors in model.quant.folded:
        from diffquant.quant.smoothquant import apply_smoothing

        apply_smoothing(reference, factors)
    return reference, model


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("plan", ["w8a8-tensor", "attn-logits-int4", "w8a8", "w8a8-smoothquant"])
def test_layer_by_layer_report_equals_the_whole_models_report(kind, plan):
    reference, model = _quantized_pair(kind, plan)
    assert model_stages(reference, ["layers.0.attn.q"]) is not None  # the lockstep path runs
    windows = _windows()
    want = all_at_once_report(reference, model, windows, batch_size=2)
    got = compare_models(reference, model, windows, batch_size=2)
    assert got == want
    assert not got["logits"]["exact"] and got["logits"]["n"] == windows.numel() * 61


def test_a_model_with_hooks_of_its_own_runs_whole_with_the_same_report():
    reference, model = _quantized_pair("diff_v2", "w8a8-tensor")
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        assert model_stages(model, []) is None
        got = compare_models(reference, model, _windows(), batch_size=2)
    finally:
        handle.remove()
    assert calls == [1, 1, 1]  # the whole model ran, once per batch
    assert got == all_at_once_report(reference, model, _windows(), batch_size=2)


def test_the_report_drops_each_layers_cached_weights_and_the_model_still_gives_its_logits():
    reference, model = _quantized_pair("diff_v1", "w8a8-tensor")
    ids = _windows(2, 24, seed=4)
    with torch.no_grad():
        before = model(ids)
    weights = [q for q in model.modules() if isinstance(q, FakeQuant) and q.kind == "weight"]
    assert weights and all(q._weight_cache is not None for q in weights)
    compare_models(reference, model, _windows(), batch_size=2)
    assert all(q._weight_cache is None for q in weights)  # one layer's at a time, none after
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # recomputed: the same quantized weights


@pytest.mark.parametrize("plan", ["w8a8-tensor", "w4a16", "attn-logits-int4"])
def test_the_quantized_model_shares_the_weights_the_plan_leaves_alone(plan):
    reference = load_model("init:diff_v2:tiny")
    fresh = load_model("init:diff_v2:tiny")
    model = quantized_copy(reference, preset(plan))
    pairs = list(zip(reference.named_parameters(), model.named_parameters(), strict=True))
    for (name, p), (name_q, q) in pairs:
        assert name == name_q and p is not q  # new Parameters (replacing one leaves the other alone)
        assert p.data_ptr() == q.data_ptr(), name  # on the same storage: held once
    assert model.tokenizer is reference.tokenizer
    apply_plan(model, preset(plan))
    calibrate(model, _windows(4, 24, seed=9), batch_size=3)
    compare_models(reference, model, _windows(), batch_size=2)
    for (name, p), (_, f) in zip(reference.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, f), name  # the reference is still the unquantized model
    assert all(p.data_ptr() == q.data_ptr() for (_, p), (_, q) in pairs)


@pytest.mark.parametrize("plan", ["w8a8-smoothquant", "w4a8-quarot"])
def test_a_plan_that_rewrites_weights_gets_weights_of_its_own(plan):
    reference = load_model("init:diff_v2:tiny")
    fresh = load_model("init:diff_v2:tiny")
    model = quantized_copy(reference, preset(plan))
    ptrs = {p.data_ptr() for p in reference.parameters()}
    assert not ptrs & {p.data_ptr() for p in model.parameters()}
    apply_plan(model, preset(plan))
    calibrate(model, _windows(4, 24, seed=9), batch_size=3)  # rotation, then smoothing: in place
    for (name, p), (_, f) in zip(reference.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, f), name


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("plan", ["w8a8-tensor", "w8a8-smoothquant", "w4a8-quarot"])
def test_quantize_writes_what_two_loads_of_the_checkpoint_wrote(tmp_path, monkeypatch, plan):
    """The run as before issue 27 (the quantized model a second load of the checkpoint, reported with the
    whole models and the all-at-once sums) and as now: the same report, the same files."""
    spec = str(save_checkpoint(load_model("init:diff_v1:tiny"), tmp_path / "m"))
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return [i * x for i in range(10)]\n" * 60)
    options = dict(calib_data=str(text), calib_tokens=200, eval_tokens=160, seq_len=32, batch_size=3)
    now = quantize_checkpoint(spec, plan, out=tmp_path / "now", **options)
    with monkeypatch.context() as m:
        m.setattr(whole_quantize, "quantized_copy", lambda reference, plan: load_model(spec))
        m.setattr(
            whole_quantize,
            "compare_models",
            lambda ref, model, windows, batch_size: all_at_once_report(ref, model, windows, batch_size),
        )
        before = quantize_checkpoint(spec, plan, out=tmp_path / "before", **options)
    assert now["report"] == before["report"] and now["text"] == before["text"].replace(
        str(tmp_path / "before"), str(tmp_path / "now")
    )
    for path in (tmp_path / "before").iterdir():
        if path.suffix == ".safetensors":
            (meta_a, a), (meta_b, b) = _tensors(path), _tensors(tmp_path / "now" / path.name)
            assert meta_a == meta_b and list(a) == list(b)
            for k in a:
                assert torch.equal(a[k], b[k]), k
        assert path.read_bytes() == (tmp_path / "now" / path.name).read_bytes(), path.name


def test_quantize_prints_its_peak_memory_last(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("print('hello, world')\n" * 200)
    argv = ["quantize", "init:baseline:tiny", "--plan", "w8a8-tensor", "--calib-data", str(text)]
    assert (
        main(
            [
                *argv,
                "--seq-len",
                "32",
                "--calib-tokens",
                "128",
                "--eval-tokens",
                "64",
                "--out",
                str(tmp_path / "q"),
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.splitlines()[-1]
    match = re.fullmatch(r"wrote .*q \(load it like any checkpoint: .*\); peak memory (\d+\.\d\d) GiB", last)
    assert match, last
    assert 0.05 < float(match.group(1)) <= whole_quantize.peak_memory_bytes() / 2**30 + 0.005


def test_the_plan_dataclass_is_what_quantized_copy_reads():
    assert QuantPlan().rotate is None and QuantPlan().smooth is None  # a plain plan shares


def test_calibration_holds_one_quantized_weight_at_a_time():
    model = tiny_model("diff_v2")
    apply_plan(model, preset("w8a8-tensor"))  # static scales: calibration runs the model
    held = []
    linears = [m for m in model.modules() if getattr(m, "weight_quantizer", None) is not None]

    def count(*_):
        held.append(sum(_cached(m.weight_quantizer) for m in linears))

    handles = [m.register_forward_pre_hook(count) for m in linears]
    try:
        calibrate(model, _windows(4, 24, seed=9), batch_size=2)
    finally:
        for h in handles:
            h.remove()
    assert held and max(held) == 0  # each dropped after its Linear ran: none left when the next one starts
    assert not any(_cached(m.weight_quantizer) for m in linears)


def _cached(quantizer) -> bool:
    return (
        getattr(quantizer, "_weight_cache", None) is not None
        or getattr(quantizer, "_cache", None) is not None
    )
