"""The replay engine's compiled fast path (numba): runs of finding-free page events, and page runs.

:func:`replay_page_events` applies consecutive page events (``pages_allocated``, ``pages_freed``,
``kv_written``, ``kv_read``) of a batch in engine order to the pools' :class:`PageState` arrays in
place, exactly as :class:`~kvtrail.forensics.replay.handlers.EventHandlers` would, as long as each event
is the common, finding-free case:

* allocation (not a prefix hit) of pages no other request holds, none shared, no page twice;
* prefix hit with one block hash per page, no page twice (room permitting in the shares' slots);
* release by a request of pages with no extra holders (pages it does not hold stay as they are);
* write by a holder (exclusive owner or prefix hit) of every page (digests / block hashes, when
  given, one per page);
* read by a holder (exclusive owner or prefix hit) of every page, each written by the reader, a
  fresh growth page (allocated to the reader as ``decode_growth`` and not written since) or a cached
  prefix (a hit whose block hash the page's last write stored), unless the cached page's writer is
  of another tenant and the policy does not allow that (F10).

It stops at the first event that is anything else and returns its index; the caller runs that event
through the Python handler and resumes after it. Double ownership lives in a dict the kernel cannot
see, so it reads a per-page flag mirroring "has extra holders" that the caller keeps up to date;
prefix-cache holders live in arrays (:class:`~kvtrail.forensics.replay.shares.PrefixShares`) the
kernel changes as the handlers would.

One call replays the events of one pool (node): pools are independent, so the caller runs each
pool ahead to its next Python event and hands Python events to the handlers in row order.
:func:`gather_runs` turns a store's run-encoded page lists back into lists for the store reader;
:func:`copy_lists` copies the released lists out of a batch's page buffer (which a later slice reuses).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS, ArraySpec
from kvtrail.forensics.replay.shares import PrefixShares, register_compiled

# Event operations (the caller maps kinds and purposes to these).
OP_PYTHON = 0  # always handled in Python (non-page kinds, node_config, ...)
OP_SKIP = 1  # no effect on page state or findings (e.g. join-only kinds when joins are not needed)
OP_ALLOC = 2
OP_GROWTH = 3  # pages_allocated with purpose decode_growth
OP_FREE = 4
OP_WRITE = 5
OP_READ = 6
OP_PREFIX = 7  # pages_allocated with purpose prefix_hit

# The kernel's own per-page arrays, after the pool's (PAGE_ARRAYS) in its arguments: "has extra holders"
# (mirroring PageState.extra) and the scratch stamps of repeated pages.
SCRATCH_ARRAYS = (ArraySpec("multi", np.bool_, False), ArraySpec("stamp", np.int64, -1))
# The per-page arrays replay_page_events takes, in order (a test checks its parameters follow this).
KERNEL_ARRAYS = PAGE_ARRAYS + SCRATCH_ARRAYS


# Compiled copies of kvtrail.forensics.replay.shares' functions (the reference statement; a parity test
# runs both). Copies, not njit(shares.share_find): numba's cache of a kernel does not notice a change in
# a function it calls from another file.
_MIX_PAGE = 0x9E3779B1
_MIX_REQUEST = 0x85EBCA6B


@njit(cache=True, nogil=True)
def share_bucket(p, r, mask):
    x = (np.int64(p) * _MIX_PAGE) ^ (np.int64(r) * _MIX_REQUEST)
    return (x ^ (x >> 29)) & mask


@njit(cache=True, nogil=True)
def share_find(index, s_page, s_req, p, r):
    mask = index.shape[0] - 1
    i = share_bucket(p, r, mask)
    while True:
        s = index[i]
        if s < 0:
            return -1
        if s_page[s] == p and s_req[s] == r:
            return s
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def share_insert(index, s_page, s_req, s_hash, s_prev, s_next, meta, head, nshared, p, r, h):
    s = meta[0]
    meta[0] = s_next[s]
    meta[1] += 1
    s_page[s] = p
    s_req[s] = r
    s_hash[s] = h
    first = head[p]
    s_prev[s] = -1
    s_next[s] = first
    if first >= 0:
        s_prev[first] = s
    head[p] = s
    nshared[p] += 1
    mask = index.shape[0] - 1
    i = share_bucket(p, r, mask)
    while index[i] >= 0:
        i = (i + 1) & mask
    index[i] = s
    return s


@njit(cache=True, nogil=True)
def share_remove(index, s_page, s_req, s_prev, s_next, meta, head, nshared, s):
    p = s_page[s]
    before = s_prev[s]
    after = s_next[s]
    if before >= 0:
        s_next[before] = after
    else:
        head[p] = after
    if after >= 0:
        s_prev[after] = before
    nshared[p] -= 1
    mask = index.shape[0] - 1
    i = share_bucket(p, s_req[s], mask)
    while index[i] != s:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        t = index[j]
        if t < 0:
            break
        k = share_bucket(s_page[t], s_req[t], mask)
        if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
            index[i] = t
            i = j
    index[i] = -1
    s_next[s] = meta[0]
    meta[0] = s
    meta[1] -= 1


@njit(cache=True, nogil=True)
def replay_page_events(
    rows,
    start,
    marker0,
    op,
    req,
    pid,
    seq,
    wall_ns,
    poff,
    pages,
    doff,
    digests,
    hoff,
    hashes,
    tenant,
    tenant_ord,
    allow_sharing,
    hit,
    sh_index,
    sh_page,
    sh_req,
    sh_hash,
    sh_prev,
    sh_next,
    sh_meta,
    has_pool,
    owner,
    gen,
    alloc_req,
    alloc_growth,
    alloc_ev,
    nshared,
    share_head,
    writer,
    write_ns,
    write_gen,
    write_ev,
    digest,
    has_digest,
    bhash,
    has_bhash,
    multi,
    stamp,
    freed,
):
    """Apply the events ``rows[start:]`` of one pool until one needs Python.

    Returns (position in ``rows`` of that event, or ``len(rows)``; releases recorded in ``freed``).
    The per-page arrays are :data:`KERNEL_ARRAYS`, in that order: the pool's :class:`PageState` arrays,
    then ``multi`` marking pages with extra holders and ``stamp``, scratch for repeated pages
    (``marker0 + row`` stamps the pages of an allocation). ``freed``
    receives the rows of the releases applied, in order: the caller records them with
    ``PageState.remember_release``. ``sh_*`` are the pool's
    :class:`~kvtrail.forensics.replay.shares.PrefixShares` arrays; ``hit[row]`` is set for the prefix hits
    applied (the caller counts their pages for the joins). ``tenant[r]`` is request r's tenant code
    (-1: none), known from order number ``tenant_ord[r]`` on; ``marker0 + row`` is a row's order number.
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
        if o == OP_PREFIX:
            if hoff[i + 1] - hoff[i] != e - a:
                return j, nfreed  # no block hashes (the handler refuses the event), or not one per page
            increasing = True
            for k in range(a + 1, e):
                if pages[k] <= pages[k - 1]:
                    increasing = False
                    break
            mark = marker0 + i
            need = 0  # entries to add
            for k in range(a, e):
                p = np.uintp(pages[k])
                if p >= n:
                    return j, nfreed
                if not increasing:
                    if stamp[p] == mark:
                        return j, nfreed  # a page listed twice (F6)
                    stamp[p] = mark
                if nshared[p] == 0 or share_find(sh_index, sh_page, sh_req, pages[k], r) < 0:
                    need += 1
            if sh_meta[1] + need > sh_page.shape[0]:
                return j, nfreed  # no room: the handler grows the slots
            for k in range(a, e):
                p = np.uintp(pages[k])
                h = hashes[hoff[i] + k - a]
                s = share_find(sh_index, sh_page, sh_req, pages[k], r) if nshared[p] > 0 else -1
                if s >= 0:
                    sh_hash[s] = h
                else:
                    share_insert(
                        sh_index,
                        sh_page,
                        sh_req,
                        sh_hash,
                        sh_prev,
                        sh_next,
                        sh_meta,
                        share_head,
                        nshared,
                        pages[k],
                        r,
                        h,
                    )
            hit[i] = True
        elif o == OP_ALLOC or o == OP_GROWTH:
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
                if p >= n or multi[p]:
                    return j, nfreed
            for k in range(a, e):  # pages r does not hold stay as they are (PageState.drop does nothing)
                p = np.uintp(pages[k])
                if nshared[p] > 0:
                    s = share_find(sh_index, sh_page, sh_req, pages[k], r)
                    if s >= 0:
                        share_remove(sh_index, sh_page, sh_req, sh_prev, sh_next, sh_meta, share_head, nshared, s)
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
                if p >= n:
                    return j, nfreed
                if owner[p] != r and (nshared[p] == 0 or share_find(sh_index, sh_page, sh_req, pages[k], r) < 0):
                    return j, nfreed  # not held (F7), or held as an extra holder
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
                if p >= n:
                    return j, nfreed
                s = share_find(sh_index, sh_page, sh_req, pages[k], r) if nshared[p] > 0 else -1
                if owner[p] != r and s < 0:
                    return j, nfreed  # not held (F5), or held as an extra holder
                w = writer[p]
                cached = s >= 0 and has_bhash[p] and bhash[p] == sh_hash[s]  # the radix cache working
                if w != r and not cached and not (alloc_req[p] == r and alloc_growth[p] and write_gen[p] < gen[p]):
                    return j, nfreed  # F1
                if cached and w >= 0 and w != r and not allow_sharing:
                    mine = tenant[r] if r < tenant.shape[0] and tenant_ord[r] <= marker0 + i else -1
                    theirs = tenant[w] if w < tenant.shape[0] and tenant_ord[w] <= marker0 + i else -1
                    if mine >= 0 and theirs >= 0 and mine != theirs:
                        return j, nfreed  # F10
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


