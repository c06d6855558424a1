"""Tasks as data (the lm-evaluation-harness habit): a type, its parameters, and one primary metric.

Task types:
- ``bpb`` / ``ppl``: bits per byte and token perplexity on a text source (``data``, ``tokens``, ``seq_len``,
  ``stride``, ``windows``); the same numbers, ``bpb`` ranks by bits per byte (comparable across
  tokenizers), ``ppl`` by token perplexity (what WikiText-2 tables report). ``data`` defaults to the text
  the model reads best: ``wikitext2:test`` when any compared model has its own tokenizer, else
  ``stdlib:validation`` (what the zoo was validated on);
- ``retrieval``: needle retrieval, the DIFF paper's Tables 2-3 protocol (``needles``, ``queries``,
  ``depths``, ``samples_per_depth``, ``context_bytes``, ``digits``, ``seed``, ``attention``);
- ``mc``: multiple choice from HellaSwag-format JSONL (``path``, ``limit``).

On the command line a task is ``TYPE`` or ``TYPE:key=value,key=value`` (``bpb:data=stdlib:validation,tokens=4096``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffquant.errors import DiffquantError
from diffquant.io.yamlfile import parse_yaml

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
}
# type -> (primary metric, higher is better)
PRIMARY: dict[str, tuple[str, bool]] = {
    "bpb": ("bits_per_byte", False),
    "ppl": ("perplexity", False),
    "retrieval": ("acc_rank", True),
    "mc": ("acc_norm", True),
}


@dataclass(frozen=True)
class TaskSpec:
    type: str
    params: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.type

    @property
    def primary(self) -> tuple[str, bool]:
        return PRIMARY[self.type]

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
    return TaskSpec(kind, params, str(value.get("name", "")))


def run_task(
    model, task: TaskSpec, *, batch_size: int = 8, progress: bool = False, default_data: str | None = None
) -> dict[str, Any]:
    """Evaluate ``model`` (through its own tokenizer) on ``task``; a flat dict of metrics (numbers or None).

    ``default_data`` is the text of a ``bpb`` / ``ppl`` task that names none (see :func:`default_text`).
    """
    p = task.params
    if task.type in ("bpb", "ppl"):
        from diffquant.data.tokenizer import model_tokenizer
        from diffquant.eval.perplexity import evaluate_bpb

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
        from diffquant.eval.retrieval import RetrievalConfig, evaluate_retrieval

        cfg = RetrievalConfig(
            n_needles=int(p["needles"]),
            n_queries=int(p["queries"]),
            depths=tuple(p["depths"]),
            samples_per_depth=int(p["samples_per_depth"]),
            context_bytes=int(p["context_bytes"] or model.config.max_seq_len - 128),
            digits=int(p["digits"]),
            seed=int(p["seed"]),
        )
        result = evaluate_retrieval(
            model, cfg, batch_size=batch_size, attention=bool(p["attention"]), progress=progress
        )
        by_depth = result.pop("by_depth", {})
        for depth, values in by_depth.items():
            result[f"acc_rank@{float(depth):g}"] = values["acc_rank"]
        return result
    if task.type == "mc":
        from diffquant.eval.multiple_choice import evaluate_mc, load_mc_jsonl

        items = load_mc_jsonl(p["path"])
        return evaluate_mc(model, items, batch_size=batch_size, limit=p["limit"])
    raise AssertionError(task.type)


def default_text(tokenizers, purpose: str = "eval") -> str:
    """The text a stage reads when none is named, for models with these tokenizers.

    Models compared side by side read the same text, so one model with a learned tokenizer moves all of
    them to WikiText-2 (test for profiles and evaluation, validation for calibration, so calibration
    never sees the evaluated text); byte-level models alone keep the text the zoo was trained and
    validated on (the stdlib splits).
    """
    from diffquant.data.tokenizer import ByteTokenizer

    if all(isinstance(t, ByteTokenizer) for t in tokenizers):
        return {"eval": "stdlib:validation", "profile": "stdlib:validation", "calib": "stdlib:train"}[purpose]
    return {"eval": "wikitext2:test", "profile": "wikitext2:test", "calib": "wikitext2:validation"}[purpose]
