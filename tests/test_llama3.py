"""Llama-3 family import: ``llama3`` and ``linear`` RoPE scaling, head_dim != hidden / heads, tied embeddings.

Every exactness test builds a tiny random ``LlamaConfig`` here, saves it with ``save_pretrained``, imports it
with ``load_model("hf:...")`` and compares against transformers' own ``LlamaForCausalLM`` (fp32, eager):
logits to 1e-5 relative (max |diff| / max |logit|), greedy tokens through the KV cache, and the export round
trip. The llama3 configs use a short original context (32) and 48-token inputs so that all three frequency
bands of the llama3 rule are exercised (the band test asserts that), and positions run past the original
context. transformers is a test-only dependency: without it these tests skip.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.io import load_model, save_checkpoint
from diffquant.io.convert_hf import export_hf
from diffquant.models import ModelConfig
from diffquant.models.attention import rope_inv_freq

VOCAB = 100
SEQ = 48
REL_TOL = 1e-5
# Original context 32 with low/high factors 1/4: wavelengths > 32 are divided, < 8 kept, 8..32 blended.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}

# name -> LlamaConfig overrides (hidden 64, 4 heads, 2 kv heads unless stated).
CASES = {
    "llama3": {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0}},
    "linear": {"rope_parameters": {**LINEAR, "rope_theta": 10000.0}},
    "head_dim24": {"head_dim": 24},
    "tied": {"tie_word_embeddings": True},
    "llama3-d24-tied": {
        "head_dim": 24,
        "tie_word_embeddings": True,
        "rope_parameters": {**LLAMA3, "rope_theta": 500.0},
    },
}


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is needed for the Llama-3 import tests")


def _scramble(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations: default inits give near-uniform logits, where greedy decoding (and a relative
    tolerance) would be decided by rounding rather than by the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def _llama(overrides: dict, seed: int = 0):
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    _scramble(model, seed)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """name -> (transformers model, its save_pretrained folder)."""
    _transformers()
    out = {}
    for i, (name, overrides) in enumerate(CASES.items()):
        model = _llama(overrides, seed=i)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def _ids(length: int = SEQ, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref - got).abs().max() / ref.abs().max()).item()


def _rewrite_config(src: Path, dst: Path, edit) -> Path:
    """A copy of ``src`` whose config.json dict went through ``edit`` (which changes it in place)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ============================================================================================ frequencies
def _bands(head_dim: int, theta: float, scaling: dict) -> tuple[list[int], list[int], list[int]]:
    """Channel pairs of the llama3 rule's kept / blended / divided bands, from the plain wavelengths."""
    n = scaling["original_max_position_embeddings"]
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    kept = [i for i, w in enumerate(wavelengths) if w < n / scaling["high_freq_factor"]]
    divided = [i for i, w in enumerate(wavelengths) if w > n / scaling["low_freq_factor"]]
    blended = [i for i in range(head_dim // 2) if i not in kept and i not in divided]
    return kept, blended, divided


@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (24, 500.0)])
def test_llama3_frequencies_hit_every_band(head_dim, theta):
    """The test configs put channels in all three bands, and each band follows its own rule."""
    kept, blended, divided = _bands(head_dim, theta, LLAMA3)
    assert kept and blended and divided, (kept, blended, divided)
    plain = rope_inv_freq(head_dim, theta)
    scaled = rope_inv_freq(head_dim, theta, LLAMA3)
    assert scaled.dtype == torch.float64
    assert torch.equal(scaled[kept], plain[kept])
    assert torch.allclose(scaled[divided], plain[divided] / LLAMA3["factor"], rtol=1e-15, atol=0)
    # blended channels lie strictly between the two rules, and their wavelengths cross 1 turn in 48 tokens
    assert (scaled[blended] < plain[blended]).all()
    assert (scaled[blended] > plain[blended] / LLAMA3["factor"]).all()
    assert LLAMA3["original_max_position_embeddings"] < SEQ  # the inputs run past the original context


def test_llama3_frequencies_match_transformers():
    """Frequencies equal transformers' (fp32) to fp32 rounding, at Llama 3.1 8B's real parameters too, and
    transformers applies no amplitude factor (attention_factor 1) for either type."""
    tf = _transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    meta_8b = {**LLAMA3, "original_max_position_embeddings": 8192}
    for scaling, head_dim, theta in ((LLAMA3, 16, 1e4), (meta_8b, 128, 5e5), (LINEAR, 24, 1e4)):
        config = tf.LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            head_dim=head_dim,
            max_position_embeddings=131072,
            rope_parameters={**scaling, "rope_theta": theta},
        )
        ref, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
        ours = rope_inv_freq(head_dim, theta, scaling)
        assert attention_factor == 1.0
        assert ((ours - ref.double()).abs() / ours).max().item() < 1e-6


