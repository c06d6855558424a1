"""Cross-check diffquant's AWQ scale search (diffquant/quant/awq.py, ``search_scales``) against
llm-compressor's ``AWQModifier`` on layer 0 of SmolLM2-135M, and write analysis/awq/crosscheck.md.

What it does
------------
1. Loads SmolLM2-135M(-Instruct) as a Hugging Face ``LlamaForCausalLM`` from the cached GGUF
   (``/root/.cache/diffquant/smollm2/*.gguf``, needs the ``gguf`` package; transformers dequantizes the
   Q4_1 tensors to float32) and keeps only decoder layer 0 (the sequential pipeline calibrates layer 0 from
   the embeddings, so what happens in layer 0 does not depend on the layers after it; dropping them keeps
   the run short). The result is saved once as a plain HF folder, /tmp/awq_crosscheck/smollm2-layer0,
   without the GGUF ``quantization_config`` (``oneshot`` re-reads the config from ``name_or_path`` and
   refuses a quantized one; ``save_pretrained`` refuses a GGUF-quantized model), and loaded from there.
2. Tokenizes the start of WikiText-2 *valid* (``/work/shared/data/wikitext-2-raw/wiki.valid.raw``) with the
   GGUF's tokenizer and cuts ``--windows`` consecutive windows of ``--seq`` tokens.
3. Runs ``oneshot`` with ``AWQModifier(duo_scaling=False, n_grid=20)`` + a W4A16 asymmetric group
   quantization (first with group 128, llm-compressor's W4A16_ASYM; if that refuses SmolLM2's 576-wide
   Linears, 576 = 4 x 128 + 64, again with group 64, which divides 576 and 1536). Wrapping
   ``AWQModifier._compute_best_scale`` / ``_compute_loss`` records, per mapping of layer 0, the chosen
   scales, the activation means, the balance weights, the cached inputs of the parent module and the loss
   of every grid point. ``_set_resolved_mappings`` is wrapped to record which mappings were kept.
4. Runs diffquant's ``search_scales(mean, weights, X, WeightGrid(4, group, sym=False), n_grid=19)`` on the
   same means, weights and inputs (llm-compressor's grid is k/(n-1), k = 0..n-1, so its n_grid = 20 is
   diffquant's alphas k/19, k = 0..18, plus alpha = 1), and compares alphas, scales and loss curves.

Environment (a throwaway venv; nothing is installed into /work/main/.venv)
-------------------------------------------------------------------------
    python3 -m venv /tmp/llmc
    /tmp/llmc/bin/pip install llmcompressor==0.14.0.1 gguf      # pulled torch 2.13.0+cpu, transformers
                                                               # 5.17.0, compressed-tensors 0.19.0
    cd /work/main && OMP_WAIT_POLICY=PASSIVE /tmp/llmc/bin/python analysis/awq/crosscheck.py

diffquant is imported from the working tree (``sys.path.insert(0, <repo root>)``); its own dependencies
beyond torch are not needed for ``diffquant.quant.awq``.

The run-time patch (monkeypatched here, site-packages is not edited)
---------------------------------------------------------------------
llm-compressor's AWQ pins the cached parent inputs before each grid search
(``IntermediatesCache.pin_memory`` -> ``_pin_intermediate`` -> ``Tensor.pin_memory()``), which fails on a
CPU-only torch with "Cannot access accelerator device". Pinning only speeds up host-to-device copies, so
it is replaced by a no-op::

    IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

GGUF_DIR = Path("/root/.cache/diffquant/smollm2")
WIKI = Path("/work/shared/data/wikitext-2-raw/wiki.valid.raw")
SCRATCH = Path("/tmp/awq_crosscheck")  # the 1-layer HF folder converted from the GGUF


# ----------------------------------------------------------------------------------------- the model
def load_model():
    """The 1-layer float32 model and the tokenizer. The GGUF is converted once into a scratch HF folder
    (``SCRATCH``): oneshot re-reads ``config.name_or_path`` with AutoConfig, which a GGUF cache folder has no
    config.json for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = sorted(GGUF_DIR.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no GGUF under {GGUF_DIR}")
    name = files[0].name
    folder = SCRATCH / "smollm2-layer0"
    if not (folder / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(str(GGUF_DIR), gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=name)
        # keep decoder layer 0 only
        model.model.layers = torch.nn.ModuleList(model.model.layers[:1])
        model.config.num_hidden_layers = 1
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:1]
        # the GGUF-loaded model carries quantization_config (method gguf), which save_pretrained and oneshot's
        # validate_model refuse; its tensors are already dequantized to float32, so rebuild a plain model
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config).to(torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model.eval()
    return model, tok, name


def windows(tok, n: int, seq: int):
    from datasets import Dataset

    text = WIKI.read_text(encoding="utf-8")
    ids: list[int] = []
    pos, step = 0, 200_000
    while len(ids) < n * seq and pos < len(text):
        ids = tok(text[: pos + step], add_special_tokens=False).input_ids
        pos += step
    if len(ids) < n * seq:
        raise SystemExit(f"only {len(ids)} tokens in {WIKI}")
    rows = [ids[i * seq : (i + 1) * seq] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq for _ in rows]})


