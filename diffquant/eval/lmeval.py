"""lm-evaluation-harness adapter: diffquant models (their own tokenizer, any quantization plan applied) on
lm-eval tasks.

lm-eval (EleutherAI/lm-evaluation-harness, pinned to 0.4.13: ``pip install 'diffquant[lmeval]'``) is an
optional dependency: importing this module does not import it, and everything that needs it says how to
install it in one line. :class:`DiffquantLM` (built on first use) is a ``TemplateLM`` over anything with
``model(ids (B, T)) -> logits (B, T, V)`` and ``model.config.max_seq_len`` (a :class:`DecoderLM`, with or
without a plan applied), reading text through the model's own tokenizer. It follows the conventions of
lm-eval's ``HFLM`` (``lm_eval/models/huggingface.py``), so the same checkpoint scores the same numbers
through either (tests/test_lmeval.py checks this against ``HFLM`` on a tiny Llama):

- encoding: ``tok_encode`` adds BOS in front exactly where the tokenizer would by default (HFLM calls the
  Hugging Face tokenizer with its default ``add_special_tokens``; diffquant's ``Tokenizer.add_bos`` is that
  default), and none to a string that already starts with the BOS token's text;
- ``prefix_token_id`` (what an empty context is conditioned on, and the first token of the first rolling
  window) is BOS when the tokenizer has one, else EOS; ``eot_token_id`` is EOS;
- ``loglikelihood``: TemplateLM splits each (context, continuation) pair; the requests are scored longest
  first (HFLM's order), right-padded within a batch (a causal model's logits at a position never depend
  on later tokens); a too long request loses context tokens on the left, never continuation tokens: the
  model reads ``(context + continuation)[-(max_length + 1):][:-1]`` and the continuation's log-probs are
  the last ``len(continuation)`` positions of that input; ``is_greedy`` says whether the argmax at every
  continuation position is the continuation token;
- ``loglikelihood_rolling``: disjoint windows of ``max_length`` tokens from
  ``lm_eval.utils.get_rolling_token_windows(..., prefix_token=prefix_token_id, context_len=1)`` through
  ``make_disjoint_window``, each scored as a loglikelihood request, summed per document;
- ``generate_until``: greedy; the context keeps its last ``max_length - max_gen_toks`` tokens; generation
  stops at EOS, at any ``until`` string (plus the EOS text, lm-eval's ``handle_stop_sequences``) or after
  ``max_gen_toks`` tokens, and the text is cut before the first stop string; decoding goes through the
  model's KV cache when it has one (``new_cache``), as HF's ``generate`` does. Sampling is refused.

``max_length`` defaults to the model's ``max_seq_len`` (HFLM reads ``max_position_embeddings``), capped at
the context the weights were trained at when a training card says so (as diffquant's text tasks do).

:func:`run_lmeval` runs ``lm_eval.simple_evaluate`` offline on such a model; diffquant's own task YAMLs in
``recipes/lmeval/`` (local-file LAMBADA, HellaSwag and WikiText) are always on the include path.
:func:`check_lmeval` refuses before lm-eval starts what can be refused: task YAMLs of an include path that
name Python (unless ``trust_task_code``), unknown task names, bad local data files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import _model_device
from diffquant.progress import progress as show_progress
from diffquant.shipped import LMEVAL_DIR
from diffquant.textfiles import (
    MAX_NESTING,
    MAX_TEXT_BYTES,
    MAX_YAML_BYTES,
    DepthLimitedLoader,
    YAMLRefused,
    check_nesting,
    nesting_error,
    read_bytes_bounded,
)

LMEVAL_VERSION = "0.4.13"
INSTALL_HINT = "pip install 'diffquant[lmeval]'"
RECIPE_TASKS = LMEVAL_DIR  # the task YAMLs installed with diffquant (a clone's recipes/lmeval links there)
_DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".raw": "text"}


def _require_lm_eval() -> Any:
    """The lm_eval package, or a one-line DiffquantError saying how to install it."""
    try:
        import lm_eval  # noqa: PLC0415 (optional library (lmeval extra))
    except ImportError as err:
        raise DiffquantError(
            f"lm-evaluation-harness is not installed ({err}); install it with {INSTALL_HINT}"
        ) from None
    return lm_eval


# ======================================================================================== task helpers
_TOP_HEADING = re.compile(r"^ ?= [^=](.*[^=])? = ?$")


def split_wikitext_articles(text: str) -> list[str]:
    """Raw WikiText (``wiki.test.raw``) -> one string per article, each starting at its top-level heading
    line ``" = Title = "`` (``" = = Section = = "`` lines stay inside). Text before the first heading is an
    article of its own when it is not blank; a text without headings is one article."""
    articles: list[list[str]] = [[]]
    for line in text.split("\n"):
        if _TOP_HEADING.match(line) and any(x.strip() for x in articles[-1]):
            articles.append([])
        articles[-1].append(line)
    return [a for a in ("\n".join(lines) for lines in articles) if a.strip()]


def wikitext_docs(dataset: Any) -> Any:
    """``process_docs`` of recipes/lmeval/wikitext_local.yaml: documents with a ``page`` field pass through;
    a raw text file (datasets' ``text`` builder, one record holding the whole file) is split into articles
    (:func:`split_wikitext_articles`), one ``page`` each."""
    if "page" in dataset.column_names:
        return dataset
    if "text" not in dataset.column_names:
        raise DiffquantError(
            f"wikitext_local: expected documents with a 'page' field (or raw text), got fields "
            f"{', '.join(dataset.column_names)}"
        )
    from datasets import Dataset  # noqa: PLC0415 (optional library (lmeval extra))

    pages = [p for record in dataset["text"] for p in split_wikitext_articles(record)]
    return Dataset.from_list([{"page": p} for p in pages])


def _special_text(tokenizer: Any, token_id: int | None) -> str | None:
    """The text a special token is written as (``"<|bos|>"``), where the tokenizer has such a form."""
    backend = getattr(tokenizer, "backend", None)
    if token_id is None or backend is None:
        return None
    text = backend.decode([int(token_id)], skip_special_tokens=False)
    return text or None


# ============================================================================================ the model
def _as_float_cpu(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` on the CPU in float32 (float64 kept): the positions a request scores, converted alone."""
    return (logits if logits.dtype == torch.float64 else logits.float()).cpu()


def _build_lm_class() -> type:
    _require_lm_eval()
    from lm_eval import utils as lm_utils  # noqa: PLC0415 (optional library (lmeval extra))
    from lm_eval.api.model import TemplateLM  # noqa: PLC0415 (optional library (lmeval extra))
    from lm_eval.models.utils import (  # noqa: PLC0415 (optional library (lmeval extra))
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )

    class DiffquantLM(TemplateLM):
        """A diffquant model as an lm-eval ``LM`` (see the module docstring for the conventions)."""

        backend = "causal"

        def __init__(
            self,
            model: Any,
            tokenizer: Tokenizer | str | Path | None = None,
            *,
            batch_size: int = 8,
            max_length: int | None = None,
            max_gen_toks: int = 256,
            progress: bool = False,
        ) -> None:
            super().__init__()
            if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
                raise DiffquantError(f"lm-eval: batch_size must be a positive integer, got {batch_size!r}")
            self.model = model
            self.dq_tokenizer = model_tokenizer(model, override=tokenizer)
            self.batch_size = batch_size
            limit = int(model.config.max_seq_len)
            trained = getattr(model, "trained_seq_len", None)
            if max_length is None:
                max_length = min(limit, trained or limit)
            if (
                not isinstance(max_length, int)
                or isinstance(max_length, bool)
                or not 2 <= max_length <= limit
            ):
                raise DiffquantError(
                    f"lm-eval: max_length must be an integer in [2, {limit}] (the model's max_seq_len), "
                    f"got {max_length!r}"
                )
            self._max_length = max_length
            self._max_gen_toks = max_gen_toks
            self._device = _model_device(model)
            self.progress = progress
            # loglikelihood's disable_tqdm, for the progress over the requests it hands on
            self._requests_quiet: bool | None = None
            self._bos_text = _special_text(self.dq_tokenizer, self.dq_tokenizer.bos_id)

        # ------------------------------------------------------------------------------ properties
        @property
        def eot_token_id(self) -> int:
            # HFLM: end of text is the tokenizer's EOS
            if self.dq_tokenizer.eos_id is None:
                raise DiffquantError(f"lm-eval: tokenizer {self.dq_tokenizer.name} has no EOS token")
            return self.dq_tokenizer.eos_id

        @property
        def prefix_token_id(self) -> int:
            # HFLM: BOS when the tokenizer has one, else EOS
            bos = self.dq_tokenizer.bos_id
            return bos if bos is not None else self.eot_token_id

        @property
        def max_length(self) -> int:
            return self._max_length

        @property
        def max_gen_toks(self) -> int:
            return self._max_gen_toks

        @property
        def tokenizer_name(self) -> str:
            return self.dq_tokenizer.fingerprint()[:16]

        def get_model_info(self) -> dict[str, Any]:
            cfg = self.model.config
            return {
                "model_attention": getattr(cfg, "attention", None),
                "model_max_length": self.max_length,
                "tokenizer": self.dq_tokenizer.describe(),
            }

        # ------------------------------------------------------------------------------ tokens
        def tok_encode(
            self,
            string: str,
            add_special_tokens: bool | None = None,
            left_truncate_len: int | None = None,
            **kwargs: Any,
        ) -> list[int]:
            tok = self.dq_tokenizer
            if add_special_tokens is None:  # HFLM: the tokenizer's default, none before an existing BOS
                bos = tok.add_bos and not (self._bos_text and string.startswith(self._bos_text))
            else:  # HF's add_special_tokens=True adds BOS only where the tokenizer is set to
                bos = bool(add_special_tokens) and tok.add_bos
            ids = tok.encode(string, bos=bos and tok.bos_id is not None)
            if left_truncate_len:
                ids = ids[-left_truncate_len:]
            return ids

        def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
            return self.dq_tokenizer.decode(tokens)

        # ------------------------------------------------------------------------------ scoring
        def _forward(self, rows: list[list[int]]) -> torch.Tensor:
            """Logits (B, T, V) for right-padded ``rows`` (pad id 0: any id the model has), as the model gives
            them (its device and dtype): callers take the few positions they score to the CPU as floats, so
            no float copy of the whole batch is made (a bf16 model's would double it)."""
            width = max(len(r) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            with torch.no_grad():
                return self.model(ids.to(self._device))

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            # TemplateLM splits the pairs (HFLM's _encode_pair) under a tokenizing bar of its own: off (it is
            # quick), the progress over the requests that follows is diffquant's
            self._requests_quiet = disable_tqdm
            try:
                return super().loglikelihood(requests, disable_tqdm=True)
            finally:
                self._requests_quiet = None

        def _requests_progress(
            self, total: int, what: str, disable_tqdm: bool, requests: list[Any] | None = None
        ) -> Any:
            """Progress over one call's requests, batch by batch (a line when it starts, then every few
            seconds off a terminal; a bar on one), named after lm-eval's request type; iterates over
            ``requests`` when given."""
            quiet = disable_tqdm if self._requests_quiet is None else self._requests_quiet
            bar = self.progress or None
            return show_progress(
                requests,
                total=total,
                desc=f"lm-eval {what}",
                unit="req",
                bar=bar,
                enabled=not quiet,
                leave=False,
                announce=True,
            )

        def _loglikelihood_tokens(
            self,
            requests: list[tuple[Any, list[int], list[int]]],
            disable_tqdm: bool = False,
            **kwargs: Any,
        ) -> list[tuple[float, bool]]:
            n = len(requests)
            # HFLM's order: longest (context + continuation) first, ties by the tokens themselves
            order = sorted(
                range(n),
                key=lambda i: (-len(requests[i][1] + requests[i][2]), tuple(requests[i][1] + requests[i][2])),
            )
            out: list[tuple[float, bool] | None] = [None] * n
            with self._requests_progress(n, "loglikelihood", disable_tqdm) as bar:
                for start in range(0, n, self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    inputs = []
                    for i in chunk:
                        _, context, continuation = requests[i]
                        if not context or not continuation:
                            raise DiffquantError("lm-eval: a request with an empty context or continuation")
                        if len(continuation) > self.max_length:
                            raise DiffquantError(
                                f"lm-eval: a continuation of {len(continuation)} tokens does not fit max_length "
                                f"{self.max_length}"
                            )
                        # HFLM: keep the last max_length + 1 tokens (context lost on the left), the model reads
                        # all but the last one (it is only a target)
                        inputs.append((context + continuation)[-(self.max_length + 1) :][:-1])
                    logits = self._forward(inputs)
                    for row, i in enumerate(chunk):
                        continuation = requests[i][2]
                        end = len(inputs[row])
                        # the positions predicting the continuation: the last len(continuation) of the input
                        scored = _as_float_cpu(logits[row, end - len(continuation) : end])
                        target = torch.tensor(continuation, dtype=torch.long)
                        logp = (
                            torch.log_softmax(scored.double(), dim=-1).gather(-1, target[:, None]).squeeze(-1)
                        )
                        answer = (float(logp.sum()), bool((scored.argmax(dim=-1) == target).all()))
                        out[i] = answer
                        if requests[i][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    # this batch's (B, T, V) logits go before the next forward allocates its own: held
                    # across it, two batches' logits (8 x 100 x 49k fp32: 160 MB each) were alive at once
                    del logits
                    bar.update(len(chunk))
            return out  # type: ignore[return-value]

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            windows: list[tuple[None, list[int], list[int]]] = []
            owner: list[int] = []
            for k, request in enumerate(requests):
                (string,) = request.args
                # HFLM: disjoint windows of max_length tokens, the first one predicted from prefix_token_id
                rolling = lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
                for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                    windows.append((None, context, continuation))
                    owner.append(k)
            scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
            totals = [0.0] * len(requests)
            for k, (loglik, _) in zip(owner, scores, strict=True):  # summed in window order, as HFLM
                totals[k] += loglik
            for request, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", tuple(request.args), total)
            return totals

        # ------------------------------------------------------------------------------ generation
        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            eos_text = _special_text(self.dq_tokenizer, self.dq_tokenizer.eos_id)
            has_cache = callable(getattr(self.model, "new_cache", None))
            results = []
            for request in self._requests_progress(len(requests), "generate_until", disable_tqdm, requests):
                context, gen_kwargs = request.args
                # HFLM: lm-eval's normalisation (max_gen_toks and its aliases; temperature > 0 means sampling)
                kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
                if kwargs.get("do_sample"):
                    raise DiffquantError(
                        "lm-eval: diffquant generates greedily; sampling (do_sample, temperature > 0) is not "
                        "supported"
                    )
                until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
                max_gen_toks = kwargs["max_gen_toks"]
                room = self.max_length - max_gen_toks
                if room < 1:
                    raise DiffquantError(
                        f"lm-eval: max_gen_toks {max_gen_toks} leaves no room for a context in max_length "
                        f"{self.max_length}"
                    )
                ids = self.tok_encode(context, left_truncate_len=room)  # HFLM: left-truncated context
                text = self._greedy(ids, max_gen_toks, until, has_cache)
                text = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return results

        def _greedy(self, ids: list[int], max_new: int, until: list[str], has_cache: bool) -> str:
            eos = self.dq_tokenizer.eos_id
            new: list[int] = []
            with torch.no_grad():
                prompt = torch.tensor([ids], dtype=torch.long, device=self._device)
                cache = self.model.new_cache() if has_cache else None
                logits = self.model(prompt, cache) if has_cache else self.model(prompt)
                for _ in range(max_new):
                    token = int(logits[0, -1].argmax())
                    if token == eos:
                        break
                    new.append(token)
                    if any(stop in self.dq_tokenizer.decode(new) for stop in until):
                        break
                    step = torch.tensor([[token]], dtype=torch.long, device=self._device)
                    if has_cache:
                        logits = self.model(step, cache)
                    else:
                        prompt = torch.cat([prompt, step], dim=1)
                        logits = self.model(prompt)
            return self.dq_tokenizer.decode(new)

    return DiffquantLM


_LM_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    """``DiffquantLM`` is built (and lm_eval imported) on first access."""
    global _LM_CLASS
    if name == "DiffquantLM":
        if _LM_CLASS is None:
            _LM_CLASS = _build_lm_class()
        return _LM_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ============================================================================ task YAMLs, read, never run
# lm-eval runs the Python a task YAML names: ``!function utils.process_docs`` imports utils.py from the
# YAML's folder (or any importable module), a ``class:`` key builds a Task class, and Jinja templates
# render in an unsandboxed environment. A task folder from elsewhere is therefore code, and, following
# transformers' ``trust_remote_code``, diffquant reads every YAML lm-eval would index under the include
# paths (with their ``include:`` chains) as data first and refuses one that names Python unless the user
# passes ``trust_task_code``. The YAMLs installed with diffquant (recipes/lmeval) and with lm-eval (its
# tasks folder) are code of installed packages, trusted like the packages themselves.
_CODE_TAGS = ("!function", "tag:yaml.org,2002:python/")  # what lm-eval's loaders would turn into Python
_CODE_KEYS = ("class",)  # TaskIndex: a 'class' key makes a Python task
_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # TaskIndex skips these folders


class _Code:
    """A YAML node lm-eval would resolve to Python (``!function x.y``): its tag and text, unresolved."""

    def __init__(self, tag: str, text: str) -> None:
        self.tag, self.text = tag, text

    def __repr__(self) -> str:
        return f"{self.tag} {self.text}".strip()


class _DataLoader(DepthLimitedLoader):
    """A YAML loader that constructs plain data only (nested at most MAX_NESTING deep); code tags become
    :class:`_Code` markers."""


def _code_node(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> _Code:
    text = loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else ""
    return _Code(node.tag, str(text))


for _tag in _CODE_TAGS:
    _DataLoader.add_multi_constructor(_tag, _code_node)


def _lm_eval_tasks_dir() -> Path | None:
    """lm-eval's own tasks folder, found without importing lm-eval."""
    import importlib.util  # noqa: PLC0415 (only to locate the optional package)

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "tasks"


def _trusted_roots() -> list[Path]:
    roots = [RECIPE_TASKS.resolve()]
    builtin = _lm_eval_tasks_dir()
    return roots + ([builtin] if builtin is not None else [])


def _is_under(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _code_in(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """(key path, what) for every place in a loaded YAML value that names Python."""
    if isinstance(value, _Code):
        yield where, repr(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}" if where else str(k)
            if str(k) in _CODE_KEYS:
                yield path, f"a '{k}' key ({v!r})"
            else:
                yield from _code_in(v, path)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _code_in(v, f"{where}[{i}]")


def _read_task_yaml(
    path: Path, trusted: list[Path], found: list[tuple[Path, str, str]], seen: frozenset[Path] = frozenset()
) -> dict[str, Any] | None:
    """One task YAML as lm-eval's loader merges it (``include:`` files first, its own keys win), read as
    data; appends (file, key, what) to ``found`` for every key of an untrusted file that names Python.
    None where lm-eval's index would skip the file (unreadable, not a mapping, a missing include, a cycle)."""
    path = path.expanduser().resolve()
    if path in seen or not path.exists():
        return None
    # read bounded: a FIFO, a device or a huge file named *.yaml is refused (lm-eval would hang reading it)
    data = read_bytes_bounded(path, MAX_YAML_BYTES, "YAML task file (lm-eval)")
    try:
        cfg = yaml.load(data, Loader=_DataLoader)  # noqa: S506 (a SafeLoader subclass)
    except YAMLRefused as err:  # lm-eval's own loader would recurse past Python's limit on it
        raise DiffquantError(f"lm-eval task file {path}: {err}") from None
    except yaml.YAMLError:
        return None
    if not isinstance(cfg, dict):
        return None
    if not _is_under(path, trusted):
        found.extend((path, key_path, what) for key_path, what in _code_in(cfg, ""))
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict[str, Any] = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        if not isinstance(inc, str):
            return None
        inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / inc
        inc_cfg = _read_task_yaml(inc_path, trusted, found, seen | {path})
        if inc_cfg is None:
            return None
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
    return {**merged, **cfg}


def _yaml_files(root: Path) -> list[Path]:
    """The YAMLs lm-eval's TaskIndex reads under ``root`` (``**/*.yaml``, sorted)."""
    return sorted(
        (p for p in root.glob("**/*.yaml") if not any(part in _IGNORE_DIRS for part in p.parts)),
        key=lambda p: p.as_posix(),
    )


def _entry_names(cfg: dict[str, Any]) -> list[str]:
    """The names a merged config adds to lm-eval's index (TaskIndex.process_cfg): its task or group, and
    its tags."""
    if "class" in cfg or ("group" not in cfg and "task" in cfg):
        names = [cfg.get("task")]
    elif "group" in cfg:
        names = [cfg["group"]]
    else:
        return []
    if "group" not in cfg or "class" in cfg:
        tags = cfg.get("tag")
        names += tags if isinstance(tags, list) else [tags]
    return [n for n in names if isinstance(n, str) and n]


@dataclass
class _LocalTasks:
    """The task YAMLs under the include paths, read as data: each name's merged config and file."""

    configs: dict[str, tuple[dict[str, Any], Path]]
    found: list[tuple[Path, str, str]]  # (file, key, what) of every key naming Python, untrusted files only


def _scan_include_paths(paths: list[Path]) -> _LocalTasks:
    trusted = _trusted_roots()
    configs: dict[str, tuple[dict[str, Any], Path]] = {}
    found: list[tuple[Path, str, str]] = []
    for root in paths:
        for file in _yaml_files(root):
            cfg = _read_task_yaml(file, trusted, found)
            for name in [] if cfg is None else _entry_names(cfg):
                configs[name] = (cfg, file.resolve())  # later paths override earlier ones, as in lm-eval
    return _LocalTasks(configs, found)


def _refuse_task_code(found: list[tuple[Path, str, str]]) -> None:
    if not found:
        return
    file, key_path, what = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise DiffquantError(
        f"lm-eval task file {file}: '{key_path}' names Python code ({what}){more}, which lm-eval would run; "
        f"if you trust the folder {file.parent}, pass trust_task_code=true with the task "
        "(--task lmeval:...,trust_task_code=true, or trust_task_code: true in a recipe task)"
    )


# a task / group / tag key and its value (a flow list, a scalar, or nothing: a block list follows)
_NAME_LINE = re.compile(r"""^\s*(?:-\s+)?(["']?)(?:task|group|tag)\1\s*:[ \t]*(.*?)\s*$""")
_LIST_ITEM = re.compile(r"^\s*-\s+(.*?)\s*$")
_NOT_YAML = (".py", ".pyc", ".md")


def _scalar_names(text: str) -> list[str]:
    text = text.split(" #", 1)[0].strip()
    items = text[1:-1].split(",") if text.startswith("[") and text.endswith("]") else [text]
    return [i.strip().strip("'\"") for i in items if i.strip().strip("'\"")]


@functools.lru_cache(maxsize=2)
def _builtin_names(root: Path) -> frozenset[str]:
    """Every name lm-eval's own tasks folder could index, read from the files' ``task:`` / ``group:`` /
    ``tag:`` lines without building a TaskManager (seconds instead of minutes). A superset: a name that is
    not here is not an lm-eval task; one that is may still turn out to be a fragment of another file."""
    names: set[str] = set()
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _IGNORE_DIRS]
        for file in files:
            if file.endswith(_NOT_YAML):  # included templates have any name (_template_yaml, naijarc)
                continue
            block = False
            for line in Path(dirpath, file).read_text(encoding="utf-8", errors="replace").splitlines():
                match = _NAME_LINE.match(line)
                if match:
                    names.update(_scalar_names(match.group(2)))
                    block = not match.group(2)
                elif block and (item := _LIST_ITEM.match(line)):
                    names.update(_scalar_names(item.group(1)))
                elif line.strip() and not line.lstrip().startswith("#"):
                    block = False
    return frozenset(names)


def _refuse_unknown(names: list[str], local: _LocalTasks) -> None:
    """An unknown task name, refused before lm-eval indexes its thousands of files."""
    missing = [n for n in names if n not in local.configs]
    if not missing:
        return
    builtin = _lm_eval_tasks_dir()
    known = _builtin_names(builtin) if builtin is not None and builtin.is_dir() else frozenset()
    unknown = [n for n in missing if n not in known]
    if unknown:
        raise DiffquantError(
            f"lm-eval: unknown task {unknown[0]!r} (not in lm-eval {LMEVAL_VERSION}, recipes/lmeval or the "
            "include_path)"
        )


# ======================================================================= local data files, checked first
def _is_label(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v.strip().isdigit())


def _is_strings(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v)


_STRING = (lambda v: isinstance(v, str), "a string")
# the fields each shipped task reads from a record (before its process_docs), with their types
SHIPPED_FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "lambada_local": {"text": _STRING},
    "hellaswag_local": {
        "activity_label": _STRING,
        "ctx_a": _STRING,
        "ctx_b": _STRING,
        "endings": (_is_strings, "a non-empty list of strings"),
        "label": (lambda v: _is_label(v), "the index of the right ending (0, 1, ... or '0', '1', ...)"),
    },
    "wikitext_local": {"page": _STRING},
}
_READS_RAW_TEXT = ("wikitext_local",)  # its process_docs (wikitext_docs) splits raw text into pages
_TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice")
_ANY = (lambda v: True, "")


def _task_fields(name: str, cfg: dict[str, Any], yaml_path: Path | None) -> dict[str, tuple[Any, str]]:
    """The fields a task reads from each record: declared for the shipped tasks, else the variables its
    Jinja templates name (none known when a process_docs or a Python class reshapes the records first)."""
    shipped = yaml_path is not None and _is_under(Path(yaml_path).resolve(), [RECIPE_TASKS.resolve()])
    if shipped and name in SHIPPED_FIELDS:
        return SHIPPED_FIELDS[name]
    if "process_docs" in cfg or "class" in cfg:
        return {}
    import jinja2  # noqa: PLC0415 (comes with lm-eval; only to read templates)
    from jinja2 import meta  # noqa: PLC0415 (comes with lm-eval; only to read templates)

    env = jinja2.Environment()
    keys = [*_TEMPLATE_KEYS, *(["doc_to_decontamination_query"] if cfg.get("should_decontaminate") else [])]
    fields: dict[str, tuple[Any, str]] = {}
    for k in keys:
        template = cfg.get(k)
        if not isinstance(template, str) or ("{{" not in template and "{%" not in template):
            continue  # a field name, a literal or a function: nothing certain to require
        try:
            names = meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateSyntaxError:
            continue  # lm-eval will say so itself (run_lmeval turns it into one line)
        except RecursionError:  # nested past what Jinja's parser (and lm-eval's) can read
            raise nesting_error(f"lm-eval task {name}: {k}", MAX_NESTING + 1, "its Jinja template") from None
        fields.update({n: _ANY for n in sorted(names) if n not in env.globals})
    return fields


def _json_type(v: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list"}
    return "null" if v is None else names.get(type(v), "an object")


def _json(text: str, where: str) -> Any:
    """``json.loads`` nested at most MAX_NESTING deep (deeper is a one-line error, not a RecursionError);
    invalid JSON raises JSONDecodeError for the caller (a .json file may be JSON lines)."""
    try:
        return check_nesting(json.loads(text), where)
    except RecursionError:
        raise nesting_error(where, MAX_NESTING + 1) from None


def check_data_file(name: str, path: str | Path, cfg: dict[str, Any], yaml_path: Path | None) -> Path:
    """``path`` as the local data file of task ``name`` (its merged config ``cfg``): it exists, has a
    suffix lm-eval's file builders read, is UTF-8, is not empty and, for JSON, every line is an object
    with the fields the task reads (:func:`_task_fields`). One-line DiffquantError naming file, line and
    field, before lm-eval (whose errors here are tracebacks from deep inside datasets) reads it."""
    file = Path(path).expanduser().resolve()
    if not file.exists():
        raise DiffquantError(f"lm-eval task {name}: data file {str(path)!r} does not exist")
    builder = _DATA_SUFFIXES.get(file.suffix.lower())
    if builder is None:
        raise DiffquantError(
            f"lm-eval task {name}: data file {str(path)!r}: expected {', '.join(_DATA_SUFFIXES)} (JSON lines or text)"
        )
    where = f"lm-eval task {name}: data file {file}"
    try:  # a regular file of at most MAX_TEXT_BYTES (a FIFO or /dev/zero is refused, not read forever)
        raw = read_bytes_bounded(file, MAX_TEXT_BYTES, "data file")
    except DiffquantError as err:
        raise DiffquantError(f"lm-eval task {name}: {err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DiffquantError(f"{where}: line {line}: not UTF-8 text (byte {err.start})") from None
    fields = _task_fields(name, cfg, yaml_path)
    if builder == "text":
        if not text.strip():
            raise DiffquantError(f"{where} is empty (expected text)")
        needed = [f for f in fields if f != "text"]
        if needed and not (name in _READS_RAW_TEXT and fields is SHIPPED_FIELDS.get(name)):
            raise DiffquantError(
                f"{where}: a text file gives records with one field 'text'; task {name} reads "
                f"{', '.join(fields)}: give a JSON lines file"
            )
        return file
    records: list[tuple[str, Any]] = []
    whole: Any = None
    if file.suffix.lower() == ".json":
        try:
            whole = _json(text, where)
        except json.JSONDecodeError:
            whole = None  # JSON lines
        if isinstance(whole, list):
            records = [(f"record {i + 1}", r) for i, r in enumerate(whole)]
        elif isinstance(whole, dict):
            records = [("record 1", whole)]
    if whole is None:
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # datasets skips blank lines
            try:
                records.append((f"line {n}", _json(line, f"{where}: line {n}")))
            except json.JSONDecodeError as err:
                raise DiffquantError(
                    f"{where}: line {n}: not valid JSON ({err.msg}, column {err.colno})"
                ) from None
    if not records:
        raise DiffquantError(f"{where} is empty (expected one JSON object per line)")
    for at, record in records:
        if not isinstance(record, dict):
            raise DiffquantError(f"{where}: {at}: expected a JSON object, got {_json_type(record)}")
        for field, (ok, expected) in fields.items():
            if field not in record:
                have = ", ".join(record) or "none"
                raise DiffquantError(
                    f"{where}: {at}: no field '{field}' (task {name} reads {', '.join(fields)}; this one has {have})"
                )
            if not ok(record[field]):
                raise DiffquantError(
                    f"{where}: {at}: field '{field}' must be {expected}, got {_json_type(record[field])}"
                )
    return file


# ========================================================================================== evaluation
@contextlib.contextmanager
def _run_progress(names: list[str], bar: bool) -> Iterator[None]:
    """One lm-eval run as a step of its own: a line when it starts and one every few seconds off a terminal
    while nothing inside reports (loading the tasks' data), closed when it ends. lm-eval's own tqdm over the
    documents it builds requests from is replaced by diffquant's progress for the time, and the bars of
    datasets (reading a task's files) are off: both drew ``\r`` bars even into a log file."""
    import datasets.utils as ds_utils  # noqa: PLC0415 (comes with lm-eval)
    import lm_eval.api.task as task_module  # noqa: PLC0415 (optional library (lmeval extra))

    def contexts(iterable: Any = None, total: int | None = None, **_: Any) -> Any:
        return show_progress(iterable, "lm-eval contexts", "doc", total=total, bar=bar or None, leave=False)

    saved = getattr(task_module, "tqdm", None)
    if saved is not None:
        task_module.tqdm = contexts
    bars_were_on = not ds_utils.are_progress_bars_disabled()
    ds_utils.disable_progress_bars()
    try:
        with show_progress(
            total=len(names), desc=f"lm-eval {'+'.join(names)}", unit="task", bar=bar or None, announce=True
        ) as run:
            yield
            run.update(len(names))
    finally:
        if saved is not None:
            task_module.tqdm = saved
        if bars_were_on:
            ds_utils.enable_progress_bars()


@contextlib.contextmanager
def _offline_single_process() -> Iterator[None]:
    """Datasets offline (local files only, no hub look-ups), and LOCAL_RANK 0 so lm-eval returns results in
    every process of a distributed sweep (each rank evaluates its own cells)."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "LOCAL_RANK")}
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    import datasets.config as ds_config  # noqa: PLC0415 (optional library (lmeval extra))

    flags = {k: getattr(ds_config, k, None) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for key in flags:
        setattr(ds_config, key, True)
    try:
        yield
    finally:
        for key, value in flags.items():
            setattr(ds_config, key, value)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _include_paths(include_path: str | Path | list[str | Path] | None) -> list[Path]:
    extra = [] if include_path is None else include_path if isinstance(include_path, list) else [include_path]
    paths = [RECIPE_TASKS] if RECIPE_TASKS.is_dir() else []
    for p in extra:
        path = Path(p).expanduser()
        if not path.exists():
            raise DiffquantError(f"lm-eval include_path {str(p)!r}: no such file or folder")
        paths.append(path)
    return paths


@functools.lru_cache(maxsize=4)
def _full_task_manager(paths: tuple[str, ...]) -> Any:
    """lm-eval's own tasks and those under ``paths``; kept, since indexing lm-eval's thousands of task files
    takes seconds and a sweep asks once per cell (the index only names files: tasks are built per run)."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (optional library (lmeval extra))

    return TaskManager(include_path=list(paths) or None)


def _task_manager(names: list[str], paths: list[Path], local: _LocalTasks) -> Any:
    """A TaskManager that knows ``names``: the include paths alone when they define them all, else lm-eval's
    tasks too (names already checked by :func:`check_lmeval`)."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (optional library (lmeval extra))

    if paths and all(n in local.configs for n in names):
        manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
        if all(n in manager.task_index for n in names):
            return manager
    manager = _full_task_manager(tuple(str(p.resolve()) for p in paths))
    unknown = [n for n in names if n not in manager.task_index]
    if unknown:
        raise DiffquantError(
            f"lm-eval: unknown task {unknown[0]!r} (not in lm-eval {LMEVAL_VERSION}, recipes/lmeval or the "
            "include_path)"
        )
    return manager


def _data_files(names: list[str], data_files: str | Path | dict[str, str | Path] | None) -> dict[str, Any]:
    """``data_files`` as ``{task: file}``: one path for a single task, or a mapping over the tasks."""
    if data_files is None:
        return {}
    if isinstance(data_files, dict):
        stray = [k for k in data_files if k not in names]
        if stray:
            raise DiffquantError(
                f"lm-eval: data file given for {stray[0]!r}, which is not among the tasks {names}"
            )
        return dict(data_files)
    if len(names) != 1:
        raise DiffquantError(
            f"lm-eval: one data file for {len(names)} tasks; give a mapping {{task: file}} (or one task per --task)"
        )
    return {names[0]: data_files}


def check_lmeval(
    tasks: list[str],
    *,
    include_path: str | Path | list[str | Path] | None = None,
    data_files: str | Path | dict[str, str | Path] | None = None,
    trust_task_code: bool = False,
) -> _LocalTasks:
    """Everything about an lm-eval run that can be refused before lm-eval starts, in one line each: the
    task YAMLs under the include paths are read as data (with their ``include:`` chains) and one that
    names Python (``!function``, a ``class:`` key, a ``!!python/`` tag) is refused unless
    ``trust_task_code``; an unknown task name is refused without indexing lm-eval's thousands of files;
    a local data file of a task defined there is checked against the fields the task reads
    (:func:`check_data_file`). Returns the include paths' tasks."""
    _require_lm_eval()
    names = [str(t) for t in ([tasks] if isinstance(tasks, str) else tasks)]
    if not names or not all(names):
        raise DiffquantError("lm-eval: no task names")
    files = _data_files(names, data_files)
    local = _scan_include_paths(_include_paths(include_path))
    if not trust_task_code:
        _refuse_task_code(local.found)
    _refuse_unknown(names, local)
    for name, path in files.items():
        if name in local.configs:
            cfg, yaml_path = local.configs[name]
            check_data_file(name, path, cfg, yaml_path)
    return local


def _data_override(name: str, path: str | Path, manager: Any) -> dict[str, Any]:
    """Task ``name`` reading the local file ``path`` as its test split (JSON lines, or text: lines, or the
    whole file for a rolling task), as an inline config: the task's YAML as lm-eval loads it (includes
    merged, functions resolved) with the dataset keys replaced. Nothing is written, so nothing is left
    behind when a run is killed."""
    from lm_eval.tasks._yaml_loader import load_yaml  # noqa: PLC0415 (optional library (lmeval extra))

    entry = manager.task_index[name]
    if entry.yaml_path is None or entry.cfg is None or "task" not in entry.cfg or "group" in entry.cfg:
        raise DiffquantError(f"lm-eval: {name!r} is a group or tag; a data file override needs a single task")
    file = check_data_file(name, path, entry.cfg, entry.yaml_path)
    builder = _DATA_SUFFIXES[file.suffix.lower()]
    kwargs: dict[str, Any] = {"data_files": {"test": str(file)}}
    if builder == "text":
        rolling = entry.cfg.get("output_type") == "loglikelihood_rolling"
        kwargs["sample_by"] = "document" if rolling else "line"
    cfg = load_yaml(entry.yaml_path, resolve_func=True)  # what lm-eval's factory reads for a named task
    return {
        **cfg,
        "task": name,
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": kwargs,
        "test_split": "test",  # the file is the evaluated split; few-shot examples come from it too
        "validation_split": None,
        "training_split": None,
        "fewshot_split": None,
    }


@contextlib.contextmanager
def _sandboxed_templates(enabled: bool) -> Iterator[None]:
    """lm-eval renders task templates with a plain Jinja environment, in which a template can reach
    Python (``{{ cycler.__init__.__globals__ }}``); while ``enabled``, it renders them in Jinja's sandbox,
    which refuses such attributes (``SecurityError``). Templates of trusted task folders need neither."""
    if not enabled:
        yield
        return
    from jinja2.sandbox import SandboxedEnvironment  # noqa: PLC0415 (comes with lm-eval)
    from lm_eval import utils as lm_utils  # noqa: PLC0415 (optional library (lmeval extra))

    plain = lm_utils.env
    sandbox = SandboxedEnvironment(
        loader=plain.loader, undefined=plain.undefined, keep_trailing_newline=plain.keep_trailing_newline
    )
    sandbox.filters.update(plain.filters)
    lm_utils.env = sandbox
    try:
        yield
    finally:
        lm_utils.env = plain


def _from_template(err: BaseException) -> bool:
    """Whether ``err`` was raised while a Jinja template ran (a frame of a compiled template, or of jinja2
    itself: the sandbox's ``range`` raises OverflowError), not by the model or lm-eval's own code."""
    tb = err.__traceback__
    while tb is not None:
        file = tb.tb_frame.f_code.co_filename
        if file == "<template>" or f"{os.sep}jinja2{os.sep}" in file:
            return True
        tb = tb.tb_next
    return False


def template_refusal(err: BaseException) -> str:
    """The one line for any error of a task's Jinja template (syntax, an undefined or blocked attribute,
    the sandbox refusing Python or a huge range, nesting past the parser's recursion)."""
    text = " ".join(str(err).split())[:200] or "no message"
    return (
        f"lm-eval: a task template was refused or failed to render ({type(err).__name__}: {text}); templates "
        "from an include_path render in Jinja's sandbox unless the task passes trust_task_code=true"
    )


def _metrics(task_results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": x, "acc_stderr": s}``:
    numbers only (a stderr lm-eval could not compute, "N/A", is left out); a filter other than ``none``
    is kept as ``metric[filter]``."""
    out: dict[str, Any] = {}
    for key, value in task_results.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        out[metric if filt == "none" else f"{metric}[{filt}]"] = float(value)
    return out


def run_lmeval(
    model: Any,
    tasks: list[str],
    *,
    include_path: str | Path | list[str | Path] | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    tokenizer: Any = None,
    data_files: str | Path | dict[str, str | Path] | None = None,
    max_length: int | None = None,
    bootstrap_iters: int = 1000,
    progress: bool = False,
    trust_task_code: bool = False,
) -> dict[str, dict[str, Any]]:
    """Evaluate ``model`` on lm-eval ``tasks`` offline; ``{task: {metric: float, ..., "n_samples": int}}``.

    ``model`` is a diffquant model (wrapped in :class:`DiffquantLM` with ``tokenizer``, ``batch_size`` and
    ``max_length``), or an lm-eval ``LM`` used as it is (lm-eval's own ``HFLM`` for a reference run).

    Every task (and group) lm-eval reports is a key, with its metrics as lm-eval names them (``acc``,
    ``acc_norm``, ``perplexity``, ``word_perplexity``, ``bits_per_byte``, ...), their standard errors
    (``acc_stderr``, ... where lm-eval computes one; ``bootstrap_iters`` 0 skips them) and the number of
    documents scored. ``data_files`` points tasks at local files: one path for a single task, or
    ``{task: path}``. recipes/lmeval/ (``lambada_local``, ``hellaswag_local``, ``wikitext_local``) is
    always on the include path, before ``include_path``. ``limit`` scores the first N documents of each
    task; ``num_fewshot`` overrides the tasks' few-shot count. Task YAMLs under ``include_path`` that
    name Python are refused, and their templates render in Jinja's sandbox, unless ``trust_task_code``
    (see :func:`check_lmeval`).
    """
    lm_eval = _require_lm_eval()
    names = [str(t) for t in ([tasks] if isinstance(tasks, str) else tasks)]
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise DiffquantError(f"lm-eval: limit must be a positive integer, got {limit!r}")
    local = check_lmeval(
        names, include_path=include_path, data_files=data_files, trust_task_code=trust_task_code
    )
    files = _data_files(names, data_files)
    paths = _include_paths(include_path)
    from jinja2.exceptions import TemplateError  # noqa: PLC0415 (comes with lm-eval)
    from lm_eval.api.model import LM  # noqa: PLC0415 (optional library (lmeval extra))

    if isinstance(model, LM):  # a ready lm-eval model (e.g. HFLM, to compare against): used as it is
        lm = model
    else:
        lm = __getattr__("DiffquantLM")(
            model, tokenizer, batch_size=batch_size, max_length=max_length, progress=progress
        )
    untrusted = not trust_task_code and any(p.resolve() != RECIPE_TASKS.resolve() for p in paths)
    with _offline_single_process(), _run_progress(names, progress):
        manager = _task_manager(names, paths, local)
        specs = [_data_override(n, files[n], manager) if n in files else n for n in names]
        try:
            with _sandboxed_templates(untrusted):
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=specs,
                    num_fewshot=num_fewshot,
                    limit=limit,
                    batch_size=batch_size,
                    bootstrap_iters=bootstrap_iters,
                    log_samples=False,
                    task_manager=manager,
                    random_seed=None,  # leave the caller's global RNGs alone (scoring is deterministic)
                    numpy_random_seed=None,
                    torch_random_seed=None,
                )
        except FileNotFoundError as err:
            raise DiffquantError(
                f"lm-eval: a task's data file is missing ({str(err).splitlines()[0] if str(err) else err}); "
                "point the task at a file with path=FILE"
            ) from None
        except (TemplateError, OverflowError, RecursionError) as err:
            # every Jinja error is one refusal: the sandbox's SecurityError, UndefinedError of an attribute
            # chain it blocks, its OverflowError for range(100000000), a template nested too deep
            if not isinstance(err, TemplateError) and not _from_template(err):
                raise
            raise DiffquantError(template_refusal(err)) from None
    if out is None:
        raise DiffquantError("lm-eval: simple_evaluate returned no results")
    counts = out.get("n-samples", {})
    results: dict[str, dict[str, Any]] = {}
    for task, values in out["results"].items():
        metrics = _metrics(values)
        if task in counts:
            metrics["n_samples"] = int(counts[task].get("effective", counts[task].get("original", 0)))
        results[task] = metrics
    return results
