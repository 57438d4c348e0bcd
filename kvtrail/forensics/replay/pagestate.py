"""The page state of one node's KV pool as the replay engine keeps it: numpy arrays indexed by page id.

The common case (one exclusive holder, one last writer) is a handful of array entries per page, so an
event costs a few vectorised operations. The rare states live in small dicts beside the arrays: pages
held by several requests at once (double ownership), pages shared as prefix-cache hits (with the
block hash each hit was keyed by), and the pages a request already released (for F7's wording, kept
for the most recent requests only so that memory stays bounded on long histories).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# Released page lists kept per pool (entries); older requests' lists are forgotten first.
RELEASED_CAP_PAGES = 1 << 22


class PageState:
    """Per-page arrays of one pool (index 0 is the padding page)."""

    def __init__(self, num_pages: int):
        n = num_pages + 1
        self.owner = np.full(n, -1, np.int32)      # exclusive holder (request index)
        self.gen = np.zeros(n, np.int64)           # bumped on every exclusive allocation
        self.alloc_req = np.full(n, -1, np.int32)  # request of the latest exclusive allocation
        self.alloc_growth = np.zeros(n, bool)      # ... and whether it was a decode_growth page
        self.alloc_ev = np.full((n, 2), -1, np.int64)
        self.nshared = np.zeros(n, np.int32)       # prefix-cache holders
        self.writer = np.full(n, -1, np.int32)
        self.write_ns = np.zeros(n, np.int64)
        self.write_gen = np.full(n, -1, np.int64)
        self.write_ev = np.full((n, 2), -1, np.int64)
        self.digest = np.zeros(n, np.uint64)       # page digest the last writer recorded
        self.has_digest = np.zeros(n, bool)
        self.bhash = np.zeros(n, np.int64)         # block hash (content key) the last writer stored
        self.has_bhash = np.zeros(n, bool)
        self.extra: dict[int, set[int]] = {}       # further exclusive holders: double ownership (F6)
        self.shared: dict[int, dict[int, int]] = {}  # page -> {request: block hash of its hit}
        self.released: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._released_pages = 0

    def holders(self, p: int) -> set[int]:
        out = set(self.extra.get(p, ())) | set(self.shared.get(p, ()))
        if self.owner[p] >= 0:
            out.add(int(self.owner[p]))
        return out

    def held_by(self, pages: np.ndarray, r: int) -> np.ndarray:
        held = self.owner[pages] == r
        for i in np.flatnonzero(~held):
            p = int(pages[i])
            held[i] = r in self.extra.get(p, ()) or r in self.shared.get(p, ())
        return held

    def hit_hashes(self, pages: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(is a prefix-cache hit of r, the hit's block hash) per page."""
        is_hit = np.zeros(len(pages), bool)
        hashes = np.zeros(len(pages), np.int64)
        if self.nshared[pages].any():
            for i, p in enumerate(pages.tolist()):
                h = self.shared.get(p, {}).get(r)
                if h is not None:
                    is_hit[i], hashes[i] = True, h
        return is_hit, hashes

    def share(self, p: int, r: int, block_hash: int) -> None:
        s = self.shared.setdefault(p, {})
        if r not in s:
            self.nshared[p] += 1
        s[r] = block_hash

    def drop(self, p: int, r: int) -> None:
        """Remove request r from the holders of page p."""
        s = self.shared.get(p)
        if s is not None and r in s:
            del s[r]
            self.nshared[p] -= 1
            if not s:
                del self.shared[p]
        if r in self.extra.get(p, ()):
            self.extra[p].discard(r)
        if self.owner[p] == r:
            more = self.extra.get(p)
            self.owner[p] = more.pop() if more else -1
        if not self.extra.get(p, True):
            del self.extra[p]

    def remember_release(self, r: int, pages: np.ndarray) -> None:
        self.released.setdefault(r, []).append(pages)
        self._released_pages += len(pages)
        while self._released_pages > RELEASED_CAP_PAGES and len(self.released) > 1:
            _, old = self.released.popitem(last=False)
            self._released_pages -= sum(len(a) for a in old)

    def released_by(self, r: int, pages: np.ndarray) -> np.ndarray:
        lists = self.released.get(r)
        return np.isin(pages, np.concatenate(lists)) if lists else np.zeros(len(pages), bool)

    def fit(self, pages: np.ndarray) -> None:
        need = int(pages.max()) + 1
        if need > len(self.owner):
            self.grow(need)

    def grow(self, n: int) -> None:
        """Extend every page array to n entries with the values of an unused page."""
        fresh = PageState(n - 1)
        for name, arr in vars(self).items():
            if isinstance(arr, np.ndarray):
                new = getattr(fresh, name)
                new[: len(arr)] = arr
                setattr(self, name, new)
