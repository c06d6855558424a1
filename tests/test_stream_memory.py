"""Memory limits and the streamed run: what this process may still use (free memory, ``ulimit -v``, memory
cgroups), a whole-model load refused in one line when it cannot fit, an allocation failure as one line
(exit 2), hidden states spilled to disk giving the same profile, and a shard lost mid-run named with
nothing written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import shard_safetensors
from test_stream import _windows

from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.io import load_model, safetensors_source, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.profile.runner import profile_model
from diffquant.stream import api, executor, profile_streamed

GiB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_checkpoint(load_model("init:diff_v2:tiny"), tmp_path_factory.mktemp("mem") / "v2")


# ----------------------------------------------------------------------------------- memory left
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_limit_minus_unreclaimable_usage(tmp_path, version):
    root, membership = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    if version == "v2":
        _write(membership, "0::/job/task\n")
        group = root / "job" / "task"
        _write(group / "memory.max", f"{2 * GiB}\n")
        _write(group / "memory.current", f"{3 * GiB // 2}\n")
        _write(group / "memory.stat", f"anon 1000\ninactive_file {GiB // 2}\nactive_file 7\n")
    else:
        _write(membership, "9:name=systemd:/\n4:memory:/job/task\n0::/\n")
        group = root / "memory" / "job" / "task"
        _write(group / "memory.limit_in_bytes", f"{2 * GiB}\n")
        _write(group / "memory.usage_in_bytes", f"{3 * GiB // 2}\n")
        _write(group / "memory.stat", f"cache 5\ntotal_inactive_file {GiB // 2}\n")
    # 2 GiB limit, 1.5 GiB charged of which 0.5 GiB is page cache the kernel would drop first: 1 GiB left
    assert executor._cgroup_left(root, membership) == GiB
    (group / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(
        "max\n" if version == "v2" else "9223372036854771712\n"
    )
    assert executor._cgroup_left(root, membership) is None  # no limit
    assert executor._cgroup_left(root, tmp_path / "absent") is None


def test_address_space_limit_caps_available_bytes():
    """Under ``ulimit -v`` the room left is the limit minus what the process has mapped already."""
    code = (
        "import resource; from diffquant.stream.executor import available_bytes, _meminfo\n"
        "vm = _meminfo('VmSize', '/proc/self/status')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 300 * 2**20, resource.RLIM_INFINITY))\n"
        "vm = _meminfo('VmSize', '/proc/self/status')\n"
        "print(available_bytes(), vm + 300 * 2**20 - vm)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    room, expected = map(int, out.split())
    assert 0 < room <= expected and room > expected - 16 * 2**20  # VmSize moved by at most a few pages


# -------------------------------------------------------------------------- refusals and failures
def test_whole_load_that_cannot_fit_is_refused_and_auto_streams(folder, tmp_path, capsys, monkeypatch):
    size = executor.whole_load_bytes(folder)  # the weights and the mapped file they are copied from
    assert size == executor.weights_bytes(folder) + (folder / "model.safetensors").stat().st_size
    monkeypatch.setattr(api, "available_bytes", lambda device="cpu": size - 1)
    monkeypatch.setattr(executor, "available_bytes", lambda device="cpu": size - 1)
    args = ["profile", str(folder), "--tokens", "128", "--seq-len", "32", "--sites", "kind:resid"]
    assert main([*args, "--out", str(tmp_path / "off")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffquant profile: error: ") and "\n" not in err
    assert "do not fit" in err and "run it with --stream on" in err
    assert not (tmp_path / "off").exists()  # refused before the run folder is made
    assert main([*args, "--out", str(tmp_path / "auto"), "--stream", "auto"]) == 0
    err = capsys.readouterr().err
    assert "exceed the budget" in err and "(--stream auto)" in err
    monkeypatch.setattr(api, "available_bytes", lambda device="cpu": size)
    assert main([*args, "--out", str(tmp_path / "fits")]) == 0  # exactly enough: loaded whole


def test_allocation_failure_is_one_line_exit_2(tmp_path):
    """A real allocation refused by the kernel (``ulimit -v`` just above what the process holds): one line
    naming the allocation and what to change, exit 2, no traceback."""
    code = (
        "import resource, sys\n"
        "from diffquant.cli import main\n"
        "from diffquant.stream.executor import _meminfo\n"
        "common = ['--quiet', 'profile', 'init:baseline:tiny', '--seq-len', '128', '--force']\n"
        "assert main([*common, '--tokens', '256', '--batch-size', '2', '--out', sys.argv[1]]) == 0\n"
        "vm = _meminfo('VmSize', '/proc/self/status')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))\n"
        "sys.exit(main([*common, '--tokens', '65536', '--batch-size', '512', '--out', sys.argv[1]]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("diffquant profile: error: out of memory (can't allocate")
    assert "--stream on" in lines[0]


# ------------------------------------------------------------------------------------ the executor
def test_hidden_states_spilled_to_disk_give_the_same_profile(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(executor.tempfile, "tempdir", str(tmp_path))
    windows = _windows(259, n=5)
    stats: dict = {}
    spilled = profile_streamed(folder, windows, batch_size=2, sites="*", topk=8, hidden_budget=0, stats=stats)
    whole = profile_model(load_model(folder), windows, batch_size=2, sites="*", topk=8)
    assert spilled.to_dict() == whole.to_dict()
    assert stats["hidden_spilled"] == 3 * (load_model(folder).config.n_layers + 1)  # 3 batches per stage
    assert stats["hidden_peak_bytes"] == 0
    assert not list(tmp_path.glob("diffquant-hidden-*"))  # the spill folder is gone


def test_shard_lost_mid_run_is_named_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    out = export_hf(load_model("init:baseline:tiny"), tmp_path / "hf")
    shard_safetensors(out, 3)
    victim = out / "model-00003-of-00003.safetensors"
    real = executor.StreamedModel.materialise

    def materialise(self, prefixes):
        if prefixes[0] == "layers.1.":
            victim.unlink()  # gone after the run began (and after the up-front check)
        return real(self, prefixes)

    monkeypatch.setattr(executor.StreamedModel, "materialise", materialise)
    run = tmp_path / "run"
    args = ["profile", f"hf:{out}", "--tokens", "128", "--seq-len", "32", "--stream", "on", "--out", str(run)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(victim) in err and "in the middle of the run" in err
    written = {p.name for p in run.rglob("*") if p.is_file()}
    assert {n for n in written if not n.startswith(".diffquant-run.")} == set()  # only the run's claim/lock
    assert not (run / "manifest.json").exists() and not list(run.glob("profile/*"))


def test_streamed_run_maps_no_shard_it_is_not_reading(folder, monkeypatch):
    """Headers are parsed, not mapped: under ``ulimit -v`` every shard of a checkpoint larger than the
    limit mapped at once would not fit; a stage reads its own tensors' bytes, mapping nothing (issue 44)."""
    opened: list[str] = []
    real = safetensors_source.safe_open

    def spy(path, *a, **k):
        opened.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors_source, "safe_open", spy)
    with executor.open_streamed(folder) as streamed:
        assert opened == []  # opening checks every header without mapping a file
        streamed.materialise(["layers.0."])
        weight = streamed.model.layers[0].attn.q_proj.weight
        assert torch.equal(weight, load_model(folder).layers[0].attn.q_proj.weight)
    assert opened == []  # read by offset, not mapped
    with pytest.raises(DiffquantError, match="truncated"):
        data = (folder / "model.safetensors").read_bytes()
        cut = folder.parent / "cut"
        cut.mkdir()
        (cut / "config.json").write_text((folder / "config.json").read_text())
        (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
        executor.weights_bytes(cut)
    assert json.loads((folder / "config.json").read_text())  # the original is untouched


def test_a_finite_spill_budget_puts_drops_and_puts_again(tmp_path, monkeypatch):
    """A budget of one batch (not 0, not None): each stage keeps the batch that fits in memory and spills
    the others, re-putting every key after a get; the profile of a 12-layer model (layers.1 and layers.11
    both exist) is the whole-model one, and the spill count is what the budget implies."""
    from conftest import tiny_model

    monkeypatch.setattr(executor.tempfile, "tempdir", str(tmp_path))
    deep = save_checkpoint(tiny_model("diff_v2", n_layers=12, vocab_size=259), tmp_path / "deep")
    windows = _windows(259, n=5)
    batch = 2 * windows.shape[1] * tiny_model("diff_v2", n_layers=12).config.d_model * 4  # one batch, fp32
    stats: dict = {}
    sites = "kind:resid"
    got = profile_streamed(deep, windows, batch_size=2, sites=sites, topk=8, hidden_budget=batch, stats=stats)
    whole = profile_model(load_model(deep), windows, batch_size=2, sites=sites, topk=8)
    assert len(whole.to_dict()["sites"]) == 12
    assert got.to_dict() == whole.to_dict()
    # batches of 2, 2, 1 windows: the first fits, the second and third spill, at each of the 13 stages
    # that store (embed and 12 layers; the head drops)
    assert stats["hidden_spilled"] == 2 * 13 and stats["hidden_peak_bytes"] == batch
    assert not list(tmp_path.glob("diffquant-hidden-*"))

    store = executor.HiddenStore(budget_bytes=16)  # put, drop, put: the dropped bytes are free again
    a, b = torch.arange(4.0), torch.arange(4.0) + 10  # 16 bytes each
    store.put(0, a)
    store.put(1, b)  # over the budget: a file
    store.drop(0)
    store.put(2, b)  # fits again in memory
    assert store.spilled == 1 and store.peak_bytes == 16
    assert torch.equal(store.get(1), b) and torch.equal(store.get(2), b)
    store.put(1, a)  # a spilled key put again: its file replaced, still over the budget
    assert torch.equal(store.get(1), a) and store.spilled == 2
    store.close()


@pytest.mark.slow  # a child process imports torch and the kernels (~15 s on a busy 2-core machine)
def test_whole_load_counts_the_load_peak_under_an_address_space_limit(tmp_path):
    """Under ``ulimit -v`` with room for the weights but not for the load's peak (the file mapped while
    its tensors are copied out), ``--stream off`` is refused in one line before loading (it used to pass
    the check and die in the load) and ``auto`` streams."""
    from conftest import tiny_model

    model = tiny_model("baseline", n_layers=12, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32)
    folder = save_checkpoint(model, tmp_path / "ckpt", overwrite=True)
    weights = executor.weights_bytes(folder)
    code = (
        "import resource, sys\n"
        "from diffquant.cli import main\n"
        "from diffquant.stream import api, executor\n"
        "executor.prepare_whole_load()\n"
        "vm = executor._meminfo('VmSize', '/proc/self/status')\n"
        f"resource.setrlimit(resource.RLIMIT_AS, (vm + 3 * {weights} // 2, resource.RLIM_INFINITY))\n"
        "print(api.choose_stream(sys.argv[1], 'auto'), flush=True)\n"
        "sys.exit(main(['--quiet', 'profile', sys.argv[1], '--tokens', '64', '--seq-len', '32',\n"
        "               '--stream', 'off', '--out', sys.argv[2]]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"  # auto: streamed
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "exceed the budget" in lines[0] and "(--stream auto)" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("diffquant profile: error: ")
    assert "do not fit" in lines[1] and "run it with --stream on" in lines[1]
    assert not (tmp_path / "run").exists()
    peak = executor.whole_load_bytes(folder)
    assert peak == weights + (folder / "model.safetensors").stat().st_size  # the file, mapped while read
