"""Every number a docs page states comes from a committed run output that a test compares with the page, or is
marked as a past measurement with its commit (issue 47).

A page says where a table's or an output block's numbers come from with a comment before it
(:mod:`docpages`: ``<!-- from: FILE -->``, ``<!-- measured at commit HASH, not re-run -->``,
``<!-- checked by: tests/FILE.py -->``). Here: every such table or block of the audited pages carries one;
a ``from:`` table is re-derived from its committed file by the deriver below and compared with the page cell
by cell, to the digits printed; a past measurement names a commit of this history; a ``checked by:`` test
exists and finds the block by its command. Every page is audited (AUDITED).
"""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from docpages import (
    CELL_NUMBER,
    DOCS,
    ROOT,
    Name,
    Numbers,
    agrees,
    block_numbers,
    cell_agrees,
    differences,
    marks,
    measured,
    numbers,
    pages,
)

# every page: README.md and docs/*.md (a new page's tables and output blocks need their marks too)
AUDITED = pages()

Rows = list[list[Any]]


def _items(kind: str) -> list[Numbers]:
    found = [item for page in AUDITED for item in numbers(page) if item.mark is not None]
    if kind == "from":
        return [item for item in found if item.mark.path is not None]
    return [item for item in found if item.mark.test is not None]


# ------------------------------------------------------------------------------------------ derivers
def _kv_vs_transformers(path: Path, shown: Rows) -> Rows:
    """docs/kv-cache.md, diffquant's cache against transformers' QuantizedCache (vs_transformers.py): per
    configuration its grouping, decode perplexity, change ± 2 paired s.e. and the change per window."""
    doc = json.loads(path.read_text())
    out: Rows = [
        ["cache", "keys", "values", "group", "decode ppl", "change ± 2 s.e.", "window 0", "window 1"]
    ]
    out.append([Name("none"), None, None, None, doc["unquantized"]["perplexity"], None, None, None])
    for name, r in doc["configs"].items():
        s = r["settings"]
        if r["engine"] == "hf":
            keys, values = ("token" if s[f"axis_{k}"] == 0 else "channel" for k in ("key", "value"))
            group = s["q_group_size"]
        else:
            keys, values, group = s["keys"], s["values"], s["group"]
        row = [Name(name), f"per {keys}", f"per {values}", float(group), r["perplexity"]]
        out.append([*row, (r["change"], r["two_se"]), *r["per_window"]])
    return out


ZOO_KINDS = ("zoo:baseline", "zoo:diff_v1", "zoo:diff_v2")


def _kv_zoo_paired(path: Path, shown: Rows) -> Rows:
    """docs/kv-cache.md, the zoo trio: each plan's paired change in bits per byte ± 2 s.e. (paired.py's
    output); the rows paired.py does not score are past measurements (``...``)."""
    paired = {(r["plan"], r["model"]): (r["change"], r["two_se"]) for r in json.loads(path.read_text())}
    out: Rows = [["plan", "baseline", "DIFF V1", "DIFF V2"]]
    for row in shown[1:]:
        plan = re.sub(r"^`?([\w-]+)`?.*", r"\1", row[0])
        cells = [paired.get((plan, kind), ...) for kind in ZOO_KINDS]
        out.append([Name(plan), *cells])
    plans = {plan for plan, _ in paired}
    assert plans <= {re.sub(r"^`?([\w-]+)`?.*", r"\1", row[0]) for row in shown[1:]}, plans
    return out


def _kv_bench(path: Path, shown: Rows) -> Rows:
    """docs/kv-cache.md, benchmark: bytes (MiB), share of bf16, decode speed and its ratio, for the
    (context, cache) rows the page shows of bench.py's JSON."""
    rows = {(r["context"], r["cache"]): r for r in json.loads(path.read_text())["rows"]}
    out: Rows = [["context", "cache", "MiB", "vs bf16", "tokens/s", "vs fp"]]
    for row in shown[1:]:
        cache = re.sub(r" \(.*\)$", "", row[1])
        r = rows[(int(row[0]), cache)]
        out.append(
            [
                float(r["context"]),
                Name(cache),
                r["bytes"] / 2**20,
                r["vs_bf16"],
                r["tokens_per_s"],
                r["speed_vs_fp"],
            ]
        )
    return out


