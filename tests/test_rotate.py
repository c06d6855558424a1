"""Rotation (QuaRot / SpinQuant R1-R4) as a plan transform: Hadamard matrices, exactness, plans, checkpoints.

Exactness is the whole point of computational invariance: with no quantizer, a rotated model computes the
same function. Each check compares logits with the unrotated model's (float64: 1e-12, float32: 1e-5).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import tiny_model

from diffquant.errors import DiffquantError
from diffquant.io import load_model
from diffquant.io.checkpoint import save_checkpoint
from diffquant.io.quantized import load_quantized, save_quantized
from diffquant.quant import QuantPlan, apply_plan, preset
from diffquant.quant import hadamard as H
from diffquant.quant.rotate import RotateSpec, rotate_model

PLACES_ALL = RotateSpec(residual="hadamard", heads="hadamard", ffn="hadamard", qk="hadamard")
RANDOM_ALL = RotateSpec(residual="random", heads="random", ffn="random", qk="random", seed=7)


# ------------------------------------------------------------------------------------------- Hadamard
def _sylvester_entry(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """H_{2^m}[i, j] = (-1)^popcount(i & j): Sylvester's matrix written from its closed form."""
    bits = i[:, None] & j[None, :]
    count = torch.zeros_like(bits)
    while bool(bits.any()):
        count += bits & 1
        bits = bits >> 1
    return 1 - 2 * (count % 2)


def test_sylvester_equals_its_closed_form():
    for m in range(0, 11):
        n = 2**m
        idx = torch.arange(n)
        assert torch.equal(H.sylvester(n), _sylvester_entry(idx, idx))


def test_every_base_matrix_is_hadamard_exactly():
    """Every H_K any size up to 16384 is built from: entries +-1 and H H^T = K I in integers (checked here
    again, independently of the check the module runs when it builds one)."""
    bases = {H.hadamard_factors(n)[0] for n in range(1, 16385) if H.has_hadamard(n)}
    assert {12, 20, 28, 36, 44, 52, 60, 108, 140} <= bases  # QuaRot's K (40 = 2 * 20 is built as 20 * 2)
    for k in sorted(bases):
        h = H._base(k)
        assert h.dtype == torch.int64 and bool((h.abs() == 1).all()), k
        gram = h.double() @ h.double().T
        assert torch.equal(gram, k * torch.eye(k, dtype=torch.float64)), k


