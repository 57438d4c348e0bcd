"""The page state of one node's KV pool as the replay engine keeps it: numpy arrays indexed by page id.

The common case (one exclusive holder, one last writer) is a handful of array entries per page, so an
event costs a few vectorised operations. The rare states live in small dicts beside the arrays: pages
held by several requests at once (double ownership), the pages a request already released (for F7's wording, kept
for the most recent requests only so that memory stays bounded on long histories), and the late writes
(F7) with what they overwrote, so that the later reader's F1 can say its own KV was corrupted. Pages
shared as prefix-cache hits (with the block hash each hit was keyed by) are frequent on a fleet with a
radix cache: they live in arrays too (:class:`~kvtrail.forensics.replay.shares.PrefixShares`), so that
the compiled path replays hits and their reads.

The arrays cost memory in proportion to the pages events use, not to the pool the node_config declares
nor to the highest page id named. A pool starts small (:meth:`PageState.for_pool`); a page beyond its
arrays either extends the *dense* part (entry p is page p, grown doubling) while that part stays at most
twice the pages the pool has used (or below :data:`DENSE_FLOOR`, or inside a declared pool of at most
:data:`DECLARED_DENSE_MAX` pages), or gets an entry of its own in a *sparse* part after it
(:mod:`kvtrail.forensics.replay.pagemap`): a node declaring 2^25 pages that uses a few hundred costs
kilobytes, and so does one event naming page 2^30 - 1. Entries therefore number at most
``max(DENSE_FLOOR, 2 * U, P + 1) + 2 * S + 16``, U the pages allocated, written or shared, S the pages
placed sparse and P the pages the node_config declares where at most DECLARED_DENSE_MAX (else 0). The
dense part grows over sparse pages it comes to cover (they move to their own entry), so an ordinary pool
keeps plain arrays and the compiled path (which sees the dense part only).

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
from kvtrail.forensics.replay.pagemap import ByPage, PageSlots
from kvtrail.forensics.replay.shares import PrefixShares

# Released page lists kept per pool (entries); older requests' lists are forgotten first.
RELEASED_CAP_PAGES = 1 << 22
# Pages a new pool's arrays hold before any event uses more (then they grow, doubling).
INITIAL_PAGES = 1 << 10
# The dense part may always grow to this many entries (~7 MB with the kernel's scratch); beyond it only while
# it stays at most twice the pages used.
DENSE_FLOOR = 1 << 16
# A pool whose node_config declares at most this many pages may have them all dense (~25 MB at most with the
# kernel's scratch) once its events name pages anywhere in it: an allocator handing out pages from all over
# the pool would otherwise leave the compiled path for Python on every event naming a high page while the
# pool fills up. Larger declared pools, and page ids beyond the declared pool, follow the rule above.
DECLARED_DENSE_MAX = 1 << 18


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
    # where each page id lives in the arrays (dense part, sparse part); see pagemap
    slots: PageSlots = field(default_factory=lambda: PageSlots(0), init=False)
    _used: tuple[int, int, int] = field(default=(-1, 0, 0), init=False)  # (dense_n, sparse pages, used) at a count
    declared: int = field(default=0, init=False)  # pages the node_config declares (0: not known, e.g. restored)

    def __post_init__(self) -> None:
        self.slots = PageSlots(len(self.owner))

    def __setstate__(self, state: dict) -> None:
        """Unpickled (a lake's partitions travel pickled): the views are made again over this PageSlots."""
        self.__dict__.update(state)
        self._wrap()

    @classmethod
    def empty(cls, num_pages: int) -> PageState:
        """A pool of ``num_pages`` unused, unwritten pages (plus the padding page)."""
        return cls(**{spec.name: spec.allocate(num_pages + 1) for spec in PAGE_ARRAYS})

    @classmethod
    def for_pool(cls, pool_pages: int) -> PageState:
        """The state of a new pool of ``pool_pages`` pages: its arrays start small and grow to the highest
        page id the events use (``reserve``), whatever the pool declares."""
        pool = cls.empty(max(0, min(pool_pages, INITIAL_PAGES)))
        pool.declared = pool_pages
        return pool

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
        head = self.raw("share_head")
        for e in np.flatnonzero(self.raw("nshared")).tolist():  # entries: the page is the shares' own key
            slots = self.shares.chain(head, e)[::-1]
            out[int(self.shares.page[slots[0]])] = {int(self.shares.req[s]): int(self.shares.bhash[s]) for s in slots}
        return dict(sorted(out.items()))

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

    def plain(self, pages: np.ndarray) -> np.ndarray:
        """Per page: no prefix-cache hit and no second holder shares it (its owner, if any, is its only holder)."""
        plain = self.nshared[pages] == 0
        if self.extra:
            plain &= ~np.fromiter(map(self.extra.__contains__, pages.tolist()), dtype=bool, count=len(pages))
        return plain

    def holders_of(self, pages: np.ndarray) -> set[int]:
        """The union of ``holders(p)`` over ``pages``; plain pages' owners taken at once."""
        plain = self.plain(pages)
        out = set(self.owner[pages[plain]].tolist())
        out.discard(-1)
        for p in pages[~plain].tolist():
            out |= self.holders(p)
        return out

    def drop_all(self, pages: np.ndarray, r: int) -> None:
        """``drop(p, r)`` for every p of ``pages`` in order: a page no prefix-cache hit and no second
        holder shares (most of them) needs only its owner cleared, for all such pages at once."""
        plain = self.plain(pages)
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
                total -= sum(map(len, old))
        self.released_pages = total

    def released_by(self, r: int, pages: np.ndarray) -> np.ndarray:
        lists = self.released.get(r)
        return np.isin(pages, np.concatenate(lists)) if lists else np.zeros(len(pages), bool)

    @property
    def dense_n(self) -> int:
        """Entries of the dense part: page p at entry p below it."""
        return self.slots.dense_n

    def fit(self, pages: np.ndarray) -> None:
        """Give every page id of ``pages`` (non-empty) an entry of the arrays. A page id beyond any plausible
        pool (a store written before ingest refused such pools) is a StoreError, not an allocation."""
        top = int(pages.max())
        if top < self.slots.dense_n:
            return
        if top > MAX_POOL_PAGES:
            raise StoreError(
                f"replay: page id {top} is beyond any plausible pool ({MAX_POOL_PAGES} pages); "
                "the store holds an event no engine recorded"
            )
        new = np.unique(pages[pages >= self.slots.dense_n])
        if len(self.slots):
            new = new[~self.slots.known(new)]
        if not len(new):
            return
        allowed = self._dense_allowed(len(new))
        near = new[new < allowed]
        if len(near):  # the dense part grows (doubling, within what is allowed; a moderate declared pool whole)
            top = self._declared_top()
            grow_to = top if int(near[-1]) < top else min(2 * self.slots.dense_n, allowed)
            self._layout(max(int(near[-1]) + 1, grow_to))
            new = new[new >= self.slots.dense_n]
        if len(new):
            self._add_sparse(new.tolist())

    def reserve(self, max_page: int) -> None:
        """Give page id ``max_page`` an entry (every id below it too where the dense part grows over it)."""
        if max_page >= self.slots.dense_n:
            self.fit(np.array([max_page]))

    def grow(self, num_entries: int) -> None:
        """Extend the dense part to ``num_entries`` entries with the values of an unused page."""
        if num_entries > self.slots.dense_n:
            self._layout(num_entries)

    def _dense_allowed(self, num_new: int) -> int:
        """How far the dense part may reach: twice the pages used (allocated, written or shared in the
        dense part, plus the sparse pages and ``num_new`` more), at least DENSE_FLOOR, and the whole declared
        pool where that is at most DECLARED_DENSE_MAX pages. The dense part's count is taken again when it
        has grown or the sparse pages have doubled since."""
        d, num_sparse = self.slots.dense_n, len(self.slots)
        at_d, at_sparse, used = self._used
        if at_d != d or num_sparse > 2 * at_sparse + 64:
            gen, ev, shared = (np.asarray(getattr(self, n))[:d] for n in ("gen", "write_ev", "nshared"))
            used = int(np.count_nonzero((gen > 0) | (ev[:, 0] >= 0) | (shared > 0)))
            self._used = (d, num_sparse, used)
        return min(max(DENSE_FLOOR, 2 * (used + num_sparse + num_new), self._declared_top()), MAX_POOL_PAGES + 1)

    def _declared_top(self) -> int:
        """Entries of the whole declared pool (pages 0..declared) where it is at most DECLARED_DENSE_MAX
        pages, else 0."""
        return self.declared + 1 if self.declared <= DECLARED_DENSE_MAX else 0

    def _layout(self, dense_n: int, sparse_cap: int | None = None) -> None:
        """Move the arrays to a dense part of ``dense_n`` entries and room for ``sparse_cap`` sparse pages
        (default: twice those left); sparse pages the dense part now covers move to their own entry."""
        old = self.slots
        pages = old.pages()
        keep = pages >= dense_n
        left = pages[keep]
        if sparse_cap is None:
            sparse_cap = 2 * len(left) + 16 if len(left) else 0
        slots = PageSlots(dense_n, left.tolist())
        src = np.arange(old.dense_n, old.dense_n + len(pages))
        dst = slots.many(pages)
        n = min(old.dense_n, dense_n)
        for spec in PAGE_ARRAYS:
            raw = np.asarray(getattr(self, spec.name))
            new = spec.allocate(dense_n + sparse_cap)
            new[:n] = raw[:n]
            new[dst] = raw[src]
            setattr(self, spec.name, new)
        self.slots = slots
        self._wrap()

    def _add_sparse(self, pages: list[int]) -> None:
        """Give new page ids (none known, all beyond the dense part) entries in the sparse part."""
        need = self.slots.dense_n + len(self.slots) + len(pages)
        if need > self.num_entries:  # room doubles: O(S) moves in all
            self._layout(self.slots.dense_n, 2 * (len(self.slots) + len(pages)) + 16)
        self.slots.add(pages)  # the views share this PageSlots: they see the new pages at once
        if not isinstance(self.owner, ByPage):
            self._wrap()

    def _wrap(self) -> None:
        """Plain arrays while every page is dense; :class:`ByPage` views (page ids to entries) otherwise."""
        for spec in PAGE_ARRAYS:
            raw = np.asarray(getattr(self, spec.name))
            setattr(self, spec.name, ByPage.over(raw, self.slots) if len(self.slots) else raw)

    @classmethod
    def restore(cls, arrays: dict[str, np.ndarray], dense_n: int, sparse_pages: list[int]) -> PageState:
        """A pool from its raw arrays (entries, as :meth:`raw` gives them) and where its sparse pages live."""
        pool = cls(**{spec.name: arrays[spec.name] for spec in PAGE_ARRAYS})
        pool.slots = PageSlots(dense_n, sparse_pages)
        pool._wrap()
        return pool

    def raw(self, name: str) -> np.ndarray:
        """Page array ``name`` as a plain array of entries (see :meth:`page_of_entries`)."""
        return np.asarray(getattr(self, name))

    def page_of_entries(self) -> np.ndarray:
        """The page id of every entry of the arrays (-1: an entry no page has)."""
        out = np.full(self.num_entries, -1, np.int64)
        out[: self.slots.dense_n] = np.arange(self.slots.dense_n)
        out[self.slots.dense_n : self.slots.dense_n + len(self.slots)] = self.slots.pages()
        return out

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The page arrays of the dense part in :data:`PAGE_ARRAYS` order (what the compiled kernel takes:
        it hands any event naming a sparse page to the handlers)."""
        if not len(self.slots) and self.slots.dense_n == self.num_entries:
            return tuple(getattr(self, spec.name) for spec in PAGE_ARRAYS)
        return tuple(self.raw(spec.name)[: self.slots.dense_n] for spec in PAGE_ARRAYS)


# The page arrays in declaration order: the one list allocation, growth and the kernel follow.
PAGE_ARRAYS: tuple[ArraySpec, ...] = tuple(
    ArraySpec(f.name, *f.metadata["page_array"]) for f in fields(PageState) if "page_array" in f.metadata
)
