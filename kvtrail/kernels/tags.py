"""Page ownership tags: integrity by construction, at a cost that grows with pages, not bytes.

Every page of a pool carries a 64-bit generation tag. The allocator bumps it each time it hands
the page out (and again when the page comes back), and a request keeps the ``(page, tag)`` pairs it
was given. Before attention reads a request's pages, one vectorised gather-and-compare checks that
every page still carries the tag the request holds; any page that was freed, reallocated, or
reallocated back to the same request id in between (ABA) carries a newer tag and is returned.

Tags are generations, not owner ids, which is why ABA is caught: a reallocation to the same request
id still bumps the generation. An int64 counter bumped a billion times a second lasts 292 years.
"""

from __future__ import annotations

import torch

from kvtrail.kernels.layout import KernelError, PageIds, as_page_ids


class PageTags:
    """The tag table of one pool: ``table[p]`` is page ``p``'s generation (page 0, padding, stays 0).

    Tags start at 0 (never allocated); ``allocate`` bumps to an odd value and ``free`` to the next even
    one, so with a paired allocator an allocated page's tag is odd. Not thread-safe: call it from the
    thread that owns the allocator.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu"):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise KernelError("num_pages", f"must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self.table = torch.zeros(num_pages + 1, dtype=torch.int64, device=device)

    def __repr__(self) -> str:
        return f"PageTags(num_pages={self.num_pages}, device={str(self.table.device)!r})"

    def _pages(self, page_ids: PageIds, what: str) -> torch.Tensor:
        ids = as_page_ids(page_ids, self.table.device)
        if ids.numel() and (int(ids.min()) < 1 or int(ids.max()) > self.num_pages):
            raise KernelError("page_ids", f"can only {what} pages 1..{self.num_pages} (0 is the padding page)")
        return ids

    def _bump(self, ids: torch.Tensor) -> None:
        # index_add_ rather than table[ids] += 1: a repeated id is bumped once per occurrence, so
        # even an allocator bug that hands out a page twice leaves every earlier holder stale.
        self.table.index_add_(0, ids, torch.ones_like(ids))

    def allocate(self, page_ids: PageIds) -> torch.Tensor:
        """Bump the pages' generations; returns the tags the new holder keeps (int64, same order)."""
        ids = self._pages(page_ids, "allocate")
        self._bump(ids)
        return self.table[ids]

    def free(self, page_ids: PageIds) -> None:
        """Bump the pages' generations again: a holder that reads a page after it was freed is caught
        even before the page is handed out anew."""
        self._bump(self._pages(page_ids, "free"))

    def current(self, page_ids: PageIds) -> torch.Tensor:
        """The pages' tags now (a copy)."""
        return self.table[self._pages(page_ids, "look up")]

    def verify(self, page_ids: PageIds, held_tags: PageIds, backend=None) -> torch.Tensor:
        """The page ids whose tag differs from the one held (empty when the request may read them all).

        ``backend`` defaults to the fast backend of the table's device (see ``registry.get_backend``).
        """
        if backend is None:
            from kvtrail.kernels.registry import get_backend

            backend = get_backend(self.table.device)
        return backend.verify_tags(self.table, page_ids, held_tags)
