"""Qwen2, Qwen3 and Mistral through `hf:` import and `export_hf`: logits equal transformers' own classes.

Each family is Llama plus ModelConfig fields: Qwen2 = q/k/v biases (``attention_bias``), Qwen3 = per-head q/k
RMSNorm before RoPE (``qk_norm``), Mistral = ``sliding_window``. The fixtures are random tiny models built with
transformers' classes (fp32, sdpa attention), scrambled so activations have unit scale and every bias and norm
weight is far from its init: a dropped bias or a misplaced norm moves the logits by far more than the tolerance.
Windows are shorter than the sequences, so a window off by one key changes the logits too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.io import load_model
from diffquant.io.convert_hf import export_hf
from diffquant.models import DecoderLM, ModelConfig
from diffquant.models.attention import _valid_mask

VOCAB = 300
SEQ = 40  # longer than every window below
RTOL = 1e-4  # max |diff| / max |logit|, fp32

# name -> (model_type, config overrides): 10 windowed layers with GQA and a tied head (Qwen2); head_dim 24
# != 64 / 4 and an eps large enough that the qk-norm's eps shows (Qwen3); MQA with a window of 6 (Mistral).
CASES = {
    "qwen2": (
        "qwen2",
        {
            "num_hidden_layers": 10,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 0,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3": (
        "qwen3",
        {
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "rms_norm_eps": 1e-3,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-window": (
        "qwen3",
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 11,
            "max_window_layers": 0,
            "tie_word_embeddings": True,
        },
    ),
    "mistral": (
        "mistral",
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 6,
            "tie_word_embeddings": False,
        },
    ),
}


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is needed for the HF family tests")


def _scramble(module: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations; norms near 1; biases of order one (a dropped bias shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def _hf_model(model_type: str, overrides: dict, seed: int, vocab: int = VOCAB):
    tf = _transformers()
    classes = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    cfg_cls, model_cls = classes[model_type]
    config = cfg_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        max_position_embeddings=128,
        rope_theta=5000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _scramble(model, seed)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """name -> (transformers model, its save_pretrained folder)."""
    _transformers()
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(CASES.items()):
        model = _hf_model(model_type, overrides, seed=i)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def _ids(length: int = SEQ, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ============================================================================================== import
@pytest.mark.parametrize("name", list(CASES))
def test_import_matches_transformers(folders, name):
    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    c, hf = model.config, hf_model.config
    assert (c.attention_bias, c.qk_norm) == (name == "qwen2", name.startswith("qwen3"))
    assert c.sliding_window == getattr(hf, "sliding_window", None)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen2 has no key
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, head_dim)
    assert c.tie_embeddings == hf.tie_word_embeddings and c.norm_eps == hf.rms_norm_eps
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert _rel(model(ids), ref) < RTOL
        model.set_attention_path("explicit", chunk_size=7)  # the map path, in query chunks
        assert _rel(model(ids), ref) < RTOL
        assert {a.last_path for a in model.attention_modules()} == {"explicit"}


@pytest.mark.parametrize("name", ["qwen2", "qwen3-window", "mistral"])
def test_window_changes_logits(folders, name):
    """The fixtures' windows matter: the same weights without a window give other logits."""
    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        windowed = model(ids)
        for attn in model.attention_modules():
            attn.window = None
        assert _rel(model(ids), windowed) > 1e-2


def test_valid_mask_window():
    """Query at p sees keys p - W < j <= p: W keys once p >= W - 1, prefill and decode rows alike."""
    full = _valid_mask(12, 12, 0, torch.device("cpu"), window=4)[0, 0]
    assert full.sum(-1).tolist() == [1, 2, 3, 4] + [4] * 8
    assert full[9].nonzero().flatten().tolist() == [6, 7, 8, 9]
    step = _valid_mask(1, 12, 11, torch.device("cpu"), window=4)[0, 0]
    assert torch.equal(step, full[11:])
    assert torch.equal(_valid_mask(5, 5, 0, torch.device("cpu"))[0, 0], torch.ones(5, 5).tril().bool())


