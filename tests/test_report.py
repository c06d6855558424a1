"""The run report: markdown and one self-contained HTML file, from a run folder's artifacts only."""

import base64
import re
import shutil
import subprocess

import pytest

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.eval.sweep import SweepSpec, run_sweep
from diffquant.eval.tasks import parse_task
from diffquant.io import load_model
from diffquant.io.artifacts import manifest, write_json_atomic
from diffquant.profile.runner import profile_stage
from diffquant.report import write_report

KINDS = ("baseline", "diff_v1", "diff_v2")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    text = run.parent / "text.txt"
    text.write_text("".join(f"value_{i} = compute({i}, scale={i % 7})\n" for i in range(300)))
    models = {k: (f"init:{k}:tiny", load_model(f"init:{k}:tiny")) for k in KINDS}
    profile_stage(
        models,
        data=str(text),
        tokens=256,
        seq_len=64,
        batch_size=4,
        sites="*",
        topk=10,
        attention=None,
        out=run,
    )
    spec = SweepSpec(
        models={k: f"init:{k}:tiny" for k in KINDS},
        plans=["attn-logits-int8", "attn-logits-int4"],
        tasks=[parse_task(f"bpb:data={text},tokens=128,seq_len=64")],
        calib_data=str(text),
        calib_tokens=64,
        calib_seq_len=64,
    )
    run_sweep(spec, run / "sweep")
    write_json_atomic(run / "manifest.json", manifest("run", recipe={"name": "t", "description": "test run"}))
    return run


def test_html_is_self_contained_and_lists_everything(run):
    md, page = write_report(run)
    doc = page.read_text()
    figures = sorted((run / "figures").glob("*.png"))
    assert figures
    # every image inline as a data URI; no other resource is referenced
    srcs = re.findall(r"src='([^']*)'", doc)
    assert len(srcs) == len(figures) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"(href|src)=['\"](?!data:)", doc)
    inline = {base64.b64decode(s.split(",", 1)[1]) for s in srcs}
    assert inline == {f.read_bytes() for f in figures}
    for caption in (
        "Table 5 view",
        "Hidden states per layer",
        "bpb: bits_per_byte",
        "Models and their scale",
    ):
        assert caption in doc and caption in md.read_text()
    assert "3B parameters and were trained on 350B tokens" in doc
    for kind in KINDS:
        assert kind in doc


def test_cli_report_and_errors(run, tmp_path, capsys):
    assert main(["report", str(run)]) == 0
    assert "report.html" in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2
    assert "expected profile/NAME.json" in capsys.readouterr().err
    with pytest.raises(DiffquantError, match="run folder not found"):
        write_report(tmp_path / "nope")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed")
def test_report_renders_headless(run, tmp_path):
    _, page = write_report(run)
    shot = tmp_path / "shot.png"
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'ud'}",
        f"--screenshot={shot}",
        "--window-size=1200,3000",
        page.as_uri(),
    ]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert shot.exists() and shot.stat().st_size > 10_000
    import matplotlib.image as mpimg

    pixels = mpimg.imread(shot)
    assert pixels[..., :3].std() > 0.05  # not a blank page
