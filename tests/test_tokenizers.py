"""Real tokens: every stage reads text through the model's own tokenizer.

A tiny random Hugging Face Llama with a small byte-level BPE trained here by `tokenizers` (no download):
the ids that reach the model's embedding in profiling, calibration, perplexity, multiple choice and
retrieval are compared with ids computed independently, straight from `tokenizers.Tokenizer.from_file`,
and perplexity with transformers' own loss on the same windows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, train_byte_bpe

from diffquant.cli import main
from diffquant.data import ByteTokenizer, HFTokenizer, load_tokenizer, model_tokenizer, token_windows
from diffquant.errors import DiffquantError
from diffquant.io import load_model

transformers = pytest.importorskip("transformers", reason="transformers builds the tiny HF Llama")
tokenizers = pytest.importorskip("tokenizers")

# ASCII text, so that the bytes a token stands for are exactly the bytes of its decoded text.
SENTENCES = [
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Most of the orchard was planted by a family who left long ago.",
    "On quiet mornings the fog rolls down from the hills and settles over the fields.",
    "The library keeps its maps in wide drawers that squeak when someone opens them.",
    "Bakers in the market square start work while the streets are still dark.",
    "In 1999 the committee met 12 times and argued about 345 benches.",
]
TEXT = "\n".join(SENTENCES * 12) + "\n"


def _train_tokenizer(folder: Path) -> Path:
    return train_byte_bpe(folder, SENTENCES)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-bpe")
    save_tiny_llama(folder, context=256)
    _train_tokenizer(folder)
    (folder / "text.txt").write_text(TEXT)
    return folder


def _reference_ids(folder: Path, text: str) -> list[int]:
    """Ids straight from the tokenizers library, without diffquant's wrapper."""
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


class Recorder:
    """Records the ids that reach the model's embedding."""

    def __init__(self, model) -> None:
        self.calls: list[torch.Tensor] = []
        self.handle = model.embed.register_forward_pre_hook(
            lambda m, args: self.calls.append(args[0].clone())
        )

    def close(self) -> None:
        self.handle.remove()


