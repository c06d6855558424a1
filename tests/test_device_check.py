"""Device mistakes caught without a GPU (issue 45): the stages on tensors that say "cuda:0" (tests/devicecheck.py).

A CPU / CUDA mix raises there as on a GPU. Each stage runs once on the CPU and once with the model and its
inputs on the fake CUDA device, and the two must agree bit for bit: the fake device computes with the same CPU
ops, so any difference is code that took another branch on CUDA. The CPU reference runs SDPA's math kernel
(what SDPA picks for a "cuda" tensor on a CPU build) and the torch statistics / fake-quant paths (CUDA tensors
take them; tests/test_profiler.py::test_native_profile_equals_the_torch_one and
tests/test_quant.py::test_fake_quant_fast_path_is_bit_identical compare those with the native passes).
"""

import contextlib
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import ALL_KINDS, tiny_model
from devicecheck import FakeCuda, fake_cuda, host_syncs, real
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffquant.cli import main
from diffquant.io import save_checkpoint
from diffquant.kernels import native
from diffquant.models import attention as model_attention
from diffquant.profile import Profiler, attention_metrics, profile_model, stats
from diffquant.profile.maps import capture_maps
from diffquant.profile.sinks import sink_rate_summary, sink_rates
from diffquant.quant import schemes

# The stand-in is for machines without a GPU: where a real one is, `pytest -m gpu` and the GPU kit run the
# stages on it (tests/devicecheck.py replaces CUDA's allocator kernels while it is active).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here")


@pytest.fixture
def torch_paths(monkeypatch):
    """The CPU reference computes as CUDA tensors do: the torch statistics and fake-quant paths, SDPA's math
    kernel."""
    for module in (stats, attention_metrics, schemes):
        monkeypatch.setattr(module, "NATIVE", False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _windows(n=4, t=24, seed=0):
    return torch.randint(0, 61, (n, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the check
def test_the_check_raises_cudas_error_on_a_cpu_cuda_mix():
    with fake_cuda():
        assert torch.cuda.is_available()
        x = torch.arange(6.0, device="cuda")
        assert isinstance(x, FakeCuda) and x.is_cuda and x.device == torch.device("cuda", 0)
        for mix in (
            lambda: x + torch.ones(6),
            lambda: torch.zeros(6).index_add_(0, torch.arange(6), x),
            lambda: torch.zeros(6, device="cuda").index_add_(0, torch.arange(6), x),
            lambda: torch.ones(6)[torch.tensor([1], device="cuda")],
            lambda: torch.where(torch.ones(6, dtype=torch.bool), x, torch.zeros(6)),
        ):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                mix()
        # what CUDA allows: CPU scalars (0-d), CPU index tensors, copies across devices
        assert (x * torch.tensor(2.0)).is_cuda
        assert x[torch.tensor([1, 4])].tolist() == [1.0, 4.0]
        assert x[x > 3].tolist() == [4.0, 5.0]
        assert torch.zeros(6).copy_(x).tolist() == x.tolist()
        host = x.cpu()
        assert (
            type(host) is torch.Tensor and host.device.type == "cpu" and host.tolist() == [0, 1, 2, 3, 4, 5]
        )
        assert float(x.sum()) == 15.0 and x[2].item() == 2.0
        y = x.clone()
        y[1:3] = 7.0
        assert y.tolist() == [0, 7, 7, 3, 4, 5] and x[1].item() == 1.0
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()
        linear = torch.nn.Linear(6, 2).to("cuda")
        assert isinstance(linear.weight, FakeCuda) and isinstance(linear.weight, torch.nn.Parameter)
        with torch.no_grad():
            assert linear(x).is_cuda
        linear.to("cpu")
        assert type(linear.weight) is torch.nn.Parameter
    assert not isinstance(torch.zeros(1), FakeCuda)


def test_native_passes_refuse_cuda_tensors_and_site_stats_take_the_torch_path(monkeypatch):
    """The native C passes read CPU pointers: under the check they raise on a CUDA tensor, and every caller
    tests the device first (a profile on CUDA never reaches them)."""
    calls = []
    for name in ("pass1", "pass2", "map_rows", "row_ranges", "fake_int_rows"):
        original = getattr(native, name)

        def counted(*args, _original=original, **kwargs):
            calls.append(args)
            return _original(*args, **kwargs)

        monkeypatch.setattr(native, name, counted)
    with fake_cuda():
        x = torch.randn(4, 8, device="cuda")
        with pytest.raises(RuntimeError, match="CPU only"):
            native.row_ranges(x > 0)
        calls.clear()
        site = stats.SiteStats("layers.0.resid", "resid")
        site.update(x.view(1, 4, 8))
        assert site.count == 32 and calls == []


# ------------------------------------------------------------------------------ statistics (issue 45)
def test_histogram_and_row_moments_run_on_cuda(torch_paths):
    """The two lines the GPU run failed at: _histogram's index_add_ with the CPU fold table and a CUDA source,
    _row_moments_block's CPU row counts dividing CUDA sums. On CUDA they give the CPU's numbers."""
    torch.manual_seed(0)
    x = torch.randn(6, 40) * torch.logspace(-3, 3, 40)
    ok = torch.rand(6, 40) > 0.2
    flat, okf = x.reshape(-1), ok.reshape(-1)
    cpu_hist = [stats._histogram(flat, None), stats._histogram(flat, okf)]
    cpu_rows = [stats._row_moments_block(x, None), stats._row_moments_block(x, ok)]
    with fake_cuda():
        xc, okc = x.to("cuda"), ok.to("cuda")
        cuda_hist = [
            stats._histogram(xc.reshape(-1), None),
            stats._histogram(xc.reshape(-1), okc.reshape(-1)),
        ]
        cuda_rows = [stats._row_moments_block(xc, None), stats._row_moments_block(xc, okc)]
    for (dense, ge6, ge100), (dense_c, ge6_c, ge100_c) in zip(cpu_hist, cuda_hist, strict=True):
        assert torch.equal(dense, real(dense_c)) and (ge6, ge100) == (ge6_c, ge100_c)
        assert dense.sum() > 0 and ge6 > 0 and ge100 > 0
    for cpu, cuda in zip(cpu_rows, cuda_rows, strict=True):
        for a, b in zip(cpu, cuda, strict=True):
            assert isinstance(b, FakeCuda) and torch.equal(a, real(b))


def _site_cases():
    """(kind, tensor, valid) updates covering each path of SiteStats.update: channel rows, a causal map
    chunk (the gathered fast path), a map with a mask that differs per row (the masked general path; one
    with fewer visible entries than the top-k), non-finite values, float64, bfloat16, a 0-d lambda."""
    g = torch.Generator().manual_seed(1)
    resid = torch.randn(2, 6, 16, generator=g)
    resid[0, 2, 5] = 250.0  # a massive activation
    logits = torch.randn(2, 4, 6, 6, generator=g) * 3
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    ragged = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    sparse = torch.zeros(2, 1, 6, 6, dtype=torch.bool)  # 4 visible entries (one per head): fewer than 7
    sparse[0, 0, 5, 2] = True
    broken = torch.randn(2, 6, 16, generator=g)
    broken[1, 3, 2], broken[0, 0, 0] = math.nan, -math.inf
    massive = torch.randn(2, 6, 16, generator=g) * 80  # many |x| > 100, and ties at the cap
    massive[0, 1, :4] = 300.0
    massive[1, 4, 3:9] = -300.0
    floor = torch.randn(2, 6, 16, generator=g)
    floor[1, 2, 7] = -100.0  # |x| >= 100 seen, none above it: a count of 0
    return [
        ("resid", resid, None),
        ("resid", massive, None),
        ("resid", floor, None),
        ("logits", logits * 60, causal),  # a gathered map's massive entries (visible ones only)
        ("logits", logits, causal),
        ("logits", logits, ragged),
        ("logits", logits, sparse),
        ("resid", broken, None),
        ("q", torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64), None),
        ("mlp_act", torch.randn(2, 6, 16, generator=g).to(torch.bfloat16), None),
        ("lambda", torch.tensor(0.37), None),
    ]


def test_massive_activations_ride_in_the_update_s_one_transfer(torch_paths):
    """An update with |x| > 100 (massive activations: most residual sites of a real LLM) reads once on CUDA:
    the count above 100 and the first entries (as many as the top-k or the massive cap, whichever is more)
    come with the update's small results, and the massive ones are the first of those. It was a data-sized
    selection of the candidates, a search among them and a read of their entries after the transfer: on a
    SmolLM2 profile on the stand-in, 128 of a batch's 552 waits. A gathered map with massive entries reads
    its mask besides, once."""
    massive, causal = _site_cases()[1][1], torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    logits = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3)) * 200
    with fake_cuda():
        stats._fold_on(torch.device("cuda", 0))  # the histogram's fold table: copied once per device
        for kind, x, valid, extra in (
            ("resid", massive, None, []),
            ("logits", logits, causal, ["nonzero", ".tolist()"]),
        ):
            site = stats.SiteStats(f"layers.1.{kind}", kind, topk=7, massive_cap=3)
            x_c, valid_c = x.to("cuda"), None if valid is None else valid.to("cuda")
            with host_syncs() as syncs:
                site.update(x_c, valid_c)
            assert site.count_abs_gt_100 > 3 and len(site.to_dict()["massive"]) == 3
            reads = [s for s in syncs if s.startswith("device-to-host")]
            assert len(reads) == 1 and [s for s in syncs if s not in reads] == extra, syncs


