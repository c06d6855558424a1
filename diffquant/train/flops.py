"""Model FLOPs of a training step and the chip's dense bf16 peak: what the trainer's ``mfu`` column divides.

Model FLOPs utilisation (MFU; Chowdhery et al. 2022, "PaLM", arXiv 2204.02311, Sec. 4.1 and Appendix B) is
the FLOPs the model itself needs per second of training over the chip's peak. Rematerialisation (the explicit
attention path's recomputed maps, ``Attention.recompute_maps``), padding (DIFF V1's zero-padded Q/K on the
fused path) and kernel-internal recomputation (flash attention's backward recomputing QK^T) are hardware
FLOPs, not model FLOPs: they lower MFU, as the work they stand for should.

Counting (PaLM App. B; Kaplan et al. 2020, arXiv 2001.08361, Sec. 2.1; Hoffmann et al. 2022, "Chinchilla",
arXiv 2203.15556, App. F): a matmul of an (m x k) by a (k x n) matrix is 2 m k n FLOPs; backward runs two
matmuls of the same size per forward matmul (the gradient of each operand), so training is 3 x forward.
Per token of a sequence of T positions:

    FLOPs/token = 6 N_mm + 3 sum_layers A_l

    N_mm = the weights of every Linear: q/k/v/o, the FFN, each kind's own readers of the layer input
           (DIFF V2's lambda_proj, gated attention's gate_proj) and the LM head (tied or not: it is a
           matmul either way). Not the embedding (a lookup), norms, biases, lambda vectors, sinks.
    A_l  = K_l (2 d n_q + 2 dv H)        forward attention FLOPs per query token in layer l:
           QK^T: 2 d per key for each of the n_q query heads of width d (n_q = 2H for DIFF V1 / V2: two
           query components per output head); PV: 2 dv per key for each of the H output heads (dv = 2d
           for DIFF V1's value heads, else d).
    K_l  = the keys a query sees on average: causal, (T + 1) / 2 (T (T + 1) / 2 pairs over T queries);
           with a sliding window W, sum_i min(i + 1, W) / T. ``causal=False``: T, PaLM's 12 L H Q T term
           (which counts the full T x T square; FlashAttention-2, Dao 2023, arXiv 2307.08691, Sec. 4.1,
           halves it for a causal mask: what a causal kernel computes and what the model needs).

Each DIFF map is one PV product here: the papers define the output as (A1 - lambda A2) V, one product with
the combined map (what the explicit path computes); the fused path's two SDPA calls do a second PV per head,
hardware FLOPs like the others above. The sink's one extra key (a constant logit, zero value) is not counted.

Left out, as PaLM's and Kaplan's counts leave them out (they are O(d) per token, not O(d^2) or O(T d)):
softmax, norms, RoPE, activations, the DIFF combination, gates, residual adds, the loss, the optimizer.
Chinchilla's App. F counts some of them and the embedding; :class:`torch.utils.flop_counter.FlopCounterMode`
counts none of them (it counts matmuls and attention kernels), and it is what the tests check this count
against, matmul for matmul.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from diffquant.models import DecoderLM

# Dense (no 2:4 sparsity) BF16 Tensor Core peaks by CUDA device name, FLOP/s. NVIDIA's datasheets print the
# sparse figure with "* with sparsity"; the dense one is half of it: H100 SXM 1,979 -> 989.4 TFLOPS,
# H100 PCIe 1,513 -> 756 (NVIDIA H100 Tensor Core GPU datasheet); H200 SXM 1,979 -> 989 (NVIDIA H200
# datasheet: the H100's GH100 compute with more memory); A100 (SXM4 and PCIe, 40 and 80 GB) 312 dense
# (NVIDIA A100 datasheet, "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*"). The H100 / H200 NVL boards are
# clocked lower (1,671 sparse) and GH200 differs again: not listed (``_UNLISTED``), so they read as unknown
# rather than as an SXM part. torch.cuda.get_device_name spells them "NVIDIA H100 80GB HBM3" (SXM5),
# "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe".
# Patterns are matched against the upper-cased name, first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIE\b", 756e12),
    (r"\bH100\b.*(SXM|HBM3)", 989e12),
    (r"\bH200\b", 989e12),
    (r"\bA100\b", 312e12),
)
_UNLISTED = r"\bNVL\b"  # H100 / H200 NVL: their own, lower peak, which the table does not hold


def matmul_parameters(model: DecoderLM) -> int:
    """N_mm: the weights of every Linear of ``model`` (the LM head included, tied to the embedding or not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def keys_per_query(seq_len: int, window: int | None = None, causal: bool = True) -> float:
    """K: keys one query attends to, averaged over the ``seq_len`` queries of a sequence (see the module)."""
    t = seq_len
    if not causal:
        return float(t)
    if window is None or window >= t:
        return (t + 1) / 2
    pairs = window * (window + 1) // 2 + (t - window) * window  # rows 0..W-1 grow to W keys, the rest keep W
    return pairs / t


def attention_flops_per_token(model: DecoderLM, seq_len: int, causal: bool = True) -> float:
    """Forward attention FLOPs per token summed over the layers: sum_l K_l (2 d n_q + 2 dv H)."""
    c = model.config
    per_key = 2 * c.head_dim * c.n_q_heads + 2 * c.value_dim * c.n_heads
    return sum(keys_per_query(seq_len, attn.window, causal) * per_key for attn in model.attention_modules())


def training_flops_per_token(model: DecoderLM, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one training step (forward and backward) per token of a ``seq_len``-position sequence:
    6 N_mm + 3 sum_l A_l (the module docstring derives it). ``causal=False``: PaLM's full-square count."""
    if seq_len < 1:
        raise ValueError(f"seq_len: expected an integer >= 1, got {seq_len}")
    return 6.0 * matmul_parameters(model) + 3.0 * attention_flops_per_token(model, seq_len, causal)


def row_flops_per_token(model: DecoderLM, row_len: int) -> float:
    """Training FLOPs per token of ``row_len``-token training rows, as tokens/s counts them: the model reads
    ``row_len - 1`` positions of each row (the last token is only a target), so a row's FLOPs are spread over
    its ``row_len`` tokens. What the trainer's ``mfu`` column and the GPU kit's probe divide."""
    return training_flops_per_token(model, row_len - 1) * (row_len - 1) / row_len


def peak_flops_of(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a CUDA device called ``name``, None when the table does not know it."""
    upper = name.upper()
    if re.search(_UNLISTED, upper):
        return None
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.search(pattern, upper)), None)


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak of ``device`` (the precision the trainer's CUDA autocast runs its matmuls in), or
    None for a CPU or a GPU the table does not know: no MFU is reported then rather than a guessed one."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        name = torch.cuda.get_device_name(device)
    except Exception:  # the name only labels a log column: a device that cannot tell it gets no MFU, the
        return None  # run goes on (a CPU build under tests/devicecheck.py's fake CUDA raises NameError here)
    return peak_flops_of(name)


def utilisation(flops_per_token: float, tokens_per_second: float, peak: float | None) -> float | None:
    """MFU: model FLOPs per second over the peak; None when the peak is unknown."""
    return None if not peak else flops_per_token * tokens_per_second / peak
