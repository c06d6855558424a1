"""HQQ's early stop over the whole weight vs per piece: SmolLM2-135M W4A16 / W3A16 g128 (docs/weights.md).

    OMP_WAIT_POLICY=PASSIVE python analysis/gptq/hqq_stopping.py

HQQ as shipped (and as optimum-quanto's HqqOptimizer) stops every group of a weight at the first iteration
whose mean error over the whole weight does not fall. SmolLM2's 576-wide rows end in a partial 64-wide group
at group size 128; here that partial group is fitted on its own (``by_groups``: its own stopping rule, the
full groups theirs), everything else as shipped. WikiText-2 test perplexity, 8 x 1,024 tokens, as
recipes/weights.yaml scores it. Writes hqq_stopping.json beside this script.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffquant.eval.perplexity import evaluate_bpb
from diffquant.io import load_model
from diffquant.quant import apply_plan, preset
from diffquant.quant.hqq import hqq_codes
from diffquant.quant.weightcodes import by_groups
from diffquant.quant.weights import weight_modules

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows = []
    for name in ("w4a16-hqq-g128", "w3a16-hqq-g128"):
        model = load_model("fetch:smollm2")
        apply_plan(model, preset(name))
        for module_name, q in weight_modules(model).items():
            linear = model.get_submodule(module_name.removesuffix(".weight_quantizer"))
            q.set_codes(by_groups(linear.weight, q.grid, lambda w, g: hqq_codes(w, g)))
        with torch.no_grad():
            ppl = evaluate_bpb(model, "wikitext2:test", max_tokens=8192, seq_len=1024, batch_size=2)[
                "perplexity"
            ]
        rows.append({"plan": name, "partial_group_own_stop_ppl": ppl})
        print(rows[-1], flush=True)
    (HERE / "hqq_stopping.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