def _numbers_in(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in CELL_NUMBER.findall(text)]


def _rotate_outliers(path: Path, shown: Rows) -> Rows:
    """docs/rotation.md, outliers.py's printout: top-1, median, kurtosis (and where the top-1 sits) before
    and after rotation, the residual stream then each Linear input."""
    doc = json.loads(path.read_text())
    values: list[Any] = []
    for when in ("before", "after"):
        r = doc[when]["residual stream (layer outputs)"]
        values += [r["top1"], r["median"], r["kurtosis"], *_numbers_in(r["top1_at"])]
    for linear in doc["before"]["per Linear (all layers)"]:
        for when in ("before", "after"):
            r = doc[when]["per Linear (all layers)"][linear]
            values += [r["top1"], r["median"], r["kurtosis"]]
    return [values]


def _rotate_bench(path: Path, shown: Rows) -> Rows:
    """docs/rotation.md, bench.py's printout: per Hadamard size the construction, fast and dense ms, the
    speed-up and the largest difference; then the forward times and ratios (the forward's shape, 2 x 512
    tokens and 5 rounds, is bench.py's setting, not in its JSON: ``...``)."""
    doc = json.loads(path.read_text())
    values: list[Any] = []
    for r in doc["transform"]:
        values += [r["n"], *_numbers_in(r["construction"]), r["fast_ms"], r["dense_ms"]]
        values += [r["dense_ms"] / r["fast_ms"], r["max_abs_diff"]]
    values += [..., ..., ...]
    for name, r in doc["forward"].items():
        if name != "model":
            values += [r["s"], r["ratio"]]
    return [values]


