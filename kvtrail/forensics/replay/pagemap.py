"""Page ids to array entries for a pool whose page ids are sparse.

A pool's :class:`~kvtrail.forensics.replay.pagestate.PageState` arrays have a *dense* part, where entry p
is page p (every ordinary pool: its pages are handed out from the lowest ids up), and, where events name
page ids far beyond the pages the pool uses (one event naming page 2^30 - 1), a *sparse* part after it:
one entry per such page, in the order the pages were first named, found through a dict.

The handlers index the page arrays with page ids (``pool.owner[pages]``, ``pool.gen[pages] += 1``).
While a pool has sparse entries its arrays are :class:`ByPage` views, which turn the page ids of an
index into entries (the dense ones unchanged); a pool without sparse entries keeps plain arrays, so
the common case costs nothing. The compiled kernel never sees the sparse part: it gets the dense part
alone and hands any event naming a page beyond it to the handlers.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PageSlots:
    """Where each page id lives in a pool's arrays: page p at entry p below ``dense_n``; a sparse page at the
    entry ``entry`` gives it (``dense_n`` + the order in which it was first named)."""

    def __init__(self, dense_n: int, sparse_pages: list[int] | None = None):
        self.dense_n = dense_n
        self.entry: dict[int, int] = {p: dense_n + k for k, p in enumerate(sparse_pages or ())}

    def __len__(self) -> int:
        """Sparse pages."""
        return len(self.entry)

    def pages(self) -> np.ndarray:
        """The sparse pages in entry order."""
        return np.fromiter(self.entry, np.int64, len(self.entry))

    def add(self, pages: list[int]) -> None:
        """Give new sparse pages (none known, all at least ``dense_n``) the next entries."""
        first = self.dense_n + len(self.entry)
        self.entry.update(zip(pages, range(first, first + len(pages))))

    def known(self, pages: np.ndarray) -> np.ndarray:
        """Whether each page (all at least ``dense_n``) has an entry."""
        return np.fromiter(map(self.entry.__contains__, pages.tolist()), bool, len(pages))

    def one(self, p: int) -> int:
        return p if p < self.dense_n else self.entry[p]

    def many(self, pages: np.ndarray) -> np.ndarray:
        """The entries of ``pages`` (a KeyError names a page no event placed: a bug, not input)."""
        out = np.array(pages, np.int64)
        hi = out >= self.dense_n
        if hi.any():
            out[hi] = np.fromiter(map(self.entry.__getitem__, out[hi].tolist()), np.int64, int(hi.sum()))
        return out


class ByPage(np.ndarray):
    """A page array indexed by page id: the first index of every subscript (an int or an integer array)
    is turned into entries by the pool's :class:`PageSlots`; slices and masks index entries as they are.
    What it returns is a plain array; arrays derived from it whole (``astype``, comparisons) are plain
    arrays of entries too."""

    _slots: PageSlots | None = None

    @classmethod
    def over(cls, raw: np.ndarray, slots: PageSlots) -> ByPage:
        out = raw.view(cls)
        out._slots = slots
        return out

    def __array_finalize__(self, obj: object) -> None:
        self._slots = None

    def _key(self, key: Any) -> Any:
        slots = self._slots
        if slots is None:
            return key
        if isinstance(key, tuple):
            return (self._key(key[0]), *key[1:]) if key else key
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return slots.one(int(key))
        if key is None or key is Ellipsis or isinstance(key, slice):
            return key
        arr = np.asarray(key)
        return arr if arr.dtype == np.bool_ else slots.many(arr)

    def __getitem__(self, key: Any) -> Any:
        return np.asarray(self)[self._key(key)]

    def __setitem__(self, key: Any, value: Any) -> None:
        np.asarray(self)[self._key(key)] = value
