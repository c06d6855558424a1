"""Gemma 3 (text) through `hf:` import and `export_hf`: logits equal transformers' Gemma3ForCausalLM.

Gemma 3 is the baseline kind plus ModelConfig fields: per-layer ``layer_types`` (sliding layers windowed, with
their own RoPE base ``rope_local_theta``; full layers causal with ``rope_theta`` and ``rope_scaling``),
``qk_norm``, ``norm_unit_offset`` ((1 + w) RMSNorms), ``sandwich_norms`` (post-norms on both branch outputs),
``embed_scale`` (sqrt(d_model)) and ``mlp_activation`` "gelu_tanh". The fixtures are random tiny models from
transformers' own classes (fp32): norm weights far from 0 so (1 + w) matters, a window of 4 against sequences
of 10-20 tokens so windows bite, layer types in an irregular order (an index off by one shows), local and
global RoPE bases far apart, one KV head with head_dim (24) != d_model / heads (16). The biggest relative
error each comparison saw is printed (``pytest -s``).
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

VOCAB = 300
SEQ = 18
WINDOW = 4
RTOL = 1e-5  # max |diff| / max |logit|, fp32

# Irregular on purpose: no period, full layers first and last, runs of both kinds.
TYPES_11 = [
    "full",
    "sliding",
    "sliding",
    "full",
    "sliding",
    "full",
    "full",
    "sliding",
    "sliding",
    "sliding",
    "full",
]
CASES = {
    # 11 layers, tied head, plain RoPE on both kinds
    "gemma": {"num_hidden_layers": 11, "layer_types": [f"{t}_attention" for t in TYPES_11]},
    # 3 layers, untied head, linear RoPE scaling on the full layer (5.x: in rope_parameters.full_attention)
    "gemma-scaled": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "tie_word_embeddings": False,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    },
}


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is needed for the Gemma 3 tests")


def _scramble(module: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations; (1 + w) norm gains far from 1 (w ~ N(0, 0.3^2))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(0.3 * noise)
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def _hf_model(overrides: dict, seed: int, attn: str = "eager"):
    tf = _transformers()
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 24,
        "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW,
        "max_position_embeddings": 128,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attn_implementation": attn,
        **overrides,
    }
    config = tf.Gemma3TextConfig(**fields)
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(config).eval()
    _scramble(model, seed)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """name -> (transformers model, its save_pretrained folder)."""
    _transformers()
    out = {}
    for i, (name, overrides) in enumerate(CASES.items()):
        model = _hf_model(overrides, seed=i)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def _ids(length: int = SEQ, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> float:
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if what:
        print(f"max relative logit error, {what}: {rel:.3g}")
    return rel


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ============================================================================================== import
@pytest.mark.parametrize("name", list(CASES))
def test_config_fields(folders, name):
    hf_model, folder = folders[name]
    c = load_model(f"hf:{folder}").config
    hf = hf_model.config
    assert c.layer_types == hf.layer_types and c.sliding_window == WINDOW
    assert (c.rope_theta, c.rope_local_theta) == (5000.0, 50.0)
    assert c.rope_scaling == (None if name == "gemma" else {"rope_type": "linear", "factor": 4.0})
    assert (c.qk_norm, c.norm_unit_offset, c.sandwich_norms, c.mlp_activation) == (
        True,
        True,
        True,
        "gelu_tanh",
    )
    assert c.embed_scale == 8.0 and c.tie_embeddings == hf.tie_word_embeddings
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (4, 1, 24)
    model = load_model(f"hf:{folder}")
    windows = [a.window for a in model.attention_modules()]
    bases = [a.rope_theta for a in model.attention_modules()]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in hf.layer_types]
    assert bases == [50.0 if t == "sliding_attention" else 5000.0 for t in hf.layer_types]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_import_matches_transformers(folders, name, attn):
    """fp32 logits equal transformers' (eager and sdpa) within 1e-5; so do the explicit map path, in query
    chunks, and the forced fused path."""
    tf = _transformers()
    _, folder = folders[name]
    hf_model = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        sdpa = model(ids)
        assert {a.last_path for a in model.attention_modules()} == {"sdpa"}
        assert _rel(sdpa, ref, f"{name} vs transformers {attn}") < RTOL
        model.set_attention_path("explicit", chunk_size=5)
        explicit = model(ids)
        assert {a.last_path for a in model.attention_modules()} == {"explicit"}
        assert _rel(explicit, ref, f"{name} explicit (chunks of 5) vs transformers {attn}") < RTOL
        assert _rel(explicit, sdpa) < RTOL
        model.set_attention_path("explicit")  # one chunk
        assert _rel(model(ids), sdpa) < RTOL


def test_every_feature_changes_the_logits(folders):
    """The fixture is sensitive to each field: flipping one moves the logits far past the tolerance."""
    _, folder = folders["gemma"]
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        base = model(ids)
        for field, value in (
            ("norm_unit_offset", False),
            ("embed_scale", 1.0),
            ("mlp_activation", "silu"),
            ("rope_local_theta", None),
        ):
            other = DecoderLM(dataclasses.replace(model.config, **{field: value})).eval()
            other.load_state_dict(model.state_dict())
            assert _rel(other(ids), base) > 1e-2, field
        for attn in model.attention_modules():
            attn.window = None
        assert _rel(model(ids), base) > 1e-2, "window"


def test_bf16_logits_match_transformers_bf16(folders):
    """Both models in bfloat16: the logits agree within bf16 rounding (and both stay near the fp32 ones)."""
    hf_model, folder = folders["gemma"]
    ids = _ids()
    with torch.no_grad():
        ref32 = hf_model(ids).logits
        hf16 = _transformers().AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        model = load_model(f"hf:{folder}", dtype=torch.bfloat16)
        assert model.embed.weight.dtype == torch.bfloat16
        ours, theirs = model(ids), hf16(ids).logits
    ours_err, theirs_err = (
        _rel(ours, ref32, "ours bf16 vs fp32"),
        _rel(theirs, ref32, "transformers bf16 vs fp32"),
    )
    assert _rel(ours, theirs, "ours bf16 vs transformers bf16") < 2e-2
    assert ours_err < 2e-2 and theirs_err < 2e-2


@pytest.mark.parametrize("path", ["auto", "explicit"])
def test_cached_decoding_matches_full_forward(folders, path):
    """Prefill 5 tokens, then one token per step to 18 (past the window on the sliding layers): each step's
    logits equal transformers' full forward at that position."""
    hf_model, folder = folders["gemma"]
    model = load_model(f"hf:{folder}")
    model.set_attention_path(path)
    ids = _ids(batch=1, seed=3)
    prefill = 5
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = model.new_cache()
        out = [model(ids[:, :prefill], cache)]
        for pos in range(prefill, SEQ):
            out.append(model(ids[:, pos : pos + 1], cache))
    assert cache.length == SEQ
    assert _rel(torch.cat(out, dim=1), ref, f"cached decoding ({path})") < RTOL


