"""The one error of the escaped-grammar conversion."""

from __future__ import annotations


class GrammarConversionError(ValueError):
    """The grammar uses a construct that has no escaped form here (the message names it),
    or is not a valid grammar."""
