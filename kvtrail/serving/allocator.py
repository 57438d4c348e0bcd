"""The paged KV allocator, shaped like SGLang's.

:class:`PageAllocator` hands out page ids ``1..num_pages``; page 0 is the padding page and is never
handed out. It moves ids only: the K/V buffers (:mod:`kvtrail.serving.kvpool`) are never zeroed, so a
reused page still holds its last owner's K/V until someone writes it.

This module needs numpy only (no torch), so the fleet simulator (:mod:`kvtrail.sim`) can share the allocator.
"""

from __future__ import annotations

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
            out = self._free[self._head : self._head + n].copy()
            self._head += n
        else:
            top = self._top
            out = self._stack[top - n : top][::-1].copy()
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
            self._stack[top : top + released.size] = released[::-1]
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
            rest = self._free[self._head :]
            self._free = rest[~np.isin(rest, pages)]
            self._head = 0
            self._staged = [s[~np.isin(s, pages)] for s in self._staged]
        else:
            kept = self._stack[: self._top]
            kept = kept[~np.isin(kept, pages)]
            self._stack[: kept.size] = kept
            self._top = kept.size

    def _merge(self) -> None:
        self._free = np.sort(np.concatenate([self._free[self._head :], *self._staged]))
        self._head = 0
        self._staged = []
        self.merges += 1
