"""Plain-text tables that a person reads at a glance (no dependencies)."""

from __future__ import annotations

import shutil
import sys
import textwrap


def terminal_width() -> int | None:
    """The terminal's columns; None when the output is not a terminal (piped output stays as it is)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def table(headers: list[str], rows: list[list], widths: dict[int, int] | None = None) -> str:
    """Left-aligned columns; column i wraps at widths[i] characters when given."""
    widths = widths or {}
    cells = [[textwrap.wrap(str(c), widths[i]) or [""] if i in widths else [str(c)] for i, c in enumerate(r)]
             for r in [headers, *rows]]
    col = [max(len(line) for row in cells for line in row[i]) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        for k in range(max(len(c) for c in row)):
            parts = [(c[k] if k < len(c) else "").ljust(col[i]) for i, c in enumerate(row)]
            out.append("  ".join(parts).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in col))
    return "\n".join(out)
