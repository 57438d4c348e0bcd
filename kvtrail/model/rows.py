"""The scalar values of a fed table's rows, made Python values only for the rows the monitors' steps read.

A commit of a few thousand page events leaves most of its rows to the compiled page steps, which read
numpy arrays; only the rest (the steps that are not page steps, the page steps the kernel leaves to
Python, and each release kept for a late write to name) need an event's scalars as Python values.
:class:`Rows` makes those, a group of rows at a time through Arrow (``take`` of each column, then
``to_pylist``), and keeps them until the table is done: the same values a whole column's ``to_pylist``
gives, for a fraction of the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


class Rows:
    """Per row of ``table``, the tuple of its ``names`` columns as Python values (None where a column is
    null or absent). ``rows[n]`` makes one row's; :meth:`fetch` makes many at once (do that first where
    the rows are known)."""

    def __init__(self, table: pa.Table | None = None, names: Sequence[str] = ()):
        self._arrays: list[pa.Array | None] = []
        self._num_rows = 0 if table is None else table.num_rows
        if table is not None:
            for name in names:
                col = table.column(name) if name in table.column_names else None
                if col is None or col.null_count == len(col):
                    self._arrays.append(None)
                else:
                    self._arrays.append(col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
        self._made: dict[int, tuple] = {}

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, n: int) -> tuple:
        row = self._made.get(n)
        if row is None:
            self.fetch([n])
            row = self._made[n]
        return row

    def fetch(self, rows: Sequence[int] | np.ndarray) -> None:
        """Make the values of ``rows`` (row numbers; those made before are left as they are)."""
        made = self._made
        todo = [n for n in dict.fromkeys(np.asarray(rows, np.int64).tolist()) if n not in made]
        if not todo:
            return
        if min(todo) < 0 or max(todo) >= self._num_rows:
            raise IndexError(f"row out of range 0..{self._num_rows - 1}")
        index = pa.array(todo, pa.int64())
        columns = [[None] * len(todo) if a is None else a.take(index).to_pylist() for a in self._arrays]
        made.update(zip(todo, zip(*columns)) if columns else ((n, ()) for n in todo))
