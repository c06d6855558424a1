"""lm-eval hardening: task folders that name Python are refused unless trusted, bad local data files are
one-line errors, an unknown task name is refused without lm-eval's full index, and a killed run leaves no
temporary folder behind.

The hostile folder is what a user might be handed: a task YAML whose ``process_docs: !function
evil.process_docs`` imports ``evil.py`` from the same folder, and ``evil.py`` writes a marker file when it
is imported. Refused: the marker never appears; with ``trust_task_code`` lm-eval imports it (the marker
appears), which is what shows the refusal was the thing that kept it from running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import save_tiny_llama, train_byte_bpe

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers", reason="transformers builds the tiny HF Llama")
pytest.importorskip("tokenizers")

from diffquant.cli import main  # noqa: E402
from diffquant.errors import DiffquantError  # noqa: E402
from diffquant.eval.lmeval import run_lmeval  # noqa: E402
from diffquant.io import load_model  # noqa: E402

DATA = Path(__file__).parent / "data" / "lmeval"
LAMBADA = DATA / "lambada.jsonl"
SENTENCES = [json.loads(line)["text"] for line in LAMBADA.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random Llama with its own byte-level BPE (as tests/test_lmeval.py builds it)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    train_byte_bpe(path, SENTENCES, config={"tokenizer_class": "PreTrainedTokenizerFast"})
    save_tiny_llama(path, context=64, bos_token_id=1, eos_token_id=0)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return load_model(f"hf:{folder}")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DIFFQUANT_QUIET", "1")


# a LAMBADA-style task over the test file, as a user's own task folder would spell it
TASK_BODY = f"""\
dataset_path: json
dataset_kwargs:
  data_files:
    test: {LAMBADA}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _evil_module(where: Path, marker: Path) -> None:
    """evil.py: writes ``marker`` when imported (what lm-eval's ``!function evil.process_docs`` does)."""
    where.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n"
        "def process_docs(dataset):\n    return dataset\n\n"
        "class EvilTask:\n    def __init__(self, *args, **kwargs):\n        pass\n"
    )


