"""Cross-check diffquant's GPTQ (diffquant/quant/gptq.py) against llm-compressor's GPTQModifier on CPU.

Model: SmolLM2-135M-Instruct (the repo's cached Q4_1 GGUF, exported to a float32 HF LlamaForCausalLM with
``diffquant export --to hf``), truncated to its first ``--layers`` decoder layers. Calibration: ``--windows``
windows of ``--seq`` tokens of ``wikitext2:validation`` (diffquant.data.corpus.token_windows with the model's
own tokenizer; diffquant ships WikiText-2 test and validation only, no train split). Both sides see the same
token ids.

For every config (bits 4, symmetric, block 128, damp 0.01; group 128 / 64, act-order off / static).
SmolLM2's hidden width 576 is 4 x 128 + 64: at group 128 six of the seven Linears have a partial last
group, which diffquant's WeightGrid supports and llm-compressor refuses unless bypass_divisibility_checks=True
(the script records the refusal, then sets it).

1. llm-compressor ``oneshot`` with a ``GPTQModifier`` on all Linears of the truncated model (sequential
   pipeline, error propagated: layer 1 sees the outputs of the quantized layer 0). The quantized weights
   are read back from the modules (fake-quantized float weights + weight_scale / weight_zero_point).
2. The inputs X of every Linear of layer 0 are captured with forward hooks on the float model (layer 0's
   inputs do not depend on any quantization, and llm-compressor calibrates the whole layer 0 before it
   quantizes any of it, so it saw exactly these X). For layer 1 the X are captured on a float model whose
   layer 0 holds llm-compressor's quantized weights: the inputs llm-compressor's layer 1 saw.
3. diffquant: H = Hessian(in).add(X).matrix, gptq_codes(W, H, WeightGrid(4, group, sym=True)); RTN:
   rtn_codes on the same grid. The layer objective err = ||(W - Q) X^T||_F^2 / ||W X^T||_F^2 (float64)
   is computed for diffquant's Q, llm-compressor's Q, llm-compressor's ``quantize_weight`` called
   directly on diffquant's H (isolates Hessian accumulation from the algorithm) and RTN.
4. Optionally (``--gptqmodel-python``, a venv with gptqmodel installed), GPTQModel's GPTQ on the same
   H (diffquant's, cast to float32), with block 128 and with block = group (run in a subprocess of this script in that venv: ``--gptqmodel-worker``).

Run (from the repo root):
    /work/main/.venv/bin/python -m diffquant.cli export --to hf --dtype float32 \
        gguf:$HOME/.cache/diffquant/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2_hf
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=/work/main /tmp/xvenv/bin/python analysis/gptq/crosscheck.py \
        --model /tmp/smollm2_hf [--gptqmodel-python /tmp/gvenv/bin/python]
It prints a table and writes analysis/gptq/crosscheck.json next to this file.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
BITS, DAMP, BLOCK = 4, 0.01, 128
CONFIGS = (
    {"name": "g128", "group": 128, "act_order": False},
    {"name": "g64", "group": 64, "act_order": False},
    {"name": "g64_actorder", "group": 64, "act_order": True},
)


def get(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


# ---------------------------------------------------------------- model, data, capture


def load_model(path: str, layers: int):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.eval()
    return model


def calibration_ids(model_path: str, windows: int, seq: int) -> torch.Tensor:
    from diffquant.data.corpus import token_windows
    from diffquant.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    return token_windows("wikitext2:validation", windows * seq, seq, tok)


@torch.no_grad()
def capture_inputs(model, ids: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """X [tokens, in] (float32) of every Linear of decoder layer ``layer``, over all windows."""
    store: dict[str, list[torch.Tensor]] = {n: [] for n in LINEARS}
    hooks = []
    for name in LINEARS:
        mod = get(model.model.layers[layer], name)
        hooks.append(
            mod.register_forward_hook(
                lambda m, args, out, name=name: store[name].append(
                    args[0].detach().reshape(-1, args[0].shape[-1]).clone()
                )
            )
        )
    try:
        for row in ids:
            model.model(input_ids=row[None], attention_mask=torch.ones_like(row[None]))
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in store.items()}


# ---------------------------------------------------------------- objectives and grids


def gram(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x.T @ x


def objective(w: torch.Tensor, q: torch.Tensor, g: torch.Tensor) -> float:
    """||(W - Q) X^T||_F^2 / ||W X^T||_F^2 with g = X^T X (float64)."""
    w, q = w.to(torch.float64), q.to(torch.float64)
    d = w - q
    return float(((d @ g) * d).sum() / ((w @ g) * w).sum())


def ragged_rtn(w: torch.Tensor, group: int, bits: int = BITS) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric RTN with s = absmax / ((2^b - 1) / 2) per group of ``group`` columns; the last group may be
    shorter (what compressed-tensors does when group does not divide the columns). Returns (Q, scale)."""
    w = w.to(torch.float64)
    out, n = w.shape
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.empty_like(w)
    scales = []
    for c in range(0, n, group):
        blk = w[:, c : c + group]
        s = blk.abs().amax(1, keepdim=True) / ((2**bits - 1) / 2)
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[:, c : c + group] = torch.clamp(torch.round(blk / s), qmin, qmax) * s
        scales.append(s)
    return q, torch.cat(scales, 1)


