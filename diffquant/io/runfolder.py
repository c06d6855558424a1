"""One run per run folder: :func:`claim_run_folder` locks a folder for a command and refuses another run's.

A run folder collects what one command wrote (manifest, profile tables, sweep cells, report). Two runs
mixed in one folder produce a report that silently combines them, so every command that writes a run
folder claims it first::

    with claim_run_folder(out, "profile", identity, force=args.force):
        ...  # write the run's artifacts

The claim

* takes an exclusive, non-blocking ``fcntl.flock`` on ``out/.diffquant-run.lock`` (holding the owner's
  pid), so a second concurrent run into the same folder stops at once with "OUT is in use by another run
  (pid N)"; the lock is released when the block exits, and by the kernel when the process dies (a killed
  run never leaves a stale lock);
* records ``{"command", "identity"}`` in ``out/.diffquant-run.json``; the same command with the same
  identity may come back (a sweep resumes, a profile rewrites its own files), while a folder recorded for
  another command or identity, or one holding run artifacts with no record (``manifest.json``,
  ``sweep.json``, ``cells-rank*.jsonl`` written without a claim), is refused with one line suggesting
  another ``--out`` or ``--force``;
* with ``force`` starts clean: everything in a folder recognised as a run folder is removed (the lock file
  excepted) before the new record is written. A folder that holds none of the markers above is not a run
  folder: its files are left alone, force or not.

An ``--out`` that is a symbolic link, or that is (or lies inside) a checkpoint folder or one of the run's
inputs, is refused in one line, force or not: the run's files would land in the folder the link points at,
beside (and with ``force`` in place of) a model.

Writers of a checkpoint folder (``quantize``, whole or streamed, ``init``, ``export``) take the same lock
through :func:`claim_checkpoint_folder`: a second writer into the same ``--out`` stops at once with "in use by
another run", and a folder that appeared since the first check is refused unless ``force``; the checkpoint
is then renamed into place (:func:`~diffquant.io.artifacts.write_folder_atomic`), so it holds no claim files.

Under ``torchrun`` only rank 0 claims (other ranks get a no-op), so the caller still synchronises ranks
after the claim where they write into the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diffquant.distributed import rank_and_world
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import spec_path, write_text_atomic
from diffquant.names import CONFIG_FILE, INDEX_FILE, PLAN_FILE, WEIGHTS_FILE
from diffquant.textfiles import MAX_CONFIG_BYTES, MAX_JSON_BYTES, read_json

RECORD_FILE = ".diffquant-run.json"
LOCK_FILE = ".diffquant-run.lock"
# Artifacts that make a folder a run folder even without a claim record (runs from before claims).
MARKERS = ("manifest.json", "sweep.json")
_HINT = "use another --out, or --force to start clean"


@contextmanager
def claim_run_folder(
    out: str | Path, command: str, identity: Any, force: bool = False, inputs: Iterable[str | Path] = ()
) -> Iterator[Path]:
    """Claim ``out`` for the run of ``command`` described by ``identity`` (JSON-able: what decides its
    results, e.g. a sweep's specifiers or a recipe) for the duration of the ``with`` block; yields the
    folder (created if missing). ``inputs``: the model specifiers (or files) the run reads, which ``out``
    must neither be nor hold nor lie in. See the module docstring for what is refused, what force removes,
    and the lock."""
    out = Path(out)
    if rank_and_world()[0] != 0:
        yield out
        return
    check_run_target(out, inputs)
    _make(out)
    fd = _lock(out)
    try:
        wanted = json.loads(json.dumps(identity, sort_keys=True, default=str))  # Paths, tuples -> JSON
        reason = _foreign(out, command, wanted)
        if force:
            if _is_run_folder(out):  # never empty a folder this package did not write a run into
                _clean(out)
        elif reason is not None:
            raise DiffquantError(f"{out}: {reason}; {_HINT}")
        record = {"command": command, "identity": wanted}
        write_text_atomic(out / RECORD_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")
        yield out
    finally:
        _unlock(fd)


@contextmanager
def claim_checkpoint_folder(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Claim ``out`` for writing a checkpoint folder into it, with the lock :func:`claim_run_folder` takes:
    a concurrent writer (or run) into ``out`` is refused at once, in one line, instead of both writing and
    the later rename silently replacing the earlier checkpoint. Under the lock ``out`` must hold nothing
    but the claim's lock (it is created for it), unless ``force``. The caller writes the checkpoint with
    :func:`~diffquant.io.artifacts.write_folder_atomic` and ``overwrite=True`` (the claimed folder exists);
    the lock file is removed when the block exits, and a folder the claim created and nothing filled is
    removed too."""
    out = Path(out)
    if rank_and_world()[0] != 0:
        yield out
        return
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        # A file or a link in the way (replaced by the rename with --force): the lock sits beside it.
        if not force:
            raise DiffquantError(f"{out}: already exists (pass --force to replace it)")
        fd = _lock(out.parent, f".{out.name}{LOCK_FILE}", out)
        try:
            yield out
        finally:
            _release_checkpoint_claim(out.parent, fd, False, f".{out.name}{LOCK_FILE}")
        return
    created = not out.exists()
    _make(out)
    fd = _lock(out)
    try:
        if not force and not claim_files_only(out):
            raise DiffquantError(f"{out}: already exists (pass --force to replace it)")
        yield out
    finally:
        _release_checkpoint_claim(out, fd, created)


def claim_files_only(out: Path) -> bool:
    """Whether folder ``out`` holds nothing but a claim's files (a writer's claim in progress, or one left by
    a killed writer): free to write once the lock is free."""
    try:
        return out.is_dir() and all(p.name in (LOCK_FILE, RECORD_FILE) for p in out.iterdir())
    except OSError:
        return False


def _release_checkpoint_claim(out: Path, fd: int, created: bool, name: str = LOCK_FILE) -> None:
    """Remove the lock file the claim put in ``out`` (when ``out`` is still the claimed folder: a written
    checkpoint was renamed over it and holds none), and the folder itself if the claim created it and it
    is empty; then release the lock."""
    try:
        lock = out / name
        try:
            mine = os.fstat(fd)
            there = lock.stat()
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                lock.unlink()
        except OSError:
            pass
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: a failed write leaves no folder behind
    finally:
        _unlock(fd)


def check_run_target(out: str | Path, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse, in one line, an ``--out`` a run must not write into: a symbolic link (the files would land
    where it points), a checkpoint folder or a folder inside one, or one of ``inputs`` (model specifiers or
    files the run reads), a folder inside one, or a folder holding one (``--force`` would empty it)."""
    out = Path(out)
    if out.is_symlink():
        raise DiffquantError(
            f"{out}: is a symbolic link (to {os.readlink(out)}); give the folder itself as --out"
        )
    target = out.expanduser().resolve()
    for folder in (target, *target.parents):
        if _is_checkpoint(folder):
            where = "is" if folder == target else f"lies inside {folder}, which is"
            raise DiffquantError(f"{out}: {where} a checkpoint folder; write the run elsewhere")
    for spec in inputs:
        text = str(spec)
        if text.split(":", 1)[0] in ("init", "zoo", "fetch") or not text:
            continue
        source = spec_path(text).expanduser().resolve()
        if source == target or source in target.parents or target in source.parents:
            raise DiffquantError(
                f"{out}: is, holds or lies inside an input of the run ({spec}); write it elsewhere"
            )


def _is_checkpoint(folder: Path) -> bool:
    """A model folder: a config beside its weights (native, quantized or Hugging Face)."""
    if not (folder / CONFIG_FILE).is_file():
        return False
    return any((folder / name).is_file() for name in (WEIGHTS_FILE, INDEX_FILE, PLAN_FILE))


@contextmanager
def lock_folder(out: str | Path) -> Iterator[Path]:
    """The claims' lock alone, for a writer that keeps its own folder's contents and resumes into it
    (``train``: checkpoints, ``--resume``): a second writer into ``out`` is refused at once, in one line,
    instead of two runs interleaving their checkpoints."""
    out = Path(out)
    if rank_and_world()[0] != 0:
        yield out
        return
    created = not out.exists()
    _make(out)
    fd = _lock(out)
    try:
        yield out
    finally:
        if created and claim_files_only(out):  # refused before writing anything: leave no folder behind
            _release_checkpoint_claim(out, fd, created)
        else:
            _unlock(fd)


def _make(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DiffquantError(f"{out}: exists and is not a folder; {_HINT.split(',')[0]}") from None
    except OSError as err:
        raise DiffquantError(f"{out}: cannot create the run folder ({err.strerror or err})") from None


def _lock(out: Path, name: str = LOCK_FILE, what: Path | None = None) -> int:
    """Take the exclusive lock ``out/name`` (``what``: the path the refusal names, default ``out``)."""
    import fcntl  # noqa: PLC0415 (POSIX only)

    path = out / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise DiffquantError(f"{path}: cannot open the run folder's lock ({err.strerror or err})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiffquantError(
            f"{what or out} is in use by another run (pid {owner}); wait for it to finish or use another --out"
        ) from None
    except OSError as err:
        os.close(fd)
        raise DiffquantError(f"{path}: cannot lock the run folder ({err.strerror or err})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _unlock(fd: int) -> None:
    import fcntl  # noqa: PLC0415 (POSIX only)

    try:
        os.ftruncate(fd, 0)  # no owner any more
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _foreign(out: Path, command: str, identity: Any) -> str | None:
    """Why ``out`` belongs to another run, or None when it is free or this run's own."""
    record_path = out / RECORD_FILE
    if record_path.exists():
        try:  # bounded: a FIFO or a device planted at the record's name is refused, not read forever
            record = read_json(record_path, "run record", limit=MAX_CONFIG_BYTES)
        except DiffquantError:
            return f"its run record {RECORD_FILE} is unreadable"
        if not isinstance(record, dict) or "command" not in record:
            return f"its run record {RECORD_FILE} is not a run record"
        if record["command"] != command:
            return f"holds another run's artifacts (a `{record['command']}` run, not `{command}`)"
        if _canonical(record.get("identity")) != _canonical(identity):
            return f"holds a different {command} run ({_difference(record.get('identity'), identity)})"
        return None
    found = [name for name in MARKERS if (out / name).exists()] + [p.name for p in _cells(out)][:1]
    if not found:
        return None
    what = found[0]
    if what == "manifest.json":
        previous = _manifest_command(out / what)
        what = f"manifest.json of a `{previous}` run" if previous else "a manifest.json"
    return f"holds another run's artifacts ({what}, written by a run that did not claim the folder)"


def _difference(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in old.keys() | new.keys() if _canonical(old.get(k)) != _canonical(new.get(k)))
        if keys:
            return f"{', '.join(keys)} changed"
    return "its identity changed"


def _canonical(value: Any) -> str:
    """Compare identities as JSON text (NaN equals NaN, key order does not matter)."""
    return json.dumps(value, sort_keys=True)


def _manifest_command(path: Path) -> str | None:
    """The command of a diffquant manifest at ``path``; None for none, or another tool's manifest."""
    try:
        data = read_json(path, "manifest", limit=MAX_JSON_BYTES)
    except DiffquantError:
        return None
    return data["command"] if isinstance(data, dict) and _is_diffquant_manifest(data) else None


def _cells(out: Path) -> list[Path]:
    return sorted(out.glob("cells-rank*.jsonl"))


def _is_run_folder(out: Path) -> bool:
    """A folder this package wrote a run into: a claim record, a diffquant manifest, a sweep."""
    if (out / RECORD_FILE).exists() or (out / "sweep.json").exists() or _cells(out):
        return True
    return _manifest_command(out / "manifest.json") is not None


def _is_diffquant_manifest(data: Any) -> bool:
    """What :func:`~diffquant.io.artifacts.manifest` writes: a command name and the library versions, this
    package's among them. A manifest.json of another tool (with a ``command`` key of its own, say) is not."""
    versions = data.get("versions") if isinstance(data, dict) else None
    return isinstance(data.get("command"), str) and isinstance(versions, dict) and "diffquant" in versions


def _clean(out: Path) -> None:
    for entry in out.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
