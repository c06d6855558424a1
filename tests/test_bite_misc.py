"""Areas where planted bugs survived an earlier audit (issue 47 item 4):

- device-map placement by module name: a map naming ``layers.1`` places layer 1, not layers 10 and 11 (a
  prefix match) and every tensor of layer 10 goes where layer 10 goes (a 12-layer model on WikiText bytes);
- GGUF read in a non-default dtype: ``dtype=bfloat16`` / ``float16`` gives the float32 load cast, tensor for
  tensor (Gemma 3's stored w + 1 norms shifted back before the cast, Q8_0 matrices), through the whole-model
  loader and the streamed run's source, whose memory estimate follows the dtype;
- RoPE scaling metadata in GGUF: a Gemma 3 file with ``rope.scaling.type = linear`` and ``factor`` gives the
  linear scaling of its global layers, and logits equal the transformers model it was written from;
- the lm-eval adapter's request building against lm-eval's own HFLM on a tiny HF Llama: is_greedy when only
  some continuation tokens are the argmax, continuations as long as the context window, BOS at the front or
  already in the text.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from test_gguf import tok_files as tok_files  # noqa: F401 (the shared GGUF tokenizer fixture)

from diffquant.data.corpus import iter_documents, token_windows
from diffquant.io import load_model, save_checkpoint
from diffquant.models import DecoderLM, ModelConfig

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="device maps need accelerate"
)


# ------------------------------------------------------------------------------------------ device maps
@pytest.fixture(scope="module")
def twelve_layers(tmp_path_factory):
    """A native 12-layer byte model (layers 1, 10 and 11 share the name prefix ``layers.1``)."""
    config = ModelConfig(
        vocab_size=259, d_model=32, n_layers=12, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
        max_seq_len=64,
    )  # fmt: skip
    torch.manual_seed(12)
    return str(save_checkpoint(DecoderLM(config).eval(), tmp_path_factory.mktemp("twelve") / "m"))


@needs_accelerate
@pytest.mark.parametrize(
    "mapping",
    [
        {"": "cpu", "layers.1": "disk"},
        {"": "cpu", "layers.10": "disk", "layers.1": "cpu"},
        {
            "embed": "cpu",
            "layers": "disk",
            "layers.1": "cpu",
            "layers.11": "cpu",
            "norm": "cpu",
            "lm_head": "cpu",
        },
    ],
    ids=["layer-1-on-disk", "layer-10-on-disk", "layers-on-disk-but-1-and-11"],
)
def test_a_map_places_each_block_by_its_own_name(twelve_layers, mapping, capsys):
    from diffquant.stream.placement import Placement, load_placed

    whole = load_model(twelve_layers)
    placed = load_placed(twelve_layers, Placement(dict(mapping)))
    capsys.readouterr()
    want = {}
    for unit in ["embed", *(f"layers.{i}" for i in range(12)), "norm", "lm_head"]:
        # the most specific entry naming the unit or a group containing it (a prefix of whole name parts)
        names = [m for m in mapping if m == unit or m == "" or unit.split(".")[0] == m]
        want[unit] = mapping[max(names, key=len)]
    assert placed.device_map == want
    for i, block in enumerate(placed.layers):  # an offloaded block's weights live in its hook, not in it
        assert block.attn.q_proj.weight.is_meta == (want[f"layers.{i}"] == "disk"), i
    ids = token_windows("wikitext2:test", 2 * 48, 48, quiet=True)
    with torch.no_grad():
        assert torch.equal(whole(ids), placed(ids))


# ------------------------------------------------------------------------------------------ GGUF
@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory, tok_files):
    """A tiny Gemma 3 GGUF (norms stored w + 1) in F32 and in Q8_0, and one with linear RoPE scaling of
    factor 4 on its global layers, with the transformers model each was written from."""
    gguf = pytest.importorskip("gguf")
    from test_gguf_families import _gemma_model, write_family_gguf

    root = tmp_path_factory.mktemp("gemma-gguf")
    plain = _gemma_model(seed=5)
    files = {
        "f32": write_family_gguf(
            root / "f32.gguf", plain, "gemma3", tok_files, gguf.GGMLQuantizationType.F32
        ),
        "q8_0": write_family_gguf(
            root / "q8.gguf", plain, "gemma3", tok_files, gguf.GGMLQuantizationType.Q8_0
        ),
    }
    scaled = _gemma_model(seed=6)
    scaled.config.rope_parameters["full_attention"] = {
        "rope_type": "linear",
        "factor": 4.0,
        "rope_theta": 5000.0,
    }
    scaled = type(scaled)(scaled.config).eval()  # rebuilt: the rotary tables read the config at init
    scaled.load_state_dict(_gemma_model(seed=6).state_dict())

    class ScalingWriter(gguf.GGUFWriter):
        """llama.cpp's converter for Gemma 3 4B-27B: rope.scaling.type linear and its factor."""

        def add_rope_freq_base(self, value: float) -> None:
            super().add_rope_freq_base(value)
            self.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            self.add_rope_scaling_factor(4.0)

    plain_writer, gguf.GGUFWriter = gguf.GGUFWriter, ScalingWriter
    try:
        files["scaled"] = write_family_gguf(root / "scaled.gguf", scaled, "gemma3", tok_files)
    finally:
        gguf.GGUFWriter = plain_writer
    return files, scaled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_a_gguf_read_in_another_dtype_is_the_float32_read_cast(gemma_files, qtype, dtype):
    from diffquant.io.gguf_source import read_gguf_checkpoint

    path = gemma_files[0][qtype]
    base = load_model(f"gguf:{path}")
    cast = load_model(f"gguf:{path}", dtype=dtype)
    want = {k: v.to(dtype) for k, v in base.state_dict().items()}
    got = cast.state_dict()
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key].dtype == dtype and torch.equal(got[key], value), key
    # a norm weight stored as w + 1 is shifted back in float32: its bfloat16 / float16 cast, not (w + 1) cast - 1
    norm = "layers.0.attn_post_norm.weight"
    assert torch.equal(got[norm], base.state_dict()[norm].to(dtype))
    checkpoint = read_gguf_checkpoint(path)
    with checkpoint.open(dtype) as tensors:
        for native, name in checkpoint.key_map.items():
            t = tensors.get(name)
            if native in checkpoint.transforms:
                t = checkpoint.transforms[native](t)
            assert t.dtype == dtype and torch.equal(t, want[native]), native
    size = torch.empty((), dtype=dtype).element_size()
    assert checkpoint.memory_bytes(dtype) == sum(p.numel() for p in base.parameters()) * size


