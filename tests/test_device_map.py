"""``--device-map`` (diffquant.stream.placement): a model spread over devices through accelerate gives the
single-device model's logits, profiles and metrics; bad maps and option mixes are one-line errors.

What accelerate allows without CUDA, and so what the CPU tests place: accelerate's devices are GPU indices,
``cpu``, ``mps`` and ``disk``. On a machine without a GPU the only two distinct placements are ``cpu``
(weights resident, computed on the CPU) and ``disk`` (weights written to an offload folder as memory-mapped
files; accelerate's hook loads a module's weights onto the execution device, here the CPU, for each forward
and drops them after). A ``{'': cpu, layers.1: disk}`` map is therefore a real two-placement dispatch: it
goes through :func:`accelerate.dispatch_model` and its hooks (the offloaded block's parameters sit on the
meta device between forwards, the tests check that) while every module still computes on the CPU, so
logits and profiles must be equal bit for bit (the offload files keep the tensors' bytes: no dtype round
trip). ``mps`` is Apple's GPU and ``cpu`` + ``cuda`` needs a GPU; the two-GPU test (marked ``gpu``) runs
``auto`` where two CUDA devices exist.
"""

import gc
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, tiny_model
from docpages import doc_block

from diffquant.cli import main
from diffquant.data.tokenizer import ByteTokenizer
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import evaluate_stream
from diffquant.io import load_model, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.profile.runner import profile_model
from diffquant.recipes import validate
from diffquant.stream.placement import (
    Placement,
    describe_map,
    load_placed,
    parse_device_map,
    parse_max_memory,
    placement_options,
)

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="device maps need accelerate"
)
TWO_PLACEMENTS = {"": "cpu", "layers.1": "disk"}  # what accelerate allows on a CPU-only machine
PROFILE = ["--tokens", "256", "--seq-len", "32", "--batch-size", "3", "--topk", "8", "--data", "stdlib"]


