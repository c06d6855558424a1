"""Progress reporting for every long step: a tqdm bar on a terminal, plain lines elsewhere, or nothing.

Off a terminal (a log file, a pipe, ``tee``) each step is a :class:`PeriodicProgress` writing whole lines::

    error report: 0/13 batch, started
    error report: 4/13 batch, 0.4 batch/s, ETA 22 s
    error report: 13/13 batch, 0.4 batch/s, done in 31 s

- a step that may run long (calibration, the error report, GPTQ / HQQ weights, writing a checkpoint, an
  lm-eval run and its requests, a sweep, a profile, a streamed run) is *announced*: its ``started`` line is
  written at once, so a run whose only batch takes minutes still says what it is doing;
- then a line at most every ``interval`` seconds at the end of a step (batch, stage, cell), and -- the
  heartbeat, a daemon thread while a step is open -- at least every interval while a single step runs on,
  for the innermost open step only (a sweep cell's windows report, not the sweep as well);
- a step that is not announced and ends within the interval prints nothing; one that printed ends with a
  ``done in N s`` line (none when it failed or was left early).

The interval is :data:`INTERVAL` (10 s) or ``DIFFQUANT_PROGRESS_INTERVAL=SECONDS`` (a batch log may want one
line a minute; 0 prints a line at every step and no heartbeat, which is also how the test suite plays a
machine so busy that every step is slow).

On a terminal every step is a tqdm bar (whatever ``bar`` a caller passes, so bars and lines never
interleave); a bar opened while another is drawn is cleared when it closes (no stale inner bars), and the
other lines printed meanwhile (GPTQ's summary, a sweep's warnings) go through :func:`write` /
:func:`outside_bars`, which clear the bars, print, and draw them again below.

``diffquant --quiet`` (or ``DIFFQUANT_QUIET=1``) silences all of it. Progress always goes to stderr, never to
stdout, so results on stdout stay clean.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

QUIET_ENV = "DIFFQUANT_QUIET"
INTERVAL_ENV = "DIFFQUANT_PROGRESS_INTERVAL"
INTERVAL = 10.0  # seconds between periodic lines (at most), and before the first one unless announced
# The clock of every step that names none. The real one (the heartbeat thread ticks only steps that read it);
# a test swaps in a fake clock to play a step of minutes inside a library call and calls beat() by hand.
CLOCK: Callable[[], float] = time.monotonic

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
    (time-based: checked at each update, and by the heartbeat while a step runs without one); with
    ``announce`` a ``desc: 0/total unit, started`` line first. If it printed anything, ``close`` adds a final
    ``desc: done/total unit, rate unit/s, done in N s`` line."""

    def __init__(
        self,
        iterable: Iterable[Any] | None,
        total: int | None,
        desc: str,
        unit: str,
        file: IO[str],
        clock: Callable[[], float] = time.monotonic,
        interval: float = INTERVAL,
        announce: bool = False,
    ) -> None:
        super().__init__(iterable, total)
        self.desc, self.unit, self.file, self.clock, self.interval = desc, unit, file, clock, interval
        self.start = self.last = clock()
        self.printed = False
        self.closed = False
        self.postfix = ""
        self.realtime = clock is time.monotonic  # the heartbeat thread ticks only these (tests: beat())
        with _lock:
            _open.append(weakref.ref(self))
        if announce:
            self._write(self.line(self.start, started=True))
        if self.realtime and interval > 0:
            _start_heartbeat()

    def update(self, n: int = 1) -> None:
        with _lock:
            self.n += n
            now = self.clock()
            if now - self.last >= self.interval:
                if (
                    self.total is not None and self.n >= self.total
                ):  # the last step: its line is the final one
                    self._write(self.line(now, final=True))
                    self._close()
                else:
                    self._write(self.line(now))
                self.last = now

    def tick(self) -> None:
        """A line if none was written for ``interval``, though no step ended (the heartbeat calls it)."""
        with _lock:
            now = self.clock()
            if not self.closed and self.interval > 0 and now - self.last >= self.interval:
                self._write(self.line(now))
                self.last = now

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self.iterable if self.iterable is not None else ():
                yield item
                self.update(1)
        except GeneratorExit:  # the loop stopped early (break, an error): no heartbeat, no "done" line
            self._close()
            raise
        self.close()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def line(self, now: float, final: bool = False, started: bool = False) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.n / elapsed
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        extra = f" ({self.postfix})" if self.postfix else ""
        if started:
            return f"{self.desc}: {count} {self.unit}, started{extra}"
        slow = 0 < rate < 0.1  # a step of over 10 s reads better as seconds per step
        speed = f"{1 / rate:.0f} s/{self.unit}" if slow else f"{rate:.1f} {self.unit}/s"
        if final:
            tail = f"done in {elapsed:.0f} s"
        elif self.total is not None and rate > 0:
            tail = f"ETA {max(0, self.total - self.n) / rate:.0f} s"
        else:
            tail = f"{elapsed:.0f} s elapsed"
        if self.n == 0:  # nothing done yet (or a step that had nothing to do): no rate to give
            return f"{self.desc}: {count} {self.unit}, {tail}{extra}"
        return f"{self.desc}: {count} {self.unit}, {speed}, {tail}{extra}"

    def _write(self, line: str) -> None:
        with _lock:
            self.file.write(line + "\n")
            self.file.flush()
            self.printed = True

    def _close(self) -> None:
        with _lock:
            self.closed = True
            _open[:] = [ref for ref in _open if ref() not in (None, self)]
            _wake.notify_all()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the step failed: no "done" line after its error
            self._close()

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self._close()
            if self.printed:
                self._write(self.line(self.clock(), final=True))


