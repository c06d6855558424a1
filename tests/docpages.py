"""The documentation pages (README.md and docs/*.md) and the example blocks in them, for the tests that check
an example against what its command prints (tests/test_readme.py, tests/test_device_map.py).

An example may move from one page to another; the tests find it by its prompt line in whichever page holds
it, and fail when no page does (a test that silently checks nothing is worse than none) or when two pages
do (one of the copies would go unchecked).
"""

from __future__ import annotations

import re
from collections.abc import Callable
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
