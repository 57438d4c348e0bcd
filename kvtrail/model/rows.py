"""The scalar values of a fed table's rows, made Python values only for the rows the monitors' steps read.

A commit of a few thousand page events leaves most of its rows to the compiled page steps, which read
numpy arrays; only the rest (the steps that are not page steps, the page steps the kernel leaves to
Python, and each release kept for a late write to name) need an event's scalars as Python values.
:class:`Rows` makes those a group of rows at a time through Arrow (``take`` of each column, then
``to_pylist``). Where a table needs many of its rows (a history of reads and prefix hits, read whole by
``model validate``), it turns whole columns into Python lists once instead, the cheaper way for most of
a table. Either way a row's values are the ones a whole column's ``to_pylist`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import filled

# Rows made one at a time (ones no fetch asked for) before whole columns are cheaper; and the share of
# a table one fetch may ask for before they are.
_SINGLE_MISSES = 32
_SUBSET_SHARE = 8


def pylist(arr: pa.Array) -> list:
    """A scalar column as Python values (``to_pylist``'s), cheaper for the shapes a commit has: an all-null
    column as Nones, a string column through its distinct values (a commit repeats a few kinds, nodes
    and purposes, and each request's id, thousands of times), an integer column with no nulls
    through numpy."""
    n, type_ = len(arr), arr.type
    if arr.null_count == n:
        return [None] * n
    if pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_dictionary(type_):
        d = arr if pa.types.is_dictionary(type_) else arr.dictionary_encode()
        distinct = np.array([*d.dictionary.to_pylist(), None], dtype=object)  # index -1: null
        return distinct[filled(d.indices, -1)].tolist()
    if pa.types.is_integer(type_) and not arr.null_count:
        return arr.to_numpy().tolist()
    return arr.to_pylist()


class Rows:
    """Per row of ``table``, the tuple of its ``names`` columns as Python values (None where a column is
    null or absent). ``rows[n]`` gives one row's; :meth:`fetch` makes many at once (call it first where
    the rows are known)."""

    def __init__(self, table: pa.Table | None = None, names: Sequence[str] = ()):
        self._arrays: list[pa.Array | None] = []
        self._num_rows = 0 if table is None else table.num_rows
        if table is not None:
            for name in names:
                col = table.column(name) if table.schema.get_field_index(name) >= 0 else None
                if col is None or col.null_count == len(col):
                    self._arrays.append(None)
                else:
                    self._arrays.append(col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
        self._made: dict[int, tuple] = {}
        self._lists: list[list] | None = None  # whole columns, once many rows are asked for
        self._misses = 0

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, n: int) -> tuple:
        row = self._made.get(n)
        if row is not None:
            return row
        if not 0 <= n < self._num_rows:
            raise IndexError(f"row {n} out of range 0..{self._num_rows - 1}")
        if self._lists is None:
            self._misses += 1
            if self._misses <= _SINGLE_MISSES:
                self.fetch([n])  # (which may take whole columns, for a short table)
            else:
                self._whole()
            row = self._made.get(n)
            if row is not None:
                return row
        assert self._lists is not None
        return tuple([c[n] for c in self._lists])  # (not kept: made again is as cheap as looked up)

    def fetch(self, rows: Sequence[int] | np.ndarray) -> None:
        """Make the values of ``rows`` (row numbers; those made before are left as they are)."""
        if self._lists is not None:
            return  # every row is at hand
        made = self._made
        todo = [n for n in dict.fromkeys(np.asarray(rows, np.int64).tolist()) if n not in made]
        if not todo:
            return
        if min(todo) < 0 or max(todo) >= self._num_rows:
            raise IndexError(f"row out of range 0..{self._num_rows - 1}")
        if len(todo) * _SUBSET_SHARE > self._num_rows:
            self._whole()
            return
        index = pa.array(todo, pa.int64())
        columns = [[None] * len(todo) if a is None else a.take(index).to_pylist() for a in self._arrays]
        made.update(zip(todo, zip(*columns)) if columns else ((n, ()) for n in todo))

    def _whole(self) -> None:
        n = self._num_rows
        self._lists = [[None] * n if a is None else pylist(a) for a in self._arrays]
