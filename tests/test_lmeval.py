"""lm-evaluation-harness adapter: diffquant models score lm-eval tasks exactly as lm-eval's own HFLM does.

A tiny random Hugging Face Llama with a byte-level BPE trained here (no download) is scored twice on the
local-file tasks of recipes/lmeval/ (LAMBADA, HellaSwag, WikiText, from tests/data/lmeval/): through
diffquant (``load_model("hf:...")`` + :class:`DiffquantLM`) and through lm-eval's ``HFLM`` on the same
folder; every metric must agree. The context is 64 tokens, so the LAMBADA passages are left-truncated and
the WikiText documents span several rolling windows. Two tokenizers: one that adds no BOS, one whose
post-processor puts BOS in front (Llama style), since the BOS conventions differ between the two.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, train_byte_bpe

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers", reason="transformers builds the tiny HF Llama")
tokenizers = pytest.importorskip("tokenizers")

from diffquant.cli import main  # noqa: E402
from diffquant.errors import DiffquantError  # noqa: E402
from diffquant.eval.lmeval import run_lmeval, split_wikitext_articles  # noqa: E402
from diffquant.eval.tasks import parse_task, run_task  # noqa: E402
from diffquant.io import load_model  # noqa: E402

DATA = Path(__file__).parent / "data" / "lmeval"
FILES = {
    "lambada_local": DATA / "lambada.jsonl",
    "hellaswag_local": DATA / "hellaswag.jsonl",
    "wikitext_local": DATA / "wikitext.jsonl",
}
CONTEXT = 64  # max_position_embeddings: short enough that truncation and several windows happen
SENTENCES = [
    "The ferry left the harbor at dawn and reached the island by noon.",
    "Snow fell on the station all night, so the morning train was late.",
    "A woman places a tray of dough on the counter and slides it into the oven.",
    "The old mill stands at the edge of the town, where the river bends twice.",
    "In 1920 the wheel broke during a flood; the owners did not repair it.",
]


def _tiny_llama(folder: Path, bos_in_front: bool) -> Path:
    """A tiny random Llama folder with its own byte-level BPE (tokenizer.json + tokenizer_config.json, as
    PreTrainedTokenizerFast reads them); with ``bos_in_front`` the tokenizer prepends BOS by default."""
    train_byte_bpe(
        folder, SENTENCES, prepend_bos=bos_in_front, config={"tokenizer_class": "PreTrainedTokenizerFast"}
    )
    save_tiny_llama(folder, context=CONTEXT, bos_token_id=1, eos_token_id=0)
    return folder


@pytest.fixture(scope="module", params=["no-bos", "bos"])
def folder(request, tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp(f"tiny-llama-{request.param}"), request.param == "bos")


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), False)


@pytest.fixture(scope="module")
def hflm(folder):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), batch_size=3, device="cpu")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


# ============================================================================ the same numbers as HFLM
def test_metrics_equal_hflm(folder, hflm):
    model = load_model(f"hf:{folder}")
    ours = run_lmeval(model, list(FILES), data_files=FILES, batch_size=3, bootstrap_iters=0)
    ref = run_lmeval(hflm, list(FILES), data_files=FILES, bootstrap_iters=0)
    assert set(ours) == set(ref) == set(FILES)
    expected = {
        "lambada_local": {"perplexity", "acc"},
        "hellaswag_local": {"acc", "acc_norm"},
        "wikitext_local": {"word_perplexity", "byte_perplexity", "bits_per_byte"},
    }
    for task, metrics in expected.items():
        assert set(ref[task]) == metrics | {"n_samples"}, ref[task]
        assert ours[task]["n_samples"] == ref[task]["n_samples"] == len(FILES[task].read_text().splitlines())
        for metric in metrics:
            value, want = ours[task][metric], ref[task][metric]
            assert math.isfinite(value) and _rel(value, want) < 1e-4, (task, metric, value, want)
    # what the tiny context exercises: LAMBADA passages longer than it (left truncation), WikiText
    # documents of several windows
    tok = model.tokenizer
    lengths = [
        len(tok.encode(json.loads(line)["text"])) for line in FILES["lambada_local"].read_text().splitlines()
    ]
    assert max(lengths) > CONTEXT + 1
    pages = [
        len(tok.encode(json.loads(line)["page"])) for line in FILES["wikitext_local"].read_text().splitlines()
    ]
    assert min(pages) > CONTEXT


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_requests_equal_hflm(folder, hflm):
    """Request by request: log-likelihoods and is_greedy (empty context, truncated context, a greedy
    continuation), rolling log-likelihoods, greedy generation with stop strings."""
    from diffquant.eval.lmeval import DiffquantLM

    ours = DiffquantLM(load_model(f"hf:{folder}"), batch_size=2)
    assert ours.prefix_token_id == hflm.prefix_token_id == 1
    assert ours.eot_token_id == hflm.eot_token_id == 0
    assert ours.max_length == hflm.max_length == CONTEXT
    for text in ("The ferry left the harbor", "<|bos|>The ferry", " snow  fell "):
        assert ours.tok_encode(text) == hflm.tok_encode(text), text
    long_context = " ".join(SENTENCES)
    gen_args = [
        ("The ferry left the", {"until": ["."], "max_gen_toks": 12}),
        ("Snow fell on the station", {"until": ["\n\n"], "max_gen_toks": 20}),
        (long_context, {"until": ["zz"], "max_gen_toks": 8}),
    ]
    # Greedy decoding compares argmaxes: in float32 two implementations can break a near-tie of a random
    # model's logits differently (seen once), so generation is compared in float64 on both sides.
    from lm_eval.models.huggingface import HFLM

    ours64 = DiffquantLM(load_model(f"hf:{folder}", dtype=torch.float64), batch_size=2)
    hflm64 = HFLM(pretrained=str(folder), batch_size=3, device="cpu", dtype="float64")
    generated = ours64.generate_until(_instances("generate_until", gen_args))
    assert generated == hflm64.generate_until(_instances("generate_until", gen_args))
    assert any(g.strip() for g in generated)  # something was generated
    ll_args = [
        ("The ferry left the", " harbor"),
        ("", "Snow fell on the station"),
        (long_context, " at dawn."),
        ("Snow fell on the station all night,", " so"),
    ]
    got = ours.loglikelihood(_instances("loglikelihood", ll_args))
    want = hflm.loglikelihood(_instances("loglikelihood", ll_args))
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want, strict=True):
        assert _rel(ll, ll_ref) < 1e-4 and greedy == greedy_ref, (got, want)
    # in tokens: the model's own greedy continuation (a random model's text does not survive a round trip
    # through the tokenizer) is greedy for both, and a context longer than the model's is cut the same way
    context = ours.tok_encode("The ferry left the")
    greedy = []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(ours.model(torch.tensor([context + greedy]))[0, -1].argmax()))
    long_ids = ours.tok_encode(long_context)
    requests = [(None, context, greedy), (None, long_ids, greedy), (None, long_ids[:-3], long_ids[-3:])]
    got, want = ours._loglikelihood_tokens(requests), hflm._loglikelihood_tokens(requests)
    assert len(long_ids) > CONTEXT + 1 and got[0][1] and want[0][1]
    for (ll, greedy_ok), (ll_ref, greedy_ref) in zip(got, want, strict=True):
        assert _rel(ll, ll_ref) < 1e-4 and greedy_ok == greedy_ref, (got, want)
    roll_args = [(long_context,), (SENTENCES[0],), (long_context * 2,)]
    got = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", roll_args))
    want = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", roll_args))
    assert all(_rel(a, b) < 1e-4 for a, b in zip(got, want, strict=True)), (got, want)


# ================================================================================ plans, text, errors
def test_plan_changes_the_numbers(plain_folder):
    from diffquant.quant import QuantPlan, apply_plan

    tasks = ["lambada_local", "wikitext_local"]
    files = {t: FILES[t] for t in tasks}
    base = run_lmeval(load_model(f"hf:{plain_folder}"), tasks, data_files=files, bootstrap_iters=0)
    model = load_model(f"hf:{plain_folder}")
    apply_plan(model, QuantPlan.load("w8a8"))
    quant = run_lmeval(model, tasks, data_files=files, bootstrap_iters=0)
    for task, metric in (("lambada_local", "perplexity"), ("wikitext_local", "word_perplexity")):
        assert math.isfinite(quant[task][metric]) and quant[task][metric] != base[task][metric]


def test_wikitext_raw_text_is_split_into_articles(plain_folder):
    raw = (DATA / "wikitext.txt").read_text()
    articles = split_wikitext_articles(raw)
    assert [a.strip().splitlines()[0].strip() for a in articles] == ["= Old Mill =", "= Orchard Road ="]
    assert "= = History = =" in articles[0]
    assert split_wikitext_articles("no headings at all\nsecond line") == ["no headings at all\nsecond line"]
    model = load_model(f"hf:{plain_folder}")
    spec = parse_task(f"lmeval:tasks=wikitext_local,path={DATA / 'wikitext.txt'}")
    metrics = run_task(model, spec, batch_size=4)
    assert metrics["n_samples"] == 2 and metrics["word_perplexity"] > 1
    assert spec.primary == ("word_perplexity", False) and spec.label == "wikitext_local"


def test_parse_task_forms():
    spec = parse_task("lmeval:tasks=lambada_local+hellaswag_local,limit=3,num_fewshot=0")
    assert spec.params["tasks"] == ["lambada_local", "hellaswag_local"]
    assert spec.params["limit"] == 3 and spec.params["num_fewshot"] == 0
    assert spec.label == "lambada_local+hellaswag_local"
    assert spec.primary == ("lambada_local/perplexity", False)
    assert parse_task("lmeval:tasks=hellaswag_local").primary == ("acc", True)
    assert parse_task("lmeval:tasks=hellaswag_local,metric=acc_norm").primary == ("acc_norm", True)
    recipe = {"type": "lmeval", "name": "both", "tasks": ["lambada_local", "wikitext_local"]}
    recipe["path"] = {"lambada_local": "a.jsonl", "wikitext_local": "b.raw"}
    spec = parse_task(recipe)
    assert spec.label == "both" and spec.primary == ("lambada_local/perplexity", False)
    assert parse_task({"type": "lmeval", "tasks": "a,b"}).params["tasks"] == ["a", "b"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("lmeval:limit=3", "needs 'tasks'"),
        ("lmeval:tasks=lambada_local,limit=0", "'limit'"),
        ("lmeval:tasks=lambada_local,bogus=1", "unknown key 'bogus'"),
        ("lmeval:tasks=a+b,path=x.jsonl", "one file for 2 tasks"),
        ("lmeval:tasks=a++b", "'tasks'"),
        ("lmeval:tasks={a: 1}", "'tasks'"),
        ("lmeval:tasks=a,path={b: x.jsonl}", "'b' is not among the tasks"),
    ],
)
def test_bad_task_is_one_line(text, words):
    with pytest.raises(DiffquantError) as err:
        parse_task(text, where="--task")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_run_errors_are_one_line(plain_folder, tmp_path, monkeypatch):
    model = load_model(f"hf:{plain_folder}")
    cases = [
        (dict(tasks=["no_such_task_anywhere"]), "unknown task 'no_such_task_anywhere'"),
        (dict(tasks=["lambada_local"], data_files=tmp_path / "missing.jsonl"), "does not exist"),
        (dict(tasks=["lambada_local"], data_files=DATA / "wikitext.txt", limit=0), "limit"),
    ]
    for kwargs, words in cases:
        with pytest.raises(DiffquantError) as err:
            run_lmeval(model, **kwargs)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    from diffquant.eval.lmeval import DiffquantLM

    sampled = _instances("generate_until", [("The ferry", {"until": ["."], "do_sample": True})])
    with pytest.raises(DiffquantError, match="generates greedily"):
        DiffquantLM(model).generate_until(sampled)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(DiffquantError) as err:
        run_lmeval(model, ["lambada_local"])
    assert "pip install 'diffquant[lmeval]'" in str(err.value) and "\n" not in str(err.value)


def test_importing_diffquant_does_not_import_lm_eval():
    code = (
        "import sys, diffquant, diffquant.cli, diffquant.eval.tasks, diffquant.eval.lmeval, diffquant.eval.sweep\n"
        "assert 'lm_eval' not in sys.modules and 'datasets' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ======================================================================================= the CLI
def test_cli_eval_writes_results(plain_folder, tmp_path, capsys):
    out = tmp_path / "run"
    task = f"lmeval:tasks=lambada_local,path={FILES['lambada_local']},limit=4"
    args = ["eval", f"hf:{plain_folder}", "--task", task, "--plan", "w8a8", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "lambada_local: perplexity (lower is better" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["primary"] == {
        "lambada_local": {"metric": "perplexity", "higher_is_better": False}
    }
    rows = {(r["plan"], r["metric"]): r for r in results["rows"]}
    assert rows[("none", "n_samples")]["value"] == 4
    base, quant = rows[("none", "perplexity")], rows[("w8a8", "perplexity")]
    assert math.isfinite(base["value"]) and quant["delta"] == pytest.approx(quant["value"] - base["value"])
    assert "lambada_local" in (out / "results.csv").read_text()


def test_an_lmeval_run_reports_its_start_and_batches(plain_folder, capsys, monkeypatch):
    """With progress on (the suite runs quiet) and stderr not a terminal, an lm-eval cell says when it starts
    and reports lm-eval's requests batch by batch (interval 0: a line at every batch, as on a machine where
    each batch is slow); lm-eval's own tqdm, which drew ``\\r`` bars into a log file, is replaced."""
    from diffquant import progress as P

    monkeypatch.delenv(P.QUIET_ENV, raising=False)
    monkeypatch.setenv(P.INTERVAL_ENV, "0")
    P.set_quiet(None)
    model = load_model(f"hf:{plain_folder}")
    files = {"lambada_local": FILES["lambada_local"]}
    run_lmeval(model, ["lambada_local"], data_files=files, limit=4, batch_size=2, bootstrap_iters=0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lm-eval")]
    assert lines[0] == "lm-eval lambada_local: 0/1 task, started"
    assert "lm-eval loglikelihood: 0/4 req, started" in lines
    batches = [line for line in lines if line.startswith("lm-eval loglikelihood: 2/4 req, ")]
    assert len(batches) == 1 and "ETA" in batches[0]
    assert any(line.startswith("lm-eval loglikelihood: 4/4 req, ") and "done in" in line for line in lines)
    assert lines[-1].startswith("lm-eval lambada_local: 1/1 task, ") and "done in" in lines[-1]
    assert any(line.startswith("lm-eval contexts: 4/4 doc") for line in lines)
    assert "\r" not in err
