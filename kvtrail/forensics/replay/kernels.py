"""The replay engine's compiled fast path (numba): runs of finding-free page events, and page runs.

:func:`replay_page_events` applies consecutive page events (``pages_allocated``, ``pages_freed``,
``kv_written``, ``kv_read``) of a batch in engine order to the pools' :class:`PageState` arrays in
place, exactly as :class:`~kvtrail.forensics.replay.handlers.EventHandlers` would, as long as each event
is the common, finding-free case:

* allocation (not a prefix hit) of pages no other request holds, none shared, no page twice;
* release by a request of pages with no shared or extra holders (pages it does not hold stay as they are);
* write by the exclusive owner of every page (digests / block hashes, when given, one per page);
* read by the exclusive owner of pages nobody shares, each written by the reader or a fresh growth
  page (allocated to the reader as ``decode_growth`` and not written since).

It stops at the first event that is anything else and returns its index; the caller runs that event
through the Python handler and resumes after it. The rare states (double ownership, prefix-cache
sharing) live in dicts the kernel cannot see, so it reads their markers instead: ``nshared`` and a
per-page flag mirroring "has extra holders" that the caller keeps up to date.

One call replays the events of one pool (node): pools are independent, so the caller runs each
pool ahead to its next Python event and hands Python events to the handlers in row order.
:func:`gather_runs` turns a store's run-encoded page lists back into lists for the store reader.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS, ArraySpec

# Event operations (the caller maps kinds and purposes to these).
OP_PYTHON = 0  # always handled in Python (non-page kinds, prefix hits, ...)
OP_SKIP = 1  # no effect on page state or findings (e.g. join-only kinds when joins are not needed)
OP_ALLOC = 2
OP_GROWTH = 3  # pages_allocated with purpose decode_growth
OP_FREE = 4
OP_WRITE = 5
OP_READ = 6

# The kernel's own per-page arrays, after the pool's (PAGE_ARRAYS) in its arguments: "has extra holders"
# (mirroring PageState.extra) and the scratch stamps of repeated pages.
SCRATCH_ARRAYS = (ArraySpec("multi", np.bool_, False), ArraySpec("stamp", np.int64, -1))
# The per-page arrays replay_page_events takes, in order (a test checks its parameters follow this).
KERNEL_ARRAYS = PAGE_ARRAYS + SCRATCH_ARRAYS


@njit(cache=True, nogil=True)
def replay_page_events(rows, start, marker0, op, req, pid, seq, wall_ns, poff, pages, doff, digests, hoff, hashes,
                       has_pool, owner, gen, alloc_req, alloc_growth, alloc_ev, nshared, writer, write_ns, write_gen,
                       write_ev, digest, has_digest, bhash, has_bhash, multi, stamp, freed):
    """Apply the events ``rows[start:]`` of one pool until one needs Python.

    Returns (position in ``rows`` of that event, or ``len(rows)``; releases recorded in ``freed``).
    The per-page arrays are :data:`KERNEL_ARRAYS`, in that order: the pool's :class:`PageState` arrays,
    then ``multi`` marking pages with extra holders and ``stamp``, scratch for repeated pages
    (``marker0 + row`` stamps the pages of an allocation). ``freed``
    receives the rows of the releases applied, in order: the caller records them with
    ``PageState.remember_release``.
    """
    nfreed = 0
    n = np.uintp(owner.shape[0])
    for j in range(start, rows.shape[0]):
        i = rows[j]
        o = op[i]
        if o == OP_SKIP:
            continue
        if o == OP_PYTHON:
            return j, nfreed
        a, e = poff[i], poff[i + 1]
        if not has_pool or a == e:
            continue  # the handler returns at once: no pool yet, or an empty page list
        r = req[i]
        if r < 0:
            return j, nfreed  # no request: a radix eviction, or input the handler must judge
        # Page ids as unsigned indices: one compare rejects negative and too large ids alike (the
        # handler grows the pool first), and indexing needs no wraparound.
        if o == OP_ALLOC or o == OP_GROWTH:
            increasing = True  # a strictly increasing list names no page twice (the usual case)
            for k in range(a + 1, e):
                if pages[k] <= pages[k - 1]:
                    increasing = False
                    break
            mark = marker0 + i
            for k in range(a, e):
                p = np.uintp(pages[k])
                if p >= n or (owner[p] >= 0 and owner[p] != r) or nshared[p] > 0:
                    return j, nfreed
                if not increasing:
                    if stamp[p] == mark:
                        return j, nfreed  # numpy's gen[pages] += 1 counts a repeated page once
                    stamp[p] = mark
            is_growth = o == OP_GROWTH
            for k in range(a, e):
                p = np.uintp(pages[k])
                owner[p] = r
                alloc_ev[p, 0] = pid[i]
                alloc_ev[p, 1] = seq[i]
                alloc_req[p] = r
                alloc_growth[p] = is_growth
                gen[p] += 1
        elif o == OP_FREE:
            for k in range(a, e):
                p = np.uintp(pages[k])
                if p >= n or nshared[p] > 0 or multi[p]:
                    return j, nfreed
            for k in range(a, e):  # pages r does not hold stay as they are (PageState.drop does nothing)
                p = np.uintp(pages[k])
                if owner[p] == r:
                    owner[p] = -1
            freed[nfreed] = i
            nfreed += 1
        elif o == OP_WRITE:
            nd, nh = doff[i + 1] - doff[i], hoff[i + 1] - hoff[i]
            if (nd > 0 and nd != e - a) or (nh > 0 and nh != e - a):
                return j, nfreed
            for k in range(a, e):
                p = np.uintp(pages[k])
                if p >= n or owner[p] != r:
                    return j, nfreed
            for k in range(a, e):
                p = np.uintp(pages[k])
                writer[p] = r
                write_ns[p] = wall_ns[i]
                write_gen[p] = gen[p]
                write_ev[p, 0] = pid[i]
                write_ev[p, 1] = seq[i]
                has_digest[p] = nd > 0
                if nd > 0:
                    digest[p] = digests[doff[i] + k - a]
                has_bhash[p] = nh > 0
                if nh > 0:
                    bhash[p] = hashes[hoff[i] + k - a]
        elif o == OP_READ:
            for k in range(a, e):
                p = np.uintp(pages[k])
                if p >= n or owner[p] != r or nshared[p] > 0:
                    return j, nfreed
                if writer[p] != r and not (alloc_req[p] == r and alloc_growth[p] and write_gen[p] < gen[p]):
                    return j, nfreed
        else:
            return j, nfreed
    return rows.shape[0], nfreed


@njit(cache=True, nogil=True)
def gather_runs(ev_row, ev_seq, ev_seg, run_seq, run_list, run_start, run_len, run_seg, poff, pages, num_dst):
    """Attach page runs to events by a merge on seq, producer by producer; two passes.

    Events ``ev_row`` (rows of the batch) are sorted by (producer, seq) with producer ``k`` at
    ``ev_seg[k]:ev_seg[k+1]``; runs likewise by (producer, seq, list, pos) at ``run_seg``. Runs of
    events that are not in the batch are skipped. With an empty ``pages`` this counts: ``poff[row + 1]``
    gets the row's 'pages' length and ``num_dst[row]`` its 'dst_pages' length; with ``pages`` sized
    ``poff[-1]`` (after a cumulative sum) it writes each row's pages at ``poff[row]``, runs in order.
    """
    fill = pages.shape[0] > 0
    for k in range(ev_seg.shape[0] - 1):
        j = run_seg[k]
        end = run_seg[k + 1]
        for e in range(ev_seg[k], ev_seg[k + 1]):
            s = ev_seq[e]
            if e > ev_seg[k] and ev_seq[e - 1] == s:
                while j > run_seg[k] and run_seq[j - 1] == s:
                    j -= 1  # a repeated (producer, seq): the same runs again, as a join would give
            while j < end and run_seq[j] < s:
                j += 1
            row = ev_row[e]
            at = poff[row] if fill else 0
            while j < end and run_seq[j] == s:
                if run_list[j] == 0:
                    if fill:
                        for q in range(run_len[j]):
                            pages[at + q] = run_start[j] + q
                        at += run_len[j]
                    else:
                        poff[row + 1] += run_len[j]
                elif not fill:
                    num_dst[row] += run_len[j]
                j += 1


def warm_up() -> None:
    """Load both kernels (from numba's cache; the very first time, compile them): the first call of
    a process pays this, a few tenths of a second."""
    i64, i32 = np.zeros(1, np.int64), np.zeros(0, np.int32)
    gather_runs(i64[:0], i64[:0], i64, i64[:0], i64[:0], i64[:0], i64[:0], i64, i64, i32, i64[:0])
    replay_page_events(  # type: ignore[call-arg]  # numba's Dispatcher stub
        i64[:0], 0, 0, np.zeros(0, np.int8), i32, i64[:0], i64[:0], i64[:0], i64, i32, i64, np.zeros(0, np.uint64),
        i64, i64[:0], False, *(spec.allocate(0) for spec in KERNEL_ARRAYS), i64[:0])