def test_valid_mask_is_one_tensor_per_shape_until_changed(monkeypatch):
    """A forward's layers share one mask per (T, S, position, device, window) (a profile reads a mask's
    positions once per mask, a wait for a GPU): the same tensor again, a new one for other arguments, after
    an in-place change, or past the kept few; a mask too large to keep and one made under inference_mode
    (autograd cannot save its tensors later) are built each time. Every one is the mask its arguments say."""
    from diffquant.models import attention

    monkeypatch.setattr(attention, "_MASKS", {})
    cpu = torch.device("cpu")

    def fresh(*args):
        return attention._build_valid_mask(*args)

    a = _valid_mask(6, 6, 0, cpu)
    assert _valid_mask(6, 6, 0, cpu) is a and torch.equal(a, fresh(6, 6, 0, cpu, None))
    others = [_valid_mask(6, 6, 0, cpu, 3), _valid_mask(2, 6, 4, cpu), _valid_mask(6, 7, 1, cpu)]
    for m, args in zip(others, [(6, 6, 0, cpu, 3), (2, 6, 4, cpu, None), (6, 7, 1, cpu, None)], strict=True):
        assert m is not a and torch.equal(m, fresh(*args))
    assert _valid_mask(6, 6, 0, cpu) is a  # four kept: a is still there, now the most recent
    a[0, 0, 0, 5] = True  # a caller changed it in place
    b = _valid_mask(6, 6, 0, cpu)
    assert b is not a and torch.equal(b, fresh(6, 6, 0, cpu, None))
    _valid_mask(3, 3, 0, cpu)  # a fifth: the oldest (the windowed one) goes
    assert _valid_mask(6, 6, 0, cpu) is b and _valid_mask(6, 6, 0, cpu, 3) is not others[0]
    keep_max = attention._MASK_KEEP_MAX
    monkeypatch.setattr(attention, "_MASK_KEEP_MAX", 35)
    assert _valid_mask(6, 6, 0, cpu) is not _valid_mask(6, 6, 0, cpu)
    monkeypatch.setattr(attention, "_MASK_KEEP_MAX", keep_max)
    with torch.inference_mode():
        inside = _valid_mask(5, 5, 0, cpu)
        assert _valid_mask(5, 5, 0, cpu) is not inside
    assert not _valid_mask(5, 5, 0, cpu).is_inference()


@pytest.mark.parametrize(
    "name, path", [("qwen2", "auto"), ("qwen3", "auto"), ("mistral", "auto"), ("mistral", "explicit")]
)
def test_cached_decoding_matches_full_forward(folders, name, path):
    """Prefill, then one token per step (one query, more keys than the window): each step's logits equal
    transformers' full forward at that position, on the SDPA path and on the explicit map path."""
    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    model.set_attention_path(path)
    ids = _ids(batch=1, seed=3)
    prefill = 20
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = model.new_cache()
        out = [model(ids[:, :prefill], cache)]
        for pos in range(prefill, SEQ):
            out.append(model(ids[:, pos : pos + 1], cache))
    assert cache.length == SEQ
    assert _rel(torch.cat(out, dim=1), ref) < RTOL


@pytest.mark.parametrize("name, pre_rope", [("mistral", False), ("qwen3-window", True)])
def test_quantized_kv_cache_decodes_with_window(folders, name, pre_rope):
    """A plan's quantized cache goes through the same windowed attention (pre-RoPE keys: after the qk-norm):
    8-bit codes stay near fp32."""
    from diffquant.quant import QuantPlan, apply_plan

    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    kv = {"format": "int8", "group": 8, "window": 8, "pre_rope": pre_rope}
    apply_plan(model, QuantPlan.from_dict({"name": "test", "kv_cache": kv}))
    ids = _ids(batch=1, seed=4)
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = model.new_cache()
        out = [model(ids[:, :16], cache)] + [model(ids[:, p : p + 1], cache) for p in range(16, SEQ)]
    assert type(cache.layers[0]).__name__ == "QuantizedLayerKV"
    assert _rel(torch.cat(out, dim=1), ref) < 0.05


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_streamed_run_reads_the_new_tensors(folders, name):
    """The layer-streamed run reads biases and q/k-norm weights through the same key map."""
    from diffquant.stream.api import logits_streamed

    hf_model, folder = folders[name]
    ids = _ids()
    with torch.no_grad():
        assert _rel(logits_streamed(f"hf:{folder}", ids, batch_size=2), hf_model(ids).logits) < RTOL


def test_map_taps_see_the_windowed_valid_mask(folders):
    """A hook on a probs tap sees the windowed mask, and the probabilities it sees are zero outside it."""
    _, folder = folders["mistral"]
    model = load_model(f"hf:{folder}")
    window = model.config.sliding_window
    seen = []
    tap = model.taps("layers.1.attn.probs")["layers.1.attn.probs"]
    tap.register_forward_hook(lambda mod, args, out: seen.append((out, args[1])))
    ids = _ids(length=20, batch=1)
    with torch.no_grad():
        cache = model.new_cache()
        model(ids[:, :16], cache)
        model(ids[:, 16:17], cache)
    for (probs, valid), (t, pos0) in zip(seen, [(16, 0), (1, 16)], strict=True):
        assert torch.equal(valid, _valid_mask(t, pos0 + t, pos0, torch.device("cpu"), window))
        assert bool((probs.masked_select(~valid) == 0).all())
        assert torch.allclose(probs.sum(-1), torch.ones(()))
    assert seen[1][1].sum().item() == window


def test_native_checkpoint_keeps_the_fields(folders, tmp_path):
    from diffquant.io import save_checkpoint

    _, folder = folders["qwen2"]
    model = load_model(f"hf:{folder}")
    save_checkpoint(model, tmp_path / "native")
    again = load_model(str(tmp_path / "native"))
    assert again.config == model.config
    ids = _ids(length=16)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_rotation_keeps_logits(folders, name):
    """R1-R4 with q/k/v biases (R2 rotates v's bias) and with qk-norm (it runs before R3's online
    rotation, which is after RoPE): rotated logits equal unrotated ones."""
    from diffquant.quant.rotate import RotateSpec, rotate_model

    _, folder = folders[name]
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        rotate_model(model, RotateSpec(residual="random", heads="random", ffn="random", qk="random"))
        assert _rel(model(ids), before) < RTOL


