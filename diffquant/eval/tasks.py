"""Tasks as data (the lm-evaluation-harness habit): a type, its parameters, and one primary metric.

Task types:
- ``bpb`` / ``ppl``: bits per byte and token perplexity on a text source (``data``, ``tokens``, ``seq_len``,
  ``stride``, ``windows``); the same numbers, ``bpb`` ranks by bits per byte (comparable across
  tokenizers), ``ppl`` by token perplexity (what WikiText-2 tables report). ``data`` defaults to the text
  the model reads best: ``wikitext2:test`` when any compared model has its own tokenizer, else
  ``stdlib:validation`` (what the zoo was validated on);
- ``retrieval``: needle retrieval, the DIFF paper's Tables 2-3 protocol (``needles``, ``queries``,
  ``depths``, ``samples_per_depth``, ``context_bytes``, ``digits``, ``seed``, ``attention``);
- ``mc``: multiple choice from HellaSwag-format JSONL (``path``, ``limit``);
- ``lmeval``: tasks of lm-evaluation-harness (optional: ``pip install 'diffquant[lmeval]'``) through
  :func:`diffquant.eval.lmeval.run_lmeval`: ``tasks`` (required: lm-eval task names, a list, or one string
  joined by ``+``), ``path`` (a local data file for the task; a mapping ``{task: file}`` for several),
  ``limit`` (first N documents per task), ``num_fewshot``, ``include_path`` (more task YAMLs; diffquant's
  ``recipes/lmeval/`` is always included: ``lambada_local``, ``hellaswag_local``, ``wikitext_local``),
  ``max_length`` (tokens per window; default the model's context) and ``metric`` (the primary metric;
  default the first task's main one: ``word_perplexity`` for wikitext*, ``perplexity`` for lambada*,
  ``acc`` otherwise). With one task its metrics keep lm-eval's names (``acc``, ``acc_norm``,
  ``perplexity``, ``bits_per_byte``, ``acc_stderr``, ..., plus ``n_samples``); with several each is
  ``TASK/METRIC``. The task is labelled by its task names (``lambada_local+hellaswag_local``) unless named.

On the command line a task is ``TYPE`` or ``TYPE:key=value,key=value`` (``bpb:data=stdlib:validation,tokens=4096``);
commas separate keys, so several lm-eval tasks are joined by ``+``
(``lmeval:tasks=lambada_local+wikitext_local,limit=100``), and a data file per task is one ``--task`` each
(``--task lmeval:tasks=lambada_local,path=lambada.jsonl --task lmeval:tasks=wikitext_local,path=wiki.raw``)
or a ``path`` mapping in a recipe.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from diffquant.data.corpus import default_text  # noqa: F401 (moved down for profile and quant)
from diffquant.data.tokenizer import model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.eval import retrieval as retrieval_mod  # tests patch the module attribute
from diffquant.eval.lmeval import run_lmeval
from diffquant.eval.multiple_choice import evaluate_mc, load_mc_jsonl
from diffquant.eval.perplexity import evaluate_bpb
from diffquant.eval.retrieval import RetrievalConfig
from diffquant.textfiles import parse_yaml

# type -> {parameter: default}; a default of REQUIRED must be given.
REQUIRED = object()
_TEXT_PARAMS = {"data": None, "tokens": 16384, "seq_len": None, "stride": None, "windows": None}
TASK_PARAMS: dict[str, dict[str, Any]] = {
    "bpb": dict(_TEXT_PARAMS),
    "ppl": dict(_TEXT_PARAMS),
    "retrieval": {
        "needles": 1,
        "queries": 1,
        "depths": [0, 25, 50, 75, 100],
        "samples_per_depth": 10,
        "context_bytes": None,  # None: the model's max_seq_len - 128 (room for the question and answer)
        "digits": 4,
        "seed": 0,
        "attention": True,
    },
    "mc": {"path": REQUIRED, "limit": None},
    "lmeval": {
        "tasks": REQUIRED,
        "path": None,
        "limit": None,
        "num_fewshot": None,
        "include_path": None,
        "max_length": None,
        "metric": None,
    },
}
_INT_LIMIT = 2**63


def _int(low: int, high: int = _INT_LIMIT - 1, optional: bool = False):
    def check(v: Any) -> str | None:
        if v is None and optional:
            return None
        if isinstance(v, int) and not isinstance(v, bool) and low <= v <= high:
            return None
        top = "2**63 - 1" if high == _INT_LIMIT - 1 else str(high)
        return f"an integer in [{low}, {top}]" + (" or null" if optional else "")

    return check


def _text(optional: bool):
    return lambda v: (
        None
        if isinstance(v, str) and v or (optional and v is None)
        else "a string" + (" or null" if optional else "")
    )


def _choice(*values: Any):
    return lambda v: None if v in values else "one of " + ", ".join(repr(x) for x in values)


def _depths(v: Any) -> str | None:
    ok = (
        isinstance(v, list)
        and v
        and all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 100 for d in v)
    )
    return None if ok else "a non-empty list of percentages in [0, 100]"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


_NAME_SEPARATORS = ("+", ",")  # a string of lm-eval task names: "a+b" (the command line), "a,b" (YAML)


def _task_names(v: Any) -> list[str] | None:
    """lm-eval task names from a list of strings or one string joined by ``+`` / ``,``; None if malformed."""
    if isinstance(v, str):
        for sep in _NAME_SEPARATORS[1:]:
            v = v.replace(sep, _NAME_SEPARATORS[0])
        v = v.split(_NAME_SEPARATORS[0])
    if not isinstance(v, list) or not v or not all(isinstance(n, str) for n in v):
        return None
    names = [n.strip() for n in v]
    return names if all(names) and not any(s in n for n in names for s in _NAME_SEPARATORS) else None


def _lm_tasks(v: Any) -> str | None:
    ok = _task_names(v) is not None
    return None if ok else "lm-eval task names: a list, or one string joined by '+' (a+b)"


def _lm_path(v: Any) -> str | None:
    ok = (
        v is None
        or (isinstance(v, str) and v)
        or (
            isinstance(v, dict)
            and v
            and all(isinstance(k, str) and isinstance(f, str) and f for k, f in v.items())
        )
    )
    return None if ok else "a file path, a mapping {task: file}, or null"


def _paths(v: Any) -> str | None:
    ok = (
        v is None
        or (isinstance(v, str) and v)
        or (isinstance(v, list) and all(isinstance(p, str) and p for p in v))
    )
    return None if ok else "a folder or file of task YAMLs, a list of them, or null"


# type -> {parameter: check}: what each parameter must be (a message of what was expected, or None).
_TEXT_CHECKS = {
    "data": _text(True),
    "tokens": _int(2),
    "seq_len": _int(2, optional=True),
    "stride": _int(1, optional=True),
    "windows": _choice(None, "disjoint", "chained"),
}
TASK_CHECKS: dict[str, dict[str, Any]] = {
    "bpb": _TEXT_CHECKS,
    "ppl": _TEXT_CHECKS,
    "retrieval": {
        "needles": _int(1),
        "queries": _int(1),
        "depths": _depths,
        "samples_per_depth": _int(1),
        "context_bytes": _int(0, optional=True),
        "digits": _int(1, 18),  # distinct candidates must exist, and numbers stay machine-sized
        "seed": _int(0),
        "attention": _bool,
    },
    "mc": {"path": _text(False), "limit": _int(1, optional=True)},
    "lmeval": {
        "tasks": _lm_tasks,
        "path": _lm_path,
        "limit": _int(1, optional=True),
        "num_fewshot": _int(0, optional=True),
        "include_path": _paths,
        "max_length": _int(2, optional=True),
        "metric": _text(True),
    },
}
# type -> (primary metric, higher is better); lmeval's depends on its tasks (see LMEVAL_METRICS)
PRIMARY: dict[str, tuple[str, bool]] = {
    "bpb": ("bits_per_byte", False),
    "ppl": ("perplexity", False),
    "retrieval": ("acc_rank", True),
    "mc": ("acc_norm", True),
}
# lm-eval task name pattern -> its main metric, first match wins (``metric`` overrides)
LMEVAL_METRICS: list[tuple[str, str]] = [
    ("wikitext*", "word_perplexity"),
    ("lambada*", "perplexity"),
    ("*", "acc"),
]
# lm-eval metrics where lower is better (the others are higher-is-better)
LMEVAL_LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")


def lmeval_primary(params: dict[str, Any]) -> tuple[str, bool]:
    """(metric key, higher is better) of an lmeval task: the first task's main metric, by its plain name
    when it is the only task, else as ``TASK/METRIC`` (the keys :func:`run_task` returns)."""
    tasks = params["tasks"]
    metric = params.get("metric") or next(
        m for pattern, m in LMEVAL_METRICS if fnmatch.fnmatch(tasks[0], pattern)
    )
    base = metric.split("[", 1)[0]  # "exact_match[strict-match]": a metric under a filter
    key = metric if len(tasks) == 1 else f"{tasks[0]}/{metric}"
    return key, base not in LMEVAL_LOWER_IS_BETTER and not base.endswith("perplexity")


@dataclass(frozen=True)
class TaskSpec:
    type: str
    params: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        if not self.name and self.type == "lmeval":
            return "+".join(self.params["tasks"])
        return self.name or self.type

    @property
    def primary(self) -> tuple[str, bool]:
        return lmeval_primary(self.params) if self.type == "lmeval" else PRIMARY[self.type]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"name": self.name} if self.name else {}), **self.params}


def parse_task(value: Any, where: str = "task") -> TaskSpec:
    """A task from a YAML mapping ({type: bpb, tokens: 4096}) or the command-line form."""
    if isinstance(value, TaskSpec):
        return value
    if isinstance(value, str):
        kind, _, rest = value.partition(":")
        data: dict[str, Any] = {"type": kind}
        for item in filter(None, rest.split(",")):
            key, eq, raw = item.partition("=")
            if not eq:
                raise DiffquantError(f"{where}: {item!r} is not key=value (in {value!r})")
            data[key.strip()] = parse_yaml(raw, f"{where}: {key.strip()}") if raw else None
        value = data
    if not isinstance(value, dict):
        raise DiffquantError(f"{where}: expected a mapping or 'TYPE[:key=value,...]', got {value!r}")
    kind = value.get("type")
    if kind not in TASK_PARAMS:
        raise DiffquantError(f"{where}.type: {kind!r}; valid task types: {', '.join(TASK_PARAMS)}")
    allowed = TASK_PARAMS[kind]
    params = {}
    for key, val in value.items():
        if key in ("type", "name"):
            continue
        if key not in allowed:
            raise DiffquantError(
                f"{where}: unknown key '{key}' for task type {kind}; allowed keys: "
                f"{', '.join(['name', 'type', *allowed])}"
            )
        params[key] = val
    for key, default in allowed.items():
        if key not in params:
            if default is REQUIRED:
                raise DiffquantError(f"{where}: task type {kind} needs '{key}'")
            params[key] = default
    for key, val in params.items():
        expected = TASK_CHECKS[kind][key](val)
        if expected is not None:
            raise DiffquantError(f"{where}: {kind} parameter '{key}': expected {expected}, got {val!r}")
    if kind == "retrieval":
        params["depths"] = [float(d) for d in params["depths"]]
    if kind == "lmeval":
        params["tasks"] = _task_names(params["tasks"])
        path = params["path"]
        if isinstance(path, str) and len(params["tasks"]) > 1:
            raise DiffquantError(
                f"{where}: lmeval parameter 'path': one file for {len(params['tasks'])} tasks; give a mapping "
                "{task: file} in a recipe, or one --task per task"
            )
        if isinstance(path, dict):
            stray = [k for k in path if k not in params["tasks"]]
            if stray:
                raise DiffquantError(
                    f"{where}: lmeval parameter 'path': {stray[0]!r} is not among the tasks {params['tasks']}"
                )
        if isinstance(params["include_path"], str):
            params["include_path"] = [params["include_path"]]
    return TaskSpec(kind, params, str(value.get("name", "")))


def run_task(
    model, task: TaskSpec, *, batch_size: int = 8, progress: bool = False, default_data: str | None = None
) -> dict[str, Any]:
    """Evaluate ``model`` (through its own tokenizer) on ``task``; a flat dict of metrics (numbers or None).

    ``default_data`` is the text of a ``bpb`` / ``ppl`` task that names none (see :func:`default_text`).
    """
    p = task.params
    if task.type in ("bpb", "ppl"):
        tokenizer = model_tokenizer(model)
        return evaluate_bpb(
            model,
            p["data"] or default_data or default_text([tokenizer]),
            max_tokens=int(p["tokens"]),
            seq_len=p["seq_len"],
            stride=p["stride"],
            windows=p["windows"],
            batch_size=batch_size,
            progress=progress,
            tokenizer=tokenizer,
        )
    if task.type == "retrieval":
        cfg = RetrievalConfig(
            n_needles=int(p["needles"]),
            n_queries=int(p["queries"]),
            depths=tuple(p["depths"]),
            samples_per_depth=int(p["samples_per_depth"]),
            context_bytes=int(p["context_bytes"] or model.config.max_seq_len - 128),
            digits=int(p["digits"]),
            seed=int(p["seed"]),
        )
        result = retrieval_mod.evaluate_retrieval(
            model, cfg, batch_size=batch_size, attention=bool(p["attention"]), progress=progress
        )
        by_depth = result.pop("by_depth", {})
        for depth, values in by_depth.items():
            result[f"acc_rank@{float(depth):g}"] = values["acc_rank"]
        return result
    if task.type == "mc":
        items = load_mc_jsonl(p["path"])
        return evaluate_mc(model, items, batch_size=batch_size, limit=p["limit"])
    if task.type == "lmeval":
        results = run_lmeval(
            model,
            p["tasks"],
            include_path=p["include_path"],
            limit=p["limit"],
            num_fewshot=p["num_fewshot"],
            batch_size=batch_size,
            data_files=p["path"],
            max_length=p["max_length"],
            progress=progress,
        )
        return flatten_lmeval(results, p["tasks"])
    raise AssertionError(task.type)


def flatten_lmeval(results: dict[str, dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    """:func:`run_lmeval`'s ``{task: {metric: value}}`` as one flat dict: the only requested task's metrics
    by name, any other entry (several tasks, or a group's subtasks) as ``TASK/METRIC``."""
    flat: dict[str, Any] = {}
    for name, metrics in results.items():
        plain = len(tasks) == 1 and name == tasks[0]
        flat.update({(key if plain else f"{name}/{key}"): value for key, value in metrics.items()})
    return flat