def test_gguf_linear_rope_scaling_reaches_the_global_layers_and_the_logits(gemma_files):
    _, scaled = gemma_files
    path = gemma_files[0]["scaled"]
    model = load_model(f"gguf:{path}")
    c = model.config
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    scaled_layers = [i for i in range(c.n_layers) if c.layer_rope(i)[1] is not None]
    assert scaled_layers == [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5]
    ids = torch.randint(0, c.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids), scaled.to(torch.float32)(ids).logits
        plain = dataclasses.replace(c, rope_scaling=None)
        unscaled = DecoderLM(plain).eval()
        unscaled.load_state_dict(model.state_dict())
        other = unscaled(ids)
    scale = float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) < 1e-4 * scale
    assert float((other - theirs).abs().max()) > 1e-3 * scale  # the scaling matters at these positions


# ------------------------------------------------------------------------------------------ lm-eval requests
CONTEXT = 32


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """(diffquant's LM, lm-eval's HFLM) on one tiny float64 HF Llama whose tokenizer puts BOS in front."""
    pytest.importorskip("lm_eval")
    from conftest import save_tiny_llama, train_byte_bpe
    from lm_eval.models.huggingface import HFLM

    from diffquant.eval.lmeval import DiffquantLM

    folder = tmp_path_factory.mktemp("llama-bos")
    lines = next(iter_documents("wikitext2:test")).text[:6000].split("\n")
    train_byte_bpe(folder, [s for s in lines if s.strip()], prepend_bos=True, config={"tokenizer_class": "PreTrainedTokenizerFast"})  # fmt: skip
    save_tiny_llama(folder, context=CONTEXT, bos_token_id=1, eos_token_id=0)
    ours = DiffquantLM(load_model(f"hf:{folder}", dtype=torch.float64), batch_size=2)
    theirs = HFLM(pretrained=str(folder), batch_size=2, device="cpu", dtype="float64")
    return ours, theirs


def _greedy(lm, context: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(lm.model(torch.tensor([context + out]))[0, -1].argmax()))
    return out


@pytest.mark.slow  # builds a tokenizer and HFLM: seconds
def test_lmeval_requests_equal_hflm_at_the_edges(lms):
    ours, theirs = lms
    assert ours.max_length == theirs.max_length == CONTEXT
    assert ours.prefix_token_id == theirs.prefix_token_id == 1
    text = "The tower is 324 metres tall, about the same height as an 81-storey building."
    for s in (text, "<|bos|>" + text, " " + text):  # BOS in front once, not twice
        assert ours.tok_encode(s) == theirs.tok_encode(s), s
    assert ours.tok_encode(text)[0] == 1 and ours.tok_encode("<|bos|>" + text).count(1) == 1
    context = ours.tok_encode(text)[:6]
    greedy = _greedy(ours, context, 5)
    vocab = ours.model.config.vocab_size
    wrong = [(t + 7) % vocab for t in greedy]
    long_ids = ours.tok_encode(text * 3)
    assert len(long_ids) > 2 * CONTEXT
    requests = [
        (None, context, greedy),  # all greedy
        (None, context, greedy[:4] + wrong[4:]),  # the last token not
        (None, context, wrong[:1] + greedy[1:]),  # only the first not
        (None, long_ids[:2], long_ids[2 : 2 + CONTEXT]),  # a continuation filling the window
        (None, long_ids[: CONTEXT + 1], long_ids[CONTEXT + 1 : CONTEXT + 4]),  # context cut on the left
        (None, long_ids[:1], long_ids[1 : CONTEXT + 1]),  # exactly max_length + 1 tokens in all
    ]
    got, want = ours._loglikelihood_tokens(requests), theirs._loglikelihood_tokens(requests)
    assert [g for _, g in want][:3] == [True, False, False]
    for k, ((ll, g), (ll_ref, g_ref)) in enumerate(zip(got, want, strict=True)):
        # transformers builds RoPE from float32 frequencies even in a float64 model: 1e-6, not 1e-12
        assert g == g_ref and abs(ll - ll_ref) <= 1e-6 * max(1.0, abs(ll_ref)), (k, got[k], want[k])
