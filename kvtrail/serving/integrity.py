"""The integrity kernels as one worker's pool uses them: per-page digests and page ownership tags.

Prefill digests the pages it sends; decode digests what landed and compares page by page (a
mismatch names the pages: finding F3). Decode keeps a generation tag per page and checks, before
every attention read, that each page of a request still carries the tag it was given; a page freed
or handed to someone else in between is caught before it is attended.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtrail.kernels.layout import KvLayout
from kvtrail.kernels.mixing import combine_page_digests
from kvtrail.kernels.registry import get_backend
from kvtrail.kernels.tags import PageTags

DIGEST_ALGO = "kvd1"  # kvtrail's page digest, defined in kvtrail.kernels.mixing


class PoolIntegrity:
    """Digests and tags over one :class:`~kvtrail.serving.kvpool.KVPool`."""

    def __init__(self, pool):
        self.layout = KvLayout(tuple(pool.buffers()), pool.config.num_pages)
        self.backend = get_backend(pool.device)
        self.tags = PageTags(pool.config.num_pages, pool.device)
        # Compile (or load the cached) fast kernels now, not on the first request.
        self.page_digests(np.array([1], dtype=np.int32))
        self.tags.verify(torch.tensor([1]), self.tags.current(torch.tensor([1])), backend=self.backend)

    def page_digests(self, pages) -> np.ndarray:
        """One 64-bit digest per page (uint64), over the page's bytes in every buffer."""
        d = self.backend.page_digests(self.layout, np.asarray(pages, dtype=np.int64))
        return d.numpy().view(np.uint64).copy()

    @staticmethod
    def request_digest(page_digests: np.ndarray) -> int:
        """The order-binding digest of a request's pages, from their page digests."""
        return combine_page_digests(torch.from_numpy(np.asarray(page_digests, dtype=np.uint64).view(np.int64)))

    def allocate(self, pages) -> np.ndarray:
        """Bump the pages' tags on allocation; returns the tags the new holder keeps."""
        return self.tags.allocate(torch.as_tensor(np.asarray(pages, dtype=np.int64))).numpy()

    def free(self, pages) -> None:
        self.tags.free(torch.as_tensor(np.asarray(pages, dtype=np.int64)))

    def foreign_pages(self, pages, held_tags) -> np.ndarray:
        """Pages whose tag is no longer the one the reader holds (freed or reallocated since)."""
        bad = self.tags.verify(
            torch.as_tensor(np.asarray(pages, dtype=np.int64)),
            torch.as_tensor(np.asarray(held_tags, dtype=np.int64)),
            backend=self.backend,
        )
        return bad.numpy()