WHO = {"baseline": "baseline", "diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}


def _gptq_why_w4a4(path: Path, shown: Rows) -> Rows:
    """docs/weights.md, why_w4a4.py: each W4A4 cell's bpb increase over the float model per GPTQ variant."""
    out: Rows = [["cell", "RTN", "GPTQ", "4x calibration", "act-order", "Hessian of the int4 inputs"]]
    for r in json.loads(path.read_text()):
        keys = ("rtn", "gptq", "gptq_32k_calib", "gptq_act_order", "gptq_quantized_inputs")
        out.append([f"{WHO[r['model']]} `{r['plan']}`", *(r[k] - r["fp"] for k in keys)])
    return out


def _gptq_bench(path: Path, shown: Rows) -> Rows:
    """docs/weights.md, the GPTQ benchmark (bench.py's JSON): time, Hessians, peak RSS and perplexity per
    mode and calibration size, and (``--threads``) the perplexity and the share of codes changed at the other
    thread counts."""
    rows = json.loads(path.read_text())["rows"]
    counts = " / ".join(str(s["threads"]) for s in rows[0].get("spread", []))
    out: Rows = [
        [
            "mode",
            "calibration",
            "GPTQ s",
            "Hessians held",
            "peak RSS",
            "WikiText-2 test ppl",
            f"ppl at {counts} threads",
            f"codes changed at {counts} threads",
        ]
    ]
    for i, r in enumerate(rows):
        calibration = f"{r['windows']} x {r['seq_len']} = {r['tokens']:,}" + (" tokens" if i == 0 else "")
        spread = r.get("spread", [])
        ppls = tuple(s["wikitext2_test_ppl"] for s in spread) or None
        changed = tuple(100 * s["codes_changed"] for s in spread) or None
        out.append(
            [
                Name(r["mode"]),
                calibration,
                r["gptq_seconds"],
                r["peak_hessian_mib"],
                r["peak_rss_gib"],
                r.get("wikitext2_test_ppl"),
                ppls,
                changed,
            ]
        )
    return out


def _bos_gemma3(path: Path, shown: Rows) -> Rows:
    """docs/results.md, the BOS conventions on Gemma-3 (analysis/bos/run.sh's eval results.csv)."""
    metrics: dict[str, dict[str, float]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            metrics.setdefault(r["task"].removeprefix("bos-"), {})[r["metric"]] = float(r["value"])
    out: Rows = [["bos", "perplexity", "bits per byte", "targets", "bytes"]]
    for bos, m in metrics.items():
        out.append([Name(bos), m["perplexity"], m["bits_per_byte"], m["n_tokens_scored"], m["n_bytes"]])
    return out


def _markdown_table(path: Path, shown: Rows) -> Rows:
    """A table a script wrote as Markdown (analysis/zoo/summarize.py's zoo.md): the same cells."""
    item = next(item for item in numbers(path) if item.kind == "table")
    return item.rows


DERIVERS: dict[str, Callable[[Path, Rows], Rows]] = {
    "analysis/kvcache/vs_transformers.json": _kv_vs_transformers,
    "analysis/kvcache/paired.json": _kv_zoo_paired,
    "analysis/kvcache/bench-float32.json": _kv_bench,
    "analysis/rotate/outliers.json": _rotate_outliers,
    "analysis/rotate/bench.json": _rotate_bench,
    "analysis/gptq/why_w4a4.json": _gptq_why_w4a4,
    "analysis/gptq/bench.json": _gptq_bench,
    "analysis/zoo/zoo.md": _markdown_table,
    "analysis/bos/gemma3/results.csv": _bos_gemma3,
}


def shown_rows(item: Numbers) -> Rows:
    return item.rows if item.kind == "table" else block_numbers(item)


# ------------------------------------------------------------------------------------------ the tests
def test_every_measured_table_and_block_of_the_audited_pages_says_where_its_numbers_come_from():
    unmarked = [
        item.where() for page in AUDITED for item in numbers(page) if measured(item) and item.mark is None
    ]
    assert unmarked == []


@pytest.mark.parametrize("item", _items("from"), ids=Numbers.where)
def test_a_from_table_is_what_its_committed_file_gives(item):
    path = item.mark.path
    assert path in DERIVERS, f"{item.where()}: no deriver for {path} in tests/test_docs_numbers.py"
    assert (ROOT / path).is_file(), f"{item.where()}: {path} is not there"
    want = DERIVERS[path](ROOT / path, item.rows)
    if any(cell is ... for row in want for cell in row):
        assert item.mark.commit, (
            f"{item.where()}: cells {path} does not give need 'the rest measured at commit'"
        )
    assert differences(shown_rows(item), want) == []


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)


def unknown_commits(page: Path, root: Path = ROOT) -> list[str]:
    """The marks of ``page`` whose commit is not one of the history of ``root``'s HEAD (``page:line: hash``)."""
    bad = []
    for mark in marks(page):
        if mark.commit is None:
            continue
        known = _git("cat-file", "-e", f"{mark.commit}^{{commit}}", root=root).returncode == 0
        if not known or _git("merge-base", "--is-ancestor", mark.commit, "HEAD", root=root).returncode != 0:
            bad.append(f"{page.name}:{mark.line}: {mark.commit}")
    return bad


@pytest.mark.skipif(
    not (ROOT / ".git").exists(),
    reason="no git history here (an installed wheel): commits cannot be looked up",
)
@pytest.mark.parametrize("page", AUDITED, ids=lambda p: p.name)
def test_a_past_measurement_names_a_commit_of_this_history(page):
    assert unknown_commits(page) == []


def test_a_made_up_commit_is_reported(tmp_path):
    # in a history of its own, so that it runs where this checkout has no .git (the mutation check's copy)
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (
        ("init", "-q"),
        ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"),
    ):
        assert _git(*args, root=repo).returncode == 0
    head = _git("rev-parse", "--short", "HEAD", root=repo).stdout.strip()
    page = tmp_path / "page.md"
    page.write_text(
        f"<!-- measured at commit {head}, not re-run -->\n| a |\n\n<!-- measured at commit deadbee, not re-run -->\n"
    )
    assert unknown_commits(page, repo) == ["page.md:4: deadbee"]


@pytest.mark.parametrize("item", _items("checked"), ids=Numbers.where)
def test_a_checked_block_is_found_by_its_test(item):
    prompt = item.rows[0][0]
    assert prompt.startswith("$ "), f"{item.where()}: a checked block starts with its command"
    test = ROOT / item.mark.test
    assert test.is_file(), f"{item.where()}: {item.mark.test} is not there"
    words = " ".join(prompt[2:].split()[:3])
    assert words in test.read_text(), f"{item.where()}: {item.mark.test} does not look for {words!r}"


# ------------------------------------------------------------------------------------------ prose tied to a run
def _sci(x: float) -> str:
    """1.4e-4 as the prose writes it (Python's 1.4e-04 without the exponent's zero)."""
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.1e}")


