"""The monitors' compiled fast path (numba): a node's run of page events that change only its pool's arrays.

:func:`run_pages` applies one pool's page events, in the judge's order, to its ``owner``, ``writer`` and
``whash`` arrays in place, exactly as the monitors' Python steps (:mod:`kvtrail.model.monitors`) would,
as long as each event is the common case that reports nothing and touches nothing but the arrays:

* allocation (not a prefix hit) of pages that are free or the request's own, no page twice;
* release by a request of pages it owns, no page with a second owner in the pool;
* radix eviction in a pool with no prefix hits and no second owners;
* write, unless it lands from a transfer for a request that freed pages in this pool (block hashes,
  when given, one per page);
* read by the owner of every page, each last written by the reader;
* a receipt the monitors cannot verify (its pages' writer becomes unknown).

It stops at the first event that is anything else (or whose pages are not yet in the arrays) and returns
its index; the caller runs that event through the Python step and resumes after it. The releases it made
are handed back by index, for the caller to keep each in the pool's in-flight frees.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtrail.model.pool import DENSE_PAGES, FREE, NO_HASH, UNKNOWN

# A page event's step (the caller maps kinds, purposes, sources and statuses to these).
OP_ALLOC = 0
OP_GROWTH = 1  # pages_allocated with purpose decode_growth
OP_PREFIX = 2  # pages_allocated with purpose prefix_hit: always Python
OP_FREE = 3
OP_EVICT = 4  # pages_freed with no request: every holder released
OP_WRITE = 5
OP_WRITE_IN = 6  # kv_written with source transfer_in
OP_READ = 7
OP_UNVERIFIED = 8  # transfer_received with status unverified


@njit(cache=True, nogil=True)
def run_pages(
    owner,
    writer,
    whash,
    has_extra,
    has_hits,
    freed_flag,
    ops,
    codes,
    rows,
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
):
    """Apply events ``i``, ``i + 1``, ... (``ops``, ``codes``, ``rows`` per event; ``values``/``offsets``/
    ``valid``: every row's page list, ``maxes`` its largest page, ``repeats`` whether it may list a page
    twice; ``hvalues``/``hoffsets``/``hvalid``: block hashes) while each is the common case. Returns the
    index of the first it left to Python (``len(ops)`` when none) and how many releases it wrote to
    ``frees`` (event indices). ``freed_flag[code]``: the request has frees kept in this pool (set here)."""
    limit = min(owner.shape[0], DENSE_PAGES)
    nf = 0
    m = ops.shape[0]
    while i < m:
        op = ops[i]
        c = codes[i]
        n = rows[i]
        a = offsets[n]
        b = offsets[n + 1]
        if op == OP_PREFIX or not valid[n] or maxes[n] >= limit:
            break
        neg = False
        for j in range(a, b):
            if values[j] < 0:
                neg = True
                break
        if neg:
            break
        if op == OP_ALLOC or op == OP_GROWTH:
            if repeats[n]:
                break
            clash = False
            for j in range(a, b):
                cur = owner[values[j]]
                if cur != FREE and cur != c:
                    clash = True
                    break
            if clash:
                break
            for j in range(a, b):
                p = values[j]
                owner[p] = c
                if op == OP_GROWTH:
                    writer[p] = c
                    whash[p] = NO_HASH
        elif op == OP_FREE:
            if has_extra:
                break
            mine = True
            for j in range(a, b):
                if owner[values[j]] != c:
                    mine = False
                    break
            if not mine:
                break
            for j in range(a, b):
                owner[values[j]] = FREE
            if b > a:
                frees[nf] = i
                nf += 1
                freed_flag[c] = True
        elif op == OP_EVICT:
            if has_extra or has_hits:
                break
            for j in range(a, b):
                owner[values[j]] = FREE
        elif op == OP_WRITE or op == OP_WRITE_IN:
            if op == OP_WRITE_IN and freed_flag[c]:
                break
            hv = hvalid[n]
            ha = hoffsets[n]
            if hv and hoffsets[n + 1] - ha != b - a:
                break
            for j in range(a, b):
                p = values[j]
                writer[p] = c
                whash[p] = hvalues[ha + j - a] if hv else NO_HASH
        elif op == OP_READ:
            clean = True
            for j in range(a, b):
                p = values[j]
                if owner[p] != c or writer[p] != c:
                    clean = False
                    break
            if not clean:
                break
        elif op == OP_UNVERIFIED:
            for j in range(a, b):
                writer[values[j]] = UNKNOWN
        else:
            break
        i += 1
    return i, nf


def warm_up() -> None:
    """Load :func:`run_pages` (from numba's cache; the very first time, compile it) for the arrays the
    monitors hand it (those read from a table read-only, their own writable): a few tenths of a second
    that the first table fed would pay."""
    i64, b = np.zeros(1, np.int64), np.zeros(0, np.bool_)
    ro_i64, ro_b = np.zeros(1, np.int64), np.zeros(0, np.bool_)
    for a in (ro_i64, ro_b):
        a.setflags(write=False)
    run_pages(
        i64,
        i64,
        i64,
        False,
        False,
        b,
        np.zeros(0, np.int8),
        i64[:0],
        i64[:0],
        ro_i64[:0],
        ro_i64,
        ro_b,
        i64[:0],
        b,
        ro_i64[:0],
        ro_i64,
        ro_b,
        0,
        i64[:0],
    )