@pytest.mark.parametrize("search", ["packed", "host"])
def test_site_stats_on_cuda_equal_the_cpu_torch_path(torch_paths, monkeypatch, search):
    """Every update path on the device gives the CPU's state, with either top-k search (the packed keys up
    to stats.DEVICE_TOPK_MAX entries, the host-guided search beyond)."""
    if search == "host":
        monkeypatch.setattr(stats, "DEVICE_TOPK_MAX", 0)
    tokens = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(2))
    seen = set()
    for (kind, x, valid), (topk, cap) in itertools.product(_site_cases(), [(7, 3), (2, 9)]):
        cpu = stats.SiteStats(f"layers.1.{kind}", kind, topk=topk, massive_cap=cap)
        cpu.update(x, valid, tokens=tokens, sample_offset=4)
        with fake_cuda():
            cuda = stats.SiteStats(f"layers.1.{kind}", kind, topk=topk, massive_cap=cap)
            cuda.update(
                x.to("cuda"), None if valid is None else valid.to("cuda"), tokens.to("cuda"), sample_offset=4
            )
            state = cuda.to_dict()
        assert json.dumps(state) == json.dumps(cpu.to_dict()), (kind, topk, cap)
        assert cpu.count > 0
        seen.add((cpu.count_abs_gt_100 > len(cpu.to_dict()["massive"]), len(cpu.to_dict()["massive"]) == cap))
    assert seen >= {(True, True), (False, False)}  # massive entries past the cap, and all of them kept


# ------------------------------------------------------------------------------------- profile stage
def _profile_state(model, ids):
    profile = profile_model(model, ids, batch_size=2, topk=5)
    maps = capture_maps(model, ids[0, :12])
    sinks = sink_rate_summary(sink_rates(model, ids, batch_size=2))
    return json.dumps(profile.to_dict()), {k: real(v).tolist() for k, v in maps.items()}, sinks


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_profile_on_cuda_equals_the_cpu_profile(kind, torch_paths):
    """Site statistics, every accumulator, attention metrics, maps and sink rates of a model on CUDA: the CPU
    profile's, bit for bit."""
    model = tiny_model(kind)
    ids = _windows(3, 16)
    cpu = _profile_state(model, ids)
    with fake_cuda():
        model.to("cuda")
        cuda = _profile_state(model, ids.to("cuda"))
        model.to("cpu")
    assert cuda == cpu


def _profile_diff_v2_on_cuda(t: int, kind: str = "diff_v2") -> None:
    """A DIFF V2 profile (4 windows of ``t`` tokens, batches of 2, top 5) with the model on the stand-in CUDA
    (another ``kind`` of model: its profile)."""
    model = tiny_model(kind)
    with fake_cuda():
        model.to("cuda")
        profile_model(model, _windows(4, t).to("cuda"), batch_size=2, topk=5)
        model.to("cpu")


def test_a_profile_locates_its_entries_without_a_read_of_their_own(torch_paths, monkeypatch):
    """Each site's top-k entries are found on the device (one top-k over packed keys) and their values and
    flat indices ride in the update's one transfer; the coordinates are unravelled and the token ids read
    on the host (the profiler copies each batch's ids there once), so locating them reads nothing more. It
    was three reads per site and update on CUDA plus a blocking copy of two index lists, then one read;
    the profile itself equals the CPU's (test_profile_on_cuda_equals_the_cpu_profile)."""
    reads = []
    located = stats.SiteStats._located

    def counted(self, both, *args, **kwargs):
        with host_syncs() as syncs:
            out = located(self, both, *args, **kwargs)
        reads.append((len(both), len(syncs), any(e["loc"].get("token") is not None for e in out)))
        return out

    monkeypatch.setattr(stats.SiteStats, "_located", counted)
    _profile_diff_v2_on_cuda(16)
    assert len(reads) > 60 and all(n == 10 for n, _, _ in reads)  # top 5: values and indices
    assert any(tokens for *_, tokens in reads)
    assert all(waits == 0 for _, waits, _ in reads), reads
    # the host-guided search (updates past DEVICE_TOPK_MAX) on the general path (a non-finite value; here
    # every update, BUNDLED off) reads them in one transfer
    monkeypatch.setattr(stats, "BUNDLED", False)
    monkeypatch.setattr(stats, "DEVICE_TOPK_MAX", 0)
    entries, general = stats.SiteStats._entries, []

    def counted_entries(self, idx, *args, **kwargs):
        with host_syncs() as syncs:
            out = entries(self, idx, *args, **kwargs)
        general.append((len(out), len(syncs)))
        return out

    monkeypatch.setattr(stats.SiteStats, "_entries", counted_entries)
    _profile_diff_v2_on_cuda(16)
    assert len(general) > 60 and all(got == (5, 1) for got in general), general


def test_the_packed_top_k_serves_device_magnitudes_up_to_its_bound(monkeypatch):
    """Packed keys for float32-exact magnitudes on a device, at most DEVICE_TOPK_MAX of them; the host-guided
    search for CPU tensors (cheaper there), float64 (no 32-bit key) and larger updates."""
    monkeypatch.setattr(stats, "DEVICE_TOPK_MAX", 100)
    with fake_cuda():
        on_device = [
            stats._packable(torch.zeros(n, dtype=d, device="cuda"))
            for n, d in [
                (100, torch.float32),
                (101, torch.float32),
                (100, torch.bfloat16),
                (100, torch.float64),
            ]
        ]
    assert on_device == [True, False, True, False]
    assert not stats._packable(torch.zeros(100))