def group_absmax_scale(w: torch.Tensor, group: int) -> torch.Tensor:
    return ragged_rtn(w, group)[1]


def rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return (a - b) / b


# ---------------------------------------------------------------- llm-compressor


def run_llmcompressor(
    model, ids: torch.Tensor, cfg: dict, seq: int, bypass: bool = False, ignore: tuple[str, ...] = ()
):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    weights = QuantizationArgs(
        num_bits=BITS, type="int", symmetric=True, strategy="group", group_size=cfg["group"], dynamic=False
    )
    recipe = GPTQModifier(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head", *ignore],
        bypass_divisibility_checks=bypass,
        block_size=BLOCK,
        dampening_frac=DAMP,
        actorder="static" if cfg["act_order"] else None,
    )
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        num_calibration_samples=ids.shape[0],
        max_seq_length=seq,
        shuffle_calibration_samples=False,
        pipeline="sequential",
    )
    return time.perf_counter() - t0


def llmc_direct(
    w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qargs
) -> torch.Tensor:
    """llm-compressor's quantize_weight on a given Hessian (its own static scales / zero points)."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    q, _loss, fallback = quantize_weight(
        weights=w[None].to(torch.float32).clone(),
        hessians=h[None].to(torch.float32).clone(),
        scale=scale[None],
        zero_point=zp[None],
        global_scale=None,
        quant_args=qargs,
        blocksize=BLOCK,
        percdamp=DAMP,
    )
    if bool(fallback[0]):
        raise RuntimeError("llm-compressor fell back to RTN (Hessian not PD)")
    return q[0]


# ---------------------------------------------------------------- GPTQModel (optional, other venv)


def gptqmodel_worker(path: str) -> None:
    """Run in a venv with gptqmodel: GPTQModel's GPTQ on saved (W, H) pairs; writes Q back to the file.

    The Hessian is handed over as GPTQ.H (float32, what GPTQModel accumulates in) instead of being
    accumulated by add_batch, so both sides quantize against the same H."""
    import gptqmodel
    import torch.nn as nn
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ

    job = torch.load(path)
    results = {}
    # the configured block, and block = group: with a group that starts inside a block, GPTQModel (like the
    # reference code) reads the group's scale from W without the pending in-block updates; with
    # block = group every group starts a block, so its semantics are diffquant's
    variants = [("gptqmodel", job["block"], job["act_order"])]
    if not job["act_order"]:
        if job["group"] != job["block"]:
            variants.append(("gptqmodel_block_eq_group", job["group"], False))
        # static groups (scales from the weights before any update) in natural order: llm-compressor's semantics
        variants.append(("gptqmodel_static_groups", job["block"], True))
    for key, item in job["items"].items():
        w = item["w"].to(torch.float32)
        for tag, block, static in variants:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            qcfg = QuantizeConfig(
                bits=job["bits"],
                group_size=job["group"],
                sym=True,
                desc_act=job["act_order"],
                static_groups=static,
                act_group_aware=False,
                damp_percent=job["damp"],
                mse=0.0,
            )
            g = GPTQ(lin, qcfg=qcfg)
            g.quantizer.configure(perchannel=True)  # as gptqmodel/looper/gptq_processor.py does
            g.H = item["h"].to(torch.float32).clone()
            g.nsamples = int(item["tokens"])
            g._hessian_dirty = False
            t0 = time.perf_counter()
            q, scale, zero, _gidx, _dur, _loss, damp, _n = g.quantize(blocksize=block)
            results[(key, tag)] = {
                "q": q.detach().to(torch.float32).cpu(),
                "scale": scale.detach().cpu(),
                "zero": zero.detach().cpu(),
                "damp": float(damp),
                "block": block,
                "static_groups": static,
                "seconds": time.perf_counter() - t0,
            }
    torch.save(
        {"results": results, "version": str(gptqmodel.__version__), "torch": str(torch.__version__)}, path
    )


def run_gptqmodel(python: str, items: dict, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.pt")
        torch.save(
            {
                "items": items,
                "bits": BITS,
                "group": cfg["group"],
                "act_order": cfg["act_order"],
                "damp": DAMP,
                "block": BLOCK,
            },
            path,
        )
        proc = subprocess.run([python, __file__, "--gptqmodel-worker", path], capture_output=True, text=True)
        if proc.returncode:
            tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
            raise RuntimeError(" | ".join(tail))
        return torch.load(path)


# ---------------------------------------------------------------- one config


def run_config(cfg: dict, args, ids: torch.Tensor, x0: dict[str, torch.Tensor]) -> dict:
    from diffquant.quant.gptq import Hessian, gptq_codes
    from diffquant.quant.weightcodes import WeightGrid, rtn_codes

    print(
        f"\n=== {cfg['name']}: int{BITS} sym group {cfg['group']} act_order {cfg['act_order']} "
        f"damp {DAMP} block {BLOCK}",
        flush=True,
    )
    float_model = load_model(args.model, args.layers)
    # Linears whose input width the group does not divide (SmolLM2: 576 = 4 x 128 + 64): diffquant quantizes
    # them with a partial last group. llm-compressor refuses them (validate_group_size_divisibility) unless
    # bypass_divisibility_checks=True; try both ways and record what happens; if neither runs, leave those
    # Linears out of llm-compressor's targets (ignore) and compare the rest.
    ragged = [
        f"model.layers.{l}.{n}"
        for l in range(args.layers)
        for n in LINEARS
        if get(float_model.model.layers[l], n).in_features % cfg["group"]
    ]
    ragged_info = None
    lc_model = None
    if ragged:
        ragged_info = {"linears": ragged}
        for key, bypass in (("without_bypass", False), ("with_bypass", True)):
            model = load_model(args.model, args.layers)
            try:
                lc_seconds = run_llmcompressor(model, ids, cfg, args.seq, bypass=bypass)
                ragged_info[key] = "ran"
                lc_model = model
                break
            except (ValueError, RuntimeError) as exc:
                ragged_info[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                print(f"llm-compressor {key}: {ragged_info[key]}", flush=True)
    if lc_model is None:
        lc_model = load_model(args.model, args.layers)
        lc_seconds = run_llmcompressor(lc_model, ids, cfg, args.seq, ignore=tuple(ragged))
        if ragged:
            ragged_info["llmcompressor"] = "left out (ignore=[...]): no llm-compressor result for these"
    print(f"llm-compressor oneshot: {lc_seconds:.1f} s", flush=True)

    # layer 1 inputs as llm-compressor saw them: float model with llm-compressor's quantized layer 0
    xs = {0: x0}
    if args.layers > 1:
        with torch.no_grad():
            for name in LINEARS:
                get(float_model.model.layers[0], name).weight.copy_(
                    get(lc_model.model.layers[0], name).weight
                )
        xs[1] = capture_inputs(float_model, ids, 1)
    grid = WeightGrid(BITS, cfg["group"], True)
    rows = []
    gm_items = {}
    dq_ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    dq_scale: dict[str, torch.Tensor] = {}
    for layer in range(min(args.layers, 2)):
        for name in LINEARS:
            x = xs[layer][name]
            w = get(load_model_cache(args)[layer], name).weight.detach().clone()  # float weight
            n = w.shape[1]
            lc_mod = get(lc_model.model.layers[layer], name)
            has_lc = hasattr(lc_mod, "weight_scale")
            g = gram(x)
            hess = Hessian(n)
            hess.add(x)
            row = {
                "layer": layer,
                "linear": name,
                "shape": list(w.shape),
                "tokens": hess.tokens,
                "dead_inputs": int((torch.diagonal(hess.matrix) == 0).sum()),
                "err_llmcompressor": None,
                "err_llmcompressor_direct_on_diffquant_H": None,
            }
            q_rtn_ref, s_ref = ragged_rtn(w, cfg["group"])  # absmax / 7.5 per group (partial last group)
            row["err_rtn"] = objective(w, q_rtn_ref, g)
            if has_lc:
                q_lc = lc_mod.weight.detach().to(torch.float64)
                s_lc = lc_mod.weight_scale.detach().to(torch.float64)
                zp_lc = getattr(lc_mod, "weight_zero_point", None)
                step_lc = s_lc.repeat_interleave(cfg["group"], 1)[:, :n]
                # grid check: scale == absmax / 7.5, zero point 0, codes in [-8, 7]
                row["lc_scale_vs_absmax_over_7.5_max_rel"] = float(((s_lc - s_ref).abs() / s_ref).max())
                row["lc_zero_point_max_abs"] = None if zp_lc is None else float(zp_lc.abs().max())
                codes_lc = torch.round(q_lc / step_lc)
                row["lc_codes_min_max"] = [int(codes_lc.min()), int(codes_lc.max())]
                row["lc_q_on_grid_max_dev"] = float((q_lc / step_lc - codes_lc).abs().max())
                row["err_llmcompressor"] = objective(w, q_lc, g)
                t0 = time.perf_counter()
                q_direct = llmc_direct(
                    w,
                    hess.matrix,
                    lc_mod.weight_scale.detach(),
                    lc_mod.weight_zero_point.detach(),
                    lc_mod.quantization_scheme.weights,
                )
                row["seconds_llmcompressor_direct"] = time.perf_counter() - t0
                row["err_llmcompressor_direct_on_diffquant_H"] = objective(w, q_direct, g)
            t0 = time.perf_counter()
            gc = gptq_codes(
                w,
                hess.matrix,
                grid,
                act_order=cfg["act_order"],
                damp=DAMP,
                block=BLOCK,
                what=f"layers.{layer}.{name}",
            )
            row["seconds_diffquant"] = time.perf_counter() - t0
            q_dq = gc.dequantize()
            step_dq = gc.scale.repeat_interleave(cfg["group"], 1)[:, :n]
            row["err_diffquant"] = objective(w, q_dq, g)
            q_rtn = rtn_codes(w, grid).dequantize()
            row["err_rtn_diffquant"] = objective(w, q_rtn, g)
            row["rtn_diffquant_vs_absmax_over_7.5_rtn_max_abs"] = float((q_rtn - q_rtn_ref).abs().max())
            if has_lc:
                row["diffquant_scale_vs_lc_scale_max_rel"] = float(((gc.scale - s_lc).abs() / s_lc).max())
                row["frac_weights_equal_diffquant_vs_lc"] = float(
                    ((q_dq - q_lc).abs() <= 1e-4 * step_lc).double().mean()
                )
                row["frac_weights_equal_diffquant_vs_lc_direct"] = float(
                    ((q_dq - q_direct.to(torch.float64)).abs() <= 1e-4 * step_lc).double().mean()
                )
            row["rel_diff_diffquant_vs_llmcompressor"] = rel(row["err_diffquant"], row["err_llmcompressor"])
            row["rel_diff_diffquant_vs_llmcompressor_direct"] = rel(
                row["err_diffquant"], row["err_llmcompressor_direct_on_diffquant_H"]
            )
            rows.append(row)
            key = f"{layer}.{name}"
            gm_items[key] = {"w": w.clone(), "h": hess.matrix.clone(), "tokens": hess.tokens}
            dq_ref[key] = (q_dq, step_dq)
            dq_scale[key] = gc.scale
            print_row(row)
    gm = None
    if args.gptqmodel_python and gm_items:
        try:
            t0 = time.perf_counter()
            res = run_gptqmodel(args.gptqmodel_python, gm_items, cfg)
            gm = {
                "version": res["version"],
                "torch": res["torch"],
                "seconds_total": time.perf_counter() - t0,
                "rows": {},
            }
            for (key, tag), r in res["results"].items():
                layer, name = int(key.split(".", 1)[0]), key.split(".", 1)[1]
                row = next(rw for rw in rows if rw["layer"] == layer and rw["linear"] == name)
                g = gram(xs[layer][name])
                row[f"err_{tag}"] = objective(gm_items[key]["w"], r["q"], g)
                row[f"rel_diff_diffquant_vs_{tag}"] = rel(row["err_diffquant"], row[f"err_{tag}"])
                q_dq, step = dq_ref[key]
                row[f"frac_weights_equal_diffquant_vs_{tag}"] = float(
                    ((r["q"].double() - q_dq).abs() <= 1e-4 * step).double().mean()
                )
                row[f"{tag}_scale_vs_diffquant_max_rel"] = float(
                    ((r["scale"].double() - dq_scale[key]).abs() / dq_scale[key]).max()
                )
                if tag == "gptqmodel_static_groups" and row.get("err_llmcompressor_direct_on_diffquant_H"):
                    row["rel_diff_lc_direct_vs_gptqmodel_static_groups"] = rel(
                        row["err_llmcompressor_direct_on_diffquant_H"], row[f"err_{tag}"]
                    )
                gm["rows"][f"{key}:{tag}"] = {
                    "err": row[f"err_{tag}"],
                    "seconds": r["seconds"],
                    "damp": r["damp"],
                    "block": r["block"],
                    "static_groups": r["static_groups"],
                }
        except Exception as exc:  # record, don't hide
            gm = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"GPTQModel: {gm['error']}", flush=True)
    res = {
        "config": cfg,
        "seconds_llmcompressor_oneshot": lc_seconds,
        "rows": rows,
        "gptqmodel": gm,
        "ragged": ragged_info,
    }
    print("\n".join(table(res)), flush=True)
    return res


_FLOAT_LAYERS: list | None = None


def load_model_cache(args):
    """The float decoder layers (loaded once), for the original weights W."""
    global _FLOAT_LAYERS
    if _FLOAT_LAYERS is None:
        _FLOAT_LAYERS = list(load_model(args.model, args.layers).model.layers)
    return _FLOAT_LAYERS


def fmt(v, spec=".5f"):
    return "-" if v is None else format(v, spec)


def print_row(row: dict) -> None:
    print(
        f"L{row['layer']} {row['linear']:<17} {str(tuple(row['shape'])):<12} dq {fmt(row['err_diffquant'])}  "
        f"lc {fmt(row['err_llmcompressor'])}  lc@dqH {fmt(row['err_llmcompressor_direct_on_diffquant_H'])}  "
        f"rtn {fmt(row['err_rtn'])}  rel(dq-lc)/lc {fmt(row['rel_diff_diffquant_vs_llmcompressor'], '+.2%')}",
        flush=True,
    )


COLUMNS = (
    ("dq", "err_diffquant", ".3e"),
    ("lc", "err_llmcompressor", ".3e"),
    ("lc@dqH", "err_llmcompressor_direct_on_diffquant_H", ".3e"),
    ("gm", "err_gptqmodel", ".3e"),
    ("gm b=g", "err_gptqmodel_block_eq_group", ".3e"),
    ("gm static", "err_gptqmodel_static_groups", ".3e"),
    ("rtn", "err_rtn", ".3e"),
    ("dq/lc-1", "rel_diff_diffquant_vs_llmcompressor", "+.2%"),
    ("dq/lc@dqH-1", "rel_diff_diffquant_vs_llmcompressor_direct", "+.2%"),
    ("dq/gm-1", "rel_diff_diffquant_vs_gptqmodel", "+.2%"),
    ("dq/gm b=g-1", "rel_diff_diffquant_vs_gptqmodel_block_eq_group", "+.2%"),
    ("lc@dqH/gm static-1", "rel_diff_lc_direct_vs_gptqmodel_static_groups", "+.2%"),
    ("same Q dq=lc", "frac_weights_equal_diffquant_vs_lc", ".1%"),
    ("same Q dq=gm", "frac_weights_equal_diffquant_vs_gptqmodel", ".1%"),
    ("same Q dq=gm b=g", "frac_weights_equal_diffquant_vs_gptqmodel_block_eq_group", ".1%"),
)


def table(res: dict) -> list[str]:
    head = ["layer", "linear", *(c[0] for c in COLUMNS)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [str(r["layer"]), r["linear"], *(fmt(r.get(k), spec) for _, k, spec in COLUMNS)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _maxabs(rows: list[dict], key: str) -> str:
    vals = [abs(r[key]) for r in rows if r.get(key) is not None]
    return "-" if not vals else f"{max(vals):.2%} (n={len(vals)})"


def summary(report: dict) -> list[str]:
    out = [
        "| config | max abs dq/lc-1 | max abs dq/gm-1 | max abs dq/gm b=g-1 | max abs lc@dqH/gm static-1 |",
        "|---|---|---|---|---|",
    ]
    for res in report["results"]:
        rows = res["rows"]
        out.append(
            f"| {res['config']['name']} | {_maxabs(rows, 'rel_diff_diffquant_vs_llmcompressor')} | "
            f"{_maxabs(rows, 'rel_diff_diffquant_vs_gptqmodel')} | "
            f"{_maxabs(rows, 'rel_diff_diffquant_vs_gptqmodel_block_eq_group')} | "
            f"{_maxabs(rows, 'rel_diff_lc_direct_vs_gptqmodel_static_groups')} |"
        )
    return out


NOTES = [
    "## Semantic differences (read from the installed sources)",
    "",
    "- Group parameters: llm-compressor 0.14 computes every group's scale / zero point once, from the "
    "original weights, before GPTQ runs (`GPTQModifier.on_sequential_epoch_end` calls "
    "`observe(modules, 'weight')`, then `quantize_weight(..., scale, zero_point)`), with or without "
    "act-order: static groups always. diffquant (and GPTQModel / the reference code without "
    "`static_groups`) take a group's parameters from the error-updated weights when its first column is "
    "reached. This is the whole dq-vs-lc difference without act-order: lc@dqH equals GPTQModel with "
    "`static_groups=True` (0.00 %), and diffquant equals GPTQModel with block = group (<= 0.2 %). In this "
    "run the static timing gave the lower layer error in 13 of the 16 comparisons with llm-compressor (by "
    "<= 2.9 %), the dynamic one in 3 (by up to 4.8 %: layer 1 down_proj at group 64).",
    "- GPTQModel, like the reference code, reads a group's parameters from the lazily updated matrix, which "
    "lacks the current block's pending updates when the group starts inside a block (group 64, block 128); "
    "diffquant adds them (the result does not depend on the block). Hence gm (block 128) differs from dq by "
    "up to a few % at group 64, and gm b=g (block 64) does not. At group 128 the two coincide.",
    "- Act-order: llm-compressor's `actorder='static'` is an alias of 'weight': columns in descending diag(H) "
    "order, static groups in the original column order: the same as diffquant's act_order=True and GPTQModel's "
    "desc_act + static_groups; all three agree to <= 0.84 % (o_proj of layer 0, the smallest error) and "
    ">= 99.4 % of the weights are identical. GPTQModifier's default actorder is 'static', not None.",
    "- Grid: llm-compressor's symmetric int4 scale is absmax / ((q_max - q_min) / 2) = absmax / 7.5 with "
    "signed codes -8..7 and zero point 0, i.e. diffquant's 2 * absmax / 15 with unsigned codes 0..15 and "
    "zero 8: the same levels (max relative scale difference 5.6e-08, float32 rounding). Rounding is "
    "clamp-then-round (half to even) vs round-then-clamp: the same for integer bounds.",
    "- Hessian: llm-compressor accumulates sum(2 x x^T) in float32 and divides by the number of sequences "
    "(inp.shape[0]), not of tokens; diffquant keeps a float64 running mean over tokens. The scale cancels "
    "(damping is relative to mean(diag H)); lc vs lc@dqH (its own H vs diffquant's) differ by <= 0.04 %.",
    "- Damping: the same (damp * mean(diag H) on the diagonal, upper Cholesky factor of H^-1). Precision: "
    "llm-compressor and GPTQModel run GPTQ in float32, diffquant in float64. Dead inputs (diag H = 0): all "
    "three set H_jj = 1 and zero the weight column (none occur here); llm-compressor's scales were already "
    "observed on the original weights, diffquant's act-order scales come from the dead-zeroed weights.",
    "- Non-positive-definite H: llm-compressor falls back to RTN for that module with a warning; GPTQModel "
    "raises damp in steps (damp_auto_increment) and adds diagonal floors; diffquant raises DiffquantError.",
    "- Partial last group (576 = 4 x 128 + 64): diffquant and GPTQModel quantize it; llm-compressor refuses "
    "(ValueError from validate_group_size_divisibility) and, with bypass_divisibility_checks=True, crashes in "
    "its weight observer (unflatten), so at group 128 only down_proj (1,536 inputs) is compared with it.",
    "- Sequential pipeline: llm-compressor calibrates a whole decoder layer on float weights, quantizes it, "
    "then re-runs it to feed the next layer (propagate_error=True). Layer 0's captured X are therefore "
    "exactly its inputs; for layer 1 this script captures X on a float model carrying llm-compressor's "
    "quantized layer 0, so every implementation sees the same X there too.",
]


def markdown(report: dict) -> str:
    lines = [
        "# diffquant GPTQ vs llm-compressor (and GPTQModel) on CPU: SmolLM2-135M, layers 0-1",
        "",
        "Generated by `analysis/gptq/crosscheck.py`; every number is in `crosscheck.json`.",
        "",
        "err = ||(W - Q) X^T||_F^2 / ||W X^T||_F^2 on the captured inputs X of each Linear "
        f"({report['calibration']['windows']} x {report['calibration']['seq']} tokens of "
        f"{report['calibration']['source']}). dq: diffquant gptq_codes; lc: llm-compressor oneshot "
        "(GPTQModifier, sequential pipeline); lc@dqH: llm-compressor's quantize_weight called on diffquant's "
        "Hessian; gm: GPTQModel's GPTQ on diffquant's Hessian (float32), block 128; gm b=g: the same with "
        "block = group size; rtn: round-to-nearest on the same grid (absmax/7.5). dq/x-1: relative difference "
        "of the errors; same Q: fraction of weights with the same quantized value. Layer 1's X are the inputs "
        "llm-compressor's layer 1 saw (the float model with llm-compressor's quantized layer 0).",
        "",
        "Environment: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f"; {report['threads']} threads; total {report['seconds_total']:.0f} s."
        + "".join(
            sorted(
                {
                    f" GPTQModel {r['gptqmodel']['version']} (torch {r['gptqmodel']['torch']}, on CPU, "
                    "separate venv)."
                    for r in report["results"]
                    if r.get("gptqmodel") and "version" in r["gptqmodel"]
                }
            )
        ),
        "",
        "The float weights are SmolLM2-135M-Instruct dequantized from the repo's cached Q4_1 GGUF "
        "(`diffquant export --to hf --dtype float32`), so they already lie on a 4-bit grid (group 32, "
        "asymmetric): the absolute errors are not those of the bf16 release, the comparison is unaffected.",
        "",
        "## Summary",
        "",
        *summary(report),
        "",
        *NOTES,
        "",
    ]
    for res in report["results"]:
        cfg = res["config"]
        lines += [
            f"## {cfg['name']}: int4 sym, group {cfg['group']}, act_order {cfg['act_order']}, "
            f"damp {DAMP}, block {BLOCK}",
            "",
            f"llm-compressor oneshot (2 layers, calibration + GPTQ): {res['seconds_llmcompressor_oneshot']:.1f} s. "
            "llm-compressor scale = absmax/7.5: max relative deviation "
            f"{max(r.get('lc_scale_vs_absmax_over_7.5_max_rel', 0) for r in res['rows']):.1e}; zero points "
            f"max |zp| {max(r.get('lc_zero_point_max_abs') or 0 for r in res['rows'])}; codes in "
            f"{sorted({tuple(r['lc_codes_min_max']) for r in res['rows'] if 'lc_codes_min_max' in r})}.",
            "",
            *table(res),
        ]
        if res.get("ragged"):
            sk = res["ragged"]
            lines += [
                "",
                f"{len(sk['linears'])} Linears (q/k/v/o/gate/up: 576 inputs = 4 x {cfg['group']} + "
                f"{576 % cfg['group']}) have a partial last group; diffquant and GPTQModel quantize them so "
                "(ceil(in / group) groups). llm-compressor: without bypass_divisibility_checks "
                f"`{sk.get('without_bypass')}`; with bypass_divisibility_checks=True `{sk.get('with_bypass')}`"
                + (f"; {sk['llmcompressor']}." if sk.get("llmcompressor") else "."),
            ]
        if res.get("gptqmodel") and res["gptqmodel"].get("error"):
            lines.append(f"\nGPTQModel: `{res['gptqmodel']['error']}`")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/smollm2_hf", help="float32 HF LlamaForCausalLM folder")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(c["name"] for c in CONFIGS))
    ap.add_argument("--gptqmodel-python", default=None, help="python of a venv with gptqmodel (optional)")
    ap.add_argument("--out", default=str(HERE / "crosscheck.json"))
    ap.add_argument(
        "--markdown-only", action="store_true", help="rewrite the .md from an existing --out json"
    )
    ap.add_argument("--gptqmodel-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gptqmodel_worker:
        gptqmodel_worker(args.gptqmodel_worker)
        return
    if args.markdown_only:
        Path(args.out).with_suffix(".md").write_text(markdown(json.loads(Path(args.out).read_text())))
        return
    t_start = time.perf_counter()
    import compressed_tensors
    import llmcompressor
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llmcompressor": llmcompressor.__version__,
        "compressed-tensors": compressed_tensors.__version__,
    }
    ids = calibration_ids(args.model, args.windows, args.seq)
    print(f"calibration: {tuple(ids.shape)} token ids of wikitext2:validation", flush=True)
    t0 = time.perf_counter()
    x0 = capture_inputs(load_model(args.model, args.layers), ids, 0)
    print(f"captured layer-0 inputs in {time.perf_counter() - t0:.1f} s", flush=True)
    wanted = args.configs.split(",")
    results = []
    for cfg in CONFIGS:
        if cfg["name"] in wanted:
            results.append(run_config(cfg, args, ids, x0))
    report = {
        "model": args.model,
        "layers": args.layers,
        "calibration": {
            "source": "wikitext2:validation",
            "windows": args.windows,
            "seq": args.seq,
            "first_ids": ids[0, :8].tolist(),
        },
        "settings": {"bits": BITS, "sym": True, "damp": DAMP, "block": BLOCK},
        "versions": versions,
        "threads": args.threads,
        "seconds_total": time.perf_counter() - t_start,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(f"\nwrote {args.out} ({report['seconds_total']:.0f} s)")


if __name__ == "__main__":
    main()
