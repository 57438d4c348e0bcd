"""The page state of one node's KV pool as the replay engine keeps it: numpy arrays indexed by page id.

The common case (one exclusive holder, one last writer) is a handful of array entries per page, so an
event costs a few vectorised operations. The rare states live in small dicts beside the arrays: pages
held by several requests at once (double ownership), the pages a request already released (for F7's wording, kept
for the most recent requests only so that memory stays bounded on long histories), and the late writes
(F7) with what they overwrote, so that the later reader's F1 can say its own KV was corrupted. Pages
shared as prefix-cache hits (with the block hash each hit was keyed by) are frequent on a fleet with a
radix cache: they live in arrays too (:class:`~kvtrail.forensics.replay.shares.PrefixShares`), so that
the compiled path replays hits and their reads.

The arrays are sized by the highest page id events actually use, not by the pool the node_config
declares: a pool starts small (:meth:`PageState.for_pool`) and grows on demand, doubling, so that a
node declaring 2^25 pages that uses a few hundred costs kilobytes (``PageState.fit``/``reserve``; the
fast path reserves a batch's highest page id before its kernel runs).

Each page array is declared once, as a field of :class:`PageState` carrying its dtype and the value of
an unused page; :data:`PAGE_ARRAYS` lists those declarations in order, and allocation, growth and the
compiled kernel's arguments (:mod:`kvtrail.forensics.replay.kernels`) are all derived from it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from kvtrail.audit.validate import MAX_POOL_PAGES
from kvtrail.errors import StoreError
from kvtrail.forensics.replay.shares import PrefixShares

# Released page lists kept per pool (entries); older requests' lists are forgotten first.
RELEASED_CAP_PAGES = 1 << 22
# Pages a new pool's arrays hold before any event uses more (then they grow, doubling).
INITIAL_PAGES = 1 << 10


@dataclass(frozen=True)
class ArraySpec:
    """One per-page array: its name, dtype, the value of an unused page and its entries per page.

    ``width`` 2 is an event key per page: (producer_id, seq).
    """

    name: str
    dtype: type
    fill: int | bool
    width: int = 1

    def allocate(self, num_entries: int) -> np.ndarray:
        shape = (num_entries,) if self.width == 1 else (num_entries, self.width)
        return np.full(shape, self.fill, self.dtype)


def _array(dtype: type, fill: int | bool, width: int = 1) -> Any:
    """A PageState field holding a per-page array (its spec in the field's metadata)."""
    return field(metadata={"page_array": (dtype, fill, width)})


@dataclass(eq=False)
class PageState:
    """Per-page arrays of one pool (index 0 is the padding page); build one with :meth:`empty`."""

    owner: np.ndarray = _array(np.int32, -1)  # exclusive holder (request index)
    gen: np.ndarray = _array(np.int64, 0)  # bumped on every exclusive allocation
    alloc_req: np.ndarray = _array(np.int32, -1)  # request of the latest exclusive allocation
    alloc_growth: np.ndarray = _array(np.bool_, False)  # ... and whether it was a decode_growth page
    alloc_ev: np.ndarray = _array(np.int64, -1, 2)
    nshared: np.ndarray = _array(np.int32, 0)  # prefix-cache holders
    share_head: np.ndarray = _array(np.int32, -1)  # slot of the newest of them in `shares`
    writer: np.ndarray = _array(np.int32, -1)
    write_ns: np.ndarray = _array(np.int64, 0)
    write_gen: np.ndarray = _array(np.int64, -1)
    write_ev: np.ndarray = _array(np.int64, -1, 2)
    digest: np.ndarray = _array(np.uint64, 0)  # page digest the last writer recorded
    has_digest: np.ndarray = _array(np.bool_, False)
    bhash: np.ndarray = _array(np.int64, 0)  # block hash (content key) the last writer stored
    has_bhash: np.ndarray = _array(np.bool_, False)
    # further exclusive holders: double ownership (F6)
    extra: dict[int, set[int]] = field(default_factory=dict, init=False)
    # prefix-cache holders: (page, request) -> block hash of the hit
    shares: PrefixShares = field(default_factory=PrefixShares, init=False)
    released: OrderedDict[int, list[np.ndarray]] = field(default_factory=OrderedDict, init=False)
    # page -> (late write's event key, the page's writer before it, that write's allocation generation):
    # a late write (F7) and what it overwrote; current while the page's write_ev is still that key.
    late: dict[int, tuple[tuple[int, int], int, int]] = field(default_factory=dict, init=False)
    released_pages: int = field(default=0, init=False)  # entries in `released`

    @classmethod
    def empty(cls, num_pages: int) -> PageState:
        """A pool of ``num_pages`` unused, unwritten pages (plus the padding page)."""
        return cls(**{spec.name: spec.allocate(num_pages + 1) for spec in PAGE_ARRAYS})

    @classmethod
    def for_pool(cls, pool_pages: int) -> PageState:
        """The state of a new pool of ``pool_pages`` pages: its arrays start small and grow to the highest
        page id the events use (``reserve``), whatever the pool declares."""
        return cls.empty(max(0, min(pool_pages, INITIAL_PAGES)))

    @property
    def num_entries(self) -> int:
        """Entries of every page array (pages + the padding page)."""
        return len(self.owner)

    def holders(self, p: int) -> set[int]:
        out = set(self.extra.get(p, ())) | self.sharers(p)
        if self.owner[p] >= 0:
            out.add(int(self.owner[p]))
        return out

    def sharers(self, p: int) -> set[int]:
        """The requests holding page p as a prefix-cache hit."""
        if not self.nshared[p]:
            return set()
        return {int(self.shares.req[s]) for s in self.shares.chain(self.share_head, p)}

    def _share_slot(self, p: int, r: int) -> int:
        return self.shares.find(p, r) if self.nshared[p] else -1

    def held_by(self, pages: np.ndarray, r: int) -> np.ndarray:
        held = self.owner[pages] == r
        for i in np.flatnonzero(~held):
            p = int(pages[i])
            held[i] = r in self.extra.get(p, ()) or self._share_slot(p, r) >= 0
        return held

    def hit_hashes(self, pages: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(is a prefix-cache hit of r, the hit's block hash) per page."""
        is_hit = np.zeros(len(pages), bool)
        hashes = np.zeros(len(pages), np.int64)
        for i in np.flatnonzero(self.nshared[pages] > 0).tolist():
            s = self.shares.find(pages[i], r)
            if s >= 0:
                is_hit[i], hashes[i] = True, self.shares.bhash[s]
        return is_hit, hashes

    def share(self, p: int, r: int, block_hash: int) -> None:
        s = self._share_slot(p, r)
        if s >= 0:
            self.shares.bhash[s] = block_hash
        else:
            self.shares.insert(self.share_head, self.nshared, p, r, block_hash)

    def shared(self) -> dict[int, dict[int, int]]:
        """Every prefix-cache hit: page -> {request: block hash}, pages ascending, requests in hit order."""
        out = {}
        for p in np.flatnonzero(self.nshared).tolist():
            slots = self.shares.chain(self.share_head, p)[::-1]
            out[p] = {int(self.shares.req[s]): int(self.shares.bhash[s]) for s in slots}
        return out

    def drop(self, p: int, r: int) -> None:
        """Remove request r from the holders of page p."""
        s = self._share_slot(p, r)
        if s >= 0:
            self.shares.remove(self.share_head, self.nshared, s)
        if r in self.extra.get(p, ()):
            self.extra[p].discard(r)
        if self.owner[p] == r:
            more = self.extra.get(p)
            self.owner[p] = more.pop() if more else -1
        if not self.extra.get(p, True):
            del self.extra[p]

    def drop_all(self, pages: np.ndarray, r: int) -> None:
        """``drop(p, r)`` for every p of ``pages`` in order: a page no prefix-cache hit and no second
        holder shares (most of them) needs only its owner cleared, for all such pages at once."""
        plain = self.nshared[pages] == 0
        if self.extra:
            plain &= ~np.fromiter(map(self.extra.__contains__, pages.tolist()), dtype=bool, count=len(pages))
        mine = pages[plain]
        self.owner[mine[self.owner[mine] == r]] = -1
        for p in pages[~plain].tolist():  # drops of different pages do not interact: order kept per page
            self.drop(p, r)

    def remember_late(self, pages: np.ndarray, key: tuple[int, int]) -> None:
        """Before a late write lands on ``pages``: remember what each page held (see ``late``)."""
        for p, w, g in zip(pages.tolist(), self.writer[pages].tolist(), self.write_gen[pages].tolist()):
            self.late[p] = (key, w, g)

    def late_writes(self, pages: np.ndarray, reader: int) -> tuple[int, int]:
        """Of ``pages``: (how many were last written by a late write, and on how many of those the late
        write overwrote ``reader``'s own write of its current allocation of the page)."""
        num_late = num_lost = 0
        for p in pages.tolist():
            entry = self.late.get(p)
            if entry is None or entry[0] != (int(self.write_ev[p, 0]), int(self.write_ev[p, 1])):
                continue
            num_late += 1
            num_lost += entry[1] == reader and entry[2] == int(self.gen[p])
        return num_late, num_lost

    def remember_release(self, r: int, pages: np.ndarray) -> None:
        self.released.setdefault(r, []).append(pages)
        self.released_pages += len(pages)
        while self.released_pages > RELEASED_CAP_PAGES and len(self.released) > 1:
            _, old = self.released.popitem(last=False)
            self.released_pages -= sum(len(a) for a in old)

    def remember_releases(self, reqs: np.ndarray, flat: np.ndarray, ends: np.ndarray) -> None:
        """``remember_release(reqs[k], flat[ends[k - 1]:ends[k]])`` for every k in order (views of ``flat``)."""
        released, total, lo = self.released, self.released_pages, 0
        for r, hi in zip(reqs.tolist(), ends.tolist()):
            lst = released.get(r)
            if lst is None:
                released[r] = [flat[lo:hi]]
            else:
                lst.append(flat[lo:hi])
            total += hi - lo
            lo = hi
            while total > RELEASED_CAP_PAGES and len(released) > 1:
                _, old = released.popitem(last=False)
                total -= sum(len(a) for a in old)
        self.released_pages = total

    def released_by(self, r: int, pages: np.ndarray) -> np.ndarray:
        lists = self.released.get(r)
        return np.isin(pages, np.concatenate(lists)) if lists else np.zeros(len(pages), bool)

    def fit(self, pages: np.ndarray) -> None:
        """Make every page id of ``pages`` (non-empty) an index of the arrays."""
        self.reserve(int(pages.max()))

    def reserve(self, max_page: int) -> None:
        """Make page ids up to ``max_page`` indices of the arrays: grown at least twofold, so that a pool used
        up to page n costs O(n) memory and O(n) copying in all. A page id beyond any plausible pool (a store
        written before ingest refused such pools) is a StoreError, not an allocation of its size."""
        if max_page < self.num_entries:
            return
        if max_page > MAX_POOL_PAGES:
            raise StoreError(
                f"replay: page id {max_page} is beyond any plausible pool ({MAX_POOL_PAGES} pages); "
                "the store holds an event no engine recorded"
            )
        self.grow(min(max(max_page + 1, 2 * self.num_entries), MAX_POOL_PAGES + 1))

    def grow(self, num_entries: int) -> None:
        """Extend every page array to ``num_entries`` entries with the values of an unused page."""
        for spec in PAGE_ARRAYS:
            old = getattr(self, spec.name)
            new = spec.allocate(num_entries)
            new[: len(old)] = old
            setattr(self, spec.name, new)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The page arrays in :data:`PAGE_ARRAYS` order (what the compiled kernel takes)."""
        return tuple(getattr(self, spec.name) for spec in PAGE_ARRAYS)


# The page arrays in declaration order: the one list allocation, growth and the kernel follow.
PAGE_ARRAYS: tuple[ArraySpec, ...] = tuple(
    ArraySpec(f.name, *f.metadata["page_array"]) for f in fields(PageState) if "page_array" in f.metadata
)
