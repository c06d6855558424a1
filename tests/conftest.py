"""Shared fixtures. Environment that must be set before heavy imports goes first."""

import os

# Triton's interpreter must be chosen before any module defining @triton.jit kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from diffquant.models import DecoderLM, ModelConfig, matched_config  # noqa: E402

BASE = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=96
)


def tiny_model(kind: str, seed: int = 0, **overrides) -> DecoderLM:
    """A small random model of ``kind`` (parameter-matched to BASE), in eval mode, fp32."""
    import dataclasses

    config = dataclasses.replace(matched_config(BASE, kind), **overrides)
    torch.manual_seed(seed)
    return DecoderLM(config).eval()


@pytest.fixture(params=["baseline", "diff_v1", "diff_v2"])
def kind(request) -> str:
    return request.param
