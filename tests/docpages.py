"""The documentation pages (README.md and docs/*.md) and the example blocks in them, for the tests that check
an example against what its command prints (tests/test_readme.py, tests/test_device_map.py), and the
tables, output blocks and provenance marks of a page, for the test that ties its numbers to committed run
outputs (tests/test_docs_numbers.py).

An example may move from one page to another; the tests find it by its prompt line in whichever page holds
it, and fail when no page does (a test that silently checks nothing is worse than none) or when two pages
do (one of the copies would go unchecked).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def doc_block(prompt: str | Callable[[str], bool]) -> tuple[Path, str, list[str]]:
    """The code block in the documentation that contains the line ``$ PROMPT`` (or the first line that
    ``prompt`` accepts, when it is a predicate): (page, that line, the lines after it up to the closing
    fence). The block must be in exactly one page."""
    accept = prompt if callable(prompt) else (lambda line: line == f"$ {prompt}")
    found = []
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if accept(line):
                end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
                assert end is not None, f"{page.name}: the block of {line!r} is not closed"
                found.append((page, line, lines[i + 1 : end]))
                break
    where = ", ".join(p.relative_to(ROOT).as_posix() for p, _, _ in found)
    assert found, f"no page of the documentation (README.md, docs/*.md) shows the example {prompt!r}"
    assert len(found) == 1, f"the example {prompt!r} is shown in several pages ({where}); keep one"
    return found[0]


def code_block(page: Path, heading: str, language: str) -> str:
    """The first ```LANGUAGE block under the heading line ``heading`` of ``page`` (before the next heading of
    any level)."""
    lines = page.read_text().splitlines()
    assert heading in lines, f"{page.name}: no heading {heading!r}"
    start = lines.index(heading)
    for i in range(start + 1, len(lines)):
        assert not lines[i].startswith("#"), f"{page.name}: no ```{language} block under {heading!r}"
        if lines[i] == f"```{language}":
            end = lines.index("```", i + 1)
            return "\n".join(lines[i + 1 : end]) + "\n"
    raise AssertionError(f"{page.name}: no ```{language} block under {heading!r}")


FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a ``# comment`` in a shell block is no heading, and a code
    line is no link)."""
    return FENCE.sub("", page.read_text())


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links and images, in order."""
    return LINK.findall(prose(page))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


# ------------------------------------------------------------------------------------------ where numbers come from
# A docs page says where the numbers of a table, an output block or a passage come from with an HTML comment
# (invisible on GitHub) on the last non-blank line before it:
#
#   <!-- from: analysis/kvcache/smollm2/results.csv -->            re-derived from that committed file by the
#                                                                  deriver tests/test_docs_numbers.py names for it
#   <!-- from: FILE; the rest measured at commit abc1234, not re-run -->   cells the file cannot give are marked so
#   <!-- measured at commit abc1234, not re-run -->                a past measurement, recorded at that commit
#   <!-- checked by: tests/test_readme.py -->                       a test reruns the command and compares
#
# tests/test_docs_numbers.py requires one before every table and output block of the audited pages that
# holds measured numbers, a real commit in every "measured" mark and a deriver for every "from" file.

MARK = re.compile(
    r"^<!-- (?:from: (?P<path>[^\s;]+)(?:; the rest measured at commit (?P<rest>[0-9a-f]{7,40}), not re-run)?"
    r"|measured at commit (?P<commit>[0-9a-f]{7,40}), not re-run(?P<what>[^>]*?)"
    r"|checked by: (?P<test>tests/\S+\.py)) -->$"
)
MARKISH = re.compile(r"^<!-- (from|measured|checked)\b")
# a number on its own, not part of a word or a name (R1, w4a4, top-1), a ratio's 1.18x included
CELL_NUMBER = re.compile(r"(?<![\w.+-])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]\d+)?(?!\.?\d)(?![a-wyzA-Z_])")


@dataclass(frozen=True)
class Mark:
    """One provenance comment: ``path`` (a from: file), ``commit`` (measured at, or the rest of a from:
    table), ``test`` (checked by); ``line`` is the comment's 1-based line."""

    line: int
    path: str | None = None
    commit: str | None = None
    test: str | None = None


@dataclass(frozen=True)
class Numbers:
    """A table or an output block of a page: ``kind`` 'table' or 'block', ``line`` its first line (1-based;
    a block's opening fence), ``rows`` its cells (a table's header and body rows, the separator dropped; a
    block's lines, one cell each), ``mark`` the provenance comment before it, if any."""

    page: Path
    kind: str
    line: int
    rows: list[list[str]]
    mark: Mark | None

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def parse_mark(text: str, line: int) -> Mark | None:
    """The Mark a comment line states, None for any other line; a comment that starts like a mark but
    does not parse is an error (a typo would otherwise leave its table unmarked without a word)."""
    m = MARK.match(text.strip())
    if m is None:
        assert not MARKISH.match(text.strip()), (
            f"line {line}: a provenance comment that does not parse: {text!r}"
        )
        return None
    return Mark(line, m["path"], m["rest"] or m["commit"], m["test"])


