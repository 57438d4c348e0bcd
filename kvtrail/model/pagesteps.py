"""The monitors' page steps (:class:`PageSteps`, a base of :class:`~kvtrail.model.monitors.Monitors`):
each pool's page events of a fed table in order, runs of common ones compiled
(:func:`~kvtrail.model.pagekernel.run_pages`), every other one by its Python step here; and how reports
are kept (the first of each property, request and node, in the order one pass over the events would
make them, whichever pool's steps ran first)."""

from __future__ import annotations

import numpy as np

from kvtrail.model.pagekernel import (
    OP_ALLOC,
    OP_EVICT,
    OP_FREE,
    OP_GROWTH,
    OP_PREFIX,
    OP_READ,
    OP_UNVERIFIED,
    OP_WRITE,
    OP_WRITE_IN,
    run_pages,
)
from kvtrail.model.pool import FREE, NEVER, NO_HASH, UNKNOWN, Pool, Violation
from kvtrail.model.rows import Rows

_SCALARS = (
    "kind",
    "cluster",
    "node",
    "instance",
    "seq",
    "wall_ns",
    "request_id",
    "tenant_id",
    "purpose",
    "source",
    "num_tokens",
    "status",
    "is_last_chunk",
)
(K_KIND, K_CLUSTER, K_NODE, K_INSTANCE, K_SEQ, K_WALL_NS, K_REQUEST_ID, K_TENANT_ID, K_PURPOSE, K_SOURCE) = range(10)
K_NUM_TOKENS, K_STATUS, K_IS_LAST_CHUNK, K_PAGES, K_ROW, K_CODE, K_POS = range(10, 17)
COLUMNS = (*_SCALARS, "block_hashes")  # what the monitors read of an event, besides its pages
# one event as the monitors hold it: the scalars of _SCALARS, its pages, its row, its request's code and
# its position in the order it was fed in
Event = tuple