@pytest.mark.parametrize("n", [*range(1, 257), 576, 640, 1536, 2048, 4096])
def test_dense_hadamard_is_orthogonal_and_the_fast_transform_equals_it(n):
    if not H.has_hadamard(n):
        with pytest.raises(DiffquantError, match=f"size {n}: no Hadamard matrix"):
            H.hadamard(n)
        return
    h = H.hadamard(n)
    assert bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(H.fast_hadamard(x, normalise=False), x @ h.T, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(H.fast_hadamard(x), x @ h.T / math.sqrt(n), rtol=1e-12, atol=1e-11)


@pytest.mark.parametrize("n", [8192, 14336, 16384])
def test_fast_transform_columns_at_large_sizes(n):
    """Too large for a dense product: the transform of unit vectors e_j is column j of H_K (x) H_2^m,
    each entry from the closed forms (H_K[a, a'] * (-1)^popcount(b & b'))."""
    k, power = H.hadamard_factors(n)
    cols = torch.tensor(sorted({0, 1, power - 1, power % n, n - 1, n // 3}))
    e = torch.zeros(len(cols), n, dtype=torch.float64)
    e[torch.arange(len(cols)), cols] = 1
    got = H.fast_hadamard(e, normalise=False)  # row r = H_n e_j = column j of H_n
    rows = torch.arange(n)
    want = H._base(k)[rows // power][:, cols // power].double() * _sylvester_entry(rows % power, cols % power)
    assert torch.equal(got, want.T)


def test_the_sizes_of_real_models():
    """SmolLM2 (576, 1536, head 64), Gemma-3-270M (640, 2048, head 256), Llama (4096, 14336)."""
    for n, k in {576: 36, 1536: 12, 640: 20, 2048: 1, 4096: 1, 14336: 28, 64: 1, 256: 1}.items():
        assert H.hadamard_factors(n)[0] == k, n
    assert not H.has_hadamard(156) and not H.has_hadamard(172)  # Williamson orders: not built here


# ------------------------------------------------------------------------------------------ exactness
def _scrambled(kind: str, dtype: torch.dtype, tie: bool = False, seed: int = 0, **overrides):
    """A tiny model with norm weights far from 1 (a fold that forgets a norm must show) and the DIFF V1
    lambda vectors non-zero."""
    model = tiny_model(kind, seed=seed, tie_embeddings=tie, **overrides).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def _ids(vocab: int, t: int = 24, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize(
    "spec", [RotateSpec(), PLACES_ALL, RANDOM_ALL], ids=["quarot", "all-hadamard", "random"]
)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tie", [False, True])
def test_rotated_logits_equal_the_original(kind, spec, dtype, tol, tie):
    model = _scrambled(kind, dtype, tie=tie)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        want = model(ids)
        report = dict(rotate_model(model, spec))
        got = model(ids)
    assert _rel(got, want) < tol
    assert ("embeddings" in report) == tie and model.config.tie_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()
    # the rotation really changed the weights (a no-op transform would pass the equality above)
    assert "residual (R1)" in report


def test_rotation_changes_every_rotated_weight_and_spreads_a_massive_channel():
    """Not a no-op: every reader, writer, the embedding and the head change; a residual with one massive
    channel comes out of R1 with its top |x| over sqrt(d) times smaller (a Hadamard spreads it evenly)."""
    model = _scrambled("baseline", torch.float64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rotate_model(model, RotateSpec())
    for name, p in model.named_parameters():
        if name.endswith(".weight") and "norm" not in name and "lambda" not in name:
            assert not torch.allclose(p, before[name]), name
    d = model.config.d_model
    x = torch.zeros(d, dtype=torch.float64)
    x[5] = 1000.0
    q = H.hadamard(d).T / math.sqrt(d)
    assert float((x @ q).abs().max()) == pytest.approx(1000.0 / math.sqrt(d))


def test_decoding_with_a_cache_is_unchanged_by_rotation(kind):
    """R3 rotates K before the cache: cached decoding (fewer queries than keys) still equals the full pass."""
    model = _scrambled(kind, torch.float64)
    ids = _ids(model.config.vocab_size, t=12)
    with torch.no_grad():
        want = model(ids)
        rotate_model(model, PLACES_ALL)
        cache = model.new_cache()
        model(ids[:, :7], cache)
        step = model(ids[:, 7:], cache)
    assert _rel(step, want[:, 7:]) < 1e-12


@pytest.mark.parametrize("kind_name", ["baseline", "diff_v1", "diff_v2"])
def test_zoo_models_rotate_exactly(kind_name):
    model = load_model(f"zoo:{kind_name}", dtype=torch.float64)
    ids = _ids(model.config.vocab_size, t=64)
    with torch.no_grad():
        want = model(ids)
        rotate_model(model, RotateSpec(qk="hadamard"))
        assert _rel(model(ids), want) < 1e-12


@pytest.mark.parametrize("model_type", ["llama", "diffllama"])
def test_hf_llama_and_diffllama_rotate_exactly(tmp_path, model_type):
    tf = pytest.importorskip("transformers")
    cfg_cls = tf.DiffLlamaConfig if model_type == "diffllama" else tf.LlamaConfig
    model_cls = tf.DiffLlamaForCausalLM if model_type == "diffllama" else tf.LlamaForCausalLM
    config = cfg_cls(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids(300)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        model = load_model(f"hf:{tmp_path / 'hf'}", dtype=dtype)
        with torch.no_grad():
            want = model(ids)
            rotate_model(model, PLACES_ALL)
            assert _rel(model(ids), want) < tol


# ---------------------------------------------------------------------------------------------- plans
def test_rotate_key_is_schema_checked():
    base = {"rules": [{"sites": ["layers.*.input"], "scheme": "int8:token"}]}
    cases = {
        "hadamrd": ({"residual": "hadamrd"}, "rotate.residual: expected one of 'hadamard', 'random', 'none'"),
        "unknown": ({"r1": "hadamard"}, "rotate: unknown key 'r1'"),
        "bool seed": ({"seed": True}, "rotate.seed: expected an integer"),
        "block 0": ({"hadamard_block": 0}, "rotate.hadamard_block"),
        "not a mapping": ("hadamard", "rotate: expected a mapping"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(DiffquantError, match=message.replace("(", r"\(")) as err:
            QuantPlan.from_dict({**base, "rotate": value})
        assert "\n" not in str(err.value), name
    with pytest.raises(DiffquantError, match="rotate: works with fake-quant rules only"):
        QuantPlan.from_dict({"backend": {"name": "quanto"}, "rotate": {}})
    plan = QuantPlan.from_dict({**base, "rotate": {"qk": "random", "seed": 3}})
    assert QuantPlan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    assert plan.to_dict()["rotate"] == {
        "residual": "hadamard",
        "heads": "hadamard",
        "ffn": "hadamard",
        "qk": "random",
        "seed": 3,
        "hadamard_block": None,
    }


def test_a_size_without_hadamard_is_refused_before_anything_changes():
    """ffn 156 has no Hadamard matrix here: refused in one line, the model untouched; block 4 or random run."""
    model = _scrambled("baseline", torch.float64, ffn_dim=156, tie=True)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(DiffquantError, match=r"rotate.ffn: size 156 has no Hadamard matrix") as err:
        apply_plan(model, preset("w8a8-quarot"))
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    # not even untied: the head still is the embedding, the config still says tied, nothing marked rotated
    assert model.lm_head.weight is model.embed.weight and model.config.tie_embeddings
    assert getattr(model, "rotation", None) is None
    assert model.quant_plan is None if hasattr(model, "quant_plan") else True
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        want = model(ids)
        report = dict(rotate_model(model, dataclasses.replace(RotateSpec(), hadamard_block=4)))
        assert _rel(model(ids), want) < 1e-12
    assert report["ffn (R4, online before mlp.down)"].startswith("block-diagonal hadamard 39 x 4")
    with pytest.raises(DiffquantError, match="block 8 does not divide it"):
        rotate_model(_scrambled("baseline", torch.float64, ffn_dim=156), RotateSpec(hadamard_block=8))


def test_rotating_a_quantized_or_rotated_model_is_refused():
    model = _scrambled("baseline", torch.float32)
    apply_plan(model, preset("w8a8"))
    with pytest.raises(DiffquantError, match="already quantized"):
        rotate_model(model, RotateSpec())
    with pytest.raises(DiffquantError, match="already quantized"):
        apply_plan(model, preset("w8a8-quarot"))
    model = _scrambled("baseline", torch.float32)
    rotate_model(model, RotateSpec())
    with pytest.raises(DiffquantError, match="already rotated"):
        rotate_model(model, RotateSpec())


@pytest.mark.parametrize("name", ["w8a8-quarot", "w4a4-quarot", "w4a8-quarot-smooth"])
def test_rotated_quantized_checkpoint_reloads_exactly(tmp_path, kind, name):
    """Save + reload of a rotated quantized model: the weights are saved rotated, the plan records that, and
    the reloaded model's logits are bit-identical (the online rotations are attached, nothing rotated twice)."""
    from diffquant.quant import calibrate

    model = _scrambled(kind, torch.float32, tie=True)
    apply_plan(model, preset(name))
    ids = _ids(model.config.vocab_size)
    calibrate(model, ids, batch_size=2)
    with torch.no_grad():
        want = model(ids)
    save_quantized(model, tmp_path / "q")
    loaded = load_quantized(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(loaded(ids), want)
    assert loaded.config.tie_embeddings is False


def test_quantize_cli_names_the_rotation(tmp_path, capsys):
    from diffquant.cli import main

    save_checkpoint(_scrambled("diff_v2", torch.float32, vocab_size=259), tmp_path / "m")  # byte vocabulary
    assert (
        main(
            [
                "quantize",
                str(tmp_path / "m"),
                "--plan",
                "w4a8-quarot",
                "--calib-tokens",
                "256",
                "--eval-tokens",
                "256",
                "--seq-len",
                "64",
                "--out",
                str(tmp_path / "q"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rotated residual (R1): hadamard sylvester (32), d 32; norms folded into their readers" in out
    assert "rotated ffn (R4, online before mlp.down): hadamard" in out


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_rotates_exactly():
    """SmolLM2-135M (576 = 36 * 16, FFN 1536 = 12 * 128, 9 heads of 64, tied embeddings): the rotated model's
    logits equal the original's within 1e-5 relative in float32 (and 1e-12 in float64)."""
    from diffquant.data import token_stream
    from diffquant.io import fetch

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        model = load_model(f"gguf:{path}", dtype=dtype)
        ids = token_stream("wikitext2:test", 256, model.tokenizer).view(1, 256)
        with torch.no_grad():
            want = model(ids)
            report = dict(rotate_model(model, PLACES_ALL))
            got = model(ids)
        assert _rel(got, want) < tol, dtype
        assert report["residual (R1)"].startswith("hadamard paley2 q=17 (36) x sylvester (16), d 576")
        assert report["ffn (R4, online before mlp.down)"].startswith(
            "hadamard paley1 q=11 (12) x sylvester (128)"
        )
        assert "embeddings" in report  # SmolLM2 ties its head to the embedding


def test_rotation_alone_is_no_error_in_the_quantize_report(tmp_path):
    """The preset quarot rotates and quantizes nothing: the error report compares the rotated model with a
    reference rotated alike, so every site and the logits agree bit for bit (an unrotated reference
    would count the rotation itself as error at every site it changes)."""
    from diffquant.io.quantize import quantize_checkpoint

    save_checkpoint(_scrambled("diff_v1", torch.float32, vocab_size=259), tmp_path / "m")
    result = quantize_checkpoint(
        str(tmp_path / "m"),
        "quarot",
        calib_data=None,
        calib_tokens=256,
        eval_tokens=256,
        seq_len=64,
        batch_size=2,
        out=tmp_path / "q",
    )
    report = result["report"]
    assert report["logits"]["exact"] and all(row["exact"] for row in report.values()), report
    assert "rotated heads (R2)" in result["text"]