# ================================================================================================ import
@pytest.mark.parametrize("name", list(CASES))
def test_import_matches_transformers(folders, name):
    hf_model, folder = folders[name]
    native = load_model(f"hf:{folder}")
    overrides = CASES[name]
    rope = overrides.get("rope_parameters", {})
    expected_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    assert native.config.rope_scaling == expected_scaling
    assert native.config.head_dim == overrides.get("head_dim", 16)
    if overrides.get("tie_word_embeddings"):
        assert native.config.tie_embeddings and native.lm_head.weight is native.embed.weight
    ids = _ids()
    with torch.no_grad():
        ref, got = hf_model(ids).logits, native(ids)
    rel = _rel_diff(ref, got)
    print(f"{name}: max rel logit diff {rel:.2e}")
    assert rel < REL_TOL, rel


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_matches_transformers(folders, name):
    """The KV-cache path (one new position per step, past the original context) decodes like transformers."""
    hf_model, folder = folders[name]
    native = load_model(f"hf:{folder}")
    prompt = _ids(SEQ - 8, seed=2)
    with torch.no_grad():
        ref = hf_model.generate(prompt, max_new_tokens=8, do_sample=False)
        got = native.generate(prompt, 8)
    assert ref.shape == (2, SEQ)
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    "name, rope_scaling",
    [
        ("llama3", {**LLAMA3}),  # the Llama 3.1 release config.json spelling
        ("linear", {"type": "linear", "factor": 4}),  # transformers < 4.43 spelling, integer factor
        ("linear", {"type": "linear", "rope_type": "linear", "factor": 4.0}),  # what 4.4x saves
    ],
)
def test_transformers_4x_spelling(folders, tmp_path, name, rope_scaling):
    """A 4.x config.json (top-level rope_theta + rope_scaling, no rope_parameters) imports to the same model."""
    hf_model, folder = folders[name]
    theta = CASES[name]["rope_parameters"]["rope_theta"]

    def to_4x(cfg: dict) -> None:
        cfg.pop("rope_parameters")
        cfg.update(rope_theta=theta, rope_scaling=rope_scaling)

    old = _rewrite_config(folder, tmp_path / "v4", to_4x)
    native, reference = load_model(f"hf:{old}"), load_model(f"hf:{folder}")
    assert native.config == reference.config
    ids = _ids()
    with torch.no_grad():
        assert _rel_diff(hf_model(ids).logits, native(ids)) < REL_TOL


# ================================================================================================ export
@pytest.mark.parametrize("name", ["llama3-d24-tied", "linear"])
def test_export_round_trip(folders, tmp_path, name):
    """hf -> native -> export_hf -> transformers from_pretrained: same logits; config.json has both spellings."""
    tf = _transformers()
    hf_model, folder = folders[name]
    native = load_model(f"hf:{folder}")
    out = export_hf(native, tmp_path / "exported")
    cfg = json.loads((out / "config.json").read_text())
    scaling = native.config.rope_scaling
    assert cfg["rope_parameters"] == {**scaling, "rope_theta": native.config.rope_theta}
    assert cfg["rope_scaling"] == {"type": scaling["rope_type"], **scaling}
    back = tf.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert back.config.rope_parameters["rope_type"] == scaling["rope_type"]
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        rel_export, rel_native = _rel_diff(ref, back(ids).logits), _rel_diff(ref, native(ids))
    print(f"{name}: export round trip max rel diff {rel_export:.2e} (native {rel_native:.2e})")
    assert rel_export < REL_TOL, rel_export
    again = load_model(f"hf:{out}")
    assert again.config == native.config


