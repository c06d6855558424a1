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

Under ``torchrun`` only rank 0 claims (other ranks get a no-op), so the caller still synchronises ranks
after the claim where they write into the folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diffquant.distributed import rank_and_world
from diffquant.errors import DiffquantError
from diffquant.io.artifacts import write_text_atomic

RECORD_FILE = ".diffquant-run.json"
LOCK_FILE = ".diffquant-run.lock"
# Artifacts that make a folder a run folder even without a claim record (runs from before claims).
MARKERS = ("manifest.json", "sweep.json")
_HINT = "use another --out, or --force to start clean"


@contextmanager
def claim_run_folder(out: str | Path, command: str, identity: Any, force: bool = False) -> Iterator[Path]:
    """Claim ``out`` for the run of ``command`` described by ``identity`` (JSON-able: what decides its
    results, e.g. a sweep's specifiers or a recipe) for the duration of the ``with`` block; yields the
    folder (created if missing). See the module docstring for what is refused, what force removes, and
    the lock."""
    out = Path(out)
    if rank_and_world()[0] != 0:
        yield out
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DiffquantError(f"{out}: exists and is not a folder; {_HINT.split(',')[0]}") from None
    except OSError as err:
        raise DiffquantError(f"{out}: cannot create the run folder ({err.strerror or err})") from None
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


def _lock(out: Path) -> int:
    import fcntl  # noqa: PLC0415 (POSIX only)

    path = out / LOCK_FILE
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
            f"{out} is in use by another run (pid {owner}); wait for it to finish or use another --out"
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
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
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
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("command") if isinstance(data, dict) and isinstance(data.get("command"), str) else None


def _cells(out: Path) -> list[Path]:
    return sorted(out.glob("cells-rank*.jsonl"))


def _is_run_folder(out: Path) -> bool:
    """A folder this package wrote a run into: a claim record, a diffquant manifest, a sweep."""
    if (out / RECORD_FILE).exists() or (out / "sweep.json").exists() or _cells(out):
        return True
    path = out / "manifest.json"
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"command", "versions"} <= data.keys()


def _clean(out: Path) -> None:
    for entry in out.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
