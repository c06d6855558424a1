"""One vocabulary for the plan file (issue 48 item 4): every old spelling is refused in one line naming the
new key, the new one reads the same setting, docs/plans.md lists every key and every old spelling, and the
two int4 grids it describes are the ones the code computes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from diffquant.errors import DiffquantError
from diffquant.formats import get_format
from diffquant.quant.kv_cache import KVCacheSpec
from diffquant.quant.plan import BackendSpec, PlanDoc, QuantPlan, RuleDoc, SmoothSpec, preset
from diffquant.quant.rotate import RotateSpec
from diffquant.quant.schemes import Scheme
from diffquant.quant.weightcodes import WeightGrid
from diffquant.quant.weights import WeightsSpec

PAGE = Path(__file__).parents[1] / "docs" / "plans.md"
RULE = {"sites": ["layers.*.input"], "scheme": "int8:token"}

# (section, old key, new key, the plan with the old spelling, the same plan spelled the new way, the value)
RENAMES = [
    ("rules[0]", "weights", "modules", {"rules": [{"weights": ["layers.*"], "scheme": "int8"}]}, {"rules": [{"modules": ["layers.*"], "scheme": "int8"}]}, ["layers.*"]),
    ("backend", "weights", "weight_type", {"backend": {"name": "quanto", "weights": "qint4"}}, {"backend": {"name": "quanto", "weight_type": "qint4"}}, "qint4"),
    ("backend", "activations", "activation_type", {"backend": {"name": "quanto", "activations": "qint8"}}, {"backend": {"name": "quanto", "activation_type": "qint8"}}, "qint8"),
    ("weights", "bits", "format", {"weights": {"method": "rtn", "bits": 3}}, {"weights": {"method": "rtn", "format": "int3"}}, "int3"),
    ("weights", "group_size", "group", {"weights": {"method": "rtn", "group_size": 32}}, {"weights": {"method": "rtn", "group": 32}}, 32),
    ("weights", "block", "lazy_batch", {"weights": {"method": "gptq", "block": 64}}, {"weights": {"method": "gptq", "lazy_batch": 64}}, 64),
    ("kv_cache", "bits", "format", {"kv_cache": {"bits": 2}}, {"kv_cache": {"format": "int2"}}, "int2"),
    ("kv_cache", "residual", "window", {"kv_cache": {"residual": 64}}, {"kv_cache": {"window": 64}}, 64),
    ("rotate", "block", "hadamard_block", {"rotate": {"block": 4}, "rules": [RULE]}, {"rotate": {"hadamard_block": 4}, "rules": [RULE]}, 4),
]  # fmt: skip
SECTIONS = {
    "rules": RuleDoc,
    "backend": BackendSpec,
    "smooth": SmoothSpec,
    "rotate": RotateSpec,
    "weights": WeightsSpec,
    "kv_cache": KVCacheSpec,
}


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"name": "x", **doc}))
    return path


@pytest.mark.parametrize(
    ("where", "old", "new", "old_doc", "new_doc", "value"), RENAMES, ids=[f"{r[0]}.{r[1]}" for r in RENAMES]
)
def test_an_old_spelling_is_refused_naming_the_new_one(tmp_path, where, old, new, old_doc, new_doc, value):
    path = _write(tmp_path, old_doc)
    with pytest.raises(DiffquantError) as err:
        QuantPlan.load(path)
    assert str(err.value) == f"{path}: {where}.{old}: renamed '{new}' (see docs/plans.md)"
    plan = QuantPlan.load(_write(tmp_path, new_doc))  # the new spelling reads the same setting
    section = plan.to_dict()[where.partition("[")[0]]
    assert (section[0] if isinstance(section, list) else section)[new] == value


def test_every_rename_of_every_section_has_its_case():
    declared = {
        (name, old, new) for name, cls in SECTIONS.items() for old, new in getattr(cls, "RENAMED", {}).items()
    }
    assert declared == {(where.partition("[")[0], old, new) for where, old, new, *_ in RENAMES}
    for cls in SECTIONS.values():  # an old name never shadows a key of the same section
        assert not set(getattr(cls, "RENAMED", {})) & {f.name for f in dataclasses.fields(cls)}


def test_the_kv_cache_bits_live_in_the_format():
    for fmt, bits in (("int2", 2), ("int4", 4), ("int8", 8), ("fp8", 8)):
        spec = QuantPlan.from_dict({"kv_cache": {"format": fmt}}).kv_cache
        assert (spec.bits, spec.codes) == (bits, "fp8" if fmt == "fp8" else "int")
    with pytest.raises(DiffquantError, match=r"kv_cache.format: .*format: int4.*got 'int'"):
        QuantPlan.from_dict({"kv_cache": {"format": "int"}})


def _table_keys(heading: str) -> list[str]:
    """The first column's keys (backticked) of the first table under ``heading`` in docs/plans.md."""
    lines = PAGE.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if re.fullmatch(r"[|\s:-]+", line):  # the separator row
            continue
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return [k for row in rows[1:] for k in re.findall(r"`([a-z_]+)`", row.split("|")[1])]


