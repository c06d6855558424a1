"""diffquant.progress: periodic lines off a terminal, tqdm on one, nothing when quiet."""

from __future__ import annotations

import io
import os
import re
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
    bar = P.progress(total=10, desc="ppl", unit="win", file=out, clock=clock, interval=5)
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
    clock.now += 12.0
    bar.update(6)
    assert out.getvalue() == "train: 6 step, 0.5 step/s, 12 s elapsed\n"


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
    plain = P.progress(total=3, desc="ppl", unit="win", bar=False, file=tty)  # on a terminal: a bar too
    assert isinstance(plain, tqdm)
    plain.close()
    assert isinstance(P.progress(total=3, desc="ppl", unit="win", bar=False, file=pipe), P.PeriodicProgress)


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


# ----------------------------------------------------------------------------- long steps (issue 26)
class TimedStream(Stream):
    """A non-terminal stream that records the fake clock's time of each line written to it."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.times = clock, []

    def write(self, s: str) -> int:
        self.times += [self.clock.now] * s.count("\n")
        return super().write(s)


def test_a_long_step_says_when_it_starts_and_at_least_every_interval():
    """A step of 35 s that never ends a batch (one profile batch): a start line at once, then the heartbeat
    (what the thread calls, here by hand once a second of fake time) a line at least every interval."""
    clock = Clock()
    out = TimedStream(clock)
    bar = P.progress(total=1, desc="profile", unit="batch", file=out, clock=clock, announce=True)
    assert out.getvalue() == "profile: 0/1 batch, started\n" and out.times == [100.0]
    for _ in range(35):
        clock.now += 1.0
        P.beat()
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "profile: 0/1 batch, started",
        "profile: 0/1 batch, 10 s elapsed",
        "profile: 0/1 batch, 20 s elapsed",
        "profile: 0/1 batch, 30 s elapsed",
        "profile: 1/1 batch, 35 s/batch, done in 35 s",
    ]
    gaps = [b - a for a, b in zip(out.times, out.times[1:], strict=False)]
    assert out.times[0] == 100.0 and max(gaps) <= P.INTERVAL
    P.beat()  # closed: no more lines
    assert len(out.getvalue().splitlines()) == 5


def test_the_heartbeat_speaks_for_the_innermost_step_only():
    """A sweep cell (outer) running windows (inner): while the inner one is open only it ticks, so one
    line per interval, not one per open step; once it is closed the outer one ticks again."""
    clock, out = Clock(), Stream()
    outer = P.progress(total=2, desc="sweep", unit="cell", file=out, clock=clock, announce=True)
    inner = P.progress(total=4, desc="ppl", unit="win", file=out, clock=clock)
    clock.now += 10.0
    P.beat()
    assert out.getvalue().splitlines()[1:] == ["ppl: 0/4 win, 10 s elapsed"]
    inner.close()
    clock.now += 10.0
    P.beat()
    outer.close()
    assert out.getvalue().splitlines()[1:] == [
        "ppl: 0/4 win, 10 s elapsed",
        "ppl: 0/4 win, done in 10 s",
        "sweep: 0/2 cell, 20 s elapsed",
        "sweep: 0/2 cell, done in 20 s",
    ]


def test_an_abandoned_loop_stops_its_heartbeat():
    """A loop left early (an error in a cell) is closed without a "done" line, and ticks no more."""
    clock, out = Clock(), Stream()
    for _ in P.progress(range(3), "sweep", "cell", file=out, clock=clock, announce=True):
        break
    clock.now += 60.0
    P.beat()
    assert out.getvalue() == "sweep: 0/3 cell, started\n"
    with pytest.raises(ValueError), P.progress(total=2, desc="x", file=out, clock=clock, announce=True):
        raise ValueError
    clock.now += 60.0
    P.beat()
    assert out.getvalue().splitlines()[1:] == ["x: 0/2 it, started"]


def test_the_heartbeat_thread_lives_while_a_real_time_step_is_open():
    """The thread starts with the first open step that reads the real clock (interval > 0) and ends when the
    last one closes (woken at once, not after its wait); a fake clock or interval 0 starts none."""
    out = Stream()
    fake = P.progress(total=1, desc="x", file=out, clock=Clock())
    zero = P.progress(total=1, desc="x", file=out, interval=0)
    assert P._thread is None
    zero.close()
    fake.close()
    bar = P.progress(total=1, desc="x", file=out, interval=30)
    thread = P._thread
    assert thread is not None and thread.is_alive() and thread.daemon
    bar.close()
    thread.join(timeout=60)
    assert not thread.is_alive() and P._thread is None
    assert out.getvalue() == ""  # nothing written: it never got to its interval


def test_a_step_without_a_count():
    clock, out = Clock(), Stream()
    with P.step("write out/q", file=out, clock=clock):
        clock.now += 12.0
        P.beat()
    assert out.getvalue().splitlines() == [
        "write out/q: started",
        "write out/q: 12 s elapsed",
        "write out/q: done in 12 s",
    ]


def test_a_terminal_gets_bars_only():
    """On a terminal every step is a tqdm bar whatever ``bar`` says (``progress=False`` of a library call
    included), a bar opened inside another is cleared when it closes, and lines printed meanwhile go
    through tqdm (cleared and redrawn), so no plain progress line lands in the middle of a bar."""
    clock, tty = Clock(), Stream(tty=True)
    outer = P.progress(total=2, desc="sweep", unit="cell", file=tty, clock=clock, announce=True)
    inner = P.progress(total=3, desc="ppl", unit="win", bar=False, file=tty, clock=clock, announce=True)
    assert isinstance(outer, tqdm) and isinstance(inner, tqdm)
    assert outer.leave and not inner.leave
    for _ in range(3):
        clock.now += 20.0
        inner.update(1)
        P.beat()
    P.write("gptq: 14 Linears", file=tty)
    with P.outside_bars(file=tty):
        tty.write("sweep: NON-FINITE result\n")
    inner.close()
    with P.step("write q", file=tty, clock=clock):
        clock.now += 20.0
        P.beat()
    outer.update(2)
    outer.close()
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", tty.getvalue())  # the cursor moves between bars
    pieces = [p for chunk in text.split("\r") for p in chunk.split("\n")]
    assert "gptq: 14 Linears" in pieces and "sweep: NON-FINITE result" in pieces  # whole lines, own rows
    plain = [p for p in pieces if "started" in p or "elapsed" in p or "ETA" in p or "done in" in p]
    assert plain == []  # no PeriodicProgress line among the bars
    assert not P._live()


def test_quiet_silences_start_lines_and_heartbeats():
    P.set_quiet(True)
    clock, out = Clock(), Stream()
    bar = P.progress(total=1, desc="profile", unit="batch", file=out, clock=clock, announce=True)
    clock.now += 30.0
    P.beat()
    bar.close()
    with P.step("write q", file=out, clock=clock):
        clock.now += 30.0
        P.beat()
    assert out.getvalue() == "" and not P._live()


@pytest.mark.parametrize(
    ("plan", "stream", "starts"),
    [
        (
            "w8a8-smoothquant",
            "off",
            ["act-scales: 0/2 batch", "calibrate: 0/4 stage", "error report: 0/1 batch", "write {out}"],
        ),
        ("w4a8-gptq", "on", ["quantize m streamed: 0/4 stage"]),
    ],
)
def test_quantize_says_when_each_long_step_starts(plan, stream, starts, tmp_path, capsys):
    """``quantize`` with progress on and stderr not a terminal: a start line for each long step (smoothing's
    act-scales, the calibration's stages, the error report, writing; the streamed run's stages), all on stderr, in
    order; ``--quiet`` prints none of them."""
    model = tmp_path / "m"
    assert main(["init", "--kind", "diff_v1", "--preset", "tiny", str(model)]) == 0
    args = ["quantize", str(model), "--plan", plan, "--stream", stream, "--calib-tokens", "256",
            "--eval-tokens", "128", "--seq-len", "64", "--batch-size", "2"]  # fmt: skip
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "q")]) == 0
    out, err = capsys.readouterr()
    started = [line for line in err.splitlines() if line.endswith("started")]
    expected = [s.format(out=tmp_path / "q") for s in starts]
    assert [line.removesuffix(", started").removesuffix(": started") for line in started] == expected
    assert "started" not in out
    assert main(["--quiet", *args, "--out", str(tmp_path / "q2")]) == 0
    assert "started" not in capsys.readouterr().err


def test_a_one_batch_profile_says_when_it_starts(capsys):
    """A profile that fits in one batch used to print its only line at its end (or none): now it says when
    the batch starts (the heartbeat then speaks every interval while it runs)."""
    import torch
    from conftest import tiny_model

    from diffquant.profile.runner import profile_model

    model = tiny_model("diff_v1")
    windows = torch.randint(0, model.config.vocab_size, (2, 16))
    assert profile_model(model, windows, batch_size=8) is not None
    assert capsys.readouterr().err.splitlines()[0] == "profile: 0/1 batch, started"


def test_training_says_when_it_starts_and_keeps_its_log_on_stdout(tmp_path, capsys, monkeypatch):
    """``train`` with stderr not a terminal: a ``train: 0/N step, started`` line on stderr at once (a large
    model's ``log_every`` steps can take minutes), a line per step at interval 0, a final ``done`` line; its
    log lines (results) stay on stdout, in step order."""
    from test_train import _cfg

    from diffquant.train import train

    monkeypatch.setenv(P.INTERVAL_ENV, "0")
    train(_cfg(tmp_path, steps=4, eval_every=4, checkpoint_every=4))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "train: 0/4 step, started"
    trained = [line for line in lines if line.startswith("train: ")]
    assert [line.split(",")[0] for line in trained][1:] == [f"train: {i}/4 step" for i in range(1, 5)]
    assert ", done in " in trained[-1]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        f"{i}/4" for i in range(1, 5)
    ]
    assert "started" not in out
