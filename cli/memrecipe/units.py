"""Memory sizes: GB = 10^9 bytes, GiB = 2^30; both read, GiB written."""

from __future__ import annotations

import re

from .errors import RecipeError

GiB = 2**30

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, what: str = "memory size") -> int:
    """'24GB' -> 24e9, '24 GiB' / '24GiB' -> 24 x 2^30, '1.5TiB'; anything else is refused."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise RecipeError(f"{what} {text!r} is not a size: write a number and a unit, like 24GiB, 80GB or 512GiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])

