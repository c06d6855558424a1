"""One exception type for everything a user can get wrong.

The CLI turns a :class:`DiffquantError` into one line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class DiffquantError(ValueError):
    """A problem with the user's input (file, key, field, value), described in one line."""


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """``did you mean 'x'?`` (or ``'x' or 'y'``) for a mistyped name among ``choices`` (the closest by
    :func:`difflib.get_close_matches`), or '' when none is close: the hint a one-line error gives."""
    import difflib  # noqa: PLC0415 (only when a name was mistyped)

    close = difflib.get_close_matches(str(word), list(dict.fromkeys(choices)), n=2, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
