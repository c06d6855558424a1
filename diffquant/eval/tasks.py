"""Tasks as data (the lm-evaluation-harness habit): a type, its parameters, and one primary metric.

Task types:
- ``bpb`` / ``ppl``: bits per byte and token perplexity on a text source (``data``, ``tokens``, ``seq_len``,
  ``stride``, ``windows``, ``decode``; ``intervene: zero|mean`` and ``intervene_layer``: Sun et al.'s
  massive-activation intervention, :mod:`diffquant.eval.interventions`); the same numbers, ``bpb`` ranks by
  bits per byte (comparable across tokenizers), ``ppl`` by token perplexity (what WikiText-2 tables
  report). ``data`` defaults to the text
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
  ``max_length`` (tokens per window; default the model's context), ``trust_task_code`` (let lm-eval run
  the Python that the include_path's task YAMLs name: ``!function``, ``class:``; without it such a YAML
  is refused, as ``trust_remote_code`` does in transformers) and ``metric`` (the primary metric;
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffquant.data.corpus import default_text, iter_documents, token_windows
from diffquant.data.tokenizer import model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.eval import retrieval as retrieval_mod  # tests patch the module attribute
from diffquant.eval.interventions import find_massive, intervened
from diffquant.eval.lmeval import check_lmeval, run_lmeval
from diffquant.eval.multiple_choice import evaluate_mc, load_mc_jsonl
from diffquant.eval.perplexity import evaluate_bpb
from diffquant.eval.retrieval import RetrievalConfig
from diffquant.eval.task_params import TASK_TYPE_PARAMS, split_task_names
from diffquant.quant.state import kv_cache_spec
from diffquant.schema import Style, check, field_default, fields_of, is_required, require_plain_name
from diffquant.textfiles import parse_yaml

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


# --------------------------------------------------------------------------------------------- the registry
Runner = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class TaskType:
    """One task type (lm-eval's registry habit): its parameters, how it runs, and its primary metric
    ((metric, higher is better), or a function of the parameters). ``reads_text``: its ``data`` is a text
    source (None: the default text for the models' tokenizers); ``prepare`` normalises checked parameters;
    ``preflight`` fails early on a missing input file."""

    name: str
    params: type
    run: Runner
    primary: tuple[str, bool] | Callable[[dict[str, Any]], tuple[str, bool]]
    reads_text: bool = False
    prepare: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    preflight: Callable[[dict[str, Any]], Any] | None = None


TASK_TYPES: dict[str, TaskType] = {}


def task_type(name: str, primary: Any, **extra: Any) -> Callable[[Runner], Runner]:
    """Register the decorated runner ``run(model, params, *, batch_size, progress, default_data)`` of the
    type ``name``, whose parameters are ``TASK_TYPE_PARAMS[name]`` (torch-free, for ``eval --help``)."""

    def register(run: Runner) -> Runner:
        TASK_TYPES[name] = TaskType(name, TASK_TYPE_PARAMS[name], run, primary, **extra)
        return run

    return register


class _TaskStyle(Style):
    """Task messages name the parameter of its type: ``bpb parameter 'tokens': expected ...``."""

    type_names = False

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def name(self, path: str) -> str:
        return f"{self.kind} parameter '{path}'"

    def unknown(self, prefix: str, key: str, allowed: Sequence[str]) -> str:
        keys = ", ".join(["name", "type", *allowed])
        return f"unknown key '{key}' for task type {self.kind}; allowed keys: {keys}"

    def missing(self, path: str) -> str:
        return f"task type {self.kind} needs '{path}'"


def _text_files(p: dict[str, Any]) -> None:
    if p["data"]:
        iter_documents(p["data"])


def _prepare_text(p: dict[str, Any], where: str) -> dict[str, Any]:
    if p["intervene_layer"] is not None and p["intervene"] is None:
        raise DiffquantError(
            f"{where}: intervene_layer {p['intervene_layer']} without intervene (zero or mean)"
        )
    return p


# registered bottom-up: bpb first (the order of the --help text and of messages)
@task_type("ppl", ("perplexity", False), reads_text=True, preflight=_text_files, prepare=_prepare_text)
@task_type("bpb", ("bits_per_byte", False), reads_text=True, preflight=_text_files, prepare=_prepare_text)
def _run_text(model, p, *, batch_size, progress, default_data):
    tokenizer = model_tokenizer(model)
    data = p["data"] or default_data or default_text([tokenizer])
    if p["intervene"] is None:
        return _text_metrics(model, p, data, tokenizer, batch_size, progress)
    if getattr(model, "stream_eval", None) is not None or not hasattr(model, "layers"):
        raise DiffquantError("intervene: needs a whole model (hooks on its layers), not a layer-streamed one")
    seq_len = p["seq_len"] or min(model.config.max_seq_len, 2048)
    windows = token_windows(data, int(p["tokens"]), min(seq_len, int(p["tokens"])), tokenizer, quiet=True)
    sites = find_massive(model, windows, batch_size=batch_size, layer=p["intervene_layer"])
    with intervened(model, sites, p["intervene"]) as counts:
        out = _text_metrics(model, p, data, tokenizer, batch_size, progress)
    return {**out, "intervene": p["intervene"], **sites.metrics(), **counts}


def _text_metrics(model, p, data, tokenizer, batch_size, progress):
    return evaluate_bpb(
        model,
        data,
        max_tokens=int(p["tokens"]),
        seq_len=p["seq_len"],
        stride=p["stride"],
        windows=p["windows"],
        batch_size=batch_size,
        progress=progress,
        tokenizer=tokenizer,
        evaluate=getattr(model, "stream_eval", None),  # a skeleton the sweep streams (diffquant.stream)
        decode=p["decode"],
        bos=p["bos"],
    )


def _prepare_retrieval(p: dict[str, Any], where: str) -> dict[str, Any]:
    return {**p, "depths": [float(d) for d in p["depths"]]}


@task_type("retrieval", ("acc_rank", True), prepare=_prepare_retrieval)
def _run_retrieval(model, p, *, batch_size, progress, default_data):
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


@task_type("mc", ("acc_norm", True), preflight=lambda p: load_mc_jsonl(p["path"]))
def _run_mc(model, p, *, batch_size, progress, default_data):
    return evaluate_mc(model, load_mc_jsonl(p["path"]), batch_size=batch_size, limit=p["limit"])


def _prepare_lmeval(p: dict[str, Any], where: str) -> dict[str, Any]:
    p = {**p, "tasks": split_task_names(p["tasks"])}
    path = p["path"]
    if isinstance(path, str) and len(p["tasks"]) > 1:
        raise DiffquantError(
            f"{where}: lmeval parameter 'path': one file for {len(p['tasks'])} tasks; give a mapping "
            "{task: file} in a recipe, or one --task per task"
        )
    if isinstance(path, dict):
        stray = [k for k in path if k not in p["tasks"]]
        if stray:
            raise DiffquantError(
                f"{where}: lmeval parameter 'path': {stray[0]!r} is not among the tasks {p['tasks']}"
            )
    if isinstance(p["include_path"], str):
        p["include_path"] = [p["include_path"]]
    return p


def _lmeval_inputs(p: dict[str, Any]) -> None:
    check_lmeval(
        p["tasks"], include_path=p["include_path"], data_files=p["path"], trust_task_code=p["trust_task_code"]
    )


@task_type("lmeval", lmeval_primary, prepare=_prepare_lmeval, preflight=_lmeval_inputs)
def _run_lmeval(model, p, *, batch_size, progress, default_data):
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
        trust_task_code=p["trust_task_code"],
    )
    return flatten_lmeval(results, p["tasks"])


# type -> {parameter: default}, REQUIRED where a task must give it (derived from the registry)
REQUIRED = object()
TASK_PARAMS: dict[str, dict[str, Any]] = {
    name: {f.name: REQUIRED if is_required(f) else field_default(f) for f, _ in fields_of(t.params)}
    for name, t in TASK_TYPES.items()
}


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
        primary = TASK_TYPES[self.type].primary
        return primary(self.params) if callable(primary) else primary

    @property
    def reads_text(self) -> bool:
        """A text task (``bpb`` / ``ppl``): ``params['data']`` is a text source, None for the default one."""
        return TASK_TYPES[self.type].reads_text

    @property
    def decodes(self) -> bool:
        """Whether the task runs the model's KV cache (where a plan's ``kv_cache`` acts): decode-mode ppl /
        bpb, retrieval (greedy answers, cached candidate scoring), lm-eval (its generate_until tasks decode;
        which ones a task holds only lm-eval knows)."""
        if self.type in ("ppl", "bpb"):
            return self.params.get("decode") is not None
        return self.type in ("retrieval", "lmeval")

    @property
    def streams(self) -> bool:
        """Whether a layer-streamed skeleton can run it: text tasks scored by whole windows (not decoding),
        without an intervention (its hooks need the whole model)."""
        return self.reads_text and not self.decodes and self.params.get("intervene") is None

    def preflight(self) -> None:
        """Fail now on an input file the task would read and cannot (before a run writes anything)."""
        check_files = TASK_TYPES[self.type].preflight
        if check_files is not None:
            check_files(self.params)

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
            key_, eq, raw = item.partition("=")
            if not eq:
                raise DiffquantError(f"{where}: {item!r} is not key=value (in {value!r})")
            data[key_.strip()] = parse_yaml(raw, f"{where}: {key_.strip()}") if raw else None
        value = data
    if not isinstance(value, dict):
        raise DiffquantError(f"{where}: expected a mapping or 'TYPE[:key=value,...]', got {value!r}")
    kind = value.get("type")
    if kind not in TASK_TYPES:
        raise DiffquantError(f"{where}.type: {kind!r}; valid task types: {', '.join(TASK_TYPES)}")
    task = TASK_TYPES[kind]
    raw = {k: v for k, v in value.items() if k not in ("type", "name")}
    params = check(task.params, raw, where, style=_TaskStyle(kind))
    if task.prepare is not None:
        params = task.prepare(params, where)
    name = value.get("name")
    if name is not None:  # it labels rows and names figure files: a plain name, never a list made a string
        require_plain_name(name, where, "name")
    return TaskSpec(kind, params, name or "")


def run_task(
    model, task: TaskSpec, *, batch_size: int = 8, progress: bool = False, default_data: str | None = None
) -> dict[str, Any]:
    """Evaluate ``model`` (through its own tokenizer) on ``task``; a flat dict of metrics (numbers or None).

    ``default_data`` is the text of a ``bpb`` / ``ppl`` task that names none (see :func:`default_text`).
    """
    if kv_cache_spec(model) is not None and not task.decodes:
        raise DiffquantError(kv_cache_refusal(task))
    run = TASK_TYPES[task.type].run
    return run(model, task.params, batch_size=batch_size, progress=progress, default_data=default_data)


def kv_cache_refusal(task: TaskSpec, plan: str = "the plan") -> str:
    """The one-line error for a ``kv_cache`` plan on a task that never decodes (it would change nothing)."""
    return (
        f"task {task.label}: {plan}'s kv_cache acts only when the model decodes, and this task scores whole "
        "windows without a cache; give ppl / bpb decode=N (decode-mode perplexity), or run retrieval or an "
        "lm-eval generate_until task"
    )


def decode_window(task: TaskSpec) -> int | None:
    """The window length of a decode-mode ``ppl`` / ``bpb`` task when the task itself fixes it
    (``seq_len``, or fewer ``tokens``: one shorter window); None for other tasks and for a window the model
    decides (its max_seq_len, known once it is loaded)."""
    if task.type not in ("ppl", "bpb") or task.params.get("decode") is None:
        return None
    seq_len = task.params.get("seq_len")
    return None if seq_len is None else min(int(seq_len), int(task.params["tokens"]))


def check_kv_cache_windows(plans: dict[str, Any], tasks: Sequence[TaskSpec], where: str = "") -> None:
    """Refuse, before a run starts, a plan whose ``kv_cache`` would quantize nothing in a decode-mode task:
    its sinks and full-precision window cover every position the task's windows read
    (:meth:`~diffquant.quant.kv_cache.KVCacheSpec.idle_within`). ``plans``: {label: QuantPlan or None}.
    Windows the model decides are checked when the task runs (a warning: evaluate_bpb)."""
    for label, plan in plans.items():
        spec = getattr(plan, "kv_cache", None)
        if spec is None:
            continue
        for task in tasks:
            window = decode_window(task)
            problem = None if window is None else spec.idle_within(window, f"task {task.label}, plan {label}")
            if problem is not None:
                raise DiffquantError(f"{where}: {problem}" if where else problem)


def flatten_lmeval(results: dict[str, dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    """:func:`run_lmeval`'s ``{task: {metric: value}}`` as one flat dict: the only requested task's metrics
    by name, any other entry (several tasks, or a group's subtasks) as ``TASK/METRIC``."""
    flat: dict[str, Any] = {}
    for name, metrics in results.items():
        plain = len(tasks) == 1 and name == tasks[0]
        flat.update({(key if plain else f"{name}/{key}"): value for key, value in metrics.items()})
    return flat
