"""The one kind of error a user sees: a single line naming the problem and the fix."""

from __future__ import annotations

import difflib


class RecipeError(ValueError):
    """Bad user input (recipe, override, file, flag). The CLI prints it as one line, exit code 2."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' when a choice is close to `word`, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