def _windows(vocab: int, n: int = 5, length: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """A tiny HF Llama (untied head), a tiny HF DiffLlama (exported from the DIFF V1 preset) and a native
    DIFF V2 checkpoint with tied embeddings (the head follows the embedding)."""
    root = tmp_path_factory.mktemp("devmap")
    llama = save_tiny_llama(root / "llama", context=64)
    diffllama = export_hf(load_model("init:diff_v1:tiny"), root / "diffllama")
    tied = save_checkpoint(tiny_model("diff_v2", seed=3, tie_embeddings=True, vocab_size=259), root / "tied")
    return {"llama": f"hf:{llama}", "diffllama": f"hf:{diffllama}", "tied": str(tied)}


@needs_accelerate
@pytest.mark.parametrize("name", ["llama", "diffllama", "tied"])
def test_cpu_and_disk_placement_equals_the_whole_model(specs, name, capsys):
    spec = specs[name]
    whole = load_model(spec)
    placed = load_placed(spec, Placement(dict(TWO_PLACEMENTS)))
    err = capsys.readouterr().err
    assert placed.device_map["layers.1"] == "disk" and placed.device_map["layers.0"] == "cpu"
    assert "layers.1 -> disk; norm, lm_head -> cpu (offload folder" in err and err.count("\n") == 1
    # the offloaded block really is offloaded: its weights are loaded by accelerate's hook per forward
    assert placed.layers[1].attn.q_proj.weight.is_meta and not placed.layers[0].attn.q_proj.weight.is_meta
    assert placed.config == whole.config and placed.tokenizer == whole.tokenizer
    if whole.config.tie_embeddings:
        assert placed.lm_head.weight is placed.embed.weight
    windows = _windows(whole.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(whole(windows), placed(windows))
    for sites in ("*", "kind:resid"):
        a = profile_model(whole, windows, batch_size=2, sites=sites, topk=8).to_dict()
        b = profile_model(placed, windows, batch_size=2, sites=sites, topk=8).to_dict()
        assert a == b
    stream = _windows(259, n=1, length=150, seed=3).flatten()  # byte ids: every model reads bytes
    settings = {"tokenizer": ByteTokenizer(), "seq_len": 32, "batch_size": 2}
    assert evaluate_stream(whole, stream, **settings) == evaluate_stream(placed, stream, **settings)
    folder = Path(re.search(r"offload folder (\S+)\)", err).group(1))
    assert (folder / "index.json").is_file()
    del placed
    gc.collect()
    assert not folder.exists()  # the offload folder goes with the model


@needs_accelerate
def test_strategies_fill_cpu_then_disk_under_max_memory(specs, capsys):
    spec = specs["llama"]
    whole = load_model(spec)
    windows = _windows(whole.config.vocab_size, n=3)
    for strategy in ("auto", "balanced", "sequential"):
        placed = load_placed(spec, Placement(strategy, parse_max_memory("cpu=300KB")))
        assert placed.device_map["embed"] == "cpu" and "disk" in placed.device_map.values()
        with torch.no_grad():
            assert torch.equal(whole(windows), placed(windows))
        assert f"placed by --device-map {strategy}: " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine places auto on its GPUs")
def test_auto_without_cuda_places_everything_on_cpu(specs, capsys):
    placed = load_placed(specs["llama"], Placement("auto"))
    assert set(placed.device_map.values()) == {"cpu"}
    err = capsys.readouterr().err
    assert "--device-map auto: no CUDA device on this machine; the whole model is placed on cpu" in err
    assert all(p.device.type == "cpu" for p in placed.parameters())


@needs_accelerate
def test_cli_profile_and_eval_with_a_device_map_equal_without(specs, tmp_path, capsys):
    spec = specs["llama"]
    common = [spec, *PROFILE, "--tokenizer", "byte"]
    assert main(["profile", *common, "--out", str(tmp_path / "whole")]) == 0
    whole_out = capsys.readouterr().out
    mapping = json.dumps(TWO_PLACEMENTS)
    assert main(["profile", *common, "--out", str(tmp_path / "placed"), "--device-map", mapping]) == 0
    captured = capsys.readouterr()
    assert captured.out.replace("placed", "whole") == whole_out
    assert "placed by --device-map: embed, layers.0 -> cpu; layers.1 -> disk;" in captured.err
    profile = "profile/llama.json"
    assert json.loads((tmp_path / "whole" / profile).read_text()) == json.loads(
        (tmp_path / "placed" / profile).read_text()
    )
    # a YAML map from a file, and an eval sweep under quantization plans (a plan on an offloaded block too)
    map_file = tmp_path / "map.yaml"
    map_file.write_text("embed: cpu\nlayers: cpu\nlayers.1: disk\nnorm: cpu\nlm_head: cpu\n")
    task = ["--task", "bpb:tokens=600,seq_len=48", "--batch-size", "3", "--tokenizer", "byte"]
    plans = ["--plan", "w8a8", "attn-logits-int4"]
    assert main(["eval", spec, *task, *plans, "--out", str(tmp_path / "ew")]) == 0
    assert (
        main(["eval", spec, *task, *plans, "--out", str(tmp_path / "ep"), "--device-map", str(map_file)]) == 0
    )
    results = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("ew", "ep")]
    assert results[0] == results[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--device-map", '{"": "cpu", "layers.1.attn": "disk"}'],
            "unknown module 'layers.1.attn' (a decoder block is never split)",
        ),
        (
            ["--device-map", '{"": "cpu", "blocks": "cpu"}'],
            "unknown module 'blocks'; expected embed, layers, layers.N (N < 2)",
        ),
        (["--device-map", '{"": "cpu", "layers.7": "cpu"}'], "unknown module 'layers.7'"),
        (
            ["--device-map", '{"": "tpu"}'],
            "--device-map: '': device 'tpu': expected cpu, disk, cuda:N or a GPU index N",
        ),
        (["--device-map", '{"embed": "cpu", "layers": "cpu"}'], "--device-map: no device for norm"),
        (
            ["--device-map", '{"": "cpu", "embed": "disk"}'],
            "embed on disk: the embedding must be on cpu or a GPU",
        ),
        (
            ["--device-map", "everywhere"],
            "--device-map: expected auto, balanced, sequential or a JSON / YAML mapping",
        ),
        (["--device-map", "auto", "--stream", "on"], "--device-map with --stream on: two ways"),
        (["--device-map", "auto", "--device", "cuda"], "leave --device at cpu (got 'cuda')"),
        (["--max-memory", "cpu=1GB"], "--max-memory sizes the devices of --device-map"),
        (
            ["--device-map", '{"": "cpu"}', "--max-memory", "cpu=1GB"],
            "an explicit --device-map places every module",
        ),
        (["--device-map", "auto", "--max-memory", "cpu=lots"], "--max-memory: cpu: size 'lots'"),
    ],
)
def test_bad_maps_and_option_mixes_are_one_line_errors(specs, tmp_path, capsys, extra, message):
    if "cuda" in extra and torch.cuda.is_available():
        pytest.skip("--device cuda is a device here")
    args = ["profile", specs["llama"], *PROFILE, "--tokenizer", "byte", "--out", str(tmp_path / "x"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("diffquant profile: error: ")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "init:baseline:tiny",
            "places hf:FOLDER and native safetensors checkpoints (zoo:NAME too); load init:",
        ),
        ("gguf:/nowhere/model.gguf", "load gguf: models without --device-map"),
        ("unilm:/nowhere", "load unilm: models without --device-map"),
    ],
)
def test_other_specifiers_are_refused_naming_the_flag(spec, message):
    with pytest.raises(DiffquantError, match=re.escape(message)) as err:
        load_placed(spec, Placement({"": "cpu"}))
    assert "\n" not in str(err.value)


