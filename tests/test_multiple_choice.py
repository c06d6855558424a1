"""HellaSwag-format multiple choice scored like lm-evaluation-harness, checked by brute force."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from diffquant import DiffquantError
from diffquant.eval.multiple_choice import MCItem, evaluate_mc, load_mc_jsonl, mc_logliks, preprocess

BOS = 256
RECORDS = [
    # raw HellaSwag fields: lm-eval builds activity_label + ": " + ctx_a + " " + ctx_b.capitalize()
    {
        "activity_label": "Baking cookies",
        "ctx_a": "A woman mixes flour. [header] She",
        "ctx_b": "pours the batter.",
        "ctx": "ignored when ctx_a is there",
        "endings": ["puts it in the oven.", "eats  the spoon [title] Done", "sings.", "runs a mile away."],
        "label": "0",  # the HF copy stores labels as strings
    },
    {"ctx": "  The cat sat on the", "endings": ["mat.", "moon.", "matrix of ideas."], "label": 2},
    {"ctx": "Bytes: é ü ✓ then", "endings": ["more", "fewer", "none at all"], "label": 1},
    {"ctx": "x", "endings": ["a", "bb", "a"], "label": 2},  # identical endings: a tie
]


def _write(tmp_path: Path, records: list, name: str = "mc.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    return path


def test_load_applies_lm_eval_preprocessing(tmp_path):
    items = load_mc_jsonl(_write(tmp_path, RECORDS))
    assert len(items) == 4
    assert items[0] == MCItem(
        "Baking cookies: A woman mixes flour. She Pours the batter.",
        ["puts it in the oven.", "eats the spoon. Done", "sings.", "runs a mile away."],
        0,
    )
    assert items[1] == MCItem("The cat sat on the", ["mat.", "moon.", "matrix of ideas."], 2)
    assert items[2].ctx == "Bytes: é ü ✓ then"
    # lm-eval's preprocess: strip, " [title]" -> ". ", drop [tags], one pass of double -> single space
    assert preprocess(" How to cook [title] Boil water. [step] Stir. ") == "How to cook. Boil water. Stir."
    assert preprocess("a    b") == "a  b"  # one pass, exactly as lm-eval


def _brute_loglik(model, ctx: str, ending: str) -> float:
    """One forward per continuation byte over the lm-eval window (context + continuation)[-(L+1):][:-1]."""
    full = [BOS, *ctx.encode("utf-8")] + list((" " + ending).encode("utf-8"))
    n_cont = len((" " + ending).encode("utf-8"))
    L = model.config.max_seq_len
    first = max(0, len(full) - 1 - L)  # tokens dropped on the left
    total = 0.0
    for m in range(len(full) - n_cont, len(full)):  # each continuation byte, from its own prefix
        prefix = full[first:m]
        assert 1 <= len(prefix) <= L
        with torch.no_grad():
            logits = model(torch.tensor([prefix]))[0, -1]
        total += torch.log_softmax(logits.double(), dim=-1)[full[m]].item()
    return total


def _first_argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _expected_metrics(items: list[MCItem], lls: list[list[float]]) -> dict:
    acc = [float(_first_argmax(ll) == it.label) for it, ll in zip(items, lls, strict=True)]
    norm = [
        float(_first_argmax([v / len(e) for v, e in zip(ll, it.endings, strict=True)]) == it.label)
        for it, ll in zip(items, lls, strict=True)
    ]
    n = len(items)

    def stderr(p: float) -> float:
        return math.sqrt(p * (1 - p) / (n - 1))

    return {"acc": sum(acc) / n, "acc_norm": sum(norm) / n, "n": n} | {
        "acc_stderr": stderr(sum(acc) / n),
        "acc_norm_stderr": stderr(sum(norm) / n),
    }


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_logliks_and_metrics_match_brute_force(tmp_path, kind, batch_size):
    items = load_mc_jsonl(_write(tmp_path, RECORDS))
    model = tiny_model(kind, vocab_size=259, max_seq_len=96)
    brute = [[_brute_loglik(model, it.ctx, e) for e in it.endings] for it in items]
    got = mc_logliks(model, items, batch_size=batch_size)
    assert [len(g) for g in got] == [len(it.endings) for it in items]
    for g, b in zip(got, brute, strict=True):
        assert g == pytest.approx(b, abs=1e-5)
    assert got[3][0] == got[3][2]  # identical endings score identically
    result = evaluate_mc(model, items, batch_size=batch_size)
    expected = _expected_metrics(items, got)
    assert result == pytest.approx(expected)
    assert set(result) == {"acc", "acc_norm", "n", "acc_stderr", "acc_norm_stderr"}


def test_truncation_keeps_the_continuation_and_drops_context_on_the_left(tmp_path):
    L = 32
    model = tiny_model("diff_v2", vocab_size=259, max_seq_len=L)
    items = [
        MCItem("A long context that cannot fit the window of this small model at all.", ["yes", "no"], 0),
        MCItem("short", ["x" * (L - 1), "y" * (L - 2)], 1),  # continuations of L and L-1 bytes
        MCItem("fits", ["ok", "fine"], 0),
    ]
    assert len(items[0].ctx) + 1 > L
    brute = [[_brute_loglik(model, it.ctx, e) for e in it.endings] for it in items]
    got = mc_logliks(model, items, batch_size=2)
    for g, b in zip(got, brute, strict=True):
        assert g == pytest.approx(b, abs=1e-5)
    # truncation really happened: a different far-left context does not change the score
    other = MCItem("Z" + items[0].ctx[1:], items[0].endings, 0)
    assert mc_logliks(model, [other])[0] == pytest.approx(got[0], abs=1e-5)
    with pytest.raises(DiffquantError) as info:
        mc_logliks(model, [MCItem("c", ["x" * L, "y"], 0)])  # L + 1 continuation bytes
    assert "max_seq_len 32" in str(info.value) and "\n" not in str(info.value)


# -------------------------------------------------------------------------------------- test doubles
class PrefixOracle:
    """A causal double that knows the right answers: wherever the input so far is a prefix of a correct
    sequence (BOS + ctx + " " + right ending), it puts almost all mass on that sequence's next byte."""

    def __init__(self, items: list[MCItem], max_seq_len: int = 128) -> None:
        self.config = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=259)
        self.next: dict[tuple[int, ...], int] = {}
        for it in items:
            seq = [BOS, *(it.ctx + " " + it.endings[it.label]).encode("utf-8")]
            for t in range(1, len(seq)):
                self.next[tuple(seq[:t])] = seq[t]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert not torch.is_grad_enabled()
        logits = torch.zeros((*ids.shape, 259))
        for b in range(ids.shape[0]):
            row = ids[b].tolist()
            for t in range(len(row)):
                nxt = self.next.get(tuple(row[: t + 1]))
                if nxt is not None:
                    logits[b, t, nxt] = 30.0
        return logits


