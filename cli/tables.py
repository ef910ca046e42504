"""Rows of names and numbers on the console, never cut: a table when it fits whole, else one record
per row. Worker, model, queue and request names can be longer than a terminal is wide, and a name
shown as ``w0123…`` or folded inside a narrow column cannot be copied or grepped.

Rich only; never imports the worker or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

UNBOUNDED_WIDTH = 1 << 20


def print_line(console: Console, text: str) -> None:
    """``text`` on one line as it is: no markup, never cut or broken (a terminal wraps it, a file keeps it whole)."""
    console.print(Text(text), soft_wrap=True)


def print_rows(console: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
               right_aligned: Sequence[str] = ()) -> None:
    """``title``, then ``rows`` as a table when every cell fits the console whole; else per row its
    first cell on a line of its own, then the other cells as ``column value`` on one indented line
    (both printed as :func:`print_line` does)."""
    print_line(console, title)
    table = Table(*columns, title=None)
    for column in table.columns:
        column.justify = "right" if column.header in right_aligned else "left"
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    # NOTE: measured as if the console were unbounded (a measurement is clamped to the width it is given).
    natural = Measurement.get(console, console.options.update_width(UNBOUNDED_WIDTH), table)
    if natural.maximum <= console.width:
        console.print(table)
        return
    for first, *rest in rows:
        print_line(console, first)
        print_line(console, "  " + "  ".join(f"{column} {cell}" for column, cell in zip(columns[1:], rest)))
