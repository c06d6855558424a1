"""diffquant.progress: periodic lines off a terminal, tqdm on one, nothing when quiet."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from tqdm import tqdm

from diffquant import progress as P
from diffquant.cli import main

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """A fake monotonic clock, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Stream(io.StringIO):
    def __init__(self, tty: bool = False) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture(autouse=True)
def not_quiet(monkeypatch):
    monkeypatch.delenv(P.QUIET_ENV, raising=False)
    monkeypatch.delenv(P.INTERVAL_ENV, raising=False)
    P.set_quiet(None)
    yield
    P.set_quiet(None)


def test_periodic_lines_every_interval_with_rate_and_eta():
    clock, out = Clock(), Stream()
    bar = P.progress(total=10, desc="ppl", unit="win", file=out, clock=clock)
    assert isinstance(bar, P.PeriodicProgress)
    for step in range(1, 11):
        clock.now += 2.0  # one window every 2 s: 0.5 win/s
        bar.update(1)
        if step == 2:
            assert out.getvalue() == ""  # 4 s: nothing yet
    bar.close()
    bar.close()  # idempotent
    lines = out.getvalue().splitlines()
    # a line at 6 s (3 done), 12 s (6 done), 18 s (9 done): at most one per 5 s, time-based
    assert lines == [
        "ppl: 3/10 win, 0.5 win/s, ETA 14 s",
        "ppl: 6/10 win, 0.5 win/s, ETA 8 s",
        "ppl: 9/10 win, 0.5 win/s, ETA 2 s",
        "ppl: 10/10 win, 0.5 win/s, done in 20 s",
    ]


def test_iterable_and_slow_steps():
    clock, out = Clock(), Stream()

    def cells():
        for i in range(3):
            clock.now += 30.0
            yield i

    assert list(P.progress(cells(), "sweep", "cell", total=3, file=out, clock=clock)) == [0, 1, 2]
    assert out.getvalue().splitlines() == [
        "sweep: 1/3 cell, 30 s/cell, ETA 60 s",
        "sweep: 2/3 cell, 30 s/cell, ETA 30 s",
        "sweep: 3/3 cell, 30 s/cell, done in 90 s",  # the last step's line is the final one (no "ETA 0 s")
    ]


def test_short_run_prints_nothing_and_unknown_total():
    clock, out = Clock(), Stream()
    for _ in P.progress(range(100), "calibrate", "batch", file=out, clock=clock):
        clock.now += 0.01
    assert out.getvalue() == ""
    bar = P.progress(desc="train", unit="step", file=out, clock=clock)
    clock.now += 6.0
    bar.update(3)
    assert out.getvalue() == "train: 3 step, 0.5 step/s, 6 s elapsed\n"


@pytest.mark.parametrize("how", ["set_quiet", "env"])
def test_quiet_prints_nothing(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv(P.QUIET_ENV, "1")
    else:
        P.set_quiet(True)
    assert P.is_quiet()
    clock, out = Clock(), Stream(tty=True)
    for bar_mode in (None, True, False):
        bar = P.progress(range(5), "sweep", "cell", bar=bar_mode, file=out, clock=clock)
        for _ in bar:
            clock.now += 10.0
        bar.close()
    assert out.getvalue() == ""


def test_quiet_context_restores_state():
    with P.quiet():
        assert P.is_quiet() and os.environ[P.QUIET_ENV] == "1"
    assert not P.is_quiet() and P.QUIET_ENV not in os.environ
    with P.quiet(False):
        assert not P.is_quiet()


def test_disabled_prints_nothing():
    clock, out = Clock(), Stream()
    bar = P.progress(range(3), "sweep", "cell", enabled=False, file=out, clock=clock)
    for _ in bar:
        clock.now += 10.0
    assert out.getvalue() == ""


def test_tty_gets_tqdm_and_bar_flag_forces_it():
    tty, pipe = Stream(tty=True), Stream()
    bar = P.progress(range(3), "sweep", "cell", file=tty)
    assert isinstance(bar, tqdm)
    assert list(bar) == [0, 1, 2]
    assert "sweep" in tty.getvalue()
    forced = P.progress(total=3, desc="ppl", unit="win", bar=True, file=pipe)  # progress=True: a bar
    assert isinstance(forced, tqdm)
    forced.close()
    plain = P.progress(total=3, desc="ppl", unit="win", bar=False, file=tty)  # progress=False: no bar
    assert isinstance(plain, P.PeriodicProgress)


def test_cli_quiet_flag_is_top_level(capsys, monkeypatch):
    import diffquant.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_presets", lambda args: seen.append(P.is_quiet()) or 0)
    assert main(["--quiet", "presets"]) == 0
    assert main(["presets"]) == 0
    assert seen == [True, False]
    assert not P.is_quiet() and P.QUIET_ENV not in os.environ  # restored after the command
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--quiet" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("value", "interval"), [("0", 0.0), ("60", 60.0), ("", P.INTERVAL), ("x", P.INTERVAL)]
)
def test_interval_from_the_environment(value, interval, monkeypatch):
    """DIFFQUANT_PROGRESS_INTERVAL sets the seconds between lines (0: a line at every step); a value that is
    not a number >= 0 falls back to the default instead of stopping the run."""
    monkeypatch.setenv(P.INTERVAL_ENV, value)
    assert P.default_interval() == interval
    clock, out = Clock(), Stream()
    bar = P.progress(total=4, desc="ppl", unit="win", file=out, clock=clock)
    assert bar.interval == interval
    clock.now += 1.0
    bar.update(1)
    assert (out.getvalue() == "ppl: 1/4 win, 1.0 win/s, ETA 3 s\n") == (interval <= 1.0)


def test_the_suite_runs_quiet_unless_asked(monkeypatch):
    """conftest's autouse fixture makes every test quiet (so what a command prints does not depend on how busy
    the machine is); this module opts out, and DIFFQUANT_TEST_PROGRESS=1 turns the fixture off."""
    assert not P.is_quiet()  # this module's not_quiet fixture ran after conftest's quiet_progress


# Tests that compare what a command prints with what it should (an error in one line, a placement line, a
# README example) and that printed progress lines when the machine was busy (found by running the whole suite
# with DIFFQUANT_TEST_PROGRESS=1 DIFFQUANT_PROGRESS_INTERVAL=0: 14 such failures, these among them).
LOAD_SENSITIVE = (
    "tests/test_tokenizers.py::test_broken_tokenizer_json_is_one_line",
    "tests/test_device_map.py::test_cpu_and_disk_placement_equals_the_whole_model",
)


@pytest.mark.slow
def test_output_comparisons_hold_on_a_busy_machine():
    """The tests that compare printed output pass when every step is slow (a progress line at each step), and
    without the suite's quiet fixture the same run fails: the busy machine is really played."""
    import subprocess
    import sys

    def run(**env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LOAD_SENSITIVE]
        full = {**os.environ, P.INTERVAL_ENV: "0", "OMP_NUM_THREADS": "1", **env}
        full.pop(P.QUIET_ENV, None)
        return subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=ROOT, timeout=600)

    quiet = run(DIFFQUANT_TEST_PROGRESS="0")
    assert quiet.returncode == 0, quiet.stdout[-3000:]
    loud = run(DIFFQUANT_TEST_PROGRESS="1")
    assert loud.returncode == 1, loud.stdout[-3000:]