# --------------------------------------------------------------------------------- llm-compressor run
def run_llmc(group: int, n_windows: int, seq: int, bypass: bool = False):
    """oneshot AWQ on the 1-layer model; returns (records, resolved mapping names, seconds)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    # the one-line CPU patch: pin_memory needs an accelerator; pinning only speeds up H2D copies
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)

    model, tok, _ = load_model()
    ds = windows(tok, n_windows, seq)

    records: list[dict] = []
    resolved: list[tuple[str, list[str], str]] = []
    current: list[float] = []

    orig_resolve = AWQModifier._set_resolved_mappings
    orig_best = AWQModifier._compute_best_scale
    orig_loss = AWQModifier._compute_loss

    def set_resolved(self, model):
        orig_resolve(self, model)
        resolved.extend(
            (m.smooth_name, list(m.balance_names), m.parent_name) for m in self._resolved_mappings
        )

    def compute_loss(self, fp16_outputs, int_w_outputs):
        loss = orig_loss(self, fp16_outputs, int_w_outputs)
        current.append(loss)
        return loss

    def compute_best(self, mapping, fp16_outputs, orig_layer_weights):
        current.clear()
        best = orig_best(self, mapping, fp16_outputs, orig_layer_weights)
        x_sum, count = self._smooth_activation_stats[mapping.smooth_name]
        xs = []
        for batch in self._parent_args_cache[mapping.parent]:
            # the parent's first argument: hidden_states (self_attn), x (mlp) or input (a Linear)
            xs.append(next(iter(batch.values())).detach().clone())
        records.append(
            dict(
                smooth=mapping.smooth_name,
                parent=mapping.parent_name,
                balance=list(mapping.balance_names),
                scales=best.detach().clone(),
                x_mean=(x_sum / count).detach().clone(),
                weights=[orig_layer_weights[b].detach().clone() for b in mapping.balance_layers],
                x=torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]),
                ratios=[r for r, _ in self._get_grid_search_params()],
                losses=list(current),
                out_numel=sum(int(f.numel()) for f in fp16_outputs),
            )
        )
        return best

    if group == 128:
        quant = QuantizationModifier(
            targets=["Linear"], ignore=["lm_head"], scheme="W4A16_ASYM", bypass_divisibility_checks=bypass
        )
    else:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(
                num_bits=4, type="int", strategy="group", group_size=group, symmetric=False
            ),
        )
        quant = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    recipe = [AWQModifier(duo_scaling=False, n_grid=20), quant]

    AWQModifier._set_resolved_mappings = set_resolved
    AWQModifier._compute_best_scale = compute_best
    AWQModifier._compute_loss = compute_loss
    t = time.time()
    try:
        oneshot(
            model=model,
            dataset=ds,
            recipe=recipe,
            num_calibration_samples=n_windows,
            max_seq_length=seq,
            pipeline="sequential",
            processor=tok,
        )
    finally:
        AWQModifier._set_resolved_mappings = orig_resolve
        AWQModifier._compute_best_scale = orig_best
        AWQModifier._compute_loss = orig_loss
    return records, resolved, time.time() - t


def vo_inputs(n_windows: int, seq: int):
    """o_proj's inputs and weight in the float model (for diffquant's search on v -> o, which
    llm-compressor skips on SmolLM2)."""
    model, tok, _ = load_model()
    ds = windows(tok, n_windows, seq)
    attn = model.model.layers[0].self_attn
    seen: list[torch.Tensor] = []
    h = attn.o_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1]))
    )
    with torch.no_grad():
        for row in ds["input_ids"]:
            model(torch.tensor([row]))
    h.remove()
    x = torch.cat(seen)
    return x, attn.o_proj.weight.detach().clone()


# ------------------------------------------------------------------------------------ diffquant side
def ours(rec: dict, group: int, n_grid: int = 19) -> dict:
    from diffquant.quant.awq import activation_scale, awq_scales, group_error, search_scales
    from diffquant.quant.weightcodes import WeightGrid

    grid = WeightGrid(4, group, False)
    mean = rec["x_mean"].to(torch.float64)
    t = time.time()
    res = search_scales(mean, rec["weights"], rec["x"], grid, n_grid=n_grid)
    rows = rec["x"].to(torch.float64)
    # the extra point of their grid, alpha = 1
    loss_1 = group_error(rec["weights"], rows, grid, awq_scales(mean, 1.0).to(torch.float32))
    out = dict(
        alpha=res.alpha,
        scales=res.scales,
        losses=list(res.losses) + [loss_1],
        rtn=res.rtn_loss,
        seconds=time.time() - t,
        mean_rel=float(((activation_scale(rec["x"]) - mean).abs() / mean.clamp(min=1e-30)).max()),
        numel=rows.shape[0] * sum(int(w.shape[0]) for w in rec["weights"]),
    )
    if rec.get("scales") is not None:
        theirs = rec["scales"].to(torch.float64)
        out["scale_rel"] = float(((res.scales.double() - theirs) / theirs).abs().max())
        # their scales at their alpha, recomputed with diffquant's formula
        their_alpha = rec["ratios"][min(range(len(rec["losses"])), key=lambda k: (rec["losses"][k], k))]
        mine = awq_scales(mean, their_alpha)
        out["their_alpha"] = their_alpha
        out["formula_rel"] = float(((mine - theirs) / theirs).abs().max())
        # diffquant's loss at llm-compressor's chosen scales (float32, as stored)
        out["loss_at_theirs"] = group_error(rec["weights"], rows, grid, theirs.to(torch.float32))
    return out


def exact_ties(w: torch.Tensor, group: int) -> int:
    """Elements of ``w`` whose w / step + zero lands exactly on .5 in float64 on diffquant's grid (s = 1):
    where float32 (compressed-tensors) and float64 (diffquant) arithmetic may round to different codes."""
    from diffquant.quant.weightcodes import WeightGrid

    grid = WeightGrid(4, group, False)
    g = w.detach().double().unflatten(-1, (-1, group)).reshape(-1, group)
    step, zero = grid.params(g)
    u = g / step + zero
    return int((u - u.floor() == 0.5).sum())


# --------------------------------------------------------------------------------------------- report
def fmt(v: float) -> str:
    return f"{v:.5g}"


def table(rec: dict | None, mine: dict) -> list[str]:
    n = len(mine["losses"])
    lines = [
        "| k | alpha | llm-compressor loss (MSE of parent output) | diffquant L(s)/numel | ratio |",
        "|---|---|---|---|---|",
    ]
    best_o = min(range(n - 1), key=lambda k: (mine["losses"][k], k))
    best_t = None
    if rec is not None and rec["losses"]:
        best_t = min(range(len(rec["losses"])), key=lambda k: (rec["losses"][k], k))
    for k in range(n):
        o = mine["losses"][k] / mine["numel"]
        t = rec["losses"][k] if rec is not None and k < len(rec["losses"]) else None
        mark_t = " **min**" if k == best_t else ""
        mark_o = " **min**" if k == best_o else (" (not on diffquant's grid)" if k == n - 1 else "")
        ratio = fmt(t / o) if t is not None and o > 0 else "-"
        lines.append(
            f"| {k} | {k}/19 | {fmt(t) + mark_t if t is not None else '-'} | {fmt(o)}{mark_o} | {ratio} |"
        )
    return lines


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--short", "diffquant/quant/awq.py", "diffquant/quant/weightcodes.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return f"{head}" + (
            f" (uncommitted: {dirty.replace(chr(10), '; ')})" if dirty else " (awq.py, weightcodes.py clean)"
        )
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default=str(HERE / "crosscheck.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    t0 = time.time()
    import importlib.metadata as md

    versions = {
        p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch", "gguf")
    }
    attempts: list[str] = []
    records = resolved = None
    group = None
    # llm-compressor's W4A16_ASYM (group 128); then the same with its divisibility check bypassed (to see
    # where compressed-tensors itself stops); then group 64, which divides 576 and 1536
    for g, bypass in ((128, False), (128, True), (64, False)):
        what = f"group {g}" + (" with bypass_divisibility_checks=True" if bypass else "")
        try:
            print(f"== llm-compressor AWQ, W4A16 asym {what}", flush=True)
            records, resolved, secs = run_llmc(g, args.windows, args.seq, bypass)
            group = g
            attempts.append(f"{what}: ran ({secs:.0f} s for oneshot)")
            break
        except Exception as e:  # noqa: BLE001 - record the exact failure
            tb = traceback.format_exc()
            first = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
            frames = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith("File ")][-2:]
            frames = [f.replace(str(Path(torch.__file__).parents[1]) + "/", "") for f in frames]
            attempts.append(f"{what}: failed with `{first}` (innermost frames: {' / '.join(frames)})")
            print(tb, flush=True)
    lines: list[str] = []
    if records is None:
        lines += ["# AWQ cross-check: diffquant vs llm-compressor (did not run)", ""]
        lines += [f"- {a}" for a in attempts]
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return

    layer0 = [r for r in records if ".layers.0." in r["smooth"]]
    print("resolved mappings:", resolved, flush=True)
    results = []
    for rec in layer0:
        print(f"== diffquant search_scales on {rec['smooth']} -> {rec['balance']}", flush=True)
        mine = ours(rec, group)
        results.append((rec, mine))
        print(
            f"   llm-compressor alpha {mine['their_alpha']:.4f}, diffquant alpha {mine['alpha']:.4f}, "
            f"max rel diff of scales {mine['scale_rel']:.3g}",
            flush=True,
        )

    # v -> o: llm-compressor skips it on a GQA model; run diffquant's search alone on o_proj's input
    vo = None
    if not any(r["smooth"].endswith("v_proj") for r in layer0):
        print("== v -> o skipped by llm-compressor; diffquant search_scales on o_proj alone", flush=True)
        from diffquant.quant.awq import activation_scale

        x, w_o = vo_inputs(args.windows, args.seq)
        rec_vo = dict(x_mean=activation_scale(x), weights=[w_o], x=x, scales=None, losses=[])
        vo = ours(rec_vo, group)
    total = time.time() - t0

    # ------------------------------------------------------------------ crosscheck.md
    L = lines
    L += [
        "# AWQ cross-check: diffquant `search_scales` vs llm-compressor `AWQModifier`, SmolLM2-135M layer 0",
        "",
    ]
    L += [
        f"Produced by `analysis/awq/crosscheck.py` (run with `/tmp/llmc/bin/python`, see its docstring) in "
        f"{total:.0f} s on 2 CPU cores. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; diffquant at {git_state()}.",
        "",
        f"- Model: `{sorted(GGUF_DIR.glob('*.gguf'))[0].name}` loaded by transformers as LlamaForCausalLM (float32, "
        "Q4_1 dequantized), decoder layer 0 only.",
        f"- Calibration: {args.windows} consecutive windows of {args.seq} tokens from the start of WikiText-2 "
        f"valid ({args.windows * args.seq} tokens), GGUF tokenizer, no BOS.",
        "- llm-compressor: `AWQModifier(duo_scaling=False, n_grid=20)` + W4A16 asymmetric group quantization, "
        "sequential pipeline; `IntermediatesCache._pin_intermediate` monkeypatched to a no-op (CPU torch).",
        f"- diffquant: `search_scales(mean, weights, X, WeightGrid(4, {group}, sym=False), n_grid=19)` on "
        "llm-compressor's recorded activation means, original balance weights and cached parent inputs.",
        "",
        "## Group size",
        "",
    ]
    L += [f"- {a}" for a in attempts]
    if group != 128:
        L += [
            "",
            "So the comparison below is at group 64 (576 = 9 x 64, 1536 = 24 x 64). diffquant's `WeightGrid` "
            "accepts group 128 on 576 columns (a partial last group of 64, as GPTQ / AutoGPTQ do); "
            "llm-compressor refuses it at initialization (`validate_group_size_divisibility`); with that check "
            "bypassed its weight observer fails to reshape 576 columns into groups of 128 "
            "(observers/helpers.py `_flatten_weight`), and compressed-tensors' group fake-quantization "
            "would refuse it next (forward_helpers.py: `columns >= group_size and columns % group_size != 0` "
            "raises). llm-compressor supports no partial group here.",
        ]
    L += ["", "## Mappings of layer 0", ""]
    L += ["llm-compressor resolved (smooth -> balance, parent whose output is the loss):", ""]
    for s, b, p in resolved:
        if ".layers.0." in s:
            L.append(f"- `{s}` -> {', '.join('`' + x.split('.')[-1] + '`' for x in b)}; parent `{p}`")
    if vo is not None:
        L += [
            "",
            "`v_proj -> o_proj` is **not** among them: SmolLM2-135M has 9 query heads and 3 KV heads, so v_proj has "
            '192 outputs and o_proj 576 inputs, and `_check_layers_are_compatible` skips the mapping ("1 mappings '
            'were skipped due to incompatible shapes"; its code comment cites mit-han-lab/llm-awq PR 67, the '
            "authors' code, which also scales v -> o only when the shapes match). A scale per o_proj input channel cannot be folded into v_proj's rows "
            "unless it is equal over the query heads that share a value head. So there is no llm-compressor "
            "result for v -> o on this model; diffquant's search on o_proj's own input is listed below for "
            "reference only (diffquant does not apply it either).",
        ]
    L += ["", "## Summary", ""]
    L += [
        "| mapping | llm-compressor alpha | diffquant alpha | max rel diff of scales | loss ratio (theirs / ours per element), range over k | their choice, extra diffquant loss | diffquant's choice, extra llm-compressor loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec, mine in results:
        ratios = [
            t / (o / mine["numel"]) for t, o in zip(rec["losses"], mine["losses"], strict=False) if o > 0
        ]
        rng = f"{min(ratios):.4g} .. {max(ratios):.4g}" if ratios else "-"
        extra_ours = mine["loss_at_theirs"] / min(mine["losses"][:-1]) - 1
        extra_theirs = rec["losses"][round(mine["alpha"] * 19)] / min(rec["losses"]) - 1
        L.append(
            f"| `{rec['smooth'].split('.')[-1]}` -> {'/'.join(b.split('.')[-1] for b in rec['balance'])} "
            f"| {rec_alpha(mine['their_alpha'])} | {rec_alpha(mine['alpha'])} | {mine['scale_rel']:.3g} | {rng} "
            f"| {100 * extra_ours:+.1f} % | {100 * extra_theirs:+.1f} % |"
        )
    if vo is not None:
        L.append(
            f"| `v_proj` -> o_proj | skipped | {rec_alpha(vo['alpha'])} (diffquant does not apply it) | - | - | - | - |"
        )
    L += [
        "",
        "\"Extra loss\": how much worse the other side's choice is under each side's own objective "
        "(diffquant's L(s) at llm-compressor's scales over diffquant's minimum; llm-compressor's parent MSE at "
        "diffquant's alpha over llm-compressor's minimum).",
    ]
    for rec, mine in results:
        if rec["parent"].endswith(rec["balance"][0].split(".")[-1]) and len(rec["balance"]) == 1:
            r0 = rec["losses"][0] / (mine["losses"][0] / mine["numel"])
            ties = exact_ties(rec["weights"][0], group)
            L += [
                "",
                f"On `{rec['smooth'].split('.')[-1]} -> {rec['balance'][0].split('.')[-1]}` the two losses are the same "
                f"quantity and agree to float32 precision at every alpha except alpha = 0 (ratio {r0:.5f}): there "
                f"s = 1 and {ties} elements of the weight land exactly on a rounding tie (w / step + zero = n + 0.5 "
                "in float64), because the GGUF's Q4_1 weights already sit on a 4-bit grid of blocks of 32; "
                "compressed-tensors computes in float32 and rounds some of those ties the other way. With s != 1 "
                "exact ties disappear.",
            ]
    L += [
        "",
        "Sanity checks per mapping: llm-compressor's scales recomputed with diffquant's `awq_scales` at llm-compressor's "
        "alpha (max rel diff), diffquant's own mean |x| over the cached inputs vs llm-compressor's recorded mean "
        "(max rel diff), and diffquant's L(s) at llm-compressor's chosen scales vs at its own.",
        "",
        "| mapping | formula rel diff | mean rel diff | diffquant L at their scales | diffquant L at own | RTN L | diffquant search s |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec, mine in results:
        L.append(
            f"| `{rec['smooth'].split('.')[-1]}` | {mine['formula_rel']:.3g} | {mine['mean_rel']:.3g} | "
            f"{fmt(mine['loss_at_theirs'])} | {fmt(min(mine['losses'][:-1]))} | {fmt(mine['rtn'])} | {mine['seconds']:.1f} |"
        )
    L += ["", "## Loss curves", ""]
    L += [
        "llm-compressor: the value `_compute_loss` returned at each grid point, i.e. the mean squared error per "
        "element of the parent module's output, with the balance Linears' weights replaced by Q(W diag(s)) "
        "diag(s)^-1. diffquant: `search_scales`' loss, sum_i ||Q(W_i diag(s)) diag(s)^-1 X^T - W_i X^T||^2, "
        "divided by tokens x (sum of the group's output widths) so that it is a per-element MSE too. Point k = 19 "
        "(alpha = 1) is on llm-compressor's grid only; diffquant's value there is computed separately with "
        "`group_error`. For a parent that is the single balance Linear (up -> down) the two columns are the same "
        "quantity; for the norm groups the parent is the whole attention / MLP block, so they are different "
        "quantities and only their minimisers are comparable.",
    ]
    for rec, mine in results:
        L += [
            "",
            f"### `{rec['smooth']}` -> {', '.join(b.split('.')[-1] for b in rec['balance'])} (parent `{rec['parent']}`)",
            "",
        ]
        L += [
            f"Local minima over k: llm-compressor {local_minima(rec['losses'])}, diffquant "
            f"{local_minima(mine['losses'])}.",
            "",
        ]
        L += table(rec, mine)
    if vo is not None:
        L += ["", "### `v_proj -> o_proj` (diffquant only; llm-compressor skips it)", ""]
        L += table(None, vo)
    L += [
        "",
        "## What differs in design",
        "",
        "- **Alpha grid.** llm-compressor: k/(n_grid - 1), k = 0..n_grid-1, so it includes alpha = 1; diffquant (and "
        "the paper's n = 20): k/n, k < n. llm-compressor n_grid = 20 and diffquant n_grid = 19 give the same first 19 "
        "points; llm-compressor has alpha = 1 in addition. Both keep the first minimum (strict `<`).",
        "- **Scale formula.** With `duo_scaling=False` both use s = clamp(mean|x|^alpha, 1e-4) / sqrt(max s * min s) "
        "(llm-compressor also maps inf/nan scales to 1). llm-compressor's default is `duo_scaling=True`: "
        "s = mean|x|^alpha / (mean|w|^(1-alpha) + 1e-4), which is not the paper's formula (it refuses "
        "it with per-tensor weight quantization). llm-compressor's mean |x| is a float32 sum, diffquant's "
        "a float64 one.",
        "- **Loss.** llm-compressor: MSE (mean over elements) of the *parent* module's output, the lowest common "
        "ancestor of the balance Linears: for input_layernorm -> q/k/v the whole `self_attn` output (through "
        "softmax attention and the unquantized o_proj), for post_attention_layernorm -> gate/up the whole `mlp` "
        "output (through SiLU and the unquantized down_proj); for up -> down (and v -> o where it applies) the "
        "parent is the balance Linear itself, i.e. diffquant's L(s) / numel. diffquant: the summed squared error "
        "of the group's own Linear outputs, the paper's Eq. 4, for every group.",
        "- **Which groups are balanced.** llm-compressor's Llama mappings: input_layernorm -> q/k/v, v_proj -> o_proj "
        "(skipped under GQA when shapes differ, as here), post_attention_layernorm -> gate/up, up_proj -> down_proj. "
        "diffquant balances the norm groups only (`AwqCollector`: q/k/v [+ readers of the same x] and gate/up); "
        "o_proj and down_proj get plain RTN codes. The up -> down search below is therefore what llm-compressor "
        "(and the authors) do that diffquant does not.",
        "- **Quantizer.** Both are min/max asymmetric with 0 in the range and an integer zero point "
        "(compressed-tensors' memoryless_minmax observer during the search; diffquant's `WeightGrid`). "
        "compressed-tensors needs the group to divide the input width; diffquant allows a partial last group.",
        "- **Clipping.** Neither searches a clipping range here (the authors' `auto_clip` is absent from "
        "llm-compressor's AWQModifier and from diffquant).",
        "",
    ]
    Path(args.out).write_text("\n".join(L) + "\n")
    raw = {
        "group": group,
        "attempts": attempts,
        "seconds": total,
        "mappings": [
            {
                "smooth": r["smooth"],
                "balance": r["balance"],
                "parent": r["parent"],
                "llmc_alpha": m["their_alpha"],
                "diffquant_alpha": m["alpha"],
                "max_rel_scale_diff": m["scale_rel"],
                "llmc_losses": r["losses"],
                "diffquant_losses_per_element": [x / m["numel"] for x in m["losses"]],
            }
            for r, m in results
        ],
        "v_o_diffquant_only": None
        if vo is None
        else {
            "alpha": vo["alpha"],
            "losses_per_element": [x / vo["numel"] for x in vo["losses"]],
            "rtn": vo["rtn"] / vo["numel"],
        },
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(L))
    print(f"total {total:.0f} s")


def local_minima(curve: list[float]) -> int:
    n = len(curve)
    return sum(
        1 for k in range(n) if (k == 0 or curve[k] < curve[k - 1]) and (k == n - 1 or curve[k] < curve[k + 1])
    )


def rec_alpha(a: float) -> str:
    return f"{a:.4f} ({round(a * 19)}/19)"


if __name__ == "__main__":
    main()