def test_hf_folder_brings_its_tokenizer(hf_folder):
    model = load_model(f"hf:{hf_folder}")
    tok = model.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    eos = tok.backend.token_to_id("<|endoftext|>")
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (tok.backend.token_to_id("<|bos|>"), eos, False)
    assert tok.encode(TEXT) == _reference_ids(hf_folder, TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    # Bytes per id: every non-special token's decoded text, measured by decoding it alone.
    lengths = tok.byte_lengths()
    backend = tokenizers.Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    for i in range(tok.vocab_size):
        want = 0 if i in (eos, tok.bos_id) else len(backend.decode([i]).encode("latin-1", "replace"))
        if i not in (eos, tok.bos_id) and "\ufffd" in backend.decode([i]):
            continue  # a lone byte of a multi-byte character decodes to U+FFFD; its length is 1 byte
        assert int(lengths[i]) == want, (i, backend.id_to_token(i))


def test_profile_windows_are_the_tokenizers_ids(hf_folder, tmp_path):
    from diffquant.profile.runner import profile_stage

    model = load_model(f"hf:{hf_folder}")
    rec = Recorder(model)
    header, _, n = profile_stage(
        {"bpe": (f"hf:{hf_folder}", model)},
        data=str(hf_folder / "text.txt"),
        tokens=256,
        seq_len=64,
        batch_size=2,
        sites=["kind:resid"],
        topk=4,
        attention=False,
        out=tmp_path,
    )
    rec.close()
    # One document: its ids, then EOS (the tokenizer's framing; no BOS: add_bos_token is false).
    stream = _reference_ids(hf_folder, TEXT) + [model.tokenizer.eos_id]
    fed = torch.cat([c for c in rec.calls if c.shape[1] == 64]).flatten().tolist()
    assert fed[:256] == stream[:256]
    profile = json.loads((tmp_path / "profile" / "bpe.json").read_text())
    assert profile["meta"]["tokens"] == 256 and profile["meta"]["tokenizer"].endswith("tokenizer.json")
    assert profile["meta"]["bytes"] == len(model.tokenizer.decode(stream[:256]).encode())
    assert "256 tokens" in header and f"{profile['meta']['bytes']:,} bytes" in header


def test_perplexity_equals_transformers_on_the_same_windows(hf_folder):
    from diffquant.eval.perplexity import evaluate_bpb

    model = load_model(f"hf:{hf_folder}")
    r = evaluate_bpb(model, str(hf_folder / "text.txt"), max_tokens=3 * 64 + 10, seq_len=64)
    assert r["windows"] == "disjoint" and r["n_windows"] == 3 and r["n_tokens_scored"] == 3 * 63
    ids = torch.tensor(_reference_ids(hf_folder, TEXT)[: 3 * 64]).view(3, 64)
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_folder).eval()
    with torch.no_grad():
        loss = reference(ids, labels=ids).loss.item()  # mean NLL over the 3 x 63 targets
    assert r["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
    n_bytes = sum(len(model.tokenizer.decode(row[1:].tolist()).encode()) for row in ids)
    assert r["n_bytes"] == n_bytes
    assert r["bits_per_byte"] == pytest.approx(loss * 3 * 63 / math.log(2) / n_bytes, rel=1e-4)


def test_calibration_reads_the_tokenizers_ids(hf_folder, tmp_path):
    from diffquant.io.quantize import quantize_checkpoint

    seen: list[torch.Tensor] = []
    original = torch.nn.Embedding.forward

    def spy(self, ids):
        seen.append(ids.clone())
        return original(self, ids)

    torch.nn.Embedding.forward = spy
    try:
        quantize_checkpoint(
            f"hf:{hf_folder}",
            "w8a8-tensor",
            calib_data=str(hf_folder / "text.txt"),
            calib_tokens=128,
            eval_tokens=64,
            seq_len=64,
            batch_size=4,
            out=tmp_path / "q",
        )
    finally:
        torch.nn.Embedding.forward = original
    stream = _reference_ids(hf_folder, TEXT)
    fed = seen[0].flatten().tolist()
    assert fed == stream[: len(fed)] and len(fed) >= 128
    quantized = load_model(tmp_path / "q")
    assert isinstance(quantized.tokenizer, HFTokenizer)
    assert quantized.tokenizer.encode(TEXT) == stream


def test_multiple_choice_encodes_like_lm_eval(hf_folder, tmp_path):
    from diffquant.eval.multiple_choice import MCItem, evaluate_mc

    model = load_model(f"hf:{hf_folder}")
    items = [MCItem("The river bends twice before it", ["reaches the old mill", "argued about benches"], 0)]
    rec = Recorder(model)
    evaluate_mc(model, items, batch_size=1)
    rec.close()
    fed = sorted((c[0].tolist() for c in rec.calls), key=len)
    for ending in items[0].endings:
        # lm-eval: continuation = encode(ctx + " " + ending)[len(encode(ctx)):]; the model reads all but
        # the last token (no BOS: the tokenizer adds none).
        whole = _reference_ids(hf_folder, items[0].ctx + " " + ending)
        assert whole[:-1] in fed
    assert len(fed) == 2


def test_retrieval_reads_prompts_in_tokens(hf_folder):
    from diffquant.eval.retrieval import RetrievalConfig, encode_prompt, evaluate_retrieval, make_samples

    model = load_model(f"hf:{hf_folder}")
    cfg = RetrievalConfig(depths=(0, 100), samples_per_depth=1, context_bytes=200)
    samples = make_samples(cfg)
    rec = Recorder(model)
    result = evaluate_retrieval(model, cfg, batch_size=1, attention=True)
    rec.close()
    assert 0 <= result["acc_rank"] <= 1 and result["answer_mass"] is not None
    prompts = [_reference_ids(Path(str(model.tokenizer.name)).parent, s.prompt) for s in samples]
    fed = [c[0].tolist() for c in rec.calls]
    for prompt, sample in zip(prompts, samples, strict=True):
        assert prompt in fed
        ids, (lo, hi), last = encode_prompt(sample, model.tokenizer)
        assert ids == prompt and last == len(prompt) - 1
        digits = sample.prompt[sample.digits[0] : sample.digits[1]]
        assert digits.isdigit() and digits in model.tokenizer.decode(ids[lo:hi])
        assert digits not in model.tokenizer.decode(ids[lo + 1 : hi]) + model.tokenizer.decode(
            ids[lo : hi - 1]
        )


def test_native_checkpoint_keeps_the_tokenizer(hf_folder, tmp_path, capsys):
    assert main(["export", f"hf:{hf_folder}", "--to", "native", str(tmp_path / "native")]) == 0
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["tokenizer"] == "tokenizer.json"
    model = load_model(tmp_path / "native")
    assert model.tokenizer.encode(TEXT) == _reference_ids(hf_folder, TEXT)
    assert (model.tokenizer.bos_id, model.tokenizer.eos_id) == (301 - 300, 0)
    # and back to HF: transformers' own tokenizer reads the exported folder with the same ids
    assert main(["export", str(tmp_path / "native"), "--to", "hf", str(tmp_path / "hf")]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == _reference_ids(hf_folder, TEXT)
    assert auto.eos_token == "<|endoftext|>"
    byte_model = load_model("init:baseline:tiny")
    assert isinstance(model_tokenizer(byte_model), ByteTokenizer)


def test_windows_differ_per_tokenizer_but_text_is_the_same(hf_folder):
    bpe = load_tokenizer(hf_folder)
    by_bpe = token_windows(str(hf_folder / "text.txt"), 128, 64, bpe)
    by_byte = token_windows(str(hf_folder / "text.txt"), 128, 64, ByteTokenizer())
    assert bpe.decode(by_bpe.flatten().tolist()).startswith(
        ByteTokenizer().decode(by_byte.flatten().tolist())
    )


# -------------------------------------------------------------------------------------------- errors
def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err


def test_model_without_tokenizer_is_refused(hf_folder, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_folder / name).read_bytes())
    out = tmp_path / "run"
    assert main(["profile", f"hf:{bare}", "--data", str(hf_folder / "text.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert f"hf:{bare}" in err and "vocab_size 320" in err and "--tokenizer" in err
    assert not out.exists()
    # with --tokenizer it runs, on the given tokenizer's ids
    assert main(
        ["profile", f"hf:{bare}", "--tokenizer", str(hf_folder), "--data", str(hf_folder / "text.txt"),
         "--tokens", "128", "--seq-len", "64", "--sites", "kind:resid", "--out", str(out)]
    ) == 0  # fmt: skip
    assert "128 tokens" in capsys.readouterr().out
    with pytest.raises(DiffquantError, match="not the byte vocabulary"):
        model_tokenizer(load_model(f"hf:{bare}"), "bare")


def test_tokenizer_that_does_not_fit_the_embedding_is_refused(hf_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["profile", "init:baseline:tiny", "--tokenizer", str(hf_folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "produces ids up to 299" in err and "vocab_size 259" in err and not out.exists()


def test_broken_tokenizer_json_is_one_line(hf_folder, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    out = tmp_path / "run"
    assert main(["profile", f"hf:{hf_folder}", "--tokenizer", str(broken), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "not a valid tokenizer.json" in err and str(broken) in err and not out.exists()
    assert main(["info", f"hf:{hf_folder}", "--tokenizer", str(tmp_path / "nowhere")]) == 2
    _one_line(capsys.readouterr().err)


def test_recipe_tokenizer_key_and_bf16_on_cpu(hf_folder, tmp_path, capsys):
    import yaml

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_folder / name).read_bytes())
    task = {"type": "ppl", "data": str(hf_folder / "text.txt"), "tokens": 192, "seq_len": 64}
    recipe = {
        "name": "tok",
        "models": {"bare": f"hf:{bare}"},
        "tokenizer": {"bare": str(hf_folder)},
        "dtype": "bfloat16",
        "eval": {"tasks": [task]},
        "plots": {"enabled": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "bare reads tokenizer" in out and "tokenizer.json (300 ids)" in out
    cells = [json.loads(line) for line in (tmp_path / "run" / "sweep" / "cells-rank0.jsonl").open()]
    bf16 = cells[0]["metrics"]
    # The same windows in fp32 with the folder's own tokenizer: bf16 on CPU runs and stays close.
    from diffquant.eval.perplexity import evaluate_bpb

    fp32 = evaluate_bpb(load_model(f"hf:{hf_folder}"), task["data"], max_tokens=192, seq_len=64)
    assert bf16["n_tokens_scored"] == fp32["n_tokens_scored"] == 3 * 63
    assert bf16["perplexity"] == pytest.approx(fp32["perplexity"], rel=0.05)
    assert bf16["perplexity"] != fp32["perplexity"]  # it really ran in bf16
    # without the key the recipe is refused in one line
    recipe.pop("tokenizer")
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path), "--out", str(tmp_path / "run2")]) == 2
    _one_line(capsys.readouterr().err)


def test_empty_tokenizer_path_is_refused(hf_folder, tmp_path, capsys, monkeypatch):
    """`--tokenizer ''` (an unset shell variable) is not "no override" and not the working folder (Path('')
    is '.', which may hold some other tokenizer.json): every command refuses it in one line."""
    monkeypatch.chdir(hf_folder)  # a folder with a tokenizer.json that '' must not pick up
    with pytest.raises(DiffquantError, match="empty path"):
        load_tokenizer("")
    text = str(hf_folder / "text.txt")
    for argv in (
        ["profile", "init:baseline:tiny", "--data", text, "--tokens", "64", "--seq-len", "32", "--out"],
        ["eval", "init:baseline:tiny", "--task", f"bpb:data={text},tokens=64,seq_len=32", "--out"],
        ["quantize", "init:baseline:tiny", "--plan", "w8a8-tensor", "--calib-data", text, "--out"],
    ):
        out = tmp_path / argv[0]
        assert main([*argv, str(out), "--tokenizer", ""]) == 2, argv
        err = capsys.readouterr().err
        _one_line(err)
        assert "tokenizer ''" in err and "empty path" in err and not out.exists()
    assert main(["info", "init:baseline:tiny", "--tokenizer", ""]) == 2
    assert "empty path" in capsys.readouterr().err


def test_info_reports_a_tokenizer_that_does_not_fit_the_embedding(hf_folder, tmp_path, capsys):
    """A checkpoint whose own tokenizer has more ids than its embedding rows: every stage refuses it, and
    `info` (which describes a model rather than running it) says so, not "none"."""
    native = tmp_path / "native"
    assert main(["init", str(native)]) == 0  # vocab_size 259 (bytes)
    (native / "tokenizer.json").write_bytes((hf_folder / "tokenizer.json").read_bytes())
    config = json.loads((native / "config.json").read_text())
    (native / "config.json").write_text(json.dumps({**config, "tokenizer": "tokenizer.json"}))
    capsys.readouterr()
    assert main(["info", str(native)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tokenizer"))
    assert "unusable" in line and "produces ids up to 299" in line and "vocab_size 259" in line
    assert main(["info", str(native), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)["tokenizer"]
    assert described.startswith("unusable") and "vocab_size 259" in described
    out = tmp_path / "run"
    assert main(["profile", str(native), "--out", str(out)]) == 2
    assert "produces ids up to 299" in capsys.readouterr().err and not out.exists()
    # a model that brings no tokenizer is still "none"
    bare = load_model("init:baseline:tiny")
    assert main(["info", "init:baseline:tiny"]) == 0
    assert "tokenizer    byte (259 ids)" in capsys.readouterr().out and bare.tokenizer is None
