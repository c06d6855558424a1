"""What every stage of the GPU kit shares: its context, the result file it writes as it goes, and commands run
under a deadline.

Why a result file written as it goes: a GPU machine is lent for minutes, and a stage that runs out of time is
killed; whatever it measured before that must still reach the summary. Why process groups: a stage starts
children (pytest shards, Triton compilers, `diffquant` commands) and a kill must take all of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """Where a stage runs: the mode (``gpu`` or ``rehearse``), its work folder, the wall-clock time (epoch
    seconds) by which it must have written its result, whether CUDA is there, and, for a trio in parts, the
    part this call trains ({kinds, size, tokens}; None: the whole trio, sized from the time)."""

    mode: str
    work: Path
    deadline: float
    cuda: bool
    trio: dict[str, Any] | None = None

    @property
    def rehearse(self) -> bool:
        return self.mode == "rehearse"

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def left(self) -> float:
        """Seconds until the stage's deadline."""
        return self.deadline - time.time()


def write_json(path: Path, data: Any) -> None:
    """Written whole and renamed: a reader (the driver, after a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Recorder:
    """A stage's result file: ``status`` (running, ok, failed, timeout, skipped), ``reason`` and ``numbers``,
    rewritten on every :meth:`set`, so a stage killed half-way leaves what it had measured."""

    path: Path
    data: dict[str, Any] = field(default_factory=lambda: {"status": "running", "reason": "", "numbers": {}})

    def set(self, **numbers: Any) -> None:
        self.data["numbers"].update(numbers)
        write_json(self.path, self.data)

    def finish(self, status: str, reason: str = "") -> None:
        self.data["status"], self.data["reason"] = status, reason
        write_json(self.path, self.data)

    def finish_run(self, res: dict[str, Any], log: Path, cut: str) -> None:
        """The status of a stage that is one run_timed command: timeout (``cut`` says what was kept), failed
        (the log's last error) or ok."""
        if res["timed_out"]:
            self.finish("timeout", cut)
        elif res["rc"] != 0:
            self.finish("failed", last_error(log))
        else:
            self.finish("ok")


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace`` seconds: a stage's children go with it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cmd`` in its own process group, stdout and stderr into ``log``, from the repository root."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        handle.write(f"$ {' '.join(cmd)}\n".encode())
        handle.flush()
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def run_timed(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` for at most ``timeout`` seconds: {rc, wall_s, timed_out}; a command past its time is
    killed with its children."""
    begin = time.time()
    proc = start(cmd, log, env)
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
    return {"rc": proc.returncode, "wall_s": round(time.time() - begin, 2), "timed_out": timed_out}


def log_tail(log: Path, chars: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def last_error(log: Path) -> str:
    """The last line that reads like an error (a traceback's last line, a one-line diffquant error)."""
    lines = [line.strip() for line in log_tail(log, 20000).splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "Error" in line or line.startswith(("Traceback", "FAILED")):
            return line[:400]
    return lines[-1][:400] if lines else ""


def diffquant(*args: str) -> list[str]:
    """A `diffquant` command as this Python runs it (the package is on PYTHONPATH, not installed, on the
    GPU machine: `python -m diffquant.cli` needs no console script)."""
    return [sys.executable, "-m", "diffquant.cli", *args]
