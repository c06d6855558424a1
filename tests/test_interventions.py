"""Sun et al. 2024's massive-activation interventions: the criterion, the layer and channels found, and the
perplexity under zero / mean against a reference that edits the planted entries by hand."""

from __future__ import annotations

import math

import pytest
import torch

from diffquant import DiffquantError
from diffquant.data import token_windows
from diffquant.eval.interventions import find_massive, intervened, massive_mask
from diffquant.eval.tasks import parse_task, run_task
from diffquant.models import DecoderLM, ModelConfig

CFG = ModelConfig(
    vocab_size=259, d_model=32, n_layers=10, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=128
)
PLANT_LAYER = 3
# (position, channel, value added): massive activations in every window, channel 5 on the first token and
# (smaller) on a later one, as Sun et al. find them on the starting token and on delimiters
PLANTS = [(0, 5, 4000.0), (9, 17, -2500.0), (20, 5, 1500.0)]
ROLE = {0: "first", 9: "later", 20: "later"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_massive_mask_is_sun_et_als_criterion(dtype):
    """|x| > max(100, 1000 x median |x| of the sequence), by loops over the entries; the floor of 100 binds
    when the median is small, the ratio when it is large, and each batch row has its own median."""
    g = torch.Generator().manual_seed(0)
    for scale in (0.05, 0.5):
        x = (torch.randn(2, 9, 16, generator=g) * scale).to(dtype)
        x[1] *= 0.3  # the second sequence's median is smaller
        x[0, 0, 3], x[1, 4, 7], x[1, 2, 2], x[0, 5, 5] = 150.0, -800.0, 99.0, 300.0
        want = torch.zeros(x.shape, dtype=torch.bool)
        for b in range(2):
            flat = [abs(float(v)) for v in x[b].flatten()]
            median = sorted(flat)[(len(flat) - 1) // 2]  # torch.median: the lower of the two middle values
            bar = max(100.0, 1000.0 * median)
            want[b] = torch.tensor([v > bar for v in flat]).view(x[b].shape)
        assert torch.equal(massive_mask(x), want)
        assert torch.equal(massive_mask(x[1:]), want[1:])  # a row's entries do not depend on the batch
        assert 0 < int(want.sum()) < 5


def _planted() -> DecoderLM:
    """A 10-layer model whose layer PLANT_LAYER output gets PLANTS added in every window (hooked)."""
    torch.manual_seed(0)
    model = DecoderLM(CFG).eval()

    def plant(_m, args, out):
        out = out.clone()
        rows = 1 + torch.arange(out.shape[0], dtype=out.dtype)  # a different size in each batch row
        start = 0 if args[1] is None else args[1].length - out.shape[1]  # a cached forward's first position
        for pos, ch, value in PLANTS:
            if start <= pos < start + out.shape[1]:
                out[:, pos - start, ch] += value * rows
        return out

    model.layers[PLANT_LAYER].register_forward_hook(plant)
    return model


def _reference_ppl(model: DecoderLM, windows: torch.Tensor, values: dict[tuple[int, int], float]) -> float:
    """exp(mean NLL) in float64 over tokens 1..T-1 of each disjoint window, with the planted entries set to
    ``values`` by a second hook (registered after the planting one, so it sees the planted output)."""

    def edit(_m, _a, out):
        out = out.clone()
        for (pos, ch), v in values.items():
            out[:, pos, ch] = v
        return out

    handle = model.layers[PLANT_LAYER].register_forward_hook(edit)
    try:
        with torch.no_grad():  # in the task's batches of 4 (the planted sizes depend on the batch row)
            logits = torch.cat([model(windows[i : i + 4]) for i in range(0, windows.shape[0], 4)]).double()
    finally:
        handle.remove()
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="mean"
    )
    return math.exp(float(nll))


def test_the_finding_pass_locates_the_planted_activations_and_their_means():
    model = _planted()
    windows = token_windows("stdlib:validation", 6 * 64, 64)
    sites = find_massive(model, windows, batch_size=4)
    assert sites.layer == PLANT_LAYER  # the first layer with massive outputs (they persist in the residual)
    assert sites.channels == [5, 17] and sites.entries == 3 * windows.shape[0]
    assert sorted(sites.means) == [(5, "first"), (5, "later"), (17, "later")]
    captured = []
    handle = model.layers[PLANT_LAYER].register_forward_hook(
        lambda _m, _a, out: captured.append(out.double())
    )
    with torch.no_grad():
        for start in (0, 4):  # the batches of the finding pass
            model(windows[start : start + 4])
    handle.remove()
    outputs = torch.cat(captured)
    for pos, ch, _ in PLANTS:
        want = float(outputs[:, pos, ch].mean())
        assert sites.means[ch, ROLE[pos]] == pytest.approx(want, rel=1e-12)
        assert sites.mean(ch, ROLE[pos]) == sites.means[ch, ROLE[pos]]
    assert sites.mean(17, "first") == sites.means[17, "later"]  # no first-token entries: the later mean
    later = find_massive(model, windows, batch_size=4, layer=PLANT_LAYER + 2)
    assert later.layer == PLANT_LAYER + 2 and later.channels == [5, 17]


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ppl_under_the_intervention_equals_editing_the_entries_by_hand(mode):
    model = _planted()
    task = parse_task(f"ppl:data=stdlib:validation,tokens=384,seq_len=64,windows=disjoint,intervene={mode}")
    out = run_task(model, task, batch_size=4)
    windows = token_windows("stdlib:validation", 384, 64)
    sites = find_massive(model, windows, batch_size=4)
    values = {(pos, ch): 0.0 if mode == "zero" else sites.means[ch, ROLE[pos]] for pos, ch, _ in PLANTS}
    assert out["perplexity"] == pytest.approx(_reference_ppl(model, windows, values), rel=1e-5)
    assert out["intervene"] == mode and out["intervene_layer"] == PLANT_LAYER
    assert out["intervene_channels"] == "5,17" and out["intervened"] == 3 * windows.shape[0]
    assert out["massive_outside"] == 0
    plain = run_task(model, parse_task("ppl:data=stdlib:validation,tokens=384,seq_len=64,windows=disjoint"))
    assert plain["perplexity"] == pytest.approx(_reference_ppl(model, windows, {}), rel=1e-5)
    if mode == "zero":  # the edit changed something (the mean barely moves this random model: see below)
        assert out["perplexity"] != pytest.approx(plain["perplexity"], rel=1e-3)


def test_the_hook_is_removed_and_outside_channels_are_counted():
    model = _planted()
    windows = token_windows("stdlib:validation", 4 * 64, 64)
    sites = find_massive(model, windows, batch_size=4)
    sites.means.pop((17, "later"))  # pretend channel 17 was not found: its entries stay and are counted
    with torch.no_grad():
        before = model(windows)
        with intervened(model, sites, "zero") as counts:
            model(windows)
        after = model(windows)
    assert counts == {"intervened": 8, "massive_outside": 4}
    assert torch.equal(before, after)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_the_layer_output_holds_zero_or_the_channel_mean_and_nothing_else_changes(mode):
    model = _planted()
    windows = token_windows("stdlib:validation", 8 * 64, 64)
    sites = find_massive(model, windows, batch_size=4)
    block = model.layers[PLANT_LAYER]
    seen = []
    with torch.no_grad():
        handle = block.register_forward_hook(lambda _m, _a, out: seen.append(out.clone()))
        model(windows[:4])
        handle.remove()
        with intervened(model, sites, mode):
            handle = block.register_forward_hook(lambda _m, _a, out: seen.append(out.clone()))
            model(windows[:4])
            handle.remove()
    before, after = seen
    expected = before.clone()
    for pos, ch, _ in PLANTS:
        expected[:, pos, ch] = 0.0 if mode == "zero" else sites.means[ch, ROLE[pos]]
    assert torch.equal(after, expected)
    assert float(before[0, 0, 5]) != pytest.approx(float(before[1, 0, 5]), rel=0.1)  # the values differ


def test_cached_decoding_knows_the_first_token_from_the_cache():
    """Decode steps (one query, fewer than the keys) are later tokens; a prefill holds the first one: the
    mean intervention gives the same layer output through the cache as in one whole forward."""
    model = _planted()
    windows = token_windows("stdlib:validation", 4 * 64, 64)
    sites = find_massive(model, windows, batch_size=4)
    block = model.layers[PLANT_LAYER]
    seen = []
    ids = windows[:4, :24]
    with torch.no_grad(), intervened(model, sites, "mean"):
        handle = block.register_forward_hook(lambda _m, _a, out: seen.append(out.clone()))  # after it
        whole = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :12], cache)[:, -1]]
        steps += [model(ids[:, t : t + 1], cache)[:, -1] for t in range(12, 24)]
    handle.remove()
    for pos, role in ((20, "later"), (0, "first")):
        assert torch.equal(seen[0][:, pos, 5], torch.full((4,), sites.means[5, role]))
    cached = torch.cat([seen[1]] + seen[2:], dim=1)
    for pos, ch, _ in PLANTS:  # the set entries are the same means; the rest agree to rounding
        assert torch.equal(cached[:, pos, ch], seen[0][:, pos, ch])
    assert torch.allclose(cached, seen[0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(torch.stack(steps, 1), whole[:, 11:], rtol=1e-4, atol=1e-4)


def test_bad_interventions_are_one_line_errors():
    torch.manual_seed(0)
    plain = DecoderLM(CFG).eval()  # a random model: no massive activations at all
    windows = token_windows("stdlib:validation", 2 * 64, 64)
    for call in (
        lambda: parse_task("ppl:intervene_layer=3"),
        lambda: parse_task("ppl:intervene=half"),
        lambda: find_massive(_planted(), windows, layer=10),
        lambda: find_massive(_planted(), windows, layer=PLANT_LAYER - 1),
        lambda: intervened(plain, find_massive(_planted(), windows), "half").__enter__(),
    ):
        with pytest.raises(DiffquantError) as info:
            call()
        assert "\n" not in str(info.value)
    assert not parse_task("ppl:intervene=zero").streams  # hooks need the whole model


def test_a_model_without_massive_activations_reports_none_found():
    """A random model has none at any layer: the task's perplexity is the plain one, bit for bit, with
    nothing found or changed and no layer (a sweep over families keeps the row instead of failing)."""
    torch.manual_seed(0)
    plain = DecoderLM(CFG).eval()
    base = "ppl:data=stdlib:validation,tokens=256,seq_len=64,windows=disjoint"
    want = run_task(plain, parse_task(base), batch_size=2)
    windows = token_windows("stdlib:validation", 256, 64)
    sites = find_massive(plain, windows, batch_size=2)
    assert sites.layer is None and sites.entries == 0 and sites.channels == []
    for mode in ("zero", "mean"):
        out = run_task(plain, parse_task(f"{base},intervene={mode}"), batch_size=2)
        assert out["perplexity"] == want["perplexity"] and out["bits_per_byte"] == want["bits_per_byte"]
        assert out["intervene_layer"] is None and out["intervene_found"] == 0
        assert out["intervened"] == 0 and out["massive_outside"] == 0 and out["intervene_channels"] == ""
    with pytest.raises(DiffquantError):  # a named layer without any stays an error: the user expected them
        find_massive(plain, windows, layer=2)
