"""One node's page pool as the monitors see it (:mod:`kvtrail.model.monitors`), and what a violation names.

Indexed by page id, so the state is sized by the pool, not by the history: the exclusive owner of each
page, its last writer and the block hash that writer stored. Beside the arrays, only what is rare or in
flight: a second owner (double ownership, a fault), the prefix-cache hits held, and, per request, the
pages it freed whose writes may still land (dropped with the request: ``Monitors.prune``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEVER, UNKNOWN, FREE = -1, -2, -1
NO_HASH = np.iinfo(np.int64).min  # the writer stored no block hash
DENSE_PAGES = 1 << 20  # page ids under this index the arrays directly (8 MB per array at most)


@dataclass
class Violation:
    property: str
    producer: str
    seq: int
    node: str
    request_id: str | None
    detail: str
    wall_ns: int

    def as_dict(self) -> dict:
        return {
            "property": self.property,
            "first_event": {
                "producer": self.producer,
                "seq": self.seq,
                "node": self.node,
                "request_id": self.request_id,
            },
            "detail": self.detail,
        }


class Pool:
    """One node's pool: ``owner``, ``writer`` (request codes) and ``whash`` arrays indexed by page slot
    (:meth:`slots`: the page id itself under ``DENSE_PAGES``); ``extra``: page -> further exclusive
    owners (double ownership); ``hits``: page -> {request code: block hash} of prefix-cache hits;
    ``freed``: request code -> the (pages, event) of each of its frees, newest last.

    Why every free of a request and not the last freer of a page: a late write of R lands on a page R
    freed, but the page may have been allocated and freed again by others meanwhile (R frees p, R2 takes
    it and frees it, then R's write lands): the page's last freer is R2 by then, and R's free is the one
    that came before the drain. So ``no_free_before_drain`` needs, per request whose writes may still
    land, the pages it freed, which is what is kept (bounded by the requests in flight, not by pages)."""

    def __init__(self, size: int = 1024):
        self.owner = np.full(size, FREE, np.int64)
        self.writer = np.full(size, NEVER, np.int64)
        self.whash = np.full(size, NO_HASH, np.int64)
        self.extra: dict[int, list[int]] = {}
        self.hits: dict[int, dict[int, int | None]] = {}
        self.freed: dict[int, list[tuple[np.ndarray, tuple]]] = {}
        self.sparse: dict[int, int] = {}  # page id (at or over DENSE_PAGES) -> its slot in the arrays

    def slots(self, pages: np.ndarray, max_page: int) -> np.ndarray:
        """Where ``pages`` (the largest ``max_page``) live in the arrays: page ids under ``DENSE_PAGES``
        index them directly (grown by doubling as ids appear); larger ids, which a pool of up to 2^31
        pages may use, get slots past ``DENSE_PAGES`` as they appear, so the arrays stay sized by the
        pages in use, not by the largest id."""
        if max_page < DENSE_PAGES:
            if max_page >= len(self.owner):
                self._grow(max(max_page + 1, 2 * len(self.owner)))
            return pages
        ix = pages.copy()
        for k in np.flatnonzero(pages >= DENSE_PAGES).tolist():
            ix[k] = self.slot(int(pages[k]))
        return ix

    def slot(self, page: int) -> int:
        """One page id's slot (assigned on first sight for an id at or over ``DENSE_PAGES``)."""
        if page < DENSE_PAGES:
            return page
        s = self.sparse.get(page)
        if s is None:
            s = self.sparse[page] = DENSE_PAGES + len(self.sparse)
            if s >= len(self.owner):
                self._grow(max(s + 1, 2 * len(self.owner), DENSE_PAGES + 1024))
        return s

    def _grow(self, size: int) -> None:
        for name, fill in (("owner", FREE), ("writer", NEVER), ("whash", NO_HASH)):
            old = getattr(self, name)
            grown = np.full(size, fill, np.int64)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def held_mask(self, ix: np.ndarray, pages: np.ndarray, code: int) -> np.ndarray:
        """Per page (``ix``: its slots), whether ``code`` holds it: as owner, second owner or prefix hit."""
        held = self.owner[ix] == code
        if (self.extra or self.hits) and not held.all():
            out = np.flatnonzero(~held)
            extra, hits = self.extra, self.hits
            held[out] = [code in extra.get(p, ()) or code in hits.get(p, ()) for p in pages[out].tolist()]
        return held

    def freed_by(self, code: int, page: int) -> tuple | None:
        """The event of ``code``'s latest free of ``page`` (None if it never freed it)."""
        for pages, e in reversed(self.freed.get(code, ())):
            if page in pages:
                return e
        return None

    def codes(self) -> set[int]:
        """Every request code the pool's pages refer to (owners, writers, prefix hits, second owners)."""
        used = np.unique(np.concatenate([self.owner, self.writer]))
        out = set(used[used >= 0].tolist())
        out.update(c for h in self.hits.values() for c in h)
        out.update(c for owners in self.extra.values() for c in owners)
        return out
