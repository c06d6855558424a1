"""The README's example outputs are what the commands print: the zoo table and the whole demo.

A number in the README that no test reproduces can drift from the code unnoticed; these tests rerun the
commands and compare their output with the README's blocks line for line (paths and the wall time aside).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diffquant.cli import main

README = Path(__file__).parents[1] / "README.md"


def readme_block(command: str) -> list[str]:
    """The lines of the README code block that starts with ``$ COMMAND`` (without that prompt line)."""
    lines = README.read_text().splitlines()
    start = lines.index(f"$ {command}")
    end = next(i for i in range(start, len(lines)) if lines[i] == "```")
    return lines[start + 1 : end]


def test_zoo_table_is_what_the_cards_say(capsys):
    assert main(["zoo"]) == 0
    assert capsys.readouterr().out.splitlines() == readme_block("diffquant zoo")


@pytest.mark.slow
def test_demo_prints_what_the_readme_shows(tmp_path, capsys):
    """Every line of the README's demo output, numbers included (Table 5, locations, both sweep grids,
    figure count), equals the demo's own output; only the run folder and the wall time differ."""
    out = tmp_path / "demo"
    assert main(["--quiet", "demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.replace(str(out), "runs/demo").splitlines()
    want = readme_block("diffquant demo")
    timing = re.compile(r"^demo finished in \d+ s; ")
    assert [line for line in printed if not timing.match(line)] == [
        line for line in want if not timing.match(line)
    ]
    assert sum(bool(timing.match(line)) for line in want) == 1
