"""Tables that fit the terminal by continuing below instead of cutting.

A rich ``Table`` wider than the terminal squeezes its columns until cells are cut short with an
ellipsis, and a narrow one can lose columns altogether: in an 80-column terminal an operator
could no longer read a URL, a tenant name or a count. ``FitTable`` renders as one table when it
fits; otherwise as several stacked tables, each repeating the key columns (what a row is about),
so every cell is printed whole. A key too long even for that folds onto the next line rather
than being cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Cell = str | Text
Justify = Literal["left", "right", "center"]
# wide enough that a table's measurement is its natural width, not the terminal's
_UNBOUNDED = 1_000_000


@dataclass
class FitTable:
    """``title`` and ``columns`` as rich's ``Table``; the first ``keys`` columns are repeated in
    each part. ``table`` holds the keyword arguments of every part's ``Table`` (its style)."""

    title: str
    columns: list[tuple[str, Justify]]
    keys: int = 1
    table: dict[str, Any] = field(default_factory=dict)
    rows: list[list[Cell]] = field(default_factory=list)

    def add_row(self, *cells: Cell) -> None:
        self.rows.append(list(cells))

    def part(self, cols: list[int], title: str) -> Table:
        t = Table(title=title, **self.table)
        for i in cols:
            head, justify = self.columns[i]
            if i < self.keys:
                t.add_column(head, justify=justify, overflow="fold")
            else:
                t.add_column(head, justify=justify, no_wrap=True, min_width=len(head),
                             overflow="fold")
        for r in self.rows:
            t.add_row(*(r[i] for i in cols))
        return t

    def parts(self, console: Console, options: ConsoleOptions) -> list[Table]:
        """The fewest parts, in column order, each no wider than ``options.max_width`` (a part
        holds the keys and at least one more column, whatever its width)."""
        keys = list(range(min(self.keys, len(self.columns))))
        rest = list(range(len(keys), len(self.columns)))
        wide = options.update_width(_UNBOUNDED)

        def width(cols: list[int]) -> int:
            return Measurement.get(console, wide, self.part(cols, self.title)).maximum

        groups: list[list[int]] = []
        for i in rest:
            if groups and width(keys + groups[-1] + [i]) <= options.max_width:
                groups[-1].append(i)
            else:
                groups.append([i])
        if not groups:
            return [self.part(keys, self.title)]
        return [self.part(keys + g, self.title if n == 0 else f"{self.title} (continued)")
                for n, g in enumerate(groups)]

    def __rich_console__(self, console: Console, options: ConsoleOptions
                         ) -> Iterator[RenderableType]:
        yield from self.parts(console, options)