def test_the_kv_cache_page_says_what_vs_transformers_measured():
    """docs/kv-cache.md's comparison with transformers: every number its prose quotes, and every 'beyond' /
    'within' two standard errors it states, from analysis/kvcache/vs_transformers.json."""
    doc = json.loads((ROOT / "analysis/kvcache/vs_transformers.json").read_text())
    c, p = doc["configs"], doc["pairs"]
    text = " ".join((DOCS / "kv-cache.md").read_text().split())

    def pair(name: str) -> str:
        return f"{p[name]['mean_nll_diff']:+.5f} ± {p[name]['two_se']:.5f}"

    same = [r for r in p.values() if "same_inputs_max_gap" in r]
    kv4 = p["hf-quanto-k-1-g32 vs dq-kv4"]
    phrases = [
        f"head and token: {c['hf-quanto']['change']:+.4f}, against {c['hf-quanto-k-1']['change']:+.4f} with keys",
        f"{c['hf-quanto-k-1-g32']['change']:+.4f} with KIVI's groups of 32; diffquant's cache with the default's "
        f"grouping gives {c['dq-token-g64']['change']:+.4f}",
        f"(transformers, groups of 64: {pair('hf-quanto vs hf-quanto-k-1')} nats per token; diffquant, groups of "
        f"32: {pair('dq-token-keys vs dq-kv4')})",
        f"({pair('hf-quanto-k-1 vs hf-quanto-k-1-g32')}, keys per channel)",
        f"`axis_key=-1, q_group_size=32` ({c['hf-quanto-k-1-g32']['change']:+.4f} here)",
        f"still end {kv4['ppl_diff']:+.4f} apart in perplexity",
        f"by up to {_sci(doc['unquantized']['transformers_max_nll_gap'])} per token",
        f"by at most {kv4['max_nll_gap_before_first_flush']:.4f} nats per token before the first flush, up to "
        f"{kv4['max_nll_gap']:.2f} after",
        f"the mean NLL difference is {pair('hf-quanto-k-1-g32 vs dq-kv4')}, within two paired standard errors",
        f"pairs end {p['hf-quanto vs dq-token-g64']['ppl_diff']:+.4f} and "
        f"{p['hf-quanto-k-1 vs dq-channel-g64']['ppl_diff']:+.4f} apart",
        f"within {_sci(max(r['same_inputs_max_gap'] for r in same))} of each other",
        f"end {abs(kv4['ppl_diff']):.4f} apart in perplexity on 2 of these windows, where two paired standard "
        f"errors of the `kv4` change are {c['dq-kv4']['two_se']:.4f}",
    ]
    assert [phrase for phrase in phrases if phrase not in text] == []
    # the verdicts: per-token keys beyond noise, group size and the same-cache pairs within it
    for name in ("hf-quanto vs hf-quanto-k-1", "dq-token-keys vs dq-kv4"):
        assert p[name]["mean_nll_diff"] > p[name]["two_se"], name
    assert (
        abs(p["hf-quanto-k-1 vs hf-quanto-k-1-g32"]["mean_nll_diff"])
        < p["hf-quanto-k-1 vs hf-quanto-k-1-g32"]["two_se"]
    )
    assert all(abs(r["mean_nll_diff"]) < r["two_se"] for r in same)
    token_keys = {
        n for n, r in c.items() if r["settings"].get("keys", r["settings"].get("axis_key")) in ("token", 0)
    }
    assert (
        {n for n, r in c.items() if r["change"] > r["two_se"]}
        == token_keys
        == {
            "hf-quanto",
            "dq-token-g64",
            "dq-token-keys",
        }
    )


# ------------------------------------------------------------------------------------------ the comparison itself
def test_agrees_rounds_to_the_digits_shown_and_keeps_the_sign_and_grouping():
    assert agrees("19.5027", 19.50274) and agrees("+0.0624", 0.06244) and agrees("1.00", 0.999)
    assert agrees("6,362,345.7", 6362345.71) and agrees("2.1e-06", 2.1457e-6) and agrees("1024", 1024.0)
    assert agrees("+0.0000", -0.00001) and agrees("-0.0000", 0.00001)  # a rounded zero shows either sign
    assert agrees("6362345.7", 6362345.7)  # no comma shown, none asked for
    for shown, value in (
        ("19.5027", 19.50276),  # one unit in the last digit
        ("+0.0624", -0.0624),  # the sign
        ("0.0624", 0.0624 + 1e-3),
        ("6,362,345.8", 6362345.71),
        ("2.1e-06", 2.1e-5),
        ("1.0", 1.06),
    ):
        assert not agrees(shown, value), (shown, value)