def test_tied_head_goes_with_the_embedding(specs):
    with pytest.raises(DiffquantError, match="tied embeddings"):
        load_placed(specs["tied"], Placement({"": "cpu", "lm_head": "disk"}))


def test_option_parsing(monkeypatch):
    assert parse_device_map("balanced") == "balanced"
    assert parse_device_map("{'': cpu, layers.1: disk}") == {"": "cpu", "layers.1": "disk"}  # YAML flow
    assert parse_device_map({"": "disk", "embed": "cpu"}) == {"": "disk", "embed": "cpu"}
    if not torch.cuda.is_available():
        with pytest.raises(DiffquantError, match="embed: device 0: CUDA is not available on this machine"):
            parse_device_map('{"embed": 0}')
    assert parse_max_memory("0=20GiB, cuda:1=1.5GB,cpu=1024") == {
        0: 20 * 2**30,
        1: 1_500_000_000,
        "cpu": 1024,
    }
    assert parse_max_memory({"cpu": "2MiB", 0: 5}) == {"cpu": 2 * 2**20, 0: 5}
    with pytest.raises(DiffquantError, match="--max-memory: device 'tpu'"):
        parse_max_memory("tpu=1GB")
    assert placement_options({"device": "cpu", "stream": "off"}) is None
    got = placement_options({"device_map": "auto", "stream": False}, name=lambda key: key)
    assert got == Placement("auto", None, "device_map")
    with pytest.raises(DiffquantError, match="^device_map with stream auto: two ways"):
        placement_options({"device_map": "auto", "stream": "auto"}, name=lambda key: key)
    monkeypatch.setattr("diffquant.stream.placement.rank_and_world", lambda: (0, 2))
    with pytest.raises(DiffquantError, match="in one process; run it without torchrun"):
        placement_options({"device_map": "auto"})
    described = describe_map(
        {"embed": "cuda:0", "layers.0": "cuda:0", "layers.1": "cuda:1", "norm": "cuda:1"}
    )
    assert described == "embed, layers.0 -> cuda:0; layers.1, norm -> cuda:1"