@pytest.mark.parametrize("pre_rope", [False, True])
def test_quantized_kv_cache_decodes_per_layer(folders, pre_rope):
    """A plan's quantized cache: pre-RoPE keys are rotated back with each layer's own base (50 on sliding
    layers, 5000 on full ones); 8-bit codes stay near fp32, and the cache error report is finite."""
    from diffquant.quant import QuantPlan, apply_plan
    from diffquant.quant.kv_cache import kv_cache_error

    hf_model, folder = folders["gemma-scaled"]
    model = load_model(f"hf:{folder}")
    kv = {"format": "int8", "group": 4, "window": 4, "pre_rope": pre_rope}
    apply_plan(model, QuantPlan.from_dict({"name": "test", "kv_cache": kv}))
    ids = _ids(batch=1, seed=4)
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = model.new_cache()
        out = [model(ids[:, :12], cache)] + [model(ids[:, p : p + 1], cache) for p in range(12, SEQ)]
    assert type(cache.layers[0]).__name__ == "QuantizedLayerKV"
    assert _rel(torch.cat(out, dim=1), ref, f"8-bit KV cache (pre_rope {pre_rope})") < 0.02
    rows = kv_cache_error(model, _ids(length=16, batch=2, seed=5))
    assert all(r["k_sqnr_db"] is not None and r["k_sqnr_db"] > 30 for r in rows), rows