def test_cells_compare_every_number_of_a_cell_and_nothing_else():
    assert cell_agrees("-0.0001 ± 0.0006", (-0.0001, 0.0006))
    assert not cell_agrees("-0.0001 ± 0.0006", (-0.0001, 0.0007))
    assert not cell_agrees("-0.0001 ± 0.0006", -0.0001)  # a second number the source does not give
    assert (
        cell_agrees("**51.44**", 51.44) and cell_agrees("2.42 GiB", 2.42) and cell_agrees("x 217,756", 217756)
    )
    assert not cell_agrees("51.44 (was 50.1)", 51.44)  # words around a number are not a number cell
    assert cell_agrees("48.33 / 49.26", (48.33, 49.26)) and not cell_agrees("48.33 / 49.26", (48.33, 49.27))
    assert cell_agrees("", None) and not cell_agrees("+0.1", None)
    assert cell_agrees("`kv4` (KIVI: keys per channel)", Name("kv4")) and cell_agrees("none", Name("none"))
    assert not cell_agrees("`kv4-compact`", Name("kv4")) and not cell_agrees("`kv4", Name("kv4"))


def test_differences_name_every_cell_and_row_that_differs():
    shown = [["plan", "ppl"], ["none", "19.4403"], ["`kv4`", "19.4954"]]
    assert differences(shown, [["plan", "ppl"], [Name("none"), 19.44029], [Name("kv4"), 19.49541]]) == []
    want = [["plan", "ppl"], [Name("none"), 19.44029], [Name("kv4"), 19.5027]]
    assert differences(shown, want) == ["row 2 cell 1: shown '19.4954', derived 19.5027"]
    assert differences(shown[:2], want) == ["2 rows shown, 3 derived"]
    assert differences(shown, [["plan", "ppl"], [Name("none"), 19.44029], [Name("kv4"), ...]]) == []
    assert len(differences([["a", "1.0", "2.0"]], [["a", 1.0]])) == 1


def test_a_block_is_compared_number_by_number_commands_aside():
    item = Numbers(
        ROOT / "x.md",
        "block",
        1,
        [["$ diffquant eval w4a4 --tokens 2048"], ["w4a4   7.493 s  1.000x  top-1 at 2"]],
        None,
    )
    assert block_numbers(item) == [["7.493", "1.000", "2"]]
    assert measured(item)
    assert not measured(
        Numbers(ROOT / "x.md", "block", 1, [["$ diffquant eval --tokens 4.5"], ["done"]], None)
    )
    assert measured(Numbers(ROOT / "x.md", "table", 1, [["plan", "ppl"], ["none", "19.4403"]], None))
    assert not measured(Numbers(ROOT / "x.md", "table", 1, [["k", "v"], ["bits", "2, 4, 8"]], None))


def test_a_malformed_mark_is_an_error_not_an_unmarked_table(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- from analysis/x.json -->\n| a |\n|---|\n| 1.5 |\n")
    with pytest.raises(AssertionError, match="does not parse"):
        numbers(page)
    page.write_text("<!-- measured at commit abc1234, not re-run -->\n\n| a |\n|---|\n| 1.5 |\n")
    assert numbers(page)[0].mark.commit == "abc1234"
    page.write_text("<!-- from: a/b.csv; the rest measured at commit abc1234, not re-run -->\n| a |\n")
    mark = numbers(page)[0].mark
    assert (mark.path, mark.commit) == ("a/b.csv", "abc1234")


def test_the_derivers_read_what_they_are_given():
    # a deriver must be fed from its file: changing one number of the file changes the derived cells
    src = ROOT / "analysis/gptq/why_w4a4.json"
    rows = _gptq_why_w4a4(src, [])
    doc = json.loads(src.read_text())
    assert rows[1][1] == pytest.approx(doc[0]["rtn"] - doc[0]["fp"])
    assert math.isfinite(rows[-1][-1])