def _hostile(tmp_path: Path, layout: str) -> tuple[Path, Path, Path, str]:
    """A task folder naming evil.py's code in one of several places lm-eval reads; returns (folder,
    marker, the file that names the code, the key naming it)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    marker = tmp_path / "marker"
    _evil_module(tasks / "evil.py", marker)
    if layout == "function":
        named = tasks / "evil_task.yaml"
        named.write_text(f"task: evil_task\n{TASK_BODY}process_docs: !function evil.process_docs\n")
        return tasks, marker, named, "process_docs"
    if layout == "class":
        named = tasks / "evil_task.yaml"
        named.write_text(f"task: evil_task\nclass: !function evil.EvilTask\n{TASK_BODY}")
        return tasks, marker, named, "class"
    if layout == "include":  # the code sits in a template only an include: reaches (not indexed itself)
        named = tasks / "_evil_template"
        named.write_text(f"{TASK_BODY}process_docs: !function evil.process_docs\n")
        (tasks / "evil_task.yaml").write_text("task: evil_task\ninclude: _evil_template\n")
        return tasks, marker, named, "process_docs"
    if layout == "group":  # a group YAML with an inline task of its own
        (tasks / "plain.yaml").write_text(f"task: evil_task\n{TASK_BODY}")
        named = tasks / "group.yaml"
        named.write_text(
            "group: evil_group\ntask:\n  - task: inner\n    process_docs: !function evil.process_docs\n"
        )
        return tasks, marker, named, "task[0].process_docs"
    raise AssertionError(layout)


# ============================================================================== task code (item 1)
@pytest.mark.parametrize("layout", ["function", "class", "include", "group"])
def test_task_code_is_refused_without_trust(model, tmp_path, layout):
    tasks, marker, named, key_path = _hostile(tmp_path, layout)
    with pytest.raises(DiffquantError) as err:
        run_lmeval(model, ["evil_task"], include_path=str(tasks), limit=2, bootstrap_iters=0)
    message = str(err.value)
    assert "\n" not in message and "trust_task_code" in message
    assert str(named.resolve()) in message and f"'{key_path}'" in message, message
    if layout == "class":  # named as the Python task it makes, whatever its value is spelled as
        assert "a 'class' key" in message, message
    assert not marker.exists()


def test_trusted_task_code_runs(model, tmp_path):
    tasks, marker, _, _ = _hostile(tmp_path, "function")
    out = run_lmeval(
        model, ["evil_task"], include_path=str(tasks), limit=2, bootstrap_iters=0, trust_task_code=True
    )
    assert marker.read_text() == "ran"  # lm-eval imported evil.py: the code the refusal kept out
    assert out["evil_task"]["n_samples"] == 2 and 0 <= out["evil_task"]["acc"] <= 1


def test_cli_refuses_task_code_before_the_run_folder(folder, tmp_path, capsys):
    tasks, marker, named, _ = _hostile(tmp_path, "function")
    out = tmp_path / "run"
    task = f"lmeval:tasks=evil_task,include_path={tasks},limit=2"
    assert main(["eval", f"hf:{folder}", "--task", task, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(named.resolve()) in err and "trust_task_code=true" in err
    assert not marker.exists() and not out.exists()  # refused before anything ran or was written
    # the same command with the task parameter runs the folder's code (and the same folder is free)
    assert main(["eval", f"hf:{folder}", "--task", f"{task},trust_task_code=true", "--out", str(out)]) == 0
    assert marker.exists()
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and {r["metric"] for r in results["rows"]} >= {"acc", "n_samples"}


def test_recipe_key_trusts_task_code(tmp_path):
    from diffquant.eval.tasks import parse_task

    tasks, marker, _, _ = _hostile(tmp_path, "function")
    recipe_task = {"type": "lmeval", "tasks": ["evil_task"], "include_path": str(tasks)}
    with pytest.raises(DiffquantError, match="trust_task_code"):
        parse_task(recipe_task, where="recipe: eval.tasks[0]").preflight()
    spec = parse_task({**recipe_task, "trust_task_code": True})
    spec.preflight()  # accepted (and nothing ran: the check only reads the YAMLs)
    assert spec.params["trust_task_code"] is True and not marker.exists()
    with pytest.raises(DiffquantError, match="trust_task_code"):
        parse_task({**recipe_task, "trust_task_code": "yes"})


def test_shipped_tasks_need_no_trust(model):
    from diffquant.eval.lmeval import check_lmeval

    local = check_lmeval(["lambada_local", "hellaswag_local", "wikitext_local"])
    assert not local.found  # their !function lines name installed code (lm-eval's, diffquant's)
    out = run_lmeval(model, ["lambada_local"], data_files=LAMBADA, limit=2, bootstrap_iters=0)
    assert out["lambada_local"]["n_samples"] == 2


def test_templates_of_an_include_path_render_sandboxed(model, tmp_path):
    """No !function, but a Jinja template that reaches os through a global: lm-eval's plain Jinja
    environment would run it; untrusted, it renders in Jinja's sandbox and is refused."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    marker = tmp_path / "marker"
    payload = f"{{{{ cycler.__init__.__globals__.os.system('echo ran > {marker}') }}}}"
    body = TASK_BODY.replace(
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"", f'doc_to_text: "{payload}"'
    )
    (tasks / "jinja_task.yaml").write_text(f"task: jinja_task\n{body}")
    with pytest.raises(DiffquantError) as err:
        run_lmeval(model, ["jinja_task"], include_path=str(tasks), limit=1, bootstrap_iters=0)
    assert "sandbox" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()
    run_lmeval(
        model, ["jinja_task"], include_path=str(tasks), limit=1, bootstrap_iters=0, trust_task_code=True
    )
    assert marker.exists()  # trusted, the template ran as lm-eval runs it


# ========================================================================== bad data files (item 6)
def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_FILES = [
    # (task, file name, content, words the one line must hold besides the file name)
    ("lambada_local", "empty.jsonl", "", "is empty"),
    ("lambada_local", "blank.jsonl", "\n \n", "is empty"),
    (
        "lambada_local",
        "notext.jsonl",
        '{"text": "a b c"}\n{"passage": "no text here"}\n',
        "line 2: no field 'text'",
    ),
    ("lambada_local", "badjson.jsonl", '{"text": "a b c"}\n{"text": "cut off\n', "line 2: not valid JSON"),
    ("lambada_local", "number.jsonl", '{"text": 5}\n', "line 1: field 'text' must be a string, got a number"),
    ("lambada_local", "list.jsonl", '["a b c"]\n', "line 1: expected a JSON object, got a list"),
    ("lambada_local", "empty.txt", "\n", "is empty"),
    ("hellaswag_local", "hs.jsonl", None, "line 1: field 'endings' must be a non-empty list of strings"),
    ("hellaswag_local", "hs.txt", "a line of text\n", "one field 'text'"),
    ("wikitext_local", "wiki.jsonl", '{"text": "= A =\\n body"}\n', "line 1: no field 'page'"),
]


