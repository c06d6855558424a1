"""The Profiler on real models: read-only hooks, exact statistics, sharding, the CLI."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import assert_close_tree, tiny_model

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.io import save_checkpoint
from diffquant.profile import Profile, Profiler, profile_model, table5


def _windows(n=4, t=24, seed=0):
    return torch.randint(0, 61, (n, t), generator=torch.Generator().manual_seed(seed))


def _all_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_logits_bit_identical_and_no_hook_survives(any_kind):
    model = tiny_model(any_kind)
    ids = _windows()
    with torch.no_grad():
        plain = model(ids)
        with Profiler(model, sites="*") as prof:
            profiled = model(ids)
            assert _all_hooks(model) > 0
    assert torch.equal(plain, profiled)
    assert _all_hooks(model) == 0
    assert prof.result().meta["tokens"] == ids.numel()


def test_hooks_removed_on_exception():
    model = tiny_model("diff_v1")
    with pytest.raises(DiffquantError), Profiler(model, sites=["kind:logits", "kind:resid"]):
        model(torch.zeros(1, 500, dtype=torch.long))  # longer than max_seq_len
    assert _all_hooks(model) == 0


def test_site_stats_match_an_independent_capture(any_kind):
    model = tiny_model(any_kind, seed=2)
    ids = _windows(3, 17)
    captured = {}

    def keep(name):
        def hook(module, args, output):
            valid = args[1] if len(args) > 1 else None
            x = output.detach().double()
            if valid is not None:
                x = x[valid.expand_as(x)]
            captured.setdefault(name, []).append(x.flatten())

        return hook

    taps = model.taps(["kind:logits", "kind:resid", "kind:mlp_act"])
    handles = [tap.register_forward_hook(keep(name)) for name, tap in taps.items()]
    with torch.no_grad(), Profiler(model, sites=["kind:logits", "kind:resid", "kind:mlp_act"]) as prof:
        model(ids)
    for h in handles:
        h.remove()
    profile = prof.result()
    for name, parts in captured.items():
        x = torch.cat(parts)
        s = profile.sites[name].summary()
        assert s["count"] == x.numel()
        assert s["max"] == x.max().item() and s["min"] == x.min().item()
        assert s["top1"] == x.abs().max().item()
        assert s["mean"] == pytest.approx(x.mean().item(), rel=1e-6, abs=1e-12)
    pooled = torch.cat([torch.cat(v) for k, v in captured.items() if "logits" in k]).abs()
    row = table5(profile)["attention logits"]
    top = pooled.sort(descending=True).values
    assert [row["top1"], row["top2"], row["top3"], row["top10"]] == [
        top[0].item(),
        top[1].item(),
        top[2].item(),
        top[9].item(),
    ]
    median = pooled.sort().values[(pooled.numel() + 1) // 2 - 1].item()
    assert row["median"] == pytest.approx(median, rel=0.01)
    # hidden states = every layer output (resid taps), not the MLP activations also captured here
    hidden = torch.cat([torch.cat(v).reshape(-1) for k, v in captured.items() if k.endswith(".resid")]).abs()
    assert sum(k.endswith(".resid") for k in captured) == model.config.n_layers
    row = table5(profile)["hidden states"]
    top = hidden.sort(descending=True).values
    assert [row["top1"], row["top2"], row["top3"], row["top10"], row["top100"]] == [
        top[i].item() for i in (0, 1, 2, 9, 99)
    ]
    median = hidden.sort().values[(hidden.numel() + 1) // 2 - 1].item()
    assert row["median"] == pytest.approx(median, rel=0.0062)
    assert row["top1_at"]["site"].endswith(".resid")


def test_batching_does_not_change_the_profile():
    model = tiny_model("diff_v2")
    windows = _windows(6, 16)
    one = profile_model(model, windows, batch_size=6, sites="*")
    split = profile_model(model, windows, batch_size=2, sites="*")
    a, b = one.to_dict(), split.to_dict()
    for name in a["sites"]:
        sa, sb = one.sites[name].summary(), split.sites[name].summary()
        assert sa["top"] == sb["top"], name  # values and locations (sample indices are global)
        assert (sa["count"], sa["max"], sa["min"]) == (sb["count"], sb["max"], sb["min"])
        assert sa["std"] == pytest.approx(sb["std"], rel=1e-6)
    assert a["meta"]["samples"] == b["meta"]["samples"] == 6


def test_profile_json_round_trip(tmp_path):
    model = tiny_model("diff_v1")
    profile = profile_model(model, _windows(2, 12), sites="*")
    text = json.dumps(profile.to_dict())
    again = Profile.from_dict(json.loads(text))
    assert json.dumps(again.to_dict()) == text
    assert {t for t, _ in profile.attention.values()} == {"map", "diff_map", "lambda", "span"}


def test_attention_metrics_and_spans():
    model = tiny_model("diff_v2")
    ids = _windows(2, 20)
    with torch.no_grad(), Profiler(model, sites="kind:diff_map") as prof:
        prof.spans = [(3, 6, 19), (10, 12, 15)]
        model(ids)
    kind, span = prof.result().attention["layers.1.attn.span"]
    summary = span.summary()
    assert kind == "span" and summary["samples"] == 2


def _ckpts(tmp_path):
    paths = []
    for kind in ("baseline", "diff_v2"):
        path = tmp_path / kind
        save_checkpoint(tiny_model(kind, vocab_size=259, max_seq_len=64), path)
        paths.append(str(path))
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x * 2  # the magic number of Paris is 42\n" * 40)
    return paths, str(data)


def test_cli_profile_two_checkpoints(tmp_path, capsys):
    paths, data = _ckpts(tmp_path)
    out = tmp_path / "run"
    assert (
        main(["profile", *paths, "--data", data, "--tokens", "256", "--seq-len", "32", "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "attention logits" in text and "hidden states" in text
    assert "baseline" in text and "diff_v2" in text
    for name in ("baseline", "diff_v2"):
        assert Profile.load(out / "profile" / f"{name}.json").meta["tokens"] == 256
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"]["tokens"] == 256 and len(manifest["checkpoints"]["baseline"]["sha256"]) == 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sites", "layers.*.attn.nothing"], "matches no site; this model's site kinds: q, k, v"),
        (["--seq-len", "65"], "--seq-len 65 exceeds the max_seq_len 64"),
        (["--data", "EMPTY"], "no text found"),
        (["--tokens", "0"], "--tokens: expected an integer >= 1"),
    ],
)
def test_cli_profile_bad_input(tmp_path, capsys, extra, message):
    paths, data = _ckpts(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = [str(empty) if e == "EMPTY" else e for e in extra]
    args = [
        "profile",
        paths[0],
        "--data",
        data,
        "--tokens",
        "64",
        "--seq-len",
        "32",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_cli_profile_not_a_checkpoint(tmp_path, capsys):
    assert main(["profile", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "missing config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path):
    paths, data = _ckpts(tmp_path)
    common = [paths[1], "--data", data, "--tokens", "320", "--seq-len", "32", "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    assert main(["profile", *common, "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "diffquant.cli", "profile", *common, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one = Profile.load(tmp_path / "one/profile/diff_v2.json")
    two = Profile.load(tmp_path / "two/profile/diff_v2.json")
    assert one.meta["tokens"] == two.meta["tokens"] == 320
    for name, s1 in one.sites.items():
        a, b = s1.summary(), two.sites[name].summary()
        for key in ("count", "nan_count", "max", "min", "top", "count_abs_ge_6", "channel_absmax"):
            assert a[key] == b[key], (name, key)
        for key in ("mean", "std", "kurtosis"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), (name, key)
    for name, (_, acc) in one.attention.items():
        assert_close_tree(acc.summary(), two.attention[name][1].summary(), name)


def test_locations_under_cached_decoding_name_the_right_tokens():
    model = tiny_model("diff_v1")
    ids = _windows(2, 12)
    with torch.no_grad(), Profiler(model, sites="layers.1.resid", topk=200) as prof:
        cache = model.new_cache()
        model(ids[:, :5], cache)
        for i in range(5, 12):
            model(ids[:, i : i + 1], cache)
    profile = prof.result()
    top = profile.sites["layers.1.resid"].summary()["top"]
    assert {e["loc"]["pos"] for e in top} == set(range(12))
    for entry in top:
        loc = entry["loc"]
        assert loc["token"] == ids[loc["sample"], loc["pos"]].item()
    assert profile.meta["tokens"] == ids.numel() and profile.meta["samples"] == 2


def _plain_and_fast(monkeypatch, run):
    """``run()``'s result with the torch speed-ups on, and with them off (the general path); the native
    pass is off in both (its float64 sums differ in the last bits: test_native_profile_equals_the_torch_one)."""
    from diffquant.profile import attention_metrics, profiler, stats

    monkeypatch.setattr(stats, "NATIVE", False)
    monkeypatch.setattr(attention_metrics, "NATIVE", False)
    fast = run()
    monkeypatch.setattr(profiler, "FAST", False)
    monkeypatch.setattr(attention_metrics, "FAST", False)
    plain = run()
    return fast, plain


def test_speedups_leave_every_statistic_unchanged(kind, monkeypatch):
    """Shared-tensor reuse (q/k/v and gate/up inputs, mlp.act = down's input), one snapshot copy, the map
    metrics' finite fast paths: the profile's JSON is the one the general path writes, byte for byte."""
    model = tiny_model(kind)
    ids = _windows(n=6, t=40, seed=3)

    def run():
        with torch.no_grad(), Profiler(model, sites="*", topk=5, massive_cap=3) as prof:
            model(ids[:3])
            snapshot = prof.result()
            model(ids[3:])
        return json.dumps([snapshot.to_dict(), prof.result(note=1).to_dict()], sort_keys=True)

    fast, plain = _plain_and_fast(monkeypatch, run)
    assert fast == plain
    merged = json.loads(fast)[1]
    # each site still names itself in its locations
    for name, site in merged["sites"].items():
        assert all(e["loc"]["site"] == name for e in site["top"] + site["massive"])


def test_speedups_profile_model_and_merge_unchanged(monkeypatch):
    from diffquant.profile.profiler import merge_profiles

    model = tiny_model("diff_v2")
    ids = _windows(n=6, t=24, seed=5)

    def run():
        a = profile_model(model, ids[:4], batch_size=2, sites="*", topk=4)
        b = profile_model(model, ids[4:], batch_size=2, sites="*", topk=4)
        before = json.dumps(a.to_dict(), sort_keys=True)
        merged = merge_profiles([a, b])
        assert json.dumps(a.to_dict(), sort_keys=True) == before  # inputs untouched
        return json.dumps(merged.to_dict(), sort_keys=True)

    fast, plain = _plain_and_fast(monkeypatch, run)
    assert fast == plain


def _close_json(a, b, path=""):
    """Equal JSON trees, floats within 1e-6 relative (the native pass's float64 sums against the torch path's
    float32 ones) in the moment / sum fields only, every other value exact."""
    sums = ("moments", "token_kurtosis", "channel_sumsq", "_sum")
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        if path.endswith(".moments") and a.get("m3") is not None:
            # M3 is a signed sum that cancels: its rounding scales with sqrt(M2 M4) (Cauchy-Schwarz)
            assert abs(a["m3"] - b["m3"]) <= 1e-6 * math.sqrt(abs(a["m2"] * a["m4"])) + 1e-12, path
            a, b = {k: v for k, v in a.items() if k != "m3"}, {k: v for k, v in b.items() if k != "m3"}
        for k in a:
            _close_json(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close_json(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and any(s in path for s in sums):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), path
    else:
        assert a == b, path


def test_native_profile_equals_the_torch_one(kind, monkeypatch):
    """A whole profile (every site, maps, per-head metrics, two forwards) from the native passes against the
    torch path: every count, extreme, bin and located entry equal, the float sums within 1e-6."""
    from diffquant.profile import attention_metrics, stats

    model = tiny_model(kind)
    ids = _windows(n=6, t=40, seed=3)

    def run():
        with torch.no_grad(), Profiler(model, sites="*", topk=5, massive_cap=3) as prof:
            model(ids[:3])
            model(ids[3:])
        return prof.result().to_dict()

    native = run()
    monkeypatch.setattr(stats, "NATIVE", False)
    monkeypatch.setattr(attention_metrics, "NATIVE", False)
    _close_json(native, run())


def test_shared_tensor_taps_see_their_own_site(monkeypatch):
    """q/k/v_proj inputs are one tensor: their statistics agree except for the site named in locations."""
    model = tiny_model("baseline")
    with torch.no_grad(), Profiler(model, sites="kind:linear_in", topk=3) as prof:
        model(_windows())
    sites = prof.result().sites
    q, k = sites["layers.0.attn.q_proj.input"].to_dict(), sites["layers.0.attn.k_proj.input"].to_dict()
    assert [e["loc"]["site"] for e in k["top"]] == ["layers.0.attn.k_proj.input"] * 3
    for entry in k["top"]:
        entry["loc"]["site"] = "layers.0.attn.q_proj.input"
    k["site"] = q["site"]
    assert q == k


def test_attention_metrics_follow_the_selection():
    model = tiny_model("diff_v2")
    ids = _windows()
    with torch.no_grad(), Profiler(model, sites=["kind:logits", "kind:resid"]) as prof:
        model(ids)
    assert prof.result().attention == {}
    with torch.no_grad(), Profiler(model, sites="layers.1.attn.probs1") as prof:
        model(ids)
    assert set(prof.result().attention) == {"layers.1.attn.probs1"}
    with torch.no_grad(), Profiler(model, sites="kind:logits", attention=True) as prof:
        model(ids)
    assert "layers.0.attn.diff_map" in prof.result().attention  # asked for: every map site


# ----------------------------------------------------------------------- non-finite lambda (DIFF V1 / V2)
def test_lambda_stats_count_non_finite_values_and_stay_json():
    """A NaN / Inf lambda (a model with non-finite weights) is counted per head and left out of the other
    statistics, which equal numpy's over the finite values; the state is strict JSON (no NaN literal) and
    merges / round-trips exactly. Before, one NaN turned the head's sums into NaN and `profile` crashed."""
    from diffquant.profile.attention_metrics import LambdaStats

    g = torch.Generator().manual_seed(3)
    lam = torch.rand(2, 5, 3, generator=g, dtype=torch.float64)  # (B, T, H)
    lam[0, :, 0] = math.nan  # head 0 of sample 0: every token
    lam[1, 2, 2] = math.inf
    one, halves = LambdaStats(), LambdaStats()
    one.update(lam)
    halves.update(lam[:1])
    later = LambdaStats()
    later.update(lam[1:])
    halves.merge(later)
    values = lam.reshape(-1, 3).numpy()
    for stats in (one, halves, LambdaStats.from_dict(json.loads(json.dumps(one.to_dict(), allow_nan=False)))):
        got = stats.summary()
        json.dumps(got, allow_nan=False)
        assert got["nonfinite"] == [5, 0, 1]
        for h in range(3):
            ok = values[np.isfinite(values[:, h]), h]
            assert got["count"][h] == ok.size
            assert got["mean"]["per_head"][h] == pytest.approx(ok.mean(), rel=1e-12)
            assert got["std"]["per_head"][h] == pytest.approx(ok.std(), rel=1e-9)
            assert got["min"]["per_head"][h] == ok.min() and got["max"]["per_head"][h] == ok.max()

    scalar = LambdaStats()
    scalar.update(torch.tensor(math.nan))
    scalar.update(torch.tensor(0.25))
    got = scalar.summary()
    assert (got["count"], got["nonfinite"], got["value"], got["min"], got["max"]) == (1, 1, 0.25, 0.25, 0.25)
    json.dumps(scalar.to_dict(), allow_nan=False)
    assert LambdaStats.from_dict(json.loads(json.dumps(scalar.to_dict()))).summary() == got


def test_freed_heap_released_after_large_maps_only_and_profile_unchanged(monkeypatch):
    """The profiler hands freed heap pages back (malloc_trim) once the maps at least TRIM_MIN_BYTES large whose
    statistics and metrics ran add up to TRIM_EVERY_BYTES, never for other sites or smaller maps, and the
    profile is the same."""
    from diffquant.profile import profiler

    assert profiler.release_freed_memory() in (True, False)  # False where there is no glibc
    model = tiny_model("diff_v2")
    ids = _windows(n=2, t=16, seed=4)
    calls = []
    monkeypatch.setattr(profiler, "release_freed_memory", lambda: calls.append(1) or True)

    def run(min_bytes: int, trim: bool = True, every: int = 1) -> str:
        monkeypatch.setattr(profiler, "TRIM_MIN_BYTES", min_bytes)
        monkeypatch.setattr(profiler, "TRIM", trim)
        monkeypatch.setattr(profiler, "TRIM_EVERY_BYTES", every)
        calls.clear()
        with torch.no_grad(), Profiler(model, sites="*", topk=5) as prof:
            model(ids)
        return json.dumps(prof.result().to_dict(), sort_keys=True)

    small = 2 * model.config.n_heads * 16 * 16 * 4  # bytes of one (2, H, 16, 16) float32 map
    trimmed = run(small)
    maps = [t for t in prof_taps(model) if t in ("logits", "probs", "diff_map")]
    metrics = [t for t in prof_taps(model) if t in ("probs", "diff_map")]
    assert len(calls) == len(maps) + len(metrics) > 0
    assert run(small + 1) == trimmed and calls == []
    # Trims wait until the large maps seen since the last one add up to TRIM_EVERY_BYTES (a trim's pages
    # fault in again on the next allocation): every third map here, and the profile is still the same.
    assert run(small, every=3 * small) == trimmed and len(calls) == (len(maps) + len(metrics)) // 3
    assert run(0, trim=False) == trimmed and calls == []


def prof_taps(model) -> list[str]:
    from diffquant.models.taps import model_taps

    return [tap.kind for tap in model_taps(model).values()]


def test_profile_model_skips_the_logits_but_not_the_lm_head_tap(monkeypatch):
    """profile_model discards the model's output, so the LM head only runs its input tap (no (B, T, vocab)
    logits): the profile equals the one with the logits computed, lm_head.input included, and the head's
    forward is the model's own again afterwards."""
    from diffquant.profile import runner

    model = tiny_model("diff_v2")
    ids = _windows(n=4, t=16, seed=6)
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    skipped = json.dumps(profile_model(model, ids, batch_size=2, sites="*", topk=5).to_dict(), sort_keys=True)
    assert shapes and all(s[-1] == 0 for s in shapes)
    assert "forward" not in vars(model.lm_head)
    monkeypatch.setattr(runner, "SKIP_LOGITS", False)
    shapes.clear()
    full = json.dumps(profile_model(model, ids, batch_size=2, sites="*", topk=5).to_dict(), sort_keys=True)
    handle.remove()
    assert shapes and all(s[-1] == model.config.vocab_size for s in shapes)
    assert skipped == full
    assert json.loads(skipped)["sites"]["lm_head.input"]["count"] == ids.numel() * model.config.d_model


def test_profile_json_is_json_dumps_of_to_dict_byte_for_byte():
    """profile_stage writes profile_json(profile): the text json.dumps(to_dict(), indent=1) gives, built one
    site at a time (no whole-profile dict in memory)."""
    from diffquant.profile.runner import profile_json

    model = tiny_model("diff_v2")
    profile = profile_model(model, _windows(n=2, t=16, seed=7), batch_size=2, sites="*", topk=3)
    profile.meta["note"] = 'a "sites": {}, look-alike'
    assert profile_json(profile) == json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n"
    empty = Profile(meta={"tokens": 0})
    assert profile_json(empty) == json.dumps(empty.to_dict(), indent=1, allow_nan=False) + "\n"
