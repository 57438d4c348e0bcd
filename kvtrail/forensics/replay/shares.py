"""Prefix-cache holders of one pool's pages, in numpy arrays the compiled fast path can read and change.

A page the radix cache hands out (a ``prefix_hit`` allocation) may be held by many requests at once,
each with the block hash its hit was keyed by. :class:`PrefixShares` keeps those (page, request,
block hash) entries in slots: an open-addressed index (linear probing, deletion by backward shift, no
tombstones) finds a (page, request) entry in a few probes, and a doubly linked chain per page (its
head in the pool's ``share_head`` array, its length in ``nshared``) lists a page's holders.

The functions below are the reference statement of the layout; the kernels
(:mod:`kvtrail.forensics.replay.kernels`) carry compiled copies, and a parity test runs both on the same
operations. Both must give every entry the same slot, so the two paths leave identical arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INITIAL_SLOTS = 4096  # a pool's first capacity (doubled when full)
_MIX_PAGE = 0x9E3779B1  # odd multipliers below 2**32: with ids below 2**31 no product leaves int64
_MIX_REQUEST = 0x85EBCA6B


def share_bucket(p: int, r: int, mask: int) -> int:
    """Home position of entry (page p, request r) in an index of ``mask + 1`` positions."""
    x = (p * _MIX_PAGE) ^ (r * _MIX_REQUEST)
    return (x ^ (x >> 29)) & mask


def share_find(index, s_page, s_req, p: int, r: int) -> int:
    """Slot of entry (p, r), or -1."""
    mask = index.shape[0] - 1
    i = share_bucket(p, r, mask)
    while True:
        s = index[i]
        if s < 0:
            return -1
        if s_page[s] == p and s_req[s] == r:
            return s
        i = (i + 1) & mask


def share_insert(index, s_page, s_req, s_hash, s_prev, s_next, meta, head, nshared, p: int, r: int, h: int) -> int:
    """Add entry (p, r) with block hash h (not present; a free slot left): returns its slot.

    ``meta`` is [first free slot, slots in use]; free slots are linked through ``s_next``.
    """
    s = meta[0]
    meta[0] = s_next[s]
    meta[1] += 1
    s_page[s], s_req[s], s_hash[s] = p, r, h
    first = head[p]
    s_prev[s], s_next[s] = -1, first
    if first >= 0:
        s_prev[first] = s
    head[p] = s
    nshared[p] += 1
    mask = index.shape[0] - 1
    i = share_bucket(p, r, mask)
    while index[i] >= 0:
        i = (i + 1) & mask
    index[i] = s
    return s


def share_remove(index, s_page, s_req, s_prev, s_next, meta, head, nshared, s: int) -> None:
    """Remove the entry in slot s."""
    p = int(s_page[s])
    before, after = s_prev[s], s_next[s]
    if before >= 0:
        s_next[before] = after
    else:
        head[p] = after
    if after >= 0:
        s_prev[after] = before
    nshared[p] -= 1
    mask = index.shape[0] - 1
    i = share_bucket(p, int(s_req[s]), mask)
    while index[i] != s:
        i = (i + 1) & mask
    j = i
    while True:  # backward shift: entries after the hole that may live in it move into it
        j = (j + 1) & mask
        t = index[j]
        if t < 0:
            break
        k = share_bucket(int(s_page[t]), int(s_req[t]), mask)
        if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
            index[i] = t
            i = j
    index[i] = -1
    s_next[s] = meta[0]
    meta[0] = s
    meta[1] -= 1


# The compiled copies (find, insert, remove), once kvtrail.forensics.replay.kernels is imported (numba
# installed, the fast path in use): the Python path's drops and hits call them too, ~2x faster per call than
# the reference above, leaving the same slots. They take plain arrays only: a pool with sparse pages
# (PageState's ByPage views) keeps the reference.
_COMPILED: tuple[Any, Any, Any] | None = None


def register_compiled(find: Any, insert: Any, remove: Any) -> None:
    global _COMPILED
    _COMPILED = (find, insert, remove)


def _plain(*arrays: np.ndarray) -> bool:
    return all(type(a) is np.ndarray for a in arrays)


class PrefixShares:
    """The (page, request, block hash) entries of one pool; pages' chain heads and counts live in its PageState."""

    def __init__(self, num_slots: int | None = None):
        num_slots = INITIAL_SLOTS if num_slots is None else num_slots
        assert num_slots > 0 and num_slots & (num_slots - 1) == 0, "slots: a power of two"
        self.index = np.full(2 * num_slots, -1, np.int32)
        self.page = np.zeros(num_slots, np.int32)
        self.req = np.zeros(num_slots, np.int32)
        self.bhash = np.zeros(num_slots, np.int64)
        self.prev = np.full(num_slots, -1, np.int32)
        self.next = np.arange(1, num_slots + 1, dtype=np.int32)
        self.next[-1] = -1
        self.meta = np.array([0, 0], np.int64)

    @property
    def num_slots(self) -> int:
        return len(self.page)

    @property
    def num_entries(self) -> int:
        return int(self.meta[1])

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(index, page, req, bhash, prev, next, meta): what the kernel takes."""
        return self.index, self.page, self.req, self.bhash, self.prev, self.next, self.meta

    def find(self, p: int, r: int) -> int:
        fn = share_find if _COMPILED is None else _COMPILED[0]
        return fn(self.index, self.page, self.req, int(p), int(r))

    def insert(self, head: np.ndarray, nshared: np.ndarray, p: int, r: int, h: int) -> None:
        if self.num_entries == self.num_slots:
            self._grow()
        fn = _COMPILED[1] if _COMPILED is not None and _plain(head, nshared) else share_insert
        fn(
            self.index,
            self.page,
            self.req,
            self.bhash,
            self.prev,
            self.next,
            self.meta,
            head,
            nshared,
            int(p),
            int(r),
            int(h),
        )

    def remove(self, head: np.ndarray, nshared: np.ndarray, s: int) -> None:
        fn = _COMPILED[2] if _COMPILED is not None and _plain(head, nshared) else share_remove
        fn(self.index, self.page, self.req, self.prev, self.next, self.meta, head, nshared, int(s))

    def chain(self, head: np.ndarray, p: int) -> list[int]:
        """The slots of page p's entries, newest first."""
        out = []
        s = int(head[p])
        while s >= 0:
            out.append(s)
            s = int(self.next[s])
        return out

    def _grow(self) -> None:
        """Twice the slots, entries kept in their slots, the index rebuilt in slot order (the kernel
        stops before it would need a slot more, so only this code ever grows)."""
        n = self.num_slots
        for name in ("page", "req", "bhash", "prev"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.full(n, -1 if name == "prev" else 0, old.dtype)]))
        self.next = np.concatenate([self.next, np.arange(n + 1, 2 * n + 1, dtype=np.int32)])
        self.next[-1] = -1
        self.meta[0] = n  # the pool was full: the new slots are the free ones
        self.index = np.full(4 * n, -1, np.int32)
        mask = len(self.index) - 1
        # Inserting in ascending home order puts entry k at max(home k, position of k-1 + 1): a running max.
        x = (self.page.astype(np.int64)[:n] * _MIX_PAGE) ^ (self.req.astype(np.int64)[:n] * _MIX_REQUEST)
        home = (x ^ (x >> 29)) & mask
        order = np.argsort(home, kind="stable")
        at = np.maximum.accumulate(home[order] - np.arange(n)) + np.arange(n)
        if at[-1] <= mask:
            self.index[at] = order
            return
        for s in order.tolist():  # the last ones wrap around: insert one by one
            i = int(home[s])
            while self.index[i] >= 0:
                i = (i + 1) & mask
            self.index[i] = s
