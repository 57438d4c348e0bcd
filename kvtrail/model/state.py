"""The model's state: requests, the decode pool and the prefill pool, as nested tuples (hashable, cheap).

A request is a tuple indexed by the constants below; a decode page is ``(owner, writer)`` (-1: free /
never written); a prefill page is ``(holders, cached_ns, writer)`` (a bit per holding request, the
namespace whose radix cache keeps it sealed or -1). Each pool's free list is kept in the order its reuse
policy hands pages out (sorted for ``lowest`` and ``any``, a stack for ``lifo``).

Symmetry: requests with the same static attributes are interchangeable, and under ``any`` reuse so are
pages; :func:`canonical` renames both so that states equal up to renaming are stored once.
"""

from __future__ import annotations

from typing import NamedTuple

# request fields
TENANT, LONG, P, D, ABORT, PA, REJ, NSEND, CHUNKS, DPAGES, PPAGES, HIT, NOTE, RESP = range(14)
# prefill stages
P_NEW, P_QUEUED, P_FORWARDED, P_SENDING, P_SENT, P_STOPPED = 0, 1, 2, 3, 4, 9
# decode stages
D_NONE, D_WAITING, D_RUNNING, D_READ, D_FINISHED, D_ABORT_WAIT, D_RELEASED, D_QUARANTINE, D_REFUSED = (
    0,
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    9,
)
D_ASKED = 8  # the router asked decode to reserve (the request is in decode's queue)
D_HOLDING = (D_WAITING, D_RUNNING, D_READ, D_ABORT_WAIT, D_QUARANTINE)
# one-sided write of one chunk: not posted, posted, complete at the sender, visible at decode
W_NONE, W_POSTED, W_COMPLETE, W_VISIBLE = 0, 1, 2, 3
# prefill -> decode message after the writes: none, transfer done, transfer failed, abort drained (ack)
N_NONE, N_DONE, N_FAILED, N_ACK = 0, 1, 2, 3
# the client's answer: none yet, 2xx with output, an error
R_NONE, R_OK, R_ERROR = 0, 1, 2
TENANTS = ("tenant-a", "tenant-b")


class State(NamedTuple):
    reqs: tuple
    dpool: tuple  # (owner, writer, late) per decode page
    dfree: tuple
    ppool: tuple  # (holders bitmask, cached namespace, writer) per prefill page
    pfree: tuple


def request_mix(num_requests: int) -> list[tuple[int, bool]]:
    """(tenant, is_long) per request: the last one's prompt is over the prefill pool (tenant b); the
    others fit, two by two per tenant starting with a, so a tenant's requests can share a prefix."""
    mix = [((i // 2) % 2, False) for i in range(num_requests - 1)]
    return mix + [(1, True)]


def initial(num_requests: int, num_pages: int, num_chunks: int) -> State:
    reqs = tuple(
        (tenant, is_long, P_NEW, D_NONE, 0, 0, 0, 0, (W_NONE,) * num_chunks, (), (), 0, N_NONE, R_NONE)
        for tenant, is_long in request_mix(num_requests)
    )
    pages = tuple(range(num_pages))
    return State(tuple(sorted(reqs)), ((-1, -1, 0),) * num_pages, pages, ((0, -1, -1),) * num_pages, pages)


def _req_key(r: tuple) -> tuple:
    return r[:DPAGES] + (len(r[DPAGES]), len(r[PPAGES])) + r[HIT:]


def canonical(s: State, page_symmetry: bool) -> State:
    """The representative of ``s`` under renaming requests (and pages, with ``page_symmetry``)."""
    reqs = s.reqs
    n = len(reqs)
    keys = [_req_key(r) for r in reqs]
    order = sorted(range(n), key=keys.__getitem__)
    same_reqs = order == list(range(n))
    rmap = [0] * n
    for new, old in enumerate(order):
        rmap[old] = new
    dmap: list[int] | None = None
    pmap: list[int] | None = None
    if page_symmetry:
        dmap = _page_map(len(s.dpool), (reqs[i][DPAGES] for i in order), s.dpool, rmap, 1)
        pmap = _page_map(len(s.ppool), (reqs[i][PPAGES] for i in order), s.ppool, rmap, 2)
        if dmap == sorted(dmap):
            dmap = None  # already named canonically
        if pmap == sorted(pmap):
            pmap = None
    if same_reqs and dmap is None and pmap is None:
        return s
    new_reqs = []
    for old in order:
        r = reqs[old]
        dp, pp = r[DPAGES], r[PPAGES]
        if dmap is not None and dp:
            dp = tuple(dmap[p] for p in dp)
        if pmap is not None and pp:
            pp = tuple(pmap[p] for p in pp)
        new_reqs.append(r[:DPAGES] + (dp, pp) + r[HIT:])
    if same_reqs:
        dpool, ppool = list(s.dpool), list(s.ppool)
    else:
        dpool = [((rmap[o] if o >= 0 else -1), (rmap[w] if w >= 0 else -1), late) for o, w, late in s.dpool]
        ppool = [(_remap_mask(h, rmap), ns, (rmap[w] if w >= 0 else -1)) for h, ns, w in s.ppool]
    dfree, pfree = s.dfree, s.pfree
    if dmap is not None:
        dpool = _permute(dpool, dmap)
        dfree = tuple(sorted(dmap[p] for p in dfree))
    if pmap is not None:
        ppool = _permute(ppool, pmap)
        pfree = tuple(sorted(pmap[p] for p in pfree))
    return State(tuple(new_reqs), tuple(dpool), dfree, tuple(ppool), pfree)


def _remap_mask(mask: int, rmap: list[int]) -> int:
    out = 0
    i = 0
    while mask:
        if mask & 1:
            out |= 1 << rmap[i]
        mask >>= 1
        i += 1
    return out


def _page_map(num_pages: int, tables, pool: tuple, rmap: list[int], writer_at: int) -> list[int]:
    """New page names: pages in the order the (renamed) requests' tables name them, the rest by state."""
    pmap = [-1] * num_pages
    nxt = 0
    for table in tables:
        for p in table:
            if pmap[p] < 0:
                pmap[p] = nxt
                nxt += 1

    def key(p: int) -> tuple:
        page = pool[p]
        w = page[writer_at]
        if writer_at == 1:  # a decode page: owner, late flag
            return (rmap[w] if w >= 0 else -1, rmap[page[0]] if page[0] >= 0 else -1, page[2])
        return (rmap[w] if w >= 0 else -1, _remap_mask(page[0], rmap), page[1])  # prefill: holders, namespace

    for p in sorted((p for p in range(num_pages) if pmap[p] < 0), key=key):
        pmap[p] = nxt
        nxt += 1
    return pmap


def _permute(pool: list, pmap: list[int]) -> list:
    out = [None] * len(pool)
    for old, new in enumerate(pmap):
        out[new] = pool[old]
    return out


def request_name(i: int) -> str:
    return f"r{i}"


def is_quiescent(s: State) -> bool:
    """Every request answered, no page held, no write in flight: the run is over."""
    for r in s.reqs:
        if r[RESP] == R_NONE or r[D] in D_HOLDING or r[D] == D_ASKED or r[P] in (P_QUEUED, P_FORWARDED, P_SENDING):
            return False
        if W_POSTED in r[CHUNKS] or W_COMPLETE in r[CHUNKS]:
            return False
    return True