def test_recipe_keys():
    raw = {"name": "x", "models": {"a": "hf:somewhere"}, "device_map": {"": "cpu", "layers.1": "disk"}}
    assert validate(raw)["device_map"] == {"": "cpu", "layers.1": "disk"}
    assert validate({**raw, "device_map": "auto", "max_memory": {0: "20GiB", "cpu": "60GiB"}})["max_memory"]
    with pytest.raises(DiffquantError, match="device_map"):
        validate({**raw, "device_map": 3.5})


@pytest.mark.gpu
@needs_accelerate
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_auto_over_two_gpus_equals_one_gpu(specs, tmp_path, capsys):
    """``auto`` capped so that the model spreads over both GPUs, and an explicit two-GPU map: logits and
    profiles as on one GPU (the same kernels on the same GPU model: equal to float rounding)."""
    spec = specs["diffllama"]
    one = load_model(spec, device="cuda:0")
    size = sum(p.numel() * p.element_size() for p in one.parameters())
    auto = load_placed(spec, Placement("auto", {0: size // 2, 1: size}))
    explicit = load_placed(
        spec, Placement(parse_device_map("{embed: 0, layers.0: 0, layers.1: 1, norm: 1, lm_head: 1}"))
    )
    windows = _windows(one.config.vocab_size)
    for placed in (auto, explicit):
        assert {"cuda:0", "cuda:1"} <= set(placed.device_map.values())
        with torch.no_grad():
            torch.testing.assert_close(
                placed(windows.cuda()).cpu(), one(windows.cuda()).cpu(), rtol=1e-6, atol=1e-6
            )
        # every site, maps and attention metrics included: statistics kept on each site's GPU, token ids
        # (on the embedding's GPU) read for the locations of sites on the other one
        a = profile_model(one, windows.cuda(), batch_size=2, topk=8)
        b = profile_model(placed, windows.cuda(), batch_size=2, topk=8)
        assert set(a.sites) == set(b.sites) and set(a.attention) == set(b.attention)
        for site, stats in a.sites.items():
            assert stats.count == b.sites[site].count
            assert stats.max == pytest.approx(b.sites[site].max, rel=1e-5)
            assert stats._top[0]["loc"] == b.sites[site]._top[0]["loc"]
    specs_args = [spec, *PROFILE]
    assert main(["profile", *specs_args, "--out", str(tmp_path / "gpu"), "--device-map", "auto"]) == 0
    assert "cuda:" in capsys.readouterr().err


@needs_accelerate
def test_readme_example_is_what_the_command_prints(tmp_path, monkeypatch, capsys):
    """The documentation's --device-map example (docs/device-maps.md: stderr's placement line, then the
    profile) line for line, the temporary offload folder aside."""
    _, command, want = doc_block(
        lambda line: line.startswith("$ diffquant profile diff") and "--device-map" in line
    )
    monkeypatch.chdir(tmp_path)
    # A slow step prints progress lines on stderr (a busy machine makes every step slow; interval 0 plays
    # it): the README shows a quiet run, so compare a quiet one.
    monkeypatch.setenv("DIFFQUANT_PROGRESS_INTERVAL", "0")
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")
    assert main(["init", "diff", "--kind", "diff_v2"]) == 0
    capsys.readouterr()
    argv = command.removeprefix("$ diffquant ").replace("\"{'': cpu, layers.1: disk}\"", "MAP").split()
    assert main([a if a != "MAP" else "{'': cpu, layers.1: disk}" for a in argv]) == 0
    captured = capsys.readouterr()
    folder = re.compile(r"\(offload folder \S+\)")
    printed = [
        folder.sub("(offload folder F)", line)
        for line in captured.err.splitlines() + captured.out.splitlines()
    ]
    assert printed == [folder.sub("(offload folder F)", line) for line in want]
