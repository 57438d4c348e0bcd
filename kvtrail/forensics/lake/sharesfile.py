"""A restored pool's prefix-cache holders, laid out at once from a checkpoint's hits.

A checkpoint lists its pool's prefix-cache hits as (page, request, block hash) rows, pages ascending and
each page's hits in hit order. Inserting them one by one (``PageState.share``) gives hit k slot k, each
page's chain newest first and ``nshared`` its count; :func:`restore_shares` builds those same slots,
chains and counts with array operations, and the open-addressed index with the running-maximum placement
:class:`~kvtrail.forensics.replay.shares.PrefixShares` uses when it grows (every entry reachable from its
home position, as linear probing requires). On a prefill node with ~10^5 hits the one-by-one inserts
were most of a checkpoint's restore.
"""

from __future__ import annotations

import numpy as np

from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.replay.shares import _MIX_PAGE, _MIX_REQUEST, INITIAL_SLOTS, PrefixShares


def _index(page: np.ndarray, req: np.ndarray, size: int) -> np.ndarray:
    """The open-addressed index (``size`` positions, a power of two) of entries 0..n-1."""
    index = np.full(size, -1, np.int32)
    n = len(page)
    if not n:
        return index
    mask = size - 1
    x = (page.astype(np.int64) * _MIX_PAGE) ^ (req.astype(np.int64) * _MIX_REQUEST)
    home = (x ^ (x >> 29)) & mask
    order = np.argsort(home, kind="stable")
    # in ascending home order each entry lands at max(its home, the previous one's position + 1)
    at = np.maximum.accumulate(home[order] - np.arange(n)) + np.arange(n)
    fits = at <= mask
    index[at[fits]] = order[fits]
    i = 0
    for s in order[~fits].tolist():  # past the last position: probing goes on from position 0
        while index[i] >= 0:
            i += 1
        index[i] = s
    return index


def restore_shares(pool: PageState, hits: np.ndarray) -> None:
    """Give ``pool`` (share_head -1 and nshared 0 everywhere) the prefix-cache holders ``hits``:
    (page, request, block hash) rows, pages ascending, each page's hits in hit order."""
    n = len(hits)
    slots = INITIAL_SLOTS
    while slots < n:
        slots *= 2
    shares = PrefixShares(slots)
    pool.shares = shares
    if not n:
        return
    pages = hits[:, 0]
    shares.page[:n] = pages
    shares.req[:n] = hits[:, 1]
    shares.bhash[:n] = hits[:, 2]
    k = np.arange(n, dtype=np.int32)
    first = np.ones(n, bool)  # the oldest hit of its page
    first[1:] = pages[1:] != pages[:-1]
    last = np.ones(n, bool)  # the newest: the chain's head
    last[:-1] = first[1:]
    # chains run newest first: slot k's next is k - 1 (none for a page's oldest), its prev k + 1
    shares.next[:n] = np.where(first, -1, k - 1)
    shares.prev[:n] = np.where(last, -1, k + 1)
    shares.meta[:] = (n if n < slots else -1, n)  # free slots: n, n + 1, ... linked through next as before
    entries = pool.slots.many(pages[last])  # page ids to the arrays' entries (the sparse ones' own)
    head, nshared = pool.raw("share_head"), pool.raw("nshared")
    head[entries] = k[last]
    starts = np.flatnonzero(first)
    nshared[entries] = np.diff(np.append(starts, n)).astype(nshared.dtype)
    shares.index = _index(shares.page[:n], shares.req[:n], len(shares.index))