def test_attention_metrics_start_their_sums_on_the_maps_device(torch_paths):
    """Per-head sums made on the host before the first map (the head count known up front) start again
    as zeros on the map's device instead of being copied there (a host wait per sum and metric); sums read
    from a saved profile are kept and moved. The results are the CPU's."""
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(2, 3, 5, 5, generator=g), -1)
    valid = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    lam = torch.rand(2, 5, 3, generator=g)
    metrics = [attention_metrics.MapStats, attention_metrics.DiffMapStats, attention_metrics.SinkRateStats]
    cpu = []
    for cls in metrics:
        m = cls(3)
        m.update(probs, valid)
        cpu.append(m.to_dict())
    lam_cpu = attention_metrics.LambdaStats()
    lam_cpu.update(lam)
    with fake_cuda():
        probs_c, valid_c, lam_c = probs.to("cuda"), valid.to("cuda"), lam.to("cuda")
        with host_syncs() as syncs:
            cuda = []
            for cls in metrics:
                m = cls(3)
                m.update(probs_c, valid_c)
                cuda.append(m)
            lam_cuda = attention_metrics.LambdaStats()
            lam_cuda.update(lam_c)
        assert [s for s in syncs if s.startswith("host-to-device")] == []
        assert [m.to_dict() for m in cuda] == cpu and lam_cuda.to_dict() == lam_cpu.to_dict()
        saved = attention_metrics.MapStats.from_dict(cpu[0])  # read in: moved, not restarted
        saved.update(probs_c, valid_c)
        twice = attention_metrics.MapStats(3)
        twice.update(probs, valid)
        twice.update(probs, valid)
        assert saved.to_dict() == twice.to_dict()


def test_row_moments_combine_with_one_read_of_the_device():
    """The per-update moments of a site's rows come to the host as one transfer (their count with the four
    sums): the CPU's numbers, and zeros for no rows."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 32, generator=g) * torch.logspace(-2, 3, 6)[:, None]
    ok = torch.rand(6, 32, generator=g) > 0.3
    cpu = stats._combine_rows(*stats._row_moments_block(rows, ok))
    empty = torch.zeros(0, dtype=torch.float64)
    with fake_cuda():
        parts = stats._row_moments_block(rows.to("cuda"), ok.to("cuda"))
        with host_syncs() as syncs:
            cuda = stats._combine_rows(*parts)
        nothing = stats._combine_rows(*(empty.to("cuda") for _ in range(5)))
    assert cuda == cpu and cpu[0] == int(ok.sum()) and len(syncs) == 1
    assert nothing == (0, 0.0, 0.0, 0.0, 0.0)


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_triton_kernel_runs_on_cuda_for_a_plan_it_implements(kind):
    """On CUDA a DIFF layer under ``qk-int8-pv-fp8`` runs the fused kernel (docs/kernels.md), as
    ``diffquant info`` plans: the P quantizers on its map taps are the kernel's own, not observers (they
    used to send it down the explicit path). A hook on a map still takes the explicit path, where maps exist.
    On the fake device the kernel runs in Triton's interpreter: the CPU's forced-kernel numbers."""
    from diffquant.kernels.dispatch import path_summary, planned_paths
    from diffquant.quant import apply_plan, preset

    model = tiny_model(kind, head_dim=16)
    apply_plan(model, preset("qk-int8-pv-fp8"))
    ids = _windows(2, 32)
    with torch.no_grad():
        model.set_kernel("triton")
        forced = model(ids)
        model.set_kernel("auto")
        with fake_cuda():
            model.to("cuda")
            out = model(ids.to("cuda")).cpu()
            ran = path_summary(model)
            with Profiler(model, sites="kind:probs", attention=False):
                model(ids.to("cuda"))
            watched = path_summary(model)
            model.to("cpu")
    assert ran == planned_paths(model, cuda=True) == {"triton": 2}
    assert torch.equal(out, forced)
    assert watched == {"explicit": 2}


# ------------------------------------------------------------------------------------- the commands
@contextlib.contextmanager
def _as_cuda(cuda: bool, device: tuple[str, ...]):
    if cuda:
        with fake_cuda():
            yield list(device)
    else:
        yield []


def _run_folder_state(folder):
    """Every artifact of a run folder, minus what names the device or the clock: JSON as data, tensors as
    lists, figures as bytes."""
    from safetensors.torch import load_file

    skip = {"device", "started", "finished", "seconds", "ident", "settings", "fingerprint"}

    def clean(obj):
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items() if k not in skip}
        if isinstance(obj, list):
            return [clean(v) for v in obj]
        return obj

    state = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if not path.is_file() or path.name.startswith(".diffquant-run") or path.name == "timing.csv":
            continue
        if path.suffix == ".json":
            state[rel] = clean(json.loads(path.read_text()))
        elif path.suffix == ".jsonl":
            state[rel] = [clean(json.loads(line)) for line in path.read_text().splitlines()]
        elif path.suffix == ".safetensors":
            state[rel] = {k: v.tolist() for k, v in load_file(str(path)).items()}
        elif path.suffix in (".png", ".pt"):
            state[rel] = path.read_bytes()
        else:
            state[rel] = path.read_text()
    return state


def _checkpoints(tmp_path, kinds, max_seq_len=64):
    paths = []
    for kind in kinds:
        path = tmp_path / kind
        save_checkpoint(tiny_model(kind, vocab_size=259, max_seq_len=max_seq_len), path)
        paths.append(str(path))
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x * 2  # the magic number of Paris is 42\n" * 40)
    return paths, str(data)


def _both(tmp_path, argv, device=("--device", "cuda")):
    """``diffquant ARGV --out cpu`` and ``diffquant ARGV --out cuda DEVICE``: their run folders."""
    states = []
    for cuda in (False, True):
        out = tmp_path / ("cuda" if cuda else "cpu")
        with _as_cuda(cuda, device) as where:
            assert main([*argv, "--out", str(out), *where]) == 0
        states.append(_run_folder_state(out))
    return states


def _same_run(cuda: dict, cpu: dict) -> bool:
    """The CPU run's artifacts, exactly, but for a quant report's metrics, which are the CPU's up to float64
    rounding: on a GPU the report adds zeros where the CPU selects the compared values (one read instead of
    a selection's), so its sums add in another order."""

    def close(a, b) -> bool:
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
        if type(a) is float and type(b) is float:
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        return a == b

    if cuda.keys() != cpu.keys():
        return False
    return all(close(cuda[k], cpu[k]) if k.endswith("quant_report.json") else cuda[k] == cpu[k] for k in cpu)


@pytest.mark.slow
def test_profile_command_on_cuda(tmp_path, torch_paths, monkeypatch):
    """`diffquant profile --device cuda` (checkpoints read onto the device, Table 5, maps, sink rates, the
    streamed profile): the CPU run's artifacts."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    paths, data = _checkpoints(tmp_path, ("baseline", "diff_v1"))
    for extra in (["--sink-rate"], ["--stream", "on", "--dtype", "bfloat16"]):
        argv = ["profile", *paths, "--data", data, "--tokens", "128", "--seq-len", "32", *extra]
        cpu, cuda = _both(tmp_path / extra[0].strip("-"), argv)
        assert _same_run(cuda, cpu) and "table5.json" in cpu


OBSERVERS_PLAN = """name: observers
description: static scales by percentile, MSE and abs-max
rules:
  - sites: ["kind:logits"]
    scheme: {format: int8, granularity: head, calibration: percentile}
  - modules: ["layers.*"]
    scheme: int4:channel
  - sites: ["layers.*.input"]
    scheme: {format: int8, granularity: tensor, calibration: mse}
  - sites: ["kind:v"]
    scheme: {format: fp8_e4m3, granularity: head, calibration: absmax}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [
        "w8a8-smoothquant",
        "w4a8-quarot-smooth",
        "w4a4-quarot-gptq",
        "w4a16-hqq-g32",
        "kv2-g8-prerope",
        "observers",
    ],
)
def test_quantize_command_on_cuda(tmp_path, torch_paths, monkeypatch, plan):
    """`diffquant quantize --device cuda`: observers, fake quant, SmoothQuant, rotation, GPTQ / HQQ, static
    scales, the KV cache and the error report give the CPU run's checkpoint and report."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    (path,), data = _checkpoints(tmp_path, ("diff_v2",))
    if plan == "observers":
        (tmp_path / "observers.yaml").write_text(OBSERVERS_PLAN)
        plan = str(tmp_path / "observers.yaml")
    argv = [
        "quantize",
        path,
        "--plan",
        plan,
        "--calib-data",
        data,
        "--calib-tokens",
        "128",
        "--seq-len",
        "32",
    ]
    cpu, cuda = _both(tmp_path, [*argv, "--eval-tokens", "64"])
    assert _same_run(cuda, cpu) and "quant_report.json" in cpu


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "plans"),
    [
        ("bpb:data={data},tokens=64,seq_len=32,intervene=mean", ["w8a8"]),
        ("ppl:data={data},tokens=96,seq_len=48,decode=20", ["kv2-g8-r8", "w4a8-quarot"]),
        ("retrieval:needles=1,queries=1,depths=[50],samples_per_depth=1,context_bytes=20", ["kv2-g8-r8"]),
        ("mc:path={mc}", ["w8a8-smoothquant"]),
        ("lmeval:tasks=lambada_local,path={lambada},limit=3,num_fewshot=0", ["w8a8"]),
    ],
)
def test_eval_command_on_cuda(tmp_path, torch_paths, monkeypatch, task, plans):
    """`diffquant eval --device cuda` on every task type (perplexity with an intervention, decode through a
    quantized KV cache, needle retrieval, multiple choice, the lm-eval adapter): the CPU run's cells."""
    if task.startswith("lmeval"):
        pytest.importorskip("lm_eval")
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    lambada = Path(__file__).parent / "data" / "lmeval" / "lambada.jsonl"
    paths, data = _checkpoints(tmp_path, ("diff_v1", "sink"), max_seq_len=160)
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"ctx": "The cat sat on the", "endings": ["mat.", "moon."], "label": 0},
                {"ctx": "def f(x): return", "endings": ["x * 2", "the magic"], "label": 0},
            )
        )
    )
    calib = ["--calib-data", data, "--calib-tokens", "64", "--calib-seq-len", "32"]
    argv = [
        "eval",
        *paths,
        "--task",
        task.format(data=data, mc=mc, lambada=lambada),
        "--plan",
        *plans,
        *calib,
    ]
    cpu, cuda = _both(tmp_path, argv)
    assert _same_run(cuda, cpu) and cpu["cells-rank0.jsonl"]