@pytest.mark.parametrize("task, name, content, words", BAD_FILES, ids=[b[1] for b in BAD_FILES])
def test_bad_data_file_is_one_line(model, tmp_path, task, name, content, words):
    if content is None:  # a real HellaSwag record, with its endings as one string instead of a list
        record = json.loads((DATA / "hellaswag.jsonl").read_text().splitlines()[0])
        content = json.dumps({**record, "endings": " ".join(record["endings"])}) + "\n"
    bad = _write(tmp_path / name, content)
    with pytest.raises(DiffquantError) as err:
        run_lmeval(model, [task], data_files=bad, bootstrap_iters=0)
    message = str(err.value)
    assert "\n" not in message and str(bad.resolve()) in message and words in message, message


def test_bad_data_file_in_the_cli_is_refused_before_the_folder(folder, tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", '{"text": "a b c"}\n{"txt": "d e f"}\n')
    out = tmp_path / "run"
    args = ["eval", f"hf:{folder}", "--task", f"lmeval:tasks=lambada_local,path={bad}", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad.resolve()}: line 2: no field 'text'" in err
    assert not out.exists()


def test_fields_of_a_task_are_read_from_its_templates(model, tmp_path):
    """A task of the include path without process_docs: the fields its templates name are required."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(f"task: mine\n{TASK_BODY}")
    bad = _write(tmp_path / "data.jsonl", '{"text": "a b c"}\n{"sentence": "d e f"}\n')
    with pytest.raises(DiffquantError, match=r"line 2: no field 'text'"):
        run_lmeval(model, ["mine"], include_path=str(tasks), data_files=bad, bootstrap_iters=0)
    good = _write(tmp_path / "good.jsonl", "\n".join(json.dumps({"text": s}) for s in SENTENCES[:2]) + "\n")
    out = run_lmeval(model, ["mine"], include_path=str(tasks), data_files=good, bootstrap_iters=0)
    assert out["mine"]["n_samples"] == 2


# ============================================================ unknown names, temporary folders (item 7)
class _NoTaskManager:
    def __init__(self, *args, **kwargs):
        raise AssertionError("lm-eval's TaskManager was built for a name that is not a task")


def test_unknown_task_is_refused_without_a_task_manager(model, tmp_path, monkeypatch):
    import lm_eval.tasks

    from diffquant.eval.lmeval import check_lmeval

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _NoTaskManager)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(f"task: mine\ntag: my_tag\n{TASK_BODY}")
    for name in ("hellaswagg", "lambada_locall"):  # a typo of an lm-eval task, of a shipped one
        with pytest.raises(DiffquantError) as err:
            run_lmeval(model, [name], include_path=str(tasks), bootstrap_iters=0)
        assert f"unknown task {name!r}" in str(err.value) and "\n" not in str(err.value)
    # real names pass the same check (lm-eval's own, the include path's task and tag, a shipped one)
    check_lmeval(["hellaswag", "mmlu", "mine", "my_tag", "wikitext_local"], include_path=str(tasks))


@pytest.mark.slow
def test_builtin_names_cover_lm_evals_index():
    """The cheap name list of lm-eval's tasks folder holds every name lm-eval's own index has (so no real
    task is ever refused by it)."""
    from lm_eval.tasks import TaskManager

    from diffquant.eval.lmeval import _builtin_names, _lm_eval_tasks_dir

    names = _builtin_names(_lm_eval_tasks_dir())
    index = set(TaskManager().task_index)
    assert index and index <= names, sorted(index - names)[:10]


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import lm_eval
    from diffquant.io import load_model
    from diffquant.eval.lmeval import run_lmeval

    folder, ready, data = sys.argv[1:4]

    def hang(**kwargs):  # lm-eval is running: say so, then wait to be killed
        Path(ready).write_text("evaluating")
        time.sleep(600)

    lm_eval.simple_evaluate = hang
    run_lmeval(load_model("hf:" + folder), ["lambada_local"], data_files=data)
    """
)


def test_a_killed_run_leaves_no_temporary_folder(folder, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ready = tmp_path / "ready"
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_WAIT_POLICY": "PASSIVE", "DIFFQUANT_QUIET": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder), str(ready), str(LAMBADA)],
        env=env,
        cwd=Path(__file__).parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300  # a generous bound on a busy machine; the wait ends at "ready"
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), child.stderr.read().decode() if child.poll() is not None else "no start"
        child.send_signal(signal.SIGKILL)  # nothing in the child can clean up after this
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert [p.name for p in tmp.iterdir() if p.name.startswith("diffquant-lmeval-")] == []
