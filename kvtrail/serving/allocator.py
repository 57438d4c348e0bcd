"""The paged KV allocator and the request-to-token table, shaped like SGLang's.

:class:`PageAllocator` hands out page ids ``1..num_pages``; page 0 is the padding page and is never
handed out. It moves ids only: the K/V buffers (:mod:`kvtrail.serving.kvpool`) are never zeroed, so a
reused page still holds its last owner's K/V until someone writes it.

:class:`ReqToTokenTable` is SGLang's ``req_to_token``: one row per request, giving the page behind
each token position. Freed rows keep their contents, as in SGLang.

This module needs numpy only (no torch), so the audit package's simulator can share the allocator.
"""

from __future__ import annotations

from collections import deque

import numpy as np

REUSE_POLICIES = ("lowest", "lifo")
_MAX_PAGES = 2**31 - 2  # page ids are int32 on the wire and in the audit store


class PageAllocator:
    """A free list over page ids ``1..num_pages`` with SGLang's two reuse orders.

    ``reuse="lowest"`` (SGLang in PD mode, ``need_sort=True``): freed pages are *staged*; only when an
    allocation needs more than the free list holds are they merged back and the list sorted, so the
    lowest ids come out first. ``reuse="lifo"`` (SGLang outside PD): the free list is a stack and the
    most recently freed pages are handed out again first, in the order they were freed.

    Every page carries a hold count. A free of a page that is not held, or a page listed twice in one
    free, raises ``ValueError`` naming the page: normal use can never hold a page twice. Only
    :meth:`force_alloc`, a fault-injection tool, can.
    """

    def __init__(self, num_pages: int, reuse: str = "lowest"):
        if num_pages < 1:
            raise ValueError("num_pages: must be >= 1")
        if num_pages > _MAX_PAGES:
            raise ValueError("num_pages: page ids must fit in int32")
        if reuse not in REUSE_POLICIES:
            raise ValueError(f"reuse: {reuse!r} is not one of {', '.join(REUSE_POLICIES)}")
        self.num_pages = int(num_pages)
        self.reuse = reuse
        self._holds = np.zeros(self.num_pages + 1, dtype=np.int32)
        self._slot = np.zeros(self.num_pages + 1, dtype=np.int32)  # scratch for the duplicate check
        self.used = 0  # distinct pages held
        self.merges = 0  # times the staged pages were merged into the free list (reuse="lowest")
        if reuse == "lowest":
            self._free = np.arange(1, self.num_pages + 1, dtype=np.int32)
            self._head = 0
            self._staged: list[np.ndarray] = []
        else:
            # A stack whose top is at the end: pages come off the top in ascending order at first.
            self._stack = np.arange(self.num_pages, 0, -1, dtype=np.int32)
            self._top = self.num_pages

    @property
    def available(self) -> int:
        """Pages that can be allocated now (free plus staged)."""
        return self.num_pages - self.used

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` pages (int32, in page-table order), or None when the pool cannot supply them."""
        if n < 0:
            raise ValueError("n: must be >= 0")
        if n > self.num_pages - self.used:
            return None
        if self.reuse == "lowest":
            if n > len(self._free) - self._head:
                self._merge()
            out = self._free[self._head:self._head + n].copy()
            self._head += n
        else:
            top = self._top
            out = self._stack[top - n:top][::-1].copy()
            self._top = top - n
        self._holds[out] = 1
        self.used += n
        return out

    def free(self, pages) -> None:
        """Drop one hold on each page; pages no longer held return to the pool (staged with "lowest")."""
        pages = self._checked(pages, "free")
        if pages.size == 0:
            return
        held = self._holds[pages] > 0
        if not held.all():
            raise ValueError(f"free: page {int(pages[np.flatnonzero(~held)[0]])} is not allocated")
        self._holds[pages] -= 1
        released = pages[self._holds[pages] == 0]  # a force-allocated page is released by its last holder
        self.used -= released.size
        if released.size == 0:
            return
        if self.reuse == "lowest":
            self._staged.append(released.copy())
        else:
            top = self._top
            self._stack[top:top + released.size] = released[::-1]
            self._top = top + released.size

    def force_alloc(self, pages) -> None:
        """Fault injection only: mark ``pages`` allocated even if they are already held.

        A page already held gains a second hold (the "double allocation" fault: two requests now own
        it, and it returns to the pool only after both free it). A free page is taken out of the free
        list, wherever it sits. Normal serving never calls this.
        """
        pages = self._checked(pages, "force_alloc")
        fresh = pages[self._holds[pages] == 0]
        if fresh.size:
            self._take(fresh)
        self._holds[pages] += 1
        self.used += fresh.size

    def hold_count(self, page: int) -> int:
        """How many holders ``page`` has (0 = free, 2+ only after :meth:`force_alloc`)."""
        if not 1 <= page <= self.num_pages:
            raise ValueError(f"page: {page} is out of range 1..{self.num_pages}")
        return int(self._holds[page])

    def _checked(self, pages, what: str) -> np.ndarray:
        pages = np.asarray(pages).reshape(-1)
        if pages.size == 0:
            return pages.astype(np.int32)
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi > self.num_pages:
            # Range first: numpy would wrap a negative id and fail on one past the end.
            raise ValueError(f"{what}: page {lo if lo < 1 else hi} is out of range 1..{self.num_pages}")
        pages = pages.astype(np.int32, copy=False)
        # O(n) duplicate check (np.unique sorts; long-context frees list tens of thousands of pages):
        # scatter each entry's position; a page listed twice keeps only its last position.
        idx = np.arange(pages.size, dtype=np.int32)
        self._slot[pages] = idx
        if not np.array_equal(self._slot[pages], idx):
            raise ValueError(f"{what}: a page appears twice in one call")
        return pages

    def _take(self, pages: np.ndarray) -> None:
        """Remove free pages from wherever they wait (free list, staged lists or stack)."""
        if self.reuse == "lowest":
            rest = self._free[self._head:]
            self._free = rest[~np.isin(rest, pages)]
            self._head = 0
            self._staged = [s[~np.isin(s, pages)] for s in self._staged]
        else:
            kept = self._stack[:self._top]
            kept = kept[~np.isin(kept, pages)]
            self._stack[:kept.size] = kept
            self._top = kept.size

    def _merge(self) -> None:
        self._free = np.sort(np.concatenate([self._free[self._head:], *self._staged]))
        self._head = 0
        self._staged = []
        self.merges += 1


class ReqToTokenTable:
    """SGLang's ``req_to_token``: rows ``1..num_rows`` (row 0 is padding), one per running request.

    A row is the request's ordered page list plus its ``seq_len``; token position ``p`` lives in slot
    ``p % page_size`` of page ``pages[p // page_size]``. :meth:`free_row` does not clear the row and
    :meth:`alloc_row` only resets the page count and ``seq_len``: the old page ids stay in the row
    (see :meth:`raw_row`), as SGLang leaves freed rows' contents in place.
    """

    def __init__(self, num_rows: int, max_context_tokens: int, page_size: int):
        if num_rows < 1:
            raise ValueError("num_rows: must be >= 1")
        if page_size < 1:
            raise ValueError("page_size: must be >= 1")
        if max_context_tokens < 1:
            raise ValueError("max_context_tokens: must be >= 1")
        self.num_rows = int(num_rows)
        self.page_size = int(page_size)
        self.max_pages = self.pages_for(max_context_tokens)
        self._rows = np.zeros((self.num_rows + 1, self.max_pages), dtype=np.int32)
        self._num_pages = np.zeros(self.num_rows + 1, dtype=np.int64)
        self._seq_len = np.zeros(self.num_rows + 1, dtype=np.int64)
        self._live = np.zeros(self.num_rows + 1, dtype=bool)
        self._free_rows = deque(range(1, self.num_rows + 1))  # taken from the front, returned at the back

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold ``tokens`` tokens (``ceil(tokens / page_size)``)."""
        if tokens < 0:
            raise ValueError("tokens: must be >= 0")
        return -(-int(tokens) // self.page_size)

    def alloc_row(self) -> int | None:
        """A free row (its page count and ``seq_len`` reset to 0), or None when all rows are taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.popleft()
        self._live[row] = True
        self._num_pages[row] = 0
        self._seq_len[row] = 0
        return row

    def free_row(self, row: int) -> None:
        """Return ``row``; its contents stay as they are."""
        self._check_live(row)
        self._live[row] = False
        self._free_rows.append(row)

    def append_pages(self, row: int, pages) -> None:
        """Add pages at the end of the row's page list."""
        self._check_live(row)
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        n = int(self._num_pages[row])
        if n + pages.size > self.max_pages:
            raise ValueError(f"pages: row {row} would hold {n + pages.size} pages, max is {self.max_pages}")
        self._rows[row, n:n + pages.size] = pages
        self._num_pages[row] = n + pages.size

    def set_seq_len(self, row: int, seq_len: int) -> None:
        """Set the tokens the row covers; at most its pages' capacity."""
        self._check_live(row)
        cap = int(self._num_pages[row]) * self.page_size
        if not 0 <= seq_len <= cap:
            raise ValueError(f"seq_len: {seq_len} is outside 0..{cap} (row {row}'s pages)")
        self._seq_len[row] = seq_len

    def pages(self, row: int) -> np.ndarray:
        """The row's page list (int32, a copy)."""
        self._check_row(row)
        return self._rows[row, :self._num_pages[row]].copy()

    def seq_len(self, row: int) -> int:
        self._check_row(row)
        return int(self._seq_len[row])

    def token_slots(self, row: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Flat slot ids ``page * page_size + p % page_size`` of positions ``[start, end)`` (default: seq_len)."""
        self._check_row(row)
        end = int(self._seq_len[row]) if end is None else end
        cap = int(self._num_pages[row]) * self.page_size
        if not 0 <= start <= end <= cap:
            raise ValueError(f"end: positions [{start}, {end}) are outside row {row}'s 0..{cap}")
        pos = np.arange(start, end, dtype=np.int64)
        return self._rows[row, pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size

    def raw_row(self, row: int) -> np.ndarray:
        """Every entry of the row, stale ones past its page count included (for forensics)."""
        self._check_row(row)
        return self._rows[row].copy()

    def _check_row(self, row: int) -> None:
        if not 1 <= row <= self.num_rows:
            raise ValueError(f"row: {row} is out of range 1..{self.num_rows}")

    def _check_live(self, row: int) -> None:
        self._check_row(row)
        if not self._live[row]:
            raise ValueError(f"row: {row} is not allocated")
