"""The layer-streamed run over GGUF files (``gguf:FILE``, ``fetch:NAME``): each stage's tensors dequantized
from the file as it runs, with the whole-model ``load_model('gguf:...')`` run's numbers bit for bit
(logits, profiles, perplexity), in Q8_0, Q4_1 and the K-quants, tied and untied; the size ``--stream auto``
weighs is the dequantized one; a truncated file is one line naming it, before anything is written.

The tiny GGUF files come from tests/test_gguf.py's writer (llama.cpp's layout, its Q/K row permutation).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf import _LAYER_NAMES, GQA, KQUANT, MHA_TIED, TWELVE, Q, write_gguf
from test_gguf import tok_files as tok_files  # noqa: F401 (the fixture, shared)

from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import evaluate_stream
from diffquant.io import fetch, load_model
from diffquant.io.convert_gguf import GGUFTensors, read_gguf
from diffquant.profile.runner import profile_model
from diffquant.stream import (
    evaluate_streamed,
    logits_streamed,
    open_streamed,
    profile_streamed,
    resolve_stream_spec,
    weights_bytes,
    would_stream,
)
from diffquant.stream.executor import whole_load_bytes

gguf = pytest.importorskip("gguf")


def _kquants(name: str):
    return Q.Q6_K if name in ("token_embd.weight", "output.weight") else Q.Q4_K


def _mixed(name: str):
    """A different type per role, K-quants among them (KQUANT's rows hold whole 256-value blocks)."""
    order = [Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.F16, Q.Q4_0]
    return order[sum(map(ord, name)) % len(order)]


# name -> (model shape, tensor types, tied?)
CASES = {
    "q8_0-untied": (GQA, Q.Q8_0, False),
    "q4_1-tied": (MHA_TIED, Q.Q4_1, True),
    "kquant-untied": (KQUANT, _kquants, False),
    "mixed-kquant-tied": (KQUANT, _mixed, True),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tok_files):
    root = tmp_path_factory.mktemp("stream-gguf")
    out = {}
    for name, (spec, qtype, tied) in CASES.items():
        spec = dataclasses.replace(spec, tied=tied)
        out[name] = write_gguf(root / f"{name}.gguf", tok_files, spec, qtype)
    return out


def _windows(vocab: int, n: int = 5, length: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_logits_and_profile_equal_whole_model(files, case):
    spec = f"gguf:{files[case]}"
    model = load_model(spec)
    assert model.config.tie_embeddings is CASES[case][2]
    windows = _windows(model.config.vocab_size)
    with torch.no_grad():
        whole = torch.cat([model(windows[i : i + 2]) for i in range(0, len(windows), 2)])
    assert torch.equal(whole, logits_streamed(spec, windows, batch_size=2))
    for sites in ("*", "kind:resid"):
        a = profile_model(model, windows, batch_size=2, sites=sites, topk=8).to_dict()
        b = profile_streamed(spec, windows, batch_size=2, sites=sites, topk=8).to_dict()
        assert a == b, sites


def test_streamed_dtype_follows_the_whole_model_load(files):
    """dtype=None dequantizes to float32 in both runs; an asked dtype is the whole-model load's too."""
    spec = f"gguf:{files['q4_1-tied']}"
    windows = _windows(load_model(spec).config.vocab_size, n=3)
    with open_streamed(spec) as streamed:
        assert streamed.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        model = load_model(spec, dtype=dtype)
        with torch.no_grad():
            whole = torch.cat([model(windows[i : i + 2]) for i in range(0, 3, 2)])
        streamed = logits_streamed(spec, windows, batch_size=2, dtype=dtype)
        assert streamed.dtype == dtype and torch.equal(whole, streamed), dtype


def test_each_stage_reads_only_its_tensors_and_maps_nothing(files, monkeypatch):
    """A stage dequantizes its own tensors and no others, and the run never maps the file (its pages stay
    in the page cache, out of the process)."""
    path = files["q8_0-untied"]
    reads: list[str] = []
    get = GGUFTensors.get

    def spy(self, key):
        reads.append(key)
        return get(self, key)

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed GGUF run must not map the file")

    monkeypatch.setattr(GGUFTensors, "get", spy)
    monkeypatch.setattr(np, "memmap", refuse)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    with open_streamed(f"gguf:{path}") as streamed:
        assert reads == []  # opening reads headers only
        read_by_stage = {}
        for name, prefixes, modules, _ in streamed.stages():
            reads.clear()
            streamed.materialise(prefixes)
            read_by_stage[name] = sorted(reads)
            streamed.release(modules)
    layer0 = read_by_stage["layers.0"]
    assert layer0 and all(k.startswith("blk.0.") for k in layer0)
    assert len(layer0) == 9  # 2 norms, q k v o, gate up down
    assert read_by_stage["embed"] == ["token_embd.weight"]
    assert read_by_stage["head"] == ["output.weight", "output_norm.weight"]
    every = sorted(k for keys in read_by_stage.values() for k in keys)
    assert every == sorted(t.name for t in read_gguf(path).tensors)  # each tensor read once
    maps = Path("/proc/self/maps")
    if maps.is_file():
        assert not [line for line in maps.read_text().splitlines() if line.endswith(str(path))]


def test_twelve_layers_each_stage_reads_its_own_block(tmp_path, tok_files, monkeypatch):
    """blk.1. vs blk.10. / blk.11.: in a 12-layer file the stage of layer i reads the nine tensors of
    blk.i and no other, and the streamed logits equal the whole-model ones."""
    path = write_gguf(tmp_path / "twelve.gguf", tok_files, TWELVE, Q.Q8_0)
    spec = f"gguf:{path}"
    model = load_model(spec)
    windows = _windows(model.config.vocab_size, n=2)
    with torch.no_grad():
        whole = model(windows)
    reads: list[str] = []
    get = GGUFTensors.get

    def spy(self, key):
        reads.append(key)
        return get(self, key)

    monkeypatch.setattr(GGUFTensors, "get", spy)
    with open_streamed(spec) as streamed:
        read_by_stage = {}
        for name, prefixes, modules, _ in streamed.stages():
            reads.clear()
            streamed.materialise(prefixes)
            read_by_stage[name] = sorted(reads)
            streamed.release(modules)
    for i in range(12):
        want = sorted(f"blk.{i}.{gguf_name}" for gguf_name in _LAYER_NAMES.values())
        assert read_by_stage[f"layers.{i}"] == want, i
    assert torch.equal(logits_streamed(spec, windows, batch_size=2), whole)


def test_weights_bytes_file_and_in_memory(files):
    """weights_bytes: the quantized bytes in the file; in_memory: dequantized float32, what a whole-model
    load holds and what --stream auto must fit (the tied head counted once)."""
    for case in ("q4_1-tied", "kquant-untied"):
        path = files[case]
        spec = f"gguf:{path}"
        reader = gguf.GGUFReader(path)
        in_file = sum(int(t.n_bytes) for t in reader.tensors)
        model = load_model(spec)
        in_memory = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weights_bytes(spec) == in_file < path.stat().st_size
        assert weights_bytes(spec, in_memory=True) == in_memory > 2 * in_file
        between = (in_file + in_memory) // 2  # the file fits, the dequantized weights do not
        streams, size, reason = would_stream(spec, budget_bytes=between)
        assert streams and size == in_memory and "streamed" in reason, case
        # a whole load needs the weights and its own temporaries (whole_load_bytes): the weights alone do not fit
        peak = whole_load_bytes(spec, weights=in_memory)
        assert peak > in_memory
        assert would_stream(spec, budget_bytes=in_memory)[0]
        assert not would_stream(spec, budget_bytes=peak)[0]


def test_truncated_gguf_is_one_line_naming_the_file(files, tmp_path, capsys):
    data = files["q4_1-tied"].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])  # header intact, the last tensors cut off
    windows = _windows(50)
    for run in (
        lambda: profile_streamed(f"gguf:{bad}", windows, batch_size=2),
        lambda: logits_streamed(f"gguf:{bad}", windows),
        lambda: weights_bytes(f"gguf:{bad}"),
    ):
        with pytest.raises(DiffquantError, match="not a readable GGUF file") as excinfo:
            run()
        assert _one_line(excinfo).startswith(str(bad))
    out = tmp_path / "out"
    code = main(
        ["profile", f"gguf:{bad}", "--tokens", "64", "--seq-len", "16", "--stream", "on"]
        + ["--out", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(bad) in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_gguf_cut_short_during_the_run_is_one_line(files, tmp_path):
    """A file truncated after the run opened it (the header checked out): the stage that reads past the
    new end fails in one line naming the file and the tensor, and no logits come out."""
    path = tmp_path / "shrinks.gguf"
    path.write_bytes(files["q8_0-untied"].read_bytes())
    got = []
    with open_streamed(f"gguf:{path}") as streamed:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size * 2 // 3)
        windows = _windows(streamed.config.vocab_size, n=2)
        with pytest.raises(DiffquantError, match="is unreadable") as excinfo:
            streamed.run([windows], on_logits=lambda k, logits: got.append(k))
    message = _one_line(excinfo)
    assert message.startswith(str(path)) and ("blk." in message or "output" in message), message
    assert got == []


def test_refusals_name_what_still_cannot_stream(files):
    spec = resolve_stream_spec(f"gguf:{files['q8_0-untied']}")
    assert spec.format == "gguf" and spec.layer_pattern == r"blk\.(\d+)\."
    for text in ("init:baseline:tiny", "unilm:/nowhere"):
        with pytest.raises(DiffquantError, match="and GGUF files") as excinfo:
            resolve_stream_spec(text)
        assert "models whole" in _one_line(excinfo)


PROFILE = ["--tokens", "192", "--seq-len", "24", "--batch-size", "3", "--topk", "8"]


def test_cli_profile_stream_on_equals_off(files, tmp_path, capsys):
    specs = [f"gguf:{files[c]}" for c in ("q4_1-tied", "kquant-untied")]
    assert main(["profile", *specs, *PROFILE, "--out", str(tmp_path / "whole")]) == 0
    assert main(["profile", *specs, *PROFILE, "--out", str(tmp_path / "streamed"), "--stream", "on"]) == 0
    capsys.readouterr()

    def profiles(out):
        return {p.stem: json.loads(p.read_text()) for p in sorted((out / "profile").glob("*.json"))}

    whole, streamed = profiles(tmp_path / "whole"), profiles(tmp_path / "streamed")
    assert len(whole) == 2 and whole == streamed
    manifest = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    assert len(manifest["streamed"]) == 2


@pytest.mark.real
def test_real_smollm2_streamed_perplexity_equals_whole():
    """SmolLM2-135M (Q4_1 linear weights, Q8_0 tied embedding): 2 windows of 128 tokens, streamed through
    30 dequantized layers, give the whole-model perplexity exactly."""
    from diffquant.data import token_stream

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    spec = f"gguf:{path}"
    model = load_model(spec)
    ids = token_stream("wikitext2:test", 2 * 128, model.tokenizer)
    whole = evaluate_stream(model, ids, seq_len=128, windows="disjoint", batch_size=1)
    del model
    streamed = evaluate_streamed("fetch:smollm2", ids, seq_len=128, windows="disjoint", batch_size=1)
    assert whole["n_windows"] == 2 and whole == streamed
    print(f"\nSmolLM2 2 x 128 ppl: whole {whole['perplexity']:.6f}, streamed {streamed['perplexity']:.6f}")