def marks(page: Path) -> list[Mark]:
    """Every provenance comment of ``page`` (outside code blocks), in order."""
    out = []
    fenced = False
    for i, text in enumerate(page.read_text().splitlines(), start=1):
        if text.startswith("```"):
            fenced = not fenced
        elif not fenced and (mark := parse_mark(text, i)) is not None:
            out.append(mark)
    return out


def _mark_before(lines: list[str], index: int) -> Mark | None:
    """The mark on the last non-blank line before 0-based ``index``."""
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    return parse_mark(lines[j], j + 1) if j >= 0 else None


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def numbers(page: Path) -> list[Numbers]:
    """The tables and the output blocks (fences other than yaml / python / bash) of ``page``, in order."""
    lines = page.read_text().splitlines()
    out: list[Numbers] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            if lines[i][3:].strip() not in ("yaml", "python", "bash", "sh"):
                rows = [[text] for text in lines[i + 1 : end]]
                out.append(Numbers(page, "block", i + 1, rows, _mark_before(lines, i)))
            i = end + 1
        elif lines[i].startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            rows = [_cells(text) for text in lines[i:end] if not re.fullmatch(r"[|\s:-]+", text)]
            out.append(Numbers(page, "table", i + 1, rows, _mark_before(lines, i)))
            i = end
        else:
            i += 1
    return out


def measured(item: Numbers) -> bool:
    """True when a table has a cell that is a measured number (it starts with one and holds a decimal
    point), or a block has such a number on a line that is not a command (``$ ...``): what needs a mark.
    Plain integers (counts, sizes, choices like ``2, 4, 8``) and numbers inside words are not."""
    if item.kind == "table":
        return any(re.match(r"[-+x~]?\*{0,2}\d[\d,]*\.\d", cell) for row in item.rows[1:] for cell in row)
    return any(
        re.search(r"(?<![\w.])[-+]?\d[\d,]*\.\d+", row[0]) and not row[0].startswith("$ ")
        for row in item.rows
    )


def agrees(shown: str, value: float) -> bool:
    """Whether the number ``shown`` on a page (``+0.0624``, ``6,362,345.7``, ``1.00``, ``1024``) is ``value``
    rounded to the digits shown: the same decimals, the same sign (a zero may show either), and commas only
    where the page groups thousands."""
    mantissa, e, _ = shown.partition("e")
    digits = len(mantissa.partition(".")[2])
    text = f"{value:{'+' if shown.startswith('+') else ''}{',' if ',' in shown else ''}.{digits}{e or 'f'}}"
    if float(text.replace(",", "")) == 0.0:  # -0.0000 and +0.0000 are the same rounded zero
        return shown.lstrip("+-") == text.lstrip("+-")
    return shown == text


class Name(str):
    """A derived label cell: the name, bare or in backticks, optionally followed by `` (a note)``."""


def cell_agrees(shown: str, want: str | float | tuple[float, ...] | None) -> bool:
    """A page's cell against its derived value: None is an empty cell, a :class:`Name` a label, a str the
    exact text, a number (or a tuple of numbers, for ``-0.0001 ± 0.0006``) the cell's numbers in order, each
    :func:`agrees`, with only spaces, ``±``, ``%``, ``x``, ``/``, brackets and a unit (``MiB``, ``GiB``, ``s``,
    ``ms``) around them (bold ``**`` allowed)."""
    if want is None:
        return shown == ""
    if isinstance(want, Name):
        return re.fullmatch(rf"(`?){re.escape(want)}\1(?: \(.+\))?", shown) is not None
    if isinstance(want, str):
        return shown == want
    values = want if isinstance(want, tuple) else (want,)
    found = CELL_NUMBER.findall(shown)
    rest = CELL_NUMBER.sub("", shown)
    return (
        len(found) == len(values)
        and re.fullmatch(r"[\s±%x()*/]*(?:[KMG]i?B|ms|s)?[\s()*]*", rest) is not None
        and all(agrees(a, float(v)) for a, v in zip(found, values, strict=True))
    )


def block_numbers(item: Numbers) -> list[list[str]]:
    """An output block as one row whose cells are its numbers in order (command lines left out), for
    :func:`differences` against a deriver's list of values."""
    return [[n for row in item.rows if not row[0].startswith("$ ") for n in CELL_NUMBER.findall(row[0])]]


def differences(
    shown: list[list[str]], want: list[list[str | float | tuple[float, ...] | None]]
) -> list[str]:
    """Every cell where a page's rows and the derived rows differ (and a row count or width that does):
    empty when the page shows exactly what was derived. ``...`` in ``want`` is a cell the source does not
    give (the mark's "the rest measured at commit" covers it)."""
    out = []
    if len(shown) != len(want):
        out.append(f"{len(shown)} rows shown, {len(want)} derived")
    for r, (got, row) in enumerate(zip(shown, want, strict=False)):
        if len(got) != len(row):
            out.append(f"row {r}: {len(got)} cells shown, {len(row)} derived: {got}")
            continue
        for c, (cell, value) in enumerate(zip(got, row, strict=True)):
            if value is not Ellipsis and not cell_agrees(cell, value):
                out.append(f"row {r} cell {c}: shown {cell!r}, derived {value!r}")
    return out