@pytest.mark.slow
def test_streamed_quantize_and_eval_on_cuda(tmp_path, torch_paths, monkeypatch):
    """Streamed runs (`--stream on`: one decoder layer at a time on the device): GPTQ's quantize and a sweep
    with plans give the CPU run's artifacts."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    (path,), data = _checkpoints(tmp_path, ("diff_v1",))
    calib = ["--calib-data", data, "--calib-tokens", "128"]
    argv = ["quantize", path, "--plan", "w4a8-gptq", *calib, "--seq-len", "32", "--eval-tokens", "64"]
    cpu, cuda = _both(tmp_path / "quantize", [*argv, "--stream", "on"])
    assert _same_run(cuda, cpu) and "quant_report.json" in cpu
    task = f"bpb:data={data},tokens=128,seq_len=32"
    argv = ["eval", path, "--task", task, "--plan", "w8a8", "w4a8-gptq", *calib, "--calib-seq-len", "32"]
    cpu, cuda = _both(tmp_path / "eval", [*argv, "--stream", "on"])
    assert _same_run(cuda, cpu) and cpu["cells-rank0.jsonl"]


MIXED_MAP = "{embed: 0, layers.0: 0, layers.1: cpu, norm: cpu, lm_head: 0}"


@pytest.mark.slow
def test_device_mapped_profile_and_eval_on_cuda(tmp_path, torch_paths, monkeypatch):
    """`--device-map` with the embedding and the first block on cuda:0 and the rest on the CPU (accelerate runs
    those on the GPU, moving their weights in): profile and a decode-mode eval through a quantized KV cache
    give the CPU run's artifacts."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    paths, data = _checkpoints(tmp_path, ("diff_v2",))
    argv = ["profile", *paths, "--data", data, "--tokens", "64", "--seq-len", "32"]
    cpu, cuda = _both(tmp_path / "profile", argv, ("--device-map", MIXED_MAP))
    assert _same_run(cuda, cpu) and "table5.json" in cpu
    task = f"ppl:data={data},tokens=96,seq_len=48,decode=20"
    argv = ["eval", *paths, "--task", task, "--plan", "kv2-g8-r8", "w8a8"]
    cpu, cuda = _both(tmp_path / "eval", argv, ("--device-map", MIXED_MAP))
    assert _same_run(cuda, cpu) and cpu["cells-rank0.jsonl"]


def _blocks_see(monkeypatch):
    """The device types of the hidden states every decoder block ran on (a spy on ``Block.forward``): a
    command that ignored its device would still give the CPU's numbers."""
    from diffquant.models.transformer import Block

    seen, forward = set(), Block.forward

    def spy(self, x, *args, **kwargs):
        seen.add(x.device.type)
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", spy)
    return seen


