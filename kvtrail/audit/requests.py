"""The writer's side of the request dictionary (store format 3, :mod:`kvtrail.audit.layout`): which
number each event's request identity gets.

An identity is the four request fields exactly as one event carried them. The writer remembers the
identities it numbered (up to :data:`REQUEST_CACHE_MAX`; past that it forgets them all), so a request's
later events reuse its number; an identity it does not remember gets the next free number, which
costs one dictionary row and nothing else (the dictionary need not be unique). Numbers are
remembered only once the batch that made them has committed.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import REQUEST_NAMES
from kvtrail.audit.layout import REQUESTS_SCHEMA

# Request identities the writer remembers (their dictionary numbers); past this many it forgets them
# all and numbers the next ones anew (a repeated identity costs one dictionary row, nothing else).
REQUEST_CACHE_MAX = 1 << 20
_KEY_LIMIT = 1 << 62  # a batch's combined request-field codes stay below this (int64)


class RequestNumbers:
    """The identities one writer numbered, and the next free number of its store's dictionary."""

    def __init__(self, next_no: int) -> None:
        self.known: dict[tuple, int] = {}
        self.next_no = next_no

    def number(self, t: pa.Table) -> tuple[pa.Array, pa.Table | None, dict[tuple, int]]:
        """Each row's request number (null: no request field), the dictionary rows new in this batch,
        and the identities they number (remembered once the batch commits)."""
        n = t.num_rows
        key = np.zeros(n, np.int64)
        radix = 1
        cols = [t.column(name) for name in REQUEST_NAMES]
        for col in cols:
            if col.null_count == n:
                continue
            enc = col.combine_chunks().dictionary_encode()
            size = len(enc.dictionary) + 1
            if radix * size >= _KEY_LIMIT:  # many distinct values: renumber the key so far densely first
                dense = pa.array(key).dictionary_encode()  # (0 stays 0: no request field so far)
                key = np.where(key != 0, dense.indices.to_numpy().astype(np.int64) + 1, 0)
                radix = len(dense.dictionary) + 1
            key += (pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1) * radix
            radix *= size
        if radix == 1:
            return pa.nulls(n, pa.int64()), None, {}
        ids = pa.array(key).dictionary_encode()
        inv = ids.indices.to_numpy()
        # Arrow numbers distinct values in order of first occurrence: a row is a first one where the
        # running maximum of the numbers grows.
        top = np.maximum.accumulate(inv)
        first = np.flatnonzero(np.concatenate(([True], top[1:] > top[:-1])))
        sel = pa.array(first)
        # One 4-tuple per distinct identity; an absent column is None throughout without a conversion.
        values = [repeat(None) if c.null_count == n else c.take(sel).to_pylist() for c in cols]
        idents = list(zip(*values))
        get = self.known.get
        number = np.array([get(ident, -1) for ident in idents], np.int64)
        # Key 0 is the rows without request fields: they keep -1 (no number).
        fresh = np.flatnonzero((number < 0) & (ids.dictionary.to_numpy() != 0))
        number[fresh] = self.next_no + np.arange(len(fresh), dtype=np.int64)
        new = dict(zip([idents[j] for j in fresh.tolist()], number[fresh].tolist()))
        per_row = number[inv]
        request_no = pa.array(per_row, mask=per_row < 0)
        if not len(fresh):
            return request_no, None, new
        take = pa.array(first[fresh])
        rows = {"request_no": pa.array(number[fresh])}
        for name, col in zip(REQUEST_NAMES, cols):
            rows[name] = col.take(take)
        return request_no, pa.table(rows).cast(REQUESTS_SCHEMA), new

    def remember(self, new: dict[tuple, int]) -> None:
        if not new:
            return
        if len(self.known) + len(new) > REQUEST_CACHE_MAX:
            self.known = {}
        self.known.update(new)
        self.next_no = max(new.values()) + 1
