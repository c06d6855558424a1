"""``diffquant export --to compressed-tensors / gptq`` (diffquant/io/export_quant.py) on tiny models.

compressed-tensors: the export is loaded by transformers with the compressed-tensors package (the loader vLLM
shares the format with) and its logits must equal those of diffquant's own quantized model (the folder
``diffquant quantize`` wrote, read by ``load_model``) to float32 rounding; the packed tensors must also be
bit for bit what the library's own compressor writes for the same weights.

GPTQ: no GPTQ loader runs on this machine's CPU (GPTQModel needs a newer torch and builds an extension;
transformers' GPTQ integration needs it and optimum), so the layout is read by an unpacker written here from
the format's description (qweight [in * b / 32, out] with codes least significant bits first along the input
dimension, qzeros [groups, out * b / 32] holding z - 1 in the v1 checkpoint format, scales [groups, out],
g_idx; the dequantized weight is scales[g_idx] * (q - (z + 1))[g_idx]) and the weights it yields are loaded
into transformers' own Llama.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffquant.cli import main
from diffquant.io.load import load_model
from tests.conftest import save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _spelled(weights: dict) -> dict:
    """A weights section written here as ``bits`` / ``group_size``, in the spelling this tree's schema reads
    (``format: int4`` / ``group`` since the keys were renamed)."""
    from dataclasses import fields

    from diffquant.quant.weights import WeightsSpec

    if "format" not in {f.name for f in fields(WeightsSpec)}:
        return weights
    out = {k: v for k, v in weights.items() if k not in ("bits", "group_size")}
    return {**out, "format": f"int{weights['bits']}", "group": weights["group_size"]}


def _quantized(tmp_path, weights: dict, name: str = "q", **extra) -> str:
    """A tiny HF Llama (hidden 96: not a multiple of 64) quantized by ``diffquant quantize`` under a plan
    with ``weights`` (and ``extra`` plan sections); the quantized folder's path."""
    base = tmp_path / "base"
    if not base.exists():
        save_tiny_llama(base, context=64, hidden_size=96, intermediate_size=128)
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps({"name": name, "weights": _spelled(weights), **extra}))
    out = tmp_path / name
    argv = ["quantize", f"hf:{base}", "--plan", str(plan), "--out", str(out), "--tokenizer", "byte"]
    assert main([*argv, "--seq-len", "16", "--calib-tokens", "64", "--eval-tokens", "32"]) == 0
    return str(out)


def _ours(folder: str) -> torch.Tensor:
    with torch.no_grad():
        return load_model(folder)(IDS)


def _export(folder: str, out, to: str, *extra: str) -> None:
    assert main(["export", folder, "--to", to, str(out), *extra]) == 0


def _transformers(folder, dequantize: bool = False) -> torch.nn.Module:
    kwargs = {}
    if dequantize:
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **kwargs
    ).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# ================================================================================== compressed-tensors
