"""One exception type for everything a user can get wrong.

The CLI turns a :class:`DiffquantError` into one line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class DiffquantError(ValueError):
    """A problem with the user's input (file, key, field, value), described in one line."""
