"""The quantized KV cache (diffquant/quant/kv_cache.py): packed codes, KIVI's streaming window, references.

References: transformers' ``QuantizedCache`` (quanto backend) on a tiny random HF Llama, for the setting both
implement; a float64 brute force of the cache's definition written here (asymmetric min-max per group,
sinks / body / window) for every attention kind; the full forward for an unquantized cache.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.io import load_model
from diffquant.models.attention import apply_rope, rope_cos_sin
from diffquant.quant import QuantPlan, apply_plan
from diffquant.quant.kv_cache import (
    KVCacheSpec,
    QuantizedLayerKV,
    cache_nbytes,
    dequantize_groups,
    pack,
    quantize_groups,
    unpack,
)
from tests.conftest import save_tiny_llama, tiny_model


def _plan(**spec) -> QuantPlan:
    return QuantPlan.from_dict({"name": "kv", "kv_cache": spec})


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of every position: the prefix in one call, then one token per call through the cache."""
    cache = model.new_cache()
    with torch.no_grad():
        out = [model(ids[:, :prefill], cache)]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache))
    return torch.cat(out, 1), cache


# ------------------------------------------------------------------------------------------ codes
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trips_every_code(bits):
    codes = torch.randint(
        0, 2**bits, (2, 3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 16 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)
    # planar, low bits first: byte j of a row holds code j + i * D / per in bits [bits * i, bits * (i + 1))
    per, row = 8 // bits, codes[1, 2, 3].tolist()
    want = [sum(row[j + i * (16 // per)] << (bits * i) for i in range(per)) for j in range(16 // per)]
    assert packed[1, 2, 3].tolist() == want


def _reference_groups(
    x: torch.Tensor, bits: int, axis: str, group: int, fmt: str = "int", scale_dtype: str = "model"
) -> torch.Tensor:
    """x_hat of min-max groups, element by element from the definition, in float64 (fp8: absmax / 448
    scales, the value through torch's float8_e4m3fn cast in the input's dtype). ``scale_dtype`` float16 /
    bfloat16: lo is rounded to it, then scale = (max - lo) / levels is rounded, and the codes use both."""
    b, h, s, d = x.shape

    def stored(value: float) -> float:
        if scale_dtype == "model":
            return value
        return float(torch.tensor(value, dtype=torch.float64).to(getattr(torch, scale_dtype)))

    out = torch.empty_like(x, dtype=torch.float64)
    levels = 2**bits - 1
    for bi in range(b):
        for hi in range(h):
            if axis == "token":
                blocks = [(t, slice(c, c + group)) for t in range(s) for c in range(0, d, group)]
            else:
                blocks = [(slice(t, t + group), c) for t in range(0, s, group) for c in range(d)]
            for t, c in blocks:
                if fmt == "fp8":
                    raw = x[bi, hi, t, c]
                    scale = stored(float(raw.abs().max()) / 448.0)
                    ratio = (raw / scale).clamp(-448.0, 448.0)
                    fp8 = ratio.to(torch.float8_e4m3fn) if scale > 0 else torch.zeros_like(raw)
                    out[bi, hi, t, c] = fp8.double() * scale
                    continue
                g = x[bi, hi, t, c].double()
                lo, top = stored(float(g.min())), float(g.max())
                scale = stored((top - lo) / levels)
                q = (
                    torch.zeros_like(g)
                    if scale == 0
                    else torch.clamp(torch.round((g - lo) / scale), 0, levels)
                )
                out[bi, hi, t, c] = q * scale + lo
    return out


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_groups_follow_the_min_max_definition(axis, bits):
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[0, 0, :4, :4] = 0.25  # a constant group: code 0, read back exactly
    codes, scale, zero = quantize_groups(x, bits, axis, 4)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    want = (2, 2, 8, 2) if axis == "token" else (2, 2, 2, 8)
    assert scale.shape == want and zero.shape == want
    got = dequantize_groups(codes, scale, zero, axis, 4)
    ref = _reference_groups(x, bits, axis, 4)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    assert torch.equal(got[0, 0, :4, :4], x[0, 0, :4, :4])
    # the error of each entry is at most half a step of its group
    step = (ref - x).abs().max()
    assert float(step) <= float(scale.max()) / 2 + 1e-12


def test_fp8_groups_are_torch_float8_casts_of_absmax_scaled_values():
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(11)) * 5
    x[1, 1, :, :4] = 0.0  # an all-zero group reads back zeros
    for axis in ("token", "channel"):
        codes, scale, zero = quantize_groups(x, 8, axis, 4, "fp8")
        assert zero is None and codes.dtype == torch.uint8
        got = dequantize_groups(codes, scale, zero, axis, 4)
        assert torch.allclose(got.double(), _reference_groups(x, 8, axis, 4, "fp8"), rtol=0, atol=1e-6)
        assert torch.equal(got[1, 1, :, :4], torch.zeros(8, 4))
        # e4m3 keeps 3 mantissa bits: every value within 1/16 relative of itself
        assert ((got - x).abs() <= x.abs() / 16 + 1e-6).all()


# ------------------------------------------------------------------------------------------ decode
def test_unquantized_cache_decode_equals_the_full_forward(any_kind):
    model = tiny_model(any_kind)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
    for prefill in (1, 17):
        dec, _ = _decode(model, ids, prefill)
        assert (dec - full).abs().max() <= 1e-6


def _brute_decode(model, ids: torch.Tensor, prefill: int, spec: KVCacheSpec) -> torch.Tensor:
    """The cache's definition replayed in float64 on a float64 copy of the model: at each step every layer's
    keys / values are [sinks | dequantized body | window] with the body re-derived from scratch (the tokens
    quantized so far, in whole groups, from the full-precision keys and values recorded per token)."""
    import copy

    m64 = copy.deepcopy(model).double()
    layers = [blk.attn for blk in m64.layers]
    records = [{"k": [], "v": []} for _ in layers]  # per layer: full-precision tokens, in order
    moved = [{"k": 0, "v": 0} for _ in layers]  # tokens in the body so far

    def rotation(start: int, n: int, sign: float):
        """RoPE tables of positions start .. start + n - 1 (sign -1: the inverse rotation)."""
        c = m64.config
        cos, sin = rope_cos_sin(torch.arange(start, start + n), c.head_dim, c.rope_theta, torch.float64)
        return cos, sign * sin

    class Replay:
        pre_rope = False  # takes post-RoPE keys, as a plain cache; pre_rope is replayed below

        def __init__(self, i):
            self.i = i

        @property
        def length(self):
            return sum(t.shape[2] for t in records[self.i]["k"])

        def append(self, k, v):
            out = []
            if spec.pre_rope:  # KVQuant: the keys are quantized before RoPE, rotated after
                k = apply_rope(k, *rotation(self.length, k.shape[2], -1.0))
            for name, x, axis in (("k", k, spec.keys), ("v", v, spec.values)):
                records[self.i][name].append(x)
                seq = torch.cat(records[self.i][name], 2)
                n_sink = min(spec.sinks, seq.shape[2])
                body_end = n_sink + moved[self.i][name]
                body = seq[:, :, n_sink:body_end]
                if body.shape[2]:
                    pieces = []
                    # the body was quantized in the chunks it moved in; groups never straddle chunks, and a
                    # chunk re-quantized alone gives the same groups (token groups: per token; channel groups:
                    # whole groups of tokens from the body's start)
                    step = 1 if axis == "token" else spec.group
                    for a in range(0, body.shape[2], step):
                        pieces.append(
                            _reference_groups(
                                body[:, :, a : a + step],
                                spec.bits,
                                axis,
                                spec.group,
                                spec.codes,
                                spec.scale_dtype,
                            )
                        )
                    body = torch.cat(pieces, 2)
                out.append(torch.cat([seq[:, :, :n_sink], body, seq[:, :, body_end:]], 2))
                window = seq.shape[2] - body_end
                if window and window >= spec.window:
                    moved[self.i][name] += window - (window % spec.group if axis == "channel" else 0)
            if spec.pre_rope:
                out[0] = apply_rope(out[0], *rotation(0, out[0].shape[2], 1.0))
            return out[0], out[1]

    class Cache:
        def __init__(self):
            self.layers = [Replay(i) for i in range(len(layers))]

        @property
        def length(self):
            return self.layers[0].length

    cache = Cache()
    with torch.no_grad():
        out = [m64(ids[:, :prefill], cache)]
        for t in range(prefill, ids.shape[1]):
            out.append(m64(ids[:, t : t + 1], cache))
    return torch.cat(out, 1)


SPECS = [
    dict(format="fp8", keys="channel", values="token", group=4, window=4),
    dict(format="int4", keys="channel", values="token", group=4, window=8),
    dict(format="int2", keys="token", values="channel", group=4, window=4, sinks=3),
    dict(format="int8", keys="channel", values="token", group=4, window=4, sinks=1, pre_rope=True),
    dict(format="int4", keys="channel", values="token", group=4, window=8, scale_dtype="float16"),
    dict(format="fp8", keys="token", values="token", group=4, window=4, scale_dtype="bfloat16"),
]


@pytest.mark.parametrize(
    "spec", SPECS, ids=["fp8", "kivi4", "kv2-sinks", "kv8-prerope", "kivi4-f16-scales", "fp8-bf16-scales"]
)
def test_quantized_decode_equals_a_float64_brute_force(any_kind, spec):
    model = tiny_model(any_kind).double()
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(3))
    reference = _brute_decode(model, ids, 9, KVCacheSpec(**spec))
    apply_plan(model, _plan(**spec))
    got, cache = _decode(model, ids, 9)
    assert (got - reference).abs().max() <= 1e-9
    with torch.no_grad():
        full = model(ids)
    assert (got - full).abs().max() > 1e-6  # the cache did quantize something
    body = cache_nbytes(cache)
    assert body["codes"] > 0


@pytest.mark.parametrize("scale_dtype", ["model", "float16"])
def test_packed_bytes_equal_the_formula(kind, scale_dtype):
    spec = dict(
        format="int4", keys="channel", values="token", group=4, window=8, sinks=2, scale_dtype=scale_dtype
    )
    model = tiny_model(kind)
    apply_plan(model, _plan(**spec))
    ids = torch.randint(0, 61, (3, 37), generator=torch.Generator().manual_seed(4))
    _, cache = _decode(model, ids, 5)
    c = model.config
    k_heads = 2 * c.n_kv_heads if kind == "diff_v1" else c.n_kv_heads
    total = {"codes": 0, "scales": 0, "zeros": 0, "full": 0}
    for layer in cache.layers:
        sizes = layer.nbytes()
        for name, heads, width in (("keys", k_heads, c.head_dim), ("values", c.n_kv_heads, c.value_dim)):
            part = sizes[name]
            n = part["quantized_tokens"]
            # after the sinks, tokens move in whenever the window reaches 8 (keys: whole groups of 4)
            window = 37 - 2 - n
            assert 0 <= window < 8 + (4 if name == "keys" else 0)
            elements = 3 * heads * n * width
            groups = elements // 4
            assert part["codes"] == elements * 4 // 8
            per = 4 if scale_dtype == "model" else 2  # the model's fp32, or float16
            assert part["scales"] == groups * per and part["zeros"] == groups * per
            assert part["full"] == 3 * heads * (2 + window) * width * 4
            for key in total:
                total[key] += part[key]
    assert cache_nbytes(cache) == total


# ------------------------------------------------------------------------------------------ transformers
def _quanto_python_unpack():
    """A pure-torch CPU kernel for quanto's ``unpack`` op (its C++ one JIT-builds for ~50 s on first use):
    quanto packs ``8 / bits`` values per byte along dim 0, value i in bits [bits * i, bits * (i + 1)), and
    unpacks them as consecutive blocks of rows."""
    import optimum.quanto  # noqa: F401 (defines the op)

    def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
        parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
        return torch.cat(parts).to(torch.uint8)

    lib = torch.library.Library("quanto", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("unpack", unpack_rows, "CPU")
    return lib


@pytest.mark.parametrize("axis_key", [0, -1], ids=["keys-per-token", "keys-per-channel"])
def test_decode_logits_equal_transformers_quantized_cache(tmp_path, axis_key):
    """transformers' QuantizedCache (quanto backend) keeps up to ``residual_length`` new tokens in full
    precision and then re-quantizes everything; its prefill quantizes the whole prompt. It equals diffquant's
    cache (sinks 0) when the prompt is at least the window and both are whole groups: axis 0 = diffquant's
    ``token`` groups (q_group_size channels of one token), axis -1 = ``channel`` groups (q_group_size tokens
    of one channel), re-quantizing a dequantized group returning the same codes."""
    pytest.importorskip("optimum.quanto")
    import transformers

    lib = _quanto_python_unpack()  # noqa: F841 (kept alive for the test)
    folder = save_tiny_llama(tmp_path / "llama", context=128)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(f"hf:{folder}").eval()
    group, residual, prompt = 8, 16, 32
    apply_plan(
        ours,
        _plan(
            format="int4",
            keys="token" if axis_key == 0 else "channel",
            values="token",
            group=group,
            window=residual,
        ),
    )
    ids = torch.randint(0, 320, (2, prompt + 40), generator=torch.Generator().manual_seed(5))
    cache = transformers.QuantizedCache(
        backend="quanto",
        config=hf.config,
        nbits=4,
        axis_key=axis_key,
        axis_value=0,
        q_group_size=group,
        residual_length=residual,
    )
    with torch.no_grad():
        theirs = [hf(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            theirs.append(hf(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    theirs = torch.cat(theirs, 1)
    got, _ = _decode(ours, ids, prompt)
    with torch.no_grad():
        full = hf(input_ids=ids).logits
    assert (got - theirs).abs().max() <= 1e-5
    assert (theirs - full).abs().max() > 1e-3  # their cache did quantize


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "spec, words",
    [
        (dict(format="int3"), "kv_cache.format"),
        (dict(keys="head"), "kv_cache.keys"),
        (dict(group=0), "kv_cache.group"),
        (dict(format="nf4"), "kv_cache.format"),
        (dict(format="int"), r"kv_cache.format: .*the old bits: 4 \+ format: int is format: int4"),
        (dict(pre_rope=1), "kv_cache.pre_rope"),
        (dict(scale_dtype="float8"), "kv_cache.scale_dtype"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_kv_cache_sections_are_one_line_errors(spec, words):
    with pytest.raises(DiffquantError, match=words) as err:
        _plan(**spec)
    assert "\n" not in str(err.value)


def test_groups_that_do_not_tile_the_heads_are_refused(kind):
    model = tiny_model(kind)  # head_dim 8
    with pytest.raises(DiffquantError, match="group 3 does not divide"):
        apply_plan(model, _plan(format="int4", keys="token", values="token", group=3, window=0))
    with pytest.raises(DiffquantError, match="multiple of group 4"):
        apply_plan(model, _plan(format="int4", keys="channel", group=4, window=6))
    assert model.quant is None and model.quant_plan is None


def test_pre_rope_refuses_a_key_site_quantizer_and_a_qk_rotation():
    model = tiny_model("baseline")
    doc = {"name": "kv", "kv_cache": {"pre_rope": True, "group": 4, "window": 8}}
    plan = QuantPlan.from_dict({**doc, "rules": [{"sites": ["kind:k"], "scheme": "int8:token"}]})
    with pytest.raises(DiffquantError, match="pre_rope"):
        apply_plan(model, plan)
    with pytest.raises(DiffquantError, match="rotate.qk"):
        QuantPlan.from_dict({**doc, "rotate": {"qk": "hadamard"}})


def test_the_plan_round_trips_its_kv_cache_section():
    plan = _plan(format="int2", keys="token", values="channel", group=16, window=32, sinks=4)
    again = QuantPlan.from_dict(plan.to_dict())
    assert again.kv_cache == plan.kv_cache and again.to_dict() == plan.to_dict()


# ------------------------------------------------------------------------------------------ tasks
def _stream_ids() -> torch.Tensor:
    return torch.randint(0, 61, (4 * 48,), generator=torch.Generator().manual_seed(6))


def test_decode_mode_perplexity_scores_the_decoded_targets(kind):
    from diffquant.data.tokenizer import ByteTokenizer
    from diffquant.eval.perplexity import evaluate_stream

    model = tiny_model(kind, vocab_size=259)
    stream = torch.randint(0, 256, (4 * 48,), generator=torch.Generator().manual_seed(6))
    tok = ByteTokenizer()
    got = evaluate_stream(
        model, stream, tokenizer=tok, seq_len=48, windows="disjoint", batch_size=3, decode=10
    )
    with torch.no_grad():
        ids = stream.view(4, 48)
        logp = torch.log_softmax(model(ids).double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    scored = logp[:, 10:]  # targets 11 .. 47: each predicted by a decode step
    assert got["n_tokens_scored"] == scored.numel() == 4 * 37
    assert abs(got["perplexity"] - float(torch.exp(-scored.mean()))) <= 1e-6 * got["perplexity"]
    apply_plan(model, _plan(format="int2", keys="channel", values="token", group=4, window=4))
    quantized = evaluate_stream(
        model, stream, tokenizer=tok, seq_len=48, windows="disjoint", batch_size=3, decode=10
    )
    assert quantized["n_tokens_scored"] == got["n_tokens_scored"]
    assert quantized["perplexity"] != got["perplexity"]


def test_a_kv_cache_plan_on_a_task_that_never_decodes_says_so():
    from diffquant.eval.tasks import parse_task, run_task

    model = tiny_model("diff_v2", vocab_size=259)
    apply_plan(model, _plan(format="int4", group=4, window=8))
    for spec in ("ppl:data=stdlib:validation,tokens=256,seq_len=64", "bpb:tokens=256,seq_len=64"):
        with pytest.raises(DiffquantError, match="kv_cache acts only when the model decodes") as err:
            run_task(model, parse_task(spec))
        assert "\n" not in str(err.value)
    with pytest.raises(DiffquantError, match="decode"):
        run_task(model, parse_task("ppl:data=stdlib:validation,tokens=256,seq_len=64,decode=63"))


def test_a_quantized_cache_branches_by_rows(kind):
    model = tiny_model(kind)
    apply_plan(model, _plan(format="int4", keys="channel", values="token", group=4, window=4, sinks=1))
    ids = torch.randint(0, 61, (3, 23), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = model.new_cache()
        model(ids[:, :20], cache)
        rows = torch.tensor([2, 0])
        branch = model.new_cache()
        branch.layers = [layer.select_rows(rows) for layer in cache.layers]
        alone = model.new_cache()
        model(ids[rows, :20], alone)
        for t in range(20, 23):
            a, b = model(ids[rows, t : t + 1], branch), model(ids[rows, t : t + 1], alone)
            assert (a - b).abs().max() <= 1e-6  # (a batch of 3 and one of 2 round matmuls differently)


def test_cli_quantize_records_the_cache_and_eval_measures_it(tmp_path, capsys):
    from diffquant.cli import main

    plan = tmp_path / "kv2.yaml"
    plan.write_text(
        "name: kv2\nkv_cache: {format: int2, keys: channel, values: token, group: 8, window: 16}\n"
    )
    out = tmp_path / "q"
    args = ["--calib-tokens", "256", "--seq-len", "64", "--eval-tokens", "256"]
    assert main(["quantize", "init:diff_v2:tiny", "--plan", str(plan), "--out", str(out), *args]) == 0
    assert "KV cache for decoding: kv2 K:channel V:token g8 r16" in capsys.readouterr().out
    reloaded = load_model(str(out))
    assert isinstance(reloaded.new_cache().layers[0], QuantizedLayerKV)
    assert reloaded.quant_plan.kv_cache == KVCacheSpec(format="int2", group=8, window=16)
    # a task that never decodes is refused before the run folder exists
    task = "ppl:data=stdlib:validation,tokens=512,seq_len=128"
    assert (
        main(["eval", "init:diff_v2:tiny", "--plan", str(plan), "--task", task, "--out", str(tmp_path / "e")])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_cache acts only when the model decodes" in err[0]
    assert not (tmp_path / "e").exists()
    assert main(["eval", str(out), "--task", task, "--out", str(tmp_path / "e")]) == 2  # its own plan
    assert "model q's kv_cache acts only" in capsys.readouterr().err and not (tmp_path / "e").exists()
    assert main(["eval", str(out), "--task", task + ",decode=32", "--out", str(tmp_path / "e")]) == 0


def test_kv_cache_error_is_the_sqnr_of_the_dequantized_body(kind):
    from diffquant.models.transformer import KVCache
    from diffquant.quant.kv_cache import kv_cache_error

    model = tiny_model(kind)
    spec = dict(format="int2", keys="channel", values="token", group=4, window=8, sinks=2)
    apply_plan(model, _plan(**spec))
    ids = torch.randint(0, 61, (3, 26), generator=torch.Generator().manual_seed(8))  # 2 sinks + 24 moved
    rows = kv_cache_error(model, ids, batch_size=2)
    plain = KVCache(model.config.n_layers)
    with torch.no_grad():
        model(ids, plain)
    for row, layer in zip(rows, plain.layers, strict=True):
        assert row["quantized_tokens"] == 24
        for name, full, axis in (("k", layer.k, "channel"), ("v", layer.v, "token")):
            body = full[:, :, 2:].double()
            error = _reference_groups(full[:, :, 2:], 2, axis, 4) - body
            want = 10 * math.log10(float(body.square().sum()) / float(error.square().sum()))
            assert abs(row[f"{name}_sqnr_db"] - want) <= 1e-4, (name, row)


def test_greedy_generation_equals_transformers_generate_with_a_quantized_cache(tmp_path):
    """``DecoderLM.generate`` (what lm-eval's generate_until and retrieval run) with a kv4 plan picks the
    tokens transformers' ``generate(cache_implementation="quantized")`` picks (quanto, the matching setting)."""
    pytest.importorskip("optimum.quanto")
    import transformers

    lib = _quanto_python_unpack()  # noqa: F841
    folder = save_tiny_llama(tmp_path / "llama", context=128)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(f"hf:{folder}").eval()
    apply_plan(ours, _plan(format="int4", keys="token", values="token", group=8, window=16))
    prompt = torch.randint(0, 320, (1, 32), generator=torch.Generator().manual_seed(9))
    config = {
        "backend": "quanto",
        "nbits": 4,
        "axis_key": 0,
        "axis_value": 0,
        "q_group_size": 8,
        "residual_length": 16,
    }
    with torch.no_grad():
        theirs = hf.generate(
            prompt, max_new_tokens=40, do_sample=False, cache_implementation="quantized", cache_config=config
        )
        plain = hf.generate(prompt, max_new_tokens=40, do_sample=False)
    got = ours.generate(prompt, 40)
    assert torch.equal(got, theirs)
    assert not torch.equal(theirs, plain)  # the quantized cache changed what was generated


@pytest.mark.parametrize("scale_dtype", ["model", "float16"])
def test_a_bfloat16_model_decodes_through_its_cache_in_bfloat16(scale_dtype):
    """bf16 models are what users decode with: the cache returns bf16 keys / values, stores scales in the
    model's dtype (or float16), and its body reads back the definition x_hat = code * scale + lo computed
    in float64 from the stored codes, scales and zeros, rounded once to bf16 per operation."""
    model = tiny_model("diff_v2").to(torch.bfloat16)
    spec = dict(format="int4", keys="channel", values="token", group=4, window=8, scale_dtype=scale_dtype)
    apply_plan(model, _plan(**spec))
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(12))
    got, cache = _decode(model, ids, 9)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
    want_scale = torch.bfloat16 if scale_dtype == "model" else torch.float16
    for layer in cache.layers:
        for name, stream in (("k", layer._k), ("v", layer._v)):
            start, body = layer.bodies()[name]
            assert body is not None and body.dtype == torch.bfloat16
            assert stream.scale.dtype == want_scale and stream.zero.dtype == want_scale
            codes = unpack(stream.codes, 4).double()
            b, h, n, d = codes.shape
            axis = spec["keys"] if name == "k" else spec["values"]
            if axis == "token":
                s = stream.scale.double().repeat_interleave(4, -1)
                z = stream.zero.double().repeat_interleave(4, -1)
            else:
                s = stream.scale.double().repeat_interleave(4, -2)
                z = stream.zero.double().repeat_interleave(4, -2)
            product = (codes * s).to(torch.bfloat16).double()  # bf16 rounds the product, then the sum
            assert torch.equal(body.double(), (product + z).to(torch.bfloat16).double()), name
    plain = tiny_model("diff_v2").to(torch.bfloat16)
    ref, _ = _decode(plain, ids, 9)
    assert (got.float() - ref.float()).abs().max() < 0.5  # a 4-bit cache moves bf16 logits, not wildly
