"""Token indices to page ids, and the content keys (block hashes) of a request's pages."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def pages_of(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The pages token indices lie in, in first-use order, each once (page = token index // page size)."""
    if page_size == 1 or not len(tokens):
        return tokens.astype(np.int64, copy=False)
    pages = tokens // page_size
    keep = np.ones(len(pages), dtype=bool)
    keep[1:] = pages[1:] != pages[:-1]  # a request's tokens fill its pages in order
    return pages[keep]


def block_hashes(token_ids: Sequence[int], start_page: int, num_pages: int, page_size: int) -> np.ndarray:
    """Position-chained content keys of pages ``start_page..start_page+num_pages`` of a token sequence.

    Page k's key hashes its tokens and page k-1's key, so two requests get equal keys for a page only
    when every token up to the end of that page is equal: what SGLang's radix cache shares by.
    Signed 64-bit, as the event model stores block hashes.
    """
    out = np.empty(num_pages, dtype=np.int64)
    prev = b""
    for k in range(start_page + num_pages):
        chunk = np.asarray(token_ids[k * page_size : (k + 1) * page_size], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        if k >= start_page:
            out[k - start_page] = int.from_bytes(prev, "little", signed=True)
    return out
