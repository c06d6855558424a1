"""No silent minutes (issue 49): every step that takes over ~10 s on a real model (SmolLM2, Gemma 3) says so
on stderr: a GGUF's dequantisation and its tokenizer, the sink probe, writing a profile, each figure family
of `plot`. Played with the fake clock of tests/test_progress.py (``diffquant.progress.CLOCK`` swapped, the
heartbeat called by hand), so a step of minutes takes no time; a quick step prints nothing."""

from __future__ import annotations

import pytest
from test_gguf import tok_files as tok_files  # noqa: F401 (the fixture, shared)
from test_gguf import write_gguf
from test_progress import Clock, Stream

from diffquant import progress as P
from diffquant.io import convert_gguf, load_model


@pytest.fixture
def clock(monkeypatch):
    """Progress on (the suite runs quiet), stderr not a terminal (capsys), and the fake clock."""
    monkeypatch.delenv(P.QUIET_ENV, raising=False)
    monkeypatch.delenv(P.INTERVAL_ENV, raising=False)
    P.set_quiet(None)
    fake = Clock()
    monkeypatch.setattr(P, "CLOCK", fake)
    yield fake
    P.set_quiet(None)


def slow(monkeypatch, owner, name: str, clock: Clock, seconds: float, calls: list | None = None) -> None:
    """``owner.name`` made to take ``seconds`` of fake time (the heartbeat beating once a second)."""
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if calls is not None:
            calls.append(name)
        for _ in range(int(seconds)):
            clock.now += 1.0
            P.beat()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def test_a_step_that_may_be_short_says_nothing_unless_it_runs_long(clock):
    out = Stream()
    with P.step("build", file=out, announce=False):
        clock.now += 3.0
        P.beat()
    assert out.getvalue() == ""  # quick: no line at all (no "started" either)
    with P.step("build", file=out, announce=False):
        for _ in range(25):
            clock.now += 1.0
            P.beat()
    assert out.getvalue().splitlines() == [
        "build: 10 s elapsed",
        "build: 20 s elapsed",
        "build: done in 25 s",
    ]


def test_a_gguf_load_says_when_dequantizing_and_the_tokenizer_take_long(
    tmp_path, tok_files, clock, monkeypatch, capsys
):  # noqa: F811
    """Gemma 3's 262k-piece tokenizer took 2-3 s per build, four builds for `info`, and dequantizing a real
    model takes minutes on a busy machine: both are steps with a line every interval once past one, named
    by the file. The tokenizer is built once per file and metadata however often the header is read."""
    path = write_gguf(tmp_path / "m.gguf", tok_files)
    builds: list = []
    slow(monkeypatch, convert_gguf, "gguf_tokenizer", clock, 12, builds)
    slow(monkeypatch, convert_gguf.GGUFTensors, "get", clock, 3)  # 3 s per tensor
    model = convert_gguf.load_gguf(path)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "m.gguf: build the tokenizer: 10 s elapsed",
        "m.gguf: build the tokenizer: done in 12 s",
    ]
    tensors = len(model.state_dict())
    assert lines[2].startswith("load m.gguf: dequantize: ") and "tensor" in lines[2]
    assert lines[-1].startswith("load m.gguf: dequantize: ") and lines[-1].endswith(
        f"done in {3 * tensors} s"
    )
    assert len(lines) >= 2 + 3 * tensors // 10  # a line at least every 10 s of the load
    for _ in range(3):  # `info` reads the header for the skeleton, the size, the stream decision
        convert_gguf.read_gguf_model(path)
    convert_gguf.read_gguf_tokenizer(path)
    assert builds == ["gguf_tokenizer"]  # built once
    assert "tokenizer" not in capsys.readouterr().err
    write_gguf(path, tok_files, add_bos=True)  # the file rewritten with other tokenizer metadata: rebuilt
    assert convert_gguf.read_gguf_tokenizer(path).add_bos and builds == ["gguf_tokenizer"] * 2


def test_the_sink_probe_reports_its_batches(clock, monkeypatch, capsys):
    """The probe (100 windows of 64 tokens) took ~17 s per real model without a line."""
    from diffquant.profile.runner import sink_probe

    model = load_model("init:baseline:tiny")

    def five_seconds(*_):
        for _ in range(5):
            clock.now += 1.0
            P.beat()

    model.register_forward_pre_hook(five_seconds)
    assert sink_probe(model, "stdlib:validation", None, desc="m: sink probe") is not None
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("m: sink probe: ") for line in lines)
    assert "batch" in lines[0] and lines[-1].endswith("done in 35 s")  # 7 batches of 16 windows, 5 s each


def test_profile_says_when_writing_a_profile_takes_long(tmp_path, clock, monkeypatch, capsys):
    """Two real models' every-site profiles took ~15 s of JSON writing without a line."""
    from diffquant.profile import runner

    slow(monkeypatch, runner, "profile_json", clock, 15)
    models = {"m": ("init:baseline:tiny", load_model("init:baseline:tiny"))}
    windows = dict(tokens=256, seq_len=64, batch_size=4, topk=10, attention=None)
    runner.profile_stage(models, data="stdlib:validation", sites="*", out=tmp_path, **windows)
    err = capsys.readouterr().err.splitlines()
    target = f"m: write {tmp_path / 'profile' / 'm'}.json"
    assert [line for line in err if line.startswith(target)] == [
        f"{target}: 10 s elapsed",
        f"{target}: done in 15 s",
    ]


def test_plot_reports_within_a_family_while_its_figures_take_long(tmp_path, clock, monkeypatch, capsys):
    """`plot` of a two-model real profile drew for 3 min 41 s with one line per family: a family whose
    figures take long now says how many it has written, and which, every interval."""
    from diffquant.plots import run as plots_run
    from diffquant.profile.runner import profile_stage

    models = {"m": ("init:baseline:tiny", load_model("init:baseline:tiny"))}
    windows = dict(tokens=256, seq_len=64, batch_size=4, topk=10, attention=None)
    profile_stage(models, data="stdlib:validation", sites="*", out=tmp_path, **windows)
    capsys.readouterr()
    real = plots_run.FIGURES["hist"]

    def slow_hist(ctx):
        for drawn in real(ctx):
            for _ in range(6):  # six seconds a figure
                clock.now += 1.0
                P.beat()
            yield drawn

    monkeypatch.setitem(plots_run.FIGURES, "hist", slow_hist)
    records = plots_run.render_run(tmp_path, what="hist", dpi=20)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "plot: hist: drawing (family 1 of 1)"
    within = err[1:]
    assert len(within) >= 2 and all(line.startswith("plot: hist: ") for line in within)
    assert "figure" in within[0] and "(last hist-" in within[-1]
    assert within[-1].startswith(f"plot: hist: {len(records)} figure") and "done in" in within[-1]


def test_quick_steps_print_nothing(tmp_path, tok_files, clock, capsys):  # noqa: F811
    """The same steps on a small model at full speed (the fake clock standing still): no line."""
    path = write_gguf(tmp_path / "q.gguf", tok_files)
    convert_gguf.load_gguf(path)
    from diffquant.profile.runner import profile_stage, sink_probe

    model = load_model("init:baseline:tiny")
    sink_probe(model, "stdlib:validation", None)
    profile_stage(
        {"m": ("init:baseline:tiny", model)}, data="stdlib:validation", tokens=64, seq_len=32, batch_size=4,
        sites="*", topk=10, attention=None, out=tmp_path,
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "tokenizer" not in err and "dequantize" not in err and "sink probe" not in err
    assert "write" not in err