# The heartbeat: one daemon thread while a real-time PeriodicProgress is open, so that a step longer than the
# interval (one profile batch, one GPTQ layer, a model load in a sweep cell) still prints a line every
# interval. Only the innermost open progress ticks: an outer one (the sweep's cells) stays silent while an
# inner one (a cell's windows) reports, and speaks again when the inner one is closed.
_lock = threading.RLock()
_wake = threading.Condition(_lock)
_open: list[weakref.ref[PeriodicProgress]] = []  # open, innermost last (one dropped unclosed goes too)
_thread: threading.Thread | None = None


def _live() -> list[PeriodicProgress]:
    with _lock:
        _open[:] = [ref for ref in _open if ref() is not None]
        return [p for p in (ref() for ref in _open) if p is not None]


def beat(realtime: bool | None = None) -> None:
    """One heartbeat: the innermost open progress writes a line if it was silent for its interval.
    ``realtime`` True: only if that progress reads the real clock (the thread's call)."""
    live = _live()
    inner = live[-1] if live else None
    if inner is not None and (realtime is None or inner.realtime == realtime):
        inner.tick()


def _heartbeat() -> None:
    global _thread
    with _lock:
        while True:
            live = [p for p in _live() if p.realtime and p.interval > 0]
            if not live:
                _thread = None
                return
            _wake.wait(min(1.0, live[-1].interval / 2))  # the lock is released while waiting
            beat(realtime=True)


def _start_heartbeat() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_heartbeat, name="diffquant-progress", daemon=True)
            _thread.start()


def write(line: str, file: IO[str] | None = None) -> None:
    """``line`` on stderr (or ``file``) without breaking a bar on the terminal: tqdm clears its bars, prints
    the line and draws them again below it (a plain print would leave a stale copy of the bar above)."""
    if file is None:
        file = sys.stderr
    from tqdm import tqdm  # noqa: PLC0415 (tqdm only once something is written)

    with _lock:
        tqdm.write(line, file=file)


