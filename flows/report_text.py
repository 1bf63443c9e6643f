"""The reports' text primitives: numbers, first lines, markdown and plain-text tables."""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence


def format_bytes(n: int | None) -> str:
    """``123456`` -> ``"123,456"``; None -> ``"—"``."""
    return "—" if n is None else f"{int(n):,}"


def format_seconds(s: float | None) -> str:
    """Seconds with two decimals; None -> ``"—"``."""
    return "—" if s is None else f"{float(s):.2f}"


def first_line(text: str | None, limit: int = 160) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters ("" for None)."""
    if not text:
        return ""
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """A GitHub markdown table; cells are escaped (``|``, newlines), ``right`` columns right-aligned."""
    head = "| " + " | ".join(md_cell(h) for h in headers) + " |"
    rule = "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"
    body = ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """A fixed-width plain-text table for terminals (``right`` columns right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *(line(r) for r in cells[1:])])


def md_cell(value: Any) -> str:
    """A table cell's text: ``\\``, ``|`` and a ``_`` that could start or end emphasis
    escaped, one line.  (Markdown the cell means, like ``**total**``, stays.)"""
    text = str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    return EMPHASIS_UNDERSCORE.sub(r"\\_", text)


#: An underscore not between two letters or digits: only those can open or close
#: emphasis (CommonMark and GFM), so ``buffer_mutation`` needs no escape.
EMPHASIS_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