class PageSteps:
    """The page steps and the reports of :class:`~kvtrail.model.monitors.Monitors` (whose state they use)."""

    from_ns: int | None
    names: list[str | None]
    tenants: list[str | None]
    violations: list[Violation]
    reported: set
    cannot_tell: dict[tuple[str, str], list]
    _rows: Rows
    _values: np.ndarray
    _offs: list[int]
    _valid: np.ndarray
    _maxes: list[int]
    _repeats: set[int]
    _hash_lists: tuple
    _tenant_from: dict[int, int]
    _found: list[tuple]
    _at: tuple[int, int]

    def _tenant(self, code: int, pos: int) -> str | None:
        """The request's tenant as known at position ``pos`` of the table being fed."""
        return None if self._tenant_from.get(code, -1) > pos else self.tenants[code]

    def _event(self, n: int, code: int, pos: int) -> Event:
        pages = self._values[self._offs[n] : self._offs[n + 1]] if self._valid[n] else None
        return self._rows[n] + (pages, n, code, pos)

    def _run_pool(
        self, pool: Pool, ns_a: np.ndarray, poss_a: np.ndarray, codes_a: np.ndarray, ops_a: np.ndarray, *lists
    ) -> None:
        """One pool's page steps in order (row numbers, positions, request codes, steps): runs of common
        ones compiled, each other one in Python."""
        offsets, maxes, hvalues, hoffsets, hvalid = lists
        repeats = np.zeros(len(offsets) - 1, bool)
        repeats[list(self._repeats)] = True
        freed_flag = np.zeros(len(self.names) + 1, bool)
        freed_flag[list(pool.freed)] = True
        frees = np.zeros(len(ops_a), np.int64)
        offs, values, valid, rows, i = self._offs, self._values, self._valid, self._rows, 0
        rows.fetch(ns_a[ops_a == OP_FREE])  # a request's releases: each kept as an event
        while True:
            i, nf = run_pages(
                pool.owner,
                pool.writer,
                pool.whash,
                bool(pool.extra),
                bool(pool.hits),
                freed_flag,
                ops_a,
                codes_a,
                ns_a,
                values,
                offsets,
                valid,
                maxes,
                repeats,
                hvalues,
                hoffsets,
                hvalid,
                i,
                frees,
            )
            if nf:  # the releases it made, kept as the Python step keeps them (the event holds the same copy)
                made = frees[:nf]
                for n, c, pos in zip(ns_a[made].tolist(), codes_a[made].tolist(), poss_a[made].tolist()):
                    pages = values[offs[n] : offs[n + 1]].copy()
                    pool.freed.setdefault(c, []).append((pages, rows[n] + (pages if valid[n] else None, n, c, pos)))
            if i >= len(ops_a):
                return
            n, code, pos = int(ns_a[i]), int(codes_a[i]), int(poss_a[i])
            self._at = (pos, 0)
            _PAGE_STEPS[int(ops_a[i])](self, pool, self._event(n, code, pos))
            if code in pool.freed:
                freed_flag[code] = True
            i += 1

    def _hashes(self, e: Event) -> np.ndarray | None:
        values, offs, valid = self._hash_lists
        n = e[K_ROW]
        return values[offs[n] : offs[n + 1]] if valid[n] else None

    def _slots(self, pool: Pool, e: Event) -> np.ndarray:
        """Where the event's pages live in the pool's arrays."""
        return pool.slots(e[K_PAGES], self._maxes[e[K_ROW]])

    def _report(self, prop: str, e: Event, detail: str, key=None) -> None:
        if self.from_ns is not None and e[K_WALL_NS] < self.from_ns:
            return
        key = (prop, key if key is not None else (e[K_REQUEST_ID], e[K_NODE]))
        self._found.append((self._at, len(self._found), key, prop, e, detail))

    def _flush(self) -> None:
        """Keep the first report of each (property, request, node), in the order one pass would make them."""
        for _, _, key, prop, e, detail in sorted(self._found, key=lambda f: f[:2]):
            if key in self.reported:
                continue
            self.reported.add(key)
            producer = f"{e[K_CLUSTER]}/{e[K_NODE]}/{e[K_INSTANCE]}"
            v = Violation(prop, producer, e[K_SEQ], e[K_NODE], e[K_REQUEST_ID], detail, e[K_WALL_NS])
            self.violations.append(v)
        self._found = []

    def _unknown(self, prop: str, why: str, e: Event) -> None:
        seen = self.cannot_tell.get((prop, why))
        if seen is None:
            self.cannot_tell[(prop, why)] = [1, e]
            return
        seen[0] += 1
        first = seen[1]  # the earliest in the judge's order, whichever order the nodes were fed in
        if (e[K_WALL_NS], e[K_CLUSTER], e[K_NODE], e[K_INSTANCE], e[K_SEQ]) < (
            first[K_WALL_NS],
            first[K_CLUSTER],
            first[K_NODE],
            first[K_INSTANCE],
            first[K_SEQ],
        ):
            seen[1] = e

    # the page steps, in Python: each event the compiled steps leave (``_run_pool``)

    def _allocate(self, pool: Pool, e: Event) -> None:
        rid, pages, code = e[K_REQUEST_ID], e[K_PAGES], e[K_CODE]
        if e[K_PURPOSE] == "prefix_hit":
            hashes = self._hashes(e)
            for k, p in enumerate(pages.tolist()):
                pool.hits.setdefault(p, {})[code] = None if hashes is None else int(hashes[k])
            return
        ix = self._slots(pool, e)
        cur = pool.owner[ix]
        clash = (cur != FREE) & (cur != code)
        if e[K_ROW] in self._repeats and len(np.unique(pages)) != len(pages):
            self._report("pages_conserved", e, f"one allocation lists a page twice: {pages.tolist()}")
        if clash.any():
            for k in np.flatnonzero(clash).tolist():
                p, other = int(pages[k]), int(cur[k])
                self._report("pages_conserved", e, f"page {p} allocated to {rid} while {self.names[other]} holds it")
                pool.extra.setdefault(p, []).append(other)
        pool.owner[ix] = code
        if e[K_PURPOSE] == "decode_growth":
            pool.writer[ix] = code  # the step that reads it fills it
            pool.whash[ix] = NO_HASH

    def _free(self, pool: Pool, e: Event) -> None:
        pages, ix = e[K_PAGES], self._slots(pool, e)
        if e[K_REQUEST_ID] is None:  # a radix eviction releases every holder
            pool.owner[ix] = FREE
            if pool.hits or pool.extra:
                for p in pages.tolist():
                    pool.hits.pop(p, None)
                    pool.extra.pop(p, None)  # every holder released
            return
        code = e[K_CODE]
        mine = pool.owner[ix] == code
        freed = pages[mine]
        if not mine.all():
            more = []
            for p in pages[~mine].tolist():
                if code in pool.extra.get(p, ()):
                    pool.extra[p].remove(code)
                    if not pool.extra[p]:
                        del pool.extra[p]
                    more.append(p)
                elif code in pool.hits.get(p, ()):
                    del pool.hits[p][code]
                    more.append(p)
            freed = np.concatenate([freed, np.asarray(more, dtype=freed.dtype)])
        pool.owner[ix[mine]] = FREE
        if pool.extra:  # a second owner still holds the page: it becomes the owner
            for p in set(pool.extra).intersection(pages[mine].tolist()):
                pool.owner[pool.slot(p)] = pool.extra[p].pop()
                if not pool.extra[p]:
                    del pool.extra[p]
        if len(freed):
            pool.freed.setdefault(code, []).append((freed, e))

    def _write(self, pool: Pool, e: Event) -> None:
        pages, ix, code = e[K_PAGES], self._slots(pool, e), e[K_CODE]
        if e[K_SOURCE] == "transfer_in" and code in pool.freed:
            for k in np.flatnonzero(~pool.held_mask(ix, pages, code)).tolist():
                p = int(pages[k])
                free = pool.freed_by(code, p)
                if free is not None:
                    rid = e[K_REQUEST_ID]
                    self._report(
                        "no_free_before_drain",
                        free,
                        f"{rid}'s write landed on page {p} after {rid} freed it (seq {e[K_SEQ]} of {e[K_NODE]})",
                    )
                    break
        pool.writer[ix] = code
        hashes = self._hashes(e)
        pool.whash[ix] = NO_HASH if hashes is None else hashes

    def _unverified(self, pool: Pool, e: Event) -> None:
        pool.writer[self._slots(pool, e)] = UNKNOWN  # writer unknown from now on

    def _read(self, pool: Pool, e: Event) -> None:
        rid, pages, code, pos = e[K_REQUEST_ID], e[K_PAGES], e[K_CODE], e[K_POS]
        ix = self._slots(pool, e)
        writers = pool.writer[ix]
        own = pool.owner[ix] == code
        if own.all() and (writers == code).all():
            return  # its own pages, written by itself: the common case
        held = pool.held_mask(ix, pages, code)
        tenant = self._tenant(code, pos)
        bad = np.flatnonzero(~held | (writers != code))
        # as Python values, once per read (a read of a cached prefix goes page by page)
        page_l, held_l, writer_l, whash_l = (a[bad].tolist() for a in (pages, held, writers, pool.whash[ix]))
        hits = pool.hits
        wtenants: dict[int, str | None] = {}  # each writer's tenant at this read
        for p, is_held, w, whash in zip(page_l, held_l, writer_l, whash_l):
            if not is_held:
                self._report("no_foreign_read", e, f"{rid} reads page {p} it does not hold")
                break
            if w == NEVER:
                self._report("no_foreign_read", e, f"{rid} reads page {p}, never written since the pool began")
                break
            if w == UNKNOWN:
                self._unknown("no_foreign_read", "a read of pages an unverified transfer may have written", e)
                continue
            hit = hits.get(p, {}).get(code)
            if w not in wtenants:
                wtenants[w] = self._tenant(w, pos)
            wtenant = wtenants[w]
            if hit is not None and hit == whash and wtenant == tenant:
                continue  # a sealed prefix of its own namespace
            why = "a prefix of another namespace" if hit is not None and hit == whash else "last written"
            self._report("no_foreign_read", e, f"{rid} ({tenant}) reads page {p}: {why} by {self.names[w]} ({wtenant})")
            break


_PAGE_STEPS = {
    OP_ALLOC: PageSteps._allocate,
    OP_GROWTH: PageSteps._allocate,
    OP_PREFIX: PageSteps._allocate,
    OP_FREE: PageSteps._free,
    OP_EVICT: PageSteps._free,
    OP_WRITE: PageSteps._write,
    OP_WRITE_IN: PageSteps._write,
    OP_READ: PageSteps._read,
    OP_UNVERIFIED: PageSteps._unverified,
}