def test_diffllama_with_llama3_rope(tmp_path):
    """DiffLlama shares Llama's rotary embedding, so scaled RoPE imports and exports for DIFF V1 too."""
    tf = _transformers()
    config = tf.DiffLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,  # 64 / 8 = 8 would leave the llama3 blend band empty (wavelengths 6.3, 63, ...)
        intermediate_size=96,
        max_position_embeddings=128,
        rope_parameters={**LLAMA3, "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(5)
    hf_model = tf.DiffLlamaForCausalLM(config).eval()
    _scramble(hf_model, 5)
    hf_model.save_pretrained(tmp_path / "diff")
    native = load_model(f"hf:{tmp_path / 'diff'}")
    assert native.config.attention == "diff_v1" and native.config.rope_scaling == LLAMA3
    out = export_hf(native, tmp_path / "exported")
    back = tf.DiffLlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        rel_native, rel_export = _rel_diff(ref, native(ids)), _rel_diff(ref, back(ids).logits)
    print(f"diffllama-llama3: max rel diff {rel_native:.2e} (export round trip {rel_export:.2e})")
    assert rel_native < REL_TOL and rel_export < REL_TOL, (rel_native, rel_export)


def test_native_checkpoint_keeps_scaling(folders, tmp_path):
    """rope_scaling survives the native checkpoint (config JSON) round trip; old configs without it load."""
    native = load_model(f"hf:{folders['llama3'][1]}")
    save_checkpoint(native, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == native.config and loaded.config.rope_scaling == LLAMA3
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids), native(ids))
    old = native.config.to_dict()
    del old["rope_scaling"]
    assert ModelConfig.from_dict(old).rope_scaling is None
    assert ModelConfig.from_json(native.config.to_json()) == native.config


# ============================================================================================ bad inputs
@pytest.mark.parametrize(
    "key, value, match",
    [
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, r'rope_type = "yarn"'),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, r'rope_type = "dynamic"'),
        ("rope_scaling", {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}, r'rope_type = "su"'),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, r'rope_type = "longrope"'),
        (
            "rope_scaling",
            {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"},
            "missing low_freq_factor",
        ),
        ("rope_parameters", {**LLAMA3, "rope_theta": 1e4, "beta_fast": 32}, r"unknown key\(s\) beta_fast"),
        ("rope_scaling", {"type": "linear", "rope_type": "llama3", "factor": 2.0}, "disagree"),
        ("rope_scaling", {**LLAMA3, "low_freq_factor": 4.0}, "low_freq_factor < high_freq_factor"),
        ("rope_scaling", {"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1"),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial",
        ),
        ("rope_scaling", [1, 2], "expected an object or null"),
    ],
)
def test_bad_rope_configs(folders, tmp_path, key, value, match):
    folder = _rewrite_config(folders["head_dim24"][1], tmp_path / "bad", lambda cfg: cfg.update({key: value}))
    with pytest.raises(DiffquantError, match=match) as excinfo:
        load_model(f"hf:{folder}")
    message = _one_line(excinfo)
    assert str(folder / "config.json") in message and key in message
    if "rope_type =" in match:
        assert "supported rope types: default, linear, llama3" in message


def test_conflicting_rope_spellings(folders, tmp_path):
    """rope_scaling and rope_parameters (or two RoPE bases) that disagree make the file ambiguous."""
    folder = folders["llama3"][1]
    linear = _rewrite_config(folder, tmp_path / "two", lambda cfg: cfg.update(rope_scaling=LINEAR))
    with pytest.raises(DiffquantError, match="describe different RoPE scalings") as excinfo:
        load_model(f"hf:{linear}")
    _one_line(excinfo)
    theta = _rewrite_config(folder, tmp_path / "theta", lambda cfg: cfg.update(rope_theta=20000.0))
    with pytest.raises(DiffquantError, match="disagree; expected one RoPE base") as excinfo:
        load_model(f"hf:{theta}")
    _one_line(excinfo)
    # the same scaling in both places, as export writes it, is fine
    same = _rewrite_config(folder, tmp_path / "same", lambda cfg: cfg.update(rope_scaling=dict(LLAMA3)))
    assert load_model(f"hf:{same}").config.rope_scaling == LLAMA3


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "yarn", "factor": 2.0}, "rope_type 'yarn' is not one of linear, llama3"),
        ({"rope_type": "linear"}, r"linear needs key\(s\) factor"),
        ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "linear takes only factor"),
        ({**LLAMA3, "original_max_position_embeddings": 32.5}, "original_max_position_embeddings must be"),
        ("linear", "got a str"),
    ],
)
def test_model_config_validates_rope_scaling(scaling, match):
    with pytest.raises(DiffquantError, match=match) as excinfo:
        ModelConfig(rope_scaling=scaling)
    assert _one_line(excinfo).startswith("model config: field 'rope_scaling' = ")
    with pytest.raises(DiffquantError, match=r"ckpt/config.json: field 'rope_scaling'"):
        ModelConfig.from_dict({"rope_scaling": scaling}, source="ckpt/config.json")
