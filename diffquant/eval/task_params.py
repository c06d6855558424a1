"""The parameters of each task type, one dataclass each, by type name: what ``eval --task TYPE:key=value``
and a recipe's ``eval.tasks`` accept (checked by :func:`diffquant.schema.check`).

Torch-free on purpose: ``diffquant eval --help`` lists every type with its keys from :data:`TASK_TYPE_PARAMS`
without importing the runners; :mod:`diffquant.eval.tasks` registers one runner per name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from diffquant.schema import key


def _text(optional: bool):
    return lambda v: (
        None
        if isinstance(v, str) and v or (optional and v is None)
        else "a string" + (" or null" if optional else "")
    )


def _depths(v: Any) -> str | None:
    ok = (
        isinstance(v, list)
        and v
        and all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 100 for d in v)
    )
    return None if ok else "a non-empty list of percentages in [0, 100]"


_NAME_SEPARATORS = ("+", ",")  # a string of lm-eval task names: "a+b" (the command line), "a,b" (YAML)


def split_task_names(v: Any) -> list[str] | None:
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
    ok = split_task_names(v) is not None
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


@dataclass
class TextParams:
    """``bpb`` / ``ppl``: a text source cut into windows."""

    data: str | None = key(None, check=_text(True))
    tokens: int = key(16384, min=2)
    seq_len: int | None = key(None, min=2)
    stride: int | None = key(None, min=1)
    windows: Literal["disjoint", "chained"] | None = key(None)
    # decode-mode perplexity: prefill this many tokens of each window, then one token per forward through the
    # KV cache (where a plan's kv_cache acts); only the targets the decode steps predict are scored
    decode: int | None = key(None, min=1)
    # which windows start with BOS (for a tokenizer that adds one): 'stream' frames each document of the text
    # as its tokenizer does (BOS at each document's start, so only the window holding it starts with BOS: the
    # convention of GPTQ / llm-compressor / HF's perplexity guide, which tokenize the joined text once),
    # 'window' puts BOS before every window (BOS + seq_len - 1 text tokens: what a model trained with BOS per
    # document expects; disjoint windows), 'none' adds no BOS anywhere
    bos: Literal["stream", "window", "none"] = key("stream")
    # Sun et al. 2024's intervention: set the massive activations of the layer where they appear to 0 or to
    # their mean (diffquant.eval.interventions); intervene_layer picks the layer (default: the first with any)
    intervene: Literal["zero", "mean"] | None = key(None)
    intervene_layer: int | None = key(None, min=0)


@dataclass
class RetrievalParams:
    needles: int = key(1, min=1)
    queries: int = key(1, min=1)
    depths: list[float] = key([0, 25, 50, 75, 100], check=_depths)
    samples_per_depth: int = key(10, min=1)
    context_bytes: int | None = key(None, min=0)  # None: max_seq_len - 128 (room for the question, answer)
    digits: int = key(4, min=1, max=18)  # distinct candidates must exist, and numbers stay machine-sized
    seed: int = key(0, min=0)
    attention: bool = key(True)


@dataclass
class MCParams:
    path: str = key(check=_text(False))
    limit: int | None = key(None, min=1)


@dataclass
class LMEvalParams:
    tasks: list[str] | str = key(check=_lm_tasks)
    path: str | dict[str, str] | None = key(None, check=_lm_path)
    limit: int | None = key(None, min=1)
    num_fewshot: int | None = key(None, min=0)
    include_path: list[str] | str | None = key(None, check=_paths)
    max_length: int | None = key(None, min=2)
    metric: str | None = key(None, check=_text(True))
    # lm-eval runs the Python a task YAML names (!function, class:); off, the include_path's YAMLs may name none
    trust_task_code: bool = key(False)


# type name -> its parameters, in the order of the --help text and of messages (bpb first); each name has one
# runner registered by @task_type in diffquant.eval.tasks
TASK_TYPE_PARAMS: dict[str, type] = {
    "bpb": TextParams,
    "ppl": TextParams,
    "retrieval": RetrievalParams,
    "mc": MCParams,
    "lmeval": LMEvalParams,
}