def test_taps_at_the_post_norm_inputs(folders):
    """mlp.out (kind mlp_out, only with sandwich norms) and attn.out are what the post-norms read."""
    _, folder = folders["gemma-scaled"]
    model = load_model(f"hf:{folder}")
    sites = model.sites()
    assert [s for s, k in sites.items() if k == "mlp_out"] == [f"layers.{i}.mlp.out" for i in range(3)]
    assert "mlp_out" not in DecoderLM(ModelConfig()).sites().values()
    seen: dict[str, torch.Tensor] = {}
    for name, tap in model.taps(["layers.1.mlp.out", "layers.1.attn.out"]).items():
        tap.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out))
    block = model.layers[1]
    for name, norm in (("attn", block.attn_post_norm), ("mlp", block.mlp_post_norm)):
        norm.register_forward_pre_hook(
            lambda mod, args, name=name: seen.__setitem__(f"{name}_post_in", args[0])
        )
    with torch.no_grad():
        model(_ids(length=10))
    assert torch.equal(seen["layers.1.mlp.out"], seen["mlp_post_in"])
    assert torch.equal(seen["layers.1.attn.out"], seen["attn_post_in"])


def test_profile_sees_the_new_sites(folders):
    from diffquant.profile.profiler import Profiler

    _, folder = folders["gemma-scaled"]
    model = load_model(f"hf:{folder}")
    with torch.no_grad(), Profiler(model, sites=["kind:mlp_out", "kind:attn_out"], topk=1) as prof:
        model(_ids(length=12))
    profile = prof.take()
    assert {s for s in profile.sites if s.endswith("mlp.out")} == {f"layers.{i}.mlp.out" for i in range(3)}


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_run_equals_the_whole_model(folders, name):
    from diffquant.stream.api import logits_streamed

    _, folder = folders[name]
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        whole = model(ids)
        assert (
            _rel(logits_streamed(f"hf:{folder}", ids, batch_size=1), whole, f"{name} streamed vs whole")
            < 1e-6
        )


def test_native_checkpoint_keeps_the_fields(folders, tmp_path):
    from diffquant.io import save_checkpoint

    _, folder = folders["gemma"]
    model = load_model(f"hf:{folder}")
    save_checkpoint(model, tmp_path / "native")
    again = load_model(str(tmp_path / "native"))
    assert again.config == model.config
    ids = _ids(length=12)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


# ======================================================================================== quantization
def test_smoothing_folds_into_the_unit_offset_gain(folders):
    """SmoothQuant's division lands on (1 + w): w' = (1 + w) / s - 1, so the float model is unchanged."""
    from diffquant.quant.smoothquant import collect_act_scales, smooth_model

    _, folder = folders["gemma"]
    model = load_model(f"hf:{folder}")
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        w0 = model.layers[2].mlp_norm.weight.detach().clone()
        scales = collect_act_scales(model, _ids(length=16, seed=7), batch_size=2)
        factors = smooth_model(model, scales, alpha=0.5)
        s = factors["layers.2.mlp_norm"]
        assert (s - 1).abs().max() > 0.1  # the factors are far from 1
        assert torch.allclose(model.layers[2].mlp_norm.weight.double(), (1 + w0.double()) / s - 1, atol=1e-6)
        assert _rel(model(ids), before, "smoothed vs float") < RTOL


def test_residual_rotation_refused_with_sandwich_norms(folders):
    from diffquant.quant import QuantPlan, apply_plan
    from diffquant.quant.rotate import RotateSpec, rotate_model

    _, folder = folders["gemma"]
    model = load_model(f"hf:{folder}")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DiffquantError, match="sandwich_norms = true") as e:
        rotate_model(model, RotateSpec(residual="hadamard"))
    _one_line(e)
    with pytest.raises(DiffquantError, match="sandwich_norms") as e:
        apply_plan(model, QuantPlan.from_dict({"name": "r", "rotate": {"residual": "random"}}))
    _one_line(e)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # nothing changed
    # R2 / R3 / R4 do not touch the residual stream: they stay exact
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        rotate_model(model, RotateSpec(residual="none", heads="random", ffn="random", qk="random"))
        assert _rel(model(ids), before, "R2-R4 rotated vs not") < RTOL


