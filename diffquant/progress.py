"""Progress reporting for every long step: a tqdm bar on a terminal, periodic lines elsewhere, or nothing.

A demo piped to a file used to be silent for minutes: tqdm bars are only drawn on a terminal. Here a
non-terminal stderr gets one line at most every ``interval`` seconds (first after ``interval``, so short runs
print nothing)::

    sweep: 3/12 cell, 0.2 cell/s, ETA 45 s

``diffquant --quiet`` (or ``DIFFQUANT_QUIET=1``) silences all of it; ``DIFFQUANT_PROGRESS_INTERVAL=SECONDS``
sets the interval (a batch log may want one line a minute; 0 prints a line at every step, which is also how
the test suite plays a machine so busy that every step is slow). Progress always goes to stderr, never to
stdout, so results on stdout stay clean.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

QUIET_ENV = "DIFFQUANT_QUIET"
INTERVAL_ENV = "DIFFQUANT_PROGRESS_INTERVAL"
INTERVAL = 5.0  # seconds between periodic lines, and before the first one

_quiet: bool | None = None  # set_quiet(); None = from the environment


def set_quiet(quiet: bool | None) -> None:
    """Silence (True) or allow (False) all progress output; None = follow ``$DIFFQUANT_QUIET`` again."""
    global _quiet
    _quiet = quiet


def is_quiet() -> bool:
    if _quiet is not None:
        return _quiet
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def default_interval() -> float:
    """Seconds between periodic lines: ``$DIFFQUANT_PROGRESS_INTERVAL`` if it is a number >= 0, else
    :data:`INTERVAL` (a malformed value must not stop a run over its progress lines)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return INTERVAL
    return value if value >= 0 and value != float("inf") else INTERVAL


class _Silent:
    """No output; iterates and counts like a bar (``update``, ``close``, context manager)."""

    def __init__(self, iterable: Iterable[Any] | None, total: int | None) -> None:
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable if self.iterable is not None else ():
            yield item
            self.n += 1

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeriodicProgress(_Silent):
    """Writes ``desc: done/total unit, rate unit/s, ETA N s`` to ``file`` at most every ``interval`` seconds
    (time-based, checked at each update; the first line once ``interval`` has passed). If it printed
    anything, ``close`` adds a final ``desc: done/total unit, rate unit/s, done in N s`` line."""

    def __init__(
        self,
        iterable: Iterable[Any] | None,
        total: int | None,
        desc: str,
        unit: str,
        file: IO[str],
        clock: Callable[[], float] = time.monotonic,
        interval: float = INTERVAL,
    ) -> None:
        super().__init__(iterable, total)
        self.desc, self.unit, self.file, self.clock, self.interval = desc, unit, file, clock, interval
        self.start = self.last = clock()
        self.printed = False
        self.closed = False
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval:
            if self.total is not None and self.n >= self.total:  # the last step: its line is the final one
                self._write(self.line(now, final=True))
                self.closed = True
            else:
                self._write(self.line(now))
            self.last = now

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable if self.iterable is not None else ():
            yield item
            self.update(1)
        self.close()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def line(self, now: float, final: bool = False) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.n / elapsed
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        slow = 0 < rate < 0.1  # a step of over 10 s reads better as seconds per step
        speed = f"{1 / rate:.0f} s/{self.unit}" if slow else f"{rate:.1f} {self.unit}/s"
        if final:
            tail = f"done in {elapsed:.0f} s"
        elif self.total is not None and rate > 0:
            tail = f"ETA {max(0, self.total - self.n) / rate:.0f} s"
        else:
            tail = f"{elapsed:.0f} s elapsed"
        extra = f" ({self.postfix})" if self.postfix else ""
        return f"{self.desc}: {count} {self.unit}, {speed}, {tail}{extra}"

    def _write(self, line: str) -> None:
        print(line, file=self.file, flush=True)
        self.printed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.printed:
            self._write(self.line(self.clock(), final=True))


def progress(
    iterable: Iterable[Any] | int | None = None,
    desc: str = "",
    unit: str = "it",
    *,
    total: int | None = None,
    bar: bool | None = None,
    enabled: bool = True,
    leave: bool = True,
    file: IO[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    interval: float | None = None,
):
    """Progress over ``iterable`` (or a bare count: an int, or ``total=`` with ``update()`` calls).

    Returns something to iterate over and/or call ``update(n)`` / ``close()`` on, usable as a context manager:

    - nothing at all when quiet (``--quiet``, ``$DIFFQUANT_QUIET``) or ``enabled`` is False (e.g. rank != 0);
    - a tqdm bar when ``bar`` is True (the ``progress=True`` of the library functions), or when ``bar`` is
      None and ``file`` (default: the current stderr) is a terminal;
    - otherwise a :class:`PeriodicProgress`, one line every ``interval`` seconds once a step runs longer
      (None: :func:`default_interval`).
    """
    if isinstance(iterable, int):
        iterable, total = None, iterable
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled or is_quiet():
        return _Silent(iterable, total)
    stream = file if file is not None else sys.stderr
    if bar is None:
        isatty = getattr(stream, "isatty", None)
        bar = bool(isatty and isatty())
    if bar:
        from tqdm import tqdm  # noqa: PLC0415 (imported when a bar is shown)

        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream)
    if interval is None:
        interval = default_interval()
    return PeriodicProgress(iterable, total, desc, unit, stream, clock=clock, interval=interval)


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """Within the block, no progress output (also in worker processes started there: ``$DIFFQUANT_QUIET``);
    both are restored after. ``quiet(False)`` changes nothing."""
    if not on:
        yield
        return
    global _quiet
    saved, saved_env = _quiet, os.environ.get(QUIET_ENV)
    _quiet = True
    os.environ[QUIET_ENV] = "1"
    try:
        yield
    finally:
        _quiet = saved
        if saved_env is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = saved_env