# ============================================================================================== export
@pytest.mark.parametrize(
    "name, architecture",
    [("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("qwen3-window", "Qwen3"), ("mistral", "Mistral")],
)
def test_export_round_trip(folders, tmp_path, name, architecture):
    """diffquant -> export_hf -> transformers loads the same architecture -> same logits; and back."""
    tf = _transformers()
    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    out = export_hf(model, tmp_path / "out")
    loaded = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert type(loaded).__name__ == f"{architecture}ForCausalLM"
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert _rel(loaded(ids).logits, ref) < RTOL
        again = load_model(f"hf:{out}")
        assert again.config == model.config
        assert _rel(again(ids), ref) < RTOL


def test_native_family_configs_export_as_their_family(tmp_path):
    """Fields alone choose the family: a window alone -> mistral; biases + window -> windowed qwen2."""
    tf = _transformers()
    base = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48
    )
    for fields, model_type in (
        ({}, "llama"),
        ({"sliding_window": 5}, "mistral"),
        ({"attention_bias": True, "sliding_window": 5}, "qwen2"),
        ({"qk_norm": True}, "qwen3"),
    ):
        torch.manual_seed(0)
        model = DecoderLM(dataclasses.replace(base, **fields)).eval()
        _scramble(model, 0)
        out = export_hf(model, tmp_path / model_type)
        assert json.loads((out / "config.json").read_text())["model_type"] == model_type
        loaded = tf.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = _ids(length=12)
        with torch.no_grad():
            assert _rel(model(ids), loaded(ids).logits) < RTOL


# ============================================================================================ refusals
def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("qk_norm", True), ("sliding_window", 8)])
@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_diff_kinds_refuse_family_fields(kind, field, value):
    with pytest.raises(
        DiffquantError, match=f"field '{field}' = {value}, expected .* for attention '{kind}'"
    ) as e:
        ModelConfig(attention=kind, **{field: value})
    _one_line(e)


def test_bad_window_value_refused():
    with pytest.raises(DiffquantError, match="sliding_window") as e:
        ModelConfig(sliding_window=0)
    _one_line(e)


def test_hf_refusals(folders, tmp_path):
    _, qwen2 = folders["qwen2"]
    _, qwen3 = folders["qwen3"]
    cases = [
        # Qwen3's and Llama's attention_bias biases o_proj too
        (_edited(qwen3, tmp_path / "q3bias", attention_bias=True), "attention_bias = true, expected false"),
        (
            _edited(qwen2, tmp_path / "llamabias", model_type="llama", attention_bias=True),
            "attention_bias = true, expected false",
        ),
        # a window on layers >= 3 of 10: transformers windows some layers only
        (
            _edited(qwen2, tmp_path / "mixed", max_window_layers=3, layer_types=None),
            "layer_types mixes full_attention and sliding_attention layers .first windowed layer 3 of 10.",
        ),
        (
            _edited(qwen3, tmp_path / "nowin", layer_types=["sliding_attention"] * 3),
            "layer_types are sliding_attention but the window is null",
        ),
        (
            _edited(qwen2, tmp_path / "badwin", sliding_window=0),
            "sliding_window = 0, expected null or an integer >= 1",
        ),
    ]
    for folder, match in cases:
        with pytest.raises(DiffquantError, match=match) as e:
            load_model(f"hf:{folder}")
        _one_line(e)


def test_export_refuses_qk_norm_with_qkv_bias(tmp_path):
    model = DecoderLM(ModelConfig(attention_bias=True, qk_norm=True))
    with pytest.raises(DiffquantError, match="attention_bias = true with qk_norm = true") as e:
        export_hf(model, tmp_path / "out")
    _one_line(e)
    assert not (tmp_path / "out").exists()


def test_old_configs_default_to_llama():
    """A saved config from before these fields loads as the Llama behaviour it was trained with."""
    data = ModelConfig().to_dict()
    for field in ("attention_bias", "qk_norm", "sliding_window"):
        data.pop(field)
    config = ModelConfig.from_dict(data, complete=True)
    assert (config.attention_bias, config.qk_norm, config.sliding_window) == (False, False, None)


def test_query_positions_are_read_off_a_windowed_mask():
    """Profile locations and span metrics read query positions off the map's mask: under a sliding window a
    far row sees W keys, not p + 1, so the position is its last visible key."""
    from diffquant.models.attention import _valid_mask
    from diffquant.models.sites import query_positions

    for window in (None, 3):
        assert query_positions(_valid_mask(5, 12, 7, torch.device("cpu"), window)).tolist() == [
            7,
            8,
            9,
            10,
            11,
        ]
        assert query_positions(_valid_mask(12, 12, 0, torch.device("cpu"), window)).tolist() == list(
            range(12)
        )