def test_a_model_that_knows_the_answers_scores_one(tmp_path):
    items = load_mc_jsonl(_write(tmp_path, RECORDS[:3]))
    # shared prefixes (none a prefix of the right ending: that would score as high, being as predicted)
    items.append(MCItem("The the the", ["the end of it all", "the end.", "then"], 1))
    result = evaluate_mc(PrefixOracle(items), items, batch_size=3)
    assert result["acc"] == 1.0 and result["acc_norm"] == 1.0 and result["n"] == 4
    assert result["acc_stderr"] == 0.0 == result["acc_norm_stderr"]
    assert evaluate_mc(PrefixOracle(items), items, limit=2)["n"] == 2


class Uniform:
    config = SimpleNamespace(max_seq_len=64, vocab_size=259)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*ids.shape, 259))


def test_ties_go_to_the_first_ending_and_acc_norm_uses_characters():
    # Uniform model: loglik = -len(bytes of " " + ending) * log(259); equal-length endings tie -> index 0.
    items = [MCItem("q", ["ab", "cd"], 0), MCItem("q", ["ab", "cd"], 1), MCItem("q", ["é", "ab"], 1)]
    lls = mc_logliks(Uniform(), items)
    assert lls[2] == pytest.approx([-3 * math.log(259), -3 * math.log(259)])  # "é" is 2 bytes, 1 character
    r = evaluate_mc(Uniform(), items)
    # acc: item 0 right (tie -> 0), item 1 wrong, item 2 wrong (tie -> 0)
    # acc_norm: lls / characters: item 2 has -3log259/1 vs -3log259/2, so "ab" (index 1) wins
    assert r["acc"] == pytest.approx(1 / 3) and r["acc_norm"] == pytest.approx(2 / 3)
    assert r["acc_stderr"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))
    assert math.isnan(evaluate_mc(Uniform(), items, limit=1)["acc_stderr"])


# -------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ("{broken", "invalid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"endings": ["a", "b"], "label": 0}, "missing key 'ctx'"),
        ({"ctx_a": "c", "endings": ["a", "b"], "label": 0}, "missing key 'ctx_b'"),
        ({"ctx": "c", "label": 0}, "missing key 'endings'"),
        ({"ctx": "c", "endings": ["a", "b"]}, "missing key 'label'"),
        ({"ctx": "c", "endings": ["a", "b"], "label": 2}, "label 2 out of range"),
        ({"ctx": "c", "endings": ["a", "b"], "label": -1}, "label -1 out of range"),
        ({"ctx": "c", "endings": ["a", "b"], "label": True}, "'label' must be an integer"),
        ({"ctx": "c", "endings": ["a", "b"], "label": "one"}, "'label' must be an integer"),
        ({"ctx": "c", "endings": "ab", "label": 0}, "'endings' must be a list"),
        ({"ctx": "c", "endings": ["a"], "label": 0}, "at least 2 strings"),
        ({"ctx": "c", "endings": ["a", 3], "label": 0}, "at least 2 strings"),
        ({"ctx": 5, "endings": ["a", "b"], "label": 0}, "'ctx' must be a string"),
        ({"ctx": "c", "endings": ["a", "[header]"], "label": 0}, "empty after preprocessing"),
    ],
)
def test_bad_lines_are_one_line_errors_naming_file_and_line(tmp_path, record, needle):
    good = {"ctx": "c", "endings": ["a", "b"], "label": 0}
    path = tmp_path / "bad.jsonl"
    bad = record if isinstance(record, str) else json.dumps(record)
    path.write_text(json.dumps(good) + "\n\n" + bad + "\n" + json.dumps(good) + "\n")
    with pytest.raises(DiffquantError) as info:
        load_mc_jsonl(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}:3" in message and needle in message


def test_file_level_and_argument_errors(tmp_path):
    with pytest.raises(DiffquantError, match="no such file"):
        load_mc_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DiffquantError, match="no items"):
        load_mc_jsonl(tmp_path / "empty.jsonl")
    items = [MCItem("q", ["a", "b"], 0)]
    for kwargs in ({"limit": 0}, {"batch_size": 0}, {"limit": 1.5}):
        with pytest.raises(DiffquantError):
            evaluate_mc(Uniform(), items, **kwargs)
    with pytest.raises(DiffquantError, match="out of range"):
        evaluate_mc(Uniform(), [MCItem("q", ["a", "b"], 5)])
    with pytest.raises(DiffquantError, match="vocab_size 61"):
        evaluate_mc(tiny_model("baseline"), items)
