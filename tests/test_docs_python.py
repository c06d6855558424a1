"""docs/python.md: every ```python block runs as it stands (each in a fresh namespace, in an empty folder),
and prints what the page says it prints."""

from __future__ import annotations

import re

import pytest
from docpages import DOCS

from diffquant import progress as P

PAGE = DOCS / "python.md"


def python_blocks() -> list[tuple[str, str]]:
    """(the heading above it, the code) of every ```python block of the page, in order."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", PAGE.read_text(), re.M | re.S):
        if match[1]:
            heading = match[1].lstrip("# ")
        else:
            blocks.append((heading, match[2]))
    return blocks


def test_the_page_has_its_recipes():
    assert [h for h, _ in python_blocks()] == [
        "Silence the progress lines",
        "Compare several plans on one model",
        "Quantize one model and print the error report",
        "Profile a layer range",
    ]


@pytest.mark.parametrize(("heading", "code"), python_blocks(), ids=lambda v: v.split()[0] if " " in v else "")
def test_every_python_block_runs(heading, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(P.QUIET_ENV, raising=False)  # the first block sets it: undone after the test
    exec(compile(code, f"docs/python.md ({heading})", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    if heading.startswith("Compare"):
        assert (
            "attn-logits-int4" in out and "w8a8" in out and (tmp_path / "runs/compare/results.json").is_file()
        )
    elif heading.startswith("Quantize"):
        assert out.splitlines()[0].split() == ["site", "SQNR", "dB", "cosine", "rel", "L1", "RMSE"]
        assert "(model output logits)" in out
    elif heading.startswith("Profile"):
        assert out.splitlines()[0] == "['3', '4', '5']" and "hidden states" in out
    elif heading.startswith("Silence"):
        assert P.is_quiet()  # what the block set
