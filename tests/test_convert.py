"""Checkpoint converters: HF llama / diffllama <-> native, unilm DIFF V1 / V2 -> native, and `export`.

transformers is a test-only dependency: the HF tests skip cleanly without it. The unilm tests compare
against an independent plain-torch implementation of the unilm formulas written here (interleaved RoPE
via complex multiplication, unilm head layout), not against the native model's code.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from diffquant.errors import DiffquantError
from diffquant.io.convert_cli import add_export_parser, load_converted
from diffquant.io.convert_hf import export_hf, load_hf
from diffquant.io.convert_unilm import load_unilm
from diffquant.models import DecoderLM, ModelConfig

# (name, model_type, HF config overrides): GQA and MHA, implicit and explicit head_dim, tied head.
HF_CASES = {
    "llama-gqa": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-mha-tied": (
        "llama",
        {"num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": True},
    ),
    "diffllama-gqa": ("diffllama", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "diffllama-mha-d16": ("diffllama", {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}),
}


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is needed for the HF converter tests")


def _scramble(module: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations (default inits give near-uniform logits, so greedy decoding would
    be decided by rounding); norms near 1, lambda vectors like the reference init but larger."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or "subln" in name:
                p.copy_(1 + 0.2 * noise)
            elif "lambda_" in name and "proj" not in name:
                p.copy_(0.2 * noise)
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def _hf_model(model_type: str, overrides: dict, seed: int = 0):
    tf = _transformers()
    cfg_cls = tf.DiffLlamaConfig if model_type == "diffllama" else tf.LlamaConfig
    model_cls = tf.DiffLlamaForCausalLM if model_type == "diffllama" else tf.LlamaForCausalLM
    config = cfg_cls(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        rope_theta=5000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _scramble(model, seed)
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[object, Path, Path]]:
    """name -> (HF model, single-file folder, sharded folder)."""
    _transformers()
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(HF_CASES.items()):
        model = _hf_model(model_type, overrides, seed=i)
        single, sharded = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(name + "-sharded")
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="40KB")
        out[name] = (model, single, sharded)
    return out


def _ids(length: int, batch: int = 2, vocab: int = 300, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_DROP = object()


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ================================================================================================= HF import
@pytest.mark.parametrize("name", list(HF_CASES))
def test_load_hf_matches_transformers(hf_folders, name):
    hf_model, single, sharded = hf_folders[name]
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    native, from_shards = load_hf(single), load_hf(sharded)
    for key, value in native.state_dict().items():
        assert torch.equal(value, from_shards.state_dict()[key]), key
    expected_kind = "diff_v1" if name.startswith("diff") else "baseline"
    assert native.config.attention == expected_kind and not native.training
    worst = 0.0
    with torch.no_grad():
        for length in (7, 13):
            ids = _ids(length)
            ref = hf_model(ids).logits
            got = native(ids)
            worst = max(worst, (ref - got).abs().max().item())
    assert worst < 1e-4, worst
    prompt = _ids(7, seed=2)
    ref_gen = hf_model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(native.generate(prompt, 12), ref_gen)


def test_load_hf_config_mapping(hf_folders):
    cfg = load_hf(hf_folders["diffllama-mha-d16"][1]).config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 4, 16)  # 8 component heads = 4 pairs
    assert (cfg.d_model, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers, cfg.max_seq_len) == (64, 96, 300, 2, 128)
    assert cfg.rope_theta == 5000.0 and cfg.norm_eps == cfg.v1_norm_eps == 1e-6
    assert cfg.v1_norm_affine is False and cfg.v1_lambda_init is None
    tied = load_hf(hf_folders["llama-mha-tied"][1])
    assert tied.config.tie_embeddings and tied.lm_head.weight is tied.embed.weight


def test_load_hf_tied_with_stored_head(hf_folders, tmp_path):
    """A tied checkpoint that stores lm_head.weight anyway loads; the head stays the embedding."""
    folder = tmp_path / "tied"
    shutil.copytree(hf_folders["llama-mha-tied"][1], folder)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(folder / "model.safetensors"))
    model = load_hf(folder)
    assert model.lm_head.weight is model.embed.weight


def test_load_hf_bf16(hf_folders):
    hf_model, single, _ = hf_folders["diffllama-gqa"]
    model = load_hf(single, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = _ids(7)
    with torch.no_grad():
        err = (model(ids).float() - hf_model(ids).logits).abs().max().item()
    assert err < 0.5  # bf16 rounding only: the layout is the fp32-checked one


def test_load_converted_specs(hf_folders):
    _, single, _ = hf_folders["llama-gqa"]
    model = load_converted(f"hf:{single}")
    assert model.config.attention == "baseline"
    with pytest.raises(DiffquantError, match="expected hf:PATH or unilm:PATH"):
        load_converted("onnx:/x")


def test_load_model_routes_converters(hf_folders):
    from diffquant.io import load_model

    _, single, _ = hf_folders["llama-gqa"]
    model = load_model(f"hf:{single}")
    assert model.config.attention == "baseline"


# ================================================================================================= HF export
def _native(kind: str, seed: int = 0, **overrides) -> DecoderLM:
    base = {"baseline": (4, 2), "diff_v1": (2, 1), "diff_v2": (4, 2)}[kind]
    config = ModelConfig(
        attention=kind,
        vocab_size=97,
        d_model=48,
        n_layers=3,
        n_heads=base[0],
        n_kv_heads=base[1],
        head_dim=12,
        ffn_dim=80,
        max_seq_len=64,
        rope_theta=2000.0,
        **overrides,
    )
    torch.manual_seed(seed)
    model = DecoderLM(config).eval()
    _scramble(model, seed)
    return model


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("baseline", {}),
        ("baseline", {"tie_embeddings": True}),
        ("diff_v1", {"v1_norm_affine": False}),
        ("diff_v1", {}),  # random per-head norm weight, folded into o_proj
    ],
)
def test_export_hf_loads_in_transformers(tmp_path, kind, overrides):
    tf = _transformers()
    native = _native(kind, **overrides)
    if kind == "diff_v1" and native.config.v1_norm_affine:
        assert not torch.allclose(native.layers[1].attn.norm.weight, torch.ones(24))
    out = export_hf(native, tmp_path / "hf")
    cls = tf.DiffLlamaForCausalLM if kind == "diff_v1" else tf.LlamaForCausalLM
    hf_model = cls.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids(13, vocab=97)
    with torch.no_grad():
        err = (hf_model(ids).logits - native(ids)).abs().max().item()
    assert err < 1e-4, err
    if not (kind == "diff_v1" and native.config.v1_norm_affine):
        # nothing folded: native -> HF -> native restores every tensor bit for bit
        back = load_hf(out)
        for key, value in native.state_dict().items():
            assert torch.equal(value, back.state_dict()[key]), key


def test_hf_import_export_import_bit_identical(hf_folders, tmp_path):
    for name in ("diffllama-gqa", "llama-mha-tied"):
        _, single, _ = hf_folders[name]
        first = load_hf(single)
        out = export_hf(first, tmp_path / name)
        second = load_hf(out)
        assert first.state_dict().keys() == second.state_dict().keys()
        for key, value in first.state_dict().items():
            assert torch.equal(value, second.state_dict()[key]), key
        original, exported = load_file(single / "model.safetensors"), load_file(out / "model.safetensors")
        for key, value in exported.items():  # the inverse permutation restores HF's own layout
            assert torch.equal(value, original[key]), key


def test_export_refusals(tmp_path):
    with pytest.raises(DiffquantError, match="diff_v2' has no Hugging Face format") as e:
        export_hf(_native("diff_v2"), tmp_path / "v2")
    _one_line_error(e)
    with pytest.raises(DiffquantError, match="v1_lambda_init") as e:
        export_hf(_native("diff_v1", v1_lambda_init=0.5), tmp_path / "c")
    with pytest.raises(DiffquantError, match="v1_norm_eps") as e:
        export_hf(_native("diff_v1", v1_norm_eps=1e-6), tmp_path / "eps")
    # A dtype the target cannot hold: folding a large norm weight into a float16 o_proj overflows.
    model = _native("diff_v1").to(torch.float16)
    with torch.no_grad():
        model.layers[0].attn.norm.weight.fill_(3e4)
        model.layers[0].attn.o_proj.weight.fill_(10.0)
    with pytest.raises(DiffquantError, match="layers.0.attn.o_proj.weight overflows float16") as e:
        export_hf(model, tmp_path / "fp16")
    _one_line_error(e)
    assert not (tmp_path / "fp16").exists() and not any(tmp_path.glob(".fp16*"))
    export_hf(_native("baseline"), tmp_path / "b")
    with pytest.raises(DiffquantError, match="already exists"):
        export_hf(_native("baseline"), tmp_path / "b")
    export_hf(_native("baseline"), tmp_path / "b", overwrite=True)


def test_export_command(tmp_path):
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "exported"
    args = parser.parse_args(["export", "init:diff_v1:tiny:3", "--to", "hf", str(out)])
    assert args.func(args) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "diffllama"
    from diffquant.io import load_model

    native, back = load_model("init:diff_v1:tiny:3"), load_hf(out)
    ids = _ids(9, vocab=native.config.vocab_size)
    with torch.no_grad():
        assert (native(ids) - back(ids)).abs().max().item() < 1e-5
    with pytest.raises(DiffquantError, match="already exists"):
        args.func(args)
    args = parser.parse_args(["export", "init:baseline:tiny", "--to", "hf", str(out), "--force"])
    assert args.func(args) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "init:baseline:tiny", "--to", "onnx", str(out)])


# ============================================================================================ HF bad input
def test_hf_bad_inputs(hf_folders, tmp_path):
    _, single, sharded = hf_folders["diffllama-gqa"]

    bad = _copy_with_config(single, tmp_path / "gemma", model_type="gemma")
    with pytest.raises(
        DiffquantError, match="'gemma' is not supported; supported: llama, diffllama, qwen2, qwen3, mistral"
    ) as e:
        load_hf(bad)
    _one_line_error(e)

    bad = _copy_with_config(single, tmp_path / "scaled", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(DiffquantError, match="rope_scaling") as e:
        load_hf(bad)
    _one_line_error(e)
    bad = _copy_with_config(
        single, tmp_path / "scaled5", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    )
    with pytest.raises(DiffquantError, match="rope_parameters"):
        load_hf(bad)

    for key, value, match in (
        ("attention_bias", True, "attention_bias = true"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("num_key_value_heads", 3, "num_key_value_heads = 3"),
    ):
        with pytest.raises(DiffquantError, match=match) as e:
            load_hf(_copy_with_config(single, tmp_path / key, **{key: value}))
        _one_line_error(e)

    bad = _copy_with_config(single, tmp_path / "shape", intermediate_size=80)
    with pytest.raises(
        DiffquantError,
        match=r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], "
        r"expected \[80, 64\]",
    ) as e:
        load_hf(bad)
    _one_line_error(e)

    bad = tmp_path / "missing-shard"
    shutil.copytree(sharded, bad)
    victim = sorted(bad.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(DiffquantError, match=f"shard {victim.name} is missing") as e:
        load_hf(bad)
    _one_line_error(e)

    bad = tmp_path / "no-weights"
    bad.mkdir()
    shutil.copy(single / "config.json", bad / "config.json")
    with pytest.raises(DiffquantError, match="no model.safetensors"):
        load_hf(bad)

    # dtypes the native model cannot hold: an integer target dtype, and integer (quantized) tensors
    with pytest.raises(DiffquantError, match="requested dtype torch.int8") as e:
        load_hf(single, dtype=torch.int8)
    _one_line_error(e)
    bad = tmp_path / "int8"
    shutil.copytree(single, bad)
    state = load_file(bad / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj.weight"
    state[key] = state[key].round().to(torch.int8)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(DiffquantError, match=f"tensor {key} has dtype I8") as e:
        load_hf(bad)
    _one_line_error(e)

    bad = tmp_path / "extra"
    shutil.copytree(single, bad)
    state = load_file(bad / "model.safetensors")
    state.pop("model.layers.1.self_attn.lambda_k2")
    state["model.layers.1.self_attn.groupnorm.weight"] = torch.ones(16)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(DiffquantError, match="missing tensor model.layers.1.self_attn.lambda_k2"):
        load_hf(bad)


# ================================================================================================= unilm
def _rope_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-J RoPE on (B, T, H, d): channel pair (2i, 2i+1) as a complex number times e^{i pos theta^-2i/d}."""
    t, d = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * rot).reshape(x.shape).to(x.dtype)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, T, H, d) x2, (B, T, H, dv) -> (B, T, H, dv), softmax in fp32."""
    logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / q.shape[-1] ** 0.5
    t = q.shape[1]
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", logits.softmax(-1), v.float())


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _unilm_forward(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """A unilm-layout decoder written from the reference formulas (multihead_flashdiff_1 / flashdiffv2)."""
    v1 = cfg["attention"] == "diff_v1"
    h, hkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    rep = h // hkv
    x = w["embed_tokens.weight"][ids]
    b, t, _ = x.shape
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        a = p + "attention."
        y = _rms(x, w[p + "attention_norm.weight"], cfg["norm_eps"])
        q = _rope_interleaved((y @ w[a + "q_proj.weight"].T).view(b, t, 2 * h, d), cfg["rope_theta"])
        k_heads = 2 * hkv if v1 else hkv
        k = _rope_interleaved((y @ w[a + "k_proj.weight"].T).view(b, t, k_heads, d), cfg["rope_theta"])
        if v1:
            v = (y @ w[a + "v_proj.weight"].T).view(b, t, hkv, 2 * d).repeat_interleave(rep, dim=2)
            q, k = q.view(b, t, h, 2, d), k.view(b, t, hkv, 2, d).repeat_interleave(rep, dim=2)
            attn1, attn2 = _causal(q[..., 0, :], k[..., 0, :], v), _causal(q[..., 1, :], k[..., 1, :], v)
            lam_init = 0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * i)).item()
            lam = (
                torch.exp((w[a + "lambda_q1"] * w[a + "lambda_k1"]).sum())
                - torch.exp((w[a + "lambda_q2"] * w[a + "lambda_k2"]).sum())
                + lam_init
            )
            o = _rms(attn1 - lam * attn2, w[a + "subln.weight"], 1e-5) * (1 - lam_init)
            out = o.reshape(b, t, -1) @ w[a + "out_proj.weight"].T
        else:
            v = (y @ w[a + "v_proj.weight"].T).view(b, t, hkv, d)
            group = 2 * h // hkv  # query heads per kv head
            attn = _causal(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2))
            lam = torch.sigmoid(y @ w[a + "lambda_proj.weight"].T)[..., None]
            o = attn[:, :, 0::2] - lam * attn[:, :, 1::2]
            out_key = a + "o_proj.weight" if a + "o_proj.weight" in w else a + "out_proj.weight"
            out = o.reshape(b, t, -1) @ w[out_key].T
        x = x + out
        y = _rms(x, w[p + "ffn_norm.weight"], cfg["norm_eps"])
        ff = p + "feed_forward."
        x = x + (F.silu(y @ w[ff + "w1.weight"].T) * (y @ w[ff + "w3.weight"].T)) @ w[ff + "w2.weight"].T
    head = w["embed_tokens.weight"] if cfg.get("tie_embeddings") else w["output.weight"]
    return _rms(x, w["norm.weight"], cfg["norm_eps"]) @ head.T


def _unilm_weights(cfg: dict, seed: int, v2_out: str = "o_proj") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    e, h, hkv, d, f = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["ffn_dim"]
    v1 = cfg["attention"] == "diff_v1"

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=gen)

    # embeddings of std 0.15: a tied head then gives logits of order 1, where fp32 rounding stays < 1e-5
    w = {
        "embed_tokens.weight": 0.15 * torch.randn(cfg["vocab_size"], e, generator=gen),
        "norm.weight": norm(e),
    }
    if not cfg.get("tie_embeddings"):
        w["output.weight"] = lin(cfg["vocab_size"], e)
    for i in range(cfg["n_layers"]):
        p, a = f"layers.{i}.", f"layers.{i}.attention."
        w[p + "attention_norm.weight"], w[p + "ffn_norm.weight"] = norm(e), norm(e)
        w[a + "q_proj.weight"] = lin(2 * h * d, e)
        w[a + "k_proj.weight"] = lin((2 if v1 else 1) * hkv * d, e)
        w[a + "v_proj.weight"] = lin((2 if v1 else 1) * hkv * d, e)
        if v1:
            w[a + "out_proj.weight"] = lin(e, 2 * h * d)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                w[a + name] = 0.2 * torch.randn(d, generator=gen)
            w[a + "subln.weight"] = norm(2 * d)
        else:
            w[a + v2_out + ".weight"] = lin(e, h * d)
            w[a + "lambda_proj.weight"] = lin(h, e)
        w[p + "feed_forward.w1.weight"], w[p + "feed_forward.w3.weight"] = lin(f, e), lin(f, e)
        w[p + "feed_forward.w2.weight"] = lin(e, f)
    return w


UNILM_CASES = {
    # V1 with GQA (4 differential heads over 2 kv pairs), head_dim from unilm's d_model // n_heads // 2
    "v1-gqa": ({"attention": "diff_v1", "n_heads": 4, "n_kv_heads": 2, "rope_theta": 5000.0}, "o_proj"),
    # V2 with GQA, explicit head_dim, unilm's older out_proj name, tied LM head
    "v2-gqa-tied": (
        {"attention": "diff_v2", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "tie_embeddings": True},
        "out_proj",
    ),
}


def _unilm_folder(tmp_path: Path, name: str) -> tuple[dict, dict[str, torch.Tensor], Path]:
    overrides, v2_out = UNILM_CASES[name]
    cfg = {
        "vocab_size": 300,
        "d_model": 64,
        "n_layers": 3,
        "ffn_dim": 96,
        "max_seq_len": 64,
        "norm_eps": 1e-6,
    }
    cfg.update(overrides)
    full = dict(
        cfg, head_dim=cfg.get("head_dim", 64 // cfg["n_heads"] // 2), rope_theta=cfg.get("rope_theta", 1e4)
    )
    weights = _unilm_weights(full, seed=len(name), v2_out=v2_out)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(folder / "model.safetensors"))
    return full, weights, folder


@pytest.mark.parametrize("name", list(UNILM_CASES))
def test_load_unilm_matches_reference(tmp_path, name):
    cfg, weights, folder = _unilm_folder(tmp_path, name)
    model = load_unilm(folder)
    assert model.config.attention == cfg["attention"] and model.config.head_dim == cfg["head_dim"]
    worst = 0.0
    with torch.no_grad():
        for length in (7, 13):
            ids = _ids(length)
            worst = max(worst, (model(ids) - _unilm_forward(cfg, weights, ids)).abs().max().item())
    assert worst < 1e-5, worst
    assert torch.equal(
        load_converted(f"unilm:{folder}").state_dict()["embed.weight"], weights["embed_tokens.weight"]
    )


def test_unilm_bad_inputs(tmp_path):
    _, weights, folder = _unilm_folder(tmp_path, "v1-gqa")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, num_heads=4)))
    with pytest.raises(DiffquantError, match="unknown key.*num_heads") as e:
        load_unilm(folder)
    _one_line_error(e)
    (folder / "config.json").write_text(json.dumps(dict(cfg, attention="baseline")))
    with pytest.raises(DiffquantError, match="attention = 'baseline', expected one of diff_v1, diff_v2"):
        load_unilm(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights.pop("layers.2.attention.subln.weight")
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(DiffquantError, match="missing tensor layers.2.attention.subln.weight") as e:
        load_unilm(folder)
    _one_line_error(e)
