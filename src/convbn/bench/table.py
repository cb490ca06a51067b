"""Printing benchmark rows: one rich table / markdown table shape for every runner."""
from __future__ import annotations

from typing import Collection, List, Optional, Sequence

from convbn.extras import require

__all__ = ["print_rich_table", "markdown_table", "require_rich"]


def require_rich(needed_by: str) -> None:
    """Raise a clear ``ImportError`` when ``rich`` (the tables and progress bars) is missing.

    The library itself does not need rich; ``convbn bench`` and ``convbn demo`` do.

    Args:
        needed_by: what needs it, for the message.

    Raises:
        ImportError: rich is not installed; the message names the extra to install (``convbn[cli]``).
    """
    require("rich", needed_by, "cli")


def print_rich_table(
    headers: Sequence[str], right: Collection[str], rows: Sequence[Sequence[str]], title: str, width: int = 220
) -> None:
    """Print ``rows`` (already formatted cells) under ``headers``; ``right`` columns right-aligned.

    Printed to a pipe or file the console is ``width`` columns wide, so tables are not
    squeezed into 80.
    """
    require_rich("printing a benchmark table")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right" if h in right else "left", overflow="fold")
    for cells in rows:
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=width)
    console.print(table)


def markdown_table(headers: Sequence[str], right: Collection[str], rows: Sequence[Sequence[str]],
                   escape: Optional[str] = "|") -> str:
    """A GitHub markdown table; ``|`` inside headers and cells is escaped."""

    def esc(text: str) -> str:
        return text.replace("|", "\\|") if escape else text

    lines: List[str] = [
        "| " + " | ".join(esc(h) for h in headers) + " |",
        "|" + "".join("---:|" if h in right else "---|" for h in headers),
    ]
    lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in rows]
    return "\n".join(lines)