def test_residual_rotation_folds_unit_offset_norms():
    """Without post-norms, R1 is exact with (1 + w) norms: the gain (1 + w) moves into the readers, w -> 0."""
    from diffquant.quant.rotate import RotateSpec, rotate_model

    config = ModelConfig(
        vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
        norm_unit_offset=True, embed_scale=8.0, mlp_activation="gelu_tanh", qk_norm=True, tie_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    _scramble(model, 0)
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        rotate_model(model, RotateSpec(residual="random", heads="random", ffn="random", qk="random"))
        assert bool((model.layers[0].attn_norm.weight == 0).all()) and bool((model.norm.weight == 0).all())
        assert _rel(model(ids), before, "R1-R4 on unit-offset norms") < RTOL


@pytest.mark.parametrize("preset_name", ["w8a8-smooth", "w4a16-gptq-g32", "w4a16-hqq-g32", "kv2-g8-prerope"])
def test_plans_run(folders, preset_name):
    """Fake-quant sites with smoothing, GPTQ and HQQ weights, a pre-RoPE KV cache: each applies, calibrates
    and stays near the float logits."""
    from diffquant.quant import apply_plan, calibrate, preset

    hf_model, folder = folders["gemma-scaled"]
    model = load_model(f"hf:{folder}")
    apply_plan(model, preset(preset_name))
    calibrate(model, _ids(length=16, batch=4, seed=9), batch_size=2)
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        if preset_name.startswith("kv"):
            cache = model.new_cache()
            got = torch.cat(
                [model(ids[:, :8], cache)] + [model(ids[:, p : p + 1], cache) for p in range(8, SEQ)], 1
            )
        else:
            got = model(ids)
    assert _rel(got, ref, preset_name) < 0.5


# ============================================================================================ DIFF kinds
@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_diff_kinds_take_the_fields_outside_attention(kind):
    config = ModelConfig(
        attention=kind, vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16,
        ffn_dim=96, norm_unit_offset=True, sandwich_norms=True, embed_scale=8.0, mlp_activation="gelu_tanh",
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    _scramble(model, 1)
    assert model.layers[0].attn_post_norm is not None and "layers.1.mlp.out" in model.sites()
    ids = _ids(length=12)
    with torch.no_grad():
        fused = model(ids)
        assert torch.isfinite(fused).all()
        cache = model.new_cache()
        steps = torch.cat(
            [model(ids[:, :6], cache)] + [model(ids[:, p : p + 1], cache) for p in range(6, 12)], 1
        )
        assert _rel(steps, fused) < RTOL
        model.set_attention_path("explicit", chunk_size=5)
        assert _rel(model(ids), fused) < RTOL


@pytest.mark.parametrize(
    "field, value", [("layer_types", ["full_attention"] * 4), ("rope_local_theta", 50.0)]
)
def test_diff_kinds_refuse_the_attention_fields(field, value):
    with pytest.raises(DiffquantError, match=f"field '{field}'") as e:
        ModelConfig(attention="diff_v2", **{field: value})
    _one_line(e)


# ============================================================================================== export
@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(folders, tmp_path, name):
    """diffquant -> export_hf -> transformers loads Gemma3ForCausalLM -> same logits; and back, same config."""
    tf = _transformers()
    hf_model, folder = folders[name]
    model = load_model(f"hf:{folder}")
    out = export_hf(model, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and written["architectures"] == ["Gemma3ForCausalLM"]
    loaded = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert _rel(loaded(ids).logits, ref, f"{name} exported, in transformers") < RTOL
        again = load_model(f"hf:{out}")
        assert again.config == model.config
        assert torch.equal(again(ids), model(ids))


def test_export_refuses_a_partial_gemma(tmp_path):
    base = ModelConfig(
        vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16, ffn_dim=96
    )
    for fields, match in (
        ({"norm_unit_offset": True}, "needs Gemma 3 .gemma3_text., which also has qk_norm = true"),
        (
            {
                "norm_unit_offset": True,
                "sandwich_norms": True,
                "qk_norm": True,
                "mlp_activation": "gelu_tanh",
            },
            "embed_scale = 1.0, expected sqrt.d_model. = 8.0",
        ),
    ):
        with pytest.raises(DiffquantError, match=match) as e:
            export_hf(DecoderLM(dataclasses.replace(base, **fields)), tmp_path / "out")
        _one_line(e)
        assert not (tmp_path / "out").exists()


# ======================================================================================= 4.x configs
def test_transformers_4_config_keys(folders, tmp_path):
    """A 4.x config.json: no layer_types (sliding_window_pattern: layer i full when (i + 1) % pattern == 0),
    rope_theta / rope_local_base_freq / rope_scaling (full layers only). Same logits as transformers reading it."""
    tf = _transformers()
    _, folder = folders["gemma"]
    dst = shutil.copytree(folder, tmp_path / "v4")
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.update(
        sliding_window_pattern=3,
        rope_theta=5000.0,
        rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    model = load_model(f"hf:{dst}")
    c = model.config
    assert c.layer_types == ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(11)]
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (
        5000.0,
        50.0,
        {"rope_type": "linear", "factor": 2.0},
    )
    hf_model = tf.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert hf_model.config.layer_types == c.layer_types
    ids = _ids()
    with torch.no_grad():
        assert _rel(model(ids), hf_model(ids).logits, "4.x config keys") < RTOL


# ============================================================================================ refusals
def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_hf_refusals(folders, tmp_path):
    _, src = folders["gemma-scaled"]
    rope = json.loads((src / "config.json").read_text())["rope_parameters"]
    cases = [
        (
            {"model_type": "gemma3"},
            "only the text model .model_type 'gemma3_text', Gemma3ForCausalLM. is read",
        ),
        ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar = 256, expected head_dim = 24"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0, expected null"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0, expected null"),
        ({"hidden_activation": "gelu"}, "hidden_activation = \"gelu\", expected 'gelu_pytorch_tanh'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention = true, expected false"),
        ({"attention_bias": True}, "attention_bias = true, expected false"),
        (
            {"rope_parameters": {**rope, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters.sliding_attention = .*expected plain RoPE",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0e4}},
            "expected an object with entries",
        ),
        (
            {"rope_theta": 123.0},
            "rope_theta = 123.0 and rope_parameters.full_attention.rope_theta = 5000.0 disagree",
        ),
        ({"layer_types": ["full_attention"] * 2}, "layer_types.*one entry per layer .3., got 2"),
    ]
    for i, (changes, match) in enumerate(cases):
        with pytest.raises(DiffquantError, match=match) as e:
            load_model(f"hf:{_edited(src, tmp_path / str(i), **changes)}")
        _one_line(e)


@pytest.mark.parametrize("stream", ["off", "on"])
def test_cli_refuses_a_residual_rotation_with_exit_2(folders, tmp_path, capsys, stream):
    from diffquant.cli import main

    _, folder = folders["gemma-scaled"]
    args = ["quantize", f"hf:{folder}", "--plan", "w8a8-quarot", "--out", str(tmp_path / "q")]
    assert main([*args, "--tokenizer", "byte", "--seq-len", "16", "--stream", stream]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sandwich_norms = true" in err[0]
    assert not (tmp_path / "q").exists()


def test_embed_scale_is_rounded_like_transformers():
    """sqrt(96) is not a bf16 number: the scale is rounded to the weights' dtype (through float32) before it
    multiplies, as Gemma3TextScaledWordEmbedding does, so the bf16 embeddings are equal bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from diffquant.models.transformer import ScaledEmbedding

    theirs = Gemma3TextScaledWordEmbedding(VOCAB, 96, 0, embed_scale=96**0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(VOCAB, 96, 96**0.5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(VOCAB, 96, generator=torch.Generator().manual_seed(0)))
        theirs.weight.copy_(ours.weight)
    ids = _ids()
    assert torch.equal(ours(ids), theirs(ids))