@pytest.mark.slow
def test_run_recipe_on_cuda(tmp_path, torch_paths, monkeypatch):
    """`diffquant run` of a recipe with ``device: cuda``, the GPU kit's study in small (analysis/gpu/kit_trio.py
    ::study_recipe): Table 5 with sink rates, the attention-logit / W8A8 / W4A8 sweep on bpb and retrieval and
    the report give the CPU run's artifacts, every block on the device. Figures are off: they are drawn from
    these artifacts alone, no tensor of the run (two runs of 21 figures took 13 s of this test's 20)."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    seen = _blocks_see(monkeypatch)
    kinds = ("baseline", "diff_v1", "diff_v2")
    models = {}
    for kind in kinds:  # ffn 64: groups of 32 (W4A8) divide every Linear
        save_checkpoint(tiny_model(kind, vocab_size=259, max_seq_len=160, ffn_dim=64), tmp_path / kind)
        models[kind] = str(tmp_path / kind)
    _, data = _checkpoints(tmp_path, ())
    states = []
    for cuda in (False, True):
        out = tmp_path / ("cuda" if cuda else "cpu")
        recipe = {
            "name": "trio",
            "models": models,
            "device": "cuda" if cuda else "cpu",
            "dtype": "float32",
            "data": {"calib": {"source": data, "tokens": 64, "seq_len": 32}},
            "profile": {"data": data, "tokens": 64, "seq_len": 32, "sink_rate": True},
            "eval": {
                "tasks": [
                    {"type": "bpb", "data": data, "tokens": 64, "seq_len": 32},
                    {
                        "type": "retrieval",
                        "needles": 1,
                        "queries": 1,
                        "depths": [50],
                        "samples_per_depth": 1,
                        "context_bytes": 20,
                        "seed": 7,
                    },
                ]
            },
            "sweep": {"plans": ["attn-logits-int4", "w8a8", "w4a8"]},
            "plots": {"enabled": False},
            "output": {"dir": str(out)},
        }
        (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
        seen.clear()
        with _as_cuda(cuda, ()):
            assert main(["run", str(tmp_path / "recipe.yaml")]) == 0
        assert seen == {"cuda" if cuda else "cpu"}
        state = _run_folder_state(out)
        # what names the folder: the run's own paths (the report and the manifest hold them)
        state = {k: v for k, v in state.items() if not k.startswith(("report.", "manifest"))}
        states.append(state)
        assert json.loads((out / "manifest.json").read_text())["recipe"]["device"] == recipe["device"]
    cpu, cuda = states
    assert _same_run(cuda, cpu) and "table5.json" in cpu and "sweep/results.json" in cpu


@pytest.mark.slow
def test_act_scales_and_quantized_exports_on_cuda(tmp_path, torch_paths, monkeypatch):
    """`diffquant act-scales --device cuda` (written as CPU tensors, loadable without a GPU) and `diffquant
    export --device cuda` of a GPTQ-quantized checkpoint as compressed-tensors and GPTQ: the CPU run's files,
    byte for byte."""
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    seen = _blocks_see(monkeypatch)
    (path,), data = _checkpoints(tmp_path, ("baseline",))
    calib = ["--calib-data", data, "--calib-tokens", "64", "--seq-len", "32"]
    files = []
    for cuda in (False, True):
        out = tmp_path / ("cuda" if cuda else "cpu")
        seen.clear()
        with _as_cuda(cuda, ("--device", "cuda")) as where:
            argv = ["act-scales", path, "--data", data, "--tokens", "64", "--seq-len", "32"]
            assert main([*argv, "--out", str(out / "act.pt"), *where]) == 0
            argv = ["quantize", path, "--plan", "w4a16-gptq-g32", *calib, "--out", str(out / "q")]
            assert main([*argv, *where]) == 0
            for to in ("gptq", "compressed-tensors"):
                assert main(["export", str(out / "q"), str(out / to), "--to", to, *where]) == 0
        assert seen == {"cuda" if cuda else "cpu"}
        scales = torch.load(out / "act.pt")
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in scales.values())
        files.append(
            {
                str(f.relative_to(out)): f.read_bytes()
                for f in sorted(out.rglob("*"))
                if f.is_file() and f.parent.name in ("gptq", "compressed-tensors")
            }
        )
        files[-1]["act"] = {k: v.tolist() for k, v in scales.items()}
    cpu, cuda = files
    assert (
        _same_run(cuda, cpu)
        and "gptq/model.safetensors" in cpu
        and "compressed-tensors/model.safetensors" in cpu
    )


@pytest.mark.parametrize("kind", ["diff_v2", "gated"])
def test_train_on_cuda(tmp_path, monkeypatch, kind):
    """`diffquant train` with ``device: cuda``: batches, bf16 autocast, the loss, logging, validation bpb,
    checkpoints, resume and the final export and card run with the model on the device. The backward pass
    is not checked (autograd asks a real CUDA device for a stream: here it is a no-op, so no gradient and
    no optimizer update happen)."""
    from test_train import _cfg

    from diffquant.train.trainer import train

    cfg = _cfg(tmp_path, "cuda", kind=kind, device="cuda", steps=4, eval_every=2, checkpoint_every=2)
    with fake_cuda():
        monkeypatch.setattr(torch.Tensor, "backward", lambda self, *args, **kwargs: None)
        train(cfg, stop_after=3, log=lambda message: None)
        out = train(cfg, resume=True, log=lambda message: None)
    card = json.loads((out / "final" / "card.json").read_text())
    log = (out / "log.csv").read_text().splitlines()
    assert card["steps"] == 4 and math.isfinite(card["val_bpb"]) and len(log) == 5  # header + 4 steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000003"]


# ------------------------------------------------------------------------------------------ host syncs
def test_the_sync_check_sees_what_makes_the_host_wait():
    """What CUDA makes the host wait for (torch.cuda.set_sync_debug_mode's list) is recorded; what it queues
    is not."""
    with fake_cuda():
        x = torch.arange(6.0, device="cuda")
        host = torch.arange(6.0)
        waits = [
            lambda: x[2].item(),
            lambda: float(x.sum()),
            lambda: bool(x[1] > 0),
            lambda: x.tolist(),
            lambda: x.nonzero(),
            lambda: x[x > 2],
            lambda: torch.equal(x, x),
            lambda: x.cpu(),
            lambda: host.to("cuda"),  # pageable and blocking
            lambda: host.to("cuda", non_blocking=True),  # pageable: the host stages it
            lambda: torch.tensor([1.0, 2.0], device="cuda"),
            lambda: x.clone().copy_(host),
        ]
        for wait in waits:
            with host_syncs() as syncs:
                wait()
            assert len(syncs) == 1, (syncs, wait)
        pinned = host.pin_memory()
        assert pinned.is_pinned() and not host.is_pinned()
        queued = [
            lambda: x * torch.tensor(2.0),  # a CPU scalar is a kernel argument
            lambda: torch.zeros(3, device="cuda"),
            lambda: x.to("cuda"),
            lambda: pinned.to("cuda", non_blocking=True),
            lambda: x.to("cpu", non_blocking=True),
            lambda: torch.where(x > 2, x, 0.0),
            lambda: x.masked_fill(x > 2, 0.0),
        ]
        with host_syncs() as syncs:
            for op in queued:
                op()
        assert syncs == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forward_of_every_kind_makes_no_host_sync(dtype):
    """A forward pass and a decode step with the KV cache (plain, and int4 in groups of 8) only queue work:
    a wait inside them (a scalar read, a blocking copy) would stall the GPU in every layer of every step."""
    from diffquant.quant import apply_plan, preset

    ids = _windows(2, 24)
    models = [(kind, tiny_model(kind)) for kind in ALL_KINDS]
    quantized_cache = tiny_model("diff_v2")
    apply_plan(quantized_cache, preset("kv4-g8"))
    models.append(("diff_v2 kv4-g8", quantized_cache))
    models.append(("baseline, scaled embedding", tiny_model("baseline", embed_scale=8.0)))  # Gemma's
    with fake_cuda(), torch.no_grad():
        for name, model in models:
            model.eval().to("cuda", dtype)
            x = ids.to("cuda")
            cache = model.new_cache()
            with host_syncs() as syncs:
                model(x)
                model(x[:, :-2], cache)
                model(x[:, -2:-1], cache)
                model(x[:, -1:], cache)
            assert syncs == [], (name, syncs)


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_the_fused_kernel_makes_no_host_sync(kind):
    """The Triton kernel's path (int8 Q/K with K smoothing, fp8 P*V, static int8 logits: every operand it
    prepares) only queues work once its per-layer setup is built; the first call checks the layer's logit
    scales on the host (one read per layer), later ones reuse that check."""
    from diffquant.kernels.dispatch import path_summary
    from diffquant.quant import QuantPlan, apply_plan, calibrate
    from diffquant.quant.presets import preset_data

    logits = {"format": "int8", "granularity": "head", "calibration": "absmax"}
    rules = [*preset_data("qk-int8-pv-fp8")["rules"], {"sites": "kind:logits", "scheme": logits}]
    model = tiny_model(kind, head_dim=16)
    apply_plan(model, QuantPlan.from_dict({"rules": rules}))
    calibrate(model, _windows(2, 32, seed=5))
    ids = _windows(2, 32)
    with torch.no_grad(), fake_cuda():
        model.to("cuda")
        x = ids.to("cuda")
        with host_syncs() as first:
            model(x)
        with host_syncs() as later:
            model(x)
        ran = path_summary(model)
        model.to("cpu")
    layers = model.config.n_layers
    assert ran == {"triton": layers}
    assert first == ["a scalar read (.item() / float / int / bool)"] * layers and later == []


def test_a_training_step_makes_no_host_sync_and_a_log_row_one():
    """The trainer's step (batch transfer, bf16 autocast forward, loss, clipping, fused AdamW) only queues
    work, so the host builds the next batch while the GPU runs this one: a blocking copy of the batch or a
    ``float(grad_norm)`` per step made every step wait. A log row reads its scalars (loss, gradient norm,
    DIFF V2's lambda mean and spread per layer and head) in one transfer. Backward is a stand-in that sets
    every gradient to ones (a CPU build cannot record autograd on CUDA tensors); the clipping and AdamW
    run for real on them."""
    from diffquant.train import trainer

    model = tiny_model("diff_v2").train()
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(0))
    with fake_cuda():
        model.to("cuda")
        device = torch.device("cuda")
        optimizer = trainer.adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        handles = trainer._watch_lambda(model)
        before = [real(p).clone() for p in model.parameters()]

        def backward(self, *args, **kwargs):
            for p in model.parameters():
                p.grad = torch.ones_like(p)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "backward", backward)
            with host_syncs() as syncs:
                for _ in range(2):
                    batch = trainer.batch_to(ids, device)
                    autocast = trainer.forward_precision("auto", device)
                    loss, grad_norm = trainer.train_step(model, model, optimizer, autocast, batch, 0, 1.0)
        assert syncs == []
        assert loss.is_cuda and grad_norm.is_cuda and optimizer.defaults["fused"]
        assert all(not torch.equal(b, real(p)) for b, p in zip(before, model.parameters(), strict=True))
        with host_syncs() as syncs:
            row = trainer.host_scalars(
                {"loss": loss, "grad_norm": grad_norm, **trainer._lambda_columns(model)}
            )
        for h in handles:
            h.remove()
    heads, layers = model.config.n_heads, model.config.n_layers
    assert syncs == [".tolist()"] and len(row) == 2 + 2 * heads * layers
    # every parameter's gradient is ones: the norm before clipping is sqrt(number of parameters)
    count = sum(p.numel() for p in model.parameters())
    assert row["grad_norm"] == pytest.approx(math.sqrt(count), rel=1e-6)


def test_a_checkpoint_pause_starts_once_the_queued_steps_are_done(tmp_path):
    """Saving a checkpoint between log rows waits for the GPU's queued steps: the pause left out of tokens/s
    must start after that wait (a device synchronize before its clock read), or the steps' own time would
    count as pause."""
    from test_train import _cfg

    from diffquant.train import trainer

    events = []
    save, clock = trainer._save_state, trainer._clock
    cfg = _cfg(tmp_path, "cuda", device="cuda", steps=3, log_every=100, eval_every=100, checkpoint_every=2)
    with fake_cuda(), pytest.MonkeyPatch.context() as patch:  # undone before fake_cuda restores torch.cuda
        patch.setattr(torch.Tensor, "backward", lambda self, *args, **kwargs: None)
        patch.setattr(torch.cuda, "synchronize", lambda *args: events.append("synchronize"))
        patch.setattr(trainer, "_clock", lambda: events.append("clock") or clock())
        patch.setattr(trainer, "_save_state", lambda *args: events.append("save") or save(*args))
        trainer.train(cfg, log=lambda message: None)
    at = events.index("save")
    assert events[at - 2 : at] == ["synchronize", "clock"], events


def test_devicecheck_leaves_torch_as_it_was():
    before = (torch.cuda.is_available, torch.cuda._lazy_init, native.pass1, stats.native.pass1)
    available = torch.cuda.is_available()
    with fake_cuda():
        assert torch.cuda.is_available() and native.pass1 is not before[2]
    assert (torch.cuda.is_available, torch.cuda._lazy_init, native.pass1, stats.native.pass1) == before
    assert torch.cuda.is_available() == available
    assert not torch.__future__.get_swap_module_params_on_conversion()
    with fake_cuda():
        stats._histogram(torch.ones(4, device="cuda"), None)
        assert any(isinstance(t, FakeCuda) for t in stats._FOLDS.values())
    assert not any(isinstance(t, FakeCuda) for t in stats._FOLDS.values())


def test_sink_pads_its_head_to_a_multiple_of_8_on_cuda(monkeypatch):
    """The sink kind's SDPA call (its sink as one extra key through one extra channel, issue 46): in bf16 on
    CUDA the head is zero-padded to a multiple of 8, the width SDPA's memory-efficient kernel needs for
    16-bit inputs (d + 1 sent it to the math kernel); on the CPU, and in fp32 on CUDA, it stays d + 1 (so the
    device check's fp32 runs equal the CPU's bit for bit). The padded channels are zeros: the logits equal
    the CPU's up to the summation order."""
    import torch.nn.functional as F

    from diffquant.models import attention

    widths = []
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        widths.append((q.is_cuda, q.dtype, q.shape[-1], k.shape[-1]))
        return original(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    model = tiny_model("sink").eval()
    d = model.config.head_dim
    padded = -(-(d + 1) // 8) * 8
    assert padded != d + 1  # the tiny model's head width shows the padding
    ids = _windows(2, 20)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            widths.clear()
            cpu = model(ids)
            with fake_cuda():
                model.to("cuda")
                cuda = real(model(ids.to("cuda")))
                model.to("cpu")
            assert {w[2:] for w in widths if not w[0]} == {(d + 1, d + 1)}
            want = padded if dtype == torch.bfloat16 else d + 1
            assert {w[2:] for w in widths if w[0]} == {(want, want)}, dtype
            # (a "cuda" tensor on a CPU build takes SDPA's math kernel, the CPU run its flash kernel)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(cuda.float(), cpu.float(), rtol=tol, atol=tol)


def test_the_error_report_moves_each_sites_sums_once():
    """``quantize``'s error report (every site of a W8A8 DIFF V2 against the float model, and the logits): each
    site's six float64 sums and its counts reach the host in one transfer per batch, and nothing else is
    read: the values left out are zeroed on the device, not selected. Seven scalar reads per site and batch
    at first, then two (the finite check) or three (an attention map's masked selection). The report is the
    CPU's (counts exactly; the metrics up to SDPA's kernel: a "cuda" tensor on a CPU build takes its math
    kernel, the CPU run its flash kernel)."""
    from diffquant.io.quantize import quantized_copy
    from diffquant.quant import apply_plan, calibrate, preset
    from diffquant.quant.report import ErrorStats, compare_models

    reference = tiny_model("diff_v2")
    reference.tokenizer = None
    quantized = quantized_copy(reference, preset("w8a8"))
    apply_plan(quantized, preset("w8a8"))
    calibrate(quantized, _windows(2, 24, seed=3))
    ids = _windows(4, 24)
    want = compare_models(reference, quantized, ids, batch_size=2)
    updates = []
    update = ErrorStats.update
    with torch.no_grad(), fake_cuda(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(ErrorStats, "update", lambda self, *a: updates.append(a[2:]) or update(self, *a))
        reference.to("cuda")
        quantized.to("cuda")
        x = ids.to("cuda")
        with host_syncs() as syncs:
            got = compare_models(reference, quantized, x, batch_size=2)
        reference.to("cpu")
        quantized.to("cpu")
    masked = sum(1 for a in updates if a and a[0] is not None)
    assert len(updates) > 2 * 20 and masked > 0
    assert syncs.count(".tolist()") == len(updates)
    assert len(syncs) == len(updates), syncs
    assert got.keys() == want.keys()
    for site, row in want.items():
        assert {k: v for k, v in got[site].items() if type(v) is not float} == {
            k: v for k, v in row.items() if type(v) is not float
        }, site
        assert got[site] == pytest.approx(row, rel=1e-5), site


def test_error_stats_leave_out_what_they_must_on_cuda_as_on_the_cpu():
    """The error report's zeroed values on a GPU against the CPU's selected ones: masked positions and
    values not finite in either model are left out of every sum and counted the same (NaN and Inf in
    either model, a mask), in one read per update."""
    from diffquant.quant.report import ErrorStats

    g = torch.Generator().manual_seed(8)
    ref = torch.randn(2, 3, 5, 5, generator=g)
    quant = ref + 0.01 * torch.randn(2, 3, 5, 5, generator=g)
    ref[0, 1, 2, 1], quant[1, 2, 1, 3], quant[0, 0, 3, 0] = math.nan, math.inf, -math.inf  # one masked
    valid = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    cases = [(ref, quant, valid), (ref, quant, None), (ref[1, 0], quant[1, 0], None)]
    cpu = []
    for r, q, v in cases:
        s = ErrorStats()
        s.update(r, q, v)
        cpu.append(s)
    with fake_cuda():
        for (r, q, v), want in zip(cases, cpu, strict=True):
            s = ErrorStats()
            with host_syncs() as syncs:
                s.update(r.to("cuda"), q.to("cuda"), None if v is None else v.to("cuda"))
            assert [x for x in syncs if not x.startswith("host-to-device")] == [".tolist()"]
            assert (s.n, s.nonfinite) == (want.n, want.nonfinite)
            assert s.summary() == pytest.approx(want.summary(), rel=1e-12)
    assert [(s.n, s.nonfinite) for s in cpu] == [(2 * 3 * 15 - 2, 2), (2 * 3 * 25 - 3, 3), (25, 0)]


def test_scoring_reads_a_window_batch_once_on_cuda(torch_paths, monkeypatch):
    """Decode perplexity (one token per forward through the cache) and the sliced LM head keep each step's
    or slice's log-probabilities on the device and move them once per batch of windows: the targets are
    known, so no step needs the last one's result (a read per decode step before: 54 of a tiny decode eval's
    62 waits). The numbers are the CPU's, bit for bit."""
    from diffquant.data import scoring
    from diffquant.eval.perplexity import decode_logprobs, target_logprobs

    model = tiny_model("diff_v2")
    ids = _windows(2, 20)
    row = 2 * 4 * model.config.vocab_size
    with torch.no_grad():
        cpu_decode = decode_logprobs(model, ids, 6)
        with monkeypatch.context() as patch:
            patch.setattr(scoring, "LOGITS_WHOLE_BYTES", row * 19 - 1)
            patch.setattr(scoring, "LOGITS_SLICE_BYTES", row * 4)
            cpu_sliced = target_logprobs(model, ids)
        with fake_cuda():
            model.to("cuda")
            x = ids.to("cuda")
            with host_syncs() as syncs:
                decode = decode_logprobs(model, x, 6)
            assert [s for s in syncs if s.startswith("device-to-host")] == [syncs[-1]], syncs
            monkeypatch.setattr(scoring, "LOGITS_WHOLE_BYTES", row * 19 - 1)
            monkeypatch.setattr(scoring, "LOGITS_SLICE_BYTES", row * 4)
            with host_syncs() as syncs:
                sliced = target_logprobs(model, x)
            assert len([s for s in syncs if s.startswith("device-to-host")]) == 1, syncs
            model.to("cpu")
    assert decode.device.type == "cpu" and torch.equal(decode, cpu_decode) and decode.shape == (2, 19)
    assert torch.equal(sliced, cpu_sliced)


def test_retrieval_scores_its_candidates_in_one_read_per_chunk(torch_paths, monkeypatch):
    """Needle retrieval's candidate scores on CUDA: the first tokens' scores in one read, then per chunk of
    candidates one copy of their token ids and one read of their sums (a copy and a read per candidate
    before); the scores are the CPU's, bit for bit."""
    from diffquant.eval import retrieval

    model = tiny_model("diff_v2", vocab_size=259, max_seq_len=512, seed=1)
    cfg = retrieval.RetrievalConfig(
        n_needles=3, n_queries=2, depths=(50,), samples_per_depth=2, context_bytes=120
    )
    samples = retrieval.make_samples(cfg)
    cpu, _ = retrieval.score_samples(model, samples, batch_size=2, attention=False)
    seen = []
    scores = retrieval._candidate_scores

    def counted(*args):
        with host_syncs() as syncs:
            out = scores(*args)
        seen.append((len(args[4]) * len(args[4][0]), args[5], syncs))
        return out

    monkeypatch.setattr(retrieval, "_candidate_scores", counted)
    with fake_cuda():
        model.to("cuda")
        cuda, _ = retrieval.score_samples(model, samples, batch_size=2, attention=False)
        model.to("cpu")
    assert [s.scores for s in cuda] == [s.scores for s in cpu]
    for n, batch, syncs in seen:
        chunks = -(-n // batch)
        assert n > batch and syncs.count(".tolist()") == 1 + chunks, syncs
        assert sum(x.startswith("host-to-device") for x in syncs) == 1 + chunks, syncs
        assert len(syncs) == 2 * (1 + chunks) + chunks, syncs  # and each chunk's rows (an index list)


def test_an_attention_metric_is_read_in_one_transfer_until_it_changes(torch_paths):
    """A metric's sums and counts reach the host together: ``to_dict`` and ``summary`` read once (a read
    per field before: seven for a map's), and again after the next update; the values are the CPU's."""
    g = torch.Generator().manual_seed(9)
    valid = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    maps = [
        torch.softmax(torch.randn(2, 3, 5, 5, generator=g).masked_fill(~valid, -math.inf), -1)
        for _ in range(2)
    ]
    cpu = attention_metrics.MapStats(3)
    cpu.update(maps[0], valid)
    first = (cpu.to_dict(), cpu.summary())
    cpu.update(maps[1], valid)
    with fake_cuda():
        m = attention_metrics.MapStats(3)
        m.update(maps[0].to("cuda"), valid.to("cuda"))
        with host_syncs() as syncs:
            got = (m.to_dict(), m.summary(), m.to_dict())
        assert syncs == ["device-to-host copy (blocking) of (7, 3)"] and got[:2] == first and got[2] == got[0]
        m.update(maps[1].to("cuda"), valid.to("cuda"))
        with host_syncs() as syncs:
            assert m.to_dict() == cpu.to_dict() and m.summary() == cpu.summary()
        assert len(syncs) == 1
    assert isinstance(first[0]["rows"][0], int) and isinstance(first[0]["entropy_sum"][0], float)


def test_query_positions_are_read_once_per_mask(monkeypatch):
    """A mask's query positions reach the host once per view place: again for the same rows of the same
    mask (another view object: each layer slices its own) costs no read; other rows, another mask, or the
    mask changed in place are read afresh; each caller gets its own list. The sink rate and span mass
    metrics and the site statistics read them so (a read per tap, layer and batch before)."""
    from diffquant.models import sites

    monkeypatch.setattr(sites, "_last_read", None)
    with fake_cuda():
        whole = torch.ones(8, 8, dtype=torch.bool, device="cuda").tril()[None, None]
        with host_syncs() as syncs:
            first = sites.read_query_positions(whole[:, :, 0:4])
            again = sites.read_query_positions(whole[:, :, 0:4])
        assert first == again == [0, 1, 2, 3] and len(syncs) == 1
        again.append(99)  # the caller's own list, also when it was kept
        assert sites.read_query_positions(whole[:, :, 0:4]) == [0, 1, 2, 3]
        with host_syncs() as syncs:
            later = sites.read_query_positions(whole[:, :, 4:8])
        assert later == [4, 5, 6, 7] and len(syncs) == 1
        whole[..., 7, :] = False
        whole[..., 7, 5] = True  # the last row now sees keys up to 5
        with host_syncs() as syncs:
            changed = sites.read_query_positions(whole[:, :, 4:8])
        assert changed == [4, 5, 6, 5] and len(syncs) == 1


def _update_syncs(monkeypatch, bundled: bool) -> list[tuple[str, bool, list[str]]]:
    """(kind, masked, host syncs) of every SiteStats.update of a DIFF V2 profile on CUDA (torch paths)."""
    monkeypatch.setattr(stats, "BUNDLED", bundled)
    monkeypatch.setattr(model_attention, "_MASKS", {})  # masks kept from earlier tests would not be read
    monkeypatch.setattr(stats, "_last_mask", None)
    seen = []
    update = stats.SiteStats.update

    def counted(self, x, valid=None, *args, **kwargs):
        with host_syncs() as syncs:
            update(self, x, valid, *args, **kwargs)
        seen.append((self.kind, valid is not None, [s for s in syncs if not s.startswith("host-to-device")]))

    monkeypatch.setattr(stats.SiteStats, "update", counted)
    _profile_diff_v2_on_cuda(24)
    monkeypatch.setattr(stats.SiteStats, "update", update)
    return seen


def test_a_profile_update_reads_its_small_results_in_one_transfer(torch_paths, monkeypatch):
    """On CUDA each site's update computes its small results (extremes, moments, token kurtosis, histogram,
    abs-max and squares per channel, and the top-k entries, found with packed keys) on the device and reads
    them in one transfer: one wait per site and update. Counted here on a DIFF V2 profile: the gathered
    attention maps also read their mask's visible positions and query positions, once per mask: a layer's
    five map taps share it, and the model keeps one mask per shape for all its layers and batches (two
    reads per layer and batch before). About ten waits per site and update before, one read at a time; then
    four (the top-k's two data-sized selections and the entries' read). The profile is the CPU's
    (test_profile_on_cuda_equals_the_cpu_profile)."""
    bundled = _update_syncs(monkeypatch, True)
    mask_reads = ["nonzero", ".tolist()"]
    for kind, masked, syncs in bundled:
        assert sum(s.startswith("device-to-host") for s in syncs) == 1, (kind, syncs)
        rest = [s for s in syncs if not s.startswith("device-to-host")]
        assert rest == [] or (masked and rest == mask_reads), (kind, syncs)
    maps = [syncs for _, masked, syncs in bundled if masked]
    layers, batches = 2, 2  # _profile_diff_v2_on_cuda: tiny_model's 2 layers, 4 windows in batches of 2
    assert len(maps) == 5 * layers * batches
    assert sum(s.count("nonzero") for s in maps) == 1  # every window has one length: one mask
    assert stats._last_mask is None  # the profiler, removed, dropped what it read off the kept mask
    one_by_one = _update_syncs(monkeypatch, False)
    assert len(one_by_one) == len(bundled) > 60 and any(masked for _, masked, _ in bundled)
    before = sum(len(s) for *_, s in one_by_one)
    after = sum(len(s) for *_, s in bundled)
    assert after < 0.6 * before, (before, after)


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_attention_metrics_and_the_lambda_site_make_no_wait_of_their_own(torch_paths, monkeypatch, kind):
    """In a DIFF profile on CUDA the attention metrics' updates read nothing: a map's non-finite rows are told
    apart on the device, DIFF V1's scalar lambda stays there (``float(lam)`` was a wait per layer and batch),
    and the lambda site's update is its one transfer (its one-entry row is exact without the float64 redo,
    which read twice more). Three waits per map tap and DIFF V1 layer and batch, before. The metrics are
    the CPU's (test_profile_on_cuda_equals_the_cpu_profile)."""
    seen: dict[str, list[list[str]]] = {}

    def counting(cls):
        update = cls.update

        def counted(self, *args, **kwargs):
            with host_syncs() as syncs:
                update(self, *args, **kwargs)
            name = cls.__name__
            if cls is stats.SiteStats:
                if args[0].dim() != 0 and not (args[0].dim() == 3 and self.kind == "lambda"):
                    return
                name = "lambda site"
            seen.setdefault(name, []).append(list(syncs))

        monkeypatch.setattr(cls, "update", counted)

    metrics = [attention_metrics.MapStats, attention_metrics.DiffMapStats, attention_metrics.LambdaStats]
    for cls in [*metrics, stats.SiteStats]:
        counting(cls)
    _profile_diff_v2_on_cuda(16, kind)
    layers, batches = 2, 2
    assert {k: len(v) for k, v in seen.items()} == {
        "MapStats": 2 * layers * batches,  # the two maps of each layer
        "DiffMapStats": layers * batches,
        "LambdaStats": layers * batches,
        "lambda site": layers * batches,
    }
    for name in ("MapStats", "DiffMapStats", "LambdaStats"):
        assert all(syncs == [] for syncs in seen[name]), (name, seen[name])
    for syncs in seen["lambda site"]:
        assert len(syncs) == 1 and syncs[0].startswith("device-to-host"), syncs


def test_a_map_with_non_finite_rows_and_a_changing_lambda_read_nothing_on_cuda(torch_paths):
    """Maps with NaN / Inf rows, a negative probability and a sum past float32, and DIFF V1 lambdas with a
    NaN among them, on CUDA: no update waits, and the state is the CPU's."""
    g = torch.Generator().manual_seed(6)
    valid = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    probs = torch.softmax(torch.randn(2, 3, 6, 6, generator=g).masked_fill(~valid, -math.inf), -1)
    probs[0, 1, 4, 2], probs[1, 0, 5, 5], probs[1, 2, 3, 0] = math.nan, -0.5, 3e38
    diff = probs - 0.5 * torch.softmax(torch.randn(2, 3, 6, 6, generator=g), -1) * valid
    lams = [torch.tensor(v) for v in (0.2, -0.7, 0.1, math.nan)]

    def _metrics():
        return (
            attention_metrics.MapStats(3),
            attention_metrics.DiffMapStats(3),
            attention_metrics.LambdaStats(),
        )

    def run(device):
        m, d, lam = _metrics()
        m.update(probs.to(device), valid.to(device))
        d.update(diff.to(device), valid.to(device))
        for x in lams:
            lam.update(x.to(device))
        return m, d, lam

    cpu = [a.to_dict() for a in run("cpu")]
    with fake_cuda():
        data = [probs.to("cuda"), diff.to("cuda"), valid.to("cuda"), *(x.to("cuda") for x in lams)]
        m, d, lam = _metrics()
        with host_syncs() as syncs:
            m.update(data[0], data[2])
            d.update(data[1], data[2])
            for x in data[3:]:
                lam.update(x)
        assert syncs == []
        assert [a.to_dict() for a in (m, d, lam)] == cpu
    assert (cpu[2]["count"], cpu[2]["nonfinite"]) == (3, 1)
    assert (cpu[2]["value"], cpu[2]["min"], cpu[2]["max"]) == tuple(float(lams[i]) for i in (2, 1, 0))
    assert cpu[0]["nonfinite_rows"] == [1, 1, 1]  # NaN (head 1), negative (head 0), p log p past float32 (2)
