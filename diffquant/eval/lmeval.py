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
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from diffquant.data.tokenizer import Tokenizer, model_tokenizer
from diffquant.errors import DiffquantError
from diffquant.eval.perplexity import _model_device

LMEVAL_VERSION = "0.4.13"
INSTALL_HINT = "pip install 'diffquant[lmeval]'"
RECIPE_TASKS = Path(__file__).resolve().parents[2] / "recipes" / "lmeval"
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
def _build_lm_class() -> type:
    _require_lm_eval()
    from lm_eval import utils as lm_utils  # noqa: PLC0415 (optional library (lmeval extra))
    from lm_eval.api.model import TemplateLM  # noqa: PLC0415 (optional library (lmeval extra))
    from lm_eval.models.utils import (  # noqa: PLC0415 (optional library (lmeval extra))
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from tqdm import tqdm  # noqa: PLC0415 (imported when a bar is shown)

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
            """Float logits (B, T, V) on the CPU for right-padded ``rows`` (pad id 0: any id the model has)."""
            width = max(len(r) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            with torch.no_grad():
                logits = self.model(ids.to(self._device))
            return (logits if logits.dtype == torch.float64 else logits.float()).cpu()

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            # TemplateLM splits the pairs (HFLM's _encode_pair); its tokenizing bar only with progress on
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

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
            bar = tqdm(total=n, desc="loglikelihood", disable=disable_tqdm or not self.progress)
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
                    scored = logits[row, end - len(continuation) : end]
                    target = torch.tensor(continuation, dtype=torch.long)
                    logp = torch.log_softmax(scored.double(), dim=-1).gather(-1, target[:, None]).squeeze(-1)
                    answer = (float(logp.sum()), bool((scored.argmax(dim=-1) == target).all()))
                    out[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(chunk))
            bar.close()
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
            for request in tqdm(requests, desc="generate", disable=disable_tqdm or not self.progress):
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


# ========================================================================================== evaluation
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


def _task_manager(names: list[str], paths: list[Path]) -> Any:
    """A TaskManager that knows ``names``: the include paths alone when they define them all, else lm-eval's
    tasks too."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (optional library (lmeval extra))

    local = TaskManager(include_path=[str(p) for p in paths], include_defaults=False) if paths else None
    if local is not None and all(n in local.task_index for n in names):
        return local
    manager = _full_task_manager(tuple(str(p.resolve()) for p in paths))
    unknown = [n for n in names if n not in manager.task_index]
    if unknown:
        raise DiffquantError(
            f"lm-eval: unknown task {unknown[0]!r} (not in lm-eval {LMEVAL_VERSION}, recipes/lmeval or the "
            "include_path)"
        )
    return manager


def _data_override(name: str, path: str | Path, manager: Any, folder: Path) -> str:
    """A task YAML in ``folder`` that is task ``name`` reading the local file ``path`` as its test split
    (JSON lines, or text: lines, or the whole file for a rolling task); returns its path (a task spec)."""
    entry = manager.task_index[name]
    if entry.yaml_path is None or entry.cfg is None or "task" not in entry.cfg:
        raise DiffquantError(f"lm-eval: {name!r} is a group or tag; a data file override needs a single task")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise DiffquantError(f"lm-eval task {name}: data file {str(path)!r} does not exist")
    builder = _DATA_SUFFIXES.get(file.suffix.lower())
    if builder is None:
        raise DiffquantError(
            f"lm-eval task {name}: data file {str(path)!r}: expected {', '.join(_DATA_SUFFIXES)} (JSON lines or text)"
        )
    kwargs: dict[str, Any] = {"data_files": {"test": str(file)}}
    if builder == "text":
        rolling = entry.cfg.get("output_type") == "loglikelihood_rolling"
        kwargs["sample_by"] = "document" if rolling else "line"
    override = {
        "include": str(Path(entry.yaml_path).resolve()),
        "task": name,
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": kwargs,
        "test_split": "test",  # the file is the evaluated split; few-shot examples come from it too
        "validation_split": None,
        "training_split": None,
        "fewshot_split": None,
    }
    out = folder / f"{name}.yaml"
    out.write_text(yaml.safe_dump(override, sort_keys=False))
    return str(out)


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
    task; ``num_fewshot`` overrides the tasks' few-shot count.
    """
    lm_eval = _require_lm_eval()
    if isinstance(tasks, str):
        tasks = [tasks]
    names = [str(t) for t in tasks]
    if not names or not all(names):
        raise DiffquantError("lm-eval: no task names")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise DiffquantError(f"lm-eval: limit must be a positive integer, got {limit!r}")
    if data_files is None:
        files: dict[str, str | Path] = {}
    elif isinstance(data_files, dict):
        files = dict(data_files)
        stray = [k for k in files if k not in names]
        if stray:
            raise DiffquantError(
                f"lm-eval: data file given for {stray[0]!r}, which is not among the tasks {names}"
            )
    else:
        if len(names) != 1:
            raise DiffquantError(
                f"lm-eval: one data file for {len(names)} tasks; give a mapping {{task: file}} (or one task per --task)"
            )
        files = {names[0]: data_files}
    from lm_eval.api.model import LM  # noqa: PLC0415 (optional library (lmeval extra))

    if isinstance(model, LM):  # a ready lm-eval model (e.g. HFLM, to compare against): used as it is
        lm = model
    else:
        lm = __getattr__("DiffquantLM")(
            model, tokenizer, batch_size=batch_size, max_length=max_length, progress=progress
        )
    with _offline_single_process(), tempfile.TemporaryDirectory(prefix="diffquant-lmeval-") as tmp:
        manager = _task_manager(names, _include_paths(include_path))
        specs = [_data_override(n, files[n], manager, Path(tmp)) if n in files else n for n in names]
        try:
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