CT_CASES = {
    "rtn-int4-g32-sym": {"method": "rtn", "bits": 4, "group_size": 32},
    "rtn-int4-g64-asym": {"method": "rtn", "bits": 4, "group_size": 64, "sym": False},  # 96: regrouped
    "gptq-int4-channel-sym": {"method": "gptq", "bits": 4, "group_size": "channel"},
    "gptq-int4-g32-asym-actorder": {
        "method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": False,
        "act_order": True,
    },
    "rtn-int8-channel-asym": {"method": "rtn", "bits": 8, "group_size": "channel", "sym": False},
    # AWQ: its scales folded into the norms, its codes those of W diag(s)
    "awq-int4-g32-asym": {"method": "awq", "bits": 4, "group_size": 32, "sym": False},
    "rtn-int8-g32-sym": {"method": "rtn", "bits": 8, "group_size": 32},
    "rtn-int2-g32-asym": {"method": "rtn", "bits": 2, "group_size": 32, "sym": False},
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_export_loads_in_transformers_with_diffquants_logits(tmp_path, case):
    weights = CT_CASES[case]
    folder = _quantized(tmp_path, weights)
    _export(folder, tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    scheme = config["config_groups"]["group_0"]["weights"]
    assert config["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
    assert scheme["num_bits"] == weights["bits"] and scheme["symmetric"] == weights.get("sym", True)
    if weights["group_size"] == 64:
        assert scheme["group_size"] == 32  # gcd(64, 96, 128): the plan's scales repeated, the same weights
    ours = _ours(folder)
    # transformers 5 + compressed-tensors 0.20 load an asymmetric pack-quantized folder only with
    # dequantize=True (their compressed route expects unpacked zero points, whatever wrote the folder)
    sym = weights.get("sym", True)
    routes = [False, True] if sym else [True]
    for dequantize in routes:
        theirs = _logits(_transformers(tmp_path / "ct", dequantize))
        torch.testing.assert_close(theirs, ours, rtol=0, atol=2e-5)


@pytest.mark.parametrize("case", ["rtn-int4-g64-asym", "rtn-int4-g32-sym", "rtn-int8-channel-asym"])
def test_packed_tensors_are_what_compressed_tensors_itself_writes(tmp_path, case):
    """compressed-tensors' own compressor, given diffquant's dequantized weight, its scale and the signed
    zero point z - 2^(b-1), writes bit for bit the tensors of the export."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    weights = CT_CASES[case]
    folder = _quantized(tmp_path, weights)
    _export(folder, tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    written = load_file(str(tmp_path / "ct" / "model.safetensors"))
    stored = load_file(f"{folder}/quant_state.safetensors")  # the codes diffquant quantize wrote
    bits, size = weights["bits"], group["weights"]["group_size"]
    plan_size = weights["group_size"]
    checked = 0
    for i in range(2):
        for native, hf in (("attn.q_proj", "self_attn.q_proj"), ("mlp.down", "mlp.down_proj")):
            prefix = f"layers.{i}.{native}.weight_quantizer"
            codes, scale, zero = (stored[f"{prefix}.{b}"] for b in ("codes", "scale", "zero"))
            width = codes.shape[1]
            if plan_size == "channel":
                scale, zero = scale.expand(-1, width), zero.expand(-1, width)
            else:
                scale = scale.repeat_interleave(plan_size, 1)[:, :width]
                zero = zero.repeat_interleave(plan_size, 1)[:, :width]
            w = (codes.float() - zero) * scale  # (q - z) * s, column by column
            step = size or width
            state = {"weight": w, "weight_scale": scale[:, ::step].contiguous()}
            if not weights.get("sym", True):
                state["weight_zero_point"] = (zero[:, ::step] - 2 ** (bits - 1)).to(torch.int8)
            theirs = compressor.compress(state, scheme)
            key = f"model.layers.{i}.{hf}"
            for name in ("weight_packed", "weight_zero_point", "weight_shape"):
                if name in theirs:
                    assert torch.equal(written[f"{key}.{name}"], theirs[name]), (key, name)
                    checked += 1
            assert torch.equal(written[f"{key}.weight_scale"], state["weight_scale"]), key
    assert checked >= 2 * 2 * 2


def test_tied_model_with_a_quantized_head_unties_it(tmp_path):
    base = tmp_path / "base"
    save_tiny_llama(base, context=64, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    folder = _quantized(
        tmp_path, {"method": "rtn", "bits": 4, "group_size": 32, "modules": ["layers.*", "lm_head"]}
    )
    _export(folder, tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["ignore"] == []
    assert "lm_head.weight_packed" in load_file(str(tmp_path / "ct" / "model.safetensors"))
    torch.testing.assert_close(_logits(_transformers(tmp_path / "ct")), _ours(folder), rtol=0, atol=2e-5)


def test_offline_rotation_and_smoothing_export(tmp_path):
    """A residual and heads rotation (folded into the weights, norms folded into their readers) and
    SmoothQuant's factors (folded into norms and Linears) leave a plain Llama: they export."""
    base = tmp_path / "base"
    save_tiny_llama(base, context=64, hidden_size=64, intermediate_size=128)
    rotate = {"residual": "hadamard", "heads": "hadamard", "ffn": "none", "qk": "none"}
    folder = _quantized(
        tmp_path, {"method": "rtn", "bits": 4, "group_size": 32}, rotate=rotate, smooth={"alpha": 0.5}
    )
    _export(folder, tmp_path / "ct", "compressed-tensors")
    torch.testing.assert_close(_logits(_transformers(tmp_path / "ct")), _ours(folder), rtol=0, atol=2e-5)


# ============================================================================================= GPTQ
def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [rows, w] -> [rows, count] values, value j of a word at bits j * bits (lsb first)."""
    per = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per) * bits
    values = (u.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)[:, :count]


def gptq_dequantize(tensors: dict, prefix: str, bits: int) -> torch.Tensor:
    """The weight [out, in] a GPTQ v1 checkpoint's Linear holds, read from the format description."""
    qweight, qzeros = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"]
    scales, g_idx = tensors[f"{prefix}.scales"].float(), tensors[f"{prefix}.g_idx"].long()
    n_out = scales.shape[1]
    n_in = qweight.shape[0] * 32 // bits
    codes = unpack_words(qweight.T, bits, n_in).T  # [in, out]
    zeros = unpack_words(qzeros, bits, n_out) + 1  # [groups, out]: v1 stores z - 1
    return (scales[g_idx] * (codes - zeros[g_idx]).float()).T


def _gptq_into_transformers(folder) -> torch.nn.Module:
    config = json.loads((folder / "config.json").read_text())
    bits = config.pop("quantization_config")["bits"]
    tensors = load_file(str(folder / "model.safetensors"))
    dense = {
        k: v
        for k, v in tensors.items()
        if k.rsplit(".", 1)[1] not in ("qweight", "qzeros", "scales", "g_idx")
    }
    for key in tensors:
        if key.endswith(".qweight"):
            prefix = key.removesuffix(".qweight")
            dense[f"{prefix}.weight"] = gptq_dequantize(tensors, prefix, bits)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.float()


GPTQ_CASES = {
    "gptq-int4-g32-sym": {"method": "gptq", "bits": 4, "group_size": 32},
    "rtn-int4-g64-asym": {"method": "rtn", "bits": 4, "group_size": 64, "sym": False},
    "gptq-int8-channel-asym": {"method": "gptq", "bits": 8, "group_size": "channel", "sym": False},
    "rtn-int2-g32-sym": {"method": "rtn", "bits": 2, "group_size": 32},
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_layout_read_from_the_format_description(tmp_path, case):
    weights = GPTQ_CASES[case]
    folder = _quantized(tmp_path, weights)
    _export(folder, tmp_path / "gptq", "gptq", "--scale-dtype", "float32")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert config == json.loads((tmp_path / "gptq" / "quantize_config.json").read_text())
    assert config["checkpoint_format"] == "gptq" and config["desc_act"] is False
    assert config["group_size"] == {32: 32, 64: 32, "channel": -1}[weights["group_size"]]
    tensors = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    bits = weights["bits"]
    q = tensors["model.layers.0.self_attn.q_proj.qweight"]
    assert q.dtype == torch.int32 and tuple(q.shape) == (96 * bits // 32, 96)
    assert tuple(tensors["model.layers.0.mlp.down_proj.scales"].shape) == (
        (1 if weights["group_size"] == "channel" else 128 // 32),
        96,
    )
    if weights.get(
        "sym", True
    ):  # every GPTQ symmetric checkpoint's signature: z - 1 = 2^(b-1) - 1 in each field
        word = {2: 0x55555555, 4: 0x77777777, 8: 0x7F7F7F7F}[bits]
        assert (tensors["model.layers.1.mlp.up_proj.qzeros"] == word).all()
    torch.testing.assert_close(
        _logits(_gptq_into_transformers(tmp_path / "gptq")), _ours(folder), rtol=0, atol=2e-5
    )


def test_gptq_default_scales_are_float16_and_the_codes_unchanged(tmp_path):
    folder = _quantized(tmp_path, GPTQ_CASES["rtn-int4-g64-asym"])
    _export(folder, tmp_path / "f32", "gptq", "--scale-dtype", "float32")
    _export(folder, tmp_path / "f16", "gptq")
    a = load_file(str(tmp_path / "f32" / "model.safetensors"))
    b = load_file(str(tmp_path / "f16" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith(".scales"):
            assert b[key].dtype == torch.float16 and torch.equal(b[key], a[key].half())
        else:
            assert torch.equal(a[key], b[key]), key


# ============================================================================================ sizes
def test_the_packed_linears_take_a_quarter_of_bf16(tmp_path):
    folder = _quantized(tmp_path, {"method": "rtn", "bits": 4, "group_size": 32})
    _export(folder, tmp_path / "ct", "compressed-tensors", "--scale-dtype", "bfloat16")
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    packed = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(".weight_packed"))
    scales = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(".weight_scale"))
    bf16 = 2 * 2 * (2 * 96 * 96 + 2 * 96 * 48 + 3 * 96 * 128)  # 2 bytes x every Linear weight of 2 layers
    assert packed * 4 == bf16 and scales * 32 == bf16  # 4 bits; a 16-bit scale per 32 weights


# ============================================================================================ refusals
def _refused(capsys, tmp_path, to, model, *needles, extra=()):
    """``diffquant export MODEL --to TO`` exits 2 with one line holding ``needles``, and writes nothing."""
    out = tmp_path / "refused"
    capsys.readouterr()
    assert main(["export", str(model), "--to", to, str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for needle in needles:
        assert needle in err[0], err[0]
    assert not out.exists()


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    base = tmp_path / "base"
    save_tiny_llama(base, context=64, hidden_size=96, intermediate_size=128)
    _refused(capsys, tmp_path, "compressed-tensors", f"hf:{base}", "not quantized", "--to hf")
    with pytest.raises(SystemExit):
        main(["export", f"hf:{base}", "--to", "awq", str(tmp_path / "x")])
    capsys.readouterr()
    _refused(
        capsys,
        tmp_path,
        "hf",
        f"hf:{base}",
        "--scale-dtype",
        extra=(
            "--scale-dtype",
            "float16",
        ),
    )
    hqq = _quantized(tmp_path, {"method": "hqq", "bits": 4, "group_size": 32}, name="hqq")
    _refused(capsys, tmp_path, "compressed-tensors", hqq, "not integers", "hqq")
    int3 = _quantized(tmp_path, {"method": "rtn", "bits": 3, "group_size": 32}, name="int3")
    _refused(capsys, tmp_path, "gptq", int3, "int3", "2, 4 or 8 bits")
    rules = _quantized(
        tmp_path,
        {"method": "rtn", "bits": 4, "group_size": 32},
        name="rules",
        rules=[{"sites": ["kind:linear_in"], "scheme": "int8:token"}],
    )
    _refused(capsys, tmp_path, "compressed-tensors", rules, "fake-quant rule", "int8")
    online = _quantized(
        tmp_path,
        {"method": "rtn", "bits": 4, "group_size": 32},
        name="online",
        rotate={"residual": "none", "heads": "none", "ffn": "hadamard"},
    )
    _refused(capsys, tmp_path, "compressed-tensors", online, "rotate.ffn", "online")
    kv = _quantized(
        tmp_path, {"method": "rtn", "bits": 4, "group_size": 32}, name="kv", kv_cache={"group": 8}
    )
    _refused(capsys, tmp_path, "compressed-tensors", kv, "KV cache")
    partial = _quantized(
        tmp_path,
        {"method": "rtn", "bits": 4, "group_size": 32, "exclude": ["layers.1.mlp.*"]},
        name="partial",
    )
    _refused(
        capsys,
        tmp_path,
        "gptq",
        partial,
        "model.layers.1.mlp.down_proj is not quantized",
        "compressed-tensors",
    )
    _export(partial, tmp_path / "partial-ct", "compressed-tensors")  # compressed-tensors lists them in ignore
    ignore = json.loads((tmp_path / "partial-ct" / "config.json").read_text())["quantization_config"][
        "ignore"
    ]
    assert ignore == [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")] + ["lm_head"]
    torch.testing.assert_close(
        _logits(_transformers(tmp_path / "partial-ct")), _ours(partial), rtol=0, atol=2e-5
    )


def test_other_kinds_are_refused(tmp_path, capsys):
    for kind in ("diff_v1", "diff_v2", "gated"):
        assert main(["init", str(tmp_path / kind), "--kind", kind]) == 0
        plan = tmp_path / "plan.json"
        weights = _spelled({"method": "rtn", "bits": 4, "group_size": 32})
        plan.write_text(json.dumps({"name": "w", "weights": weights}))
        argv = ["quantize", str(tmp_path / kind), "--plan", str(plan), "--out", str(tmp_path / f"q-{kind}")]
        assert main([*argv, "--seq-len", "16", "--calib-tokens", "64", "--eval-tokens", "32"]) == 0
        _refused(
            capsys,
            tmp_path,
            "compressed-tensors",
            str(tmp_path / f"q-{kind}"),
            f"'{kind}'",
            "Hugging Face architecture",
        )


def test_gptq_v1_refuses_a_zero_point_of_zero(tmp_path, capsys):
    """An asymmetric group with no negative weight has z = 0, which v1's stored z - 1 cannot hold."""
    base = tmp_path / "base"
    save_tiny_llama(base, context=64, hidden_size=96, intermediate_size=128)
    state = load_file(str(base / "model.safetensors"))
    key = "model.layers.0.self_attn.k_proj.weight"
    state[key][0, :32] = state[key][0, :32].abs()
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    folder = _quantized(tmp_path, {"method": "rtn", "bits": 4, "group_size": 32, "sym": False})
    _refused(capsys, tmp_path, "gptq", folder, "layers.0.attn.k_proj", "zero point 0")
    _export(folder, tmp_path / "ct", "compressed-tensors")  # compressed-tensors holds it
    torch.testing.assert_close(
        _logits(_transformers(tmp_path / "ct", True)), _ours(folder), rtol=0, atol=2e-5
    )