class _Step(PeriodicProgress):
    """A step with nothing to count (writing a checkpoint): ``desc: started``, ``desc: N s elapsed`` every
    interval while it runs, ``desc: done in N s``."""

    def line(self, now: float, final: bool = False, started: bool = False) -> str:
        if started:
            return f"{self.desc}: started"
        seconds = f"{now - self.start:.0f} s"
        return f"{self.desc}: done in {seconds}" if final else f"{self.desc}: {seconds} elapsed"


@contextlib.contextmanager
def step(
    desc: str,
    *,
    file: IO[str] | None = None,
    clock: Callable[[], float] | None = None,
    announce: bool = True,
) -> Iterator[None]:
    """One long step without a count, as :func:`progress` shows steps: a bar on a terminal, off one a line
    when it starts, one every interval while it runs and one when it is done; nothing when quiet.

    ``announce`` False: a step that is often short (building a tokenizer, dequantizing a small GGUF) says
    nothing unless it runs past the interval; then ``desc: N s elapsed`` every interval and ``desc: done in
    N s`` (no ``started`` line, so a quick step adds no noise)."""
    if is_quiet():
        yield
        return
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty and isatty():
        with progress(total=1, desc=desc, unit="step", leave=False, file=stream) as bar:
            yield
            bar.update(1)
        return
    clock = clock if clock is not None else CLOCK
    with _Step(None, None, desc, "step", stream, clock=clock, interval=default_interval(), announce=announce):
        yield


@contextlib.contextmanager
def outside_bars(file: IO[str] | None = None) -> Iterator[None]:
    """Within the block, what is printed to stderr (or ``file``) lands above the bars on the terminal: they
    are cleared first and drawn again after (for messages printed by a caller's ``log``)."""
    from tqdm import tqdm  # noqa: PLC0415

    with _lock, tqdm.external_write_mode(file=file if file is not None else sys.stderr):
        yield


def _bars_open() -> bool:
    from tqdm import tqdm  # noqa: PLC0415

    return any(not getattr(bar, "disable", False) for bar in list(getattr(tqdm, "_instances", ())))


def progress(
    iterable: Iterable[Any] | int | None = None,
    desc: str = "",
    unit: str = "it",
    *,
    total: int | None = None,
    bar: bool | None = None,
    enabled: bool = True,
    leave: bool = True,
    announce: bool = False,
    file: IO[str] | None = None,
    clock: Callable[[], float] | None = None,
    interval: float | None = None,
):
    """Progress over ``iterable`` (or a bare count: an int, or ``total=`` with ``update()`` calls).

    Returns something to iterate over and/or call ``update(n)`` / ``close()`` on, usable as a context manager:

    - nothing at all when quiet (``--quiet``, ``$DIFFQUANT_QUIET``) or ``enabled`` is False (e.g. rank != 0);
    - a tqdm bar when ``file`` (default: the current stderr) is a terminal, or when ``bar`` is True (the
      ``progress=True`` of the library functions) -- on a terminal always a bar, never lines, whatever
      ``bar`` says, so the two never interleave; a bar opened while another is drawn is cleared when it
      closes (``leave`` False), so no finished inner bar stays on screen;
    - otherwise a :class:`PeriodicProgress`: a ``started`` line at once when ``announce`` (a step that may
      run long: calibration, an lm-eval cell, a profile), then one line every ``interval`` seconds while it
      runs (None: :func:`default_interval`).
    """
    if isinstance(iterable, int):
        iterable, total = None, iterable
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled or is_quiet():
        return _Silent(iterable, total)
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if bar or (isatty and isatty()):
        from tqdm import tqdm  # noqa: PLC0415 (imported when a bar is shown)

        leave = leave and not _bars_open()
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream, disable=False)
    if interval is None:
        interval = default_interval()
    clock = clock if clock is not None else CLOCK
    return PeriodicProgress(
        iterable, total, desc, unit, stream, clock=clock, interval=interval, announce=announce
    )


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