def test_the_plans_page_lists_every_key_of_every_section():
    want = {
        "## Top level": PlanDoc,
        "## `backend`": BackendSpec,
        "## `smooth`": SmoothSpec,
        "## `rotate`": RotateSpec,
        "## `weights`": WeightsSpec,
        "## `kv_cache`": KVCacheSpec,
    }
    for heading, cls in want.items():
        assert _table_keys(heading) == [f.name for f in dataclasses.fields(cls)], heading
    rules = _table_keys("## `rules[i]` and their schemes")
    assert rules == [f.name for f in dataclasses.fields(RuleDoc)]
    text = PAGE.read_text()
    schemes = re.findall(r"^\| `([a-z_]+)` \|", text.split("| scheme key |")[1].split("\n\n")[0], re.M)
    assert schemes == [f.name for f in dataclasses.fields(Scheme)]
    old = text.split("## Old spellings")[1].split("\n## ")[0]
    for where, key, new, *_ in RENAMES:
        section = where.replace("[0]", "[i]")
        assert re.search(
            rf"^\| `{re.escape(section)}\.{key}\b[^|]*\| `{re.escape(section)}\.{new}\b", old, re.M
        ), key


def test_the_two_int4_grids_are_what_the_page_says():
    # a rule's int4: the symmetric codebook -7..7 (times absmax / 7), saturating
    fmt = get_format("int4")
    assert fmt.max_value == 7 and fmt.min_value == -7
    assert fmt.round(torch.tensor([9.0, -9.0, 6.6, -7.4])).tolist() == [7.0, -7.0, 7.0, -7.0]
    w = torch.linspace(-1, 1, 64).reshape(8, 8)
    # the weights section's int4: GPTQ's 16 codes, levels -8..7 times 2 max|w| / 15
    grid = WeightGrid(4, 8, True)
    scale, zero = grid.params(w)
    assert grid.maxq == 15 and bool((zero == 8).all())
    assert torch.allclose(scale, 2 * w.abs().amax(1, keepdim=True) / 15)
    assert preset("w4a16-rtn-g32").weights.label() == "rtn int4 g32 sym (GPTQ grid, levels -8..7)"
    assert (
        "levels -7..7" in preset("w4a16").description and "GPTQ's grid" in preset("w4a16-rtn-g32").description
    )


def test_a_checkpoint_written_before_the_renames_still_loads(tmp_path):
    """diffquant's own old quant_plan.json (rule ``weights``, weights ``bits`` / ``group_size`` / ``block``,
    kv_cache ``bits`` / ``residual``) reads in today's spelling: the same model, bit for bit; a user's plan
    file with those keys is still refused naming the new one."""
    import json

    import torch

    from diffquant.errors import DiffquantError
    from diffquant.io.quantized import load_quantized, save_quantized
    from diffquant.quant import QuantPlan, apply_plan
    from tests.conftest import tiny_model

    model = tiny_model("diff_v2")
    plan = {
        "name": "old",
        "rules": [{"modules": ["layers.0.attn.q_proj"], "scheme": "int8:channel"}],
        "weights": {
            "method": "gptq",
            "format": "int4",
            "group": 16,
            "lazy_batch": 32,
            "exclude": ["*.q_proj"],
        },
        "kv_cache": {"format": "int4", "group": 8, "window": 16},
    }
    apply_plan(model, QuantPlan.from_dict(plan))
    from diffquant.quant import calibrate

    ids = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    calibrate(model, ids, batch_size=2)
    save_quantized(model, tmp_path / "q")
    path = tmp_path / "q" / "quant_plan.json"
    doc = json.loads(path.read_text())
    new = doc["plan"]
    old = json.loads(json.dumps(new))
    old["rules"][0]["weights"] = old["rules"][0].pop("modules")
    w = old["weights"]
    w["bits"] = int(w.pop("format")[3:])
    w["group_size"] = w.pop("group")
    w["block"] = w.pop("lazy_batch")
    kv = old["kv_cache"]
    kv["bits"], kv["format"] = int(kv.pop("format")[3:]), "int"
    kv["residual"] = kv.pop("window")
    path.write_text(json.dumps({**doc, "plan": old}))
    loaded = load_quantized(tmp_path / "q")
    assert loaded.quant.plan.to_dict() == new
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(DiffquantError, match=r"rules\[0\].weights: renamed 'modules'"):
        QuantPlan.from_dict(old)