@njit(cache=True, nogil=True)
def copy_lists(pages, starts, lengths, out):
    """The lists ``pages[starts[k]:starts[k] + lengths[k]]`` back to back into ``out`` (sized for them all)."""
    at = 0
    for k in range(starts.shape[0]):
        s = starts[k]
        for q in range(lengths[k]):
            out[at + q] = pages[s + q]
        at += lengths[k]


def read_only(a: np.ndarray) -> np.ndarray:
    """``a`` marked read-only, as the arrays Arrow hands over are: numba compiles a call with read-only
    arrays apart from one with writable ones, so the reader's arrays and :func:`warm_up`'s must agree."""
    a.setflags(write=False)
    return a


def warm_up() -> None:
    """Load the kernels (from numba's cache; the very first time, compile them): the first call of
    a process pays this, a few tenths of a second."""
    i64, i32 = np.zeros(1, np.int64), np.zeros(0, np.int32)
    seq, lst, start, length = (read_only(np.zeros(0, t)) for t in (np.int64, np.int8, np.int32, np.int32))
    gather_runs(i64[:0], i64[:0], i64, seq, lst, start, length, i64, i64, i32, i64[:0])  # page_runs' own types
    copy_lists(i32, i64[:0], i64[:0], i32)
    digests, hashes = read_only(np.zeros(0, np.uint64)), read_only(np.zeros(0, np.int64))  # as Arrow's lists
    replay_page_events(  # type: ignore[call-arg]  # numba's Dispatcher stub
        i64[:0],
        0,
        0,
        np.zeros(0, np.int8),
        i32,
        i64[:0],
        i64[:0],
        i64[:0],
        i64,
        i32,
        i64,
        digests,
        i64,
        hashes,
        i32,
        i64[:0],
        False,
        np.zeros(0, np.bool_),
        *PrefixShares(1).arrays(),
        False,
        *(spec.allocate(0) for spec in KERNEL_ARRAYS),
        i64[:0],
    )
    # the Python path's calls (PrefixShares' methods): Python ints, a pool's plain int32 arrays
    shares, head, count = PrefixShares(2), np.full(2, -1, np.int32), np.zeros(2, np.int32)
    shares.insert(head, count, 1, 1, 0)
    shares.remove(head, count, shares.find(1, 1))


register_compiled(share_find, share_insert, share_remove)
